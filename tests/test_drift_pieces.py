"""A trajectory split where its context drifted counts once: in the group baselines and in the
per-trajectory figures, every piece taking the trajectory's advantage."""

from __future__ import annotations

import json

import pytest
import torch

import harts
from harts.data.rollout_files import ContextDriftWarning, read_rollouts
from harts.objectives import validate_rollouts
from harts.objectives.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from harts.trainer.rollout_stats import rollout_stats

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # 8 trajectories, mean 0.375


def _turns_file(path) -> None:
    """One group of 8 two-turn trajectories; trajectory 'd' (reward 1) drifts at its second turn."""
    lines = []
    for i, reward in enumerate(REWARDS):
        name = "abcdefgh"[i]
        prompt = [1, 2, 3, 10 + i]
        first = {
            "trajectory_id": name,
            "turn": 0,
            "prompt_token_ids": prompt,
            "completion_token_ids": [20 + i, 21],
        }
        second_prompt = prompt + [20 + i, 21, 5]
        if name == "d":
            second_prompt = [1, 2, 9] + second_prompt[3:]  # an earlier turn re-rendered: drift
        second = {
            "trajectory_id": name,
            "turn": 1,
            "prompt_token_ids": second_prompt,
            "completion_token_ids": [30 + i],
            "reward": reward,
        }
        for line in (first, second):
            line["group_id"] = "g"
        lines += [first, second]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture
def pieces(tmp_path):
    _turns_file(tmp_path / "turns.jsonl")
    with pytest.warns(ContextDriftWarning):
        return read_rollouts(tmp_path / "turns.jsonl")


def test_the_pieces_carry_the_trajectorys_identity(pieces):
    assert len(pieces) == 9
    split = [r for r in pieces if r.trajectory_id is not None]
    assert [r.trajectory_id for r in split] == ["d", "d"] and {r.reward for r in split} == {1.0}
    stats = rollout_stats(pieces)
    assert stats["reward_mean"] == 0.375  # over the 8 trajectories; over the 9 pieces it reads 0.444
    assert stats["response_tokens_mean"] == 3.0  # each trajectory's 3 completion tokens, pieces summed


@pytest.mark.parametrize("estimator", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_group_estimators_count_a_split_trajectory_once(pieces, estimator):
    forest = harts.build_forest([r.tokens for r in pieces])
    rows = harts.build_loss_rows(forest, pieces)
    name = {grpo_advantages: "grpo", dr_grpo_advantages: "dr_grpo", rloo_advantages: "rloo"}[estimator]
    got = harts.estimate_advantages(rows, name).advantage
    per_trajectory = estimator(torch.tensor(REWARDS, dtype=torch.float64), torch.zeros(8, dtype=torch.long))
    index = {name: i for i, name in enumerate("abcdefgh")}
    # each piece's rows take its trajectory's advantage: match pieces to trajectories by their tokens
    for i, r in enumerate(pieces):
        mine = got[rows.trajectory == i]
        letter = r.trajectory_id or "abcdefgh"[int(r.tokens[3]) - 10]
        assert torch.allclose(mine.double(), per_trajectory[index[letter]].expand_as(mine), rtol=0, atol=1e-6)


def test_pieces_of_one_trajectory_must_agree_on_reward_and_group():
    a = harts.Rollout([1, 2, 3], reward=1.0, group_id="g", trajectory_id="t")
    b = harts.Rollout([4, 5, 6], reward=0.0, group_id="g", trajectory_id="t")
    with pytest.raises(ValueError, match="trajectory 1: a piece of trajectory 't' with reward 0.0"):
        validate_rollouts([a, b])
