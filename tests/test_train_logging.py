"""``[logging] backends``: a short run writes real TensorBoard event files and a real offline wandb
run holding the step records of ``metrics.jsonl``; a backend whose package is missing is refused
before the model loads, naming the extra that installs it.

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
