"""What ``RunConfig(verify=True)`` costs: the check as a share of the step it checks.

    python -m harts.bench.verify_cost [--families F ...] [--shapes S ...] [--repeats N] [--budget B]

For each (family, shape) of the benchmark (:mod:`harts.bench.cases`: the "small" models, the
synthetic shapes at the benchmark's length scale), the step (:func:`harts.forest_step`, the SFT
sum, under the budget) runs unverified and verified, alternated ``repeats`` times after a warm-up
of each; the figure is the verified step's extra time over the unverified one's (medians), as a
share of the unverified step. A step that is not verified costs nothing extra: ``verify`` is off
by default and the trainer turns it on for the updates ``[run] verify`` names (the first of a
run by default). The check's parts are in :mod:`harts.runtime.verify`: the sample's stock
forwards and backwards at the step's precision and one precision up (a copy of the model), and
harts on the sample's forest. Results go to stdout as a table and to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from harts.bench.cases import DEFAULT_FAMILIES, SFT, SUM, BenchConfig, build_case
from harts.runtime.config import RunConfig
from harts.runtime.verify import sample_spans
from harts.runtime.verify_sample import within_prefix
from harts.steps import forest_step

__all__ = ["measure", "main"]


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(family: str, shape: str, cfg: BenchConfig, budget: int | None, repeats: int) -> dict:
    """Seconds of the unverified and the verified step (medians) and the check's share."""
    case = build_case(cfg, family, shape)
    model, forest, rows = case.model, case.tree, case.tree_rows
    plain, checked = RunConfig(budget_tokens=budget), RunConfig(budget_tokens=budget, verify=True)

    def step(run: RunConfig) -> None:
        forest_step(model, forest, rows, SFT, normalizers=SUM, run=run)
        model.zero_grad(set_to_none=True)

    step(plain), step(checked)  # warm-up of each
    times: dict[str, list[float]] = {"plain": [], "verified": []}
    for r in range(repeats):
        order = (
            (("plain", plain), ("verified", checked))
            if r % 2 == 0
            else (("verified", checked), ("plain", plain))
        )
        for name, run in order:
            times[name].append(_timed(lambda run=run: step(run)))
    base, verified = statistics.median(times["plain"]), statistics.median(times["verified"])
    spans = sample_spans(forest)  # (trajectory, tokens kept), then brought within the prefix limit
    sample, _, _ = within_prefix([forest.trajectory(i)[:keep] for i, keep in spans], None)
    return {
        "family": family,
        "shape": shape,
        "budget": budget,
        "unique_tokens": forest.num_tokens,
        "flat_tokens": forest.num_flat_tokens,
        "trajectories": forest.num_trajectories,
        "sample_trajectories": len(sample),
        "sample_tokens": sum(t.numel() for t in sample),
        "step_s": base,
        "verified_step_s": verified,
        "share": (verified - base) / base,
        "times": times,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        prog="python -m harts.bench.verify_cost", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES))
    parser.add_argument("--shapes", nargs="+", default=["star", "agentic", "paper_like", "deep"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--scale", type=float, default=BenchConfig.scale)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dataclasses.replace(BenchConfig(scale=args.scale)).resolved()
    results = []
    head = ("family", "shape", "unique", "flat", "sample", "step s", "verified s", "share")
    print(f"{head[0]:<16}{head[1]:<12}" + "".join(f"{h:>10}" for h in head[2:]))
    for family in args.families:
        for shape in args.shapes:
            res = measure(family, shape, cfg, args.budget, args.repeats)
            results.append(res)
            counts = "".join(f"{res[k]:>10}" for k in ("unique_tokens", "flat_tokens", "sample_tokens"))
            times = f"{res['step_s']:>10.3f}{res['verified_step_s']:>10.3f}{res['share']:>10.1%}"
            print(f"{family:<16}{shape:<12}{counts}{times}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
