"""``make gpu-check`` without a CUDA device: it says so, runs the backend seam's CPU tests, writes its
JSON and table, and exits 0 (on a GPU machine the same command runs the CUDA stages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harts.bench.gpu_check import gpu_test_files, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the GPU stages would run")
def test_without_cuda_the_check_says_so_and_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["--out", str(tmp_path), "--time-limit", "300"]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
    results = json.loads((tmp_path / "gpu-check.json").read_text())
    assert results["device"] == "no CUDA device" and results["bench"] == {}
    assert [(s["name"], s["status"]) for s in results["stages"]] == [("cpu-tests", "passed")]
    assert "| cpu-tests | passed |" in (tmp_path / "gpu-check.md").read_text()


def test_a_failing_stage_fails_the_check(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("harts.bench.gpu_check.CPU_TESTS", ["tests/no_such_test_file.py"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--out", str(tmp_path), "--time-limit", "300"]) == 1
    status = json.loads((tmp_path / "gpu-check.json").read_text())["stages"][0]["status"]
    assert status.startswith("failed")


def test_the_cuda_stage_collects_exactly_the_files_that_mark_a_test_gpu(tmp_path):
    (tmp_path / "test_marked.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_x(): pass\n")
    (tmp_path / "test_plain.py").write_text("import trl  # a CPU-side package a CUDA image may lack\n")
    (tmp_path / "helper.py").write_text("# pytest.mark.gpu, but not a test file\n")
    assert gpu_test_files(tmp_path) == [str(tmp_path / "test_marked.py")]
    in_repo = gpu_test_files(ROOT / "tests")
    assert str(ROOT / "tests" / "test_gpu_backend.py") in in_repo
    assert str(ROOT / "tests" / "test_integrations_trl.py") not in in_repo
