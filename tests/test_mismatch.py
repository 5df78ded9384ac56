"""The engine-trainer mismatch figures: exact on known log-probs, in every record of ``harts train``
and its progress line, and reported by ``harts analyze FILE --model M`` without training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import harts
from harts.analyze import main as analyze_main
from harts.objectives.mismatch import mismatch_figures
from harts.tiny import tiny_model
from harts.trainer.progress import progress_line
from tests.helpers import run_train, write_config, write_small_rollouts

FAMILY = "qwen3"


def test_figures_on_known_log_probs():
    """Two trajectories of 8 and 4 loss tokens; the trainer is off by 0.1 on the last quarter of each."""
    trajectory = torch.tensor([0] * 8 + [1] * 4)
    behaviour = -torch.linspace(0.1, 3.0, 12, dtype=torch.float64)
    old = behaviour.clone()
    old[6:8] += 0.1
    old[11] += 0.1
    figures = mismatch_figures(behaviour, old, trajectory)
    assert figures["mismatch_log_rho_abs_max"] == pytest.approx(0.1, abs=1e-12)
    for q in (1, 2, 3):
        assert figures[f"mismatch_kl_q{q}"] == 0 and figures[f"mismatch_log_rho_abs_q{q}"] == 0
    assert figures["mismatch_log_rho_abs_q4"] == pytest.approx(0.1, abs=1e-12)
    assert figures["mismatch_kl_q4"] == pytest.approx(np.expm1(0.1) - 0.1, abs=1e-12)
    expected = np.corrcoef(behaviour.exp().numpy(), old.exp().numpy())[0, 1]
    assert figures["mismatch_prob_corr"] == pytest.approx(expected, abs=1e-12)
    same = mismatch_figures(behaviour, behaviour, trajectory)
    assert same["mismatch_prob_corr"] == pytest.approx(1.0, abs=1e-12) and same["mismatch_kl_q4"] == 0
    assert mismatch_figures(behaviour[:0], old[:0], trajectory[:0]) == {}


def test_harts_train_records_and_prints_the_mismatch(tmp_path, capsys):
    data = write_small_rollouts(tmp_path / "small.jsonl")
    tables = dict(
        model={"tiny": FAMILY},
        data={"path": str(data), "rollouts_per_step": 9},
        objective={"kind": "ppo", "advantage": "grpo"},
        ppo={"epochs": 1, "mini_batches": 1, "old_logprobs": "policy"},
        logging={"plot": False},
    )
    config = write_config(tmp_path / "run.toml", {"steps": 1}, tables)
    assert run_train(config, tmp_path / "out") == 0
    record = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    for key in (
        "mismatch_kl",
        "mismatch_log_rho_abs_max",
        "mismatch_prob_corr",
        "mismatch_kl_q1",
        "mismatch_kl_q4",
    ):
        assert np.isfinite(record[key]), key
    assert -1 <= record["mismatch_prob_corr"] <= 1
    output = capsys.readouterr()
    assert f"mismatch kl {record['mismatch_kl']:.2e}" in output.out + output.err
    assert "mismatch kl" in progress_line(record, 1, 0.0)


def test_analyze_reports_the_files_mismatch_without_training(tmp_path, capsys):
    """The file's engine log-probs are the tiny model's own (seed 0) except on the last quarter of each
    trajectory's loss tokens, off by 0.05: the report finds that gap there and nowhere else."""
    rollouts = harts.read_rollouts(write_small_rollouts(tmp_path / "small.jsonl"))
    model = tiny_model(FAMILY, seed=0)
    with torch.no_grad():
        own = harts.forest_logprobs(model, rollouts, loss_positions_only=True).logprobs
    lines = []
    for r, logprobs in zip(rollouts, own, strict=True):
        where = np.flatnonzero(np.asarray(r.loss_mask, dtype=bool))
        engine = logprobs.double().numpy().copy()
        last = where[(4 * np.arange(where.size)) // where.size == 3]
        engine[last] -= 0.05
        lines.append(
            {
                "tokens": list(r.tokens),
                "loss_mask": list(r.loss_mask),
                "rollout_logprobs": engine.tolist(),
                "reward": r.reward,
                "group_id": r.group_id,
            }
        )
    path = tmp_path / "engine.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    stats = analyze_main([str(path), "--model", FAMILY, "--json", "--budget", "16"])
    capsys.readouterr()
    assert stats["mismatch_tokens"] == sum(int(np.sum(r.loss_mask)) for r in rollouts)
    for q in (1, 2, 3):
        assert stats[f"mismatch_log_rho_abs_q{q}"] <= 1e-6  # the same model, another micro-batch plan
    assert stats["mismatch_log_rho_abs_q4"] == pytest.approx(0.05, abs=1e-6)
    assert stats["mismatch_log_rho_abs_max"] == pytest.approx(0.05, abs=1e-6)
