"""The framework-neutral batch API: an RL stack's padded or packed batch in, harts' tree step inside.

RL stacks hold a step as tensors: ``input_ids`` [B, L] with an ``attention_mask`` (left, right or
both-sided padding), or packed [T] / [1, T] with ``cu_seqlens``; a response mask; per-token
``old_log_probs``, ``ref_log_probs`` and ``advantages`` ([B] per sequence or per token). Per-token
fields may cover the whole sequence ([B, L]) or only its response, the last R columns ([B, R], the
layout verl's ``responses`` and TRL's ``completion_ids`` use). The shared prefixes are found from
the token ids themselves (:func:`harts.build_forest`); nothing needs to say which sequences share
a prompt.

- :func:`batch_logprobs`: per-token log-probs and entropies in the batch's own layout, with
  autograd: differentiate any loss of them (the stack's own) and the gradients reach the model
  as if every sequence ran alone. The hook for trainers whose loss code stays theirs (TRL, verl).
  Under ``torch.no_grad()`` it also takes a token budget (the old and reference passes in
  bounded memory).
- :func:`batch_step`: harts' whole step (forward, loss, backward under a token budget) on such a
  batch with one of the standard aggregations, returning the loss, metrics, log-probs and
  entropies in the batch's layout.
- :func:`group_advantages`: GRPO's group-normalised advantages with each stack's std convention.

Log-probs are *target-indexed*: the value at token position p is log pi(token p | tokens < p),
as HF and TRL store them (verl's engine output is predictor-indexed, shifted by one: see
``harts.integrations.verl``). Positions without a value (padding, prompt, a sequence's first
token) hold 0.

What this leaves out: critics and value heads, generation, per-token loss weights other than
0/1 masks, and data-parallel reduction (normalisers are this batch's; pass ``normalizers`` for a
step spread over several batches or ranks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch
from torch import nn

from harts.batch_positions import BatchLayout, batch_layout
from harts.forest import Forest, build_forest
from harts.objectives.losses import Aggregation, Normalizers, PolicyLossConfig, normalizers_for
from harts.objectives.rollout import BatchRollouts, Rollout
from harts.runtime.backward import StepResult
from harts.runtime.config import RunConfig
from harts.runtime.executor import forward
from harts.runtime.forward_only import forest_row_logprobs
from harts.runtime.result import replace_result
from harts.steps.policy import forest_step, step_inputs

__all__ = [
    "StdMode",
    "group_advantages",
    "BatchLogprobs",
    "batch_logprobs",
    "BatchStepResult",
    "batch_step",
    "MASK_FIELDS",
    "OLD_FIELDS",
    "REF_FIELDS",
]

Tensor = torch.Tensor

# the names stacks give the same field, in the order they are looked up
MASK_FIELDS = ("response_mask", "completion_mask", "loss_mask")
OLD_FIELDS = ("old_log_probs", "old_per_token_logps", "rollout_log_probs")
REF_FIELDS = ("ref_log_probs", "ref_log_prob", "ref_per_token_logps")


class StdMode(StrEnum):
    """The group standard deviation GRPO divides by.

    - SAMPLE: unbiased (n - 1), as verl's ``compute_grpo_outcome_advantage`` and TRL's GRPOTrainer;
    - POPULATION: biased (n), as :func:`harts.objectives.advantages.grpo_advantages`;
    - NONE: no division (Dr. GRPO; TRL's ``scale_rewards="none"``, verl's
      ``norm_adv_by_std_in_grpo=False``).
    """

    SAMPLE = "sample"
    POPULATION = "population"
    NONE = "none"


def group_advantages(rewards, group_ids, std: StdMode = StdMode.SAMPLE, eps: float = 1e-6) -> Tensor:
    """[B] advantages ``(r - mean_g) / (std_g + eps)`` of per-sequence ``rewards`` [B] in groups
    ``group_ids`` [B] (any hashables; GRPO: one group per prompt).

    ``eps`` is the stack's own (verl 1e-6, TRL 1e-4). A group of one sequence gets advantage 0
    (its reward is its mean); so does a group whose rewards are all equal.
    """
    std = StdMode(std)
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if len(group_ids) != rewards.numel():
        raise ValueError(f"group_ids has {len(group_ids)} entries for {rewards.numel()} rewards")
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"trajectory {i}: reward is {float(rewards[i])}")
    ids: dict = {}
    group = torch.tensor(
        [ids.setdefault(g.item() if isinstance(g, Tensor) else g, len(ids)) for g in group_ids],
        dtype=torch.long,
    )
    count = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, group, torch.ones_like(rewards))
    mean = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, group, rewards) / count
    centered = rewards - mean[group]
    if std is StdMode.NONE:
        return centered.float()
    sq = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, group, centered * centered)
    dof = count - 1 if std is StdMode.SAMPLE else count
    spread = torch.sqrt(sq / dof.clamp(min=1))  # a group of one: centered is 0, any std gives 0
    return (centered / (spread[group] + eps)).float()


# ---- per-token fields in the caller's layout -----------------------------------------------------
def _as_tensor(values, name: str) -> Tensor:
    if isinstance(values, Tensor):
        return values.detach() if values.requires_grad else values
    try:
        return torch.as_tensor(np.asarray(values))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a tensor or array, got {type(values).__name__} ({err})") from None


def _widen(values, name: str, shape: tuple[int, ...], fill=0) -> tuple[Tensor, int | None]:
    """``values`` in the tokens' ``shape``, and the response width R when it covered only the last
    R columns of a padded batch ([B, R] with R < L), else None."""
    values = _as_tensor(values, name)
    if tuple(values.shape) == shape:
        return values, None
    if len(shape) == 2 and values.dim() == 2 and values.shape[0] == shape[0] and values.shape[1] < shape[1]:
        width = int(values.shape[1])
        wide = torch.full(shape, fill, dtype=values.dtype, device=values.device)
        wide[:, shape[1] - width :] = values
        return wide, width
    raise ValueError(
        f"{name} has shape {tuple(values.shape)}: it must have the tokens' shape {shape}"
        + (
            f", or [B, R] = [{shape[0]}, R < {shape[1]}] for the last R columns (the response)"
            if len(shape) == 2
            else ""
        )
    )


def _scored_positions(layout: BatchLayout, mask: Tensor | None, name: str) -> list[np.ndarray]:
    """Per trajectory, the positions p >= 1 that get a value (``mask`` there, else all)."""
    if mask is None:
        return [np.arange(1, i.size) for i in layout.index]
    if mask.dtype != torch.bool:
        if (
            mask.dtype.is_floating_point
            or mask.dtype.is_complex
            or not bool(((mask == 0) | (mask == 1)).all())
        ):
            bad = ~((mask == 0) | (mask == 1))
            raise ValueError(
                f"{name} must hold 0/1 or booleans, got {mask[bad][0].item()!r} "
                f"at flat index {int(bad.reshape(-1).nonzero()[0, 0])}"
            )
        mask = mask == 1
    out = []
    for b, m in enumerate(layout.split(mask.cpu(), name)):
        m = m.numpy()
        if m.size and m[0]:
            raise ValueError(
                f"trajectory {b}, position 0: {name} is set on the first token, which nothing "
                f"predicts (a sequence needs at least one prompt token)"
            )
        out.append(np.flatnonzero(m))
    return out


@dataclass(eq=False)
class BatchLogprobs:
    """What :func:`batch_logprobs` returns. ``logprobs`` / ``entropies`` have the caller's token
    shape (with autograd when the forward kept it), values where ``mask`` is True and 0 elsewhere;
    ``forest`` is the prefix-merged batch (``forest.redundancy``: flat over unique tokens)."""

    logprobs: Tensor
    entropies: Tensor
    mask: Tensor
    forest: Forest
    layout: BatchLayout


def batch_logprobs(
    model: nn.Module,
    input_ids,
    attention_mask=None,
    *,
    cu_seqlens=None,
    position_ids=None,
    score_mask=None,
    temperature: float = 1.0,
    share_prefixes: bool = True,
    run: RunConfig | None = None,
) -> BatchLogprobs:
    """Per-token log-probs and entropies of a padded or packed batch, every shared prefix run once.

    ``score_mask`` (the tokens' shape, or [B, R] for the last R columns) says which positions get a
    value; None scores every token but each sequence's first. ``temperature`` T: of
    ``softmax(logits / T)``. The result keeps autograd (run it under ``torch.no_grad()`` for
    old or reference log-probs): a loss of it backpropagates into the model exactly as the stock
    forward of each sequence alone would. With autograd the whole batch is one forward (no token
    budget: for one, use :func:`batch_step` or :func:`harts.forest_backward`). Under
    ``torch.no_grad()`` a budget (``run.budget_tokens``) is honoured: the forest runs in
    micro-batches as the step would cut it (:func:`harts.forest_logprobs`), holding one
    micro-batch's activations at a time, and the values are those of the whole batch at once.
    """
    run = RunConfig.resolve(run)
    budgeted = run.budget_tokens is not None
    if budgeted and torch.is_grad_enabled():
        raise ValueError(
            "batch_logprobs with a token budget runs without autograd: call it under torch.no_grad() "
            "(old or reference log-probs, as harts.forest_logprobs), or train under a budget with "
            "batch_step or harts.forest_backward"
        )
    layout = batch_layout(input_ids, attention_mask, cu_seqlens, position_ids)
    shape = tuple(layout.shape)
    mask = None if score_mask is None else _widen(score_mask, "score_mask", shape)[0]
    positions = _scored_positions(layout, mask, "score_mask")
    tokens = layout.split(_as_tensor(input_ids, "input_ids").cpu(), "input_ids")
    forest = build_forest(tokens, share_prefixes=share_prefixes)
    paths = [forest.trajectory_token_indices(b) for b in range(forest.num_trajectories)]
    pos = torch.from_numpy(np.concatenate(positions).astype(np.int64)) if positions else torch.empty(0)
    trajectory = torch.repeat_interleave(
        torch.arange(len(positions)), torch.tensor([p.size for p in positions])
    )
    flat = torch.cat(paths)
    starts = torch.cumsum(torch.tensor([p.numel() for p in paths]), 0) - torch.tensor(
        [p.numel() for p in paths]
    )
    where = starts[trajectory] + pos
    predictor, target = flat[where - 1], forest.tokens[flat[where]]
    if budgeted:  # forward only, part by part; checks the model and the token ids before any compute
        rows = forest_row_logprobs(model, forest, predictor, target, run=run, temperature=temperature)
        logprob, entropy = rows.logprob, rows.entropy
    else:
        out = forward(model, forest, run)  # checks the model and the token ids before any compute
        logprob, entropy = out.logprobs(predictor, target, temperature=temperature)
    values = layout.scatter(logprob, trajectory, pos)
    scored = layout.scatter(torch.ones_like(logprob, dtype=torch.bool), trajectory, pos, fill=False)
    return BatchLogprobs(values, layout.scatter(entropy, trajectory, pos), scored, forest, layout)


# ---- the whole step ------------------------------------------------------------------------------
@dataclass(eq=False)
class BatchStepResult:
    """What :func:`batch_step` returns: the detached ``loss`` and ``metrics``; ``logprobs`` and
    ``entropies`` (detached) in the layout the response mask came in ([B, L], [B, R] or packed),
    0 off the mask; ``step``, harts' :class:`~harts.runtime.backward.StepResult` (plan, timings)."""

    loss: Tensor
    metrics: dict[str, Tensor]
    logprobs: Tensor
    entropies: Tensor
    step: StepResult


def _field(batch: Mapping, names: tuple[str, ...], required: bool = False):
    present = [n for n in names if batch.get(n) is not None]
    if len(present) > 1:
        raise ValueError(f"the batch has both {present[0]!r} and {present[1]!r}: give one of {list(names)}")
    if not present and required:
        raise ValueError(f"the batch needs one of {list(names)}")
    return batch[present[0]] if present else None


def _advantages(values, layout: BatchLayout, shape) -> list:
    """Per trajectory: its advantages, from [B] (one per sequence) or per-token values."""
    values = _as_tensor(values, "advantages")
    if values.dim() == 1 and values.numel() == layout.num_trajectories and tuple(values.shape) != shape:
        return [float(v) for v in values.double()]
    return layout.split(_widen(values, "advantages", shape)[0], "advantages")


def batch_step(
    model: nn.Module,
    batch: Mapping,
    config: PolicyLossConfig,
    *,
    loss_scale_factor: float | None = None,
    normalizers: Normalizers | None = None,
    budget_tokens: int | None = None,
    run: RunConfig | None = None,
    share_prefixes: bool = True,
) -> BatchStepResult:
    """harts' step on a padded or packed batch: forward, ``config``'s loss, backward into ``.grad``.

    ``batch`` holds ``input_ids`` and its layout (``attention_mask``, or ``cu_seqlens`` /
    ``position_ids``), a response mask (one of :data:`MASK_FIELDS`), ``advantages`` ([B] or
    per token) for a policy loss, old log-probs (one of :data:`OLD_FIELDS`) for PPO/GSPO and
    reference log-probs (:data:`REF_FIELDS`) for ``config.kl_coef > 0``. Per-token fields may be
    the response only ([B, R], the last R columns). ``config.aggregation`` is one of the standard
    modes; ``seq-mean-token-sum-norm`` divides by ``loss_scale_factor``, which defaults as in
    verl's ``agg_loss`` to the response mask's width (R for a [B, R] mask). ``normalizers``: the
    counts of a step spread over several batches (see :func:`harts.normalizers_for`); None: this
    batch is the whole step. Every budget gives the same loss and gradients.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of field names to tensors, got {type(batch).__name__}")
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"expected a PolicyLossConfig, got {type(config).__name__}")
    if batch.get("input_ids") is None:
        raise ValueError("the batch needs input_ids")
    input_ids = _as_tensor(batch["input_ids"], "input_ids")
    layout = batch_layout(
        input_ids, batch.get("attention_mask"), batch.get("cu_seqlens"), batch.get("position_ids")
    )
    shape = tuple(layout.shape)
    mask, width = _widen(_field(batch, MASK_FIELDS, required=True), "response_mask", shape)
    positions = _scored_positions(layout, mask, "response_mask")
    per_token = {
        "loss_mask": [np.isin(np.arange(i.size), p) for i, p in zip(layout.index, positions, strict=True)]
    }
    for key, names in (("rollout_logprobs", OLD_FIELDS), ("ref_logprobs", REF_FIELDS)):
        values = _field(batch, names)
        if values is not None:
            per_token[key] = layout.split(_widen(values, names[0], shape)[0].cpu(), names[0])
    if batch.get("advantages") is not None:
        per_token["advantages"] = _advantages(batch["advantages"], layout, shape)
    tokens = layout.split(input_ids.cpu(), "input_ids")
    rollouts = BatchRollouts(
        [Rollout(tokens[b], **{k: v[b] for k, v in per_token.items()}) for b in range(len(tokens))], layout
    )
    forest, rows = step_inputs(model, rollouts, share_prefixes)
    if config.aggregation is Aggregation.SEQ_MEAN_TOKEN_SUM_NORM:
        scale = loss_scale_factor if loss_scale_factor is not None else (width or shape[-1])
        normalizers = dataclasses.replace(normalizers or normalizers_for(rows), max_length=float(scale))
    elif loss_scale_factor is not None:
        raise ValueError(
            f"loss_scale_factor applies to seq-mean-token-sum-norm only, not {config.aggregation}"
        )
    result = forest_step(
        model, forest, rows, config, normalizers=normalizers, budget_tokens=budget_tokens, run=run
    )
    result = replace_result(result, batch_layout=layout)

    def back(values: Tensor) -> Tensor:
        full = layout.scatter(values.detach(), rows.trajectory, rows.position)
        return full[:, shape[1] - width :] if width is not None else full

    return BatchStepResult(result.loss, result.metrics, back(result.logprob), back(result.entropy), result)
