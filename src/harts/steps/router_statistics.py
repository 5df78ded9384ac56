"""MoE statistics of a step, equal to the flat batch's, with or without a token budget.

:func:`moe_stats` turns what a :class:`~harts.runtime.routers.RouterRecorder` saw during one
forward into :class:`~harts.objectives.moe.MoEStats`. :class:`MoEObserver` does the same across
the micro-batches of a budgeted step: it counts each part's routing on the part's first forward
(each unique token weighted by its multiplicity), and adds to each part's backward the part's
share of the load-balancing loss, ``coef * E * sum_e f_e P_e^(part)``, with ``f`` from the whole
step (see :mod:`harts.objectives.moe`). The value and gradients equal one pass over the step.

On several ranks the whole step is every rank's: before its first backward each rank sums its
routed counts and token total with the others' (``agree``: one all-reduce of ``E + 1`` fp64
numbers, exact integers), so ``f`` is the whole step's and each rank's terms are its own parts'
``P``; the ranks' terms and gradients add up to one process's. The step already runs every
part's forward before any backward when the aux loss is on (two forwards of each part but the
last), so the ranks add no pass.
"""

from __future__ import annotations

from collections.abc import Callable

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
from harts.runtime.backward import PartObserver
from harts.runtime.routers import RouterRecorder, find_routers

__all__ = ["moe_stats", "resolve_aux_coef", "MoEObserver"]

Tensor = torch.Tensor


def moe_stats(recorder: RouterRecorder, weight: Forest | Tensor) -> MoEStats:
    """Statistics of what ``recorder`` saw; ``weight`` is the forest it ran (its token multiplicity
    is used) or a [N] integer weight per recorded token (a padded batch's flattened attention mask).

    The aux loss stays in the autograd graph of the recorded router logits."""
    chosen = None
    if isinstance(weight, Forest):
        chosen = None if weight.routed_experts is None else recorder.indices  # replayed routes
        weight = weight.token_multiplicity
    counts = expert_counts(recorder.indices, weight, recorder.num_experts)
    aux = None
    if recorder.balancing is MoEBalancing.AUX_LOSS:
        aux = load_balancing_loss(recorder.logits, weight, recorder.top_k, chosen)
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

    Use inside ``with recorder:``; the step calls the hooks (:class:`~harts.runtime.backward.PartObserver`).
    """

    def __init__(
        self, recorder: RouterRecorder, aux_coef: float, agree: Callable[[Tensor], Tensor] | None = None
    ):
        self.recorder = recorder
        self.aux_coef = aux_coef
        self.has_aux = recorder.balancing is MoEBalancing.AUX_LOSS
        self.agree = agree  # sums a flat fp64 tensor over the ranks (None: one process)
        self.agreed = False
        self._inputs: list[tuple[int, Tensor]] = []
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
        logits = self.recorder.logits if self.has_aux else []
        if self.has_aux and (first or needs_term):  # one pass over the logits serves both uses
            replayed = layout.global_forest.routed_experts is not None  # count the replayed routes
            sums = routing_sums(
                logits, weight, self.recorder.top_k, self.recorder.indices if replayed else None
            )
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
        self._agree()
        self._inputs = list(zip(self.recorder.layers, logits, strict=True))
        # f from the whole step (every part's first forward has run), P from this part only
        return self.aux_coef * aux_loss_from_sums(self.routed, sums[1], self.total)

    def term_inputs(self) -> list[tuple[int, Tensor]]:
        """The router logits of each MoE layer: the aux term is softmaxes and sums of them."""
        return self._inputs

    def _agree(self) -> None:
        """The whole step's routed counts and token total: every rank's, summed once."""
        if self.agreed or self.agree is None:
            return
        both = self.agree(torch.cat([self.routed, self.total.reshape(1)]))
        self.routed, self.total = both[:-1], both[-1]
        self.agreed = True

    def whole_step_aux_loss(self, all_reduce_sum: Callable[[Tensor], Tensor]) -> Tensor:
        """The aux loss of every rank's step (detached), from the ranks' sums: call it on every rank
        once the step is done (an all-reduce of ``E`` fp64 numbers, and of ``E + 1`` more where
        the counts were not summed during the step)."""
        prob_sum = all_reduce_sum(self.prob_sum.detach().to(torch.float64))
        routed, total = self.routed, self.total
        if not self.agreed:  # the counts are still this rank's own
            both = all_reduce_sum(torch.cat([routed, total.reshape(1)]))
            routed, total = both[:-1], both[-1]
        return aux_loss_from_sums(routed, prob_sum, total).to(self.prob_sum.dtype)

    def stats(self) -> MoEStats:
        """This rank's statistics; with ``agree``, the aux loss is this rank's share of the whole
        step's (``f`` the step's, ``P`` this rank's), so the ranks' shares add up."""
        aux = aux_loss_from_sums(self.routed, self.prob_sum, self.total) if self.has_aux else None
        return MoEStats(self.recorder.layers, self.counts, torch.tensor(self.tokens), aux)
