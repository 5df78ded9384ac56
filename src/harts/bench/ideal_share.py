"""Share of the FLOP-ideal speedup a budgeted tree step reaches against the strongest flat step.

For each shape, one SFT step (:data:`harts.bench.cases.STEPS` ``forest_step``) of the small
``--family`` config runs on the tree at each budget B of ``--budgets`` and on the flat layout
(``share_prefixes=False``, whole trajectories per micro-batch) at B, 4B and without a budget (a
flat variant is named by the budget it ran at: raised to the longest trajectory where needed). The
variants are interleaved, ``--repeats`` times after a warm-up, and for each B the table reports
the tree's median against the fastest of the three flat medians (flat at its best budget), the
FLOP-ideal speedup (:func:`harts.runtime.flops.ideal_speedup`) and the share of it reached. Flat
budgets that give the same micro-batches run once.

The shapes (``harts.data.synthetic``, lengths in tokens):

- ``agentic-r5``: two tasks of six rollouts, three turns of about 150 tokens, branching at 40% of
  turn boundaries, under a 700-token system prompt (R about 5);
- ``agentic-r10``: one task of ten rollouts, three short turns (about 60 tokens), branching at 50%
  (R about 10);
- ``star``: a 300-token prompt and 24 completions of about 50 tokens (a GRPO group);
- ``deep``: a 60-token trunk, then a full ternary tree of depth 4 of 3-9-token segments.

    python -m harts.bench.ideal_share [--family bailing_hybrid] [--shapes ...] [--budgets 1024 4096]
        [--repeats 3] [--threads 2] [--processes 1] [--json PATH]

``--processes P`` (> 1) measures each shape in P fresh processes, one after the other, and reports
per row the median of the P shares (and of the times), with the lowest and highest share: a
process can run a step at a steady 20-45% slower than the next on a shared machine, and slows the
tree more than flat, so one process's share can read low by a quarter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import harts
from harts.bench.cases import STEPS, BenchConfig, effective_flat_budget, make_model
from harts.data import synthetic
from harts.runtime.flops import flop_model, ideal_speedup

__all__ = ["SHAPES", "measure", "main"]

SHAPES: dict[str, Callable[[int], list[list[int]]]] = {
    "agentic-r5": lambda vocab: synthetic.agentic(
        system_len=700,
        num_tasks=2,
        rollouts_per_task=6,
        turns=3,
        turn_len=150,
        branch_prob=0.4,
        vocab_size=vocab,
        seed=0,
    ),
    "agentic-r10": lambda vocab: synthetic.agentic(
        system_len=700,
        num_tasks=1,
        rollouts_per_task=10,
        turns=3,
        turn_len=60,
        branch_prob=0.5,
        vocab_size=vocab,
        seed=0,
    ),
    "star": lambda vocab: synthetic.star(
        prompt_len=300, num_completions=24, completion_len=50, vocab_size=vocab, seed=0
    ),
    "deep": lambda vocab: synthetic.deep(
        trunk_len=60, depth=4, branching=3, seg_len=6, vocab_size=vocab, seed=0
    ),
}


def _timed(fns: dict[str, Callable[[], object]], model: torch.nn.Module, repeats: int) -> dict[str, float]:
    """Median seconds of each step, the steps interleaved after one warm-up each."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(repeats + 1):
        for name, fn in fns.items():
            model.zero_grad(set_to_none=True)
            began = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - began)
    model.zero_grad(set_to_none=True)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(
    family: str, shape: str, budgets: tuple[int, ...], repeats: int, model_size: str = "small"
) -> list[dict]:
    """One row per budget: the tree's and the best flat step's medians, the ideal and the share."""
    model = make_model(family, BenchConfig(families=(family,), model_size=model_size))
    step = STEPS["forest_step"]
    trajectories = SHAPES[shape](model.config.get_text_config().vocab_size)
    tree, flat = harts.build_forest(trajectories), harts.build_forest(trajectories, share_prefixes=False)
    rollouts = [harts.Rollout(t) for t in trajectories]
    tree_rows, flat_rows = harts.build_loss_rows(tree, rollouts), harts.build_loss_rows(flat, rollouts)

    fns: dict[str, Callable[[], object]] = {}
    for b in budgets:
        run = harts.RunConfig(budget_tokens=b)
        fns[f"tree {b}"] = lambda run=run: step(model, tree, tree_rows, run)
    # the flat micro-batches each budget gives (effective budget), and the variant that runs them
    effective = {fb: effective_flat_budget(fb, flat) for b in budgets for fb in (b, 4 * b, None)}
    flat_of: dict[int | None, str] = {}
    for eb in sorted(set(effective.values()), key=lambda x: (x is None, x)):
        flat_of[eb] = name = f"flat {eb or 'whole'}"
        run = harts.RunConfig(budget_tokens=eb)
        fns[name] = lambda run=run: step(model, flat, flat_rows, run)
    medians = _timed(fns, model, repeats)
    ideal = ideal_speedup(flop_model(model), tree, flat)
    rows = []
    for b in budgets:
        best = min((flat_of[effective[x]] for x in (b, 4 * b, None)), key=medians.__getitem__)
        speedup = medians[best] / medians[f"tree {b}"]
        rows.append(
            dict(
                family=family,
                shape=shape,
                redundancy=flat.num_tokens / tree.num_tokens,
                unique_tokens=tree.num_tokens,
                budget=b,
                tree_ms=1e3 * medians[f"tree {b}"],
                flat_best=best,
                flat_best_ms=1e3 * medians[best],
                speedup=speedup,
                ideal=ideal,
                share=speedup / ideal,
            )
        )
    return rows


def table(rows: list[dict]) -> str:
    spread = any("share_low" in r for r in rows)
    lines = [
        "| shape | R | budget | tree ms | flat best ms (variant) | tree vs flat | ideal | share |"
        + (" share range |" if spread else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if spread else ""),
    ]
    for r in rows:
        span = f" {100 * r['share_low']:.0f}-{100 * r['share_high']:.0f}% |" if spread else ""
        lines.append(
            f"| {r['shape']} | {r['redundancy']:.2f} | {r['budget']} | {r['tree_ms']:.0f} | "
            f"{r['flat_best_ms']:.0f} ({r['flat_best']}) | {r['speedup']:.2f} | {r['ideal']:.2f} | "
            f"{100 * r['share']:.0f}% |{span}"
        )
    return "\n".join(lines)


def across_processes(runs: list[list[dict]]) -> list[dict]:
    """One row per budget from the rows of several processes (each a list in budget order): the
    median share, tree and flat times and speedup, the lowest and highest share, and the flat
    variant most processes found fastest."""
    rows = []
    for same in zip(*runs, strict=True):
        row = dict(same[0])
        for key in ("tree_ms", "flat_best_ms", "speedup", "share"):
            row[key] = statistics.median(r[key] for r in same)
        variants = [r["flat_best"] for r in same]
        row["flat_best"] = max(set(variants), key=variants.count)
        row["share_low"], row["share_high"] = min(r["share"] for r in same), max(r["share"] for r in same)
        row["processes"] = len(same)
        rows.append(row)
    return rows


def _in_processes(shape: str, a: argparse.Namespace) -> list[dict]:
    """``shape`` measured in ``a.processes`` fresh processes, one after the other."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.processes):
            out = f"{tmp}/{i}.json"
            cmd = [
                sys.executable,
                "-m",
                "harts.bench.ideal_share",
                "--family",
                a.family,
                "--shapes",
                shape,
                "--budgets",
                *map(str, a.budgets),
                "--repeats",
                str(a.repeats),
                "--threads",
                str(a.threads),
                "--json",
                out,
            ]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                runs.append(json.load(f))
    return across_processes(runs)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m harts.bench.ideal_share", description=__doc__.splitlines()[0])
    p.add_argument("--family", default="bailing_hybrid")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--budgets", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--processes", type=int, default=1, help="fresh processes per shape (median share)")
    p.add_argument("--json", default=None, help="write every row here")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.processes < 1 or any(b < 1 for b in a.budgets):
        p.error("--repeats, --processes and every budget must be positive")
    torch.set_num_threads(a.threads)
    rows = []
    for shape in a.shapes:
        if a.processes > 1:
            rows += _in_processes(shape, a)
        else:
            rows += measure(a.family, shape, tuple(a.budgets), a.repeats)
        print(table(rows[-len(a.budgets) :]).split("\n", 2)[-1], flush=True)
    across = f", median over {a.processes} processes" if a.processes > 1 else ""
    print(f"\n{a.family}, {a.threads} thread(s), median of {a.repeats}{across}\n{table(rows)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
