"""Measure the linear-attention kernels and fit ``harts.plan.linear_cost.LinearCostModel`` to them.

Why: AUTO weighs plans of calls against the one-call chunk tree by this model, so both halves
must be fitted on the same machine, thread count and kernels. This script times fwd + bwd of the
delta rule through ``tree_recurrence`` (gathers included):

- single calls: W segments of T tokens at chunk C (W in 1-64, T in 16-1024, C in 8-64), and
  calls with S inner boundaries; and whole plans of calls (depth, chain, AUTO) on the forests below;
- chunk trees: the benchmark's forest shapes (tree and flat, two scales) at every chunk size;

then fits each half by least squares on relative error (every row divided by its time), negative
weights clipped to zero and the rest refitted, and prints the fields, the median and 90th
percentile relative error of each half, and plan-level checks on the bench shapes (estimate vs
measured for AUTO's call plan and the chunk tree).

Run: ``python -m harts.bench.fit_linear_cost [--threads 1] [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import numpy as np
import torch
import torch.nn.functional as F

import harts
from harts.bench.cases import BenchConfig, make_trajectories
from harts.ops.tree_recurrence import tree_gated_delta_rule
from harts.plan.chunk_tree import chunk_tree_plan
from harts.plan.linear import LinearPlan, chain_plan, plan_linear
from harts.plan.linear_cost import LinearCostModel, PlanMode

H, K, V = 4, 32, 32
CHUNKS = (8, 16, 32, 64)
call_features, tree_features = LinearCostModel.call_terms, LinearCostModel.tree_terms


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs = (
        torch.randn(n, H, K, generator=g),
        F.normalize(torch.randn(n, H, K, generator=g), dim=-1),
        torch.randn(n, H, V, generator=g),
        F.logsigmoid(torch.randn(n, H, K, generator=g) + 3.0),
        torch.rand(n, H, generator=g),
    )
    return [x.requires_grad_(True) for x in xs]


def time_plan(plan, n: int, repeats: int) -> float:
    """Seconds of fwd + bwd of the delta rule over ``plan`` (the fastest of ``repeats`` after a warm-up)."""
    xs = _inputs(n)

    def step():
        o, _ = tree_gated_delta_rule(*xs, plan)
        o.square().mean().backward()
        for x in xs:
            x.grad = None

    step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def chain_forest(w: int, t: int, s: int) -> harts.Forest:
    """W roots of T tokens, each a chain of S + 1 nodes (trajectories end at the inner boundaries)."""
    rng = np.random.default_rng(w * 10_000 + t * 10 + s)
    trajectories = []
    for _ in range(w):
        seq = rng.integers(0, 50_000, size=t).tolist()
        cuts = sorted({round(t * (j + 1) / (s + 1)) for j in range(s)} | {t})
        trajectories += [seq[:c] for c in cuts]
    return harts.build_forest(trajectories)


def measure_calls(quick: bool, repeats: int):
    rows = []
    grid = itertools.product((1, 4, 16, 64), (16, 64, 256, 1024), CHUNKS, (0,))
    extra = itertools.product((4, 16), (64, 256), CHUNKS, (2, 6))
    for w, t, c, s in itertools.chain(grid, extra):
        if quick and (w * t > 4096 or c not in (8, 64)):
            continue
        forest = chain_forest(w, t, s)
        call = chain_plan(forest).calls[0]
        assert call.num_boundaries == s and tuple(call.token_index.shape) == (w, t), (w, t, s)
        plan = LinearPlan([call.rows(torch.arange(w), c)], forest.num_tokens)
        rows.append((call_features(w, t, s, c), time_plan(plan, forest.num_tokens, repeats) * 1e6))
    return rows


def plan_features(plan: LinearPlan) -> list[float]:
    """A plan of calls costs the sum of its calls: its features are the sums of theirs."""
    feats = [call_features(*c.token_index.shape, c.num_boundaries, c.chunk_size) for c in plan.calls]
    return [sum(col) for col in zip(*feats, strict=True)]


def measure_call_plans(quick: bool, repeats: int):
    """Whole plans of calls (depth, fewest-calls chain, AUTO among calls) on the bench forests:
    what AUTO compares, so the fit sees the calls of real plans, not only the grid's."""
    calls_only = LinearCostModel(consider_chunk_tree=False)
    rows = []
    for _, forest in bench_forests(quick):
        for mode in ("depth", "chain", "auto"):
            plan = plan_linear(forest, mode, calls_only)
            rows.append((plan_features(plan), time_plan(plan, forest.num_tokens, repeats) * 1e6))
    return rows


def bench_forests(quick: bool):
    scales = (0.01,) if quick else (0.01, 0.02)
    for shape, scale in itertools.product(("star", "agentic", "paper_like", "deep", "random"), scales):
        trajectories = make_trajectories(shape, BenchConfig(shapes=(shape,), scale=scale).resolved(), 1024)
        for layout, share in (("tree", True), ("flat", False)):
            yield f"{shape}@{scale}/{layout}", harts.build_forest(trajectories, share_prefixes=share)


def measure_trees(quick: bool, repeats: int):
    rows = []
    for _, forest in bench_forests(quick):
        for c in CHUNKS:
            plan = chunk_tree_plan(forest, c)
            seconds = time_plan(plan, forest.num_tokens, repeats)
            rows.append((tree_features(plan.num_chunks, plan.scan_steps, c), seconds * 1e6))
    return rows


def fit(features, times):
    """Non-negative least squares on relative error (clip negatives to zero and refit the rest)."""
    a = np.asarray(features, dtype=float) / np.asarray(times)[:, None]
    b = np.ones(len(times))
    active = np.ones(a.shape[1], dtype=bool)
    while True:
        x = np.zeros(a.shape[1])
        x[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        active &= x > 0


def errors(pred, times):
    rel = np.abs(np.asarray(pred) / np.asarray(times) - 1)
    return float(np.median(rel)), float(np.quantile(rel, 0.9))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small grid (smoke run; not for the defaults)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    calls = measure_calls(args.quick, args.repeats) + measure_call_plans(args.quick, args.repeats)
    trees = measure_trees(args.quick, args.repeats)
    xc = fit([f for f, _ in calls], [t for _, t in calls])
    xt = fit([f for f, _ in trees], [t for _, t in trees])
    fields = dict(zip(LinearCostModel.CALL_FIELDS, (float(f"{v:.3g}") for v in xc), strict=True))
    fields |= dict(zip(LinearCostModel.TREE_FIELDS, (float(f"{v:.3g}") for v in xt), strict=True))
    model = dataclasses.replace(LinearCostModel(), **fields)
    print(f"threads {args.threads}, {len(calls)} calls and plans of calls, {len(trees)} chunk trees")
    print("fields:", ", ".join(f"{k}={v}" for k, v in fields.items()))
    for label, rows, x in (("calls", calls, xc), ("chunk trees", trees, xt)):
        e = errors([float(np.dot(f, x)) for f, _ in rows], [t for _, t in rows])
        print(f"{label}: relative error median {e[0]:.0%}, 90th percentile {e[1]:.0%}")
    print("\nplan-level check (ms, estimate / measured):")
    print("| forest | tokens | AUTO calls plan | chunk tree (chosen C) | AUTO picks | measured faster |")
    print("|---|---:|---:|---:|---|---|")
    call_only = dataclasses.replace(model, consider_chunk_tree=False)
    for name, forest in bench_forests(args.quick):
        calls_plan = plan_linear(forest, "auto", call_only)
        tree_plan = plan_linear(forest, "tree", model)
        auto = plan_linear(forest, "auto", model)
        t_calls = time_plan(calls_plan, forest.num_tokens, args.repeats) * 1e3
        t_tree = time_plan(tree_plan, forest.num_tokens, args.repeats) * 1e3
        est_calls, est_tree = (
            model.plan(calls_plan) / 1e3,
            model.chunk_tree(tree_plan.num_chunks, tree_plan.scan_steps, tree_plan.chunk_size) / 1e3,
        )
        picked = "tree" if auto.mode is PlanMode.TREE else "calls"
        print(
            f"| {name} | {forest.num_tokens} | {est_calls:.0f} / {t_calls:.0f} "
            f"| {est_tree:.0f} / {t_tree:.0f} (C={tree_plan.chunk_size}) | {picked} "
            f"| {'tree' if t_tree < t_calls else 'calls'} |"
        )


if __name__ == "__main__":
    main()
