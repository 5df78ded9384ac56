"""The check every plan of the recurrence contract passes: a forest's tree run against the fp64
per-token reference of each trajectory alone (outputs, every node's final state, and the gradients
of every input and of the roots' initial states under a random linear functional of both).

Bounds (fp32 against fp64): max abs 1e-5 on values, relative 1e-5 on gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.ops.recurrence import DELTA_RULE
from harts.ops.tree_recurrence import tree_recurrence
from tests.helpers import path_tokens, root_of

ATOL = 1e-5
GRAD_RTOL = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def recurrence_inputs(recurrence, gate: str, n, h, dk, dv, strength=2.0):
    q = F.normalize(torch.randn(n, h, dk), dim=-1)
    k = F.normalize(torch.randn(n, h, dk), dim=-1)
    v = torch.randn(n, h, dv)
    g = -torch.rand(n, h, dk) * strength if gate == "key" else -torch.rand(n, h) * strength
    extra = (torch.rand(n, h),) if recurrence is DELTA_RULE else ()
    return tuple(x.requires_grad_() for x in (q, k, v, g, *extra))


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
