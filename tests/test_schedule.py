"""A step's schedule, decided from part sizes and readers alone, without a model; and the runtime
running exactly that schedule (the parts it runs twice, the forwards, the graphs it holds)."""

from __future__ import annotations

import pytest
import torch

import harts
from harts.plan.schedule import (
    Backward,
    DropLayout,
    Forward,
    HandOver,
    LossForm,
    Recompute,
    Release,
    RowGradients,
    Schedule,
    depth_first_schedule,
    forward_only_schedule,
    graphs_to_hold,
    three_pass_schedule,
)
from harts.plan.schedule import step_schedule as plan_step
from harts.runtime.backward import forest_backward, next_token_rows
from tests.reference import cached_model
from tests.test_split import SPLIT_FORESTS, RowLoss, SequenceLoss

# a chain of three spine parts (each read by every later part) over a leaf part
CHAIN = {0: set(), 1: {0}, 2: {0, 1}, 3: {0, 1, 2}}
CHAIN_SIZES = [100, 100, 100, 10]


def test_a_chain_held_whole_runs_every_part_once():
    schedule = depth_first_schedule(range(4), CHAIN_SIZES, CHAIN, hold_limit=300)
    assert schedule.events == (
        Forward(0, grad=True), HandOver(0), Forward(1, grad=True), HandOver(1), Forward(2, grad=True),
        HandOver(2), Forward(3, grad=True), Backward(3, own_rows=True), Backward(2, own_rows=True),
        Release(2), Backward(1, own_rows=True), Release(1), Backward(0, own_rows=True), Release(0),
    )  # fmt: skip
    assert schedule.order == (0, 1, 2, 3)
    assert schedule.recomputed_parts == () and schedule.part_forwards == 4
    assert schedule.peak_held_tokens == 300


def test_a_chain_holding_nothing_runs_every_read_part_twice():
    schedule = depth_first_schedule(range(4), CHAIN_SIZES, CHAIN, hold_limit=0)
    assert schedule.events == (
        Forward(0, grad=False), HandOver(0), Forward(1, grad=False), HandOver(1), Forward(2, grad=False),
        HandOver(2), Forward(3, grad=True), Backward(3, own_rows=True), Recompute(2),
        Backward(2, own_rows=True), Release(2), Recompute(1), Backward(1, own_rows=True), Release(1),
        Recompute(0), Backward(0, own_rows=True), Release(0),
    )  # fmt: skip
    assert schedule.recomputed_parts == (0, 1, 2) and schedule.part_forwards == 7
    assert schedule.peak_held_tokens == 0


def test_the_auto_bound_holds_one_budget_of_graphs():
    """``hold_tokens="auto"`` reads as the budget: room for one of the three spine graphs, the
    innermost (the tie goes to it); the other two run again, in reverse order."""
    limit = harts.RunConfig(budget_tokens=100).hold_limit
    schedule = depth_first_schedule(range(4), CHAIN_SIZES, CHAIN, limit)
    forwards = [e for e in schedule if isinstance(e, Forward)]
    assert forwards == [Forward(0, False), Forward(1, False), Forward(2, True), Forward(3, True)]
    assert schedule.recomputed_parts == (0, 1) and schedule.part_forwards == 6
    assert schedule.peak_held_tokens == 100
    backwards = [e.part for e in schedule if isinstance(e, Recompute | Backward)]
    assert backwards == [3, 2, 1, 1, 0, 0]


def test_a_branching_tree_runs_each_subtree_before_the_spine_backward():
    """A spine part read by two subtree parts, and a part of whole trees: each subtree runs forward
    and backward at once; the spine's backward follows its last reader's."""
    producers = {0: set(), 1: {0}, 2: {0}, 3: set()}
    schedule = depth_first_schedule(range(4), [8, 5, 5, 6], producers, hold_limit=8)
    assert schedule.events == (
        Forward(0, grad=True), HandOver(0), Forward(1, grad=True), Backward(1, own_rows=True),
        Forward(2, grad=True), Backward(2, own_rows=True), Backward(0, own_rows=True), Release(0),
        Forward(3, grad=True), Backward(3, own_rows=True),
    )  # fmt: skip
    assert schedule.peak_held_tokens == 8 and schedule.recomputed_parts == ()
    none = depth_first_schedule(range(4), [8, 5, 5, 6], producers, hold_limit=7)
    assert none.recomputed_parts == (0,) and none.peak_held_tokens == 0
    assert none.events[6:9] == (Recompute(0), Backward(0, own_rows=True), Release(0))


def test_lifetimes_that_do_not_nest_never_build_a_graph_they_drop():
    """3 reads 1 and 4 reads 2: 1's graph is freed while 2's, started later, still lives; the walk
    drops the oldest held graph to make room for 2's, so 1 runs without autograd from the start."""
    producers = {0: set(), 1: {0}, 2: {0}, 3: {1}, 4: {2}}
    sizes = [10, 30, 30, 5, 5]
    assert graphs_to_hold(range(5), sizes, producers, 40) is None
    schedule = depth_first_schedule(range(5), sizes, producers, hold_limit=40)
    assert schedule.peak_held_tokens <= 40
    built = {e.part for e in schedule if isinstance(e, Forward) and e.grad}
    assert set(schedule.recomputed_parts).isdisjoint(built)
    assert schedule.part_forwards == 5 + len(schedule.recomputed_parts)


def test_three_passes_recompute_every_part_but_the_last():
    schedule = three_pass_schedule([0, 1, 2], [4, 4, 4])
    assert schedule.events == (
        Forward(0, grad=False), HandOver(0), Forward(1, grad=False), HandOver(1), Forward(2, grad=True),
        RowGradients((0, 1, 2)), Backward(2, own_rows=False), Recompute(1), Backward(1, own_rows=False),
        Release(1), Recompute(0), Backward(0, own_rows=False), Release(0),
    )  # fmt: skip
    assert schedule.recomputed_parts == (0, 1) and schedule.part_forwards == 5
    assert schedule.peak_held_tokens == 0


def test_forward_only_releases_a_hand_over_after_its_last_reader():
    schedule = forward_only_schedule([4, 3, 3, 2], {0: set(), 1: {0}, 2: {0}, 3: set()})
    assert schedule.events == (
        Forward(0, grad=False), HandOver(0), DropLayout(0), Forward(1, grad=False), DropLayout(1),
        Forward(2, grad=False), DropLayout(2), Release(0), Forward(3, grad=False), DropLayout(3),
    )  # fmt: skip
    assert schedule.recomputed_parts == () and schedule.part_forwards == 4 and schedule.peak_held_tokens == 0


def test_the_loss_form_picks_the_schedule():
    """Per row: depth first; per trajectory: whole trees depth first, cut trees in three passes; any
    other loss: three passes; no loss: forward only; a single part always runs depth first."""
    sizes, producers, whole = [6, 6, 5], {0: set(), 1: {0}, 2: set()}, [False, False, True]
    per_row = plan_step(sizes, producers, whole, LossForm.PER_ROW, hold_limit=0)
    assert per_row == depth_first_schedule(range(3), sizes, producers, 0)
    per_trajectory = plan_step(sizes, producers, whole, "per_trajectory", hold_limit=0)
    whole_first = depth_first_schedule([2], sizes, producers, 0)
    assert per_trajectory == whole_first.then(three_pass_schedule([0, 1], sizes))
    assert per_trajectory.order == (2, 0, 1) and per_trajectory.recomputed_parts == (0,)
    assert plan_step(sizes, producers, whole, LossForm.WHOLE, 0) == three_pass_schedule(range(3), sizes)
    assert plan_step(sizes, producers, whole, LossForm.NONE, 0) == forward_only_schedule(sizes, producers)
    single = plan_step([9], {0: set()}, [True], LossForm.WHOLE, 0)
    assert single.events == (Forward(0, grad=True), Backward(0, own_rows=True))
    with pytest.raises(ValueError, match="different parts"):
        single.then(Schedule((8,), ()))


# ---- the runtime runs the schedule it was given --------------------------------------------------
def _step(forest, run, loss_type, separable):
    model = cached_model("qwen3_next", seed=11)
    predictor, target = next_token_rows(forest)
    loss = loss_type(forest)
    loss_fn = loss if separable else (lambda logprob, entropy: loss(logprob, entropy))
    model.zero_grad(set_to_none=True)
    return forest_backward(model, forest, predictor, target, loss_fn, run=run)


@pytest.mark.parametrize("hold", ["auto", 0, 10**9])
def test_the_runtime_reports_what_its_schedule_said(hold):
    """Under a per-row loss at every hold bound, and under the three passes: the parts the step ran
    twice, its forwards and the most graph tokens it held while another part ran forward are those
    its schedule named before any compute."""
    forest = harts.build_forest(SPLIT_FORESTS["stacked-branches"])
    run = harts.RunConfig(budget_tokens=4, hold_tokens=hold)
    for loss_type, separable in ((RowLoss, True), (SequenceLoss, False)):
        result = _step(forest, run, loss_type, separable)
        schedule = result.schedule
        assert result.num_cuts >= 2
        assert schedule.sizes == tuple(result.tokens_per_micro_batch)
        assert result.recomputed_parts == schedule.recomputed_parts
        assert result.part_forwards == schedule.part_forwards
        assert result.peak_held_tokens == schedule.peak_held_tokens <= (run.hold_limit if separable else 0)
        assert sorted(schedule.order) == list(range(result.num_micro_batches))
    if hold == 0:
        assert result.recomputed_parts == tuple(range(result.num_micro_batches - 1))


def test_forward_only_passes_run_each_part_once():
    model = cached_model("qwen3_next", seed=11)
    rollouts = [harts.Rollout(t) for t in SPLIT_FORESTS["stacked-branches"]]
    with torch.no_grad():
        got = harts.forest_logprobs(model, rollouts, run=harts.RunConfig(budget_tokens=4))
    assert got.rows.num_cuts >= 2 and got.rows.part_forwards == got.num_micro_batches
