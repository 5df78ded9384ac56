"""What a step runs, and when: the parts' forwards, hand-overs and backwards, decided before any compute.

A step over a forest cut into micro-batches (parts) runs each part forward, hands what later parts
read over to them, and runs the backwards in an order that lets the gradients of the handed-over
tensors flow back to the parts that produced them. Which parts keep their autograd graphs, which
run forward twice, and in what order, follow from three facts alone: the parts' order, their sizes
in tokens, and which earlier parts each part reads (its *producers*). This module turns those facts
into a :class:`Schedule`, a list of typed events, with no model and no tensor in sight; the runtime
(:func:`harts.runtime.backward.run_schedule`) is one loop over the events.

The forms, by what the loss says of itself (:class:`LossForm`):

- **Depth first** (:func:`depth_first_schedule`, a loss that is a sum of per-row terms): every part
  runs forward and backward once on its own rows. A part no later part reads runs its backward
  right after its forward. A part later parts read keeps its graph until they have all sent their
  gradients back, or, where holding it would exceed the hold bound, runs without autograd first
  and again (:class:`Recompute`) when its backward is due. The walk that decides this is
  :func:`depth_first_walk`; which graphs to hold is a knapsack on the tree of graph lifetimes
  (:func:`graphs_to_hold`).
- **Three passes** (:func:`three_pass_schedule`, any loss): every part forward without autograd
  (the last with it), the loss differentiated once with respect to the rows' values
  (:class:`RowGradients`), then the backwards in reverse order, all but the last recomputed.
- **Forward only** (:func:`forward_only_schedule`, no loss): every part forward without autograd,
  what it hands on dropped once its last reader has run.

:func:`step_schedule` picks and joins them as :func:`harts.forest_backward` does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

__all__ = [
    "Walk",
    "depth_first_walk",
    "walk_holding",
    "oldest_dropped_walk",
    "graphs_to_hold",
    "reader_counts",
    "HOLD_STEPS",
    "Forward",
    "HandOver",
    "Recompute",
    "RowGradients",
    "Backward",
    "Release",
    "DropLayout",
    "Event",
    "Schedule",
    "LossForm",
    "depth_first_schedule",
    "three_pass_schedule",
    "forward_only_schedule",
    "step_schedule",
]

#: which earlier parts each part reads, by part: a mapping or a sequence indexed by part
Producers = Mapping[int, Collection[int]] | Sequence[Collection[int]]


# ---- the depth-first walk: which read parts keep their graphs -------------------------------------
class Walk(StrEnum):
    """A decision of the depth-first walk (:func:`depth_first_walk`), paired with its part."""

    RUN = "run"  # a part no later part reads: forward with autograd, its backward follows
    HOLD = "hold"  # a part later parts read, its graph kept until its backward
    PASS = "pass"  # a part later parts read, run without autograd: it runs again for its backward
    DROP = "drop"  # a held graph dropped to make room (only where lifetimes do not nest)
    AGAIN = "again"  # a part whose graph is not held runs forward again for its backward
    BACKWARD = "backward"  # the part's backward


WalkStep = tuple[Walk, int]


def depth_first_walk(
    order: Sequence[int], sizes: Sequence[int], producers: Producers, cap: int
) -> Iterator[WalkStep]:
    """The decisions of a depth-first step, from part sizes and readers alone, in order (:class:`Walk`).

    Every graph not held runs its forward again, so the walk holds the graphs that leave the fewest
    tokens to run twice while the graphs held at any moment total at most ``cap`` tokens
    (:func:`graphs_to_hold`). Where the parts' lifetimes do not nest, it falls back to holding
    each part while it fits, dropping the oldest held graphs first to make room
    (:func:`oldest_dropped_walk`)."""
    keep = graphs_to_hold(order, sizes, producers, cap)
    if keep is None:
        yield from oldest_dropped_walk(order, sizes, producers, cap)
    else:
        yield from walk_holding(order, producers, keep)


def walk_holding(
    order: Sequence[int], producers: Producers, keep: Collection[int] | None
) -> Iterator[WalkStep]:
    """The walk holding the graphs of the parts in ``keep`` (None: of every part later parts read)."""
    readers = reader_counts(order, producers)
    for p in order:
        if readers[p]:
            yield (Walk.HOLD if keep is None or p in keep else Walk.PASS), p
            continue
        yield Walk.RUN, p
        yield from _backwards_from(p, producers, readers, lambda r: keep is None or r in keep)


def reader_counts(order: Sequence[int], producers: Producers) -> dict[int, int]:
    """How many parts of ``order`` read each part: a part's hand-over lives until that many have run."""
    readers = {p: 0 for p in order}
    for p in order:
        for q in producers[p]:
            readers[q] += 1
    return readers


def _backwards_from(
    p: int, producers: Producers, readers: dict[int, int], released: Callable[[int], bool]
) -> Iterator[WalkStep]:
    """(BACKWARD, p), then that of each part whose last reader has just run its backward, each
    preceded by (AGAIN, q) where ``released(q)`` says its graph was not held. The producers are
    visited in their collection's own order: the order the step's gradients add up in."""
    ready = [p]
    while ready:
        q = ready.pop()
        yield Walk.BACKWARD, q
        for r in producers[q]:
            readers[r] -= 1
            if readers[r] == 0:
                if not released(r):
                    yield Walk.AGAIN, r
                ready.append(r)


#: Capacity steps of the held-graph knapsack (:func:`graphs_to_hold`): a bound above this many
#: tokens is counted in coarser units.
HOLD_STEPS = 2048


def graphs_to_hold(
    order: Sequence[int], sizes: Sequence[int], producers: Producers, cap: int
) -> set[int] | None:
    """The parts later parts read whose graphs to hold: the most held tokens (so the fewest run
    twice) such that the graphs held at any moment total at most ``cap``; None where the parts'
    lifetimes do not nest.

    A read part's graph lives from its forward to its backward, after its last reader's. Lifetimes
    nest (a spine run's readers run after it, before the parts of other branches), so the graphs
    alive at one moment are a chain of enclosing lifetimes, and the choice is a knapsack on the
    tree of lifetimes: every chain's held sizes within ``cap``, the held total largest. Solved by
    dynamic programming over the capacity left, from the innermost lifetimes out: exactly for a
    bound of up to :data:`HOLD_STEPS` tokens, in coarser units (sizes rounded up) above.
    """
    tree = _lifetime_tree(order, sizes, producers)
    if tree is None:
        return None
    read, children, chain = tree
    if cap >= max(chain.values()):
        return set(read)  # every chain fits: hold them all
    # Capacity in units of at most HOLD_STEPS steps: sizes rounded up, so the bound still holds
    # (exact where the bound is at most HOLD_STEPS tokens, as at the default of one budget of 1024).
    unit = max(1, -(-cap // HOLD_STEPS))
    c, size = cap // unit, {p: -(-sizes[p] // unit) for p in read}
    # per lifetime, per capacity: the most held units in it and the lifetimes it encloses
    best: dict[int, np.ndarray] = {}
    below: dict[int | None, np.ndarray] = {}
    for p in [*reversed(read), None]:
        inner = np.zeros(c + 1, dtype=np.int64)
        for q in children[p]:
            inner += best.pop(q)
        below[p] = inner
        if p is not None:
            best[p] = inner.copy()
            s = size[p]
            if s <= c:
                best[p][s:] = np.maximum(inner[s:], s + inner[: c + 1 - s])
    keep, stack = set(), [(q, c) for q in children[None]]
    while stack:  # the choices, from the outermost lifetimes in
        p, room = stack.pop()
        s = size[p]
        if s <= room and s + below[p][room - s] > below[p][room]:
            keep.add(p)
            room -= s
        stack.extend((q, room) for q in children[p])
    return keep


def _lifetime_tree(order: Sequence[int], sizes: Sequence[int], producers: Producers):
    """(read parts by start, the lifetimes each encloses directly (None: the outermost), tokens of each
    lifetime and those enclosing it) when holding every read graph; None where lifetimes do not nest."""
    start, end = {}, {}
    for i, (kind, p) in enumerate(walk_holding(order, producers, None)):
        if kind is Walk.HOLD:
            start[p] = i
        elif kind is Walk.BACKWARD:
            end[p] = i
    read = sorted(start, key=start.get)
    children: dict[int | None, list[int]] = {p: [] for p in read}
    children[None] = []
    chain: dict[int | None, int] = {None: 0}
    live: list[int] = []
    for p in read:
        while live and end[live[-1]] < start[p]:
            live.pop()
        outer = live[-1] if live else None
        if outer is not None and end[p] > end[outer]:
            return None
        children[outer].append(p)
        chain[p] = chain[outer] + sizes[p]
        live.append(p)
    return read, children, chain


def oldest_dropped_walk(
    order: Sequence[int], sizes: Sequence[int], producers: Producers, cap: int
) -> Iterator[WalkStep]:
    """The walk holding each read part while it fits ``cap``, dropping the oldest held graphs first:
    the fallback where lifetimes do not nest and the knapsack of :func:`graphs_to_hold` has no tree."""
    readers = reader_counts(order, producers)
    held: dict[int, int] = {}  # insertion order: the oldest first
    for p in order:
        if readers[p]:
            keep = sizes[p] <= cap
            while keep and held and sum(held.values()) + sizes[p] > cap:
                oldest = next(iter(held))
                del held[oldest]
                yield Walk.DROP, oldest
            if keep:
                held[p] = sizes[p]
            yield (Walk.HOLD if keep else Walk.PASS), p
            continue
        yield Walk.RUN, p
        yield from _backwards_from(p, producers, readers, lambda r: held.pop(r, None) is not None)


# ---- the events a step runs ---------------------------------------------------------------------
@dataclass(frozen=True)
class Forward:
    """Part ``part``'s first forward; with ``grad`` its graph is kept for its backward, without it
    only its rows' values (and, with a :class:`HandOver` next, what it hands on) are kept."""

    part: int
    grad: bool


@dataclass(frozen=True)
class HandOver:
    """What the part just run forward hands on (keys/values, conv inputs, states), banked without its
    graph for the later parts that read it."""

    part: int


@dataclass(frozen=True)
class Recompute:
    """Part ``part`` forward again, with autograd, right before its backward: its first forward ran
    without (its graph was not held). The same ops on the same inputs: the same values."""

    part: int


@dataclass(frozen=True)
class RowGradients:
    """The loss of the rows of ``parts`` (all their forwards run), differentiated once with respect to
    the rows' values: the row gradients the backwards of those parts inject (three passes)."""

    parts: tuple[int, ...]


@dataclass(frozen=True)
class Backward:
    """Part ``part``'s backward, with the gradients later parts sent back to what it handed on. With
    ``own_rows`` its rows' own loss is its term (added to the step's loss), else the row gradients
    of the last :class:`RowGradients`."""

    part: int
    own_rows: bool


@dataclass(frozen=True)
class Release:
    """Drop what part ``part`` handed on: every part reading it is done with it."""

    part: int


@dataclass(frozen=True)
class DropLayout:
    """Drop part ``part``'s layout and the plans it built: nothing runs it again (forward only)."""

    part: int


Event = Forward | HandOver | Recompute | RowGradients | Backward | Release | DropLayout


@dataclass(frozen=True)
class Schedule:
    """A step's events in order, and the part sizes (tokens) they were decided on.

    What the step will do is known before it runs: :attr:`order` (first forwards),
    :attr:`recomputed_parts`, :attr:`part_forwards` and :attr:`peak_held_tokens`.
    """

    sizes: tuple[int, ...]
    events: tuple[Event, ...]

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def then(self, other: Schedule) -> Schedule:
        """This schedule's events followed by ``other``'s (over the same parts)."""
        if other.sizes != self.sizes:
            raise ValueError("schedules over different parts cannot be joined")
        return Schedule(self.sizes, self.events + other.events)

    @property
    def order(self) -> tuple[int, ...]:
        """The parts in the order of their first forward."""
        return tuple(e.part for e in self.events if isinstance(e, Forward))

    @property
    def recomputed_parts(self) -> tuple[int, ...]:
        """The parts that run forward twice, ascending (``StepResult.recomputed_parts``)."""
        return tuple(sorted(e.part for e in self.events if isinstance(e, Recompute)))

    @property
    def part_forwards(self) -> int:
        """Forwards of parts the step runs: one per part, and one more per recomputed part."""
        return sum(isinstance(e, Forward | Recompute) for e in self.events)

    @property
    def peak_held_tokens(self) -> int:
        """The most tokens of graphs alive while another part runs forward: the graphs a step holds
        beyond its running part, within the hold bound of a depth-first step."""
        alive: set[int] = set()
        peak = 0
        for e in self.events:
            if isinstance(e, Forward | Recompute):
                peak = max(peak, sum(self.sizes[p] for p in alive))
                if isinstance(e, Recompute) or e.grad:
                    alive.add(e.part)
            elif isinstance(e, Backward):
                alive.discard(e.part)
        return peak


class LossForm(StrEnum):
    """What a step's loss says of itself, which decides how its parts run (module docstring)."""

    PER_ROW = "per_row"  # a sum of per-row terms over fixed normalisers: depth first
    PER_TRAJECTORY = "per_trajectory"  # a sum over trajectories: cut trees' parts take three passes
    WHOLE = "whole"  # any other loss (or one needing the whole step's statistics): three passes
    NONE = "none"  # no loss: forward only


def depth_first_schedule(
    order: Sequence[int], sizes: Sequence[int], producers: Producers, hold_limit: int
) -> Schedule:
    """Each part of ``order`` forward and backward once on its own rows, depth first
    (:func:`depth_first_walk`), graphs held within ``hold_limit`` tokens beyond the running part.

    A held graph the walk drops later is never built: its part runs without autograd from the
    start, since its holds are known before the step runs. The part's hand-over is released after its
    backward, once every reader has sent its gradients back."""
    walk = list(depth_first_walk(list(order), list(sizes), producers, hold_limit))
    dropped = {p for kind, p in walk if kind is Walk.DROP}
    read = {p for p, n in reader_counts(order, producers).items() if n}
    events: list[Event] = []
    for kind, p in walk:
        if kind is Walk.RUN:
            events.append(Forward(p, grad=True))
        elif kind is Walk.HOLD or kind is Walk.PASS:
            events += [Forward(p, grad=kind is Walk.HOLD and p not in dropped), HandOver(p)]
        elif kind is Walk.AGAIN:
            events.append(Recompute(p))
        elif kind is Walk.BACKWARD:
            events.append(Backward(p, own_rows=True))
            if p in read:
                events.append(Release(p))
    return Schedule(tuple(sizes), tuple(events))


def three_pass_schedule(order: Sequence[int], sizes: Sequence[int]) -> Schedule:
    """Forward of the parts of ``order`` without autograd (the last with it: nothing comes after it),
    the row gradients of their rows' loss, then backward part by part in reverse order, all but the
    last recomputed, each releasing its hand-over (only later parts read it, and they are done)."""
    order = list(order)
    if not order:
        return Schedule(tuple(sizes), ())
    *first, last = order
    events: list[Event] = []
    for p in first:
        events += [Forward(p, grad=False), HandOver(p)]
    events += [Forward(last, grad=True), RowGradients(tuple(order)), Backward(last, own_rows=False)]
    for p in reversed(first):
        events += [Recompute(p), Backward(p, own_rows=False), Release(p)]
    return Schedule(tuple(sizes), tuple(events))


def forward_only_schedule(sizes: Sequence[int], producers: Producers) -> Schedule:
    """Every part's forward without autograd, in order, keeping only its rows' values.

    What a part hands on is kept until the last part that reads it has run, then released, and so
    is a part's layout with the plans it built: the pass holds one part's activations and plans and
    the hand-overs still to be read, never a graph."""
    order = range(len(sizes))
    readers = reader_counts(order, producers)
    events: list[Event] = []
    for p in order:
        events.append(Forward(p, grad=False))
        if readers[p]:
            events.append(HandOver(p))
        events.append(DropLayout(p))
        for q in producers[p]:
            readers[q] -= 1
            if not readers[q]:
                events.append(Release(q))
    return Schedule(tuple(sizes), tuple(events))


def step_schedule(
    sizes: Sequence[int],
    producers: Producers,
    self_contained: Sequence[bool],
    form: LossForm,
    hold_limit: int,
) -> Schedule:
    """The schedule of a step over parts of ``sizes`` under a loss of ``form``.

    ``self_contained[p]``: part ``p`` holds whole trees (it reads no part and none reads it). A single
    part, or a per-row loss, runs depth first; a per-trajectory loss runs the parts of whole trees
    depth first and those of cut trees in three passes (their loss needs all their rows at once);
    any other loss runs every part in three passes; no loss, forward only."""
    form = LossForm(form)
    everything = list(range(len(sizes)))
    if form is LossForm.NONE:
        return forward_only_schedule(sizes, producers)
    if len(everything) == 1 or form is LossForm.PER_ROW:
        return depth_first_schedule(everything, sizes, producers, hold_limit)
    if form is LossForm.WHOLE:
        return three_pass_schedule(everything, sizes)
    whole = [p for p in everything if self_contained[p]]
    cut = [p for p in everything if not self_contained[p]]
    schedule = depth_first_schedule(whole, sizes, producers, hold_limit)
    return schedule.then(three_pass_schedule(cut, sizes)) if cut else schedule
