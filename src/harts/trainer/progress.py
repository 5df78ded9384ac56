"""What a run reports: a progress line on stderr, ``metrics.jsonl``, a plot (other backends:
:mod:`harts.trainer.logging_backends`).

The progress line is self-made (no dependency) and says what the forest saves as it happens:
unique tokens per second (what the model computed), flat tokens per second (what per-trajectory
training would have computed for the same result) and their ratio, the step's sharing.
``metrics.jsonl`` holds one JSON object per optimizer step, appended and flushed as each step
ends; on resume the lines past the checkpoint's step (steps a killed run did after its last
checkpoint, which the resumed run does again) are dropped first, so the file always reads as one
run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["MetricsLog", "progress_line", "write_plot", "read_metrics", "PLOTTED"]


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (a torn last line, from a kill mid-write, is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsLog:
    """``metrics.jsonl``, starting after step ``start`` (0: a fresh file)."""

    def __init__(self, path: Path, start: int):
        kept = [r for r in read_metrics(path) if r.get("step", math.inf) <= start] if start else []
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, path)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        if seconds >= 3600
        else (f"{seconds // 60}:{seconds % 60:02d}")
    )


def progress_line(record: dict, total: int, eta_seconds: float) -> str:
    """``step 4/12 | loss 4.4987 | lr 3.3e-04 | gnorm 2.31 | 3,025 unique tok/s (20,700 flat, 9,800 loss)
    | shared 6.84x | 0.021 TFLOP/s (MFU 31.2% on a known CUDA device) | ...``
    (with a critic, its value loss and explained variance after ``gnorm``; with rewards their mean,
    ``reward 0.53``, and the mean response length, ``resp 143 tok``, after those; with both the
    engine's and the trainer's old log-probs, the engine-trainer gap, ``mismatch kl 1.2e-03``)."""
    parts = [
        f"step {record['step']}/{total}",
        f"epoch {record['epoch']}",
        *([f"ppo {record['ppo_epoch']}.{record['mini_batch']}"] if "mini_batch" in record else []),
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"gnorm {record['grad_norm']:.3g}",
        *(
            [f"vloss {record['value_loss']:.4f}", f"ev {record['explained_variance']:.3f}"]
            if "value_loss" in record
            else []
        ),
        *([f"reward {record['reward_mean']:.3g}"] if "reward_mean" in record else []),
        *([f"resp {record['response_tokens_mean']:,.0f} tok"] if "response_tokens_mean" in record else []),
        *([f"mismatch kl {record['mismatch_kl']:.2e}"] if "mismatch_kl" in record else []),
        f"{record['unique_tokens_per_s']:,.0f} unique tok/s ({record['flat_tokens_per_s']:,.0f} flat"
        + (f", {record['loss_tokens_per_s']:,.0f} loss)" if "loss_tokens_per_s" in record else ")"),
        f"shared {record['redundancy']:.2f}x",
        *([_flops(record)] if "model_flops_per_s" in record else []),
        f"{record['seconds']:.2f} s/step",
        f"eta {_duration(eta_seconds)}",
    ]
    return " | ".join(parts)


def _flops(record: dict) -> str:
    text = f"{record['model_flops_per_s'] / 1e12:.3g} TFLOP/s"
    return text + (f" (MFU {record['mfu']:.1%})" if "mfu" in record else "")


PLOTTED = (
    "loss",
    "policy_loss",
    "grad_norm",
    "lr",
    "entropy",
    "clip_fraction",
    "kl",
    "value_loss",
    "explained_variance",
    "reward_mean",
    "response_tokens_mean",
    "mismatch_kl",
    "mismatch_prob_corr",
    "redundancy",
    "unique_tokens_per_s",
)


def write_plot(metrics: Path, out: Path, keys: tuple[str, ...] = PLOTTED, markers: bool = True) -> str:
    """A PNG of the run's main metrics (``keys``: those the records have, three to a row) against the
    step, a marker on each point of a short curve with ``markers``; returns a line saying what it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    records = read_metrics(metrics)
    keys = [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in records)]
    if not records or not keys:
        return "no plot: no metrics"
    cols = 3
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        marker = "." if markers and len(points) < 50 else None
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker)
        ax.set_title(key)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return f"plot: {out}"
