"""Sliding-window and sink tree attention against the plain per-token definition.

The reference (:func:`harts.ops.tree_attention.path_attention_reference`) walks each query's own
path, keeps its last W keys and, with sinks, adds the head's sink logit to the softmax
denominator, in float64. Outputs and the gradients of q, k, v and the sinks are compared, on the
fused CPU flash path and on the recompute path of other devices, with external keys (a cut part)
and several head layouts. Windows: 1 (each token sees itself), 2, 3, 7, and one as long as the
longest path (the plain plan). Sinks also run over plans with a shared-prefix call wherever a block
reads ancestor keys (the sink joins each query's block, once); a windowed plan has none.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.ops.tree_attention import masked_tree_attention, path_attention_reference, tree_attention
from harts.plan.attention import plan_reference_mask, plan_tree_attention
from tests.helpers import ATTENTION_FORESTS, ATTENTION_SCALE, fused_kernels, plan_args, shared_prefixes


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _paths(forest, ext: int) -> list[torch.Tensor]:
    """Key rows of each query's path (query t is forest token ext + t), root first, itself last."""
    prev = forest.token_previous.tolist()
    paths = []
    for t in range(ext, forest.num_tokens):
        path, at = [], t
        while at >= 0:
            path.append(at)
            at = prev[at]
        paths.append(torch.tensor(path[::-1]))
    return paths


def _check(trajectories, window, sinks: bool, cut=0, heads=(4, 2), dk=8, dv=5, dtype=torch.float64,
           fused=True, tol=1e-10, prefixes="default"):
    torch.manual_seed(0)
    forest = harts.build_forest(trajectories)
    args, ext = plan_args(forest, cut)
    n, m = args["num_queries"], args["num_keys"]
    h, hkv = heads
    q = torch.randn(h, n, dk, dtype=dtype, requires_grad=True)
    k = torch.randn(hkv, m, dk, dtype=dtype, requires_grad=True)
    v = torch.randn(hkv, m, dv, dtype=dtype, requires_grad=True)
    s = (torch.randn(h, dtype=dtype) * 2).requires_grad_() if sinks else None
    w = torch.randn(n, h, dv, dtype=dtype)
    with shared_prefixes(prefixes):
        plan = plan_tree_attention(**args)
    leaves = [x for x in (q, k, v, s) if x is not None]
    with fused_kernels(fused):
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE, window=window, sinks=s)
        grads = torch.autograd.grad((out * w).sum(), leaves)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    q64, k64, v64 = leaves64[:3]
    s64 = leaves64[3] if sinks else None
    ref = path_attention_reference(q64, k64, v64, _paths(forest, ext), ATTENTION_SCALE, window=window,
                                   sinks=s64)
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), leaves64)
    assert (out.double() - ref).abs().max() <= tol
    for name, g, r in zip("qkvs", grads, ref_grads, strict=False):
        err = (g.double() - r).abs().max()
        assert err <= tol * max(1.0, float(r.abs().max())), f"d{name}: {err:.3g}"
    return plan, out


WINDOWS = [1, 2, 3, 7]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"W{w}" for w in WINDOWS])
@pytest.mark.parametrize("name", ["deep-binary-D5-S3", "one-token-nodes-D4", "roots-R4"])
def test_window_matches_per_token_paths(name, window, fused):
    _check(ATTENTION_FORESTS[name], window, sinks=False, fused=fused)


@pytest.mark.parametrize("prefixes", ["default", "all"])
@pytest.mark.parametrize("window", [None, 1, 5], ids=["full", "W1", "W5"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("name", ["star-P40-G6", "one-token-nodes-D4"])
def test_sinks_match_per_token_paths(name, fused, window, prefixes):
    plan, _ = _check(ATTENTION_FORESTS[name], window, sinks=True, fused=fused, prefixes=prefixes)
    assert bool(plan.prefixes) == (prefixes == "all")  # the plan as built; a window runs its own


@pytest.mark.parametrize(("name", "cut"), [("star-P40-G6", 1), ("deep-binary-D5-S3", 3)])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_window_with_external_keys(name, cut, sinks):
    """A cut part: ancestors' keys computed earlier; the window still counts along the whole path."""
    _check(ATTENTION_FORESTS[name], 4, sinks=sinks, cut=cut)


@pytest.mark.parametrize("heads,dk,dv", [((4, 4), 8, 8), ((4, 1), 6, 10), ((6, 2), 8, 3)],
                         ids=["H4-Hkv4-K8-V8", "H4-Hkv1-K6-V10", "H6-Hkv2-K8-V3"])
def test_window_and_sinks_heads_and_widths(heads, dk, dv):
    _check(ATTENTION_FORESTS["deep-binary-D5-S3"], 5, sinks=True, cut=2, heads=heads, dk=dk, dv=dv)
    _check(ATTENTION_FORESTS["deep-binary-D5-S3"], None, sinks=True, cut=2, heads=heads, dk=dk, dv=dv,
           prefixes="all")


def test_float32_flash_path_with_window_and_sinks():
    _check(ATTENTION_FORESTS["long-P700-G3"], 64, sinks=True, cut=1, heads=(4, 2), dk=16, dv=16,
           dtype=torch.float32, tol=2e-5)


def test_windowed_plan_gathers_only_the_window():
    """On a 700-token trunk, a window of 32 bounds the keys a block gathers and the exact cost; the
    windowed plan has no shared prefixes (a window's keys differ from query to query)."""
    forest = harts.build_forest(ATTENTION_FORESTS["long-P700-G3"])
    args, _ = plan_args(forest, 0)
    with shared_prefixes("all"):
        plan = plan_tree_attention(**args)
    windowed = plan.windowed(32)
    assert windowed.window == 32 and windowed is plan.windowed(32)
    assert plan.prefixes and not windowed.prefixes
    assert max(g.lk - g.lq for g in windowed.groups) <= 31
    positions = forest.token_position
    assert windowed.exact_cost == int(torch.clamp(positions + 1, max=32).sum())
    assert windowed.padded_cost <= 1.5 * windowed.exact_cost < plan.exact_cost / 10
    # a window covering every path is the plain plan
    assert plan.windowed(int(positions.max()) + 1) is plan


@pytest.mark.parametrize("window", [1, 3, 9])
def test_reference_mask_window(window):
    """The dense windowed mask agrees with the per-token definition (both references)."""
    forest = harts.build_forest(ATTENTION_FORESTS["one-token-nodes-D4"])
    args, _ = plan_args(forest, 0)
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, forest.num_tokens, 4, dtype=torch.float64) for _ in range(3))
    dense = masked_tree_attention(q, k, v, plan_reference_mask(**args, window=window), ATTENTION_SCALE)
    loop = path_attention_reference(q, k, v, _paths(forest, 0), ATTENTION_SCALE, window=window)
    assert torch.allclose(dense, loop, atol=1e-12, rtol=0)


def test_window_is_not_a_no_op():
    """The comparison can fail: W=2 differs from full attention on a path longer than 2."""
    forest = harts.build_forest(ATTENTION_FORESTS["chain-N3-T30"])
    args, _ = plan_args(forest, 0)
    q, k, v = (torch.randn(2, forest.num_tokens, 4, dtype=torch.float64) for _ in range(3))
    plan = plan_tree_attention(**args)
    full = tree_attention(q, k, v, plan, ATTENTION_SCALE)
    win = tree_attention(q, k, v, plan, ATTENTION_SCALE, window=2)
    assert (full - win).abs().max() > 1e-2


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_refused(window):
    args, _ = plan_args(harts.build_forest(ATTENTION_FORESTS["chain-N3-T30"]), 0)
    plan = plan_tree_attention(**args)
    q = k = v = torch.randn(2, plan.num_queries, 4)
    with pytest.raises(ValueError, match="sliding window must be a positive integer"):
        tree_attention(q, k, v, plan, ATTENTION_SCALE, window=window)


def test_bad_sinks_refused():
    args, _ = plan_args(harts.build_forest(ATTENTION_FORESTS["chain-N3-T30"]), 0)
    plan = plan_tree_attention(**args)
    q = k = v = torch.randn(2, plan.num_queries, 4)
    with pytest.raises(ValueError, match="sinks must be"):
        tree_attention(q, k, v, plan, ATTENTION_SCALE, sinks=torch.zeros(3))


def test_flex_backend_refuses_windows_and_sinks():
    """The FlexAttention tree attention has no window or sink form: one line, not a wrong result."""
    from harts.ops.fla_backend import flex_tree_attention

    args, _ = plan_args(harts.build_forest(ATTENTION_FORESTS["chain-N3-T30"]), 0)
    plan = plan_tree_attention(**args)
    q = k = v = torch.randn(2, plan.num_queries, 4)
    for extra in ({"window": 4}, {"sinks": torch.zeros(2)}):
        with pytest.raises(ValueError, match="no sliding window or attention sinks"):
            flex_tree_attention(q, k, v, plan, ATTENTION_SCALE, **extra)
