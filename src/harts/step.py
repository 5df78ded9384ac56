"""One training step over a whole forest under a micro-batch token budget.

``forest_backward(model, forest, predictor, target, loss_fn, budget_tokens)`` accumulates into
``.grad`` exactly the gradients of ``loss_fn(logprob [R], entropy [R])``, the loss of rows given
by a predicting unique token and a target id, whatever the budget.

Without a budget (or when the forest fits) it is one forward, the loss, one backward. With a
budget the forest is cut into micro-batches (:mod:`harts.plan.micro_batches`) and run in three
passes:

1. forward of every part in order, without autograd, keeping what each part hands on (per layer:
   keys/values and conv inputs of the tokens later parts read, final states of their parents)
   and the row log-probs and entropies; the last part runs with autograd and keeps its graph;
2. the loss on detached row log-probs, differentiated once: d loss / d logprob and d entropy,
   so any objective works, including sequence-level ones whose rows span parts (GSPO);
3. parts in reverse order: recompute the part's forward with autograd (all but the last), the
   handed-over inputs as leaves, and run backward with the row gradients and the gradients that
   later parts sent back to this part's exports injected
   (``torch.autograd.backward(tensors, grad_tensors)``). The gradients of its leaves go back to
   the parts that produced them.

Peak activation memory is one part's graph plus the handed-over tensors; the price is one extra
forward of every part but the last (as with activation checkpointing). Recomputation is exact:
the same ops on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from harts.adapters.base import LayerHandoff
from harts.executor import _model_device, check_inputs, run_layout
from harts.forest import Forest
from harts.ops.logprobs import DEFAULT_CHUNK_ROWS, token_logprobs
from harts.plan.layout import TreeLayout
from harts.plan.micro_batches import plan_micro_batches

__all__ = ["StepResult", "forest_backward", "next_token_rows"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepResult:
    loss: torch.Tensor  # detached scalar
    logprob: torch.Tensor  # [R] detached
    entropy: torch.Tensor  # [R] detached
    num_micro_batches: int
    num_cuts: int
    tokens_per_micro_batch: list[int]
    layouts: list[TreeLayout]  # one per micro-batch: plans, calls per linear layer, padding


def next_token_rows(forest: Forest) -> tuple[torch.Tensor, torch.Tensor]:
    """(predictor [R], target [R]) for every next-token prediction of every trajectory."""
    indices = [forest.trajectory_token_indices(i) for i in range(forest.num_trajectories)]
    predictor = torch.cat([idx[:-1] for idx in indices])
    return predictor, forest.tokens[torch.cat([idx[1:] for idx in indices])]


def _row_logprobs(model, hidden, local_predictor, target, chunk_rows):
    unique, inverse = torch.unique(local_predictor, return_inverse=True)
    head = model.lm_head
    return token_logprobs(hidden[unique], head.weight, inverse, target, bias=head.bias, chunk_rows=chunk_rows)


@dataclass
class _PartRun:
    """What one part's forward leaves for its backward."""

    exports: list[LayerHandoff]
    logprob: torch.Tensor | None
    entropy: torch.Tensor | None
    leaves: list[tuple[int, str, int | None, torch.Tensor]]


class _Banks:
    """Handed-over tensors of every layer, rows in the order of all parts' export lists."""

    def __init__(self, num_layers: int):
        self.parts: list[list[LayerHandoff]] = []
        self.layers = num_layers

    def add(self, handoffs: list[LayerHandoff]) -> None:
        self.parts.append(handoffs)

    def gather(self, layer: int, rows: np.ndarray, nodes: list[int]) -> LayerHandoff:
        def cat(name, dim):
            ts = [getattr(p[layer], name) for p in self.parts if getattr(p[layer], name) is not None]
            return torch.cat(ts, dim=dim) if ts else None

        key, value, conv = cat("key", 1), cat("value", 1), cat("conv_input", 0)
        idx = torch.as_tensor(rows)
        states = {}
        for p in self.parts:
            states.update(p[layer].states)
        return LayerHandoff(
            key=key[:, idx] if key is not None else None,
            value=value[:, idx] if value is not None else None,
            conv_input=conv[idx] if conv is not None else None,
            states={n: states[n] for n in nodes if n in states},
        )


def forest_backward(
    model: nn.Module,
    forest: Forest,
    predictor: torch.Tensor,
    target: torch.Tensor,
    loss_fn: LossFn,
    budget_tokens: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    recompute_linear: bool = False,
) -> StepResult:
    """Accumulate into ``.grad`` the gradients of ``loss_fn(logprob, entropy)`` over rows.

    ``predictor`` [R]: unique-token index (in ``forest``) of each row's predicting position;
    ``target`` [R]: the token id it predicts. Returns the loss and the row log-probs.
    ``recompute_linear``: linear-attention calls keep only their inputs for backward and run
    again there: about 30% less activation memory per micro-batch on the hybrid bench configs,
    for 7% (flat) to 28% (tree) more step time.
    """
    check_inputs(model, forest)
    predictor = torch.as_tensor(predictor, dtype=torch.long)
    target = torch.as_tensor(target, dtype=torch.long)
    if predictor.shape != target.shape or predictor.dim() != 1:
        raise ValueError(
            f"predictor and target must both be [R], got {tuple(predictor.shape)}, {tuple(target.shape)}"
        )
    if predictor.numel() and (predictor.min() < 0 or predictor.max() >= forest.num_tokens):
        raise ValueError(f"predictor indices must lie in [0, {forest.num_tokens})")
    device = _model_device(model)
    plan = plan_micro_batches(forest, budget_tokens)
    layouts = [
        TreeLayout(plan.forest, device, part if plan.num_micro_batches > 1 else None) for part in plan.parts
    ]
    sizes = [lay.num_tokens for lay in layouts]

    if len(layouts) == 1:
        hidden, _ = run_layout(model, layouts[0], recompute_linear=recompute_linear)
        logp, ent = _row_logprobs(model, hidden, predictor.to(device), target.to(device), chunk_rows)
        loss = loss_fn(logp, ent)
        loss.backward()
        return StepResult(loss.detach(), logp.detach(), ent.detach(), 1, 0, sizes, layouts)

    # rows of each part: those whose predicting token it holds
    part_of_token = np.empty(forest.num_tokens, dtype=np.int64)
    local_index = np.empty(forest.num_tokens, dtype=np.int64)
    for p, lay in enumerate(layouts):
        part_of_token[lay.global_tokens] = p
        local_index[lay.global_tokens] = np.arange(lay.global_tokens.size)
    pred_np = predictor.numpy()
    row_parts = [np.flatnonzero(part_of_token[pred_np] == p) for p in range(len(layouts))]
    # where each part's external rows sit in the concatenation of all exports
    export_row = np.full(forest.num_tokens, -1, dtype=np.int64)
    offset = 0
    for lay in layouts:
        export_row[lay.export_token_ids] = offset + np.arange(lay.export_token_ids.size)
        offset += lay.export_token_ids.size
    num_layers = model.config.num_hidden_layers

    def external_for(lay: TreeLayout, banks: _Banks) -> list[LayerHandoff] | None:
        if not lay.root_state_source:
            return None
        rows = export_row[lay.external_tokens]
        nodes = sorted(set(lay.root_state_source.values()))
        return [banks.gather(layer, rows, nodes) for layer in range(num_layers)]

    def forward_part(p: int, grad: bool) -> _PartRun:
        """Part ``p``'s forward and row log-probs; with ``grad``, its handed-over inputs become leaves."""
        lay, rows = layouts[p], row_parts[p]
        ext = external_for(lay, banks)
        leaves: list[tuple[int, str, int | None, torch.Tensor]] = []
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
        with torch.set_grad_enabled(grad):
            hidden, exports = run_layout(model, lay, ext, recompute_linear)
            if rows.size:
                local = torch.as_tensor(local_index[pred_np[rows]], device=device)
                lp, en = _row_logprobs(model, hidden, local, target[rows].to(device), chunk_rows)
        return _PartRun(exports, lp, en, leaves)

    # 1. forward of every part in order, without autograd except for the last part, whose graph
    #    is kept for its backward right after the loss (no recompute for it)
    banks = _Banks(num_layers)
    logp = torch.empty(predictor.numel(), device=device)
    ent = torch.empty(predictor.numel(), device=device)
    last = len(layouts) - 1

    def keep_rows(p: int, run: _PartRun) -> None:
        rows = row_parts[p]
        if rows.size:
            logp[rows], ent[rows] = run.logprob.detach().to(logp.dtype), run.entropy.detach().to(ent.dtype)

    for p in range(last):
        run = forward_part(p, grad=False)
        banks.add(run.exports)
        keep_rows(p, run)
    del run
    kept = forward_part(last, grad=True)  # no part comes after it: its exports are not banked
    keep_rows(last, kept)

    # 2. the loss and its gradient with respect to the rows
    logp_leaf, ent_leaf = logp.clone().requires_grad_(), ent.clone().requires_grad_()
    loss = loss_fn(logp_leaf, ent_leaf)
    grad_logp, grad_ent = torch.autograd.grad(loss, (logp_leaf, ent_leaf), allow_unused=True)

    # 3. backward, last part first (the others recomputed); gradients flow back through the banks
    # per part: {(layer, "key" | "value" | "conv_input" | "state", node or None): gradient of its export}
    sent_back: list[dict[tuple[int, str, int | None], torch.Tensor]] = [{} for _ in layouts]

    def backward_part(p: int, run: _PartRun) -> None:
        """Run part ``p``'s backward and send its leaves' gradients back to the parts they came from.

        A function, so that nothing of the part (graph outputs, leaves and their gradients, which are
        often views of whole-layer gradient buffers) stays alive while the next part runs.
        """
        lay, rows = layouts[p], row_parts[p]
        tensors, grads = [], []
        if rows.size:
            for t, g in ((run.logprob, grad_logp), (run.entropy, grad_ent)):
                if g is not None:
                    tensors.append(t)
                    grads.append(g[torch.as_tensor(rows, device=device)].to(t.dtype))
        for (layer, name, node), g in sent_back[p].items():
            h = run.exports[layer]
            tensors.append(h.states[node] if name == "state" else getattr(h, name))
            grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        # route the leaves' gradients to the parts that exported those rows / states
        for layer, name, node, leaf in run.leaves:
            grad, leaf.grad = leaf.grad, None
            if grad is None:
                continue
            if name == "state":
                producer = next(q for q in range(p) if node in layouts[q].node_set)
                key = (layer, name, node)
                sent_back[producer][key] = sent_back[producer].get(key, 0) + grad
                continue
            ext_rows = export_row[lay.external_tokens]
            for q in range(p):
                lo = export_row[layouts[q].export_token_ids[0]] if layouts[q].export_token_ids.size else None
                if lo is None:
                    continue
                hi = lo + layouts[q].export_token_ids.size
                sel = np.flatnonzero((ext_rows >= lo) & (ext_rows < hi))
                if not sel.size:
                    continue
                dim = 1 if name in ("key", "value") else 0
                part_grad = torch.zeros_like(getattr(banks.parts[q][layer], name))
                src = grad.index_select(dim, torch.as_tensor(sel, device=device))
                part_grad.index_add_(dim, torch.as_tensor(ext_rows[sel] - lo, device=device), src)
                key = (layer, name, None)
                sent_back[q][key] = sent_back[q].get(key, 0) + part_grad
        sent_back[p].clear()  # spent

    backward_part(last, kept)
    del kept
    for p in range(last - 1, -1, -1):
        backward_part(p, forward_part(p, grad=True))
        banks.parts.pop()  # only later parts read a part's exports, and they are done
    return StepResult(loss.detach(), logp, ent, len(layouts), plan.num_cuts, sizes, layouts)
