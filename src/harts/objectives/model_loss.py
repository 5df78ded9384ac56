"""The model glue: a forest through a stock Hugging Face model to one scalar loss.

::

    forest_loss:  harts.forward(model, forest)            hidden states of the unique tokens
                  out.logprobs(rows.predictor, rows.target)  (logprob [R], entropy [R]), softmax once
                                                             per unique predictor
                  compute_loss(...)                       scalar over the step's global normalisers
    rollout_step: validate_rollouts -> build_forest -> build_loss_rows -> forest_loss
                  (+ MoE statistics and the load-balancing loss, when asked)

Every check that can fail (annotations the objective needs, Dr. GRPO's constant, rows that do
not belong to the forest, MoE options the model cannot honour) runs before the model does.

What this leaves out: micro-batch planning (one forest per call; sum the losses of a step's
forests, built with the step's normalisers), advantage estimation (give the rollouts advantages,
or rows from ``estimate_advantages``), the backward pass and the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch import nn

from harts.executor import TreeOutput, forward
from harts.forest import Forest, build_forest
from harts.objectives.losses import (
    Aggregation,
    LossKind,
    Normalizers,
    PolicyLossConfig,
    compute_loss,
    normalizers_for,
)
from harts.objectives.moe import MoEConfig, MoEStats, RouterRecorder, moe_stats
from harts.objectives.rollout import Rollout, validate_rollouts
from harts.objectives.rows import LossRows, build_loss_rows

__all__ = ["forest_loss", "rollout_step", "RolloutStepResult"]

Tensor = torch.Tensor


def _check_inputs(
    forest: Forest, rows: LossRows, config: PolicyLossConfig, normalizers: Normalizers, old_logprob
) -> None:
    """What compute_loss would refuse after the forward, refused before it."""
    if not isinstance(forest, Forest):
        raise TypeError(f"expected a harts Forest (see harts.build_forest), got {type(forest).__name__}")
    if not isinstance(rows, LossRows):
        raise TypeError(f"expected LossRows (see build_loss_rows), got {type(rows).__name__}")
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"expected a PolicyLossConfig, got {type(config).__name__}")
    if not isinstance(normalizers, Normalizers):
        raise TypeError(f"expected Normalizers (see normalizers_for), got {type(normalizers).__name__}")
    if rows.num_trajectories != forest.num_trajectories:
        raise ValueError(
            f"the rows have {rows.num_trajectories} trajectories but the forest has {forest.num_trajectories}"
        )
    if rows.num_rows:
        index = rows.target_index.cpu()
        if int(index.max()) >= forest.num_tokens or not torch.equal(forest.tokens[index], rows.target.cpu()):
            raise ValueError("the rows were not built on this forest (build_loss_rows(forest, rollouts))")
    if old_logprob is not None and tuple(old_logprob.shape) != (rows.num_rows,):
        raise ValueError(
            f"old_logprob must have shape [R] = ({rows.num_rows},), got {tuple(old_logprob.shape)}"
        )
    if config.kind is not LossKind.SFT:
        if not rows.has_advantage:
            raise ValueError(f"{config.kind} needs advantages: give the rollouts advantages or use "
                             f"estimate_advantages")  # fmt: skip
        if old_logprob is None and not rows.has_rollout_logprob:
            raise ValueError(
                f"{config.kind} needs the behaviour policy's log-probs: give the rollouts rollout_logprobs "
                f"or pass old_logprob"
            )
    if config.kl_coef > 0 and not rows.has_ref_logprob:
        raise ValueError("kl_coef > 0 needs reference log-probs: give the rollouts ref_logprobs")
    if config.aggregation is Aggregation.SEQ_MEAN_TOKEN_SUM_NORM and normalizers.max_length is None:
        raise ValueError(
            "seq-mean-token-sum-norm needs Dr. GRPO's constant: pass normalizers_for(rows, max_length=...)"
        )


def forest_loss(
    model: nn.Module,
    forest: Forest,
    rows: LossRows,
    config: PolicyLossConfig,
    normalizers: Normalizers,
    old_logprob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor], TreeOutput]:
    """``(loss, metrics, out)`` of one forest: the model runs once per unique token.

    ``rows`` must be ``build_loss_rows(forest, rollouts)``; ``normalizers`` are the counts of the
    whole optimizer step (``normalizers_for`` over all its micro-batches), so the losses of a
    step's forests add up to the step's loss. ``old_logprob`` [R] replaces the rollout log-probs
    (see ``compute_loss``). ``loss`` is a differentiable 0-dim tensor, ``metrics`` are detached
    0-dim tensors (``compute_loss``), ``out`` is the ``TreeOutput`` (hidden states [N, D]).
    Per-row entropies are always computed (the softmax normaliser needs the same pass) and
    reported as the ``entropy`` metric.
    """
    _check_inputs(forest, rows, config, normalizers, old_logprob)
    out = forward(model, forest)
    device = out.hidden_states.device
    if rows.device != device:
        rows = rows.to(device)
    logprob, entropy = out.logprobs(rows.predictor, rows.target)
    loss, metrics = compute_loss(logprob, entropy, rows, config, normalizers, old_logprob)
    return loss, metrics, out


class RolloutStepResult(NamedTuple):
    """What :func:`rollout_step` returns.

    - ``loss``: 0-dim, differentiable: the policy loss plus ``aux_loss_coef`` times the MoE
      load-balancing loss when that applies.
    - ``metrics``: detached 0-dim tensors (``compute_loss``'s, plus ``moe_aux_loss`` when the
      family has an aux loss).
    - ``moe``: :class:`MoEStats` of the forest when ``moe`` was given, else None.
    """

    loss: Tensor
    metrics: dict[str, Tensor]
    moe: MoEStats | None


def rollout_step(
    model: nn.Module,
    rollouts: Sequence[Rollout],
    config: PolicyLossConfig,
    *,
    share_prefixes: bool = True,
    normalizers: Normalizers | None = None,
    moe: MoEConfig | None = None,
) -> RolloutStepResult:
    """Loss of a batch of rollouts trained as one forest; no backward.

    Validates the rollouts (against the model's vocabulary), the config's needs and the MoE
    options before any compute, then builds the forest (``share_prefixes=False`` gives the flat
    layout, for comparisons) and the rows, and runs :func:`forest_loss`. ``normalizers`` None
    means this batch is the whole step (``normalizers_for(rows)``; Dr. GRPO's aggregation then
    needs explicit normalisers with ``max_length``). ``moe``: record the routers, return
    :class:`MoEStats` and add the load-balancing loss (see :class:`MoEConfig`).
    """
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"expected a PolicyLossConfig, got {type(config).__name__}")
    if moe is not None and not isinstance(moe, MoEConfig):
        raise TypeError(f"moe must be a MoEConfig or None, got {type(moe).__name__}")
    checked = validate_rollouts(rollouts, vocab_size=model.config.vocab_size)
    aux_coef = moe.resolve(model) if moe is not None else 0.0
    forest = build_forest([c.tokens for c in checked], share_prefixes=share_prefixes)
    rows = build_loss_rows(forest, rollouts)
    if normalizers is None:
        normalizers = normalizers_for(rows)
    recorder = RouterRecorder(model) if moe is not None else None
    with recorder if recorder is not None else nullcontext():
        loss, metrics, _ = forest_loss(model, forest, rows, config, normalizers)
    stats = None
    if recorder is not None:
        stats = moe_stats(recorder, forest)
        if stats.aux_loss is not None:
            metrics["moe_aux_loss"] = stats.aux_loss.detach()
            if aux_coef > 0:
                loss = loss + aux_coef * stats.aux_loss.to(loss.dtype)
                metrics["loss"] = loss.detach()
    return RolloutStepResult(loss, metrics, stats)
