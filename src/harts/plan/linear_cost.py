"""What a linear-attention plan costs: the plan modes and the cost model the planners choose by.

Both kinds of plan are costed in the same unit (microseconds of forward + backward through the
plain-PyTorch kernels), so :func:`harts.plan.linear.plan_linear` can weigh a plan of calls
(:mod:`harts.plan.linear`) against the one-call chunk tree (:mod:`harts.plan.chunk_tree`):

- a **call** of W segments padded to T tokens, run with chunk C (N = ceil(T / C) chunks), costs
  ``W N C (slot_cost + slot_cost_per_chunk C)`` for its token slots (padding included; the
  intra-chunk work per slot grows with C), ``segment_chunk_cost W N`` for the per-chunk state
  products, ``step_cost N`` for the chunk-after-chunk recurrence (a Python step each),
  ``boundary_cost C W S`` for S emitted inner states (each replays part of a chunk) and
  ``call_cost`` for gathers, set-up and launches;
- the **chunk tree** of M chunks of C slots whose scan takes L sequential levels costs
  ``M C (tree_slot_cost + tree_slot_cost_per_chunk C) + tree_chunk_cost M + tree_step_cost L +
  tree_call_cost``.

Defaults: a least-squares fit (relative error) of measured fwd + bwd times of the delta rule on a
2-core CPU at 2 threads, H = 4, K = V = 32: single calls over W in 1-64, T in 16-1024, C in 8-64,
whole plans of calls and chunk trees (C in 8-64) of the benchmark's forest shapes, tree and
flat. ``python -m harts.bench.fit_linear_cost`` measures and fits both halves and prints the fields; its
median relative error was 13% for calls and 11% for chunk trees. (The fit predates the factored
intra-chunk scores of :mod:`harts.ops.chunked.scores`; a refit on them moved whole steps within
noise and raised one tensor peak against flat's, so it was not adopted: docs/benchmarks.md.) On
a GPU slots are nearly free until the device is full and calls and steps dominate: refit there
before trusting AUTO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["LinearCostModel", "PlanMode"]


class PlanMode(StrEnum):
    """How :func:`harts.plan.linear.plan_linear` cuts a forest into calls."""

    AUTO = "auto"  # the cheapest of DEPTH, CHAIN (any call budget) and TREE under the cost model
    DEPTH = "depth"  # one call per depth level, one node per segment
    CHAIN = "chain"  # fewest calls: heavy-child chains, Horton-Strahler order
    TREE = "tree"  # one call: every node cut into chunks, chained down the chunk tree
    PACKED = "packed"  # one call: the token order cut into chunks that span nodes (no per-node padding)


@dataclass(frozen=True)
class LinearCostModel:
    """Estimated time (microseconds) of a linear-attention plan, fwd + bwd (module docstring).

    :meth:`chunk_for` picks a call's chunk (a power of two in ``chunk_sizes``): long single
    segments want fewer steps, wide calls of short segments less padding and intra-chunk work.
    :meth:`chunk_tree` costs a chunk tree from its shape; AUTO takes it over the best plan of calls
    when it costs at most ``chunk_tree_margin`` times as much (the fit's median error is 11-13%,
    so closer estimates do not tell the two apart, and then the plan of calls, what a flat
    trainer's kernels run, is kept); ``consider_chunk_tree=False`` keeps AUTO to plans of calls
    (a backend whose kernels run calls only, say).
    """

    chunk_sizes: tuple[int, ...] = (8, 16, 32, 64)
    slot_cost: float = 9.99
    slot_cost_per_chunk: float = 0.295
    segment_chunk_cost: float = 52.8
    step_cost: float = 228.0
    boundary_cost: float = 1.02
    call_cost: float = 2920.0
    tree_slot_cost: float = 11.8
    tree_slot_cost_per_chunk: float = 0.172
    tree_chunk_cost: float = 57.7
    tree_step_cost: float = 0.0
    tree_call_cost: float = 3270.0
    consider_chunk_tree: bool = True
    chunk_tree_margin: float = 0.85

    #: the fields the terms of a call and of a chunk tree are weighted by, in the terms' order
    CALL_FIELDS = (
        "slot_cost",
        "slot_cost_per_chunk",
        "segment_chunk_cost",
        "step_cost",
        "boundary_cost",
        "call_cost",
    )
    TREE_FIELDS = (
        "tree_slot_cost",
        "tree_slot_cost_per_chunk",
        "tree_chunk_cost",
        "tree_step_cost",
        "tree_call_cost",
    )

    @staticmethod
    def call_terms(w: int, t: int, s: int, chunk_size: int) -> tuple[float, ...]:
        """What a call of W segments, T tokens, S boundaries at chunk C is made of (CALL_FIELDS order):
        slots, slots x C, segment-chunks, chunk steps, replayed boundary slots, one call."""
        c = chunk_size
        steps = max(1, math.ceil(t / c))
        slots = w * steps * c
        return (slots, slots * c, w * steps, steps, c * w * s, 1)

    @staticmethod
    def tree_terms(chunks: int, levels: int, chunk_size: int) -> tuple[float, ...]:
        """What a chunk tree is made of (TREE_FIELDS order): slots, slots x C, chunks, levels, one call."""
        slots = chunks * chunk_size
        return (slots, slots * chunk_size, chunks, levels, 1)

    def _weigh(self, fields: tuple[str, ...], terms: tuple[float, ...]) -> float:
        return sum(getattr(self, f) * x for f, x in zip(fields, terms, strict=True))

    def shape(self, w: int, t: int, s: int = 0, chunk_size: int | None = None) -> float:
        """Cost of one call of W segments, T tokens, S inner boundaries (best chunk if None)."""
        c = chunk_size or self.chunk_for(w, t, s)
        return self._weigh(self.CALL_FIELDS, self.call_terms(w, t, s, c))

    def chunk_for(self, w: int, t: int, s: int = 0) -> int:
        """The cheapest chunk for a call of W segments, T tokens, S boundaries (ties: the larger)."""
        return min(self.chunk_sizes, key=lambda c: (self.shape(w, t, s, c), -c))

    def chunk_tree(self, chunks: int, levels: int, chunk_size: int) -> float:
        """Cost of a chunk tree of ``chunks`` chunks of ``chunk_size`` slots and ``levels`` scan steps."""
        return self._weigh(self.TREE_FIELDS, self.tree_terms(chunks, levels, chunk_size))

    @property
    def max_chunk(self) -> int:
        return max(self.chunk_sizes)

    def call(self, call) -> float:
        """Cost of one :class:`~harts.plan.linear.LinearCall` (this module imports no plan)."""
        w, t = call.token_index.shape
        return self.shape(w, t, call.num_boundaries, call.chunk_size)

    def plan(self, plan) -> float:
        """Cost of a :class:`~harts.plan.linear.LinearPlan`: the sum of its calls'."""
        return float(sum(self.call(c) for c in plan.calls))
