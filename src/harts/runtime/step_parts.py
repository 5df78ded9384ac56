"""The parts of one step: each part's forward and backward, and what they leave for each other.

:class:`StepParts` plans a step's micro-batches (parts) and runs one part at a time, forward
(:meth:`StepParts.forward`) or backward (:meth:`StepParts.backward`), with the hand-over between
parts (:class:`~harts.runtime.handoff.HandoffBanks`). *When* each part runs, which keep their graphs
and which run twice, is the step's :class:`~harts.plan.schedule.Schedule`
(:meth:`StepParts.schedule`), and :func:`harts.runtime.backward.run_schedule` runs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from harts.forest import Forest
from harts.ops.precision import no_autocast
from harts.plan.layout import TreeLayout
from harts.plan.micro_batches import plan_micro_batches
from harts.plan.schedule import LossForm, Schedule, step_schedule
from harts.runtime.executor import layout_for, model_device, run_layout
from harts.runtime.handoff import HandoffBanks, LayerHandoff
from harts.runtime.readout import Readout
from harts.runtime.sharded import PartSegments

__all__ = ["PartObserver", "PartRun", "StepParts", "check_rows"]

Tensor = torch.Tensor


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
class PartRun:
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


#: the row gradients of a three-pass step's loss: d loss / d logprob and d entropy, [R] each (or None)
RowGrads = tuple[Tensor | None, Tensor | None]


class StepParts:
    """The parts of one step: their plan, forwards and backwards, and the hand-over between them."""

    def __init__(
        self, model, forest, predictor, target, loss_fn, run, observer, readout: Readout, sharded=None
    ):
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
        self.peak_held_tokens = 0  # the most tokens of graphs alive while another part ran forward
        self.layout_seconds = 0.0  # build time of the layouts dropped as the step ran (forward only)

    def schedule(self, form: LossForm) -> Schedule:
        """When each part runs under a loss of ``form``: from the parts' sizes and readers alone."""
        producers = {p: self.banks.producers(p) for p in range(len(self.layouts))}
        self_contained = [lay.self_contained for lay in self.layouts]
        return step_schedule(self.sizes, producers, self_contained, form, self.run.hold_limit)

    def _plan(self, forest):
        plan = plan_micro_batches(forest, self.run.budget_tokens, self.run.context_weight)
        single = plan.num_micro_batches == 1
        layouts = [
            layout_for(plan.forest, self.device, self.run, None if single else part) for part in plan.parts
        ]
        return layouts, plan

    def rows(self, p: int) -> Tensor:
        return torch.as_tensor(self.row_parts[p], device=self.device)

    def forward(self, p: int, grad: bool, first: bool) -> PartRun:
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
            hidden, exports = run_layout(
                self.model, lay, ext, self.run.recompute_linear, self.sharded, segments
            )
            if rows.size:
                local = torch.as_tensor(self.local_index[self.pred_np[rows]], device=self.device)
                lp, en = self.readout(hidden, local, self.target[rows].to(self.device), self.run.chunk_rows)
        if lay.conv_windows:  # the model's convolutions, seen once: later parts gather only their reach
            self.conv_window = max(self.conv_window or 0, *lay.conv_windows)
        extra = self.observer.after_part(p, lay, first, grad)
        inputs = self.observer.term_inputs() if extra is not None and segments is not None else []
        part_run = PartRun(exports, lp, en, leaves, extra, segments, inputs)
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

    def backward(self, p: int, part_run: PartRun, row_terms: list[tuple[Tensor, Tensor]]) -> None:
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

    def _backward(self, p: int, part_run: PartRun, row_terms: list[tuple[Tensor, Tensor]]) -> None:
        received = self.clock.timed("handoff", self.banks.received, p)
        exported = [
            (layer, self._export(part_run, layer, name, node), g)
            for (layer, name, node), g in received.items()
        ]
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
    def _term_roots(part_run: PartRun) -> list[tuple[int, Tensor, Tensor]]:
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
    def _export(part_run: PartRun, layer: int, name: str, node: int | None) -> Tensor:
        h = part_run.exports[layer]
        return h.states[node] if name == "state" else getattr(h, name)

    # ---- a loss that is a sum over trajectories of each one's rows: every part's own loss --------
    def own_loss_terms(self, p: int, part_run: PartRun) -> list[tuple[Tensor, Tensor]]:
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

    def own_backward(self, p: int, part_run: PartRun) -> None:
        """Part ``p``'s backward with its own rows' loss as its term."""
        self.backward(p, part_run, self.own_loss_terms(p, part_run))

    # ---- a loss that needs all its rows at once: its row gradients ----------------------------------
    def row_gradients(self, order: tuple[int, ...]) -> RowGrads:
        """The loss of the rows of the parts of ``order`` (all of them run forward), added to the
        step's, and its gradients with respect to those rows' log-probs and entropies."""
        logp_leaf, ent_leaf = self.logp.clone().requires_grad_(), self.ent.clone().requires_grad_()
        if len(order) == len(self.layouts):
            value = self.loss_fn(logp_leaf, ent_leaf)
        else:  # the other parts ran on their own: the loss of these parts' rows (whole trajectories)
            rows = torch.as_tensor(np.concatenate([self.row_parts[p] for p in order]), device=self.device)
            value = self.loss_fn.subset(rows)(logp_leaf[rows], ent_leaf[rows])
        rows_loss = self.add(value)
        if not rows_loss.requires_grad:
            return None, None
        grad_logp, grad_ent = torch.autograd.grad(rows_loss, (logp_leaf, ent_leaf), allow_unused=True)
        return grad_logp, grad_ent

    def row_backward(self, p: int, part_run: PartRun, grads: RowGrads) -> None:
        """Part ``p``'s backward with its rows' share of the row gradients ``grads`` injected."""
        rows = self.rows(p)
        terms = []
        if rows.numel():
            pairs = ((part_run.logprob, grads[0]), (part_run.entropy, grads[1]))
            terms = [(t, g[rows].to(t.dtype)) for t, g in pairs if g is not None]
        self.backward(p, part_run, terms)

    # ---- what the events of a schedule do beyond a forward and a backward ---------------------------
    def hand_over(self, p: int, part_run: PartRun) -> None:
        """Bank what part ``p`` hands on, without its graph: readers take none, so dropping the part's
        graph frees it."""
        self.banks.put(p, [h.detached() for h in part_run.exports])

    def drop_layout(self, p: int) -> None:
        """Drop part ``p``'s layout and the plans it built, keeping their build time: only readers'
        layouts are read from here on (by the hand-over banks too)."""
        self.layout_seconds += self.layouts[p].build_seconds
        self.layouts[p] = None

    def note_held(self, graphs: dict[int, PartRun]) -> None:
        """Count the tokens of the graphs alive as another part starts its forward."""
        self.peak_held_tokens = max(self.peak_held_tokens, sum(self.sizes[p] for p in graphs))
