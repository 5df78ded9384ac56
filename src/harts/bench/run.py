"""``harts bench``: tree vs flat vs stock per-trajectory training on rollout-forest shapes.

For each model family (small random configs) and each shape (star, agentic, paper_like, deep,
random) it reports: the redundancy R; the FLOP-ideal speedup (:mod:`harts.runtime.flops`); the
achieved speedup of the tree layout over the flat layout at its best budget (packed whole
trajectories through the same kernels, timed at the tree's budget, without one and at
``--flat-budgets``, :mod:`harts.bench.cases`); the speedup over stock Hugging
Face training of each trajectory on its own; peak memory of each (live-tensor peak, and on the CPU
the resident-set peak too); calls per linear-attention layer; and, on full-attention families and
the one-prefix shape, the peers PrefixGrouper and flash-pref (:mod:`harts.bench.peers`). Cases
and steps: :mod:`harts.bench.cases`.

Timing: one process, ``torch.set_num_threads`` fixed, every variant warmed up, then the variants
interleaved (tree, flat, stock, peers, tree, flat, ...) ``repeats`` times; medians are reported.
Memory: each (family, shape, variant) runs in a fresh child process; see :mod:`harts.bench.memory`.

What this leaves out: real tokenised data, real model sizes, optimizer steps, distributed runs.
Usage: ``harts bench [--quick] [--shapes star deep] [--families qwen3] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from harts.bench.cases import (
    DEFAULT_FAMILIES,
    SHAPES,
    STEPS,
    BenchConfig,
    build_case,
    flat_budgets,
    is_flat_variant,
    variant_fns,
)
from harts.ops.backends import available_backends, resolve_backend
from harts.plan.linear_cost import PlanMode
from harts.runtime.config import RunConfig
from harts.runtime.flops import FLOP_MODEL_TEXT, flop_model, forest_flops
from harts.tiny import FAMILIES

__all__ = ["run", "run_case", "main"]


# ---- timing --------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_variants(
    model: nn.Module,
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    device: str,
    optional: tuple[str, ...] = (),
) -> tuple[dict[str, list[float]], dict[str, object], dict[str, str]]:
    """Warm every variant up, then run them interleaved ``repeats`` times.

    Returns (seconds per run, last result, failures): a variant named in ``optional`` (a peer)
    that raises during warm-up is dropped with its error; any other error propagates.
    """
    results: dict[str, object] = {}
    failed: dict[str, str] = {}
    for _ in range(max(warmup, 1)):
        for name, fn in list(fns.items()):
            model.zero_grad(set_to_none=True)
            try:
                results[name] = fn()
            except Exception as exc:
                if name not in optional:
                    raise
                failed[name] = f"failed: {type(exc).__name__}: {exc}"
                del fns[name]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            results[name] = fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return times, results, failed


def _loss(result) -> float:
    """The loss of a variant's result: a StepResult's, or the tensor a stock or peer step returns."""
    return float(getattr(result, "loss", result))


def _plan_stats(result, has_linear: bool) -> tuple[int | None, int | None]:
    """(calls per linear-attention layer, padded slots), summed over the step's micro-batches."""
    if not has_linear or not getattr(result, "layouts", None):
        return None, None
    plans = [layout.linear_plan for layout in result.layouts]
    return sum(p.num_calls for p in plans), sum(p.padded_tokens for p in plans)


def run_case(cfg: BenchConfig, family: str, shape: str) -> dict:
    """Every measurement of one (family, shape): a JSON-ready row."""
    case = build_case(cfg, family, shape)
    fm = flop_model(case.model)
    flops_tree, flops_flat = forest_flops(fm, case.tree), forest_flops(fm, case.flat)
    fns, skipped = variant_fns(case, cfg)
    peers = tuple(n for n in fns if n not in ("tree", "stock") and not is_flat_variant(n))
    times, results, failed = time_variants(case.model, fns, cfg.repeats, cfg.warmup, cfg.device, peers)
    skipped.update(failed)
    stock_loss = _loss(results["stock"])
    variants: dict[str, dict] = {}
    for name in fns:
        loss = _loss(results[name])
        calls, padded = _plan_stats(results[name], fm.num_linear_layers > 0)
        variants[name] = dict(
            status="ran",
            time_s=statistics.median(times[name]),
            times_s=times[name],
            loss=loss,
            loss_rel_diff_vs_stock=abs(loss - stock_loss) / max(abs(stock_loss), 1e-30),
            linear_calls=calls,
            linear_padded_slots=padded,
        )
    for name, reason in skipped.items():
        variants[name] = dict(status="skipped", reason=reason)
    if cfg.memory:
        from harts.bench.memory import measure_peak

        for name, v in variants.items():
            if v["status"] == "ran":
                v.update(measure_peak(cfg, family, shape, name))
    t = {name: v.get("time_s") for name, v in variants.items()}
    ideal = flops_flat / flops_tree
    flat_best = min((n for n in t if is_flat_variant(n) and t[n] is not None), key=lambda n: t[n])
    achieved = t[flat_best] / t["tree"]
    return dict(
        family=family,
        shape=shape,
        trajectories=case.tree.num_trajectories,
        unique_tokens=case.tree.num_tokens,
        flat_tokens=case.tree.num_flat_tokens,
        max_depth=case.tree.max_depth,
        redundancy=case.tree.redundancy,
        flops_tree=flops_tree,
        flops_flat=flops_flat,
        ideal_speedup=ideal,
        flat_best=flat_best,
        flat_best_budget=flat_budgets(cfg, case.flat).get(flat_best),
        achieved_speedup=achieved,
        fraction_of_ideal=achieved / ideal,
        speedup_vs_stock=t["stock"] / t["tree"],
        flop_model=fm.as_dict(),
        variants=variants,
    )


def machine_info(cfg: BenchConfig) -> dict:
    info = dict(
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        device=cfg.device,
    )
    if cfg.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    info["backend"], info["backend_reason"] = resolve_backend(cfg.run.backend, torch.device(cfg.device))
    return info


def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run every (family, shape) of ``cfg``; returns the JSON-ready results."""
    cfg = cfg.resolved()
    torch.set_num_threads(cfg.threads)
    backend, why = resolve_backend(cfg.run.backend, torch.device(cfg.device))
    log(f"kernels: {backend} backend ({why})")
    rows = []
    for family in cfg.families:
        for shape in cfg.shapes:
            start = time.perf_counter()
            rows.append(run_case(cfg, family, shape))
            r = rows[-1]
            log(
                f"{family:>15} {shape:<10} R={r['redundancy']:.2f} ideal={r['ideal_speedup']:.2f} "
                f"tree/flat={r['achieved_speedup']:.2f} tree/stock={r['speedup_vs_stock']:.2f} "
                f"({time.perf_counter() - start:.1f} s)"
            )
    return dict(
        config=dataclasses.asdict(cfg),
        machine=machine_info(cfg),
        flop_model=FLOP_MODEL_TEXT,
        rows=rows,
    )


def _hold_tokens(text: str) -> int | str:
    """``--hold-tokens``: ``auto`` or a token count >= 0 (``RunConfig.hold_tokens``)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected auto or an integer >= 0, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, str]:
    p = argparse.ArgumentParser(prog="harts bench", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), choices=FAMILIES)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median reported)")
    p.add_argument("--scale", type=float, default=0.02, help="length factor on the full-size shapes")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--model-size", choices=("small", "tiny"), default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--no-peers", action="store_true", help="skip PrefixGrouper and flash-pref")
    p.add_argument("--out", default="bench-out", help="folder for results.json/.md and speedup.png")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models and shapes, 1 repeat")
    p.add_argument("--budget", type=int, default=None, help="micro-batch token budget (tree and flat)")
    p.add_argument(
        "--linear-plan",
        choices=[m.value for m in PlanMode],
        default="auto",
        help="how linear-attention layers are cut into calls",
    )
    p.add_argument(
        "--recompute-linear",
        action="store_true",
        help="recompute linear-attention calls in backward (less memory, more time)",
    )
    p.add_argument(
        "--hold-tokens",
        type=_hold_tokens,
        default=RunConfig.hold_tokens,
        help="graph tokens cut-tree parts may hold for readers (more memory, fewer forwards): "
        "a count >= 0 or auto (the budget; default)",
    )
    p.add_argument(
        "--flat-budgets",
        type=int,
        nargs="*",
        default=list(BenchConfig.flat_budgets),
        help="more budgets the flat layout runs at; the fastest flat run is the baseline",
    )
    p.add_argument("--step", choices=sorted(STEPS), default="forest_step")
    p.add_argument(
        "--backend",
        choices=["auto", *available_backends()],
        default="auto",
        help="kernels: torch (plain PyTorch), fla (CUDA, the gpu extra), auto (fla on CUDA where installed)",
    )
    a = p.parse_args(argv)
    run_config = RunConfig(
        budget_tokens=a.budget,
        linear_plan=a.linear_plan,
        recompute_linear=a.recompute_linear,
        hold_tokens=a.hold_tokens,
        backend=a.backend,
    )
    cfg = BenchConfig(
        shapes=tuple(a.shapes),
        families=tuple(a.families),
        repeats=a.repeats,
        scale=a.scale,
        threads=a.threads,
        model_size=a.model_size,
        device=a.device,
        memory=not a.no_memory,
        peers=not a.no_peers,
        quick=a.quick,
        run=run_config,
        step=a.step,
        flat_budgets=tuple(a.flat_budgets),
    )
    return cfg, a.out


def main(argv: list[str] | None = None) -> dict:
    from harts.bench.report import markdown, write_outputs

    cfg, out = parse_args(argv)
    results = run(cfg)
    print(markdown(results))
    for line in write_outputs(results, out):
        print(line)
    return results


if __name__ == "__main__":
    main()
