"""Tree against flat online RL: the same runs, seed by seed, trained in both layouts.

    python examples/rl_compare.py                      # examples/rl.toml, seeds 0 1 2, into docs/rl/
    python examples/rl_compare.py --seeds 0 --steps 20 --out /tmp/rl   # a quick look

For every seed, ``harts rl`` runs twice from the same config: ``layout = "tree"`` (every shared
prefix token computed once) and ``layout = "flat"`` (each trajectory alone, the per-trajectory
baseline). Both start from the same weights and sample with the same random streams, so their
curves differ only through floating-point rounding in the updates; the seeds show how far
curves lie apart by chance. The two layouts of a seed run back to back, their order alternating
from seed to seed, so a slow spell of a shared machine does not always fall on the same one.

Writes into ``--out``: ``rl_compare.png`` (reward against the step and against wall-clock
seconds, every run on one figure) and ``rl_compare.json`` (the curves, the summary, the
parameter difference between the layouts' final models, the command and the config). The runs
themselves (metrics, checkpoints, logs) go to ``--runs``. Needs matplotlib for the figure
(``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tomllib
from pathlib import Path

import torch
from safetensors.torch import load_file

from harts.rl import load_rl_config, run_rl
from harts.rl.config import parse_rl_config
from harts.rl.report import compare_summary, plot_compare
from harts.trainer.progress import read_metrics

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("reward", "wall_seconds", "train_seconds", "sample_seconds", "computed_tokens", "tokens")


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    return load_file(newest / "model.safetensors")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "rl.toml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="steps per run (default: the config's)")
    parser.add_argument("--window", type=int, default=10, help="moving-average window of the curves")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "rl")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "rl_compare")
    parser.add_argument("--replot", action="store_true", help="no runs: redraw the figure and recompute the "
                        "summary from the curves of --out/rl_compare.json")  # fmt: skip
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.out, args.window)

    base = load_rl_config(args.config)
    curves: dict[str, dict[int, dict]] = {"tree": {}, "flat": {}}
    param_gap = {}
    for i, seed in enumerate(args.seeds):
        order = ("tree", "flat") if i % 2 == 0 else ("flat", "tree")
        for layout in order:
            config = base.with_overrides(layout=layout, steps=args.steps, seed=seed)
            run = args.runs / f"seed{seed}-{layout}"
            if run.exists():
                raise SystemExit(f"{run} exists: remove it or choose another --runs")
            run.mkdir(parents=True)
            began = time.perf_counter()
            with (run / "log.txt").open("w") as log:
                run_rl(config, run, log=log)
            records = read_metrics(run / "metrics.jsonl")
            curves[layout][seed] = {k: [r[k] for r in records] for k in KEYS}
            seconds = time.perf_counter() - began
            print(f"seed {seed} {layout}: {len(records)} steps in {seconds:.0f} s, reward "
                  f"{records[0]['reward']:.3f} -> {records[-1]['reward']:.3f}", flush=True)  # fmt: skip
        tree, flat = (final_weights(args.runs / f"seed{seed}-{layout}") for layout in ("tree", "flat"))
        param_gap[seed] = max(float((tree[k] - flat[k]).abs().max()) for k in tree)

    steps = len(next(iter(curves["tree"].values()))["reward"])
    config = base.with_overrides(steps=steps)
    command = "python examples/rl_compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {
        "command": command.strip(),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": config.threads or torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "config": config.text,
        "steps": steps,
        "summary": {"final_param_max_abs_diff": param_gap},
        "curves": {layout: {str(s): c for s, c in runs.items()} for layout, runs in curves.items()},
    }
    return write(record, args.out, args.window)


def write(record: dict, out: Path, window: int) -> dict:
    """The summary of ``record``'s curves, the figure and the JSON, into ``out``."""
    curves = {layout: {int(s): c for s, c in runs.items()} for layout, runs in record["curves"].items()}
    summary = compare_summary(curves, window)
    summary["final_param_max_abs_diff"] = record["summary"]["final_param_max_abs_diff"]
    record["summary"] = summary
    out.mkdir(parents=True, exist_ok=True)
    config = parse_rl_config(tomllib.loads(record["config"]), ROOT / "examples")
    title = (f"harts rl, {config.task.name} ({config.task.turns} turns), tiny {config.model.tiny}: "
             f"{config.sampling.prompts_per_step} episodes x {config.sampling.leaves()} branches per step, "
             f"seeds {', '.join(map(str, summary['seeds']))}")  # fmt: skip
    print(plot_compare(curves, window, out / "rl_compare.png", title))
    (out / "rl_compare.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=1))
    return record


def replot(out: Path, window: int) -> dict:
    return write(json.loads((out / "rl_compare.json").read_text(encoding="utf-8")), out, window)


if __name__ == "__main__":
    main()
