"""A trajectory split where its context drifted counts once: in the group baselines and in the
per-trajectory figures, every piece taking the trajectory's advantage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import harts
from harts.data.rollout_files import ContextDriftWarning, read_rollouts
from harts.objectives import validate_rollouts
from harts.objectives.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from harts.trainer.rollout_stats import rollout_stats
from tests.helpers import run_train, write_config

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # 8 trajectories, mean 0.375


def _turns_file(path, logprobs: bool = False) -> None:
    """One group of 8 two-turn trajectories; trajectory 'd' (reward 1) drifts at its second turn;
    ``logprobs``: with the engine's log-probs of every completion token."""
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
            if logprobs:
                line["completion_logprobs"] = [
                    -0.5 - 0.1 * k for k in range(len(line["completion_token_ids"]))
                ]
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


def _run_config(tmp_path, name: str, strategy: str | None) -> Path:
    tables = dict(
        model={"tiny": "qwen3"},
        data={"path": str(tmp_path / "turns.jsonl"), "rollouts_per_step": 9},
        objective={"kind": "ppo", "advantage": "grpo", "correction": "seq-tis", "correction_high": 2.0},
        ppo={"epochs": 1, "mini_batches": 1, "old_logprobs": "policy"},
        run={"budget_tokens": 16},
        logging={"plot": False},
    )
    if strategy is not None:
        tables["distributed"] = {"strategy": strategy, "timeout_s": 120}
    return write_config(tmp_path / f"{name}.toml", {"steps": 1, "max_grad_norm": 0}, tables)


def _first_record(out: Path) -> dict:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.multiprocess
def test_harts_train_counts_a_split_trajectory_once_on_one_and_two_ranks(tmp_path):
    """The turns file above under ``harts train`` (GRPO, a sequence-level correction, the engine's
    log-probs against the trainer's): ``reward_mean`` over the 8 trajectories, the advantages of
    per-trajectory GRPO; 2 DDP ranks record what one process does (the loss within 2e-4, a sum of
    both signs in another order; the figures of the rewards exactly)."""
    from tests.test_distributed import _torchrun

    _turns_file(tmp_path / "turns.jsonl", logprobs=True)
    assert run_train(_run_config(tmp_path, "one", None), tmp_path / "one") == 0
    one = _first_record(tmp_path / "one")
    assert one["reward_mean"] == 0.375
    per_trajectory = grpo_advantages(
        torch.tensor(REWARDS, dtype=torch.float64), torch.zeros(8, dtype=torch.long)
    )
    # each trajectory's 3 completion tokens are loss rows, pieces or not: the rows' mean advantage
    assert one["advantage_mean"] == pytest.approx(float(per_trajectory.mean()), abs=1e-6)
    for key in ("mismatch_kl", "mismatch_prob_corr", "correction_truncated_fraction"):
        assert np.isfinite(one[key]), key
    done = _torchrun(
        "-m",
        "harts",
        "train",
        str(_run_config(tmp_path, "two", "ddp")),
        "--out",
        str(tmp_path / "two"),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    two = _first_record(tmp_path / "two")
    for key in ("reward_mean", "groups_same_reward", "response_tokens_mean"):
        assert two[key] == one[key], key
    assert two["advantage_mean"] == pytest.approx(one["advantage_mean"], abs=1e-9)
    assert abs(two["loss"] - one["loss"]) <= 2e-4 * abs(one["loss"])
