"""What ``harts rl`` reports: its progress line, the metrics its plot draws, and tree against flat
over several seeds.

``progress_line`` is the line of one step; ``PLOTTED`` the curves of a run's plot (reward, loss,
entropy, time per step; :func:`harts.trainer.progress.write_plot` draws them);
``compare_summary`` and ``plot_compare`` turn the curves of tree and flat runs of the same seeds
into the numbers and the figure of ``docs/rl/``: the largest gap between the two layouts'
reward curves of one seed, set beside the spread between seeds (the noise a curve has anyway),
and the wall-clock time of each layout.

Plots need matplotlib (the ``bench`` extra); without it a line says so and nothing is drawn.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["progress_line", "PLOTTED", "compare_summary", "plot_compare"]

PLOTTED = ("reward", "loss", "entropy", "grad_norm", "redundancy", "seconds")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def progress_line(record: dict, total: int, eta: float) -> str:
    """``step 4/150 | reward 0.312 | loss -0.0123 | gnorm 0.51 | tree: 523 tokens for 8,400 flat ...``."""
    return " | ".join(
        [
            f"step {record['step']}/{total}",
            f"reward {record['reward']:.3f}",
            f"loss {record['loss']:.4f}",
            f"gnorm {record['grad_norm']:.3g}",
            f"{record['layout']}: {record['computed_tokens']:,} tokens for {record['tokens']:,} flat, "
            f"{record['loss_tokens']:,} loss (shared {record['redundancy']:.1f}x)",
            *([f"{record['model_flops_per_s'] / 1e12:.3g} TFLOP/s"] if "model_flops_per_s" in record else []),
            f"sample {record['sample_seconds']:.2f} s train {record['train_seconds']:.2f} s",
            f"eta {_duration(eta)}",
        ]
    )


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _same_prefix(a: list[float], b: list[float]) -> int:
    """How many leading entries of ``a`` and ``b`` are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare_summary(curves: dict[str, dict[int, dict]], window: int) -> dict:
    """Numbers of a comparison: ``curves[layout][seed]`` holds ``reward`` and ``wall_seconds`` per step.

    - ``identical_steps``: per seed, the steps before the first whose mean rewards differ between
      the layouts (the rollouts are the same until rounding flips one sampled token; from there
      the runs part like runs of two seeds);
    - ``max_gap``: the largest |tree - flat| of the ``window``-step moving averages of one seed's
      reward curves, over seeds and steps (the raw per-step gap too); ``mean_gap``: the same
      between the two layouts' curves averaged over the seeds;
    - ``seed_spread``: the largest difference between two seeds' moving averages of one layout,
      at one step: how far curves lie apart by chance;
    - per layout: mean final reward (last ``window`` steps), mean wall-clock seconds of a run.
    """
    layouts = sorted(curves)
    seeds = sorted(set.intersection(*(set(curves[layout]) for layout in layouts)))
    summary: dict = {"seeds": seeds, "window": window, "layouts": {}}
    for layout in layouts:
        runs = [curves[layout][s] for s in seeds]
        summary["layouts"][layout] = {
            "final_reward": _mean([_mean(r["reward"][-window:]) for r in runs]),
            "first_reward": _mean([r["reward"][0] for r in runs]),
            "wall_seconds": _mean([r["wall_seconds"][-1] for r in runs]),
            "train_seconds": _mean([sum(r["train_seconds"]) for r in runs]),
            "sample_seconds": _mean([sum(r["sample_seconds"]) for r in runs]),
        }
    if {"tree", "flat"} <= set(layouts):
        gap = raw = 0.0
        for s in seeds:
            tree, flat = curves["tree"][s]["reward"], curves["flat"][s]["reward"]
            raw = max(raw, max(abs(a - b) for a, b in zip(tree, flat, strict=False)))
            st, sf = smooth(tree, window), smooth(flat, window)
            gap = max(gap, max(abs(a - b) for a, b in zip(st, sf, strict=False)))
        summary["max_gap"], summary["max_gap_raw"] = gap, raw
        tree, flat = curves["tree"], curves["flat"]
        summary["identical_steps"] = {s: _same_prefix(tree[s]["reward"], flat[s]["reward"]) for s in seeds}
        means = {}
        for layout in ("tree", "flat"):
            smoothed = [smooth(curves[layout][s]["reward"], window) for s in seeds]
            means[layout] = [_mean(v) for v in zip(*smoothed, strict=False)]
        summary["mean_gap"] = max(abs(a - b) for a, b in zip(means["tree"], means["flat"], strict=False))
        t, f = summary["layouts"]["tree"], summary["layouts"]["flat"]
        summary["wall_clock_saving"] = 1.0 - t["wall_seconds"] / f["wall_seconds"]
        summary["train_speedup"] = f["train_seconds"] / t["train_seconds"]
    spread = 0.0
    for layout in layouts:
        smoothed = [smooth(curves[layout][s]["reward"], window) for s in seeds]
        for i in range(len(smoothed)):
            for j in range(i + 1, len(smoothed)):
                spread = max(spread, max(abs(a - b) for a, b in zip(smoothed[i], smoothed[j], strict=False)))
    summary["seed_spread"] = spread
    return summary


def plot_compare(curves: dict[str, dict[int, dict]], window: int, out: Path, title: str) -> str:
    """Reward against the step and against wall-clock seconds, every run of both layouts on one figure."""
    plt = _pyplot()
    if plt is None:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    colors = {"tree": "tab:green", "flat": "tab:blue"}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for layout in sorted(curves, reverse=True):
        for i, seed in enumerate(sorted(curves[layout])):
            run = curves[layout][seed]
            reward = smooth(run["reward"], window)
            label = f"{layout}, seed {seed}"
            style = dict(color=colors.get(layout), linestyle=styles[i % len(styles)], linewidth=1.3)
            axes[0].plot(range(1, len(reward) + 1), reward, label=label, **style)
            axes[1].plot(run["wall_seconds"], reward, label=label, **style)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall-clock seconds (sampling + training)")
    for ax in axes:
        ax.set_ylabel(f"reward ({window}-step moving average)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0.0, top=max(0.05, math.ceil(ax.get_ylim()[1] * 10) / 10))
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return f"plot: {out}"
