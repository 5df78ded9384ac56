"""``RunConfig(verify=True)`` on an FSDP2-sharded model, with real processes (gloo on CPU).

What must hold: on two ranks an exact step passes and computes the same bits on every rank as
without the check (loss, each rank's gradient shards); tree attention off by 1e-3 in its query's
gradient is a VerificationError on every rank with no gradient left; in low precision, fp32
shards under ``MixedPrecisionPolicy(param_dtype=bf16)`` and bf16 shards, the same, with tree
attention's output x1.01 in every precision caught by the algorithm's check at fp32 and x1.05 in
bf16 alone by the kernels' check; ``harts train`` with ``strategy = "fsdp"`` verifies its first
update, in fp32 and with a bf16 model, and a faulty kernel stops every rank before the optimizer
step (no checkpoint written).
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
        caught = rank["caught"]["test-attention-off-in-backward"]
        assert caught is not None and "verification of rollout_step failed" in caught
        assert "parameter model.layers." in caught
        assert rank["untouched"]
    # the verdict is the ranks' one: the same figures everywhere
    assert reports[0]["figures"]["verify_gradient_ratio"] == reports[1]["figures"]["verify_gradient_ratio"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape", ["mixed", "bf16"])
def test_two_sharded_ranks_verify_low_precision_in_lock_step(tmp_path, shape):
    """fp32 shards computing in bf16 (FSDP2's MixedPrecisionPolicy) and bf16 shards: both halves of
    the low-precision check run sharded, the same bits come out, and each fault is caught by its
    half on every rank, before anything reaches ``.grad``."""
    out = tmp_path / "reports.pt"
    done = _torchrun(str(HERE / "verify_worker.py"), "qwen3", str(out), shape, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = torch.load(out)
    assert len(reports) == 2
    label = "bfloat16 FSDP2 mixed precision" if shape == "mixed" else "bfloat16 parameters"
    for rank in reports:
        assert rank["same_bits"]
        f = rank["figures"]
        assert f["verify_value_error"] <= f["verify_value_bound"]
        assert 0.0 < f["verify_gradient_ratio"] <= 1.0
        assert f["verify_algorithm_value_error"] <= f["verify_algorithm_value_bound"] == 2e-4
        assert 0.0 < f["verify_algorithm_gradient_ratio"] <= 1.0
        assert 0.0 < f["verify_kernel_ratio"] <= 1.0
        every, bf16_only = rank["caught"]["test-out-1.01"], rank["caught"]["test-bf16-out-1.05"]
        assert every is not None and every.startswith("verification of rollout_step (its algorithm, at fp32")
        assert bf16_only is not None and f"failed ({label})" in bf16_only
        assert "tree attention's kernel in bfloat16" in bf16_only
        assert "autocast around an FSDP2-sharded model is not checked" in rank["refused"]
        assert rank["untouched"]
    assert reports[0]["figures"] == {
        **reports[1]["figures"],
        "verify_seconds": reports[0]["figures"]["verify_seconds"],
    }


def _config(tmp_path, model=None, **run):
    return write_config(
        tmp_path / f"train{len(run)}{'' if model is None else '-' + model['dtype']}.toml",
        {"steps": 2},
        model=model or {},
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


@pytest.mark.multiprocess
def test_harts_train_under_fsdp_verifies_a_bf16_model(tmp_path):
    """A bf16 model sharded by ``harts train``: its first update is checked in bf16 (both halves),
    and a kernel wrong in bf16 alone stops every rank before the optimizer step."""
    bf16 = {"tiny": "qwen3", "dtype": "bfloat16"}
    done = _torchrun(
        "-m", "harts", "train", str(_config(tmp_path, bf16)), "--out", str(tmp_path / "ok"), timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "verified against the stock forward (bfloat16 parameters" in done.stderr, done.stderr[-3000:]
    assert "run.verify: not here" not in done.stderr and "of rank 0's trees" in done.stderr
    assert "attention kernels at" in done.stderr  # both halves of the low-precision check ran
    faulty = _config(tmp_path, bf16, backend="test-bf16-out-1.05")
    done = _torchrun(str(HERE / "verify_train.py"), "train", str(faulty), "--out", str(tmp_path / "bad"),
                     timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert "verification of forest_step failed (bfloat16 parameters)" in done.stderr, done.stderr[-3000:]
    assert "tree attention's kernel in bfloat16" in done.stderr
    written = tmp_path / "bad" / "checkpoints"
    assert not written.exists() or not list(written.iterdir())
