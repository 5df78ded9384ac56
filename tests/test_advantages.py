"""Advantage estimators against plain loops over trajectories and positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.forest import build_forest
from harts.objectives import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    Rollout,
    advantages_to_rollouts,
    build_loss_rows,
    dr_grpo_advantages,
    estimate_advantages,
    grpo_advantages,
    pitfall_advantages,
    rloo_advantages,
    tree_advantages,
    with_advantages,
)

VOCAB = 5
ATOL = 1e-12


def random_rollouts(seed: int, num: int = 14, num_groups: int = 3) -> list[Rollout]:
    """Shared prefixes at many depths, a duplicate, a prefix of another, a singleton group."""
    g = np.random.default_rng(seed)
    trajs: list[np.ndarray] = []
    for _ in range(num):
        if trajs and g.random() < 0.7:
            base = trajs[int(g.integers(len(trajs)))]
            cut = int(g.integers(1, len(base) + 1))
            trajs.append(np.concatenate([base[:cut], g.integers(0, VOCAB, size=int(g.integers(1, 5)))]))
        else:
            trajs.append(g.integers(0, VOCAB, size=int(g.integers(2, 7))))
    trajs += [trajs[1].copy(), trajs[2][:-1].copy() if len(trajs[2]) > 1 else trajs[2].copy()]
    out = []
    for i, t in enumerate(trajs):
        mask = g.random(len(t)) < 0.8
        mask[0] = False
        err = int(g.integers(0, len(t))) if g.random() < 0.5 else None
        group = "alone" if i == 0 else int(g.integers(num_groups))
        out.append(Rollout(t, loss_mask=mask, reward=float(g.standard_normal()), group_id=group,
                           first_error_position=err))  # fmt: skip
    return out


# ---- loop references -----------------------------------------------------------------------------
def loop_group_advantages(rewards, groups, kind, eps=1e-6):
    out = []
    for r, gid in zip(rewards, groups, strict=True):
        members = [x for x, h in zip(rewards, groups, strict=True) if h == gid]
        mean = sum(members) / len(members)
        if kind == "grpo":
            std = (sum((x - mean) ** 2 for x in members) / len(members)) ** 0.5
            out.append((r - mean) / (std + eps))
        elif kind == "dr_grpo":
            out.append(r - mean)
        else:  # rloo
            others = len(members) - 1
            out.append(r - (sum(members) - r) / others if others else 0.0)
    return out


def loop_tree_advantage(rollouts, groups, i, p):
    """V(node of position p) - V(parent node), from sets of trajectories sharing a prefix."""
    tokens = [list(r.tokens) for r in rollouts]
    rewards = [r.reward for r in rollouts]

    def through(q):  # trajectories whose path contains position q of trajectory i
        return frozenset(j for j, t in enumerate(tokens) if len(t) > q and t[: q + 1] == tokens[i][: q + 1])

    def value(members):
        return sum(rewards[j] for j in members) / len(members)

    here = through(p)
    q = p - 1
    while q >= 0 and through(q) == here:  # same node
        q -= 1
    if q >= 0:
        return value(here) - value(through(q))
    members = [j for j in range(len(rollouts)) if groups[j] == groups[i]]
    return value(here) - value(members)


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_group_estimators_match_loops(kind, seed):
    rollouts = random_rollouts(seed)
    rows = build_loss_rows(build_forest([r.tokens for r in rollouts]), rollouts, dtype=torch.float64)
    fn = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}[kind]
    got = fn(rows.reward, rows.group)
    ref = loop_group_advantages([r.reward for r in rollouts], rows.group.tolist(), kind)
    assert torch.allclose(got, torch.tensor(ref, dtype=torch.float64), atol=ATOL, rtol=0)
    assert got[0] == 0.0  # the singleton group
    # through the registry, broadcast to rows
    est = estimate_advantages(rows, kind)
    assert est.has_advantage and torch.allclose(est.advantage, got[rows.trajectory], atol=ATOL, rtol=0)


def test_rloo_is_scaled_dr_grpo():
    reward = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5], dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 1, 1])
    n = torch.tensor([3.0, 3, 3, 2, 2], dtype=torch.float64)
    assert torch.allclose(rloo_advantages(reward, group), n / (n - 1) * dr_grpo_advantages(reward, group))


@pytest.mark.parametrize("seed", [0, 1, 2, 3], ids=lambda s: f"seed{s}")
def test_tree_advantages_match_prefix_set_loops(seed):
    rollouts = random_rollouts(seed)
    forest = build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts, dtype=torch.float64)
    got = tree_advantages(forest, rows)
    groups = rows.group.tolist()
    ref = [
        loop_tree_advantage(rollouts, groups, int(i), int(p))
        for i, p in zip(rows.trajectory, rows.position, strict=True)
    ]
    assert torch.allclose(got, torch.tensor(ref, dtype=torch.float64), atol=ATOL, rtol=0)


def test_tree_advantages_reduce_to_dr_grpo_without_sharing():
    rollouts = random_rollouts(5)
    flat = build_forest([r.tokens for r in rollouts], share_prefixes=False)
    rows = build_loss_rows(flat, rollouts, dtype=torch.float64)
    expected = dr_grpo_advantages(rows.reward, rows.group)[rows.trajectory]
    assert torch.allclose(tree_advantages(flat, rows), expected, atol=ATOL, rtol=0)
    # star: one prompt per group, distinct completions: the completion tokens get Dr. GRPO's advantage
    star = [
        Rollout([7, 7, 7, k, k + 1], loss_mask=[0, 0, 0, 1, 1], reward=float(k), group_id=0) for k in range(4)
    ]
    forest = build_forest([r.tokens for r in star])
    rows = build_loss_rows(forest, star, dtype=torch.float64)
    expected = dr_grpo_advantages(rows.reward, rows.group)[rows.trajectory]
    assert torch.allclose(tree_advantages(forest, rows), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("a_pos", "a_neg"), [(1.0, 1.0), (0.5, 2.0)], ids=["sym", "pos0.5-neg2"])
def test_pitfall_advantages_match_loop(a_pos, a_neg):
    rollouts = random_rollouts(6)
    rows = build_loss_rows(build_forest([r.tokens for r in rollouts]), rollouts, dtype=torch.float64)
    ref = []
    for i, p in zip(rows.trajectory.tolist(), rows.position.tolist(), strict=True):
        e = rollouts[i].first_error_position
        ref.append(-a_neg if e is not None and p >= e else a_pos)
    assert pitfall_advantages(rows, a_pos, a_neg).tolist() == ref
    est = estimate_advantages(rows, AdvantageEstimator.PITFALL, a_pos=a_pos, a_neg=a_neg)
    assert est.advantage.tolist() == ref


def test_registry_and_write_back_to_rollouts():
    assert set(ADVANTAGE_ESTIMATORS) == set(AdvantageEstimator)
    rollouts = random_rollouts(7)
    forest = build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs the forest"):
        estimate_advantages(rows, "tree")
    adv = estimate_advantages(rows, "tree", forest=forest).advantage
    # written into rollouts, rebuilt into rows of a different layout: same per-row values
    written = advantages_to_rollouts(rollouts, rows, adv)
    rebuilt = build_loss_rows(build_forest([r.tokens for r in written], share_prefixes=False), written,
                              dtype=torch.float64)  # fmt: skip
    assert torch.equal(rebuilt.advantage, adv)
    per_traj = with_advantages(rows, torch.arange(rows.num_trajectories, dtype=torch.float64))
    assert torch.equal(per_traj.advantage, rows.trajectory.double())
    with pytest.raises(ValueError, match=r"\[R\]"):
        with_advantages(rows, torch.zeros(rows.num_rows + 1))


def test_missing_reward_names_the_trajectory():
    rollouts = random_rollouts(8)
    rollouts[2] = Rollout(rollouts[2].tokens, loss_mask=rollouts[2].loss_mask, reward=None)
    rows = build_loss_rows(build_forest([r.tokens for r in rollouts]), rollouts)
    for name in ("grpo", "tree"):
        with pytest.raises(ValueError, match="trajectory 2"):
            estimate_advantages(rows, name, forest=build_forest([r.tokens for r in rollouts]))
