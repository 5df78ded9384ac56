"""``[logging] backends``: a short run writes real TensorBoard event files and a real offline wandb
run holding the step records of ``metrics.jsonl``; a backend whose package is missing is refused
before the model loads, naming the extra that installs it. A record holds the figures of its
update's rollouts (rewards, constant-reward groups, advantages, response lengths), and the
progress line shows them.

The packages come with the ``logging`` extra (``make test`` installs it); without them the
file-writing tests skip, saying so.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, one_thread, run_train, write_config  # noqa: F401 (autouse: one thread)


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_events_hold_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = write_config(tmp_path / "run.toml", logging={"backends": ["jsonl", "tensorboard"]})
    assert run_train(config, tmp_path / "out") == 0
    events = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    events.Reload()
    records = _metrics(tmp_path / "out")
    assert len(records) == 3
    for key in ("loss", "grad_norm", "lr", "unique_tokens", "redundancy"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [r["step"] for r in records]
        # stored as float32: the record's value rounded once to fp32
        assert [s.value for s in scalars] == [float(_f32(r[key])) for r in records], key


def _f32(x: float) -> float:
    import numpy as np

    return float(np.float32(x))


def test_wandb_writes_an_offline_run_with_the_metrics(tmp_path, monkeypatch):
    import wandb  # noqa: F401 (the logging extra, installed by make test: missing is a failure)

    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    config = write_config(tmp_path / "run.toml", logging={"backends": ["jsonl", "wandb"]})
    assert run_train(config, tmp_path / "out") == 0
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one offline run, nothing uploaded"
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    # wandb's record log stores each logged value as its JSON text: every step's loss is in it
    for record in _metrics(tmp_path / "out"):
        assert json.dumps(record["loss"]).encode() in data
        assert json.dumps(record["grad_norm"]).encode() in data
    assert b"grad_norm" in data and b"unique_tokens_per_s" in data


@pytest.mark.parametrize("backend, package", [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")])
def test_a_missing_package_is_refused_naming_the_extra(tmp_path, backend, package):
    """A real ``harts train`` process in which importing the package fails, as where it is absent."""
    config = write_config(tmp_path / "run.toml", logging={"backends": ["jsonl", backend]})
    blocked = f"import sys; sys.modules[{package!r}] = None; from harts.cli import main; main()"
    command = [sys.executable, "-c", blocked, "train", str(config), "--out", str(tmp_path / "out")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"logging.backends: '{backend}' needs the" in done.stderr
    assert "pip install 'harts[logging]'" in done.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_jsonl_cannot_be_left_out(tmp_path, capsys):
    config = write_config(tmp_path / "run.toml", logging={"backends": ["tensorboard"]})
    assert run_train(config, tmp_path / "out") == 2
    assert "keep \"jsonl\" in the list" in capsys.readouterr().err


def test_a_record_holds_the_reward_advantage_and_response_figures_of_its_rollouts(tmp_path, capsys):
    """One Dr. GRPO step on the example rollouts: its record's figures recomputed by hand from the
    step's rollouts (advantage r - group mean on every loss-bearing token)."""
    import numpy as np

    from harts import iter_rollout_steps
    from tests.helpers import EXAMPLE_ROLLOUTS

    config = write_config(tmp_path / "run.toml", top={"steps": 1},
                          objective={"kind": "ppo", "advantage": "dr_grpo"})  # fmt: skip
    assert run_train(config, tmp_path / "out") == 0
    (record,) = _metrics(tmp_path / "out")
    rollouts = next(iter(iter_rollout_steps(EXAMPLE_ROLLOUTS, 8)))
    assert record["rollouts"] == len(rollouts)
    rewards = np.array([r.reward for r in rollouts], dtype=np.float64)
    assert record["reward_mean"] == pytest.approx(rewards.mean())
    assert record["reward_std"] == pytest.approx(rewards.std())
    assert (record["reward_min"], record["reward_max"]) == (rewards.min(), rewards.max())
    groups = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r.reward)
    assert record["groups_same_reward"] == pytest.approx(
        sum(len(set(g)) == 1 for g in groups.values()) / len(groups))  # fmt: skip
    lengths = np.array([np.asarray(r.loss_mask, dtype=bool)[1:].sum() for r in rollouts])
    assert record["response_tokens_mean"] == pytest.approx(lengths.mean())
    assert record["response_tokens_max"] == lengths.max()
    means = {g: np.mean(v) for g, v in groups.items()}
    per_token = np.repeat([r.reward - means[r.group_id] for r in rollouts], lengths)
    assert record["advantage_mean"] == pytest.approx(per_token.mean(), abs=1e-6)
    assert record["advantage_std"] == pytest.approx(per_token.std(), rel=1e-5)
    assert record["advantage_std"] > 0  # the step's rollouts hold a group with a signal
    err = capsys.readouterr().err
    assert f"| reward {record['reward_mean']:.3g} |" in err
    assert f"| resp {record['response_tokens_mean']:,.0f} tok |" in err
