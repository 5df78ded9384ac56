"""Speed of the tree step against the flat layout at its fastest budget, next to the FLOP-ideal.

One step (forward and backward) is timed ``repeats`` times after a warm-up, the layouts
interleaved, the median of each. The flat layout is timed at the tree's budget, without a budget
when the whole flat forest fits the largest of :data:`FLAT_BUDGETS`, and at those budgets (the
distinct micro-batch plans of :func:`harts.bench.cases.flat_budget_variants`); the fastest is the
baseline, as ``harts bench`` does: one flat micro-batch per budget is not the strongest flat
trainer.

The FLOP-ideal (:func:`harts.runtime.flops.ideal_speedup`: flat FLOPs over tree FLOPs) is what
computing each shared token once can save. A measured speedup above it says the flat baseline was
measured slow (a busy machine, a noisy timer, too few repeats), not that the tree is that fast:
the demo then warns and claims no speedup (:func:`speedup_verdict`).
"""

from __future__ import annotations

import statistics
import time

import harts
from harts.bench.cases import flat_budget_variants, flat_run
from harts.demo.training import step_fn
from harts.runtime.flops import flop_model, ideal_speedup

FLAT_BUDGETS = (1024, 4096, 8192)  # besides the tree's budget


def flat_variants(budget: int, flat: harts.Forest) -> dict[str, int | None]:
    """The flat variants timed, by name, with the budget each runs at (None: one micro-batch).
    One micro-batch of the whole flat forest is a candidate only when the largest budget would
    hold it anyway: on a large forest (37k flat tokens under ``--full``) it is far slower and
    larger than any budgeted one."""
    fits = flat.num_tokens <= max(FLAT_BUDGETS)
    return {
        name: flat_run(harts.RunConfig(budget_tokens=b), flat).budget_tokens
        for name, b in flat_budget_variants(budget, FLAT_BUDGETS, flat).items()
        if name != "flat_whole" or fits
    }


def time_steps(model, fns: dict, flat_names, repeats: int) -> tuple[dict[str, float], set[str]]:
    """Median seconds per step of each variant: every one warmed up once (timed), then the tree and
    the flat variants that could still be fastest (within 1.5x of the fastest flat warm-up; a
    warm-up step is never faster than a warm one) timed ``repeats`` times, interleaved; the
    others keep their warm-up time. Returns (seconds by variant, the variants timed warm)."""

    def timed(fn) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    warm = {name: timed(fn) for name, fn in fns.items()}
    fastest_flat = min(warm[n] for n in flat_names)
    racing = [n for n in fns if n == "tree" or warm[n] <= 1.5 * fastest_flat]
    times: dict[str, list[float]] = {name: [] for name in racing}
    for _ in range(repeats):
        for name in racing:
            times[name].append(timed(fns[name]))
    model.zero_grad(set_to_none=True)
    median = {name: statistics.median(times[name]) if name in times else warm[name] for name in fns}
    return median, set(racing)


def speedup_verdict(speedup: float, ideal: float) -> str:
    """The speed headline: the measured speedup next to the FLOP-ideal, or, when the measurement
    exceeds the ideal, a warning that the baseline's timing is noisy or weak, with no figure."""
    if speedup > ideal:
        return (
            f"warning: the tree measured faster than its FLOP-ideal {ideal:.2f}x over flat, more than "
            "computing each shared token once can save: the flat baseline's timing is noisy or weak "
            "here (a busy machine, too few repeats), so this run claims no speedup; rerun on a quiet "
            "machine, or with more --repeats"
        )
    return f"speedup against flat at its fastest budget: {speedup:.2f}x (FLOP-ideal {ideal:.2f}x)"


def report_speed(
    model, rollouts, tree: harts.Forest, flat: harts.Forest, budget: int, repeats: int
) -> int | None:
    """Time the tree step and the flat variants, print the table and the verdict; returns the
    budget of the fastest flat variant (None: one micro-batch)."""
    variants = flat_variants(budget, flat)
    fns = {"tree": step_fn(model, rollouts, True, budget)}
    fns.update({name: step_fn(model, rollouts, False, b) for name, b in variants.items()})
    median, raced = time_steps(model, fns, variants, repeats)
    best = min(raced & set(variants), key=median.get)
    print("layout   budget   median s per step (forward and backward)")
    for name, seconds in median.items():
        layout, shown = ("tree", budget) if name == "tree" else ("flat", variants[name])
        mark = "   <- fastest flat" if name == best else ""
        mark = mark if name in raced else "   (warm-up step only: too slow to be the fastest)"
        print(f"{layout:<8} {shown or 'none':>6}   {seconds:.2f}{mark}")
    print(speedup_verdict(median[best] / median["tree"], ideal_speedup(flop_model(model), tree, flat)))
    return variants[best]
