"""A critic's value step, tree against flat, side by side on one star-shaped batch.

One prompt and ``--completions`` sampled completions (a GRPO group, ``harts.data.synthetic.star``)
through :func:`harts.value_step` (the clipped value loss, forward and backward) with a tiny
``*ForTokenClassification`` critic (``num_labels=1``) of ``--family``: *tree* merges the
trajectories by common prefix under ``--budget``; *flat* runs the same call with
``share_prefixes=False`` (each trajectory its own root, whole trajectories packed) at ``--budget``,
at four times it and without a budget, and the fastest of the three is the baseline (the strongest
flat step a user could pick). Variants are interleaved, ``--repeats`` times after a warm-up; the
medians, tree against the best flat, the flat / unique token counts and the largest difference of
the losses and head-weight gradients between the layouts are printed.

    python -m harts.bench.critic_step [--family qwen3] [--prompt 512] [--completions 8]
        [--completion 64] [--budget 1024] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import AutoModelForTokenClassification

import harts
from harts.data.synthetic import star
from harts.tiny import tiny_config

SMALL = dict(vocab_size=1024, hidden_size=128, intermediate_size=256)  # harts bench's "small" widths


def rollouts(args, vocab: int) -> list[harts.Rollout]:
    trajectories = star(args.prompt, args.completions, args.completion, vocab_size=vocab, seed=0)
    gen = torch.Generator().manual_seed(0)
    out = []
    for t in trajectories:
        mask = torch.zeros(len(t), dtype=torch.long)
        mask[args.prompt :] = 1  # the completion is what the critic is trained on
        out.append(
            harts.Rollout(
                t,
                loss_mask=mask,
                returns=torch.randn(len(t), generator=gen),
                values=torch.randn(len(t), generator=gen),
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = tiny_config(args.family, num_labels=1, **SMALL)
    critic = AutoModelForTokenClassification.from_config(config).eval()
    batch = rollouts(args, config.vocab_size)
    loss_config = harts.ValueLossConfig(clip=0.5)
    variants = {
        "tree": (True, args.budget),
        f"flat@{args.budget}": (False, args.budget),
        f"flat@{4 * args.budget}": (False, 4 * args.budget),
        "flat@whole": (False, None),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    results = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, (share, budget) in variants.items():
            critic.zero_grad(set_to_none=True)
            start = time.perf_counter()
            result = harts.value_step(critic, batch, loss_config, budget_tokens=budget, share_prefixes=share)
            elapsed = time.perf_counter() - start
            if repeat:
                times[name].append(elapsed)
            results[name] = (result, critic.score.weight.grad.clone())
    med = {name: statistics.median(t) for name, t in times.items()}
    best = min((n for n in variants if n != "tree"), key=med.get)
    tree, flat = results["tree"][0], results[best][0]
    unique = sum(tree.tokens_per_micro_batch)
    flat_tokens = sum(flat.tokens_per_micro_batch)
    print(
        f"{args.family} critic (hidden {config.hidden_size}), star: prompt {args.prompt}, "
        f"{args.completions} x ~{args.completion}; budget {args.budget}; {args.threads} threads; "
        f"{platform.processor() or platform.machine()}"
    )
    print(f"tokens: flat {flat_tokens}, unique {unique} (R = {flat_tokens / unique:.2f})")
    for name in variants:
        r = results[name][0]
        print(
            f"  {name:5s} value_step median {med[name]:.3f} s over {args.repeats} "
            f"({r.num_micro_batches} micro-batches)"
        )
    print(f"  best flat ({best}) / tree = {med[best] / med['tree']:.2f}x")
    grad_diff = (results["tree"][1] - results[best][1]).abs().max().item()
    print(
        f"  |loss tree - flat| = {abs(tree.loss.item() - flat.loss.item()):.2e}, "
        f"max |score grad tree - flat| = {grad_diff:.2e}"
    )


if __name__ == "__main__":
    main()
