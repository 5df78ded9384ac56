"""Every family's step checked against the stock forward on this device, in fp32, bf16 autocast and
bf16 parameters: the first stage of ``make gpu-check``, so the first minute on a GPU says whether
the GPU path (the ``fla`` backend's kernels) is exact there.

    python -m harts.bench.verify_families [--device cuda] [--backend fla] [--families F ...]
        [--precisions fp32 bf16-autocast bf16-params] [--out verify.json]

For each (family, precision): a tiny model of the family (harts.tiny) on the device, a batch of
five trees whose prompts branch (some cut under the budget), and
:func:`harts.steps.policy.verify_step` (the check ``RunConfig(verify=True)`` runs before a step,
:mod:`harts.runtime.verify`) under the backend and a budget that cuts trees. A row per pair:
passed or the VerificationError's message, the worst log-prob error and its bound, the gradients
as a fraction of their bounds, seconds. The exit status is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import numpy as np
import torch

import harts
from harts.runtime.config import RunConfig
from harts.runtime.verify import VerificationError
from harts.steps.policy import step_inputs, verify_step
from harts.tiny import FAMILIES, tiny_model

__all__ = ["PRECISIONS", "check", "main", "table"]

PRECISIONS = ("fp32", "bf16-autocast", "bf16-params")
LOSS = harts.PolicyLossConfig(kind="ppo")


def _rollouts(vocab_size: int, seed: int = 0) -> list[harts.Rollout]:
    """Five trees: prompts of 8-40 tokens with 1-4 continuations of 5-19 tokens each."""
    rng = np.random.default_rng(seed)
    out = []
    for group, (prompt_len, branches) in enumerate([(40, 4), (12, 1), (25, 3), (8, 2), (30, 1)]):
        prompt = rng.integers(1, vocab_size, prompt_len).tolist()
        for _ in range(branches):
            reply = rng.integers(1, vocab_size, int(rng.integers(5, 20))).tolist()
            tokens = prompt + reply
            mask = [0] * prompt_len + [1] * len(reply)
            out.append(
                harts.Rollout(
                    tokens,
                    loss_mask=mask,
                    rollout_logprobs=[-1.0] * len(tokens),
                    advantages=float(rng.normal()),
                    group_id=group,
                )
            )
    return out


def check(family: str, precision: str, device: str, backend: str, budget: int = 32) -> dict:
    """One (family, precision) pair's verification row."""
    model = tiny_model(family).to(device).train()
    if precision == "bf16-params":
        model = model.to(torch.bfloat16)
    cast = contextlib.nullcontext()
    if precision == "bf16-autocast":
        cast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    rollouts = _rollouts(model.config.get_text_config().vocab_size)
    forest, _ = step_inputs(model, rollouts)
    row = dict(family=family, precision=precision, device=device, backend=backend)
    began = time.perf_counter()
    try:
        with cast:
            report = verify_step(model, forest, LOSS, RunConfig(budget_tokens=budget, backend=backend))
    except VerificationError as exc:
        row.update(status="failed", message=str(exc))
    except Exception as exc:  # a crash on the device is a result too
        row.update(
            status="error", message=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
    else:
        row.update(
            status="passed",
            logprob_error=report.value_error,
            logprob_bound=report.value_bound,
            stock_logprob_error=report.stock_value_error,
            gradient_ratio=report.gradient_ratio,
        )
    row["seconds"] = time.perf_counter() - began
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| family | precision | status | worst log-prob (stock) | bound | gradients / bound | s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] == "passed":
            stock = r["stock_logprob_error"]  # None: not run, harts met an exact stock's bounds
            figures = (
                f"{r['logprob_error']:.2g} ({'not run' if stock is None else f'{stock:.2g}'}) | "
                f"{r['logprob_bound']:.2g} | {r['gradient_ratio']:.2g}"
            )
        else:
            figures = f"{r['message'][:90].replace('|', '/')} | | "
        lines.append(f"| {r['family']} | {r['precision']} | {r['status']} | {figures} | {r['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m harts.bench.verify_families", description=__doc__.splitlines()[0]
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backend", default="auto", help="the kernels checked (auto: fla on CUDA with the gpu extra)"
    )
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--out", default=None, help="JSON of the rows")
    a = p.parse_args(argv)
    rows = []
    for family in a.families:
        for precision in a.precisions:
            rows.append(check(family, precision, a.device, a.backend))
            r = rows[-1]
            print(
                f"[verify] {family} {precision}: {r['status']} ({r['seconds']:.1f} s)"
                + (f": {r['message']}" if r["status"] != "passed" else ""),
                flush=True,
            )
            if a.out:  # after every row: a check stopped at its time limit keeps what it measured
                with open(a.out, "w", encoding="utf-8") as f:
                    json.dump(rows, f, indent=1)
    print(table(rows))
    return 1 if any(r["status"] != "passed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
