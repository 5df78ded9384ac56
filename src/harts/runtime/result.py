"""What a step returns: :class:`StepResult`, built here and only here.

A step's result is a composition of four parts, each typed and frozen:

- :class:`StepLoss`: the detached loss, its metrics and the MoE statistics;
- :class:`RowValues`: the per-row values (log-probs and entropies, or a critic's values), which rows
  they are, and where those rows sat in the caller's batch;
- :class:`StepPlan`: what the plan did (layouts, micro-batches, the parts run twice, the schedule);
- ``timings``: seconds in ``plan``, ``handoff`` and ``total``.

Every field a caller reads is also a property of :class:`StepResult` itself (``result.loss``,
``result.logprob``, ``result.recomputed_parts``...). The layers above the runtime add to a result
(the rows, the MoE statistics, metrics summed over ranks, the batch layout) by building a new one
with :func:`replace_result`, never by assigning to it, so a result never changes once returned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from harts.batch_positions import BatchLayout
from harts.plan.layout import TreeLayout
from harts.plan.schedule import Schedule

__all__ = [
    "StepResult",
    "StepLoss",
    "RowValues",
    "StepPlan",
    "RowPositions",
    "RoutingStats",
    "step_result",
    "replace_result",
]

Tensor = torch.Tensor


class RowPositions(Protocol):
    """Which trajectory and position each row belongs to: what a result reads of its rows
    (:class:`harts.LossRows`, the objectives' rows, which the runtime does not import)."""

    @property
    def trajectory(self) -> Tensor: ...

    @property
    def position(self) -> Tensor: ...


class RoutingStats(Protocol):
    """A step's routing statistics (:class:`harts.MoEStats`, which the runtime does not import)."""

    @property
    def layers(self) -> tuple[int, ...]: ...

    @property
    def expert_counts(self) -> Tensor: ...

    @property
    def tokens(self) -> Tensor: ...

    @property
    def aux_loss(self) -> Tensor | None: ...


@dataclass(frozen=True, eq=False)
class StepLoss:
    """The step's loss, detached 0-dim (with every term the step added, e.g. MoE aux); ``metrics``,
    detached 0-dim tensors; ``moe``, the step's routing statistics when asked for."""

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    moe: RoutingStats | None = None


@dataclass(frozen=True, eq=False)
class RowValues:
    """Per row [R], detached: ``logprob`` and ``entropy`` (a readout's two quantities); ``value``,
    a critic's values; ``rows``, which trajectory and position each row belongs to; ``batch_layout``,
    where each trajectory sat in the padded or packed batch the rollouts came from."""

    logprob: Tensor
    entropy: Tensor
    value: Tensor | None = None
    rows: RowPositions | None = None
    batch_layout: BatchLayout | None = None


@dataclass(frozen=True, eq=False)
class StepPlan:
    """What the plan did: ``layouts`` and ``tokens_per_micro_batch`` of the micro-batches (parts),
    ``num_cuts`` (parts reading context from an earlier part), ``part_forwards`` (forwards of parts
    run), ``recomputed_parts`` (the parts run forward twice), ``peak_held_tokens`` (the most tokens
    of graphs alive while another part ran forward) and the ``schedule`` the step ran."""

    layouts: list[TreeLayout]
    tokens_per_micro_batch: list[int]
    num_cuts: int = 0
    part_forwards: int = 0
    recomputed_parts: tuple[int, ...] = ()
    peak_held_tokens: int = 0
    schedule: Schedule | None = None

    @property
    def num_micro_batches(self) -> int:
        return len(self.tokens_per_micro_batch)


@dataclass(frozen=True, eq=False)
class StepResult:
    """What a step returns.

    - ``loss``: detached 0-dim, the step's loss (with every term the step added, e.g. MoE aux).
    - ``metrics``: detached 0-dim tensors (``compute_loss``'s for :func:`harts.rollout_step`, the
      loss function's own when it returns ``(loss, metrics)``).
    - ``moe``: :class:`~harts.objectives.moe.MoEStats` of the step when MoE statistics were asked for.
    - ``logprob`` / ``entropy`` [R]: detached, per row.
    - ``num_micro_batches``, ``num_cuts`` (parts reading context from an earlier part),
      ``tokens_per_micro_batch``, ``layouts`` (plans, calls per linear layer, padding).
    - ``timings``: seconds spent in ``plan`` (micro-batches, layouts, attention/linear/conv plans),
      ``handoff`` (gathering handed-over rows and routing their gradients back) and ``total``.
    - ``rows``: the :class:`~harts.objectives.rows.LossRows` of a :func:`harts.rollout_step`
      (which trajectory and position each entry of ``logprob`` belongs to), else None.
    - ``part_forwards``: forwards of micro-batches the step ran: one per micro-batch that ran
      forward and backward once, two for one that ran without autograd first and again in backward,
      so ``part_forwards == num_micro_batches + len(recomputed_parts)`` for a step of
      :func:`harts.forest_backward`.
    - ``recomputed_parts``: the indices (into ``layouts``, in plan order) of the micro-batches
      that ran forward twice: under a per-row loss, the parts later parts read whose graphs were
      not held (``RunConfig.hold_tokens``); under the three passes, every part they ran but the
      last of them (all of a step's parts but its last, or, under a per-trajectory loss, the
      parts of cut trees but the last of those). Empty when every part ran forward once.
    - ``peak_held_tokens``: the most tokens of graphs the step kept alive while another part ran
      forward (within ``RunConfig.hold_limit``); ``schedule``: the
      :class:`~harts.plan.schedule.Schedule` it ran (None for a step that ran none).
    - ``value``: per row [R], detached, the critic's values of a :func:`harts.value_step` (its
      ``logprob`` holds the same values, the readout's first quantity), else None.
    - ``batch_layout``: where each trajectory sat in the padded or packed batch the rollouts came
      from (``harts.rollouts_from_batch``), else None; :meth:`to_batch` uses it.

    These are read through four typed parts: ``objective`` (:class:`StepLoss`), ``per_row``
    (:class:`RowValues`), ``plan`` (:class:`StepPlan`) and ``timings``. Build one with
    :func:`step_result`, a changed copy with :func:`replace_result`.
    """

    objective: StepLoss
    per_row: RowValues
    plan: StepPlan
    timings: dict[str, float] = field(default_factory=dict)

    # ---- the loss part
    @property
    def loss(self) -> Tensor:
        return self.objective.loss

    @property
    def metrics(self) -> dict[str, Tensor]:
        return self.objective.metrics

    @property
    def moe(self) -> RoutingStats | None:
        return self.objective.moe

    # ---- the per-row part
    @property
    def logprob(self) -> Tensor:
        return self.per_row.logprob

    @property
    def entropy(self) -> Tensor:
        return self.per_row.entropy

    @property
    def value(self) -> Tensor | None:
        return self.per_row.value

    @property
    def rows(self) -> RowPositions | None:
        return self.per_row.rows

    @property
    def batch_layout(self) -> BatchLayout | None:
        return self.per_row.batch_layout

    # ---- the plan part
    @property
    def layouts(self) -> list[TreeLayout]:
        return self.plan.layouts

    @property
    def num_micro_batches(self) -> int:
        return self.plan.num_micro_batches

    @property
    def num_cuts(self) -> int:
        return self.plan.num_cuts

    @property
    def tokens_per_micro_batch(self) -> list[int]:
        return self.plan.tokens_per_micro_batch

    @property
    def part_forwards(self) -> int:
        return self.plan.part_forwards

    @property
    def recomputed_parts(self) -> tuple[int, ...]:
        return self.plan.recomputed_parts

    @property
    def peak_held_tokens(self) -> int:
        return self.plan.peak_held_tokens

    @property
    def schedule(self) -> Schedule | None:
        return self.plan.schedule

    def to_batch(self, values: Tensor | None = None, fill: float = 0.0) -> Tensor:
        """Per-row ``values`` (default: ``logprob``) in the caller's padded or packed layout: the
        value of trajectory b at position p where its token sat, ``fill`` elsewhere."""
        if self.rows is None or self.batch_layout is None:
            raise ValueError(
                "to_batch needs a step over rollouts made by harts.rollouts_from_batch "
                "(padded or packed input)"
            )
        values = self.logprob if values is None else values
        return self.batch_layout.scatter(values, self.rows.trajectory, self.rows.position, fill)


#: each flat name of a result -> the part holding it
_PARTS = (("objective", StepLoss), ("per_row", RowValues), ("plan", StepPlan))
_PART_OF = {f.name: part for part, kind in _PARTS for f in dataclasses.fields(kind)}


def step_result(
    loss: Tensor,
    logprob: Tensor,
    entropy: Tensor,
    *,
    layouts: list[TreeLayout],
    tokens_per_micro_batch: list[int],
    timings: dict[str, float] | None = None,
    **fields,
) -> StepResult:
    """A :class:`StepResult` from its flat fields: the loss and row values, the plan's ``layouts``
    and ``tokens_per_micro_batch``, and any other field of its parts by name (``metrics``,
    ``num_cuts``, ``part_forwards``, ``recomputed_parts``, ``rows``...)."""
    empty = StepResult(
        StepLoss(loss),
        RowValues(logprob, entropy),
        StepPlan(layouts, tokens_per_micro_batch),
        dict(timings or {}),
    )
    return replace_result(empty, **fields) if fields else empty


def replace_result(result: StepResult, **changes) -> StepResult:
    """A copy of ``result`` with the fields named in ``changes`` replaced (``dataclasses.replace`` by
    the flat names a caller reads: ``loss``, ``metrics``, ``rows``, ``batch_layout``, ``timings``...).
    How a layer above the runtime adds to a step's result."""
    by_part: dict[str, dict] = {}
    for name, value in changes.items():
        if name == "timings":
            by_part.setdefault("", {})[name] = dict(value)
        elif name in _PART_OF:
            by_part.setdefault(_PART_OF[name], {})[name] = value
        else:
            raise TypeError(f"StepResult has no field {name!r}")
    top = by_part.pop("", {})
    parts = {part: dataclasses.replace(getattr(result, part), **fields) for part, fields in by_part.items()}
    return dataclasses.replace(result, **parts, **top)
