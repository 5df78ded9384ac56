"""MoE statistics of a step, equal to the flat batch's, with or without a token budget.

:func:`moe_stats` turns what a :class:`~harts.runtime.routers.RouterRecorder` saw during one
forward into :class:`~harts.objectives.moe.MoEStats`. :class:`MoEObserver` does the same across
the micro-batches of a budgeted step: it counts each part's routing on the part's first forward
(each unique token weighted by its multiplicity), and adds to each part's backward the part's
share of the load-balancing loss, ``coef * E * sum_e f_e P_e^(part)``, with ``f`` from the whole
step (see :mod:`harts.objectives.moe`). The value and gradients equal one pass over the step.
"""

from __future__ import annotations

import torch
from torch import nn

from harts.adapters import adapter_for
from harts.adapters.base import MoEBalancing
from harts.forest import Forest
from harts.objectives.moe import (
    MoEConfig,
    MoEStats,
    aux_loss_from_sums,
    expert_counts,
    load_balancing_loss,
    routing_sums,
)
from harts.plan.layout import TreeLayout
from harts.runtime.routers import RouterRecorder, find_routers
from harts.runtime.step import PartObserver

__all__ = ["moe_stats", "resolve_aux_coef", "MoEObserver"]

Tensor = torch.Tensor


def moe_stats(recorder: RouterRecorder, weight: Forest | Tensor) -> MoEStats:
    """Statistics of what ``recorder`` saw; ``weight`` is the forest it ran (its token multiplicity
    is used) or a [N] integer weight per recorded token (a padded batch's flattened attention mask).

    The aux loss stays in the autograd graph of the recorded router logits."""
    if isinstance(weight, Forest):
        weight = weight.token_multiplicity
    counts = expert_counts(recorder.indices, weight, recorder.num_experts)
    aux = None
    if recorder.balancing is MoEBalancing.AUX_LOSS:
        aux = load_balancing_loss(recorder.logits, weight, recorder.top_k)
    return MoEStats(recorder.layers, counts, weight.to(torch.long).sum(), aux)


def resolve_aux_coef(config: MoEConfig, model: nn.Module) -> float:
    """The aux-loss coefficient of ``config`` for ``model``; raises ValueError before any compute."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"moe must be a MoEConfig or None, got {type(config).__name__}")
    find_routers(model)
    balancing = adapter_for(model).moe_balancing
    family = model.config.model_type
    coef = config.aux_loss_coef
    if coef is None:
        if balancing is not MoEBalancing.AUX_LOSS:
            return 0.0
        return float(getattr(model.config, "router_aux_loss_coef", 0.0))
    if coef > 0 and balancing is not MoEBalancing.AUX_LOSS:
        raise ValueError(
            f"{family} balances experts by router bias, not an auxiliary loss: use expert_counts and "
            f"bias_update instead of aux_loss_coef={coef}"
        )
    return float(coef)


class MoEObserver(PartObserver):
    """Routing statistics over a step's micro-batches, and each part's share of the aux loss.

    Use inside ``with recorder:``; the step calls the hooks (:class:`~harts.runtime.step.PartObserver`).
    """

    def __init__(self, recorder: RouterRecorder, aux_coef: float):
        self.recorder = recorder
        self.aux_coef = aux_coef
        self.has_aux = recorder.balancing is MoEBalancing.AUX_LOSS
        self.counts: Tensor | None = None
        self.tokens = 0
        self.routed: Tensor | None = None
        self.prob_sum: Tensor | None = None
        self.total: Tensor | None = None

    @property
    def needs_step_statistics(self) -> bool:
        """The aux term of a part needs the whole step's routing counts first; counts alone do not."""
        return self.has_aux and self.aux_coef > 0

    def before_part(self, part: int, layout: TreeLayout, first: bool) -> None:
        self.recorder.clear()

    def after_part(self, part: int, layout: TreeLayout, first: bool, grad: bool) -> Tensor | None:
        weight = layout.local.token_multiplicity.to(layout.device)
        needs_term = grad and self.has_aux and self.aux_coef > 0
        sums = None
        if self.has_aux and (first or needs_term):  # one pass over the logits serves both uses
            sums = routing_sums(self.recorder.logits, weight, self.recorder.top_k)
        if first:
            counts = expert_counts(self.recorder.indices, weight, self.recorder.num_experts)
            self.counts = counts if self.counts is None else self.counts + counts
            self.tokens += int(weight.sum())
            if sums is not None:
                routed, prob_sum, total = (t.detach() for t in sums)
                self.routed = routed if self.routed is None else self.routed + routed
                self.prob_sum = prob_sum if self.prob_sum is None else self.prob_sum + prob_sum
                self.total = total if self.total is None else self.total + total
        self.recorder.clear()
        if not needs_term:
            return None
        # f from the whole step (every part's first forward has run), P from this part only
        return self.aux_coef * aux_loss_from_sums(self.routed, sums[1], self.total)

    def stats(self) -> MoEStats:
        aux = aux_loss_from_sums(self.routed, self.prob_sum, self.total) if self.has_aux else None
        return MoEStats(self.recorder.layers, self.counts, torch.tensor(self.tokens), aux)
