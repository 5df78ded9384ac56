"""``make gpu-check`` without a CUDA device: it says so, runs the backend seam's CPU tests, writes its
JSON and table, and exits 0 (on a GPU machine the same command runs the CUDA stages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harts.bench.gpu_check import _stage, gpu_test_files, main
from harts.bench.gpu_child import AUTOTUNE_MODES

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


def test_a_stage_at_its_limit_is_stopped_and_its_log_ends_with_where_it_stood(tmp_path, monkeypatch):
    monkeypatch.setattr("harts.bench.gpu_check.MIN_STAGE_SECONDS", 0.5)
    script = "import time\nprint('started', flush=True)\ndef waiting_here():\n time.sleep(60)\nwaiting_here()"
    cmd = [sys.executable, "-X", "faulthandler", "-c", script]
    start = time.monotonic()
    stage = _stage("slow", cmd, time.monotonic() + 3.0, tmp_path / "slow.log")
    assert stage["status"] == "stopped (time limit)" and time.monotonic() - start < 30
    assert stage["output_tail"].startswith("started") and "in waiting_here" in stage["output_tail"]
    assert (tmp_path / "slow.log").read_text() == stage["output_tail"]


def test_a_stage_without_time_is_not_run(tmp_path):
    stage = _stage("late", [sys.executable, "-c", "pass"], time.monotonic() + 1.0, tmp_path / "late.log")
    assert stage["status"] == "not run (time limit)" and not (tmp_path / "late.log").exists()


def test_the_child_runs_a_module_as_main_with_its_arguments(tmp_path):
    (tmp_path / "echo_args.py").write_text("import sys\nif __name__ == '__main__':\n    print(sys.argv[1:])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}
    for mode in AUTOTUNE_MODES:
        cmd = [sys.executable, "-m", "harts.bench.gpu_child", "--autotune", mode, "echo_args", "-q", "-x"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        assert proc.stdout.strip() == "['-q', '-x']"


def test_on_cuda_the_stages_run_through_the_child_with_the_chosen_tuning_and_families(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test device")
    seen = []

    def record(name, cmd, deadline, log, share=1.0):
        seen.append((name, cmd, log.name, share))
        return dict(name=name, status="passed", seconds=0.0, command=" ".join(cmd))

    monkeypatch.setattr("harts.bench.gpu_check._stage", record)
    assert main(["--out", str(tmp_path), "--autotune", "full", "--families", "qwen3_next"]) == 0
    assert [(n, log, share) for n, _, log, share in seen] == [
        ("verify", "verify.log", 0.3), ("tests", "tests.log", 0.3),
        ("tests-kernels", "tests-kernels.log", 0.35), ("bench-fla", "bench-fla.log", 0.5),
        ("bench-torch", "bench-torch.log", 1.0)]  # fmt: skip
    for _, cmd, _, _ in seen:
        assert cmd[1:7] == ["-X", "faulthandler", "-m", "harts.bench.gpu_child", "--autotune", "full"]
    verify = seen[0][1]  # first: every family checked against the stock forward under fla
    assert verify[7] == "harts.bench.verify_families" and verify[verify.index("--backend") + 1] == "fla"
    assert seen[1][1][7:12] == ["pytest", "-q", "-p", "no:cacheprovider", "-m"]
    assert "tests_kernels" in seen[2][1]
    assert "tests/test_gpu_backend.py" in seen[1][1]
    bench = seen[3][1]
    assert bench[7] == "harts.bench.run" and bench[bench.index("--families") + 1] == "qwen3_next"
    assert bench[bench.index("--backend") + 1] == "fla" and bench[bench.index("--device") + 1] == "cuda"
    results = json.loads((tmp_path / "gpu-check.json").read_text())
    assert results["autotune"] == "full" and results["bench"] == {"fla": [], "torch": []}
    assert "triton's autotuning" in (tmp_path / "gpu-check.md").read_text()


def test_the_verify_stage_checks_each_precision_and_its_table_names_them(tmp_path):
    """The stage's module on the CPU with plain PyTorch: a row per (family, precision), each passed."""
    from harts.bench.gpu_check import table
    from harts.bench.verify_families import main as verify_main

    out = tmp_path / "verify.json"
    args = ["--device", "cpu", "--backend", "torch", "--families", "qwen3", "--out", str(out)]
    assert verify_main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["family"], r["precision"], r["status"]) for r in rows] == [
        ("qwen3", p, "passed") for p in ("fp32", "bf16-autocast", "bf16-params")]  # fmt: skip
    assert all(r["logprob_error"] <= r["logprob_bound"] and r["gradient_ratio"] <= 1 for r in rows)
    results = dict(device="a test device", torch=torch.__version__, autotune="first", stages=[], bench={},
                   verify=rows)  # fmt: skip
    text = table(results)
    assert "| qwen3 | bf16-params | passed |" in text and "against the stock forward" in text
