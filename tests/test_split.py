"""Split invariance: any micro-batch budget gives the gradients of no budget.

Budgets small enough to cut each tree several times, including cuts inside a long node, for every
family; and the micro-batch plans themselves (coverage, budget, order, whole-tree packing).

Gradients of a budgeted and an unbudgeted run agree within ``GRAD_RTOL`` per parameter; where they
do not, both are judged against the fp64 truth of each trajectory alone, with the stock fp32
computation's own error (:func:`tests.reference.split_gradient_failures`, whose docstring derives
why two fp32 runs may differ by the sum of their errors). Only qwen3_5_moe's tiny model needs it:
layer 0's ``A_log``, ``dt_bias``, conv and projection gradients are ~7e-5 off fp64 in stock fp32
too, so its two runs may lie on opposite sides of the truth.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harts
from harts.plan.layout import TreeLayout
from harts.plan.micro_batches import plan_micro_batches, split_long_nodes
from harts.plan.schedule import depth_first_walk
from harts.runtime.backward import forest_backward, next_token_rows
from harts.tiny import FAMILIES
from tests.helpers import EDGE_SHAPES
from tests.reference import (
    GRAD_RTOL,
    cached_model,
    grad_relative_errors,
    param_grads,
    split_gradient_failures,
)

SPLIT_FORESTS = {
    "stacked-branches": EDGE_SHAPES["stacked-branches"],
    "long-node-T130": EDGE_SHAPES["long-branch-T130"],
    "duplicates+roots": EDGE_SHAPES["duplicates"] + EDGE_SHAPES["unrelated-roots"],
}
# budgets that cut every tree several times; 40 and 9 cut inside the 130-token node
CASES = [
    ("stacked-branches", 4),
    ("stacked-branches", 1),
    ("long-node-T130", 40),
    ("long-node-T130", 9),
    ("duplicates+roots", 9),
    ("duplicates+roots", 2),
]


def model_of(family):
    return cached_model(family, seed=11)


class SequenceLoss:
    """Row-weighted terms plus a sequence-level term (GSPO-like: a non-linear function of each
    trajectory's mean log-prob) whose rows span several micro-batches of a cut tree. A sum over
    trajectories of each one's rows, so ``subset`` (whole trajectories' rows) is exact."""

    def __init__(self, forest, rows=None):
        predictor, _ = next_token_rows(forest)
        self.forest = forest
        self.w = torch.randn(predictor.numel(), generator=torch.Generator().manual_seed(0))
        lengths = forest.trajectory_length - 1
        self.traj = torch.repeat_interleave(torch.arange(forest.num_trajectories), lengths)
        self.rows = torch.arange(predictor.numel()) if rows is None else rows

    def __call__(self, logprob, entropy):
        w, traj = self.w[self.rows], self.traj[self.rows]
        seq_mean = torch.zeros(self.forest.num_trajectories, dtype=logprob.dtype).index_add(0, traj, logprob)
        seq_mean = seq_mean / (self.forest.trajectory_length - 1).clamp(min=1)
        present = torch.zeros(self.forest.num_trajectories, dtype=torch.bool)
        present[traj] = True
        entropy_w = self.w.flip(0)[self.rows]
        return (logprob * w).sum() + 0.1 * (entropy * entropy_w).sum() + torch.exp(seq_mean)[present].sum()

    def magnitude(self, logprob, entropy) -> float:
        """The sum of its terms' magnitudes, which bounds the rounding of their sum."""
        w, entropy_w = self.w[self.rows].double(), self.w.flip(0)[self.rows].double()
        lengths = (self.forest.trajectory_length - 1).clamp(min=1).double()
        seq_mean = torch.zeros(self.forest.num_trajectories, dtype=torch.float64).index_add(
            0, self.traj[self.rows], logprob.double()
        )
        return float(
            (logprob * w).abs().sum()
            + 0.1 * (entropy * entropy_w).abs().sum()
            + (seq_mean / lengths).exp().sum()
        )

    def subset(self, rows):
        return SequenceLoss(self.forest, self.rows[rows.cpu()])


class RowLoss:
    """A sum of per-row terms (random weights on log-probs and entropies): subsets of any rows add
    up, so it declares ``separable_rows`` and cut trees run depth first, each part once."""

    separable_rows = True

    def __init__(self, forest, rows=None):
        predictor, _ = next_token_rows(forest)
        generator = torch.Generator().manual_seed(1)
        self.w = torch.randn(2, predictor.numel(), generator=generator)
        self.rows = torch.arange(predictor.numel()) if rows is None else rows

    def __call__(self, logprob, entropy):
        w = self.w[:, self.rows]
        return (logprob * w[0]).sum() + 0.1 * (entropy * w[1]).sum()

    def magnitude(self, logprob, entropy) -> float:
        """The sum of its terms' magnitudes, which bounds the rounding of their sum."""
        w = self.w[:, self.rows].double()
        return float((logprob * w[0]).abs().sum() + 0.1 * (entropy * w[1]).abs().sum())

    def subset(self, rows):
        out = RowLoss.__new__(RowLoss)
        out.w, out.rows = self.w, self.rows[rows.cpu()]
        return out


def _step(model, forest, budget, separable=False, loss_type=SequenceLoss, run=None):
    predictor, target = next_token_rows(forest)
    loss = loss_type(forest)
    loss_fn = loss if separable else (lambda logprob, entropy: loss(logprob, entropy))
    model.zero_grad(set_to_none=True)
    result = forest_backward(model, forest, predictor, target, loss_fn, budget_tokens=budget, run=run)
    return result, param_grads(model)


def _assert_losses_agree(loss_type, forest, got, ref) -> None:
    """The two steps' losses differ by no more than their rows explain: the loss of each side's
    rows evaluated in fp64 (the rows themselves are checked elementwise), plus each side's fp32
    rounding of the loss, at most gamma_(R+3) times the sum of its terms' magnitudes (R rows; a
    product and an exp add a rounding each; u = 2^-24). A bound relative to the loss alone would
    not hold for a sum whose terms cancel."""
    loss = loss_type(forest)
    rows = [(r.logprob.double(), r.entropy.double()) for r in (got, ref)]
    explained = abs(float(loss(*rows[0])) - float(loss(*rows[1])))
    n = got.logprob.numel() + 3 + got.num_micro_batches  # the parts' sums added in turn
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    rounding = gamma * (loss.magnitude(*rows[0]) + loss.magnitude(*rows[1]))
    assert abs(float(got.loss) - float(ref.loss)) <= explained + rounding


def _check_gradients(grads, ref_grads, model, shape, loss_type, what=""):
    """Split invariance of the gradients of ``loss_type`` over the forest ``shape`` (module docstring)."""
    trajectories = SPLIT_FORESTS[shape]
    loss = loss_type(harts.build_forest(trajectories))
    failures, _ = split_gradient_failures(grads, ref_grads, model, trajectories, lambda lp, en: loss(lp, en))
    assert not failures, f"{what}{failures}"


def _read_by_later_parts(result) -> tuple[int, ...]:
    """The parts that hand something over to a later part (the spine parts of cut trees)."""
    return tuple(p for p, lay in enumerate(result.layouts) if lay.export_token_ids.size or lay.export_nodes)


# Every family cuts its trees under the default hold (auto: one budget of held graphs beyond the
# running part; in every case here some parts that later parts read keep their graphs and some run
# forward again), which hands each family's keys, values and states over in forward and their
# gradients back. Other hold settings change which autograd graph those gradients enter, not what
# is handed over: none held and all held run on one full-attention and one hybrid family.
HOLD_FAMILIES = ("qwen3", "qwen3_next")
CUT_CASES = [(f, s, b) for f in FAMILIES for s, b in CASES]
CUT_IDS = [f"{f}-{s}-budget{b}" for f, s, b in CUT_CASES]


@pytest.mark.parametrize(("family", "shape", "budget"), CUT_CASES, ids=CUT_IDS)
def test_cut_trees_run_once_depth_first_under_a_per_row_loss(family, shape, budget):
    """A per-row loss: every part forward and backward once when the held graphs may grow with the
    chain of parts; each part later parts read runs twice when none may be held (0); in between
    when one budget's worth may be held (auto, the default). Every setting gives the gradients of
    no budget."""
    model = model_of(family)
    forest = harts.build_forest(SPLIT_FORESTS[shape])
    ref, ref_grads = _step(model, forest, None, True, RowLoss)
    recomputed = {}
    holds = ("auto", 0, 10**9) if family in HOLD_FAMILIES else ("auto",)
    for hold in holds:
        run = harts.RunConfig(budget_tokens=budget, hold_tokens=hold)
        got, grads = _step(model, forest, budget, True, RowLoss, run)
        spine = _read_by_later_parts(got)
        assert got.num_cuts >= 2 and spine
        recomputed[hold] = got.recomputed_parts
        assert got.part_forwards == got.num_micro_batches + len(got.recomputed_parts)
        assert torch.allclose(got.logprob, ref.logprob, atol=1e-5, rtol=0)
        _assert_losses_agree(RowLoss, forest, got, ref)
        _check_gradients(grads, ref_grads, model, shape, RowLoss, f"hold {hold}: ")
    # the default holds some spine graphs and runs the others again (the paths of 10**9 and of 0)
    assert recomputed["auto"] and set(recomputed["auto"]) < set(spine), (recomputed["auto"], spine)
    if family in HOLD_FAMILIES:
        assert recomputed[0] == spine
        assert recomputed[10**9] == ()


@pytest.mark.parametrize(("shape", "budget"), CASES, ids=[f"{s}-budget{b}" for s, b in CASES])
@pytest.mark.parametrize("family", FAMILIES)
def test_budget_does_not_change_gradients(family, shape, budget):
    model = model_of(family)
    forest = harts.build_forest(SPLIT_FORESTS[shape])
    ref, ref_grads = _step(model, forest, None)
    got, grads = _step(model, forest, budget)
    assert got.num_micro_batches > 2 and got.num_cuts >= 2
    assert max(got.tokens_per_micro_batch) <= budget
    assert torch.allclose(got.logprob, ref.logprob, atol=1e-5, rtol=0)
    _assert_losses_agree(SequenceLoss, forest, got, ref)
    _check_gradients(grads, ref_grads, model, shape, SequenceLoss)


@pytest.mark.parametrize("family", ["bailing_hybrid", "qwen3_next", "llama"])
def test_whole_trees_run_once_under_a_separable_loss(family):
    """A loss over whole trajectories (not per row): trees that fit the budget run forward and
    backward once; cut trees take three passes."""
    model = model_of(family)
    forest = harts.build_forest(SPLIT_FORESTS["duplicates+roots"])
    ref, ref_grads = _step(model, forest, None)
    for budget in (9, 4):  # 9: two parts of whole trees; 4: one (a 3-token tree)
        plain, plain_grads = _step(model, forest, budget)
        once, grads = _step(model, forest, budget, separable=True)
        whole = sum(1 for lay in once.layouts if lay.self_contained)
        assert whole >= 1 and once.num_cuts >= 1, "a mixed plan: whole trees and a cut tree"
        cut = once.num_micro_batches - whole
        assert once.part_forwards == whole + 2 * cut - 1
        assert plain.part_forwards == 2 * once.num_micro_batches - 1
        # the three passes run again every part they take but the last
        cut_parts = tuple(p for p, lay in enumerate(once.layouts) if not lay.self_contained)
        assert once.recomputed_parts == cut_parts[:-1]
        assert plain.recomputed_parts == tuple(range(plain.num_micro_batches - 1))
        for got in (once, plain):
            assert got.part_forwards == got.num_micro_batches + len(got.recomputed_parts)
        _assert_losses_agree(SequenceLoss, forest, once, ref)
        assert torch.allclose(once.logprob, ref.logprob, atol=1e-5, rtol=0)
        for got in (grads, plain_grads):
            errors = grad_relative_errors(got, ref_grads)
            worst = max(errors, key=errors.get)
            assert errors[worst] <= GRAD_RTOL, f"{worst}: relative error {errors[worst]:.3g}"


def test_split_long_nodes_keeps_paths():
    forest = harts.build_forest(EDGE_SHAPES["long-branch-T130"])
    refined = split_long_nodes(forest, 16)
    assert int(refined.node_length.max()) <= 16
    assert torch.equal(refined.tokens, forest.tokens)
    assert torch.equal(refined.token_position, forest.token_position)
    for i in range(forest.num_trajectories):
        assert torch.equal(refined.trajectory(i), forest.trajectory(i))
    assert torch.equal(refined.token_predecessors(4), forest.token_predecessors(4))


@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_plan_covers_every_node_once_within_budget(budget):
    trajs = EDGE_SHAPES["star-P20-G4"] + EDGE_SHAPES["stacked-branches"] + EDGE_SHAPES["unrelated-roots"]
    forest = harts.build_forest(trajs)
    plan = plan_micro_batches(forest, budget)
    nodes = np.concatenate([p.nodes.numpy() for p in plan.parts])
    assert np.array_equal(np.sort(nodes), np.arange(plan.forest.num_nodes))
    seen: set[int] = set()
    for part in plan.parts:
        assert part.num_tokens(plan.forest) <= budget
        for node in part.nodes.tolist():
            parent = int(plan.forest.node_parent[node])
            assert parent < 0 or parent in seen or parent in set(part.nodes.tolist())
        seen.update(part.nodes.tolist())


def test_small_trees_are_packed_whole():
    forest = harts.build_forest([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]])
    plan = plan_micro_batches(forest, 5)
    assert plan.num_cuts == 0
    assert sorted(p.num_tokens(forest) for p in plan.parts) == [5, 5]


@pytest.mark.parametrize("family", ["bailing_hybrid", "qwen3_next"])
def test_recomputed_linear_attention_gives_the_same_gradients(family):
    model = model_of(family)
    forest = harts.build_forest(SPLIT_FORESTS["stacked-branches"])
    predictor, target = next_token_rows(forest)
    grads = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        forest_backward(
            model, forest, predictor, target, lambda lp, en: -(lp.sum() + 0.1 * en.sum()),
            budget_tokens=4, run=harts.RunConfig(recompute_linear=recompute),
        )  # fmt: skip
        grads.append(param_grads(model))
    errors = grad_relative_errors(grads[1], grads[0])
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-6, f"{worst}: relative error {errors[worst]:.3g}"


def _cost(forest, part, weight):
    """A part's budget cost: own tokens, plus weighted context: the tokens it reads from earlier
    parts, each once however many of its roots sit below it."""
    return part.num_tokens(forest) + weight * part.external_tokens.numel()


@pytest.mark.parametrize("weight", [0.0, 0.25, 1.0])
def test_cut_trees_put_only_their_spine_in_parts_later_parts_read(weight):
    """One tree of 10-token nodes: a trunk and 14 branches (150 tokens), budget 100. The trunk
    (the only node whose subtree exceeds the budget) is the spine, one part; the branches are
    packed whole, first-fit, as many per part as their tokens and their shared context (the trunk,
    counted once per part) allow."""
    trajs = [list(range(10)) + [100 + 10 * b + i for i in range(10)] for b in range(14)]
    forest = harts.build_forest(trajs)
    budget = 100
    plan = plan_micro_batches(forest, budget, context_weight=weight)
    costs = [_cost(plan.forest, p, weight) for p in plan.parts]
    assert sum(p.num_tokens(plan.forest) for p in plan.parts) == forest.num_tokens
    assert all(c <= budget for c in costs), costs
    read = [p for p, part in enumerate(plan.parts) if part.export_tokens.numel() or part.export_nodes]
    assert read == [0] and plan.parts[0].num_tokens(plan.forest) == 10
    per_part = int((budget - weight * 10) // 10)
    assert plan.num_micro_batches == 1 + -(-14 // per_part)
    assert max(p.num_tokens(plan.forest) for p in plan.parts[1:]) == 10 * min(per_part, 14)


def test_a_long_spine_is_cut_in_balanced_runs():
    """A 300-token trunk over two short branches, budget 100: the trunk (every piece's subtree
    exceeds the budget) is the spine, three runs of 100; both branches fit one part, their shared
    context (300 tokens at weight 0.25) counted once; at weight 0.5 it no longer fits one part with
    both, and each branch gets one of its own (a run of one branch may exceed the budget by its
    context: a run takes a node)."""
    forest = harts.build_forest([list(range(300)) + [1000 + i for i in range(5)], list(range(300)) + [7]])
    plan = plan_micro_batches(forest, 100, context_weight=0.0)
    sizes = [p.num_tokens(plan.forest) for p in plan.parts]
    assert sum(sizes) == forest.num_tokens and max(sizes) <= 100
    spine = [s for p, s in zip(plan.parts, sizes, strict=True) if p.export_tokens.numel()]
    assert spine == [100, 100, 100] and len(sizes) == 4, sizes
    weighted = plan_micro_batches(forest, 100, context_weight=0.25)
    # (a spine run of one 100-token piece exceeds the budget by its context: a run takes a node)
    costs = [_cost(weighted.forest, p, 0.25) for p in weighted.parts[3:]]
    assert max(costs) <= 100 and weighted.num_micro_batches == 4, costs
    heavier = plan_micro_batches(forest, 100, context_weight=0.5)
    assert heavier.num_micro_batches == 5
    assert all(p.num_tokens(heavier.forest) <= 5 for p in heavier.parts[3:])


def test_convolution_context_is_the_reach_of_its_window():
    """A part gathers, of its context, only the convolution inputs its window reaches: the last
    window - 1 tokens above each root (here 3 rows of a 300-token context), and its predecessor
    rows in [those rows ; own tokens] read the same tokens as the predecessors over the whole
    context."""
    forest = harts.build_forest([list(range(300)) + [1000 + i for i in range(5)], list(range(300)) + [7]])
    plan = plan_micro_batches(forest, 100, context_weight=0.0)
    checked = 0
    for part in plan.parts:
        lay = TreeLayout(plan.forest, "cpu", part)
        e = lay.num_external
        if not e:
            continue
        roots = len(lay.root_state_source)
        for window in (2, 4):
            pred = lay.predecessors(window)
            rows = lay.conv_context_rows(window)
            assert rows.tolist() == sorted(set(pred[(pred >= 0) & (pred < e)].tolist()))
            assert rows.size <= (window - 1) * roots < e
            space = torch.cat([torch.as_tensor(lay.conv_context_rows(4)), e + torch.arange(lay.num_tokens)])
            mapped = lay.conv_predecessors(window, 4)
            assert torch.equal(torch.where(mapped >= 0, space[mapped.clamp(min=0)], -1), pred)
        with pytest.raises(AssertionError, match="window 5"):
            lay.conv_predecessors(5, 4)
        checked += 1
    assert checked == plan.num_micro_batches - 1


def test_context_weight_must_lie_in_unit_interval():
    with pytest.raises(ValueError, match="context_weight"):
        plan_micro_batches(harts.build_forest([[1, 2, 3]]), 2, context_weight=1.5)


def test_fp64_model_keeps_fp64_rows_across_cuts():
    """A cut tree's loss reads the kept row log-probs: in an fp64 model they stay fp64."""
    from harts.tiny import tiny_model

    model = tiny_model("llama", seed=3, dtype=torch.float64)
    forest = harts.build_forest(SPLIT_FORESTS["stacked-branches"])
    ref, ref_grads = _step(model, forest, None)
    got, grads = _step(model, forest, 4)
    assert got.num_cuts >= 1 and got.logprob.dtype == torch.float64
    errors = grad_relative_errors(grads, ref_grads)
    assert max(errors.values()) <= 1e-10, max(errors.items(), key=lambda kv: kv[1])


def test_by_default_a_spine_within_one_budget_runs_forward_once():
    """Two cut trees whose spine is one part each (and a whole tree): by default (auto: one budget
    of held graphs) every part runs forward once; with nothing held (0) exactly the spine parts,
    those that later parts read, run forward twice. Both give the gradients of no budget."""
    model = model_of("llama")
    trunk, other = list(range(10, 16)), list(range(50, 57))
    trajectories = [trunk + list(range(20, 25)), trunk + list(range(30, 35)), other + list(range(60, 65)),
                    other + list(range(70, 75)), [90, 91, 92]]  # fmt: skip
    forest = harts.build_forest(trajectories)
    ref, ref_grads = _step(model, forest, None, True, RowLoss)
    default, grads = _step(model, forest, 8, True, RowLoss)
    spine = _read_by_later_parts(default)
    assert default.num_cuts >= 2 and len(spine) == 2, (default.num_cuts, spine)
    assert default.recomputed_parts == () and default.part_forwards == default.num_micro_batches
    run = harts.RunConfig(budget_tokens=8, hold_tokens=0)
    none_held, none_grads = _step(model, forest, 8, True, RowLoss, run)
    assert none_held.recomputed_parts == spine
    assert none_held.part_forwards == none_held.num_micro_batches + len(spine)
    for got, got_grads in ((default, grads), (none_held, none_grads)):
        assert torch.allclose(got.logprob, ref.logprob, atol=1e-5, rtol=0)
        errors = grad_relative_errors(got_grads, ref_grads)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= GRAD_RTOL, f"{worst}: relative error {errors[worst]:.3g}"


def test_depth_first_walk_knows_its_holds_in_advance():
    """A chain of three spine parts (0 -> 1 -> 2, each read by every later part) over a leaf part 3,
    room for one held graph: one of the three is held and the other two run again for their
    backward, in reverse order (the tie goes to the innermost, part 2). The walk reads sizes and
    readers only: the step knows its holds before running anything, and runs a part whose graph it
    will not hold without autograd the first time."""
    producers = {0: set(), 1: {0}, 2: {0, 1}, 3: {0, 1, 2}}
    events = list(depth_first_walk([0, 1, 2, 3], [100, 100, 100, 10], producers, cap=100))
    assert events == [("pass", 0), ("pass", 1), ("hold", 2), ("run", 3), ("backward", 3), ("backward", 2),
                      ("again", 1), ("backward", 1), ("again", 0), ("backward", 0)]  # fmt: skip
    roomy = list(depth_first_walk([0, 1, 2, 3], [100, 100, 100, 10], producers, cap=300))
    assert not any(kind in ("pass", "again") for kind, _ in roomy)
    none = list(depth_first_walk([0, 1, 2, 3], [100, 100, 100, 10], producers, cap=0))
    assert [p for kind, p in none if kind == "again"] == [2, 1, 0]
    too_large = list(depth_first_walk([0, 1, 2, 3], [100, 400, 100, 10], producers, cap=300))
    assert ("pass", 1) in too_large and ("again", 1) in too_large
    assert ("hold", 0) in too_large and ("hold", 2) in too_large


def test_depth_first_walk_counts_a_large_bound_in_coarser_units():
    """A bound of 100,000 tokens is counted in units of 49 tokens (at most 2,048 steps): sizes round
    up, so the held graphs still stay within the bound, and here the best choice is still found."""
    producers = {0: set(), 1: {0}, 2: {0, 1}, 3: {0, 1, 2}}
    sizes = [60_000, 30_000, 65_000, 10]  # 0 + 2 overflow; 0 + 1 hold 90,000 tokens, 1 + 2 95,000
    events = list(depth_first_walk([0, 1, 2, 3], sizes, producers, cap=100_000))
    peak, rerun = _held_peak_and_rerun(events, sizes)
    assert peak <= 100_000 and rerun == 60_000
    assert [p for kind, p in events if kind == "hold"] == [1, 2]


def test_depth_first_walk_falls_back_where_lifetimes_do_not_nest():
    """Parts not in pre-order: 3 reads 1 and 4 reads 2, so 1's graph is freed while 2's, started
    later, still lives. No tree of lifetimes, so the walk holds each part while it fits and drops
    the oldest held graphs to make room, within the bound."""
    from harts.plan.schedule import graphs_to_hold, oldest_dropped_walk

    producers = {0: set(), 1: {0}, 2: {0}, 3: {1}, 4: {2}}
    sizes, order = [10, 30, 30, 5, 5], [0, 1, 2, 3, 4]
    assert graphs_to_hold(order, sizes, producers, 40) is None
    events = list(depth_first_walk(order, sizes, producers, 40))
    assert events == list(oldest_dropped_walk(order, sizes, producers, 40))
    assert _held_peak_and_rerun(events, sizes)[0] <= 40


def _held_peak_and_rerun(events, sizes):
    """(largest tokens of held graphs at any moment, tokens run twice) of a walk's events."""
    held, peak, held_now = set(), 0, 0
    for kind, p in events:
        if kind == "hold":
            held.add(p)
            held_now += sizes[p]
            peak = max(peak, held_now)
        elif kind == "drop":
            held.discard(p)
            held_now -= sizes[p]
        elif kind == "backward" and p in held:
            held.discard(p)
            held_now -= sizes[p]
    return peak, sum(sizes[p] for kind, p in events if kind == "again")


@pytest.mark.parametrize("seed", range(40))
def test_depth_first_walk_runs_the_fewest_tokens_twice(seed):
    """Random cut trees (parts in pre-order, each reading its parent part and some of the parts
    above; the leaves read by none) and random bounds: the parts' lifetimes nest, the walk keeps
    the graphs held at any moment within the bound, and runs no more tokens twice than the best
    choice of held graphs found by trying every subset; never more than dropping the oldest held
    graphs first."""
    import itertools

    from harts.plan.schedule import graphs_to_hold, oldest_dropped_walk, walk_holding

    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 10))
    parent, path = [-1], [0]  # pre-order: each part hangs off the path down to the part before it
    for p in range(1, n):
        d = int(rng.integers(0, len(path)))
        parent.append(path[d])
        path = path[: d + 1] + [p]
    producers = {}
    for p in range(n):
        above, a = [], parent[p]
        while a >= 0:
            above.append(a)
            a = parent[a]
        producers[p] = {a for i, a in enumerate(above) if i == 0 or rng.random() < 0.5}
    order = list(range(n))
    sizes = [int(x) for x in rng.integers(1, 60, n)]
    cap = int(rng.integers(0, 150))
    assert graphs_to_hold(order, sizes, producers, cap) is not None
    events = list(depth_first_walk(order, sizes, producers, cap))
    peak, rerun = _held_peak_and_rerun(events, sizes)
    assert peak <= cap
    read = sorted({q for p in order for q in producers[p]})
    choices = [_held_peak_and_rerun(list(walk_holding(order, producers, set(keep))), sizes)
               for k in range(len(read) + 1) for keep in itertools.combinations(read, k)]  # fmt: skip
    best = min(rerun for peak, rerun in choices if peak <= cap)
    assert rerun == best
    assert rerun <= _held_peak_and_rerun(list(oldest_dropped_walk(order, sizes, producers, cap)), sizes)[1]


def test_held_graphs_are_bounded_by_hold_tokens():
    """The tensor peak of a budgeted step (live bytes, not time): with nothing held it stays near
    one micro-batch's, far below the whole forest's; holding every spine graph raises it; a bound
    of one part's tokens sits between."""
    from harts.bench.memory import tensor_peak_bytes

    model = model_of("llama")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    trunk = torch.randint(0, vocab, (240,), generator=gen).tolist()
    trajs = [trunk + torch.randint(0, vocab, (60,), generator=gen).tolist() for _ in range(6)]
    forest = harts.build_forest(trajs)
    predictor, target = next_token_rows(forest)
    loss = RowLoss(forest)

    def peak(run):
        def step():
            forest_backward(model, forest, predictor, target, loss, run=run)

        reset = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
        step()
        reset()
        return tensor_peak_bytes(step, reset)

    whole = peak(harts.RunConfig())
    none_held = peak(harts.RunConfig(budget_tokens=64, hold_tokens=0))
    one_held = peak(harts.RunConfig(budget_tokens=64, hold_tokens=64))
    all_held = peak(harts.RunConfig(budget_tokens=64, hold_tokens=10**9))
    assert none_held < 0.5 * whole, (none_held, whole)
    assert none_held < one_held < all_held, (none_held, one_held, all_held)
