"""The critic's objective on loss rows: PPO's clipped value loss, and how well values explain returns.

A critic row is a (trajectory, position) like a policy row (:mod:`harts.objectives.rows`): its
value ``V`` is the critic's head at the state after token ``p - 1`` (``harts.forward_values``), its
target ``R`` the return at ``p`` (``Rollout.returns``, ``rows.value_target``) and its anchor
``V_old`` the rollout-time value (``Rollout.values``, ``rows.rollout_value``). The loss is verl's
``compute_value_loss`` (after TRL's PPO trainer), per row

    l = max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)

and ``0.5 * aggregate(l)`` over the step's normalisers with the aggregations the policy losses use
(:func:`harts.objectives.losses.aggregate`): a sum of per-row terms, so any subset of rows (a
part of a cut tree) gets its exact share. ``clip=None`` drops the clipped term: ``0.5 * (V - R)^2``.

Metrics: ``value_loss``; ``value_clip_fraction``, the token mean of rows where the clipped term is
the larger (verl's ``vf_clipfrac``); ``value_mean``, the token mean of V. The explained variance
``1 - Var(R - V) / Var(R)`` over the step's rows (verl's ``vf_explained_var``) needs the whole
step's values first, so :func:`explained_variance` computes it from them afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harts.objectives.losses import Aggregation, Normalizers, aggregate
from harts.objectives.rows import LossRows, check_row_tensor

__all__ = ["ValueLossConfig", "value_loss", "clipped_value_loss", "check_value_rows", "explained_variance"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class ValueLossConfig:
    """The critic's loss: ``clip`` c (verl's ``cliprange_value``; None: unclipped) and the
    ``aggregation`` of per-row losses (names as in verl's ``loss_agg_mode``)."""

    clip: float | None = 0.5
    aggregation: Aggregation = Aggregation.TOKEN_MEAN

    def __post_init__(self):
        if self.clip is not None and not (
            isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0
        ):
            raise ValueError(f"ValueLossConfig.clip must be a finite number > 0 or None, got {self.clip!r}")
        object.__setattr__(self, "aggregation", Aggregation(self.aggregation))


def clipped_value_loss(value: Tensor, target: Tensor, old_value: Tensor | None, clip: float | None):
    """(per-row loss [R], clipped [R] bool): ``max((V - R)^2, (clip(V, V_old +- c) - R)^2)``, without
    the 0.5; ``clipped`` where the clipped term is the larger (strictly, as verl counts it)."""
    unclipped = (value - target) ** 2
    if clip is None:
        return unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (torch.clamp(value, old_value - clip, old_value + clip) - target) ** 2
    return torch.maximum(unclipped, clipped), clipped > unclipped


def value_loss(
    value: Tensor, rows: LossRows, config: ValueLossConfig, normalizers: Normalizers
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar value loss of ``rows`` and detached metrics (module docstring); ``value`` [R] with
    autograd. Every value is a sum over global normalisers, so a step's is the sum of its parts'."""
    check_row_tensor(value, rows, "value")
    check_value_rows(rows, config)
    dtype = value.dtype
    old = rows.rollout_value.to(dtype) if config.clip is not None else None
    per_row, clipped = clipped_value_loss(value, rows.value_target.to(dtype), old, config.clip)
    loss = 0.5 * aggregate(per_row, rows, config.aggregation, normalizers)
    metrics = {
        "value_loss": loss.detach(),
        "value_clip_fraction": aggregate(
            clipped.to(dtype), rows, Aggregation.TOKEN_MEAN, normalizers
        ).detach(),
        "value_mean": aggregate(value.detach(), rows, Aggregation.TOKEN_MEAN, normalizers),
        "loss": loss.detach(),
    }
    return loss, metrics


def check_value_rows(rows: LossRows, config: ValueLossConfig) -> None:
    """What the value loss reads: returns always, rollout-time values when clipping."""
    if not rows.has_value_target:
        raise ValueError("the value loss needs returns: give the rollouts returns (e.g. from GAE)")
    if config.clip is not None and not rows.has_rollout_value:
        raise ValueError(
            "a clipped value loss needs the rollout-time values: give the rollouts values "
            "(harts.forward_values) or set ValueLossConfig(clip=None)"
        )


def explained_variance(value: Tensor, target: Tensor) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over rows [R] (population variances; verl's unbiased ones give
    the same ratio). 1 for a perfect critic, 0 for a constant one at the mean; NaN when the returns
    do not vary (or there are no rows)."""
    value, target = value.detach().double(), target.detach().double()
    if value.numel() == 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    var = target.var(unbiased=False)
    return 1 - (target - value).var(unbiased=False) / var if var > 0 else torch.tensor(float("nan"))
