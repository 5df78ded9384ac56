"""Activation checkpointing in a harts step: what it saves, and what it costs.

With ``model.gradient_checkpointing_enable()`` in train mode, harts runs each decoder layer under
an activation checkpoint, as the stock model does. This benchmark runs one SFT
:func:`harts.rollout_step` of a small model on an agentic forest with and without it and reports,
for each: the bytes the forward saves for backward (saved-tensor hooks, each storage once), the
step's tensor peak (:func:`harts.bench.memory.tensor_peak_bytes`) and its time (median of
``repeats`` interleaved runs). Tests check exactness; this only measures.

Usage: ``harts bench-checkpointing [--family bailing_hybrid] [--scale 0.02] [--budget N] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import harts
from harts.bench.cases import BenchConfig, make_model, make_trajectories
from harts.bench.memory import tensor_peak_bytes
from harts.tiny import FAMILIES

__all__ = ["saved_bytes", "measure", "main"]


def saved_bytes(fn) -> int:
    """Bytes of the tensors saved for backward while ``fn()`` builds its graph (each storage once)."""
    seen: set = set()
    total = 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def measure(family: str, scale: float, budget: int | None, repeats: int) -> dict:
    cfg = BenchConfig(families=(family,), scale=scale)
    model = make_model(family, cfg).train()
    vocab = model.config.get_text_config().vocab_size
    rollouts = [harts.Rollout(t) for t in make_trajectories("agentic", cfg, vocab)]
    forest = harts.build_forest([r.tokens for r in rollouts])
    config = harts.PolicyLossConfig(kind="sft")

    def step():
        return harts.rollout_step(model, rollouts, config, budget_tokens=budget)

    def graph():  # the forward's graph and the loss, the part whose saved tensors checkpointing drops
        return harts.forward(model, forest).all_trajectory_logprobs()

    rows = {}
    for name in ("plain", "checkpointed"):
        if name == "checkpointed":
            model.gradient_checkpointing_enable()
        step()  # warm-up
        rows[name] = dict(
            saved_mib=saved_bytes(graph) / 2**20,
            peak_mib=tensor_peak_bytes(step, lambda: model.zero_grad(set_to_none=True)) / 2**20,
            times=[],
        )
    model.gradient_checkpointing_disable()
    for _ in range(repeats):
        for name in ("plain", "checkpointed"):
            if name == "checkpointed":
                model.gradient_checkpointing_enable()
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            rows[name]["times"].append(time.perf_counter() - start)
            model.gradient_checkpointing_disable()
    for row in rows.values():
        row["time_s"] = statistics.median(row["times"])
    return dict(
        family=family,
        unique_tokens=forest.num_tokens,
        flat_tokens=forest.num_flat_tokens,
        budget=budget,
        threads=torch.get_num_threads(),
        **rows,
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="harts bench-checkpointing", description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, default=FAMILIES[0])
    p.add_argument("--scale", type=float, default=0.02, help="length factor on the agentic shape")
    p.add_argument("--budget", type=int, default=None, help="unique tokens per micro-batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args(argv)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own start/stop lines
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    row = measure(a.family, a.scale, a.budget, a.repeats)
    plain, ck = row["plain"], row["checkpointed"]
    print(
        f"{row['family']}: {row['unique_tokens']} unique / {row['flat_tokens']} flat tokens, "
        f"budget {row['budget']}\n"
        f"saved for backward {plain['saved_mib']:.1f} -> {ck['saved_mib']:.1f} MiB; "
        f"step tensor peak {plain['peak_mib']:.1f} -> {ck['peak_mib']:.1f} MiB; "
        f"step {plain['time_s']:.2f} -> {ck['time_s']:.2f} s"
    )
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
