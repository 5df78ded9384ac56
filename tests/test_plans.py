"""Linear-attention plans: validity, fewest calls, cost choice, and exactness of the state handoff.

Every plan (depth, fewest-calls chain, budgeted chains, auto) is checked structurally on random
and edge-shaped forests; the chain plan's call count against an exhaustive search over chain
decompositions; and ``tree_gated_delta_rule`` under each plan against the fp64 per-token
recurrence run on every root-to-node path alone (outputs, the state of every node, and gradients
including those of the root states), extending tests/test_ops_tree.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

import harts
from harts.ops.delta_rule import naive_recurrent_gated_delta_rule
from harts.ops.tree_recurrence import tree_gated_delta_rule
from harts.plan.chunk_tree import ChunkTreePlan, choose_chunk, chunk_tree_plan, chunk_tree_shape
from harts.plan.linear import LinearPlan, chain_plan, min_calls, plan_linear
from harts.plan.linear_cost import LinearCostModel, PlanMode
from tests.helpers import PLAN_SHAPES, forests, path_tokens, root_of

OUT_ATOL = 1e-5  # fp32 chunked vs fp64 recurrence, max |o diff|
STATE_RTOL = 1e-5  # relative norm error of each node's final state
GRAD_RTOL = 1e-5  # relative norm error of each gradient


def _fewest(forest) -> int:
    f, _ = min_calls(forest)
    return max(f[r] for r in (forest.node_parent < 0).nonzero().squeeze(1).tolist())


CALL_MODES = [m for m in PlanMode if m not in (PlanMode.TREE, PlanMode.PACKED)]  # the plans made of calls
CALLS_ONLY = LinearCostModel(consider_chunk_tree=False)  # AUTO among plans of calls


def all_plans(forest) -> dict[str, object]:
    """Every call plan the planner can make for ``forest``, by name (chunk trees: chunk_trees)."""
    plans = {mode.value: plan_linear(forest, mode, CALLS_ONLY, bucket=False) for mode in CALL_MODES}
    dear_calls = LinearCostModel(call_cost=1e9, consider_chunk_tree=False)
    plans["auto-dear-calls"] = plan_linear(forest, "auto", dear_calls, bucket=False)
    for mode in CALL_MODES:  # the same plans split into calls of similar segment lengths
        plans[f"bucketed-{mode.value}"] = plan_linear(forest, mode, CALLS_ONLY)
    for budget in range(_fewest(forest), forest.max_depth + 2):
        plans[f"chain-K{budget}"] = chain_plan(forest, max_calls=budget)
    return plans


def chunk_trees(forest) -> dict[str, ChunkTreePlan]:
    """The chunk-tree plan at its chosen chunk and at the smallest and largest chunk tried."""
    return {"tree": plan_linear(forest, PlanMode.TREE), "tree-C8": chunk_tree_plan(forest, 8),
            "tree-C64": chunk_tree_plan(forest, 64)}  # fmt: skip


def check_chunk_tree(forest, plan: ChunkTreePlan) -> None:
    """Structure a chunk tree must have for the handoff to be exact, checked without the planner's code:
    each node's tokens fill a chain of chunks in order (a chunk starts from its predecessor in the
    node), a node's first chunk starts from its parent's last chunk (a root's from its own
    initial-state row), every source is computed in an earlier level, and the levels are
    consecutive blocks of chunk ids."""
    parent, starts = forest.node_parent.tolist(), forest.node_start.tolist()
    lengths, c, r = forest.node_length.tolist(), plan.chunk_size, len(plan.root_nodes)
    assert plan.num_tokens == forest.num_tokens
    assert sorted(plan.root_nodes) == [v for v in range(forest.num_nodes) if parent[v] < 0]
    level, at = {}, 0
    for d, idx in enumerate(plan.levels):
        assert isinstance(idx, slice) and idx.start == at < idx.stop and idx.step is None
        at = idx.stop
        for m in range(idx.start, idx.stop):
            level[m] = d
    assert at == plan.num_chunks, "a chunk never runs"
    source, slots = plan.source.tolist(), plan.token_index.tolist()
    last = plan.node_last_chunk.tolist()
    seen = []
    for v in range(forest.num_nodes):
        chain = [last[v]]  # the node's chunks, walked back from its last along their sources
        while len(chain) < max(1, math.ceil(lengths[v] / c)):
            assert source[chain[0]] >= r
            chain.insert(0, source[chain[0]] - r)
        tokens = [t for m in chain for t in slots[m]]
        want = list(range(starts[v], starts[v] + lengths[v]))
        assert tokens == want + [forest.num_tokens] * (len(tokens) - lengths[v])
        want_source = r + last[parent[v]] if parent[v] >= 0 else plan.root_nodes.index(v)
        assert source[chain[0]] == want_source
        for m in chain:
            assert source[m] < r or level[source[m] - r] < level[m]
        seen += chain
    assert sorted(seen) == list(range(plan.num_chunks)), "a chunk belongs to no node or to two"
    order = plan.output_index.tolist()
    assert [slots[i // c][i % c] for i in order] == list(range(forest.num_tokens))


def check_plan(forest, plan) -> None:
    """Structure a plan must have for the handoff to be exact, checked without the planner's code."""
    parent = forest.node_parent.tolist()
    starts, lengths = forest.node_start.tolist(), forest.node_length.tolist()
    done: set[int] = set()
    assert plan.num_tokens == forest.num_tokens
    for call in plan.calls:
        ran = []
        w, t = call.token_index.shape
        assert call.lengths.shape == (w,) and int(call.lengths.max()) == t
        assert call.boundary_offsets.shape[0] == w
        for i in range(w):
            nodes = [*call.boundary_nodes[i], call.end_node[i]]
            assert nodes[0] == call.start_node[i]
            assert call.init_node[i] == parent[nodes[0]]
            # the initial state must come from a call that already ran (not this one)
            assert call.init_node[i] < 0 or call.init_node[i] in done
            assert all(parent[b] == a for a, b in zip(nodes, nodes[1:], strict=False)), "not a chain"
            want = [j for v in nodes for j in range(starts[v], starts[v] + lengths[v])]
            n = int(call.lengths[i])
            assert call.token_index[i, :n].tolist() == want
            assert not call.token_index[i, n:].any()
            ends = list(itertools.accumulate(lengths[v] for v in nodes))
            assert call.boundary_offsets[i, : len(nodes) - 1].tolist() == ends[:-1]
            ran += nodes
        assert not done & set(ran) and len(set(ran)) == len(ran), "a node ran twice"
        done |= set(ran)
    assert done == set(range(forest.num_nodes)), "a node never ran"
    order = plan.output_order()
    assert sorted(order.tolist()) == list(range(forest.num_tokens))


def brute_force_min_calls(forest) -> int:
    """Fewest calls over every chain decomposition: each inner node continues into any one child or
    none, and each chain runs one call after its parent's (as early as allowed)."""
    parent = forest.node_parent.tolist()
    children: dict[int, list[int]] = {}
    for v, p in enumerate(parent):
        children.setdefault(p, []).append(v)
    inner = [v for v in range(forest.num_nodes) if v in children]
    best = math.inf
    for choice in itertools.product(*([None, *children[v]] for v in inner)):
        cont = dict(zip(inner, choice, strict=True))
        call = [0] * forest.num_nodes
        for v, p in enumerate(parent):  # parents come first
            if p >= 0:
                call[v] = call[p] + (cont[p] != v)
        best = min(best, max(call) + 1)
    return best


# ---- structure ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PLAN_SHAPES))
def test_every_plan_is_valid_on_edge_shapes(name):
    forest = harts.build_forest(PLAN_SHAPES[name])
    for plan in all_plans(forest).values():
        check_plan(forest, plan)
    for plan in chunk_trees(forest).values():
        check_chunk_tree(forest, plan)


@settings(max_examples=60, deadline=None)
@given(forests())
def test_every_plan_is_valid_on_random_forests(trajs):
    forest = harts.build_forest(trajs)
    plans = all_plans(forest)
    for plan in plans.values():
        check_plan(forest, plan)
    for plan in chunk_trees(forest).values():
        check_chunk_tree(forest, plan)
    chain, depth = plans["chain"], plans["depth"]
    leaves = int((forest.node_subtree_end - torch.arange(forest.num_nodes) == 1).sum())
    assert chain.num_calls <= depth.num_calls == forest.max_depth + 1
    assert chain.num_calls <= math.floor(math.log2(leaves)) + 1  # Horton-Strahler bound
    for name, plan in plans.items():
        if name.startswith("chain-K"):
            assert plan.num_calls <= int(name[len("chain-K") :])


@settings(max_examples=80, deadline=None)
@given(forests(max_trajectories=5, max_len=6))
def test_chain_plan_needs_the_fewest_calls(trajs):
    forest = harts.build_forest(trajs)
    assert chain_plan(forest).num_calls == _fewest(forest) == brute_force_min_calls(forest)


@pytest.mark.parametrize(
    "name, calls",
    [("chain-M5", 1), ("star-P9-G5", 2), ("caterpillar-D8", 2), ("binary-D3", 4), ("roots-3", 4)],
)
def test_chain_plan_call_counts_on_known_shapes(name, calls):
    forest = harts.build_forest(PLAN_SHAPES[name])
    assert chain_plan(forest).num_calls == calls == brute_force_min_calls(forest)


@pytest.mark.parametrize("name", list(PLAN_SHAPES))
def test_auto_picks_the_cheapest_candidate(name):
    forest = harts.build_forest(PLAN_SHAPES[name])
    plans = all_plans(forest)
    auto, model = plans["auto"], LinearCostModel()
    assert auto.cost == model.plan(auto)
    assert auto.mode in (PlanMode.DEPTH, PlanMode.CHAIN)
    assert auto.cost <= min(
        p.cost for n, p in plans.items() if n != "auto-dear-calls" and not n.startswith("bucketed")
    )
    for mode in CALL_MODES:  # splitting by length only ever lowers the estimated cost
        assert plans[f"bucketed-{mode.value}"].cost <= plans[mode.value].cost
    assert plans["auto-dear-calls"].num_calls == plans["chain"].num_calls
    assert plans["depth"].padded_tokens == sum(int(c.token_index.numel()) for c in plans["depth"].calls) - (
        forest.num_tokens
    )


@pytest.mark.parametrize("name", list(PLAN_SHAPES))
def test_auto_weighs_the_chunk_tree_against_the_calls(name):
    """AUTO returns the chunk tree at its cheapest chunk exactly when the model costs it below the
    best plan of calls; a model with dear calls always picks it, one with a dear chunk tree never."""
    forest = harts.build_forest(PLAN_SHAPES[name])
    model = LinearCostModel()
    calls = plan_linear(forest, "auto", CALLS_ONLY)
    chunk, tree_cost = choose_chunk(forest, model)
    shapes = {c: chunk_tree_shape(forest, c) for c in model.chunk_sizes}
    assert tree_cost == min(model.chunk_tree(*shapes[c], c) for c in model.chunk_sizes)
    built = chunk_tree_plan(forest, chunk)
    assert (built.num_chunks, built.scan_steps) == shapes[chunk]
    assert built.cost == tree_cost
    auto = plan_linear(forest, "auto", model)
    if tree_cost < model.chunk_tree_margin * model.plan(calls):
        assert isinstance(auto, ChunkTreePlan) and auto.chunk_size == chunk
    else:
        assert isinstance(auto, LinearPlan) and auto.num_calls == calls.num_calls
    assert isinstance(plan_linear(forest, "auto", LinearCostModel(call_cost=1e12)), ChunkTreePlan)
    assert isinstance(plan_linear(forest, "auto", LinearCostModel(tree_call_cost=1e12)), LinearPlan)


def test_a_call_backend_keeps_auto_to_plans_of_calls():
    """Under a backend whose kernels run calls (fla on a GPU), the layout's AUTO never picks the
    plain-PyTorch chunk tree; under the default backend it may."""
    from harts.ops.backends import Backend, register_backend, use_backend
    from harts.ops.delta_rule import chunked_gated_delta_rule
    from harts.ops.recurrence import DELTA_RULE
    from harts.ops.tree_attention import tree_attention
    from harts.runtime.config import RunConfig
    from harts.runtime.executor import layout_for

    forest = harts.build_forest(PLAN_SHAPES["binary-D3"])
    run = RunConfig(cost_model=LinearCostModel(call_cost=1e12))
    assert isinstance(layout_for(forest, "cpu", run).linear_plan, ChunkTreePlan)
    calls_only = Backend("calls-only", {DELTA_RULE.name: chunked_gated_delta_rule}, tree_attention)
    register_backend("calls-only", lambda: calls_only)
    with use_backend("calls-only"):
        assert isinstance(layout_for(forest, "cpu", run).linear_plan, LinearPlan)


def test_bad_mode_and_budget_are_refused():
    forest = harts.build_forest(PLAN_SHAPES["binary-D3"])
    with pytest.raises(ValueError, match="unknown plan mode"):
        plan_linear(forest, "fastest")
    with pytest.raises(ValueError, match="below the fewest calls"):
        chain_plan(forest, max_calls=3)


# ---- exactness of the handoff under every plan -------------------------------------------------
NUMERIC = ["chunk-boundaries-T200", "caterpillar-D8", "roots-3", "short-parents-K4"]


@pytest.mark.parametrize("mode", ["depth", "chain", "auto", "auto-dear-calls", "budget", "tree", "tree-C8",
                                  "tree-C64"])
@pytest.mark.parametrize("name", NUMERIC)
def test_tree_delta_rule_is_exact_under_every_plan(name, mode):
    torch.manual_seed(0)
    forest = harts.build_forest(PLAN_SHAPES[name])
    plans = {**all_plans(forest), **chunk_trees(forest)}
    plan = plans[f"chain-K{min(_fewest(forest) + 1, forest.max_depth + 1)}" if mode == "budget" else mode]
    n, h, dk, dv = forest.num_tokens, 2, 8, 4
    q = F.normalize(torch.randn(n, h, dk), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(n, h, dk), dim=-1).requires_grad_()
    v = torch.randn(n, h, dv, requires_grad=True)
    g = (-torch.rand(n, h, dk) * 2).requires_grad_()
    beta = torch.rand(n, h, requires_grad=True)
    roots = (forest.node_parent < 0).nonzero().squeeze(1).tolist()
    root_states = {r: (0.3 * torch.randn(h, dk, dv)).requires_grad_() for r in roots}
    leaves = (q, k, v, g, beta, *root_states.values())
    out, states = tree_gated_delta_rule(q, k, v, g, beta, plan, root_states=root_states)
    assert set(states) == set(range(forest.num_nodes))  # inner chain nodes included
    w_out = torch.randn_like(out)
    w_state = torch.randn(forest.num_nodes, h, dk, dv)
    loss = (out * w_out).sum() + sum((states[m] * w_state[m]).sum() for m in states)
    got = torch.autograd.grad(loss, leaves)

    def naive(idx, root):  # the fp64 recurrence over one path, from its root's state
        rows = (x[idx][None] for x in (q, k, v, g, beta))
        return naive_recurrent_gated_delta_rule(*rows, initial_state=root_states[root][None])

    ref_loss = 0.0
    for i in range(forest.num_trajectories):  # outputs: each trajectory alone, shared rows once
        idx = forest.trajectory_token_indices(i)
        ref, _ = naive(idx, root_of(forest, int(forest.trajectory_end_node[i])))
        assert (out[idx].double() - ref[0]).abs().max() <= OUT_ATOL
        ref_loss = (
            ref_loss + (ref[0] * w_out[idx].double() / forest.token_multiplicity[idx][:, None, None]).sum()
        )
    for m in range(forest.num_nodes):  # states: the path from the root to the end of node m
        _, ref_state = naive(path_tokens(forest, m), root_of(forest, m))
        assert (states[m].double() - ref_state[0]).norm() <= STATE_RTOL * ref_state[0].norm()
        ref_loss = ref_loss + (ref_state[0] * w_state[m].double()).sum()
    want = torch.autograd.grad(ref_loss, leaves)
    for got_, want_ in zip(got, want, strict=True):
        assert (got_.double() - want_).norm() <= GRAD_RTOL * want_.norm()
