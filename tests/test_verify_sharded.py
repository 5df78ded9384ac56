"""``RunConfig(verify=True)`` on an FSDP2-sharded model, with real processes (gloo on CPU).

What must hold: on two ranks an exact step passes and computes the same bits on every rank as
without the check (loss, each rank's gradient shards); tree attention off by 1e-3 in its query's
gradient is a VerificationError on every rank with no gradient left; ``harts train`` with
``strategy = "fsdp"`` verifies its first update, and a faulty kernel stops every rank before
the optimizer step (no checkpoint written).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import write_config
from tests.test_distributed import HERE, _torchrun


@pytest.mark.multiprocess
def test_two_sharded_ranks_verify_in_lock_step(tmp_path):
    out = tmp_path / "reports.pt"
    done = _torchrun(str(HERE / "verify_worker.py"), "qwen3", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = torch.load(out)
    assert len(reports) == 2
    for rank in reports:
        assert rank["same_bits"]
        figures = rank["figures"]
        assert figures["verify_value_error"] <= figures["verify_value_bound"]
        assert 0.0 < figures["verify_gradient_ratio"] <= 1.0
        assert rank["caught"] is not None and "verification of rollout_step failed" in rank["caught"]
        assert "parameter model.layers." in rank["caught"]
        assert rank["untouched"]
    # the verdict is the ranks' one: the same figures everywhere
    assert reports[0]["figures"]["verify_gradient_ratio"] == reports[1]["figures"]["verify_gradient_ratio"]


def _config(tmp_path, **run):
    return write_config(
        tmp_path / f"train{len(run)}.toml",
        {"steps": 2},
        objective={"kind": "ppo", "advantage": "grpo"},
        optimizer={"lr": 1e-3},
        run={"budget_tokens": 48, **run},
        distributed={"strategy": "fsdp", "timeout_s": 60},
    )


@pytest.mark.multiprocess
def test_harts_train_under_fsdp_verifies_its_first_update(tmp_path):
    done = _torchrun(
        "-m", "harts", "train", str(_config(tmp_path)), "--out", str(tmp_path / "ok"), timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verified against the stock forward (fp32" in done.stderr, done.stderr[-3000:]
    records = (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()
    assert '"verify_gradient_ratio"' in records[0] and '"verify_gradient_ratio"' not in records[1]
    # the fault's backend is registered by the worker's import of tests.test_verify in each rank
    faulty = _config(tmp_path, backend="test-off-in-backward")
    done = _torchrun(str(HERE / "verify_train.py"), "train", str(faulty), "--out", str(tmp_path / "bad"),
                     timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.count("verification of forest_step failed") >= 1, done.stderr[-3000:]
    written = tmp_path / "bad" / "checkpoints"
    assert not written.exists() or not list(written.iterdir())
