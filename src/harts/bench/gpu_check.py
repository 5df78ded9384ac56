"""``make gpu-check``: what harts checks on one CUDA GPU, in one command, within a time limit.

Stages, each a child process given a share of the time left (the whole check stops at
``--time-limit`` seconds, 480 by default; a stage that runs long leaves time for the benches):

0. ``verify``: every family's step checked against the stock forward on the GPU with the ``fla``
   backend, in fp32, bf16 autocast and bf16 parameters (:mod:`harts.bench.verify_families`,
   ``RunConfig(verify=True)``'s check), first, so the first minute says whether the GPU path is
   exact; a row per (family, precision) in the table;
1. ``tests``: every test that needs a CUDA device: the ``gpu``-marked tests of ``tests/`` (the
   ``fla`` backend's model-level forward and backward against the stock fp64 reference, and the
   fp32 / bf16 precision comparison with stock) and ``tests_kernels/`` on the device (fla's delta
   rule against the fp64 references with per-segment initial states and inner states, FlexAttention
   tree attention against the dense mask, a tiny model's tree forward under ``fla``);
2. ``bench-fla`` and ``bench-torch``: ``harts bench --device cuda`` on the small configs of
   ``--families`` (bailing_hybrid and qwen3_next, the two delta-rule kernels, where the installed
   transformers has them), shapes ``agentic`` and ``paper_like``, once with the ``fla`` backend and
   once with plain PyTorch; each reports the tree step against the flat layout at its best budget.

Every stage runs through :mod:`harts.bench.gpu_child`, which sets triton's tuning (``--autotune``:
each kernel's first configuration by default, since a fresh machine's full autotuning outlasts the
limit) and runs under ``-X faulthandler``; its output streams into ``<stage>.log`` in ``--out``.

It writes ``gpu-check.json`` (every stage's status, seconds and output tail, and both benches'
rows) and ``gpu-check.md`` (one table) into ``--out``. Without a CUDA device it says so, runs the
CPU side of the backend seam (selection and refusal tests) and exits 0. The exit status is 1 when
a stage that ran failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from harts.bench.gpu_child import AUTOTUNE_MODES
from harts.tiny import FAMILIES

__all__ = ["gpu_test_files", "main", "table"]

BENCH_ARGS = [
    "--shapes",
    "agentic",
    "paper_like",
    "--model-size",
    "small",
    "--repeats",
    "3",
    "--no-memory",
    "--no-peers",
    "--scale",
    "0.05",
]
# the families whose linear layers the fla kernels run (Kimi Delta Attention, Gated DeltaNet), those the
# installed transformers has
BENCH_FAMILIES = tuple(f for f in ("bailing_hybrid", "qwen3_next") if f in FAMILIES)
CHILD_ENV = {"PYTHONUNBUFFERED": "1"}
MIN_STAGE_SECONDS = 20.0  # a stage given less is reported "not run (time limit)"
CPU_TESTS = ["tests/test_backend_selection.py", "tests/test_gpu_backend.py"]


def _stage(name: str, cmd: list[str], deadline: float, log: Path, share: float = 1.0) -> dict:
    """Run one stage as a child process, given ``share`` of the time left (the later stages keep the rest).

    Its output streams into ``log``. A child still running at its limit gets SIGABRT first: children
    run under ``-X faulthandler``, so the log ends with every thread's Python stack, where it stood."""
    left = (deadline - time.monotonic()) * share
    if left < MIN_STAGE_SECONDS:
        return dict(name=name, status="not run (time limit)", seconds=0.0, command=" ".join(cmd))
    start = time.monotonic()
    print(f"[gpu-check] {name}: {' '.join(cmd)}", flush=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **CHILD_ENV})
        try:
            code = proc.wait(timeout=left)
            status = "passed" if code == 0 else f"failed (status {code})"
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = "stopped (time limit)"
    seconds = time.monotonic() - start
    print(f"[gpu-check] {name}: {status} in {seconds:.0f} s (log: {log})", flush=True)
    output = log.read_text(errors="replace")
    return dict(name=name, status=status, seconds=seconds, command=" ".join(cmd), output_tail=output[-4000:])


def gpu_test_files(root: Path = Path("tests")) -> list[str]:
    """The test files that mark a test ``gpu``: only those are collected, so a CUDA image without the
    ``dev`` extra's CPU-side packages (TRL, say) still runs every CUDA test."""
    return sorted(str(f) for f in root.glob("test_*.py") if _GPU_MARK.search(f.read_text()))


_GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)", re.MULTILINE)


def _bench_rows(out: Path) -> list[dict]:
    path = out / "results.json"
    return json.loads(path.read_text())["rows"] if path.exists() else []


def table(results: dict) -> str:
    """The check as markdown: the stages, then tree against flat per backend, family and shape."""
    tuning = {
        "first": "; each triton kernel at its first configuration, not autotuned",
        "full": "; triton's autotuning",
    }[results["autotune"]]
    if results["device"] == "no CUDA device":  # no triton kernel runs
        tuning = ""
    lines = [
        f"GPU check on {results['device']} (torch {results['torch']}{tuning})",
        "",
        "| stage | status | seconds |",
        "|---|---|---:|",
    ]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.0f} |" for s in results["stages"]]
    if results.get("verify"):
        from harts.bench.verify_families import table as verify_table

        lines += [
            "",
            "Each family's step against the stock forward (RunConfig(verify=True)'s check):",
            "",
            verify_table(results["verify"]).rstrip("\n"),
        ]
    rows = [(backend, r) for backend, rs in results["bench"].items() for r in rs]
    if rows:
        head = "| backend | family | shape | R | FLOP-ideal | tree / best flat | share of ideal | flat best |"
        lines += ["", head, "|---|---|---|---:|---:|---:|---:|---|"]
        lines += [
            f"| {b} | {r['family']} | {r['shape']} | {r['redundancy']:.2f} | {r['ideal_speedup']:.2f} | "
            f"{r['achieved_speedup']:.2f} | {r['fraction_of_ideal']:.0%} | {r['flat_best']} |"
            for b, r in rows
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harts.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-check", help="folder for gpu-check.json, gpu-check.md and the logs")
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds for the whole check")
    p.add_argument(
        "--autotune",
        choices=AUTOTUNE_MODES,
        default="first",
        help="triton's kernel tuning: each kernel's first configuration (the default: a fresh "
        "machine's full autotuning outlasts the time limit) or full (harts.bench.gpu_child)",
    )
    p.add_argument(
        "--families",
        nargs="+",
        default=list(BENCH_FAMILIES),
        choices=FAMILIES,
        help="the benches' model families",
    )
    a = p.parse_args(argv)
    deadline = time.monotonic() + a.time_limit
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    child = [sys.executable, "-X", "faulthandler", "-m", "harts.bench.gpu_child", "--autotune", a.autotune]
    pytest = [*child, "pytest", "-q", "-p", "no:cacheprovider"]
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "no CUDA device"
    results = dict(device=device, torch=torch.__version__, autotune=a.autotune, stages=[], bench={})

    def stage(name: str, cmd: list[str], share: float = 1.0) -> None:
        results["stages"].append(_stage(name, cmd, deadline, out / f"{name}.log", share))

    if not cuda:
        print("[gpu-check] no CUDA device here: GPU stages skipped; running the backend seam's CPU tests")
        stage("cpu-tests", [*pytest, *CPU_TESTS])
    else:
        # shares of the time left: a slow stage leaves time for the benches
        verify_json = out / "verify.json"
        stage(
            "verify",
            [
                *child,
                "harts.bench.verify_families",
                "--device",
                "cuda",
                "--backend",
                "fla",
                "--out",
                str(verify_json),
            ],
            0.3,
        )
        results["verify"] = json.loads(verify_json.read_text()) if verify_json.exists() else []
        stage("tests", [*pytest, "-m", "gpu", *gpu_test_files()], 0.3)
        stage("tests-kernels", [*pytest, "tests_kernels"], 0.35)
        for backend, share in (("fla", 0.5), ("torch", 1.0)):
            bench_out = out / f"bench-{backend}"
            bench = ["harts.bench.run", "--device", "cuda", "--backend", backend, "--out", str(bench_out)]
            stage(f"bench-{backend}", [*child, *bench, "--families", *a.families, *BENCH_ARGS], share)
            results["bench"][backend] = _bench_rows(bench_out)
    (out / "gpu-check.json").write_text(json.dumps(results, indent=1))
    (out / "gpu-check.md").write_text(table(results))
    print(table(results))
    print(f"[gpu-check] wrote {out / 'gpu-check.json'} and {out / 'gpu-check.md'}")
    failed = [s["name"] for s in results["stages"] if s["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
