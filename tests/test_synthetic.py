"""Synthetic rollout generators: determinism, vocabulary bounds, the shapes they promise, and the
redundancy their defaults are tuned to.

Left out: anything about models; these are token-id lists only.
"""

from __future__ import annotations

import pytest
import torch

from harts.data.synthetic import SHAPES, agentic, deep, paper_like, random_forest, scaled, star
from harts.forest import build_forest

SMALL = {  # each shape at a few hundred tokens or less, to keep these tests fast
    "star": dict(prompt_len=64, num_completions=4, completion_len=16),
    "agentic": dict(system_len=96, num_tasks=2, rollouts_per_task=4, turns=3, turn_len=20),
    "paper_like": dict(system_len=96, num_tasks=2, rollouts_per_task=4, turns=3, turn_len=20),
    "deep": dict(trunk_len=40, depth=3, branching=2, seg_len=8),
    "random": dict(num_trajectories=12, max_len=10),
}


@pytest.mark.parametrize("name", list(SHAPES), ids=[f"{n}-small" for n in SHAPES])
def test_deterministic_given_seed(name):
    gen = SHAPES[name]
    a = gen(**SMALL[name], vocab_size=50, seed=3)
    assert a == gen(**SMALL[name], vocab_size=50, seed=3)
    assert a != gen(**SMALL[name], vocab_size=50, seed=4)


@pytest.mark.parametrize("vocab", [2, 7, 32000], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("name", list(SHAPES), ids=[f"{n}-small" for n in SHAPES])
def test_token_ids_are_ints_within_vocabulary(name, vocab):
    trajs = SHAPES[name](**SMALL[name], vocab_size=vocab, seed=1)
    assert isinstance(trajs, list) and trajs
    for t in trajs:
        assert isinstance(t, list) and len(t) >= 1
        assert all(type(x) is int and 0 <= x < vocab for x in t)
    build_forest(trajs).check_vocabulary(vocab)


@pytest.mark.parametrize(
    "gen,target",
    [(agentic, 9.0), (paper_like, 5.6)],
    ids=["agentic-default-R9", "paper_like-default-R5.6"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_redundancy_near_target(gen, target, seed):
    forest = build_forest(gen(seed=seed))
    assert forest.redundancy == pytest.approx(target, rel=0.15)


def test_agentic_default_is_a_long_shared_system_prompt():
    trajs = agentic()
    forest = build_forest(trajs)
    # One root holding at least the 4.8K system prompt, shared by every trajectory.
    assert int((forest.node_parent == -1).sum()) == 1
    assert int(forest.node_length[0]) >= 4800 and int(forest.node_multiplicity[0]) == len(trajs)
    assert 5000 < forest.num_flat_tokens / len(trajs) < 10000


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_dropped_thinking_branches_where_the_thinking_started():
    """With thinking always dropped, each turn's sample ends a trajectory, and the next one
    branches off exactly at the start of the dropped thinking (here: right after the prompt)."""
    trajs = agentic(
        system_len=50,
        num_tasks=1,
        rollouts_per_task=1,
        turns=3,
        turn_len=30,
        user_len=10,
        drop_thinking_prob=1.0,
        seed=0,
    )
    assert len(trajs) == 3  # two dropped-thinking samples and the final trajectory
    assert _lcp(trajs[0], trajs[1]) == 60
    assert len(trajs[1]) < len(trajs[2])


def test_no_drop_no_branch_gives_identical_rollouts():
    trajs = agentic(
        system_len=20,
        num_tasks=2,
        rollouts_per_task=3,
        turns=3,
        turn_len=10,
        branch_prob=0.0,
        drop_thinking_prob=0.0,
        seed=0,
    )
    assert len(trajs) == 6
    assert trajs[0] == trajs[1] == trajs[2] != trajs[3] == trajs[4] == trajs[5]


def test_branching_makes_rollouts_diverge_at_turn_boundaries():
    trajs = agentic(
        system_len=20,
        num_tasks=1,
        rollouts_per_task=8,
        turns=4,
        turn_len=10,
        branch_prob=1.0,
        drop_thinking_prob=0.0,
        seed=0,
    )
    forest = build_forest(trajs)
    # Every rollout resamples its first turn: a star under the system + user prompt.
    assert forest.num_nodes == 9 and int(forest.node_length[0]) == 25


@pytest.mark.parametrize("prompt,group", [(512, 8), (64, 3)], ids=["star-P512-G8", "star-P64-G3"])
def test_star_is_one_prompt_and_a_group(prompt, group):
    forest = build_forest(star(prompt_len=prompt, num_completions=group, completion_len=32, seed=0))
    assert forest.num_trajectories == group and forest.num_nodes == group + 1
    assert int(forest.node_length[0]) == prompt


@pytest.mark.parametrize("depth,branching", [(3, 2), (4, 3)], ids=["deep-D3-B2", "deep-D4-B3"])
def test_deep_has_branch_points_at_every_level(depth, branching):
    trajs = deep(trunk_len=100, depth=depth, branching=branching, seg_len=12, end_prob=0.0, seed=0)
    forest = build_forest(trajs)
    assert len(trajs) == branching**depth
    assert forest.max_depth == depth
    has_children = forest.node_subtree_end > torch.arange(forest.num_nodes) + 1
    assert int(has_children.sum()) == sum(branching**k for k in range(depth))  # trunk + inner segments


def test_deep_ends_inside_the_tree():
    trajs = deep(trunk_len=20, depth=3, branching=3, seg_len=5, end_prob=0.5, seed=0)
    assert len(trajs) > 27
    assert any(_lcp(a, b) == len(a) < len(b) for a in trajs for b in trajs)


def test_random_forest_covers_duplicates_and_prefixes():
    dup = pre = False
    for seed in range(10):
        trajs = random_forest(num_trajectories=20, max_len=12, seed=seed)
        dup |= len({tuple(t) for t in trajs}) < len(trajs)
        pre |= any(_lcp(a, b) == len(a) < len(b) for a in trajs for b in trajs)
    assert dup and pre


def test_scaled_shrinks_lengths_and_keeps_redundancy():
    small = scaled("agentic", 0.03)
    mean_len = sum(map(len, small)) / len(small)
    assert 100 < mean_len < 400
    assert build_forest(small).redundancy == pytest.approx(9.0, rel=0.25)
    expected = star(prompt_len=1024, num_completions=3, completion_len=256)
    assert scaled("star", 0.5, num_completions=3) == expected


@pytest.mark.parametrize("name,scale", [("nope", 1.0), ("star", 0.0)], ids=["unknown-shape", "zero-scale"])
def test_scaled_rejects_bad_arguments(name, scale):
    with pytest.raises(ValueError):
        scaled(name, scale)
