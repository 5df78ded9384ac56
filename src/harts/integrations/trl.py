"""TRL's ``GRPOTrainer`` with its log-probs from harts: the prompt shared by a group's completions
(``num_generations`` of them) and any other common prefix run once in forward and backward.

A drop-in subclass: the same constructor (two keyword options added), TRL's own generation,
rewards, advantages, loss types, KL and entropy terms, logging and optimizer. TRL's prompt +
completion batch is left-padded prompts followed by right-padded completions, one contiguous run
per row, which harts reads from the attention mask and runs as one prefix-merged forest. The
values equal the stock forward of each sequence alone within fp32 rounding, and so do the
gradients of TRL's loss. Two ways in:

- ``_get_per_token_logps_and_entropies``, which TRL calls for the policy's log-probs (with
  autograd) and, without it, for the old and reference log-probs: one harts forward over the
  forest (:func:`harts.integrations.batch.batch_logprobs`) replaces the batched stock forward
  over every padded row, and TRL's loss backpropagates through it. The plain single-process,
  unbudgeted step.
- ``compute_loss``, with a token budget (``harts_run.budget_tokens``) or a model that accelerate
  wrapped in DDP: harts runs the step (:func:`harts.forest_backward`) with TRL's own
  ``_compute_loss`` as the loss of its rows, so every TRL loss type, KL, entropy term and metric
  stays TRL's. The forest is cut into micro-batches under the budget (each part's forward and
  backward seeded with the gradient of TRL's loss by the rows); under DDP the step runs on the
  wrapped module and the gradients are summed over the ranks by harts
  (:func:`harts.runtime.distributed.data_parallel_step`), the loss scaled by ``1 / world size`` as
  DDP's mean would scale it. TRL's normalisers across processes (``num_items_in_batch`` for
  "dapo", "cispo", "vespo") are TRL's own. The gradients are in ``.grad`` when ``compute_loss``
  returns; it hands the Trainer a leaf holding the loss's value, whose backward reaches no
  parameter.

TRL's MoE load-balancing loss (``router_aux_loss_coef``, by default the model config's: on for
qwen3_moe, qwen3_next and the other families trained with the Switch loss): TRL adds
``router_aux_loss_coef * aux_loss / gradient_accumulation_steps`` to each micro-batch's loss,
``aux_loss`` the stock forward's ``load_balancing_loss_func`` over the padded rows with their
attention mask as the weight: a sum over the batch's tokens, which harts computes exactly from
its forest's routers, each unique token weighted by its multiplicity
(:func:`harts.objectives.load_balancing_loss`). Without harts' step TRL's backward differentiates
it; in harts' step its value is handed to TRL's loss and its gradient added part by part by
:class:`harts.steps.router_statistics.MoEObserver` with this process's routing fractions, as
TRL's (under DDP each rank's aux loss is its own micro-batch's, and the ranks' mean averages
them; harts' own ``MoEConfig`` takes the fractions of the whole step over the ranks instead). A
family balanced by router bias has no such loss and is refused with a weight set, as is a
negative weight.

Mixed precision: with ``bf16=True`` (TRL's default) accelerate wraps the prepared model's forward
in ``torch.autocast`` (bf16, CPU or CUDA); harts calls the model's modules, not that forward, so
its forward-only passes and its step enter the same autocast (``accelerator.autocast()``), and
TRL's loss runs outside it, as in stock. harts' ops take the stock ops' autocast policy
(:mod:`harts.ops.precision`): its log-probs and updates are no farther from the fp32 truth than
twice stock TRL's under the same setting plus a few bf16 roundings (tests/test_integrations_trl_bf16.py;
docs/integrations/trl.md has the figures).

Refused, with an error naming the option, before the first step: models harts does not run
(:func:`harts.supported_families`), vision inputs, ``router_aux_loss_coef`` below 0 or on a
family balanced by router bias, ``fp16=True`` (no fp16 autocast on
a CPU; on a GPU a loss scaler that harts' own backward would bypass), ``cast_lm_head_to_fp32``
under bf16 (TRL's head then runs outside autocast, harts' under it), accelerate's
FSDP, DeepSpeed and other non-DDP distributed types and ``torch.nn.DataParallel`` over several
GPUs of one process (their parameter gathering, batch splitting and gradient reduction live in
the wrapper's forward and hooks, which harts does not run); at the first step, a model sharded
with FSDP2's ``fully_shard`` and a DDP communication hook (gradient compression: harts sums the
gradients uncompressed).

What this leaves out: generation (TRL's, unchanged: ``model.generate`` or vLLM), TRL's
``batch_size`` chunking of the log-prob forward (the whole batch is one forest, so that groups
share their prompt), and a budget on the forward-only passes (the old and reference log-probs
run the batch as one forest without autograd; the budget bounds the training step).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

try:
    import trl
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError("harts.integrations.trl needs TRL: pip install 'harts[trl]'") from err

from harts.adapters import supported_families
from harts.batch_positions import batch_layout
from harts.forest import build_forest
from harts.integrations.batch import batch_logprobs
from harts.objectives.moe import MoEConfig, aux_loss_from_sums, load_balancing_loss
from harts.ops.precision import no_autocast
from harts.runtime.backward import forest_backward
from harts.runtime.config import RunConfig
from harts.runtime.distributed import data_parallel, data_parallel_step, unwrap_data_parallel
from harts.runtime.routers import RouterRecorder
from harts.steps.router_statistics import MoEObserver, resolve_aux_coef

__all__ = ["GRPOTrainer"]

Tensor = torch.Tensor

# multimodal inputs TRL may pass; harts runs text-only causal LMs
_VISION = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
# accelerate's distributed types whose model is a plain module or a DDP wrapper
_DDP_TYPES = (
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_XPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_HPU",
)


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "_orig_mod", base)


def _completion_mask(attention_mask: Tensor, logits_to_keep: int) -> Tensor:
    """The positions TRL scores: the last ``logits_to_keep`` columns where the mask is set."""
    score = attention_mask.clone()
    score[:, : attention_mask.shape[1] - logits_to_keep] = 0
    return score


class _Rows:
    """TRL's padded batch as harts' next-token rows over its prefix-merged forest, and the way back:
    row r predicts the token at (trajectory[r], position[r]) from the position before it, and
    :meth:`batch` puts row values where TRL's completion columns hold them."""

    def __init__(self, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, share_prefixes: bool):
        self.layout = batch_layout(input_ids, attention_mask)
        self.keep = logits_to_keep
        score = self.layout.split(_completion_mask(attention_mask, logits_to_keep).cpu().bool(), "mask")
        positions = [np.flatnonzero(m.numpy()) for m in score]
        if any(p.size and p[0] == 0 for p in positions):
            raise ValueError("a sequence has no prompt token: nothing predicts its first completion token")
        tokens = self.layout.split(input_ids.cpu(), "input_ids")
        self.forest = build_forest(tokens, share_prefixes=share_prefixes)
        paths = [self.forest.trajectory_token_indices(b) for b in range(self.forest.num_trajectories)]
        counts = torch.tensor([p.size for p in positions])
        self.trajectory = torch.repeat_interleave(torch.arange(len(positions)), counts)
        self.position = torch.from_numpy(np.concatenate(positions).astype(np.int64))
        lengths = torch.tensor([p.numel() for p in paths])
        where = (torch.cumsum(lengths, 0) - lengths)[self.trajectory] + self.position
        flat = torch.cat(paths)
        self.predictor = flat[where - 1]
        self.target = self.forest.tokens[flat[where]]

    def batch(self, values: Tensor) -> Tensor:
        """Row values [R] as TRL's [B, K] completion columns, 0 elsewhere (differentiable)."""
        return self.layout.scatter(values, self.trajectory, self.position)[:, -self.keep :]


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs and entropies come from harts' tree forward.

    Takes TRL's arguments unchanged, plus ``harts_run`` (a :class:`harts.RunConfig`: token
    budget, linear plan, head chunk; it changes time and memory, never values),
    ``share_prefixes`` (False runs each sequence on its own through harts: the flat baseline) and
    ``harts_verify`` (True by default: the first training step checks a sample of its batch
    against the model's stock forward on this device and dtype before computing, and raises
    :class:`harts.VerificationError` when harts is off, docs/verification.md; False skips it).
    """

    def __init__(
        self,
        *args,
        harts_run: RunConfig | None = None,
        share_prefixes: bool = True,
        harts_verify: bool = True,
        **kwargs,
    ):
        self.harts_run = RunConfig.resolve(harts_run)
        self.share_prefixes = bool(share_prefixes)
        self._verify_every_step = self.harts_run.verify  # verify=True in harts_run: every step
        self.harts_verify = bool(harts_verify) or self._verify_every_step
        self.harts_run = self.harts_run.unverified  # the check runs here, on the batch, once (or every step)
        self._harts_supplied: tuple[Tensor, Tensor, Tensor | None] | None = None
        super().__init__(*args, **kwargs)
        family = getattr(_base_model(self.model).config, "model_type", None)
        if family not in supported_families():
            raise ValueError(
                f"harts does not run model family {family!r}; supported: {', '.join(supported_families())}"
            )
        self._refuse_mixed_precision()
        if self.aux_loss_enabled:
            self._check_aux_loss()
        if self.args.n_gpu > 1:
            raise ValueError(
                f"{self.args.n_gpu} GPUs in one process (torch.nn.DataParallel, which splits the batch in "
                f"its forward): launch one process per GPU (accelerate launch, DDP) instead"
            )
        kind = getattr(self.accelerator.distributed_type, "name", str(self.accelerator.distributed_type))
        if kind not in _DDP_TYPES:
            raise ValueError(
                f"accelerate's distributed type {kind}: its parameter gathering and gradient reduction run "
                f"in the wrapper's forward and hooks, which harts does not call; harts' drop-in runs one "
                f"process or DDP (accelerate launch without an FSDP or DeepSpeed config)"
            )

    def _refuse_mixed_precision(self) -> None:
        """bf16 runs under accelerate's autocast (:meth:`_autocast`); fp16 and fp8 are refused."""
        precision = self.accelerator.mixed_precision
        if precision == "fp16":
            raise ValueError(
                "mixed precision 'fp16' (GRPOConfig fp16=True): on a CPU accelerate applies no fp16 autocast "
                "(the stock forward would run in fp32), and on a GPU it scales the loss with a GradScaler "
                "that harts' own backward (with a token budget or under DDP) would bypass; use bf16=True"
            )
        if precision not in ("no", "bf16") or (precision == "bf16" and not self.accelerator.native_amp):
            raise ValueError(
                f"mixed precision {precision!r} without torch autocast: harts' drop-in runs bf16 "
                f"through accelerate's native autocast (GRPOConfig bf16=True) or in the model's own dtype"
            )
        if precision == "bf16" and getattr(self.args, "cast_lm_head_to_fp32", False):
            raise ValueError(
                "cast_lm_head_to_fp32=True under bf16 mixed precision: TRL then runs the head in fp32 "
                "outside autocast, harts' head runs under it; set cast_lm_head_to_fp32=False"
            )

    def _check_aux_loss(self) -> None:
        """TRL's MoE load-balancing loss (``router_aux_loss_coef``, by default the model config's):
        harts computes the same Switch loss from its own routers' logits, each unique token
        weighted by its multiplicity (:func:`harts.objectives.load_balancing_loss`); a family
        balanced by router bias has no such loss, and a negative weight is refused."""
        coef = self.router_aux_loss_coef
        if not coef > 0:
            raise ValueError(
                f"router_aux_loss_coef={coef}: harts' drop-in adds TRL's MoE load-balancing loss with a "
                f"positive weight (0.0 turns it off)"
            )
        resolve_aux_coef(MoEConfig(aux_loss_coef=coef), _base_model(self.model))

    def _autocast(self):
        """The autocast accelerate wraps the prepared model's forward in (``bf16=True``: CPU or CUDA
        bf16), entered around harts' forward and step, which call the model's modules rather than its
        forward; a null context without mixed precision."""
        return self.accelerator.autocast()

    # ---- harts' step: TRL's loss inside forest_backward -------------------------------------------
    def _harts_steps(self, model) -> bool:
        """Whether harts runs the step (loss and backward): with a token budget, or a DDP model
        (whose gradient sync harts does itself)."""
        dp = data_parallel(model)
        if dp is not None and dp.kind != "ddp":
            raise ValueError(
                "the model is sharded with FSDP2 (fully_shard): TRL's forward-only passes would run it "
                "outside a sharded step; harts' drop-in runs one process or DDP"
            )
        if dp is not None and getattr(dp.wrapper, "_comm_hooks", None):
            raise ValueError(
                "the DDP model has a communication hook (accelerate's DistributedDataParallelKwargs "
                "comm_hook, or register_comm_hook): harts sums the gradients over the ranks itself, "
                "uncompressed, so the hook would not run; train without it"
            )
        return self.harts_run.budget_tokens is not None or dp is not None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss; with a budget or under DDP (see the module docstring) its gradients are
        accumulated into ``.grad`` here, and the returned leaf's backward adds nothing."""
        if self.harts_verify and torch.is_grad_enabled():
            self._verify(model, inputs)
        if not (self._harts_steps(model) and torch.is_grad_enabled()):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        return self._harts_step(model, inputs).requires_grad_()

    def _verify(self, model, inputs) -> None:
        """The batch's check against the stock forward (:mod:`harts.runtime.verify`), before its
        step, on every process on its own batch; the processes agree on the verdict first, so all
        stop together. Once, unless ``harts_run.verify`` asks for every step."""
        from harts.runtime.backward import verify_training
        from harts.runtime.executor import resolve_model
        from harts.runtime.verify import VerificationError

        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        rows = _Rows(input_ids, attention_mask, inputs["completion_ids"].size(1), self.share_prefixes)
        module = resolve_model(unwrap_data_parallel(model))
        error = None
        try:
            with self._autocast():
                verify_training(
                    module,
                    rows.forest,
                    self.harts_run,
                    self.temperature,
                    None,
                    False,
                    "TRL's GRPOTrainer step",
                )
        except VerificationError as exc:
            error = str(exc)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            found: list[str | None] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(found, error)
            error = next((e for e in found if e is not None), None)
        if error is not None:
            raise VerificationError(error)
        self.harts_verify = self._verify_every_step

    def _harts_step(self, model, inputs) -> Tensor:
        """One harts step over the batch's forest; TRL's ``_compute_loss`` is the loss of its rows
        (called once: with a budget, on every row's value from the forward-only pass). Returns the
        detached loss as TRL computed it on this process."""
        given = sorted(name for name in _VISION if inputs.get(name) is not None)
        if given:  # refused before the forward, not inside TRL's loss after it
            raise ValueError(f"harts runs text-only models; the batch has vision inputs {given}")
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        rows = _Rows(input_ids, attention_mask, completion_ids.size(1), self.share_prefixes)
        seen: dict[str, Tensor] = {}
        with data_parallel_step(model) as (module, dp):
            scale = 1.0 / dp.world_size if dp is not None else 1.0  # DDP's mean over the ranks
            observer, aux_weight = self._aux_observer(module, scale)

            def loss_fn(logprob: Tensor, entropy: Tensor) -> Tensor:
                aux = None
                if observer is not None:  # every part's first forward has run: this batch's aux loss
                    aux = aux_loss_from_sums(observer.routed, observer.prob_sum, observer.total)
                    aux = aux.detach().requires_grad_()
                self._harts_supplied = (rows.batch(logprob), rows.batch(entropy), aux)
                try:  # outside autocast, as stock TRL computes its loss from the forward's outputs
                    with no_autocast(logprob.device):
                        loss = super(GRPOTrainer, self)._compute_loss(module, inputs)
                finally:
                    self._harts_supplied = None
                if aux is not None:
                    self._check_aux_weight(loss, aux, aux_weight / scale)
                seen["loss"] = loss.detach()
                return loss * scale

            with self._autocast(), observer.recorder if observer is not None else contextlib.nullcontext():
                self._harts_result = forest_backward(
                    module,
                    rows.forest,
                    rows.predictor,
                    rows.target,
                    loss_fn,
                    run=self.harts_run,
                    observer=observer,
                    temperature=self.temperature,
                )
        self._harts_redundancy = rows.forest.redundancy
        return seen["loss"].clone()

    def _aux_observer(self, module, scale: float) -> tuple[MoEObserver | None, float]:
        """With TRL's MoE load-balancing loss: the observer that records the routers of harts' step
        and adds each part's share of the loss's gradient, and the loss's weight in the step.

        TRL adds ``router_aux_loss_coef * aux_loss / gradient_accumulation_steps`` to each
        micro-batch's loss, ``aux_loss`` the Switch loss of that micro-batch on this process (the
        stock forward's over the padded rows, its attention mask the weight). The observer's
        routing fractions are this process's (no sum over the ranks), its per-part terms carry the
        same weight times DDP's ``1 / world size``; the loss's value TRL adds itself, from the value
        :meth:`_get_per_token_logps_and_entropies` hands it."""
        if not self.aux_loss_enabled:
            return None, 0.0
        accumulation = self.current_gradient_accumulation_steps if self.model.training else 1.0
        weight = self.router_aux_loss_coef / accumulation * scale
        return MoEObserver(RouterRecorder(_base_model(module)), weight), weight

    @staticmethod
    def _check_aux_weight(loss: Tensor, aux: Tensor, weight: float) -> None:
        """TRL's loss is linear in the aux loss with the weight the observer's terms carry; a TRL
        that weighted it otherwise would get gradients of another loss, so it is refused here."""
        (got,) = torch.autograd.grad(loss, aux, retain_graph=True, allow_unused=True)
        got = 0.0 if got is None else float(got)
        if abs(got - weight) > 1e-6 * abs(weight):  # TRL's fp32 coefficient: a few 2^-24 off
            raise RuntimeError(
                f"TRL weighted the MoE aux loss by {got:.6g} in its loss, harts' step by {weight:.6g}: "
                f"this TRL version adds router_aux_loss_coef otherwise than TRL 1.16"
            )

    # ---- the log-probs TRL asks for -----------------------------------------------------------------
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
        """(log-probs [B, K], entropies [B, K] or None, aux loss or None) of the last K =
        ``logits_to_keep`` columns, as TRL's own: inside harts' step, the rows' values it supplies;
        otherwise one harts forward over the batch's forest. ``compute_aux_loss``: the MoE
        load-balancing loss of the batch (:func:`harts.objectives.load_balancing_loss` over the
        forest's routers, each unique token weighted by its multiplicity: the stock forward's
        over the padded rows with their attention mask)."""
        given = sorted(name for name, value in vision.items() if value is not None)
        if given:
            raise ValueError(f"harts runs text-only models; the batch has vision inputs {given}")
        unknown = sorted(set(vision) - set(_VISION))
        if unknown:
            raise TypeError(f"unexpected arguments {unknown} from this TRL version")
        if self._harts_supplied is not None:
            logps, entropies, aux = self._harts_supplied
            if tuple(logps.shape) != (input_ids.shape[0], logits_to_keep):
                raise ValueError(
                    f"harts' step has log-probs of shape {tuple(logps.shape)}, TRL asks for "
                    f"{(input_ids.shape[0], logits_to_keep)}"
                )
            if compute_aux_loss and aux is None:
                raise ValueError("TRL asks for the MoE aux loss, which harts' step did not record")
            return logps, entropies if compute_entropy else None, aux if compute_aux_loss else None
        if data_parallel(model) is not None:
            if torch.is_grad_enabled():
                raise ValueError(
                    "log-probs with autograd through a data-parallel model outside harts' step: its "
                    "gradient sync would not run; GRPOTrainer.compute_loss runs such steps"
                )
            model = unwrap_data_parallel(model)  # no gradients, nothing to synchronise
        # a forward-only pass (or the unbudgeted step): the whole forest at once; a budget bounds the
        # graph harts' step keeps, and these passes keep none
        run = dataclasses.replace(self.harts_run, budget_tokens=None)
        recorder = RouterRecorder(_base_model(model)) if compute_aux_loss else None
        with self._autocast(), recorder if recorder is not None else contextlib.nullcontext():
            out = batch_logprobs(
                model,
                input_ids,
                attention_mask,
                score_mask=_completion_mask(attention_mask, logits_to_keep),
                temperature=self.temperature,
                share_prefixes=self.share_prefixes,
                run=run,
            )
        self._harts_redundancy = out.forest.redundancy
        logps = out.logprobs[:, -logits_to_keep:]
        entropies = out.entropies[:, -logits_to_keep:] if compute_entropy else None
        aux = None
        if recorder is not None:  # one forward of the forest: its routers, weighted by multiplicity
            aux = load_balancing_loss(recorder.logits, out.forest.token_multiplicity, recorder.top_k)
        return logps, entropies, aux
