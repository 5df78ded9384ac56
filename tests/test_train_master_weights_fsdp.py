"""bf16 with fp32 master weights under FSDP2 (gloo on CPU, two real processes): each master is a
DTensor sharded as its parameter, checkpointed with its optimizer state, and a resume on the
same ranks ends with the uninterrupted run's bytes."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, write_config


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
               "-m", "harts", "train", *args]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _dcp_state(checkpoint: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "state", target)
    return torch.load(target, weights_only=True)


@pytest.mark.multiprocess
def test_bf16_muon_under_fsdp_trains_fp32_masters_and_resumes_bit_for_bit(tmp_path):
    config = write_config(
        tmp_path / "train.toml",
        {"steps": 4},
        model={"tiny": "llama", "dtype": "bfloat16"},
        optimizer={"kind": "muon", "lr": 1e-5},
        checkpoint={"every": 2, "keep_last": 3},
        distributed={"strategy": "fsdp", "timeout_s": 60},
    )
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    done = _torchrun(str(config), "--out", str(first))
    assert done.returncode == 0, done.stderr[-3000:]
    final = first / "checkpoints" / "step-000004"
    assert len(list((final / "state").glob("*.distcp"))) == 2  # each rank its shard
    shutil.copytree(first, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000004")
    done = _torchrun(str(config), "--out", str(resumed), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr
    got = resumed / "checkpoints" / "step-000004"
    assert (got / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()
    want, have = _dcp_state(final), _dcp_state(got)
    masters = want["masters"]
    assert masters.keys() == have["masters"].keys() and masters
    assert all(m.dtype == torch.float32 and torch.equal(m, have["masters"][k]) for k, m in masters.items())
    # the whole masters, gathered from the two shards, round to the whole bf16 model
    assert all(torch.equal(want["model"][k], m.to(torch.bfloat16)) for k, m in masters.items())
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in masters.values())
