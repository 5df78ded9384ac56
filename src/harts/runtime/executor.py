"""Run a stock Hugging Face causal LM over a forest, each unique token once.

``forward(model, forest)`` embeds the unique tokens, runs every decoder layer with the model's own
norms, MLP/MoE blocks and parameters, replaces only the token mixers by their tree-aware forms
(:mod:`harts.adapters`), applies the final norm, and returns a :class:`TreeOutput` holding the
final hidden state of every unique token. Logits are formed only on request: per trajectory, or
as log-probs of chosen targets computed once per unique predicting token, in row chunks.

``run_layout`` is the same pass over one micro-batch of a cut forest: it reads the keys/values,
conv inputs and states handed over by earlier micro-batches and returns what it hands on
(:mod:`harts.runtime.backward` drives it). Losses live in :mod:`harts.objectives`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harts.adapters import adapter_for
from harts.adapters.base import logit_softcap
from harts.forest import Forest
from harts.ops.backends import current_backend, resolve_backend, use_backend
from harts.ops.logprobs import DEFAULT_CHUNK_ROWS, head_token_logprobs, softcap_logits, token_logprobs
from harts.plan.layout import TreeLayout
from harts.runtime.config import RunConfig
from harts.runtime.handoff import LayerHandoff, MixerContext
from harts.runtime.image_inputs import check_forest_images, embed_images, rope_positions
from harts.runtime.model_checks import check_model, hooked, resolve_model
from harts.runtime.routing_replay import PartRoutes, check_routes
from harts.runtime.sharded import PartSegments, ShardedStep

__all__ = [
    "forward",
    "TreeOutput",
    "run_layout",
    "check_inputs",
    "model_device",
    "layout_for",
    "row_logprobs",
    "run_backend",
    "check_targets",
    "plain_linear_head",
    "resolve_model",
]


class TreeOutput:
    """Final hidden states of a forest's unique tokens, and the model head to read them.

    - ``hidden_states`` [N, D]: after the model's final norm, in the forest's token order.
    - ``softcap``: the final logit soft-cap the stock forward applies after the head (Gemma's
      ``final_logit_softcapping``), or None; every reader here applies it, as the stock logits have it.
    """

    def __init__(
        self,
        hidden_states: torch.Tensor,
        forest: Forest,
        lm_head: nn.Module,
        layout: TreeLayout,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        *,
        softcap: float | None,
    ):
        self.hidden_states = hidden_states
        self.forest = forest
        self.lm_head = lm_head
        self.layout = layout
        self.chunk_rows = chunk_rows
        self.softcap = softcap

    def trajectory_logits(self, i: int) -> torch.Tensor:
        """[len_i, vocab] logits of trajectory ``i``, equal to the stock forward of that trajectory alone
        (soft-capped where the stock forward caps them)."""
        idx = self.forest.trajectory_token_indices(i).to(self.hidden_states.device)
        return softcap_logits(self.lm_head(self.hidden_states[idx]), self.softcap)

    def trajectory_logprobs(
        self, i: int, chunk_rows: int | None = None, temperature: float = 1.0
    ) -> torch.Tensor:
        """[len_i - 1] log-prob of each next token of trajectory ``i`` (position p predicted by p - 1),
        under ``softmax(logits / temperature)``."""
        idx = self.forest.trajectory_token_indices(i)
        targets = self.forest.tokens[idx[1:]]
        logp, _ = self.logprobs(idx[:-1], targets, chunk_rows=chunk_rows, temperature=temperature)
        return logp

    def all_trajectory_logprobs(
        self, chunk_rows: int | None = None, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Next-token log-probs of every trajectory, [len_i - 1] each, from one pass over the head.

        Shared predicting positions are read once: prefer this to calling
        :meth:`trajectory_logprobs` per trajectory, which recomputes shared prefixes.
        """
        f = self.forest
        indices = [f.trajectory_token_indices(i) for i in range(f.num_trajectories)]
        predictor = torch.cat([idx[:-1] for idx in indices])
        target = f.tokens[torch.cat([idx[1:] for idx in indices])]
        logp, _ = self.logprobs(predictor, target, chunk_rows=chunk_rows, temperature=temperature)
        return list(torch.split(logp, [idx.numel() - 1 for idx in indices]))

    def logprobs(
        self,
        predictor: torch.Tensor,
        target: torch.Tensor,
        chunk_rows: int | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob [R], entropy [R]) for rows given by unique predicting index and target id.

        The softmax normaliser and the entropy are computed once per distinct predictor and only
        for predictors that have rows, ``chunk_rows`` at a time, so no [N, vocab] tensor is formed.
        ``temperature`` T: log-probs and entropies of ``softmax(logits / T)``.
        """
        device = self.hidden_states.device
        predictor, target = predictor.to(device), target.to(device)
        check_targets(target, self.lm_head)
        return row_logprobs(
            self.lm_head,
            self.hidden_states,
            predictor,
            target,
            chunk_rows or self.chunk_rows,
            temperature,
            softcap=self.softcap,
        )


def plain_linear_head(head: nn.Module) -> bool:
    """True for a bare ``nn.Linear`` without hooks: its weight can be read directly."""
    return type(head) is nn.Linear and not hooked(head)


def head_vocab_size(head: nn.Module) -> int | None:
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def check_targets(target: torch.Tensor, head: nn.Module) -> None:
    """ValueError naming the first row whose target id lies outside the head's vocabulary."""
    vocab = head_vocab_size(head)
    if vocab is None or not target.numel():
        return
    bad = (target < 0) | (target >= vocab)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"row {row}: target token id {int(target[row])} is outside the model's vocabulary "
            f"(vocab_size={vocab})"
        )


def row_logprobs(
    head: nn.Module,
    hidden,
    predictor,
    target,
    chunk_rows: int,
    temperature: float = 1.0,
    *,
    softcap: float | None,
):
    """(logprob [R], entropy [R]) of rows (predicting index into ``hidden`` [N, D], target id).

    The softmax runs once per distinct predictor. A plain linear head takes the chunked path that
    reads its weight; any other head (LoRA, hooks, quantised, wrapped) is called as a module.
    ``softcap``: the model's final logit soft-cap (:func:`harts.adapters.base.logit_softcap`),
    applied before the temperature as the stock logits have it; a required keyword, so that no
    reader of the head can leave it out.
    """
    unique, inverse = torch.unique(predictor, return_inverse=True)
    if plain_linear_head(head):
        return token_logprobs(
            hidden[unique],
            head.weight,
            inverse,
            target,
            bias=head.bias,
            chunk_rows=chunk_rows,
            temperature=temperature,
            softcap=softcap,
        )
    return head_token_logprobs(hidden[unique], head, inverse, target, chunk_rows, temperature, softcap)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def check_inputs(model: nn.Module, forest: Forest) -> None:
    """Raise before any compute for an unsupported model or setup, or a token id outside the vocabulary."""
    check_model(model)
    if not isinstance(forest, Forest):
        raise TypeError(f"expected a harts Forest (see harts.build_forest), got {type(forest).__name__}")
    forest.check_vocabulary(model.config.vocab_size)
    check_forest_images(model, forest)
    check_routes(model, forest)


def run_layout(
    model: nn.Module,
    layout: TreeLayout,
    external: list[LayerHandoff] | None = None,
    recompute_linear: bool = False,
    sharded: ShardedStep | None = None,
    segments: PartSegments | None = None,
) -> tuple[torch.Tensor, list[LayerHandoff]]:
    """Final hidden states [n, D] of the layout's tokens, and what each layer hands on.

    ``recompute_linear``: linear-attention calls save only their inputs and run again in backward.
    ``sharded``: an FSDP2 step that gathers each decoder layer's unit around the layer; with
    ``segments`` the graph is cut at every layer and the pieces recorded there, for the step's
    layer-by-layer backward (:mod:`harts.runtime.sharded`).
    """
    adapter = adapter_for(model)
    backbone = adapter.backbone(model)
    layers = backbone.layers[: model.config.num_hidden_layers]
    mixers = [adapter.mixer(layer, adapter.layer_type(model, i)) for i, layer in enumerate(layers)]
    hidden = embed_images(model, layout, adapter.embedding(backbone)(layout.tokens)[None])  # [1, n, D]
    if sharded is not None:
        hidden = sharded.embedded(hidden, segments)
    rotary = adapter.rotary(backbone)
    position_embeddings = rotary(hidden, rope_positions(layout)) if rotary is not None else None
    rotary_at = (lambda positions: rotary(hidden, positions)) if rotary is not None else None  # noqa: E731
    ctx = MixerContext(layout, position_embeddings, external, recompute_linear, rotary_at)
    routes = layout.global_forest.routed_experts
    replay = (
        None
        if routes is None
        else PartRoutes(model, layout.global_forest, layout.global_tokens, hidden.device)
    )

    def mlp(layer, x):
        out = layer.mlp(x)
        return out[0] if isinstance(out, tuple) else out

    def block(hidden, index, layer, module, mixer):
        ctx.begin_layer(index)  # idempotent: a checkpoint's replay in backward records nothing twice
        # the family's norm placement (pre-norm, post-norm, sandwich) around the tree mixer
        with contextlib.nullcontext() if replay is None else replay.around(index):  # recorded MoE routes
            return adapter.decoder_block(
                layer, hidden, lambda x: mixer(module, x, ctx), lambda x: mlp(layer, x)
            )

    for index, (layer, (module, mixer)) in enumerate(zip(layers, mixers, strict=True)):
        if checkpointed(model, layer):
            # The model's gradient-checkpointing flag, honoured per decoder layer. Non-reentrant, so
            # what the layer hands to later micro-batches (computed inside) keeps its gradient.
            run = functools.partial(
                checkpoint, block, index=index, layer=layer, module=module, mixer=mixer, use_reentrant=False
            )
        else:
            run = functools.partial(block, index=index, layer=layer, module=module, mixer=mixer)
        hidden = run(hidden) if sharded is None else sharded.layer(index, run, hidden, segments)
    if sharded is not None:
        hidden = sharded.top(hidden, segments)
    return adapter.final_norm(backbone)(hidden)[0], ctx.exports


def checkpointed(model: nn.Module, layer: nn.Module) -> bool:
    """Whether stock training would checkpoint ``layer``: its flag is set, the model is in train
    mode, and a graph is being built."""
    return (
        bool(getattr(layer, "gradient_checkpointing", False)) and model.training and torch.is_grad_enabled()
    )


def run_backend(run: RunConfig, model: nn.Module):
    """The context that runs ``model``'s kernels on ``run.backend`` (resolved on the model's device,
    :func:`harts.ops.backends.resolve_backend`). Kernels are chosen at forward time, and a recomputed
    call in backward reuses the one its forward chose."""
    return use_backend(resolve_backend(run.backend, model_device(model))[0])


def layout_for(forest: Forest, device, run: RunConfig, part=None) -> TreeLayout:
    """The layout of ``forest`` (or of one ``part`` of it) with ``run``'s planning knobs.

    Under a device backend (``fla``), whose kernels run plans of calls, AUTO leaves the chunk
    tree (plain PyTorch) out.
    """
    cost = run.cost_model
    if cost.consider_chunk_tree and current_backend().name != "torch":
        cost = dataclasses.replace(cost, consider_chunk_tree=False)
    return TreeLayout(forest, device, part, linear_mode=run.linear_plan, cost_model=cost)


def forward(model: nn.Module, forest: Forest, run: RunConfig | None = None) -> TreeOutput:
    """Run ``model`` (a supported ``*ForCausalLM``) over every unique token of ``forest`` once.

    The whole forest is one micro-batch, and its output holds every unique token's final hidden
    state, so ``run.budget_tokens`` must be None, with autograd or without: log-probs without
    autograd under a budget (the old-policy and reference passes) come from
    :func:`harts.forest_logprobs`, training under one from :func:`harts.forest_backward` or
    :func:`harts.rollout_step`. ``run`` supplies the linear plan, cost model, head chunk and
    recompute settings. Raises ValueError before any compute for an unsupported model or a token
    id outside the model's vocabulary (naming the trajectory and position).
    """
    run = RunConfig.resolve(run)
    if run.budget_tokens is not None:
        raise ValueError(
            "harts.forward runs the whole forest at once and returns every unique token's hidden state; "
            "for log-probs without autograd under a token budget (old-policy, reference) use "
            "harts.forest_logprobs; to train under one use "
            "harts.forest_backward or harts.rollout_step, which run each part's backward in turn"
        )
    model = resolve_model(model)
    check_inputs(model, forest)
    if not hasattr(model, "lm_head"):
        raise ValueError(
            f"harts.forward reads a causal LM's lm_head; {type(model).__name__} has none: a critic's values "
            f"come from harts.forward_values, a reward model's scores from harts.score"
        )
    with run_backend(run, model):
        layout = layout_for(forest, model_device(model), run)
        hidden, _ = run_layout(model, layout, recompute_linear=run.recompute_linear)
    return TreeOutput(hidden, forest, model.lm_head, layout, run.chunk_rows, softcap=logit_softcap(model))
