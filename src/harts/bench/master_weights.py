"""bf16 training with and without fp32 master weights, against fp32: losses and weights moved.

Runs ``harts train`` three times on the example rollouts (SFT, AdamW, constant learning rate,
one thread): ``float32``; ``bfloat16`` with fp32 master weights (the default); ``bfloat16``
with ``optimizer.master_weights = false``. Prints the loss of every step side by side and, at
the end, the fraction of the model's weights that differ from the run's starting weights (for
the master-weight run, of its fp32 masters too). With ``--plot PATH`` it also draws the three loss
curves (``pip install -e '.[bench]'`` for matplotlib): the losses per step, and each run's loss
minus fp32's at the same step. Every step reads other rollouts, so the raw curves zigzag with the
data; the difference removes that, leaving what the precision did.

    python -m harts.bench.master_weights [--steps 20] [--lr 1e-5] [--family llama] \
        [--plot docs/bench/master-weights.png]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from harts.trainer.config import parse_config
from harts.trainer.inputs import load_model
from harts.trainer.loop import train

ROOT = Path(__file__).resolve().parents[3]  # the checkout (src/harts/bench/ is three below): its examples/
RUNS = {
    "fp32": ("float32", True),
    "bf16 + fp32 masters": ("bfloat16", True),
    "pure bf16": ("bfloat16", False),
}


def _config(family: str, dtype: str, masters: bool, steps: int, lr: float):
    table = {
        "seed": 0,
        "steps": steps,
        "threads": 1,
        "max_grad_norm": 1.0,
        "model": {"tiny": family, "dtype": dtype},
        "data": {"path": str(ROOT / "examples" / "rollouts.jsonl"), "rollouts_per_step": 8},
        "objective": {"kind": "sft"},
        "optimizer": {"kind": "adamw", "lr": lr, "master_weights": masters},
        "checkpoint": {"every": 0},
        "logging": {"every": steps, "plot": False},
    }
    return parse_config(table, ROOT)


def _fraction_changed(start: dict, end: dict) -> float:
    changed = sum(int((start[k] != end[k].to(start[k].dtype)).sum()) for k in start)
    return changed / sum(t.numel() for t in start.values())


def _masters(checkpoint: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    buffer = checkpoint.parent / "state.pt"
    dcp_to_torch_save(checkpoint / "state", buffer)
    return torch.load(buffer, weights_only=True).get("masters", {})


def plot(losses: dict[str, list[float]], path: Path, title: str) -> None:
    """Two panels over the steps: each run's loss, and its loss minus the fp32 run's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    reference = losses["fp32"]
    for (name, values), style in zip(losses.items(), ("-o", "-s", "-^"), strict=True):
        steps = range(1, len(values) + 1)
        top.plot(steps, values, style, markersize=4, label=name)
        bottom.plot(
            steps, [v - r for v, r in zip(values, reference, strict=True)], style, markersize=4, label=name
        )
    top.set_ylabel("SFT loss")
    top.set_title(title, fontsize=10)
    bottom.legend(loc="upper left")  # the top panel's peaks leave it no free corner
    bottom.axhline(0.0, color="grey", linewidth=0.5)
    bottom.set_ylabel("loss minus fp32 loss")
    bottom.set_xlabel("step (each reads other rollouts; the same ones every fourth)")
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--plot", type=Path, help="write the loss curves to this image")
    args = parser.parse_args()
    losses, moved = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (dtype, masters) in RUNS.items():
            config = _config(args.family, dtype, masters, args.steps, args.lr)
            start = {
                k: v.detach().clone() for k, v in load_model(config.model, config.seed).state_dict().items()
            }
            out = Path(tmp) / name.replace(" ", "_")
            summary = train(config, out, log=io.StringIO())
            end = load_file(Path(summary["checkpoint"]) / "model.safetensors")
            start = {k: v for k, v in start.items() if k in end}
            moved[name] = _fraction_changed(start, end)
            if dtype == "bfloat16" and masters:
                fp32 = _masters(Path(summary["checkpoint"]))
                moved[f"{name} (the masters)"] = _fraction_changed(
                    {k: start[k].float() for k in fp32 if k in start}, fp32
                )
            lines = (out / "metrics.jsonl").read_text().splitlines()
            losses[name] = [json.loads(line)["loss"] for line in lines]
    title = f"tiny {args.family}, SFT on examples/rollouts.jsonl, AdamW lr {args.lr:g}, {args.steps} steps"
    print(title + "\n")
    print("| step | " + " | ".join(RUNS) + " |")
    print("|---|" + "---|" * len(RUNS))
    for i in range(args.steps):
        print(f"| {i + 1} | " + " | ".join(f"{losses[name][i]:.6f}" for name in RUNS) + " |")
    print()
    for name, fraction in moved.items():
        print(f"weights changed after {args.steps} steps, {name}: {100 * fraction:.2f}%")
    if args.plot is not None:
        plot(losses, args.plot, title)
        print(f"loss curves: {args.plot}")


if __name__ == "__main__":
    main()
