"""Time outside model compute in a budgeted step on a large forest.

A step under a token budget does work besides the model's kernels: cutting the forest into
parts, building each part's layout and its attention, convolution and linear-attention plans,
and handing keys/values, conv inputs and states (and their gradients) between parts. This
benchmark runs one :func:`harts.rollout_step` (SFT) of a tiny bailing_hybrid model on a
paper-like forest of about a million flat tokens at a budget of 1024 unique tokens per
micro-batch and reports the step's own accounting (:attr:`harts.StepResult.timings`): seconds in
planning, in hand-over bookkeeping, and in total; everything else is model compute.

Usage: ``harts bench-overhead [--scale 1.0] [--budget 1024] [--threads 0] [--family bailing_hybrid]``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import harts
from harts.data.synthetic import scaled
from harts.tiny import FAMILIES, tiny_model

__all__ = ["measure", "main"]


def measure(
    family: str = "bailing_hybrid", scale: float = 1.0, num_tasks: int = 5, budget: int = 1024, seed: int = 0
) -> dict:
    """One step's timings on the paper-like shape (``num_tasks`` tasks at ``scale``)."""
    model = tiny_model(family, seed=seed)
    trajectories = scaled(
        "paper_like",
        scale,
        vocab_size=model.config.get_text_config().vocab_size,
        num_tasks=num_tasks,
        seed=seed,
    )
    rollouts = [harts.Rollout(t) for t in trajectories]
    start = time.perf_counter()
    result = harts.rollout_step(model, rollouts, harts.PolicyLossConfig(kind="sft"), budget_tokens=budget)
    wall = time.perf_counter() - start
    forest = harts.build_forest(trajectories)
    t = result.timings
    outside = t["plan"] + t["handoff"]
    return dict(
        family=family,
        flat_tokens=forest.num_flat_tokens,
        unique_tokens=forest.num_tokens,
        redundancy=forest.redundancy,
        budget=budget,
        micro_batches=result.num_micro_batches,
        cuts=result.num_cuts,
        step_s=t["total"],
        wall_s=wall,
        plan_s=t["plan"],
        handoff_s=t["handoff"],
        outside_fraction=outside / t["total"],
        threads=torch.get_num_threads(),
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="harts bench-overhead", description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, default="bailing_hybrid")
    p.add_argument("--scale", type=float, default=1.0, help="length factor on the paper-like shape")
    p.add_argument(
        "--tasks", type=int, default=5, help="tasks of 8 rollouts (5 at scale 1: 1.1M flat tokens)"
    )
    p.add_argument("--budget", type=int, default=1024, help="unique tokens per micro-batch")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    row = measure(a.family, a.scale, a.tasks, a.budget)
    print(
        f"{row['family']}: {row['flat_tokens']} flat / {row['unique_tokens']} unique tokens "
        f"(R {row['redundancy']:.2f}), budget {row['budget']}: {row['micro_batches']} micro-batches, "
        f"{row['cuts']} cut\n"
        f"step {row['step_s']:.2f} s: planning {row['plan_s']:.2f} s, hand-over {row['handoff_s']:.2f} s, "
        f"outside model compute {100 * row['outside_fraction']:.1f}%"
    )
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
