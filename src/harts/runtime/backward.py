"""Forward and backward of a whole forest under a micro-batch token budget.

``forest_backward(model, forest, predictor, target, loss_fn, budget_tokens)`` accumulates into
``.grad`` exactly the gradients of ``loss_fn(logprob [R], entropy [R])``, the loss of rows given
by a predicting unique token and a target id, whatever the budget. It is the lower layer of
:func:`harts.rollout_step` and the entry point for custom losses.

Without a budget (or when the forest fits) it is one forward, the loss, one backward. With a
budget the forest is cut into micro-batches (:mod:`harts.plan.micro_batches`), and how they run
depends on what the loss says of itself:

- **Per-row losses** (``loss_fn.subset(rows)`` and ``loss_fn.separable_rows``: a sum of per-row
  terms over normalisers fixed before the step, as every objective of :func:`harts.rollout_step`
  but GSPO is): every part runs forward and backward once, on its own rows, as a flat trainer runs
  its micro-batches. A micro-batch of whole trees runs its backward right after its forward. A cut
  tree is walked depth first over its parts: a part that later parts read keeps its graph while
  they run, and runs its backward once they have all sent back the gradients of what it handed
  them. Held graphs are those of the chain of parts above the running one; where holding one
  would exceed ``RunConfig.hold_limit`` (by default ``budget_tokens``: the step's graphs stay
  within two micro-batches' tokens; ``hold_tokens=0``: within one, holding none), that part runs
  without autograd first and again in backward (``StepResult.part_forwards`` counts the forwards,
  ``StepResult.recomputed_parts`` names the parts that ran twice).
- **Per-trajectory losses** (``subset`` only: valid for whole trajectories' rows, e.g. GSPO's
  sequence ratio): micro-batches of whole trees run once as above; the parts of cut trees take
  the three passes below.
- **Any other loss** (or an observer that needs the whole step's statistics first): every part
  takes the three passes:

  1. forward of every part in order, without autograd, keeping what each part hands on (per
     layer: keys/values and conv inputs of the tokens later parts read, final states of their
     parents) and the row log-probs and entropies; the last part runs with autograd;
  2. the loss on detached row log-probs, differentiated once: d loss / d logprob and d entropy;
  3. parts in reverse order: recompute the part's forward with autograd (all but the last), the
     handed-over inputs as leaves, and run backward with the row gradients and the gradients
     that later parts sent back to this part's exports injected.

In every order, the gradients of a part's handed-over leaves go back to the parts that produced
them (:class:`~harts.runtime.handoff.HandoffBanks`), and recomputation is exact: the same ops on
the same inputs.

A :class:`PartObserver` sees every part's forward and may add a loss term to a part's backward:
this is how the MoE load-balancing loss, a product of two means over the whole step, gets its
exact gradient part by part (:mod:`harts.steps.router_statistics`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from harts.forest import Forest
from harts.ops.precision import no_autocast
from harts.plan.layout import TreeLayout
from harts.plan.micro_batches import plan_micro_batches
from harts.runtime.config import RunConfig
from harts.runtime.executor import (
    check_inputs,
    layout_for,
    model_device,
    resolve_model,
    run_backend,
    run_layout,
)
from harts.runtime.handoff import HandoffBanks, LayerHandoff
from harts.runtime.readout import Readout, readout_for
from harts.runtime.sharded import PartSegments, ShardedStep
from harts.runtime.verify import Verification, verify_sample

__all__ = ["StepResult", "PartObserver", "forest_backward", "next_token_rows"]

Tensor = torch.Tensor
LossFn = Callable[[Tensor, Tensor], "Tensor | tuple[Tensor, dict[str, Tensor]]"]


@dataclass
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
      :func:`forest_backward`.
    - ``recomputed_parts``: the indices (into ``layouts``, in plan order) of the micro-batches
      that ran forward twice: under a per-row loss, the parts later parts read whose graphs were
      not held (``RunConfig.hold_tokens``); under the three passes, every part they ran but the
      last of them (all of a step's parts but its last, or, under a per-trajectory loss, the
      parts of cut trees but the last of those). Empty when every part ran forward once.
    - ``value``: per row [R], detached, the critic's values of a :func:`harts.value_step` (its
      ``logprob`` holds the same values, the readout's first quantity), else None.
    - ``batch_layout``: where each trajectory sat in the padded or packed batch the rollouts came
      from (``harts.rollouts_from_batch``), else None; :meth:`to_batch` uses it.
    """

    loss: Tensor
    logprob: Tensor
    entropy: Tensor
    num_micro_batches: int
    num_cuts: int
    tokens_per_micro_batch: list[int]
    layouts: list[TreeLayout]
    metrics: dict[str, Tensor] = field(default_factory=dict)
    moe: Any = None
    timings: dict[str, float] = field(default_factory=dict)
    rows: Any = None
    batch_layout: Any = None
    part_forwards: int = 0
    value: Any = None
    recomputed_parts: tuple[int, ...] = ()

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


class PartObserver:
    """Sees each part's forward; may add a scalar loss term to a part's backward.

    ``needs_step_statistics``: True when a term needs statistics of every part first (then no
    part runs forward and backward in one pass).

    ``before_part(p, layout, first)`` runs before part ``p``'s forward; ``after_part`` after it
    and returns a 0-dim term to backpropagate with the part (or None). ``first`` is True on the
    first forward of a part (a part that ran without autograd runs once more in backward);
    ``grad`` is True when the forward kept its graph. With ``needs_step_statistics``, every part's first
    forward has run before the first ``after_part`` with ``grad`` True, so a term may use
    statistics of the whole step.
    """

    needs_step_statistics = False

    def before_part(self, part: int, layout: TreeLayout, first: bool) -> None:
        pass

    def after_part(self, part: int, layout: TreeLayout, first: bool, grad: bool) -> Tensor | None:
        return None

    def term_inputs(self) -> list[tuple[int, Tensor]]:
        """What the term ``after_part`` returned last is a function of: ``(decoder layer index,
        tensor computed inside that layer)`` pairs whose graph to the term holds no parameter. A
        sharded step backpropagates the term through them, each layer with its unit gathered."""
        return []


def next_token_rows(forest: Forest) -> tuple[Tensor, Tensor]:
    """(predictor [R], target [R]) for every next-token prediction of every trajectory."""
    indices = [forest.trajectory_token_indices(i) for i in range(forest.num_trajectories)]
    predictor = torch.cat([idx[:-1] for idx in indices])
    return predictor, forest.tokens[torch.cat([idx[1:] for idx in indices])]


def _split_loss(value) -> tuple[Tensor, dict[str, Tensor]]:
    if isinstance(value, tuple):
        loss, metrics = value
        return loss, dict(metrics)
    return value, {}


def check_rows(forest: Forest, predictor, target, readout: Readout) -> tuple[Tensor, Tensor]:
    predictor = torch.as_tensor(predictor, dtype=torch.long)
    target = torch.as_tensor(target, dtype=torch.long)
    if predictor.shape != target.shape or predictor.dim() != 1:
        raise ValueError(
            f"predictor and target must both be [R], got {tuple(predictor.shape)}, {tuple(target.shape)}"
        )
    if predictor.numel() and (predictor.min() < 0 or predictor.max() >= forest.num_tokens):
        raise ValueError(f"predictor indices must lie in [0, {forest.num_tokens})")
    readout.check_targets(target)
    return predictor.cpu(), target.cpu()


@dataclass
class _PartRun:
    """What one part's forward leaves for its backward."""

    exports: list[LayerHandoff]
    logprob: Tensor | None
    entropy: Tensor | None
    leaves: list[tuple[int, str, int | None, Tensor]]  # (layer, name, state node, leaf)
    extra: Tensor | None  # the observer's loss term
    segments: PartSegments | None = None  # the graph cut at every layer (an FSDP2 step)
    extra_inputs: list[tuple[int, Tensor]] = field(default_factory=list)  # the term's, by layer


class _Clock:
    def __init__(self):
        self.seconds: dict[str, float] = {"plan": 0.0, "handoff": 0.0}

    def timed(self, key: str, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[key] += time.perf_counter() - start


def _depth_first_walk(order: list[int], sizes: list[int], producers: dict[int, set[int]], cap: int):
    """The decisions of :meth:`StepParts.depth_first`, from part sizes and readers alone, in order:
    ("run", p) a part no later part reads (its backward follows); ("hold", p) / ("pass", p) a part
    later parts read, its graph kept or not; ("drop", p) a held graph dropped to make room (only
    where lifetimes do not nest, below); ("again", p) a part whose graph is not held runs again for
    its backward; and ("backward", p).

    Every graph not held runs its forward again, so the walk holds the graphs that leave the fewest
    tokens to run twice while the graphs held at any moment total at most ``cap`` tokens
    (:func:`_graphs_to_hold`). Where the parts' lifetimes do not nest, it falls back to holding
    each part while it fits, dropping the oldest held graphs first to make room."""
    keep = _graphs_to_hold(order, sizes, producers, cap)
    if keep is None:
        yield from _oldest_dropped_walk(order, sizes, producers, cap)
    else:
        yield from _walk(order, producers, keep)


def _walk(order: list[int], producers: dict[int, set[int]], keep: set[int] | None):
    """The walk holding the graphs of the parts in ``keep`` (None: of every part later parts read)."""
    readers = _reader_counts(order, producers)
    for p in order:
        if readers[p]:
            yield ("hold" if keep is None or p in keep else "pass"), p
            continue
        yield "run", p
        yield from _backwards(p, producers, readers, lambda r: keep is None or r in keep)


def _reader_counts(order: list[int], producers: dict[int, set[int]]) -> dict[int, int]:
    readers = {p: 0 for p in order}
    for p in order:
        for q in producers[p]:
            readers[q] += 1
    return readers


def _backwards(p: int, producers: dict[int, set[int]], readers: dict[int, int], released):
    """("backward", p), then that of each part whose last reader has just run its backward, each
    preceded by ("again", q) where ``released(q)`` says its graph was not held."""
    ready = [p]
    while ready:
        q = ready.pop()
        yield "backward", q
        for r in producers[q]:
            readers[r] -= 1
            if readers[r] == 0:
                if not released(r):
                    yield "again", r
                ready.append(r)


def _graphs_to_hold(order: list[int], sizes: list[int], producers: dict[int, set[int]], cap: int):
    """The parts later parts read whose graphs to hold: the most held tokens (so the fewest run
    twice) such that the graphs held at any moment total at most ``cap``; None where the parts'
    lifetimes do not nest.

    A read part's graph lives from its forward to its backward, after its last reader's. Lifetimes
    nest (a spine run's readers run after it, before the parts of other branches), so the graphs
    alive at one moment are a chain of enclosing lifetimes, and the choice is a knapsack on the
    tree of lifetimes: every chain's held sizes within ``cap``, the held total largest. Solved by
    dynamic programming over the capacity left, from the innermost lifetimes out: exactly for a
    bound of up to :data:`_HOLD_STEPS` tokens, in coarser units (sizes rounded up) above.
    """
    start, end = {}, {}
    for i, (kind, p) in enumerate(_walk(order, producers, None)):
        if kind == "hold":
            start[p] = i
        elif kind == "backward":
            end[p] = i
    read = sorted(start, key=start.get)
    children: dict[int | None, list[int]] = {p: [] for p in read}
    children[None] = []
    chain = {None: 0}  # tokens of each lifetime and those enclosing it
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
    if cap >= max(chain.values()):
        return set(read)  # every chain fits: hold them all
    # Capacity in units of at most _HOLD_STEPS steps: sizes rounded up, so the bound still holds
    # (exact where the bound is at most _HOLD_STEPS tokens, as at the default of one budget of 1024).
    unit = max(1, -(-cap // _HOLD_STEPS))
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


#: Capacity steps of the held-graph knapsack (:func:`_graphs_to_hold`): a bound above this many
#: tokens is counted in coarser units.
_HOLD_STEPS = 2048


def _oldest_dropped_walk(order: list[int], sizes: list[int], producers: dict[int, set[int]], cap: int):
    """The walk holding each read part while it fits ``cap``, dropping the oldest held graphs first."""
    readers = _reader_counts(order, producers)
    held: dict[int, int] = {}  # insertion order: the oldest first
    for p in order:
        if readers[p]:
            keep = sizes[p] <= cap
            while keep and held and sum(held.values()) + sizes[p] > cap:
                oldest = next(iter(held))
                del held[oldest]
                yield "drop", oldest
            if keep:
                held[p] = sizes[p]
            yield ("hold" if keep else "pass"), p
            continue
        yield "run", p
        yield from _backwards(p, producers, readers, lambda r: held.pop(r, None) is not None)


class StepParts:
    """The parts of one step: their forwards, backwards, and the two orders they run in."""

    def __init__(self, model, forest, predictor, target, loss_fn, run, observer, readout: Readout,
                 sharded=None):  # fmt: skip
        self.model, self.loss_fn, self.run, self.observer = model, loss_fn, run, observer
        self.sharded = sharded
        self.readout = readout
        self.target = target
        self.device = model_device(model)
        self.clock = _Clock()
        self.layouts, self.plan = self.clock.timed("plan", self._plan, forest)
        self.sizes = [lay.num_tokens for lay in self.layouts]
        # rows of each part: those whose predicting token it holds
        part_of_token = np.empty(forest.num_tokens, dtype=np.int64)
        self.local_index = np.empty(forest.num_tokens, dtype=np.int64)
        for p, lay in enumerate(self.layouts):
            part_of_token[lay.global_tokens] = p
            self.local_index[lay.global_tokens] = np.arange(lay.global_tokens.size)
        self.pred_np = predictor.numpy()
        row_order = np.argsort(part_of_token[self.pred_np], kind="stable")
        bounds = np.searchsorted(part_of_token[self.pred_np][row_order], np.arange(len(self.layouts) + 1))
        self.row_parts = [row_order[bounds[p] : bounds[p + 1]] for p in range(len(self.layouts))]
        self.num_layers = model.config.num_hidden_layers
        self.banks = HandoffBanks(self.layouts, forest.num_tokens)
        self.conv_window: int | None = None  # the widest convolution a part has run (None: none yet)
        # the head's precision (fp32, fp64 for an fp64 model): the loss of a cut tree reads these
        dtype = readout.dtype
        self.logp = torch.empty(predictor.numel(), device=self.device, dtype=dtype)
        self.ent = torch.empty(predictor.numel(), device=self.device, dtype=dtype)
        self.loss = torch.zeros((), device=self.device)
        self.metrics: dict[str, Tensor] = {}
        self.forwards = 0
        self.recomputed: list[int] = []  # parts whose forward ran again (``first`` False)

    def _plan(self, forest):
        plan = plan_micro_batches(forest, self.run.budget_tokens, self.run.context_weight)
        single = plan.num_micro_batches == 1
        layouts = [
            layout_for(plan.forest, self.device, self.run, None if single else part) for part in plan.parts
        ]
        return layouts, plan

    def rows(self, p: int) -> Tensor:
        return torch.as_tensor(self.row_parts[p], device=self.device)

    def forward(self, p: int, grad: bool, first: bool) -> _PartRun:
        """Part ``p``'s forward and row log-probs; with ``grad``, its handed-over inputs become leaves."""
        lay, rows = self.layouts[p], self.row_parts[p]
        self.forwards += 1
        if not first:
            self.recomputed.append(p)
        ext = self.clock.timed("handoff", self.banks.gather, p, self.num_layers, self.conv_window)
        leaves: list[tuple[int, str, int | None, Tensor]] = []
        if grad and ext is not None:
            for layer, h in enumerate(ext):
                for name in ("key", "value", "conv_input"):
                    t = getattr(h, name)
                    if t is not None:
                        leaf = t.detach().requires_grad_()
                        setattr(h, name, leaf)
                        leaves.append((layer, name, None, leaf))
                for node in list(h.states):
                    leaf = h.states[node].detach().requires_grad_()
                    h.states[node] = leaf
                    leaves.append((layer, "state", node, leaf))
        lp = en = None
        segments = None
        if self.sharded is not None:
            self.sharded.enter_forward()
            segments = PartSegments() if grad else None
        self.observer.before_part(p, lay, first)
        with torch.set_grad_enabled(grad):
            hidden, exports = run_layout(self.model, lay, ext, self.run.recompute_linear, self.sharded,
                                         segments)  # fmt: skip
            if rows.size:
                local = torch.as_tensor(self.local_index[self.pred_np[rows]], device=self.device)
                lp, en = self.readout(hidden, local, self.target[rows].to(self.device), self.run.chunk_rows)
        if lay.conv_windows:  # the model's convolutions, seen once: later parts gather only their reach
            self.conv_window = max(self.conv_window or 0, *lay.conv_windows)
        extra = self.observer.after_part(p, lay, first, grad)
        inputs = self.observer.term_inputs() if extra is not None and segments is not None else []
        part_run = _PartRun(exports, lp, en, leaves, extra, segments, inputs)
        if first and lp is not None:  # keep the rows' values (recomputation gives the same ones)
            rows_t = self.rows(p)
            self.logp[rows_t] = lp.detach().to(self.logp.dtype)
            self.ent[rows_t] = en.detach().to(self.ent.dtype)
        return part_run

    def add(self, value) -> Tensor:
        """Add a loss term (``loss`` or ``(loss, metrics)``) to the step's; returns the loss."""
        part_loss, part_metrics = _split_loss(value)
        self.loss = self.loss + part_loss.detach()
        for name, v in part_metrics.items():  # every metric is a sum over global normalisers
            self.metrics[name] = self.metrics[name] + v.detach() if name in self.metrics else v.detach()
        return part_loss

    def backward(self, p: int, part_run: _PartRun, row_terms: list[tuple[Tensor, Tensor]]) -> None:
        """Part ``p``'s backward: ``row_terms`` (output, its gradient), the gradients later parts sent
        back to its exports and the observer's term; then its leaves' gradients go back to the parts
        they came from.

        Nothing of the part (graph outputs, leaves and their gradients, which are often views of
        whole-layer gradient buffers) outlives this call, so none stays alive while the next part runs.

        It runs outside autocast even when the step is called inside it, as a trainer's
        ``loss.backward()`` after an autocast forward: every op's gradient then comes in the dtype
        its forward ran in (autocast's casts are in the graph), and the ops kept in fp32 in the
        forward (recurrences, softmaxes) are not rounded to the low precision in their backward.
        """
        with no_autocast(self.device):
            self._backward(p, part_run, row_terms)

    def _backward(self, p: int, part_run: _PartRun, row_terms: list[tuple[Tensor, Tensor]]) -> None:
        received = self.clock.timed("handoff", self.banks.received, p)
        exported = [(layer, self._export(part_run, layer, name, node), g)
                    for (layer, name, node), g in received.items()]  # fmt: skip
        if self.sharded is not None:  # layer by layer, each unit gathered for its own backward
            by_layer: dict[int, list[tuple[Tensor, Tensor]]] = {}
            for layer, t, g in exported + self._term_roots(part_run):
                by_layer.setdefault(layer, []).append((t, g))
            self.sharded.enter_backward()
            self.sharded.backward(part_run.segments, row_terms, by_layer)
        else:
            tensors = [t for t, _ in row_terms] + [t for _, t, _ in exported]
            grads = [g for _, g in row_terms] + [g for _, _, g in exported]
            if part_run.extra is not None:
                tensors.append(part_run.extra)
                grads.append(torch.ones_like(part_run.extra))
            # with frozen parameters (LoRA, a frozen layer, head-only training) some outputs have no graph
            live = [(t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad]
            if live:
                torch.autograd.backward([t for t, _ in live], [g for _, g in live])

        def route():
            for layer, name, node, leaf in part_run.leaves:
                grad, leaf.grad = leaf.grad, None
                if grad is not None:
                    self.banks.send_back(p, layer, name, node, grad)

        self.clock.timed("handoff", route)

    @staticmethod
    def _term_roots(part_run: _PartRun) -> list[tuple[int, Tensor, Tensor]]:
        """The observer's term as gradients of the tensors it is a function of, by layer: its graph
        from them holds no parameter, so it runs here, and each layer's share runs with the
        layer's backward (its unit gathered)."""
        extra = part_run.extra
        if extra is None or not extra.requires_grad:
            return []
        if not part_run.extra_inputs:
            raise ValueError("an observer's loss term in a sharded (FSDP2) step needs its term_inputs")
        tensors = [t for _, t in part_run.extra_inputs]
        grads = torch.autograd.grad(extra, tensors, allow_unused=True)
        pairs = zip(part_run.extra_inputs, grads, strict=True)
        return [(layer, t, g) for (layer, t), g in pairs if g is not None]

    @staticmethod
    def _export(part_run: _PartRun, layer: int, name: str, node: int | None) -> Tensor:
        h = part_run.exports[layer]
        return h.states[node] if name == "state" else getattr(h, name)

    # ---- a loss that is a sum over trajectories of each one's rows: every part's own loss --------
    def own_loss_terms(self, p: int, part_run: _PartRun) -> list[tuple[Tensor, Tensor]]:
        """The loss of part ``p``'s own rows (the whole loss for a single part), added to the step's."""
        if len(self.layouts) == 1 and part_run.logprob is None:  # a forest without rows: the loss of none
            value = self.loss_fn(self.logp, self.ent)
        elif len(self.layouts) == 1:
            value = self.loss_fn(part_run.logprob, part_run.entropy)
        elif self.row_parts[p].size:
            value = self.loss_fn.subset(self.rows(p))(part_run.logprob, part_run.entropy)
        else:
            return []
        part_loss = self.add(value)
        return [(part_loss, torch.ones_like(part_loss))]

    def depth_first(self, order: list[int]) -> None:
        """Each part of ``order`` forward and backward once, in order (a cut tree's parts in pre-order).

        A part no later part reads (a micro-batch of whole trees, a subtree off a spine) runs its
        backward right after its forward. A part later parts read keeps its graph until they have all
        run theirs and sent their gradients back, then runs its own: held graphs are those of the
        parts above the running one, the chain of spine runs. The graphs held at any moment stay
        within ``run.hold_limit`` tokens (``hold_tokens``, ``auto`` read as the budget); a part whose
        graph is not held runs again, with autograd, when its backward is due, and the walk holds
        the graphs that leave the fewest tokens to run twice. It depends on sizes and readers alone
        (:func:`_depth_first_walk`), so it is known before the step: a part whose graph it will not
        hold runs its first forward without autograd, never building a graph that nothing reads.
        """
        producers = {p: self.banks.producers(p) for p in order}
        events = list(_depth_first_walk(order, self.sizes, producers, self.run.hold_limit))
        dropped = {p for kind, p in events if kind == "drop"}
        graphs: dict[int, _PartRun] = {}  # held, just run, or run again for its backward
        for kind, p in events:
            if kind == "run":
                graphs[p] = self.forward(p, grad=True, first=True)
            elif kind in ("hold", "pass"):
                keep = kind == "hold" and p not in dropped
                part_run = self.forward(p, grad=keep, first=True)
                self.banks.put(p, [h.detached() for h in part_run.exports])  # readers take no graph
                if keep:
                    graphs[p] = part_run
                del part_run
            elif kind == "drop":
                graphs.pop(p, None)  # its graph is freed (or was never built); it runs again later
            elif kind == "again":
                graphs[p] = self.forward(p, grad=True, first=False)
            elif kind == "backward":  # the part's backward; those whose last reader it was follow
                part_run = graphs.pop(p)
                self.backward(p, part_run, self.own_loss_terms(p, part_run))
                del part_run
                self.banks.release(p)

    # ---- no loss: forward only ----------------------------------------------------------------------
    def forward_only(self) -> None:
        """Every part's forward without autograd, in plan order, keeping only its rows' values.

        What a part hands on is kept until the last part that reads it has run, then dropped, and
        so is a part's layout with the plans it built (``self.layouts[p]`` becomes None; their
        build time is kept in ``self.layout_seconds``): the pass holds one part's activations and
        plans and the hand-overs still to be read, never a graph.
        """
        order = range(len(self.layouts))
        self.layout_seconds = 0.0
        producers = {p: self.banks.producers(p) for p in order}
        readers = dict.fromkeys(order, 0)
        for p in order:
            for q in producers[p]:
                readers[q] += 1
        for p in order:
            part_run = self.forward(p, grad=False, first=True)
            if readers[p]:
                self.banks.put(p, part_run.exports)
            del part_run
            self.layout_seconds += self.layouts[p].build_seconds
            self.layouts[p] = None  # only readers' layouts are read from here on (HandoffBanks too)
            for q in producers[p]:
                readers[q] -= 1
                if not readers[q]:
                    self.banks.release(q)

    # ---- any loss: three passes ---------------------------------------------------------------------
    def three_passes(self, order: list[int]) -> None:
        """Forward of the parts of ``order`` without autograd (the last with it), the gradient of their
        rows' loss with respect to the rows, then backward part by part in reverse order, all but the
        last recomputed. Any loss: the loss sees all its rows' values at once."""
        for p in order[:-1]:
            self.banks.put(p, self.forward(p, grad=False, first=True).exports)
        last = order[-1]
        kept = self.forward(last, grad=True, first=True)  # no part comes after it: nothing banked
        logp_leaf, ent_leaf = self.logp.clone().requires_grad_(), self.ent.clone().requires_grad_()
        if len(order) == len(self.layouts):
            value = self.loss_fn(logp_leaf, ent_leaf)
        else:  # the other parts ran on their own: the loss of these parts' rows (whole trajectories)
            rows = torch.as_tensor(np.concatenate([self.row_parts[p] for p in order]), device=self.device)
            value = self.loss_fn.subset(rows)(logp_leaf[rows], ent_leaf[rows])
        rows_loss = self.add(value)
        grad_logp = grad_ent = None
        if rows_loss.requires_grad:
            grad_logp, grad_ent = torch.autograd.grad(rows_loss, (logp_leaf, ent_leaf), allow_unused=True)

        def row_terms(p: int, part_run: _PartRun) -> list[tuple[Tensor, Tensor]]:
            rows = self.rows(p)
            if not rows.numel():
                return []
            pairs = ((part_run.logprob, grad_logp), (part_run.entropy, grad_ent))
            return [(t, g[rows].to(t.dtype)) for t, g in pairs if g is not None]

        self.backward(last, kept, row_terms(last, kept))
        del kept
        for p in reversed(order[:-1]):
            part_run = self.forward(p, grad=True, first=False)
            self.backward(p, part_run, row_terms(p, part_run))
            del part_run
            self.banks.release(p)  # only later parts read a part's exports, and they are done


#: why ``RunConfig(verify=True)`` is refused on an FSDP2-sharded model
FSDP_VERIFY = ("RunConfig(verify=True) runs the stock forward of a sample on one rank, which an "
               "FSDP2-sharded model cannot do alone: verify on one process or under DDP")  # fmt: skip


def verify_training(model: nn.Module, forest: Forest, run: RunConfig, temperature: float, readout,
                    separable: bool, what: str) -> Verification:  # fmt: skip
    """``run.verify``'s check of a training call (:func:`harts.runtime.verify.verify_sample`): harts'
    pass on the sample is :func:`forest_backward` under ``run`` unverified, with ``readout``."""

    def harts_rows(sub: Forest, predictor: Tensor, target: Tensor, loss, sample_run: RunConfig) -> Tensor:
        return forest_backward(model, sub, predictor, target, loss, run=sample_run,
                               temperature=temperature, readout=readout).logprob  # fmt: skip

    return verify_sample(model, forest, run=run, harts_rows=harts_rows, readout=readout,
                         temperature=temperature, gradients=True, separable=separable,
                         what=what)  # fmt: skip


def forest_backward(
    model: nn.Module,
    forest: Forest,
    predictor: Tensor,
    target: Tensor,
    loss_fn: LossFn,
    budget_tokens: int | None = None,
    *,
    run: RunConfig | None = None,
    observer: PartObserver | None = None,
    temperature: float = 1.0,
    sharded: ShardedStep | None = None,
    readout: Readout | None = None,
) -> StepResult:
    """Accumulate into ``.grad`` the gradients of ``loss_fn(logprob, entropy)`` over rows.

    ``predictor`` [R]: unique-token index (in ``forest``) of each row's predicting position;
    ``target`` [R]: the token id it predicts. ``loss_fn`` returns a 0-dim loss, or
    ``(loss, metrics)``. If it has ``subset(rows [r]) -> loss_fn`` over those rows alone (a sum
    over trajectories, each of its own rows, so that the losses of whole trajectories' rows add
    up), micro-batches of whole trees run forward and backward once; if it also sets
    ``separable_rows = True`` (a sum of per-row terms: subsets of any rows add up), so do the parts
    of cut trees (module docstring). ``budget_tokens`` (or
    ``run.budget_tokens``) cuts the forest into micro-batches; ``run`` holds the other execution
    knobs (:class:`~harts.runtime.config.RunConfig`).
    ``temperature`` T: rows' log-probs and entropies are those of ``softmax(logits / T)``, the
    distribution a sampler at T drew from. ``sharded``: the FSDP2 step of
    :func:`harts.runtime.distributed.data_parallel_step` (units gathered layer by layer; the
    model is that step's). ``readout``: what the rows read from their predictor's final hidden
    state (:mod:`harts.runtime.readout`; default: the log-prob of the target and the entropy
    under ``model.lm_head``; :class:`~harts.runtime.readout.ScalarReadout` gives a critic's
    values, passed to ``loss_fn`` in place of the log-probs). Every check runs before any
    compute. Returns the loss, the row log-probs and entropies (or the readout's two
    quantities), and what the plan did.
    """
    start = time.perf_counter()
    run = RunConfig.resolve(run, budget_tokens)
    observer = observer or PartObserver()
    model = resolve_model(model)
    check_inputs(model, forest)
    readout = readout_for(model, readout, temperature)
    predictor, target = check_rows(forest, predictor, target, readout)
    by_trajectory = hasattr(loss_fn, "subset") and not observer.needs_step_statistics
    by_row = by_trajectory and getattr(loss_fn, "separable_rows", False)
    if run.verify:
        if sharded is not None:
            raise ValueError(FSDP_VERIFY)
        verify_training(model, forest, run, temperature, readout, by_row, "forest_backward")
        run = run.unverified
    with run_backend(run, model):
        parts = StepParts(model, forest, predictor, target, loss_fn, run, observer, readout, sharded)
        everything = list(range(len(parts.layouts)))
        if len(everything) == 1 or by_row:
            parts.depth_first(everything)
        elif by_trajectory:  # parts of whole trees on their own rows; cut trees see all their rows at once
            whole = [p for p in everything if parts.layouts[p].self_contained]
            cut = [p for p in everything if not parts.layouts[p].self_contained]
            parts.depth_first(whole)
            if cut:
                parts.three_passes(cut)
        else:
            parts.three_passes(everything)
    layouts = parts.layouts
    timings = {
        "plan": parts.clock.seconds["plan"] + sum(lay.build_seconds for lay in layouts),
        "handoff": parts.clock.seconds["handoff"],
        "total": time.perf_counter() - start,
    }
    return StepResult(
        parts.loss.detach(), parts.logp, parts.ent, len(layouts), parts.plan.num_cuts, parts.sizes, layouts,
        parts.metrics, timings=timings, part_forwards=parts.forwards,
        recomputed_parts=tuple(sorted(parts.recomputed)),
    )  # fmt: skip
