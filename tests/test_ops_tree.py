"""Tree ops against per-trajectory references: attention, short conv, delta-rule handoff, log-probs.

Each tree op runs once over a forest's unique tokens; its reference runs the plain sequence form
on every trajectory alone (SDPA causal, nn.functional.conv1d with left zero padding, the fp64
recurrence) and gathers the same rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harts
from harts.ops.delta_rule import naive_recurrent_gated_delta_rule
from harts.ops.logprobs import plain_token_logprobs, token_logprobs
from harts.ops.short_conv import tree_short_conv
from harts.ops.tree_attention import tree_attention
from harts.ops.tree_recurrence import tree_gated_delta_rule
from harts.plan.layout import TreeLayout
from tests.helpers import OP_FORESTS


def _per_trajectory(forest, fn, x):
    """Apply ``fn`` to each trajectory's rows of ``x`` and return the rows, trajectory by trajectory."""
    return [fn(x[forest.trajectory_token_indices(i)]) for i in range(forest.num_trajectories)]


def _tree_rows(forest, y):
    return [y[forest.trajectory_token_indices(i)] for i in range(forest.num_trajectories)]


@pytest.mark.parametrize("name", list(OP_FORESTS))
def test_tree_attention_equals_causal_per_trajectory(name):
    torch.manual_seed(0)
    forest = harts.build_forest(OP_FORESTS[name])
    layout = TreeLayout(forest)
    n = forest.num_tokens
    q = torch.randn(4, n, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, n, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, n, 5, dtype=torch.float64, requires_grad=True)
    out = tree_attention(q, k, v, layout.attention_plan, scaling=0.3)
    w = torch.randn_like(out)
    got_grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_loss = 0.0
    for i in range(forest.num_trajectories):
        idx = forest.trajectory_token_indices(i)
        ref = F.scaled_dot_product_attention(
            q[:, idx],
            k[:, idx].repeat_interleave(2, 0),
            v[:, idx].repeat_interleave(2, 0),
            is_causal=True,
            scale=0.3,
        ).transpose(0, 1)
        assert torch.allclose(out[idx], ref, atol=1e-12)
        # each trajectory's loss weights its own rows; shared rows are summed over trajectories
        ref_loss = ref_loss + (ref * w[idx] / forest.token_multiplicity[idx][:, None, None]).sum()
    ref_grads = torch.autograd.grad(ref_loss, (q, k, v))
    for g, r in zip(got_grads, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-10)


@pytest.mark.parametrize("name", list(OP_FORESTS))
def test_short_conv_equals_conv1d_per_trajectory(name):
    torch.manual_seed(0)
    forest = harts.build_forest(OP_FORESTS[name])
    x = torch.randn(forest.num_tokens, 6, dtype=torch.float64)
    w = torch.randn(6, 4, dtype=torch.float64)
    bias = torch.randn(6, dtype=torch.float64)
    got = tree_short_conv(x, w, forest.token_predecessors(4), bias)

    def conv(rows):
        return F.conv1d(rows.t()[None], w[:, None], bias, padding=3, groups=6)[0, :, : rows.shape[0]].t()

    for g, r in zip(_tree_rows(forest, got), _per_trajectory(forest, conv, x), strict=True):
        assert torch.allclose(g, r, atol=1e-12)


@pytest.mark.parametrize("name", list(OP_FORESTS))
def test_tree_delta_rule_hands_state_to_children(name):
    torch.manual_seed(0)
    forest = harts.build_forest(OP_FORESTS[name])
    plan = TreeLayout(forest).linear_plan
    n, h, dk, dv = forest.num_tokens, 2, 8, 4
    q = F.normalize(torch.randn(n, h, dk), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(n, h, dk), dim=-1).requires_grad_()
    v = torch.randn(n, h, dv, requires_grad=True)
    g = (-torch.rand(n, h, dk) * 2).requires_grad_()
    beta = torch.rand(n, h, requires_grad=True)
    inputs = (q, k, v, g, beta)
    out, _ = tree_gated_delta_rule(*inputs, plan)
    w = torch.randn_like(out)
    got_grads = torch.autograd.grad((out * w).sum(), inputs)
    ref_loss = 0.0
    for i in range(forest.num_trajectories):
        idx = forest.trajectory_token_indices(i)
        ref, _ = naive_recurrent_gated_delta_rule(*(t[idx][None] for t in inputs))
        assert (out[idx].double() - ref[0]).abs().max() <= 1e-5
        ref_loss = ref_loss + (ref[0] * w[idx].double() / forest.token_multiplicity[idx][:, None, None]).sum()
    ref_grads = torch.autograd.grad(ref_loss, inputs)
    for g_, r in zip(got_grads, ref_grads, strict=True):
        assert (g_.double() - r).norm() / r.norm() <= 1e-5


@pytest.mark.parametrize("read", ["both", "logprob", "entropy"])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1024], ids=lambda c: f"chunk{c}")
def test_chunked_logprobs_match_full_logits(chunk_rows, read):
    """Values and gradients against full logits, with the loss reading both outputs or one (the
    chunked backward then skips the other's term)."""
    torch.manual_seed(0)
    hidden = torch.randn(7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    predictor = torch.tensor([0, 0, 3, 6, 6, 6, 2])  # repeated predictors with different targets
    target = torch.tensor([1, 2, 3, 4, 5, 4, 49])
    w_lp, w_ent = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    results = []
    for fn in (lambda *a: token_logprobs(*a, chunk_rows=chunk_rows), plain_token_logprobs):
        lp, ent = fn(hidden, weight, predictor, target, bias)
        terms = {"logprob": (lp * w_lp).sum(), "entropy": (ent * w_ent).sum()}
        loss = sum(terms.values()) if read == "both" else terms[read]
        grads = torch.autograd.grad(loss, (hidden, weight, bias))
        results.append((lp, ent, *grads))
    for got, ref in zip(*results, strict=True):
        assert torch.allclose(got.double(), ref.double(), atol=1e-10), (got, ref)
