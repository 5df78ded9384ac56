"""The ``fla`` backend's delta rule against the plain references, outputs and gradients, in fp32.

Each case runs fla's triton kernels (under the interpreter on a CPU, conftest.py) through
:func:`harts.ops.fla_backend.fla_delta_rule`, and compares with a per-segment loop of the fp64
per-token recurrence (``harts.ops.delta_rule.naive``), each segment from its own initial state, or
with the plain chunked kernel (``harts.ops.delta_rule``) where inner states are asked for. A
negative control shows a swap of two segments' initial states would be caught. Shapes are tiny:
under the interpreter chunk_kda's forward takes about 9 s a call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harts
from harts.ops.backends import use_backend
from harts.ops.delta_rule import chunked_gated_delta_rule, naive_recurrent_gated_delta_rule
from harts.ops.fla_backend import fla_delta_rule
from harts.ops.tree_recurrence import tree_gated_delta_rule
from harts.plan.layout import TreeLayout
from tests_kernels.device import DEVICE

OUT_ATOL = 1e-5  # fp32 kernel vs fp64 recurrence, max |diff| of outputs and states (values ~1)
GRAD_RTOL = 1e-5  # relative norm error of each input's gradient
LENGTHS = [40, 17, 29]  # one segment a chunk-and-a-bit shorter than T, one in the middle
H, K, V = 2, 16, 16


def _inputs(per_head: bool, lengths=LENGTHS, seed=0):
    """Leaves (q, k, v, gate, beta, h0) and g as the kernel sees it: [B, T, H] per head (GDN, as the
    contract passes it), [B, T, H, K] per key channel (KDA)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(DEVICE).requires_grad_()
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(DEVICE).requires_grad_()
    v = torch.randn(B, T, H, V, generator=gen).to(DEVICE).requires_grad_()
    gate = (-torch.rand(B, T, H, *(() if per_head else (K,)), generator=gen)).to(DEVICE).requires_grad_()
    beta = torch.rand(B, T, H, generator=gen).to(DEVICE).requires_grad_()
    h0 = torch.randn(B, H, K, V, generator=gen).to(DEVICE).requires_grad_()
    return (q, k, v, gate, beta, h0), gate


def _weights(o, final, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(o.shape, generator=gen).to(o.device),
            torch.randn(final.shape, generator=gen).to(o.device))


def _rel(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def _per_segment_reference(leaves, g, lengths):
    """fp64: each segment alone from its own initial state; (o [B, T, H, V], final [B, H, K, V])."""
    q, k, v, _, beta, h0 = leaves
    outs, finals = [], []
    for b, n in enumerate(lengths):
        seg = (x[b:b + 1, :n] for x in (q, k, v, g, beta))
        o, s = naive_recurrent_gated_delta_rule(*seg, initial_state=h0[b:b + 1])
        outs.append(F.pad(o[0], (0, 0, 0, 0, 0, q.shape[1] - n)))
        finals.append(s[0])
    return torch.stack(outs), torch.stack(finals)


def _check_against_reference(per_head: bool):
    leaves, g = _inputs(per_head)
    q, k, v, _, beta, h0 = leaves
    lengths = torch.tensor(LENGTHS)
    o, final = fla_delta_rule(q, k, v, g, beta, initial_state=h0, lengths=lengths)
    w_o, w_f = _weights(o, final)
    grads = torch.autograd.grad((o * w_o).sum() + (final * w_f).sum(), leaves)
    ref_o, ref_f = _per_segment_reference(leaves, g, LENGTHS)
    ref_grads = torch.autograd.grad((ref_o * w_o.double()).sum() + (ref_f * w_f.double()).sum(), leaves)
    assert o.dtype == q.dtype and final.dtype == torch.float32
    assert (o.double() - ref_o).abs().max() <= OUT_ATOL
    assert (final.double() - ref_f).abs().max() <= OUT_ATOL
    for name, got, ref in zip(("q", "k", "v", "g", "beta", "h0"), grads, ref_grads, strict=True):
        assert _rel(got, ref) <= GRAD_RTOL, name


@pytest.mark.parametrize("per_head", [True, False], ids=["gdn-B3-T40-H2-K16", "kda-B3-T40-H2-K16"])
def test_varlen_segments_with_own_initial_states(per_head):
    _check_against_reference(per_head)


def test_swapped_initial_states_are_caught():
    """Negative control: the same call with two segments' initial states swapped fails the bound."""
    leaves, g = _inputs(per_head=True)
    q, k, v, _, beta, h0 = leaves
    with torch.no_grad():
        swapped = h0[[1, 0, 2]]
        o, final = fla_delta_rule(q, k, v, g, beta, initial_state=swapped, lengths=torch.tensor(LENGTHS))
        ref_o, ref_f = _per_segment_reference(leaves, g, LENGTHS)
    assert (o.double() - ref_o).abs().max() > 100 * OUT_ATOL
    assert (final.double() - ref_f).abs().max() > 100 * OUT_ATOL


def test_inner_states_by_split_segments():
    """``output_states_at`` (offsets inside, at 0, at and past the end) runs as rounds of pieces."""
    leaves, g = _inputs(per_head=True)
    q, k, v, _, beta, h0 = leaves
    lengths = torch.tensor(LENGTHS)
    at = torch.tensor([[10, 25, 40], [0, 5, 17], [29, 33, 29]])
    args = (q, k, v, g, beta)
    o, final, states = fla_delta_rule(*args, initial_state=h0, lengths=lengths, output_states_at=at)
    ref = chunked_gated_delta_rule(*args, initial_state=h0, lengths=lengths, output_states_at=at,
                                   chunk_size=16)
    weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(x.device)
               for i, x in enumerate(ref)]

    def loss(outputs):
        return sum((x * w).sum() for x, w in zip(outputs, weights, strict=True))

    got_grads = torch.autograd.grad(loss((o, final, states)), leaves)
    ref_grads = torch.autograd.grad(loss(ref), leaves)
    for got, want in zip((o, final, states), ref, strict=True):
        assert (got - want).abs().max() <= OUT_ATOL
    for name, got, want in zip(("q", "k", "v", "g", "beta", "h0"), got_grads, ref_grads, strict=True):
        assert _rel(got, want.double()) <= GRAD_RTOL, name


def test_equal_channel_gate_keeps_per_channel_gradients():
    """A per-channel gate leaf whose K values coincide runs chunk_kda: its per-channel gradient
    matches the plain kernel's (the per-head kernel would give one summed column)."""
    leaves, g_head = _inputs(per_head=True, lengths=[9, 5], seed=3)
    q, k, v, _, beta, h0 = leaves
    g = g_head[..., None].expand(*g_head.shape, K).detach().clone().requires_grad_()
    lengths = torch.tensor([9, 5])
    o, final = fla_delta_rule(q, k, v, g, beta, initial_state=h0, lengths=lengths)
    ref_o, ref_f = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=h0, lengths=lengths, chunk_size=8)
    w_o, w_f = _weights(o, final)
    got = torch.autograd.grad((o * w_o).sum() + (final * w_f).sum(), g)[0]
    ref = torch.autograd.grad((ref_o * w_o).sum() + (ref_f * w_f).sum(), g)[0]
    assert ref[..., 1:].abs().max() > 1e-3  # the control: the other channels' gradients are not zero
    assert _rel(got, ref.double()) <= GRAD_RTOL


@pytest.mark.parametrize("recompute", [False, True], ids=["chain-plan", "chain-plan-recompute"])
def test_tree_delta_rule_under_fla_backend(recompute):
    """The tree executor's calls (chain plan: inner node states, state hand-off) give the same
    outputs, node states and gradients under ``use_backend("fla")`` as under the torch backend."""
    forest = harts.build_forest([[1, 2, 3, 4, 5], [1, 2, 6], [1, 7, 8, 9, 10], [1, 7, 11], [12, 13]])
    plan = TreeLayout(forest, DEVICE, linear_mode="chain").linear_plan
    assert any(call.num_boundaries for call in plan.calls)  # the case that needs split segments
    n = forest.num_tokens
    gen = torch.Generator().manual_seed(5)
    q = F.normalize(torch.randn(n, H, K, generator=gen), dim=-1).to(DEVICE).requires_grad_()
    k = F.normalize(torch.randn(n, H, K, generator=gen), dim=-1).to(DEVICE).requires_grad_()
    v = torch.randn(n, H, V, generator=gen).to(DEVICE).requires_grad_()
    head = (-torch.rand(n, H, generator=gen)).to(DEVICE).requires_grad_()
    beta = torch.rand(n, H, generator=gen).to(DEVICE).requires_grad_()
    leaves = (q, k, v, head, beta)

    def run():
        out, states = tree_gated_delta_rule(q, k, v, head, beta, plan, recompute=recompute)
        node_states = torch.stack([states[i] for i in sorted(states)])
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(DEVICE)
        ws = torch.randn(node_states.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
        return out, node_states, torch.autograd.grad((out * w).sum() + (node_states * ws).sum(), leaves)

    with use_backend("fla"):
        out, states, grads = run()
    ref_out, ref_states, ref_grads = run()
    assert (out - ref_out).abs().max() <= OUT_ATOL
    assert (states - ref_states).abs().max() <= OUT_ATOL
    for name, got, want in zip(("q", "k", "v", "g", "beta"), grads, ref_grads, strict=True):
        assert _rel(got, want.double()) <= GRAD_RTOL, name
