"""The check every plan of the recurrence contract passes: a forest's tree run against the fp64
per-token reference of each trajectory alone (outputs, every node's final state, and the gradients
of every input and of the roots' initial states under a random linear functional of both).

The tests run it over :data:`harts.ops.recurrence.ALL_RECURRENCES` (:data:`RECURRENCES` here, with
their names as test ids), building each recurrence's inputs by their names (:data:`INPUTS`).

Bounds (fp32 against fp64): max abs 1e-5 on values, relative 1e-5 on gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.ops.recurrence import ALL_RECURRENCES
from harts.ops.tree_recurrence import tree_recurrence
from tests.helpers import path_tokens, root_of

ATOL = 1e-5
GRAD_RTOL = 1e-5
RECURRENCES = ALL_RECURRENCES
RECURRENCE_IDS = [r.name for r in RECURRENCES]
# A random input [n, H, ...] by its name: (gate, n, h, dk, dv, strength) -> tensor. q and k unit-norm,
# v ~ N(0, 1), the log-decay g per key channel ("key") or per head ("head") in -U(0, strength),
# beta ~ U(0, 1) per head.
INPUTS = {
    "q": lambda gate, n, h, dk, dv, strength: F.normalize(torch.randn(n, h, dk), dim=-1),
    "k": lambda gate, n, h, dk, dv, strength: F.normalize(torch.randn(n, h, dk), dim=-1),
    "v": lambda gate, n, h, dk, dv, strength: torch.randn(n, h, dv),
    "g": lambda gate, n, h, dk, dv, strength: (
        -torch.rand(n, h, dk) * strength if gate == "key" else -torch.rand(n, h) * strength
    ),
    "beta": lambda gate, n, h, dk, dv, strength: torch.rand(n, h),
}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def recurrence_inputs(recurrence, gate: str, n, h, dk, dv, strength=2.0):
    """``recurrence``'s inputs in its order, each drawn by :data:`INPUTS` and requiring grad."""
    missing = [name for name in recurrence.inputs if name not in INPUTS]
    if missing:
        raise KeyError(f"{recurrence.name}: no random input for {missing}; add one to INPUTS")
    return tuple(INPUTS[name](gate, n, h, dk, dv, strength).requires_grad_() for name in recurrence.inputs)


def gates(recurrence) -> tuple[str, ...]:
    """The gate layouts ``recurrence`` takes: per key channel, and per head where its g may be."""
    return ("key", "head") if "g" in recurrence.per_head_inputs else ("key",)


def check_against_reference(forest, plan, recurrence, gate, strength=2.0):
    h, dk, dv = 2, 8, 4
    inputs = recurrence_inputs(recurrence, gate, forest.num_tokens, h, dk, dv, strength)
    roots = (forest.node_parent < 0).nonzero().squeeze(1).tolist()
    root_states = {r: (0.3 * torch.randn(h, dk, dv)).requires_grad_() for r in roots}
    leaves = (*inputs, *root_states.values())
    out, states = tree_recurrence(recurrence, inputs, plan, root_states=root_states)
    assert set(states) == set(range(forest.num_nodes))
    w_out = torch.randn_like(out)
    w_state = torch.randn(forest.num_nodes, h, dk, dv)
    loss = (out * w_out).sum() + sum((states[m] * w_state[m]).sum() for m in states)
    got = torch.autograd.grad(loss, leaves)

    def naive(idx, root):
        return recurrence.reference(*(x[idx][None] for x in inputs), initial_state=root_states[root][None])

    ref_loss = 0.0
    for i in range(forest.num_trajectories):
        idx = forest.trajectory_token_indices(i)
        ref, _ = naive(idx, root_of(forest, int(forest.trajectory_end_node[i])))
        assert (out[idx].double() - ref[0]).abs().max() <= ATOL
        mult = forest.token_multiplicity[idx][:, None, None]
        ref_loss = ref_loss + (ref[0] * w_out[idx].double() / mult).sum()
    for m in range(forest.num_nodes):
        _, ref_state = naive(path_tokens(forest, m), root_of(forest, m))
        assert (states[m].double() - ref_state[0]).abs().max() <= ATOL
        ref_loss = ref_loss + (ref_state[0] * w_state[m].double()).sum()
    want = torch.autograd.grad(ref_loss, leaves)
    for name, got_, want_ in zip([*recurrence.inputs, *(f"root {r}" for r in roots)], got, want, strict=True):
        assert rel(got_, want_) <= GRAD_RTOL, name
