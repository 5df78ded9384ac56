"""Any recurrence of the contract (:mod:`harts.ops.recurrence`) over a forest: differentiable state
handoff from parent to child. :func:`tree_recurrence` is the general form; :func:`tree_gated_delta_rule`
the delta rule through it, unchanged.

Each call of a :class:`~harts.plan.linear.LinearPlan` gathers its segments into a right-padded
batch, starts each segment from the fp32 final state of its ``init_node`` (zeros at roots), runs
the chunked kernel once, and keeps the final state of every node it ran for the calls after it:
the segment's final state for its ``end_node``, and, for a segment that runs a chain of nodes,
the states after each inner node (``boundary_offsets``, via the kernel's ``output_states_at``,
which replays the chunk that holds the boundary from its chunk-start state: exact, no alignment
of chunks to nodes needed). The states are ordinary tensors in the autograd graph, never written
in place, so the gradient of a parent's final state is the sum over its children by construction.

Shapes: the recurrence's per-token inputs [N, H, ...] (for the delta rule q, k [N, H, K]; v [N, H, V];
g [N, H, K], log decay per key channel, or [N, H] per head (GDN), which reaches the kernel as it is;
beta [N, H]). Returns o [N, H, V] and the final state [H, K, V] of every node of the plan (inner
chain nodes included: children in later calls and later micro-batches read them). ``root_states``
supplies the initial state of segments that start at a node without a parent in the plan
(``init_node == -1``), keyed by that node: the final state of its parent in an earlier
micro-batch. Missing entries start from zeros.

``recompute=True`` trades compute for memory: each call keeps for backward only references to
the inputs (as passed, shared by all calls, and its initial states) and runs its
forward again in backward (``torch.utils.checkpoint``). The kernel's internals (chunk matrices,
padded slots, per-chunk states) then live only while one call's backward runs, so the padding of
short tree segments no longer counts: on the hybrid bench configs a 1000-token micro-batch's
peak falls by about 30%, tree or flat, for one more kernel forward per call (7-28% more step
time).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch.utils.checkpoint import checkpoint

from harts.ops.precision import no_autocast
from harts.ops.recurrence import DELTA_RULE, Recurrence
from harts.plan.chunk_tree import ChunkTreePlan
from harts.plan.linear import LinearCall, LinearPlan
from harts.plan.packed_chunks import PackedChunkPlan

__all__ = ["tree_gated_delta_rule", "tree_recurrence"]


def tree_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: LinearPlan,
    scale: float | None = None,
    root_states: dict[int, torch.Tensor] | None = None,
    recompute: bool = False,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The gated delta rule (:data:`~harts.ops.recurrence.DELTA_RULE`) over ``plan``."""
    return tree_recurrence(DELTA_RULE, (q, k, v, g, beta), plan, scale, root_states, recompute)


def tree_recurrence(
    recurrence: Recurrence,
    inputs: tuple[torch.Tensor, ...],
    plan: LinearPlan,
    scale: float | None = None,
    root_states: dict[int, torch.Tensor] | None = None,
    recompute: bool = False,
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``recurrence`` over ``plan``: (o [N, H, V], {node: final state [H, K, V]}).

    Under ``torch.autocast`` the recurrence runs with autocast off: its chunk maths and states stay
    in fp32, as the fused kernels keep them (a recomputation in backward restores that state too).
    """
    with no_autocast(inputs[0].device):
        return _tree_recurrence(recurrence, inputs, plan, scale, root_states, recompute)


def _tree_recurrence(recurrence, inputs, plan, scale, root_states, recompute):
    recurrence.check(inputs)
    n = inputs[0].shape[0]
    if n != plan.num_tokens:
        raise ValueError(
            f"the plan covers {plan.num_tokens} tokens but the {recurrence.name} inputs have {n} rows "
            f"({recurrence.inputs[0]}: {tuple(inputs[0].shape)})"
        )
    h, dk, dv = recurrence.state_shape(inputs)
    root_states = root_states or {}
    q = inputs[0]
    zero_state = torch.zeros(h, dk, dv, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    recompute = recompute and torch.is_grad_enabled()
    one_call = {  # plans run as one call: (kernel, its name, the plan's row of each node's final state)
        ChunkTreePlan: lambda: (recurrence.tree_kernel, "chunk-tree", plan.node_last_chunk),
        PackedChunkPlan: lambda: (recurrence.packed_kernel, "packed-chunk", plan.node_state_row),
    }.get(type(plan))
    if one_call is not None:
        kernel, form, rows = one_call()
        if kernel is None:
            raise ValueError(f"{recurrence.name} has no {form} kernel; use another linear plan")
        return _run_one_call(kernel, inputs, plan, rows.tolist(), scale, root_states, zero_state, recompute)
    kernel = recurrence.kernel()
    states: dict[int, torch.Tensor] = {}
    outputs = []
    for call in plan.calls:
        init = torch.stack(
            [
                states[node] if node >= 0 else root_states.get(start, zero_state)
                for node, start in zip(call.init_node, call.start_node, strict=True)
            ],
            dim=0,
        )
        run = functools.partial(_run_call, kernel, call, scale)
        if recompute:
            o, final, inner = checkpoint(run, init, *inputs, use_reentrant=False)
        else:
            o, final, inner = run(init, *inputs)
        for w, nodes in enumerate(call.boundary_nodes):
            for s, node in enumerate(nodes):
                states[node] = inner[w, s]
        for w, node in enumerate(call.end_node):
            states[node] = final[w]
        outputs.append(o)
    return torch.cat(outputs, dim=0)[plan.output_order()], states


class _NodeStates(Mapping):
    """{node: final state [H, K, V]} read from a chunk tree's end states (or a packed plan's
    states buffer), one view per lookup."""

    def __init__(self, ends: torch.Tensor, last_chunk: list[int]):
        self.ends, self.last_chunk = ends, last_chunk

    def __getitem__(self, node: int) -> torch.Tensor:
        return self.ends[self.last_chunk[node]]

    def __iter__(self):
        return iter(range(len(self.last_chunk)))

    def __len__(self) -> int:
        return len(self.last_chunk)


def _run_one_call(kernel, inputs, plan, node_rows: list[int], scale, root_states, zero_state, recompute):
    """A one-call plan (the chunk tree, packed chunks) in one call of its kernel; node m's final state
    is row ``node_rows[m]`` of the states the kernel returns."""
    init = torch.stack([root_states.get(node, zero_state) for node in plan.root_nodes], dim=0)

    def run(init, *inputs):
        return kernel(*inputs, plan=plan, initial_state=init, scale=scale)

    o, states = checkpoint(run, init, *inputs, use_reentrant=False) if recompute else run(init, *inputs)
    return o, _NodeStates(states, node_rows)


def _run_call(kernel, call: LinearCall, scale, init, *inputs):
    """One call: gather its segments' rows, run the kernel; (valid outputs, final, inner states)."""
    idx = call.token_index
    args = tuple(x[idx] for x in inputs)
    if call.num_boundaries:
        o, final, inner = kernel(
            *args,
            initial_state=init,
            lengths=call.lengths,
            scale=scale,
            output_states_at=call.boundary_offsets,
            chunk_size=call.chunk_size,
        )
    else:
        o, final = kernel(
            *args, initial_state=init, lengths=call.lengths, scale=scale, chunk_size=call.chunk_size
        )
        inner = None
    return o[call.valid], final, inner
