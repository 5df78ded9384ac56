"""TRL's ``GRPOTrainer`` with its log-probs from harts: the prompt shared by a group's completions
(``num_generations`` of them) and any other common prefix run once in forward and backward.

A drop-in subclass: the same constructor (two keyword options added), TRL's own generation,
rewards, advantages, loss types, KL and entropy terms, logging and optimizer. What changes is
``_get_per_token_logps_and_entropies``, which TRL calls for the policy's log-probs (with autograd)
and, without it, for the old and reference log-probs: here one harts forward over the batch's
prefix-merged forest (:func:`harts.integrations.batch.batch_logprobs`) replaces the batched stock
forward over every padded row. TRL's prompt + completion batch is left-padded prompts followed by
right-padded completions, one contiguous run per row, which harts reads from the attention mask.
The values equal the stock forward of each sequence alone within fp32 rounding, and so do the
gradients TRL's loss sends back.

Refused, with an error naming the option, before the first step: models harts does not run
(:func:`harts.supported_families`), vision inputs, the MoE load-balancing loss through TRL
(``router_aux_loss_coef``; harts' own is ``harts.MoEConfig``), TRL's bf16/fp16 autocast (the
default ``bf16=True``: set ``bf16=False`` and load the model in bf16 instead), a model wrapped
for data-parallel training (DDP, FSDP, DeepSpeed: harts refuses the wrapper rather than skip its
gradient sync).

What this leaves out: generation (TRL's, unchanged: ``model.generate`` or vLLM), TRL's
``batch_size`` chunking of the log-prob forward (the whole batch is one forest, so that groups
share their prompt), and token budgets (TRL's loss needs every log-prob before its backward).
"""

from __future__ import annotations

import torch

try:
    import trl
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError("harts.integrations.trl needs TRL: pip install 'harts[trl]'") from err

from harts.adapters import supported_families
from harts.integrations.batch import batch_logprobs
from harts.runtime.config import RunConfig

__all__ = ["GRPOTrainer"]

# multimodal inputs TRL may pass; harts runs text-only causal LMs
_VISION = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "_orig_mod", base)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs and entropies come from harts' tree forward.

    Takes TRL's arguments unchanged, plus ``harts_run`` (a :class:`harts.RunConfig`: linear
    plan, head chunk; it changes time, never values; no token budget) and ``share_prefixes``
    (False runs each sequence on its own through harts: the flat baseline).
    """

    def __init__(self, *args, harts_run: RunConfig | None = None, share_prefixes: bool = True, **kwargs):
        self.harts_run = RunConfig.resolve(harts_run)
        if self.harts_run.budget_tokens is not None:
            raise ValueError(
                "harts_run.budget_tokens is not supported under TRL: TRL's loss needs every log-prob of the "
                "batch before its backward, so the batch runs as one forest (harts.integrations.batch_step "
                "for budgeted steps)"
            )
        self.share_prefixes = bool(share_prefixes)
        super().__init__(*args, **kwargs)
        family = getattr(_base_model(self.model).config, "model_type", None)
        if family not in supported_families():
            raise ValueError(
                f"harts does not run model family {family!r}; supported: {', '.join(supported_families())}"
            )
        if self.accelerator.mixed_precision != "no":
            raise ValueError(
                f"mixed precision {self.accelerator.mixed_precision!r} (GRPOConfig bf16/fp16, bf16 is TRL's "
                f"default): harts runs the model in its own dtype, not under autocast; set bf16=False and "
                f"load the model in the dtype to train in (model_init_kwargs={{'dtype': torch.bfloat16}})"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                "router_aux_loss_coef != 0: TRL's MoE load-balancing loss reads the router logits of the "
                "stock forward, which harts does not run; set router_aux_loss_coef=0.0 in GRPOConfig"
            )

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **vision,
    ):
        """(log-probs [B, K], entropies [B, K] or None, None) of the last K = ``logits_to_keep``
        columns, as TRL's own, from one harts forward over the batch's forest."""
        given = sorted(name for name, value in vision.items() if value is not None)
        if given:
            raise ValueError(f"harts runs text-only models; the batch has vision inputs {given}")
        unknown = sorted(set(vision) - set(_VISION))
        if unknown:
            raise TypeError(f"unexpected arguments {unknown} from this TRL version")
        if compute_aux_loss:
            raise ValueError(
                "the MoE load-balancing loss through TRL is not supported: set router_aux_loss_coef=0"
            )
        width = input_ids.shape[1]
        score = attention_mask.clone()
        score[:, : width - logits_to_keep] = 0  # only the completion is scored, as TRL's labels say
        out = batch_logprobs(
            model, input_ids, attention_mask, score_mask=score, temperature=self.temperature,
            share_prefixes=self.share_prefixes, run=self.harts_run,
        )  # fmt: skip
        self._harts_redundancy = out.forest.redundancy
        logps = out.logprobs[:, -logits_to_keep:]
        entropies = out.entropies[:, -logits_to_keep:] if compute_entropy else None
        return logps, entropies, None
