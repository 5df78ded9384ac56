"""The three passes of a PPO/GRPO step, tree against flat, side by side on one agentic forest.

Each step runs the rollouts three times: the policy with autograd (:func:`harts.rollout_step`,
PPO with a k3 KL term), then the old policy and the reference without it
(:func:`harts.forest_logprobs`, at the loss positions only, as the step reads them). *tree*
merges the rollouts by common prefix; *flat* runs the same calls with ``share_prefixes=False``
(each trajectory its own root: packed sequences through the same kernels, micro-batches of whole
trajectories), as ``harts bench`` runs its flat baseline. Both run under one token budget
(flat also at its best of the budgets ``harts bench`` tries, the strongest flat baseline).
Variants are interleaved, ``--repeats`` times after a warm-up; medians are printed with the
tree / flat ratios and the largest difference of the old log-probs between the layouts.

    python -m harts.bench.three_passes [--family bailing_hybrid] [--budget 1024] [--repeats 3]
        [--threads 1] [--scale 0.01]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import harts
from harts.bench.cases import small_overrides
from harts.data.synthetic import scaled
from harts.tiny import tiny_model


def rollouts_of(trajectories, seed: int = 0) -> list[harts.Rollout]:
    """PPO rollouts: the second half of each trajectory loss-bearing, sampler log-probs, advantages."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in trajectories:
        mask = torch.zeros(len(t), dtype=torch.bool)
        mask[max(1, len(t) // 2) :] = True
        old = -torch.rand(len(t), generator=gen)
        out.append(
            harts.Rollout(
                t,
                loss_mask=mask,
                rollout_logprobs=old,
                ref_logprobs=old,
                advantages=float(torch.randn((), generator=gen)),
            )
        )
    return out


def passes(model, rollouts, budget: int, share: bool):
    """(seconds of the policy pass, of the two forward-only passes, the old log-probs)."""
    config = harts.PolicyLossConfig(kind="ppo", kl_coef=0.05)
    run = harts.RunConfig(budget_tokens=budget)
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    harts.rollout_step(model, rollouts, config, run=run, share_prefixes=share)
    policy = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    old = harts.forest_logprobs(model, rollouts, run=run, share_prefixes=share, loss_positions_only=True)
    harts.forest_logprobs(model, rollouts, run=run, share_prefixes=share, loss_positions_only=True)
    return policy, time.perf_counter() - start, old.logprobs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="bailing_hybrid")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--flat-budgets", type=int, nargs="*", default=[4096])
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = tiny_model(args.family, seed=0, **small_overrides(args.family))  # harts bench's small model
    trajectories = scaled("agentic", args.scale, seed=0, vocab_size=model.config.get_text_config().vocab_size)
    rollouts = rollouts_of(trajectories)
    tree = harts.build_forest(trajectories)
    print(
        f"{args.family} (hidden 128, vocab 1024), agentic forest: {tree.num_trajectories} trajectories, "
        f"{tree.num_tokens} unique / {tree.num_flat_tokens} flat tokens (R {tree.redundancy:.2f}); "
        f"budget {args.budget}; {args.threads} threads, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}"
    )
    variants = {"tree": (args.budget, True), f"flat@{args.budget}": (args.budget, False)}
    variants |= {f"flat@{b}": (b, False) for b in args.flat_budgets if b != args.budget}
    times = {name: [] for name in variants}
    logprobs = {}
    for r in range(args.repeats + 1):  # the first round warms up
        for name, (budget, share) in variants.items():
            policy, forward_only, lp = passes(model, rollouts, budget, share)
            logprobs[name] = lp
            if r:
                times[name].append((policy, forward_only))
    med = {n: tuple(statistics.median(x[i] for x in v) for i in range(2)) for n, v in times.items()}
    flat_best = min((n for n in med if n != "tree"), key=lambda n: sum(med[n]))
    diff = max(
        float((a - b)[a.isfinite() & b.isfinite()].abs().max()) if a.numel() > 1 else 0.0
        for a, b in zip(logprobs["tree"], logprobs[flat_best], strict=True)
    )
    print(f"{'variant':>12} {'policy s':>9} {'old+ref s':>10} {'total s':>8}")
    for name, (p, f) in med.items():
        print(f"{name:>12} {p:9.3f} {f:10.3f} {p + f:8.3f}")
    tp, tf = med["tree"]
    fp, ff = med[flat_best]
    print(
        f"flat best ({flat_best}) / tree: policy {fp / tp:.2f}x, old+ref {ff / tf:.2f}x, "
        f"three passes {(fp + ff) / (tp + tf):.2f}x; forward-only share of the tree step "
        f"{tf / (tp + tf):.0%}; max |old log-prob tree - flat| {diff:.1e}"
    )


if __name__ == "__main__":
    main()
