"""``[eval]``: held-out rollouts scored forward only during a run, against each trajectory alone.

The run's ``eval/loss`` after its last update must equal the mean negative log-prob of every
eval rollout run alone through the stock forward of the final checkpoint (fp64), and
``eval/kl`` the KL estimate from those stock log-probs and the starting weights' ones.

Tolerance: each fp32 log-prob is within ``TOL = 2 * LOGIT_ATOL`` of the exact one
(``tests/test_train_reference.py``), so a mean of them is too. The k3 KL term
``exp(d) - d - 1`` (``d`` = reference minus policy log-prob) moves by at most
``|exp(d') - 1| * |delta d|`` with ``|delta d| <= 2 TOL`` (two log-probs), ``d'`` within
``2 TOL`` of ``d``: the bound is that, per token, averaged.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from harts.data.rollout_files import read_rollouts
from harts.tiny import tiny_model
from tests.helpers import (
    FAMILY,
    one_thread,  # noqa: F401 (autouse: one thread)
    run_train,
    write_config,
    write_small_rollouts,
)
from tests.reference import LOGIT_ATOL, stock_logprobs

TOL = 2 * LOGIT_ATOL


def _stock(model, rollouts) -> torch.Tensor:
    """The loss-position log-probs of each rollout alone through the stock forward in fp64."""
    scored = zip(stock_logprobs(model, rollouts), rollouts, strict=True)
    return torch.cat([lp[torch.as_tensor(r.loss_mask, dtype=torch.bool)] for lp, r in scored])


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    data = write_small_rollouts(tmp / "train.jsonl")
    held_out = write_small_rollouts(tmp / "held_out.jsonl", groups=3, seed=7)
    config = write_config(
        tmp / "run.toml", {"steps": 4},
        data={"path": str(data), "rollouts_per_step": 9},
        objective={"kind": "ppo", "advantage": "grpo", "kl_coef": 0.1},
        reference={"model": "initial"}, optimizer={"lr": 1e-2, "weight_decay": 0.0},
        checkpoint={"every": 0}, eval={"file": str(held_out), "every_steps": 2, "budget_tokens": 16},
    )  # fmt: skip
    assert run_train(config, tmp / "out") == 0
    records = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    return records, read_rollouts(held_out), tmp / "out" / "checkpoints" / "step-000004"


def test_eval_runs_every_few_steps_and_after_the_last(eval_run):
    records, _, _ = eval_run
    assert ["eval/loss" in r for r in records] == [False, True, False, True]
    assert records[1]["eval/loss"] != records[3]["eval/loss"]  # the weights moved between them


def test_eval_loss_and_kl_equal_each_trajectory_alone(eval_run):
    records, rollouts, final = eval_run
    policy = _stock(AutoModelForCausalLM.from_pretrained(final), rollouts)
    initial = _stock(tiny_model(FAMILY, seed=0), rollouts)
    last = records[-1]
    assert last["eval/tokens"] == policy.numel()
    assert abs(last["eval/loss"] - float(-policy.mean())) <= TOL
    assert last["eval/logprob"] == -last["eval/loss"]
    d = initial - policy
    kl = float((torch.exp(d) - d - 1).mean())
    bound = float(((torch.exp(d.abs() + 2 * TOL) - 1) * 2 * TOL).mean())
    assert abs(last["eval/kl"] - kl) <= bound
    assert kl > 100 * bound  # the reference is far enough from the policy for the check to tell
    # the check can fail: the starting weights' loss is beyond TOL of the final one's
    assert abs(last["eval/loss"] - float(-initial.mean())) > 100 * TOL
    assert math.isfinite(last["eval/seconds"])


def test_a_bad_eval_line_stops_the_run_before_any_step(tmp_path, capsys):
    bad = tmp_path / "held_out.jsonl"
    bad.write_text('{"tokens": [1, 2, 3], "loss_mask": [0, 1]}\n')
    config = write_config(tmp_path / "run.toml", eval={"file": str(bad)})
    assert run_train(config, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "held_out.jsonl, line 1" in err and "loss_mask has 2 values" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
