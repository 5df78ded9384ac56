"""Forward and backward of a whole forest under a micro-batch token budget.

``forest_backward(model, forest, predictor, target, loss_fn, budget_tokens)`` accumulates into
``.grad`` exactly the gradients of ``loss_fn(logprob [R], entropy [R])``, the loss of rows given
by a predicting unique token and a target id, whatever the budget. It is the lower layer of
:func:`harts.rollout_step` and the entry point for custom losses.

Without a budget (or when the forest fits) it is one forward, the loss, one backward. With a
budget the forest is cut into micro-batches (:mod:`harts.plan.micro_batches`). A micro-batch of
whole trees runs forward and backward once, on its own rows, when the loss is a sum over
trajectories of functions of each one's own rows (a ``loss_fn`` with a ``subset(rows)`` method,
as every objective of :func:`harts.rollout_step` is, given the step's normalisers): that is how a
flat trainer runs its micro-batches. The parts of cut trees (and every part, for a loss without
``subset``) run in three passes:

1. forward of every part in order, without autograd, keeping what each part hands on (per layer:
   keys/values and conv inputs of the tokens later parts read, final states of their parents)
   and the row log-probs and entropies; the last part runs with autograd and keeps its graph;
2. the loss on detached row log-probs, differentiated once: d loss / d logprob and d entropy,
   so any objective works, including sequence-level ones whose rows span parts (GSPO);
3. parts in reverse order: recompute the part's forward with autograd (all but the last), the
   handed-over inputs as leaves, and run backward with the row gradients and the gradients that
   later parts sent back to this part's exports injected
   (``torch.autograd.backward(tensors, grad_tensors)``). The gradients of its leaves go back to
   the parts that produced them (:class:`~harts.runtime.handoff.HandoffBanks`).

Peak activation memory is one part's graph plus the handed-over tensors; the price is one extra
forward of every part but the last (as with activation checkpointing). Recomputation is exact:
the same ops on the same inputs.

A :class:`PartObserver` sees every part's forward and may add a loss term to a part's backward:
this is how the MoE load-balancing loss, a product of two means over the whole step, gets its
exact gradient part by part (:mod:`harts.train.moe`).
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
from harts.plan.layout import TreeLayout
from harts.plan.micro_batches import plan_micro_batches
from harts.runtime.config import RunConfig
from harts.runtime.executor import (
    check_inputs,
    check_targets,
    layout_for,
    model_device,
    resolve_model,
    row_logprobs,
    run_layout,
)
from harts.runtime.handoff import HandoffBanks, LayerHandoff

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
    - ``part_forwards``: forwards of micro-batches the step ran: one per micro-batch where each
      runs once (whole trees under a separable loss), up to two where a cut tree's parts run a
      first pass without autograd and again in backward.
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
    first forward of a part (each part runs once more in backward, except the last); ``grad`` is
    True when the forward kept its graph. With ``needs_step_statistics``, every part's first
    forward has run before the first ``after_part`` with ``grad`` True, so a term may use
    statistics of the whole step.
    """

    needs_step_statistics = False

    def before_part(self, part: int, layout: TreeLayout, first: bool) -> None:
        pass

    def after_part(self, part: int, layout: TreeLayout, first: bool, grad: bool) -> Tensor | None:
        return None


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


def _check_rows(forest: Forest, predictor, target, head: nn.Module) -> tuple[Tensor, Tensor]:
    predictor = torch.as_tensor(predictor, dtype=torch.long)
    target = torch.as_tensor(target, dtype=torch.long)
    if predictor.shape != target.shape or predictor.dim() != 1:
        raise ValueError(
            f"predictor and target must both be [R], got {tuple(predictor.shape)}, {tuple(target.shape)}"
        )
    if predictor.numel() and (predictor.min() < 0 or predictor.max() >= forest.num_tokens):
        raise ValueError(f"predictor indices must lie in [0, {forest.num_tokens})")
    check_targets(target, head)
    return predictor.cpu(), target.cpu()


@dataclass
class _PartRun:
    """What one part's forward leaves for its backward."""

    exports: list[LayerHandoff]
    logprob: Tensor | None
    entropy: Tensor | None
    leaves: list[tuple[int, str, int | None, Tensor]]  # (layer, name, state node, leaf)
    extra: Tensor | None  # the observer's loss term


class _Clock:
    def __init__(self):
        self.seconds: dict[str, float] = {"plan": 0.0, "handoff": 0.0}

    def timed(self, key: str, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[key] += time.perf_counter() - start


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
) -> StepResult:
    """Accumulate into ``.grad`` the gradients of ``loss_fn(logprob, entropy)`` over rows.

    ``predictor`` [R]: unique-token index (in ``forest``) of each row's predicting position;
    ``target`` [R]: the token id it predicts. ``loss_fn`` returns a 0-dim loss, or
    ``(loss, metrics)``; if it has ``subset(rows [r]) -> loss_fn`` over those rows alone (a sum
    over trajectories, each of its own rows, so that the loss of whole trajectories' rows adds
    up), micro-batches of whole trees run forward and backward once. ``budget_tokens`` (or
    ``run.budget_tokens``) cuts the forest into micro-batches; ``run`` holds the other execution
    knobs (:class:`~harts.runtime.config.RunConfig`).
    ``temperature`` T: rows' log-probs and entropies are those of ``softmax(logits / T)``, the
    distribution a sampler at T drew from. Every check runs before any compute. Returns the
    loss, the row log-probs and entropies, and what the plan did.
    """
    start = time.perf_counter()
    run = RunConfig.resolve(run, budget_tokens)
    observer = observer or PartObserver()
    model = resolve_model(model)
    check_inputs(model, forest)
    predictor, target = _check_rows(forest, predictor, target, model.lm_head)
    head = model.lm_head

    def head_rows(hidden, local_predictor, row_target):
        return row_logprobs(head, hidden, local_predictor, row_target, run.chunk_rows, temperature)

    device = model_device(model)
    clock = _Clock()

    def plan_parts():
        plan = plan_micro_batches(forest, run.budget_tokens, run.context_weight)
        single = plan.num_micro_batches == 1
        return plan, [layout_for(plan.forest, device, run, None if single else part) for part in plan.parts]

    plan, layouts = clock.timed("plan", plan_parts)
    sizes = [lay.num_tokens for lay in layouts]

    def result(loss, metrics, logp, ent, forwards: int) -> StepResult:
        plan_s = clock.seconds["plan"] + sum(lay.build_seconds for lay in layouts)
        timings = {"plan": plan_s, "handoff": clock.seconds["handoff"], "total": time.perf_counter() - start}
        return StepResult(loss.detach(), logp, ent, len(layouts), plan.num_cuts, sizes, layouts,
                          {k: v.detach() for k, v in metrics.items()}, timings=timings,
                          part_forwards=forwards)  # fmt: skip

    # rows of each part: those whose predicting token it holds
    part_of_token = np.empty(forest.num_tokens, dtype=np.int64)
    local_index = np.empty(forest.num_tokens, dtype=np.int64)
    for p, lay in enumerate(layouts):
        part_of_token[lay.global_tokens] = p
        local_index[lay.global_tokens] = np.arange(lay.global_tokens.size)
    pred_np = predictor.numpy()
    row_order = np.argsort(part_of_token[pred_np], kind="stable")
    row_bounds = np.searchsorted(part_of_token[pred_np][row_order], np.arange(len(layouts) + 1))
    row_parts = [row_order[row_bounds[p] : row_bounds[p + 1]] for p in range(len(layouts))]
    num_layers = model.config.num_hidden_layers
    banks = HandoffBanks(layouts, forest.num_tokens)

    def forward_part(p: int, grad: bool, first: bool) -> _PartRun:
        """Part ``p``'s forward and row log-probs; with ``grad``, its handed-over inputs become leaves."""
        lay, rows = layouts[p], row_parts[p]
        ext = clock.timed("handoff", banks.gather, p, num_layers)
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
        observer.before_part(p, lay, first)
        with torch.set_grad_enabled(grad):
            hidden, exports = run_layout(model, lay, ext, run.recompute_linear)
            if rows.size:
                local = torch.as_tensor(local_index[pred_np[rows]], device=device)
                lp, en = head_rows(hidden, local, target[rows].to(device))
        return _PartRun(exports, lp, en, leaves, observer.after_part(p, lay, first, grad))

    # the head's precision (fp32, fp64 for an fp64 model): the loss of a cut tree reads these
    dtype = torch.promote_types(model.lm_head.weight.dtype, torch.float32)
    logp = torch.empty(predictor.numel(), device=device, dtype=dtype)
    ent = torch.empty(predictor.numel(), device=device, dtype=dtype)

    def keep_rows(p: int, part_run: _PartRun) -> None:
        rows = torch.as_tensor(row_parts[p], device=device)
        if rows.numel():
            logp[rows] = part_run.logprob.detach().to(logp.dtype)
            ent[rows] = part_run.entropy.detach().to(ent.dtype)

    # Parts that hold whole trees neither read from nor hand to other parts. With a loss that is a
    # sum over trajectories of each one's own rows (``loss_fn.subset``), such a part runs forward
    # and backward once, on its own rows, as a flat trainer runs a micro-batch; so does the single
    # part of a forest that fits the budget, whatever the loss. Everything else (cut trees; any
    # part when the loss couples all rows, or the observer needs the whole step's statistics
    # first) takes the three passes below.
    single = len(layouts) == 1
    separable = hasattr(loss_fn, "subset") and not observer.needs_step_statistics
    whole = [p for p, lay in enumerate(layouts) if (single or separable) and lay.self_contained]
    whole_set = set(whole)
    cut = [p for p in range(len(layouts)) if p not in whole_set]
    loss = torch.zeros((), device=device)
    metrics: dict[str, Tensor] = {}
    forwards = 0

    def add(part_loss, part_metrics) -> None:
        nonlocal loss
        loss = loss + part_loss.detach()
        for name, value in part_metrics.items():  # every metric is a sum over global normalisers
            metrics[name] = metrics[name] + value.detach() if name in metrics else value.detach()

    for p in whole:
        part_run = forward_part(p, grad=True, first=True)
        forwards += 1
        keep_rows(p, part_run)
        terms = [] if part_run.extra is None else [part_run.extra]
        if single and not row_parts[p].size:  # a forest without rows: the loss of none
            add(*_split_loss(loss_fn(logp, ent)))
        elif row_parts[p].size:
            part_loss_fn = loss_fn if single else loss_fn.subset(torch.as_tensor(row_parts[p], device=device))
            part_loss, part_metrics = _split_loss(part_loss_fn(part_run.logprob, part_run.entropy))
            terms.append(part_loss)
            add(part_loss, part_metrics)
        total = sum(terms[1:], terms[0]) if terms else None
        if total is not None and total.requires_grad:  # nothing to differentiate when all is frozen
            total.backward()
        del part_run, terms, total
    if not cut:
        return result(loss, metrics, logp, ent, forwards)

    # 1. forward of the other parts in order, without autograd except for the last one, whose graph
    #    is kept for its backward right after the loss (no recompute for it)
    last = cut[-1]
    for p in cut[:-1]:
        part_run = forward_part(p, grad=False, first=True)
        banks.put(p, part_run.exports)
        keep_rows(p, part_run)
    part_run = None
    kept = forward_part(last, grad=True, first=True)  # no part comes after it: its exports are not banked
    keep_rows(last, kept)
    forwards += len(cut)

    # 2. the loss of their rows and its gradient with respect to the rows
    logp_leaf, ent_leaf = logp.clone().requires_grad_(), ent.clone().requires_grad_()
    if whole:
        cut_rows = torch.as_tensor(np.concatenate([row_parts[p] for p in cut]), device=device)
        cut_loss_fn = loss_fn.subset(cut_rows)
        cut_loss, cut_metrics = _split_loss(cut_loss_fn(logp_leaf[cut_rows], ent_leaf[cut_rows]))
    else:
        cut_loss, cut_metrics = _split_loss(loss_fn(logp_leaf, ent_leaf))
    grad_logp = grad_ent = None
    if cut_loss.requires_grad:
        grad_logp, grad_ent = torch.autograd.grad(cut_loss, (logp_leaf, ent_leaf), allow_unused=True)
    add(cut_loss, cut_metrics)

    # 3. backward, last part first (the others recomputed); gradients flow back through the banks
    def backward_part(p: int, part_run: _PartRun) -> None:
        """Run part ``p``'s backward and send its leaves' gradients back to the parts they came from.

        A function, so that nothing of the part (graph outputs, leaves and their gradients, which are
        often views of whole-layer gradient buffers) stays alive while the next part runs.
        """
        rows = torch.as_tensor(row_parts[p], device=device)
        tensors, grads = [], []
        if rows.numel():
            for t, g in ((part_run.logprob, grad_logp), (part_run.entropy, grad_ent)):
                if g is not None:
                    tensors.append(t)
                    grads.append(g[rows].to(t.dtype))
        for (layer, name, node), g in clock.timed("handoff", banks.received, p).items():
            h = part_run.exports[layer]
            tensors.append(h.states[node] if name == "state" else getattr(h, name))
            grads.append(g)
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
                    banks.send_back(p, layer, name, node, grad)

        clock.timed("handoff", route)

    backward_part(last, kept)
    del kept
    for p in reversed(cut[:-1]):
        backward_part(p, forward_part(p, grad=True, first=False))
        forwards += 1
        banks.release(p)  # only later parts read a part's exports, and they are done
    return result(loss, metrics, logp, ent, forwards)
