"""The per-update rollout figures of ``harts.trainer.rollout_stats`` against hand-computed values:
rewards with some missing, groups of constant reward, masked responses, advantages of loss rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harts import Rollout
from harts.trainer.progress import progress_line
from harts.trainer.rollout_stats import (
    advantage_stats,
    groups_same_reward,
    response_tokens,
    reward_stats,
    rollout_stats,
)


def _r(n: int, reward=None, group=None, mask=None) -> Rollout:
    return Rollout(tokens=list(range(n)), reward=reward, group_id=group, loss_mask=mask)


def test_rewards_skip_rollouts_without_one():
    rollouts = [_r(3, 1.0), _r(3, None), _r(3, 0.0), _r(3, 2.0)]
    stats = reward_stats(rollouts)
    assert stats["reward_mean"] == pytest.approx(1.0)
    assert stats["reward_std"] == pytest.approx(math.sqrt(2 / 3))  # population: (0 + 1 + 1) / 3
    assert (stats["reward_min"], stats["reward_max"]) == (0.0, 2.0)
    assert reward_stats([_r(3), _r(4)]) == {}


def test_groups_same_reward_counts_groups_with_a_reward():
    rollouts = [
        _r(3, 1.0, "a"), _r(3, 1.0, "a"),  # constant: no signal
        _r(3, 0.0, "b"), _r(3, 1.0, "b"),  # varied
        _r(3, None, "c"), _r(3, None, "c"),  # no reward: left out
        _r(3, 0.5, "d"), _r(3, None, "d"),  # one reward left: constant
        _r(3, 0.0, None), _r(3, 1.0, None),  # two groups of their own: constant each
    ]  # fmt: skip
    assert groups_same_reward(rollouts) == pytest.approx(4 / 5)  # a, d, two singles of 5 groups
    assert groups_same_reward([_r(3, 0.0, "x"), _r(3, 1.0, "x")]) == 0.0
    assert groups_same_reward([_r(3), _r(3)]) is None


def test_response_tokens_count_mask_positions_but_the_first():
    rollouts = [
        _r(5),  # no mask: positions 1..4
        _r(6, mask=[1, 1, 0, 0, 1, 1]),  # position 0 never counts: 3
        _r(4, mask=np.zeros(4, dtype=bool)),  # fully masked: 0
        _r(7, mask=torch.tensor([0, 0, 0, 1, 1, 1, 1])),  # 4
    ]
    expected = {"response_tokens_mean": (4 + 3 + 0 + 4) / 4, "response_tokens_max": 4}
    assert response_tokens(rollouts) == expected
    assert response_tokens([]) == {}


def test_advantage_stats_are_population_moments_of_the_rows():
    stats = advantage_stats(torch.tensor([1.0, -1.0, 3.0, 1.0]))
    assert stats["advantage_mean"] == pytest.approx(1.0)
    assert stats["advantage_std"] == pytest.approx(math.sqrt((0 + 4 + 4 + 0) / 4))
    assert advantage_stats(torch.zeros(0)) == {}


def test_rollout_stats_leave_out_reward_keys_without_rewards():
    assert rollout_stats([_r(3), _r(5)]) == {"response_tokens_mean": 3.0, "response_tokens_max": 4}
    stats = rollout_stats([_r(3, 1.0, "g"), _r(5, 1.0, "g")])
    assert stats["groups_same_reward"] == 1.0 and stats["reward_std"] == 0.0


def test_progress_line_shows_reward_and_response_length_when_present():
    record = {"step": 1, "epoch": 0, "loss": 0.5, "lr": 1e-4, "grad_norm": 1.0, "unique_tokens_per_s": 10.0,
              "flat_tokens_per_s": 20.0, "redundancy": 2.0, "seconds": 1.0}  # fmt: skip
    assert "reward" not in progress_line(record, 3, 2.0) and "resp" not in progress_line(record, 3, 2.0)
    line = progress_line({**record, "reward_mean": 0.5312, "response_tokens_mean": 142.6}, 3, 2.0)
    assert "| reward 0.531 |" in line and "| resp 143 tok |" in line
