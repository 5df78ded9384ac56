"""Grouped tree attention against the dense-mask form and against causal SDPA per trajectory.

A forest's nodes become the plan's nodes; with ``cut`` > 0 the first ``cut`` nodes (pre-order)
are external: their tokens exist only as keys (computed in an earlier micro-batch), so the key
space is larger than the query space and query rows are shifted by the external token count.
Outputs and gradients of q, k, v are compared in float64; float32 cases run CPU flash attention.
``fused=False`` sends every group down the backward that recomputes the group's forward (the path
of non-CPU devices) instead of CPU flash attention's fused backward kernel. ``prefixes`` plans
shared-prefix calls as the defaults choose ("default"), wherever a block reads ancestor keys
("all"), or never ("off"; tests of the groups' own machinery).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import harts
from harts.ops.tree_attention import masked_tree_attention, tree_attention
from harts.plan.attention import plan_reference_mask, plan_tree_attention
from tests.helpers import (
    ATTENTION_FORESTS,
    ATTENTION_SCALE,
    dense_plans,
    fused_kernels,
    padding_by,
    plan_args,
    shared_prefixes,
    token_run,
)

GATHER = importlib.import_module("harts.ops.tree_attention.gather")
GROUPED = importlib.import_module("harts.ops.tree_attention.grouped")
DENSE = importlib.import_module("harts.ops.tree_attention.dense")
PLAN_ATTENTION = importlib.import_module("harts.plan.attention")
ATOL_OUT = 1e-10
ATOL_GRAD = 1e-10


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny ops: on a shared 2-core machine, intra-op threads spin-wait far longer than they compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _groups_unless_asked():
    """Plans built here run their groups unless a test asks for dense plans (``dense=``)."""
    with dense_plans("off"):
        yield


def _check(trajectories, cut=0, heads=(4, 2), dk=8, dv=5, budget=None, dtype=torch.float64,
           tol=(ATOL_OUT, ATOL_GRAD), fused=True, prefixes="default", dense="off"):
    atol, atol_grad = tol
    torch.manual_seed(0)
    forest = harts.build_forest(trajectories)
    args, ext = plan_args(forest, cut)
    n, m = args["num_queries"], args["num_keys"]
    h, hkv = heads
    q = torch.randn(h, n, dk, dtype=dtype, requires_grad=True)
    k = torch.randn(hkv, m, dk, dtype=dtype, requires_grad=True)
    v = torch.randn(hkv, m, dv, dtype=dtype, requires_grad=True)
    w = torch.randn(n, h, dv, dtype=dtype)
    with shared_prefixes(prefixes):
        plan = plan_tree_attention(**args, max_group_tokens=budget)
    with fused_kernels(fused), dense_plans(dense):
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE)
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))

    # reference 1: the dense [n, m] mask of the same plan arguments
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = masked_tree_attention(q64, k64, v64, plan_reference_mask(**args), ATTENTION_SCALE)
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), (q64, k64, v64))
    assert torch.allclose(out.double(), ref, atol=atol, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g.double(), r, atol=atol_grad, rtol=0)

    # reference 2: causal SDPA on each trajectory alone; external rows get queries of their own
    q_full = torch.cat([torch.randn(h, ext, dk, dtype=torch.float64), q64], dim=1)
    w_full = torch.cat([torch.zeros(ext, h, dv, dtype=torch.float64), w.double()])
    loss = 0.0
    for i in range(forest.num_trajectories):
        idx = forest.trajectory_token_indices(i)
        y = F.scaled_dot_product_attention(
            q_full[:, idx], k64[:, idx].repeat_interleave(h // hkv, 0),
            v64[:, idx].repeat_interleave(h // hkv, 0), is_causal=True, scale=ATTENTION_SCALE,
        ).transpose(0, 1)
        mine = idx >= ext
        assert torch.allclose(out.double()[idx[mine] - ext], y[mine], atol=atol, rtol=0)
        # shared rows are summed over the trajectories through them, so weight by 1 / multiplicity
        loss = loss + (y * w_full[idx] / forest.token_multiplicity[idx][:, None, None]).sum()
    traj_grads = torch.autograd.grad(loss, (q_full, k64, v64))
    traj_grads = (traj_grads[0][:, ext:],) + traj_grads[1:]
    for g, r in zip(grads, traj_grads, strict=True):
        assert torch.allclose(g.double(), r, atol=atol_grad, rtol=0)
    return plan


@pytest.mark.parametrize("dense", ["off", "on"])
@pytest.mark.parametrize("name", list(ATTENTION_FORESTS))
def test_tree_attention_matches_references(name, dense):
    plan = _check(ATTENTION_FORESTS[name], dense=dense)
    with dense_plans(dense):
        assert plan.dense_for(4, 8) == (dense == "on")


@pytest.mark.parametrize("name", ["star-P40-G6", "deep-binary-D5-S3", "long-P700-G3"])
def test_tree_attention_small_group_budget(name):
    plan = _check(ATTENTION_FORESTS[name], budget=2048)
    assert len(plan.groups) > 1


@pytest.mark.parametrize("name,cut", [("star-P40-G6", 1), ("deep-binary-D5-S3", 3), ("roots-R4", 2),
                                      ("long-P700-G3", 1)])
@pytest.mark.parametrize("dense", ["off", "on"])
def test_tree_attention_external_keys(name, cut, dense):
    _check(ATTENTION_FORESTS[name], cut=cut, dense=dense)


@pytest.mark.parametrize("heads,dk,dv", [((4, 4), 8, 8), ((4, 1), 6, 10), ((6, 2), 8, 3)],
                         ids=["H4-Hkv4-K8-V8", "H4-Hkv1-K6-V10", "H6-Hkv2-K8-V3"])
@pytest.mark.parametrize("dense", ["off", "on"])
def test_tree_attention_heads_and_widths(heads, dk, dv, dense):
    _check(ATTENTION_FORESTS["deep-binary-D5-S3"], cut=2, heads=heads, dk=dk, dv=dv, dense=dense)


@pytest.mark.parametrize("dense", ["off", "on"])
def test_tree_attention_float32_flash_path(dense):
    """Dk == Dv in float32 takes CPU flash attention, where the padding channel (or the dense mask's
    hidden keys) must still be exact."""
    _check(ATTENTION_FORESTS["long-P700-G3"], cut=1, heads=(4, 2), dk=16, dv=16, dtype=torch.float32,
           tol=(2e-5, 2e-5), dense=dense)


def test_plan_cost_is_near_exact():
    # agentic shape, scaled down: a 960-token root, 8 children of 120, each with 2 children of 60
    trajs = [token_run(1, 960) + token_run(2000 + 200 * c, 120) + [5000 + 2 * c + g] * 60
             for c in range(8) for g in range(2)]
    forest = harts.build_forest(trajs)
    args, _ = plan_args(forest, 0)
    plan = plan_tree_attention(**args)
    positions = forest.token_position
    assert plan.exact_cost == int((positions + 1).sum())
    assert plan.padded_cost <= 1.5 * plan.exact_cost


@pytest.mark.parametrize("prefixes", ["off", "all", "dense"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("trajs", [[[3]], [[7], [7], [8], [7, 9]], ATTENTION_FORESTS["one-token-leaves-R2"]],
                         ids=["lone-token", "one-token-trajs", "one-token-leaves"])
def test_lone_key_gives_exactly_zero_query_gradient(trajs, fused, prefixes):
    """A query with a single key (a one-token root) returns that value; in exact arithmetic its query
    gradient is zero, and so is the key gradient of a token no other token sees. With shared
    prefixes too: those blocks run apart from the one-key blocks a prefix reaches, on the exact
    path, whatever the fused kernels' rounding; in a dense plan, their rows' gradients bypass the
    kernel."""
    forest = harts.build_forest(trajs)
    args, _ = plan_args(forest, 0)
    q, k, v = (torch.randn(2, forest.num_tokens, 8, requires_grad=True) for _ in range(3))
    with shared_prefixes("off" if prefixes == "dense" else prefixes):
        plan = plan_tree_attention(**args)
    assert bool(plan.prefixes) == (prefixes == "all" and max(map(len, trajs)) > 1)
    if plan.prefixes:  # the root's one key runs apart from the one-key blocks a prefix reaches
        assert plan.lone_unmerged() and len([g for g in plan.groups if g.lk == 1]) > len(plan.lone_unmerged())
    with fused_kernels(fused), dense_plans("on" if prefixes == "dense" else "off"):
        assert plan.dense_for(2, 8) == (prefixes == "dense")
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE)
        dq, dk = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k))
    first = torch.zeros(forest.num_tokens, dtype=torch.bool)  # one-token roots: their key is their path
    first[forest.node_start[(forest.node_parent < 0) & (forest.node_length == 1)]] = True
    assert torch.equal(out[first], v[:, first].detach().transpose(0, 1))
    assert dq[:, first].abs().max() == 0
    alone = first & (plan_reference_mask(**args).sum(0) == 1)  # roots no other query sees
    assert alone.any() and dk[:, alone].abs().max() == 0


def test_plan_rejects_uncovered_queries():
    args, _ = plan_args(harts.build_forest(ATTENTION_FORESTS["star-P40-G6"]), 0)
    args["num_queries"] += 1
    args["num_keys"] += 1
    with pytest.raises(ValueError, match="exactly once"):
        plan_tree_attention(**args)


@pytest.mark.parametrize("bad", [-1, "num_keys"])
def test_plan_rejects_ancestor_keys_out_of_range(bad):
    """An ancestor key row outside [0, num_keys) is refused, naming the first node that holds one,
    whether the lists are tensors or host arrays."""
    args, _ = plan_args(harts.build_forest(ATTENTION_FORESTS["star-P40-G6"]), 0)
    anc = [a.clone() for a in args["node_ancestor_keys"]]
    node = next(m for m, a in enumerate(anc) if m > 1 and a.numel())
    anc[node][-1] = args["num_keys"] if bad == "num_keys" else bad
    for lists in (anc, [a.numpy() for a in anc]):
        with pytest.raises(ValueError, match=f"node {node}: ancestor key rows must lie in"):
            plan_tree_attention(**{**args, "node_ancestor_keys": lists})


@settings(max_examples=40, deadline=None)
@given(
    trajs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=12), min_size=1, max_size=8),
    cut_frac=st.floats(0, 0.9),
    budget=st.sampled_from([None, 64, 600]),
    fused=st.booleans(),
    prefixes=st.sampled_from(["off", "all"]),
    dense=st.sampled_from(["off", "on"]),
)
def test_tree_attention_random_forests(trajs, cut_frac, budget, fused, prefixes, dense):
    forest = harts.build_forest(trajs)
    _check(trajs, cut=int(cut_frac * forest.num_nodes), budget=budget, fused=fused, prefixes=prefixes,
           dense=dense)


# ---- backward: both paths, and what it saves ---------------------------------------------------
# (forest, cut, heads, Dk, Dv, budget): each has groups with and without key padding; GQA/MQA,
# lone-key groups, external keys (num_keys > num_queries).
BACKWARD_CASES = {
    "gqa-external": ("deep-binary-D5-S3", 2, (6, 2), 8, 3, 2048),
    "gqa-lone-keys": ("one-token-nodes-D4", 0, (4, 2), 8, 5, 600),
    "mqa-lone-keys-external": ("roots-R4", 1, (4, 1), 6, 10, 600),
    "gqa-long-external": ("long-P700-G3", 1, (4, 2), 16, 16, None),
}


@pytest.mark.parametrize("padding", ["mask", "channel"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_tree_attention_backward_paths(case, dtype, fused, padding):
    name, cut, heads, dk, dv, budget = BACKWARD_CASES[case]
    tol = (ATOL_OUT, ATOL_GRAD) if dtype == torch.float64 else (2e-5, 2e-5)
    with padding_by(padding):
        plan = _check(ATTENTION_FORESTS[name], cut=cut, heads=heads, dk=dk, dv=dv, budget=budget,
                      dtype=dtype, tol=tol, fused=fused, prefixes="off")
    # the padded groups took the way asked for: per-block masks (these groups are small) or the channel
    assert any(key[0] == "padded_mask" for key in plan._cache) == (padding == "mask")
    assert any(g.pad_keys for g in plan.groups) and any(not g.pad_keys and g.lk > 1 for g in plan.groups)
    assert any(g.lk == 1 for g in plan.groups) == ("lone" in case)
    assert (plan.num_keys > plan.num_queries) == ("external" in case)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
def test_padded_groups_take_masks_within_the_bound_and_the_channel_beyond(fused):
    """Under a bound that holds the first padded group's mask but not all of them, the first ones
    take masks and the rest the channel, in one call, and the result stays exact."""
    forest = harts.build_forest(ATTENTION_FORESTS["deep-binary-D5-S3"])
    with shared_prefixes("off"):
        plan = plan_tree_attention(**plan_args(forest, 2)[0], max_group_tokens=2048)
    r = 2  # heads (4, 2)
    sizes = [g.size * r * g.lq * g.lk for g in plan.groups if g.pad_keys]
    assert len(sizes) >= 2
    with padding_by(sizes[0]):
        checked = _check(ATTENTION_FORESTS["deep-binary-D5-S3"], cut=2, heads=(4, 2), dk=8, dv=8, budget=2048,
                         dtype=torch.float32, tol=(2e-5, 2e-5), fused=fused, prefixes="off")
        chosen = GATHER._masked_groups(checked, r, None)
    padded = [i for i, g in enumerate(checked.groups) if g.pad_keys]
    assert chosen == {padded[0]}, (chosen, padded)


@pytest.mark.parametrize("padding", ["mask", "channel"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 6e-2)], ids=["f16", "bf16"])
def test_tree_attention_half_precision(dtype, tol, fused, padding):
    """Half-precision inputs (key/value gradients summed over blocks in float32), loosely; a plan
    with shared prefixes runs whole paths in half precision."""
    with padding_by(padding):
        plan = _check(ATTENTION_FORESTS["deep-binary-D5-S3"], cut=2, heads=(4, 2), dk=16, dv=16, budget=2048,
                      dtype=dtype, tol=(tol, tol), fused=fused, prefixes="all")
    assert plan.prefixes


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
def test_backward_kernel_choice(fused, monkeypatch):
    """On CPU the fused flash backward serves every group with several keys, unless switched off."""
    calls = []
    kernel = GROUPED.flash_backward
    monkeypatch.setattr(GROUPED, "flash_backward", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    plan = _check(ATTENTION_FORESTS["one-token-nodes-D4"], cut=1, fused=fused, prefixes="off")
    assert len(calls) == (sum(g.lk > 1 for g in plan.groups) if fused else 0) and (not fused or calls)


@pytest.mark.parametrize("prefixes", ["off", "all"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
def test_backward_saves_no_gathered_rows(fused, prefixes):
    """Saved for backward: q, k, v as passed, the output and per-group logsumexps (with shared
    prefixes, every query's too); no gathered rows, which on short nodes are several times the
    token count."""
    forest = harts.build_forest(ATTENTION_FORESTS["deep-binary-D5-S3"])
    args, _ = plan_args(forest, 0)
    with shared_prefixes(prefixes):
        plan = plan_tree_attention(**args)
    n, m = args["num_queries"], args["num_keys"]
    assert plan.whole().key_index.numel() > 3 * m and bool(plan.prefixes) == (prefixes == "all")
    q = torch.randn(4, n, 8, requires_grad=True)
    k, v = (torch.randn(2, m, d, requires_grad=True) for d in (8, 6))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with fused_kernels(fused), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE)
    lse = 4 * sum(g.size * g.lq for g in plan.groups) * 4  # float32 [Hkv, G, r Lq]
    lse += 4 * n * 4 if plan.prefixes else 0  # float32 [n, H]
    inputs = sum(x.numel() * x.element_size() for x in (q, k, v))
    assert sum(saved.values()) <= inputs + out.numel() * out.element_size() + lse
    assert saved.keys() >= {x.untyped_storage().data_ptr() for x in (q, k, v)}
    with fused_kernels(fused):
        assert all(g.abs().sum() > 0 for g in torch.autograd.grad(out.sum(), (q, k, v)))


def test_double_backward_is_refused():
    forest = harts.build_forest(ATTENTION_FORESTS["roots-R4"])
    args, _ = plan_args(forest, 0)
    q, k, v = (torch.randn(2, forest.num_tokens, 4, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = tree_attention(q, k, v, plan_tree_attention(**args), ATTENTION_SCALE)
    (dq,) = torch.autograd.grad((out * out).sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


@pytest.mark.parametrize("dense", ["off", "on"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
def test_lone_key_propagates_nan(fused, dense):
    """As SDPA would: a NaN query of a lone-key token makes its output NaN, the rest stay finite."""
    forest = harts.build_forest([[7], [8, 9]])
    args, _ = plan_args(forest, 0)
    q, k, v = (torch.randn(2, forest.num_tokens, 4) for _ in range(3))
    q[:, 0] = float("nan")
    q.requires_grad_()
    plan = plan_tree_attention(**args)
    with fused_kernels(fused), dense_plans(dense):
        assert plan.dense_for(2, 4) == (dense == "on")
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE)
        (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert out[0].isnan().all() and not out[1:].isnan().any()
    assert not dq[:, 1:].isnan().any()


def test_empty_queries():
    """No query rows (every key external): an empty output."""
    none = torch.zeros(0, dtype=torch.long)
    args = dict(node_query_start=none, node_length=none, node_key_start=none, node_ancestor_keys=[],
                num_queries=0, num_keys=5)
    q = torch.randn(4, 0, 8, requires_grad=True)
    k, v = torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 5, 3, requires_grad=True)
    out = tree_attention(q, k, v, plan_tree_attention(**args), ATTENTION_SCALE)
    ref = masked_tree_attention(q, k, v, plan_reference_mask(**args), ATTENTION_SCALE)
    assert out.shape == ref.shape == (0, 4, 3)


# ---- shared prefixes ---------------------------------------------------------------------------
PREFIX_CASES = [(name, 0) for name in ATTENTION_FORESTS] + [("deep-binary-D5-S3", 3), ("long-P700-G3", 1),
                                                             ("roots-R4", 2), ("star-P40-G6", 1)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,cut", PREFIX_CASES, ids=[f"{n}-cut{c}" for n, c in PREFIX_CASES])
def test_shared_prefixes_match_references(name, cut, dtype, fused):
    """Every run of ancestor keys that a block reads as a call of its own, merged by logsumexp, is
    as exact as the groups alone; without the fused kernels (other devices) the op runs the whole
    plan."""
    tol = (ATOL_OUT, ATOL_GRAD) if dtype == torch.float64 else (2e-5, 2e-5)
    plan = _check(ATTENTION_FORESTS[name], cut=cut, dtype=dtype, tol=tol, fused=fused, prefixes="all")
    assert plan.prefixes and plan.whole() is not plan and not plan.whole().prefixes


def _block_keys(plan) -> list[torch.Tensor]:
    """Per query (one query head per key/value head), the real key rows its group block reads."""
    q_start = [0]
    for g in plan.groups:
        q_start.append(q_start[-1] + g.size * g.lq)
    k_start = [0]
    for g in plan.groups:
        k_start.append(k_start[-1] + g.size * g.lk)
    keys = []
    for t in range(plan.num_queries):
        pos = int(plan.row_base[t] + plan.row_offset[t])
        gi = max(i for i in range(len(plan.groups)) if q_start[i] <= pos)
        g, within = plan.groups[gi], pos - q_start[gi]
        slot, col = divmod(within, g.lq)
        at = k_start[gi] + slot * g.lk
        row = plan.key_index[at: at + g.lk][: g.lk - g.lq + col + 1]  # causal: up to its own key
        keys.append(row[row != plan.num_keys])
    return keys


@pytest.mark.parametrize("name,cut", PREFIX_CASES, ids=[f"{n}-cut{c}" for n, c in PREFIX_CASES])
def test_shared_prefixes_and_blocks_read_each_path_key_once(name, cut):
    """Each query reads every key of its path exactly once, from its block's gathered row or from
    the shared prefixes over it, and no other key."""
    forest = harts.build_forest(ATTENTION_FORESTS[name])
    args, _ = plan_args(forest, cut)
    with shared_prefixes("all"):
        plan = plan_tree_attention(**args)
    reads = torch.zeros(plan.num_queries, plan.num_keys, dtype=torch.long)
    for t, keys in enumerate(_block_keys(plan)):
        reads[t].index_add_(0, keys, torch.ones_like(keys))
    for p in plan.prefixes:
        reads[p.q0: p.q1, p.k0: p.k1] += 1
    assert torch.equal(reads, plan_reference_mask(**args).long())
    assert plan.key_index.numel() < plan.whole().key_index.numel()


def test_default_prefixes_take_the_long_shared_prompt():
    """With the default thresholds, the 960-token prompt that 24 nodes read becomes one call for all
    their queries, and the blocks gather less than half the key rows."""
    trajs = [token_run(1, 960) + token_run(2000 + 200 * c, 120) + [5000 + 2 * c + g] * 60
             for c in range(8) for g in range(2)]
    forest = harts.build_forest(trajs)
    args, _ = plan_args(forest, 0)
    plan = plan_tree_attention(**args)
    assert [(p.k0, p.k1, p.q0, p.q1) for p in plan.prefixes] == [(0, 960, 960, forest.num_tokens)]
    assert 2 * plan.key_index.numel() < plan.whole().key_index.numel()
    assert plan.exact_cost == plan.whole().exact_cost


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "recompute"])
def test_one_valued_prefix_runs_whole_paths(fused):
    """Values that are one value c on a shared prefix: the op runs the whole plan, so that queries
    whose whole path holds c return c exactly, with exactly zero query and key gradients ("Equal
    values"); merged partial results would be c only to rounding."""
    forest = harts.build_forest(ATTENTION_FORESTS["star-P40-G6"])
    args, _ = plan_args(forest, 0)
    with shared_prefixes("all"):
        plan = plan_tree_attention(**args)
    assert plan.prefixes
    n = forest.num_tokens
    torch.manual_seed(0)
    q, k = torch.randn(4, n, 8, requires_grad=True), torch.randn(2, n, 8, requires_grad=True)
    c = torch.randn(2, 1, 8)
    v = c.expand(2, n, 8).clone().requires_grad_()
    with fused_kernels(fused):
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE)
        dq, dk = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k))
    assert torch.equal(out, c.repeat_interleave(2, 0).transpose(0, 1).expand(n, 4, 8))
    assert not dq.any() and not dk.any()


# ---- dense plans -------------------------------------------------------------------------------
def _star(prompt: int, completions: list[int]) -> list[list[int]]:
    return [token_run(1, prompt) + token_run(1000 + 100 * i, n) for i, n in enumerate(completions)]


def test_default_dense_choice():
    """The defaults mark a small star dense (one call beats its groups' fixed costs), not the same
    trajectories without shared prefixes (8 separate paths: most of [n, n] would be hidden keys),
    nor a forest whose [n, m] scores exceed the bound."""
    trajs = _star(41, [5, 14, 12, 14, 14, 14, 8, 8])
    tree = plan_tree_attention(**plan_args(harts.build_forest(trajs), 0)[0])
    flat = plan_tree_attention(**plan_args(harts.build_forest(trajs, share_prefixes=False), 0)[0])
    long = plan_tree_attention(**plan_args(harts.build_forest([token_run(1, 1500)]), 0)[0])
    windowed = tree.windowed(16)
    with dense_plans("default"):
        assert tree.dense_for(4, 32) and not flat.dense_for(4, 32) and not long.dense_for(4, 32)
        assert not windowed.dense_for(4, 32) and not tree.dense_for(64, 128)  # wide heads: scores cost more
        # the 45,000 score elements per call at 4 x 32 that the estimate stands on
        assert PLAN_ATTENTION._DENSE_CALL_WORK / (4 * 32) == 45_000


def test_dense_mask_is_the_reference_mask():
    forest = harts.build_forest(ATTENTION_FORESTS["deep-binary-D5-S3"])
    args, _ = plan_args(forest, 3)
    plan = plan_tree_attention(**args)
    mask = plan.dense_mask(2, torch.float32)[0, 0]
    sees = plan_reference_mask(**args)
    assert torch.equal(mask == 0, sees.repeat(2, 1))
    assert (mask[~sees.repeat(2, 1)] == -torch.finfo(torch.float32).max / 4).all()


@pytest.mark.parametrize("equal", ["all", "starts"])
def test_dense_plan_runs_groups_where_values_repeat(equal, monkeypatch):
    """Values equal at the first two tokens of a path: some query's visible values may be one value
    c, which the groups return exactly (output c, zero query and key gradients; "Equal values"), so
    the op runs them instead of the dense call; with every value one value, that exactness shows."""
    forest = harts.build_forest(ATTENTION_FORESTS["star-P40-G6"])
    args, _ = plan_args(forest, 0)
    plan = plan_tree_attention(**args)
    n = forest.num_tokens
    torch.manual_seed(0)
    q, k = torch.randn(4, n, 8, requires_grad=True), torch.randn(2, n, 8, requires_grad=True)
    c = torch.randn(2, 1, 8)
    v = c.expand(2, n, 8).clone() if equal == "all" else torch.randn(2, n, 8)
    with dense_plans("on"):
        assert plan.dense_for(4, 8)
    assert DENSE.dense_applies(q, v, plan) == (equal == "starts")  # random values: the dense call
    v[:, 1] = v[:, 0]  # the shared prompt's first two tokens
    assert not DENSE.dense_applies(q, v, plan)
    v.requires_grad_()
    dense_calls = []
    monkeypatch.setattr(DENSE._DenseTreeAttention, "apply", lambda *a: dense_calls.append(1))
    with dense_plans("on"):
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE)
    dq, dk = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k))
    assert not dense_calls
    if equal == "all":
        assert torch.equal(out, c.repeat_interleave(2, 0).transpose(0, 1).expand(n, 4, 8))
        assert not dq.any() and not dk.any()


def test_dense_plan_keeps_a_nan_in_its_trajectory():
    """A NaN key reaches, through a dense call's hidden scores, every query; the op then returns the
    groups' result, where it stays in the rows of the trajectory that holds it (all of them, as in
    a causal kernel's masked scores)."""
    trajs = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9]]
    forest = harts.build_forest(trajs)
    args, _ = plan_args(forest, 0)
    plan = plan_tree_attention(**args)
    q, k, v = (torch.randn(2, forest.num_tokens, 4) for _ in range(3))
    nan_row = int(forest.trajectory_token_indices(2)[1])
    k[:, nan_row] = float("nan")
    with dense_plans("on"):
        assert plan.dense_for(2, 4)
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE)
    third = forest.trajectory_token_indices(2)
    assert out[third].isnan().all()
    others = torch.ones(forest.num_tokens, dtype=torch.bool)
    others[third] = False
    assert out[others].isfinite().all()


def test_dense_backward_saves_inputs_output_and_logsumexp():
    forest = harts.build_forest(ATTENTION_FORESTS["deep-binary-D5-S3"])
    args, _ = plan_args(forest, 0)
    plan = plan_tree_attention(**args)
    n, m = args["num_queries"], args["num_keys"]
    q = torch.randn(4, n, 8, requires_grad=True)
    k, v = (torch.randn(2, m, d, requires_grad=True) for d in (8, 6))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), dense_plans("on"):
        out = tree_attention(q, k, v, plan, ATTENTION_SCALE)
    assert out.grad_fn.name() == "_DenseTreeAttentionBackward"
    inputs = sum(x.numel() * x.element_size() for x in (q, k, v))
    assert sum(saved.values()) <= inputs + out.numel() * out.element_size() + 4 * n * 4
    assert saved.keys() >= {x.untyped_storage().data_ptr() for x in (q, k, v, out)}


@pytest.mark.parametrize("heads,dk,dv", [((2, 2), 8, 8), ((4, 4), 40, 32)], ids=["H2-K8-V8", "H4-K40-V32"])
def test_dense_one_query(heads, dk, dv):
    """A one-token forest: the output's gradient rows already lie in the dense call's layout (so they
    must not be overwritten), and all of it goes to the one value."""
    _check([[3]], heads=heads, dk=dk, dv=dv, dense="on")
