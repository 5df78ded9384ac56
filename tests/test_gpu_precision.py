"""Per family on a CUDA device: harts against the stock forward at three precisions, each measured
against the fp64 stock forward of the same weights (one small tree, tests/precision.py):

- ``fp32``: fp32 parameters, no autocast, TF32 off: harts within the CPU equivalence bounds
  (logits 1e-4 absolute, each parameter's gradient 1e-4 relative, or twice stock fp32's own error
  where stock misses that; tests/reference.py);
- ``bf16-autocast``: fp32 parameters under ``torch.autocast("cuda", torch.bfloat16)``, as
  mixed-precision trainers run;
- ``bf16-params``: every parameter in bf16 (the fp32 weights rounded; the truth is the fp64
  forward of the rounded weights), no autocast.

In both bf16 modes harts must be no worse than stock: log-prob error <= 2 x stock's + 2 ulp, logit
angle and whole-gradient relative error <= 2 x stock's + 4u, u = 2^-8 (tests/test_autocast.py
derives them). harts runs its default (``torch``) backend; the ``fla`` kernels have their own
check (tests/test_gpu_backend.py).

Marked ``gpu`` and skipped without CUDA. Its CPU counterparts: tests/test_autocast.py (the same
runs and bounds under CPU autocast), and here the bf16-parameter mode of every family and
:func:`test_report_on_cpu` (the fp32 mode and the report), so that the code a GPU run takes is
exercised on every machine. With
``HARTS_GPU_REPORT=path`` each test merges its family's figures (per mode, stock and harts: worst
log-prob error, lowest logit cosine, gradient relative error, and the bounds' misses) into that
JSON file; ``python -m harts.bench.gpu_precision_table path`` prints them as a table.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from harts.tiny import FAMILIES
from tests.helpers import one_thread  # noqa: F401  (module-scoped fixture)
from tests.precision import errors, model_of, no_worse_failures, stock, summary, tree, truth
from tests.reference import LOGIT_ATOL, gradient_failures

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODES = ("fp32", "bf16-autocast", "bf16-params")


def measure(family: str, mode: str, device: str) -> tuple[dict, list[str]]:
    """(figures, failures) of one family and mode on ``device`` (module docstring)."""
    params = torch.bfloat16 if mode == "bf16-params" else torch.float32
    autocast = torch.bfloat16 if mode == "bf16-autocast" else None
    model = copy.deepcopy(model_of(family, params)).to(device)
    exact = truth(family, params)
    ran_stock, ran_tree = stock(model, autocast), tree(model, autocast)
    theirs, mine = errors(ran_stock, exact), errors(ran_tree, exact)
    if mode == "fp32":
        worst = max((a - b).abs().max().item() for a, b in zip(ran_tree[0], exact[0], strict=True))
        failures = [f"max |logit diff| {worst:.3g} > {LOGIT_ATOL}"] if worst > LOGIT_ATOL else []
        grads = gradient_failures(ran_tree[2], exact[2], ran_stock[2])
        failures += [f"gradient of {name}: {why}" for name, why in grads.items()]
    else:
        failures = no_worse_failures(theirs, mine, exact, torch.bfloat16)
    return {"stock": summary(theirs), "harts": summary(mine), "failures": failures}, failures


def report(path: str | os.PathLike | None, device: str, family: str, mode: str, figures: dict) -> None:
    """Merge one family's figures for one mode into the JSON report at ``path`` (nothing without)."""
    if not path:
        return
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    if device.startswith("cuda"):
        data.setdefault("device", torch.cuda.get_device_name())
    data.setdefault("families", {}).setdefault(family, {})[mode] = figures
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.fixture
def no_tf32():
    """fp32 matmuls and convolutions in IEEE fp32 (TF32 rounds to ~1e-3, past the fp32 bounds)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_precision_no_worse_than_stock(family, mode, no_tf32):
    figures, failures = measure(family, mode, "cuda")
    report(os.environ.get("HARTS_GPU_REPORT"), "cuda", family, mode, figures)
    assert not failures, f"{family}, {mode}: " + "; ".join(failures)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_parameters_no_worse_than_stock_on_cpu(family):
    """The bf16-parameter mode on the CPU (test_autocast covers CPU autocast)."""
    _, failures = measure(family, "bf16-params", "cpu")
    assert not failures, f"{family}: " + "; ".join(failures)


def test_report_on_cpu(tmp_path):
    """The GPU test's measurement and report on the CPU, one family: fp32 within the equivalence
    bounds, and the figures of both modes in the JSON file."""
    path = tmp_path / "report.json"
    family = FAMILIES[0]
    for mode in ("fp32", "bf16-params"):
        figures, failures = measure(family, mode, "cpu")
        assert not failures, f"{family}, {mode}: " + "; ".join(failures)
        report(path, "cpu", family, mode, figures)
    data = json.loads(path.read_text())["families"][family]
    assert set(data) == {"fp32", "bf16-params"}
    assert data["fp32"]["harts"]["logprob_max_error"] < 1e-4  # fp32: the equivalence bound
    assert data["bf16-params"]["stock"]["logprob_max_error"] > 2.0**-16  # bf16's rounding, not fp32's
