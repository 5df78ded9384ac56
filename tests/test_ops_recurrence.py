"""The recurrent-mixer contract: each recurrence's chunked op against its fp64 per-token reference,
and the tree form of any recurrence against the reference on every trajectory alone.

Chunked op: outputs, final states and states at inner offsets, for varlen right-padded batches with
initial states, per-channel and per-head decays (expanded, or per head as is), strong decays (no
overflow), several chunk sizes; gradients of every input and of the initial state under a random
linear functional of outputs and states. Tolerances as the delta-rule op tests: max abs 1e-5 on
values, relative 1e-5 on gradients (fp32 against fp64).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harts
from harts.ops import recurrence as recurrence_module
from harts.ops.backends import Backend, register_backend, use_backend
from harts.ops.chunked import gate_per_key, head_gate
from harts.ops.gated_linear_attention import (
    chunked_gated_linear_attention,
    naive_recurrent_gated_linear_attention,
)
from harts.ops.recurrence import ALL_RECURRENCES, DELTA_RULE, GATED_LINEAR_ATTENTION, Recurrence
from harts.ops.tree_attention import tree_attention
from harts.ops.tree_recurrence import tree_gated_delta_rule, tree_recurrence
from harts.plan.chunk_tree import chunk_tree_plan
from harts.plan.linear import plan_linear
from tests.helpers import PLAN_SHAPES
from tests.recurrence_checks import RECURRENCE_IDS, RECURRENCES, check_against_reference, recurrence_inputs

ATOL = 1e-5
GRAD_RTOL = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def gla_inputs(B, T, H, K, V, gate, seed=0):
    """q, k unit-norm (lightning attention's silu(q) has no norm: scale 0.5 keeps the state O(1)),
    v ~ N(0, 1), g per channel ('channel'), one per head expanded over K ('head') or passed per head
    [B, T, H] for the op to expand ('per-head'), or -U(0, 20)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    if gate == "channel":
        g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2.0)
    elif gate == "head":
        g = F.logsigmoid(torch.randn(B, T, H, 1, generator=gen) + 3.0).expand(B, T, H, K).contiguous()
    elif gate == "per-head":
        g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3.0)
    else:
        g = -torch.rand(B, T, H, K, generator=gen) * 20.0
    s0 = torch.randn(B, H, K, V, generator=gen)
    return [q, k, v, g, s0]


CASES = [  # (B, T, H, K, V, chunk, gate)
    (2, 37, 2, 8, 5, 16, "channel"),
    (3, 70, 2, 16, 8, 64, "head"),
    (2, 45, 2, 8, 4, 16, "per-head"),
    (2, 50, 1, 8, 1, 8, "strong20"),  # Mamba's selective-scan shape: V = 1
]


def _case_id(c):
    return f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-V{c[4]}-C{c[5]}-{c[6]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_chunked_gla_equals_reference_varlen_with_states(case):
    B, T, H, K, V, C, gate = case
    xs = gla_inputs(B, T, H, K, V, gate, seed=T)
    lengths = torch.tensor([T] + [max(0, T - 7 * b - 3) for b in range(1, B)])
    at = torch.stack([torch.tensor([0, 1, C, min(C + 3, T), T]) for _ in range(B)])
    q, k, v, g, s0 = (x.clone().requires_grad_() for x in xs)
    o, S, states = chunked_gated_linear_attention(
        q, k, v, g, s0, lengths=lengths, chunk_size=C, scale=0.5, output_states_at=at
    )
    gen = torch.Generator().manual_seed(1)
    wo, wS, wst = (torch.randn(x.shape, generator=gen) for x in (o, S, states))
    ((o * wo).sum() + (S * wS).sum() + (states * wst).sum()).backward()
    for b in range(B):
        L = int(lengths[b])
        ref = [x[b : b + 1, :L].double().requires_grad_() for x in xs[:4]]
        r0 = xs[4][b : b + 1].double().requires_grad_()
        on, Sn = naive_recurrent_gated_linear_attention(*ref, initial_state=r0, scale=0.5)
        assert (o[b, :L].double() - on[0]).abs().max() <= ATOL
        assert (o[b, L:] == 0).all()
        assert (S[b].double() - Sn[0]).abs().max() <= ATOL
        loss = (on[0] * wo[b, :L].double()).sum() + (Sn[0] * wS[b].double()).sum()
        for i, p in enumerate(at[b].tolist()):
            p = min(p, L)  # the state is frozen past the true length
            _, Sp = naive_recurrent_gated_linear_attention(*(x[:, :p] for x in ref), initial_state=r0)
            assert (states[b, i].double() - Sp[0]).abs().max() <= ATOL, f"segment {b}, state after {p}"
            loss = loss + (Sp[0] * wst[b, i].double()).sum()
        loss.backward()
        for name, got, want in zip("qkvg", (q, k, v, g), ref, strict=True):
            if L:
                assert rel(got.grad[b, :L], want.grad[0]) <= GRAD_RTOL, f"segment {b} grad {name}"
            assert (got.grad[b, L:] == 0).all()
        assert rel(s0.grad[b], r0.grad[0]) <= GRAD_RTOL, f"segment {b} grad of the initial state"


def test_gla_is_not_the_delta_rule_without_beta():
    """The delta-rule op with beta = 0 drops k v^T too: the two recurrences differ."""
    q, k, v, g, s0 = gla_inputs(1, 9, 1, 4, 3, "channel")
    o_gla, _ = naive_recurrent_gated_linear_attention(q, k, v, g, s0, scale=1.0)
    o_dr, _ = DELTA_RULE.reference(q, k, v, g, torch.zeros(1, 9, 1), s0, scale=1.0)
    assert (o_gla - o_dr).abs().max() > 1e-2


# ---- the contract over a forest ------------------------------------------------------------------
def _inputs_for(recurrence, n, h, dk, dv):
    """Inputs of ``recurrence`` with a gate per key channel in -U(0, 2)."""
    return recurrence_inputs(recurrence, "key", n, h, dk, dv)


def test_every_recurrence_is_listed_once():
    """ALL_RECURRENCES, which the contract's checks run over, holds every recurrence defined."""
    defined = [x for x in vars(recurrence_module).values() if isinstance(x, Recurrence)]
    assert {id(x) for x in defined} == {id(x) for x in ALL_RECURRENCES}
    assert len({r.name for r in ALL_RECURRENCES}) == len(ALL_RECURRENCES)


@pytest.mark.parametrize("recurrence", RECURRENCES, ids=RECURRENCE_IDS)
@pytest.mark.parametrize("mode", ["depth", "chain", "tree", "tree-C8"])
@pytest.mark.parametrize("name", ["caterpillar-D8", "short-parents-K4", "roots-3", "chunk-boundaries-T200"])
def test_tree_run_equals_each_trajectory_alone(name, mode, recurrence):
    torch.manual_seed(0)
    forest = harts.build_forest(PLAN_SHAPES[name])
    plan = chunk_tree_plan(forest, 8) if mode == "tree-C8" else plan_linear(forest, mode)
    check_against_reference(forest, plan, recurrence, "key")


def test_delta_rule_through_the_contract_is_the_delta_rule():
    """tree_gated_delta_rule is tree_recurrence(DELTA_RULE): same values, bit for bit."""
    torch.manual_seed(1)
    forest = harts.build_forest(PLAN_SHAPES["short-parents-K4"])
    plan = plan_linear(forest, "chain")
    inputs = _inputs_for(DELTA_RULE, forest.num_tokens, 2, 8, 4)
    a, sa = tree_gated_delta_rule(*inputs, plan)
    b, sb = tree_recurrence(DELTA_RULE, inputs, plan)
    assert torch.equal(a, b) and all(torch.equal(sa[m], sb[m]) for m in sa)


def test_contract_refuses_bad_inputs():
    forest = harts.build_forest(PLAN_SHAPES["roots-3"])
    plan = plan_linear(forest, "depth")
    q, k, v, g = _inputs_for(GATED_LINEAR_ATTENTION, forest.num_tokens, 2, 8, 4)
    with pytest.raises(ValueError, match="takes 4 inputs"):
        tree_recurrence(GATED_LINEAR_ATTENTION, (q, k, v), plan)
    with pytest.raises(ValueError, match="input 'g' must be"):
        tree_recurrence(GATED_LINEAR_ATTENTION, (q, k, v, g[:, :1]), plan)
    with pytest.raises(ValueError, match="the plan covers"):
        tree_recurrence(GATED_LINEAR_ATTENTION, (q[:3], k[:3], v[:3], g[:3]), plan)


def test_contract_takes_a_per_head_gate_and_refuses_other_shapes():
    forest = harts.build_forest(PLAN_SHAPES["roots-3"])
    plan = plan_linear(forest, "depth")
    q, k, v, g, beta = _inputs_for(DELTA_RULE, forest.num_tokens, 2, 8, 4)
    head = g[..., 0].detach().requires_grad_()
    expanded, _ = tree_recurrence(DELTA_RULE, (q, k, v, head[..., None].expand_as(k), beta), plan)
    for gate in (head, head[..., None]):
        out, _ = tree_recurrence(DELTA_RULE, (q, k, v, gate, beta), plan)
        assert torch.equal(out, expanded)
    with pytest.raises(ValueError, match="one per head"):
        tree_recurrence(DELTA_RULE, (q, k, v, g[..., :3], beta), plan)


def test_gate_shapes():
    """A gate [..., H] or [..., H, 1] is per head; [..., H, K] is per key channel however equal its
    channels (their gradients are K free values)."""
    k = torch.randn(6, 2, 4)
    head = -torch.rand(6, 2)
    assert torch.equal(head_gate(head, k), head) and torch.equal(head_gate(head[..., None], k), head)
    assert head_gate(head[..., None].expand(6, 2, 4), k) is None
    assert gate_per_key(head, k).shape == k.shape and torch.equal(gate_per_key(head, k)[..., 3], head)
    per_key = -torch.rand(6, 2, 4)
    assert gate_per_key(per_key, k) is per_key


def _recording_backend(name: str, recurrence, calls: list):
    """A backend that runs ``recurrence``'s plain op and records the gate each call hands it; it
    names nothing else, so attention and every other recurrence keep their plain kernels."""

    def kernel(*args, **kwargs):
        calls.append(tuple(args[recurrence.inputs.index("g")].shape))
        return recurrence.chunked(*args, **kwargs)

    register_backend(name, lambda: Backend(name, {recurrence.name: kernel}))


def test_a_backend_names_only_what_it_accelerates():
    """A backend of a name alone is the torch backend's set of kernels: every recurrence's plain op
    and the plain tree attention."""
    bare = Backend("bare")
    assert bare.recurrences == {} and bare.attention is tree_attention
    with use_backend("torch") as torch_backend:
        assert torch_backend.recurrences == {} and torch_backend.attention is tree_attention
        assert all(r.kernel() is r.chunked for r in ALL_RECURRENCES)


def _per_head_gate(recurrence, inputs):
    """``inputs`` with the gate g as one value per head [N, H] where ``recurrence`` takes it so."""
    if "g" not in recurrence.per_head_inputs:
        return inputs
    at = recurrence.inputs.index("g")
    return (*inputs[:at], inputs[at][..., 0], *inputs[at + 1 :])


@pytest.mark.parametrize("named", RECURRENCES, ids=RECURRENCE_IDS)
def test_a_backend_supplies_a_kernel_for_any_recurrence_by_name(named):
    """A backend that names one recurrence runs every call of it, and leaves the others (which it
    does not name) on their plain ops; a per-head gate reaches the kernel unexpanded."""
    forest = harts.build_forest(PLAN_SHAPES["short-parents-K4"])
    plan = plan_linear(forest, "chain")
    calls: list = []
    _recording_backend(f"{named.name}-recording", named, calls)
    inputs = [_per_head_gate(r, _inputs_for(r, forest.num_tokens, 2, 8, 4)) for r in RECURRENCES]
    want = [tree_recurrence(r, x, plan)[0] for r, x in zip(RECURRENCES, inputs, strict=True)]
    with use_backend(f"{named.name}-recording"):
        got = []
        for r, x in zip(RECURRENCES, inputs, strict=True):
            got.append(tree_recurrence(r, x, plan)[0])
            if r is named:  # a per-head gate as [W, T, H]
                dims = 3 if "g" in named.per_head_inputs else 4
                assert len(calls) == plan.num_calls and all(len(shape) == dims for shape in calls)
    assert len(calls) == plan.num_calls
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
