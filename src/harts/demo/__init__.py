"""``make demo``: harts' tree step against stock Hugging Face and against the flat layout, in a minute.

A randomly initialised model with the Ling 3 architecture (KDA linear layers, an MLA full
layer with interleaved RoPE and output gate, MoE with a shared expert) and a synthetic agentic
rollout set (a shared system prompt, several turns, branches where earlier-turn thinking is
dropped). The flat layout is the same :func:`harts.rollout_step` with ``share_prefixes=False``
(same code and kernels, each trajectory its own root, whole trajectories packed into
micro-batches and never cut), the way a flat trainer runs.

It prints, in order:

1. exactness of one step against stock Hugging Face (:mod:`harts.demo.exactness`): each
   trajectory alone through the stock ``model(input_ids)`` forward, the logits and the gradients
   of the same SFT loss, against harts' tree step; the worst differences next to the fp32 bounds
   (1e-4 on logits, 1e-4 relative on each parameter's gradient), PASS or FAIL. On FAIL the demo
   stops there and exits with status 1;
2. speed (:mod:`harts.demo.speed`): one step (forward and backward) of the tree against the flat
   layout at its fastest budget, medians of ``--repeats`` interleaved timings, next to the
   FLOP-ideal speedup; a measured speedup above the ideal is reported as a noisy or weak baseline,
   with no speedup claimed;
3. the tensor peak of one step in each layout at the same stated budget, the tree's
   (:mod:`harts.demo.memory`);
4. ``--steps`` AdamW steps from the same seed in both layouts, losses side by side
   (:mod:`harts.demo.training`).

By default the rollouts are small (a 200-token system prompt, 2 turns of about 60 tokens, a
512-token budget, 2 repeats, 2 steps), so that the whole run takes about a minute on 2 CPU cores,
most of it the stock forwards of part 1 and the flat steps of part 2. ``--full`` restores the
longer measurement (a 1000-token system prompt, 4 turns of about 100 tokens, a 2048-token budget,
3 repeats, 3 steps: about 37k flat tokens, several minutes on 2 cores); any size given on the
command line overrides either preset.

It runs torch on one thread unless ``--threads`` says otherwise: on a CPU shared with other work,
OpenMP's barriers between threads can slow each step several-fold (the quick run took 4m46s on
two threads and 1m46s on one on a 2-core machine at a load of 7-9), and the model is small.

Usage: ``python -m harts.demo [--full] [--system-len N] [--turns N] [--turn-len N] [--budget N]
[--repeats N] [--steps N] [--seed 0] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import harts
from harts.data.synthetic import agentic
from harts.demo.exactness import compare_with_stock
from harts.demo.memory import report_memory
from harts.demo.speed import report_speed
from harts.demo.training import report_training, step_fn
from harts.tiny import tiny_model

DEMO_MODEL = dict(
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    num_experts=8,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
FAMILY = "bailing_hybrid"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of one demo run: the rollouts (``harts.data.synthetic.agentic``), the tree's
    token budget, timed repeats per variant and optimizer steps per layout."""

    system_len: int
    turns: int
    turn_len: int
    budget: int
    repeats: int
    steps: int


QUICK = Sizes(system_len=200, turns=2, turn_len=60, budget=512, repeats=2, steps=2)  # about a minute
FULL = Sizes(system_len=1000, turns=4, turn_len=100, budget=2048, repeats=3, steps=3)  # several minutes


def demo_model(seed: int = 0):
    """The demo's model: a tiny randomly initialised Ling 3 (bailing_hybrid)."""
    return tiny_model(FAMILY, seed=seed, **DEMO_MODEL)


def demo_trajectories(sizes: Sizes, seed: int = 0) -> list[list[int]]:
    """Two tasks, four rollouts each, over one shared system prompt."""
    return agentic(
        system_len=sizes.system_len,
        num_tasks=2,
        rollouts_per_task=4,
        turns=sizes.turns,
        turn_len=sizes.turn_len,
        vocab_size=DEMO_MODEL["vocab_size"],
        seed=seed,
    )


def parse_args(argv: list[str] | None) -> tuple[Sizes, argparse.Namespace]:
    """(the run's sizes: the preset, ``--full`` or the quick default, with any size given; the
    other arguments: seed, threads)."""
    parser = argparse.ArgumentParser(prog="python -m harts.demo", description=__doc__.splitlines()[0])
    longer = "the longer measurement: about 37k flat tokens, several minutes on 2 cores"
    parser.add_argument("--full", action="store_true", help=longer)
    helps = {
        "system_len": "shared system prompt tokens",
        "turns": "turns per rollout",
        "turn_len": "tokens per turn (about)",
        "budget": "unique tokens per micro-batch of the tree",
        "repeats": "timed steps per layout and budget",
        "steps": "optimizer steps per layout",
    }
    for name, text in helps.items():
        default = f"default {getattr(QUICK, name)}; --full {getattr(FULL, name)}"
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"{text} ({default})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: module docstring)")
    args = parser.parse_args(argv)
    given = {name: getattr(args, name) for name in helps if getattr(args, name) is not None}
    return dataclasses.replace(FULL if args.full else QUICK, **given), args


def main(argv: list[str] | None = None) -> None:
    sizes, args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # each line as it is printed, also into a pipe
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        run_demo(sizes, args.seed)
    finally:  # a caller in the same process (the tests, harts' command) keeps its own setting
        torch.set_num_threads(threads)


def run_demo(sizes: Sizes, seed: int) -> None:
    """The four parts of the module docstring, printed; SystemExit(1) when exactness fails."""
    torch.manual_seed(seed)
    model = demo_model(seed)
    trajectories = demo_trajectories(sizes, seed)
    tree = harts.build_forest(trajectories)
    flat = harts.build_forest(trajectories, share_prefixes=False)
    rollouts = [harts.Rollout(t) for t in trajectories]
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {FAMILY} (Ling 3 architecture), {params / 1e6:.2f}M parameters, "
        f"layers {model.config.layer_types}"
    )
    print(f"forest: {tree.describe()}")
    longer = "" if sizes == FULL else "; --full for the longer measurement"
    print(
        f"redundancy (flat / unique tokens): {tree.redundancy:.2f}; "
        f"tree budget {sizes.budget} unique tokens{longer}"
    )

    print(
        f"\n1. exactness: harts' tree step against stock Hugging Face, each of the {len(rollouts)} "
        "trajectories alone through model(input_ids), fp32"
    )
    comparison = compare_with_stock(model, rollouts, sizes.budget)
    print("\n".join(comparison.report()))
    if not comparison.passed:
        raise SystemExit(1)

    print("\n2. speed: one step, tree against flat at its fastest budget")
    flat_budget = report_speed(model, rollouts, tree, flat, sizes.budget, sizes.repeats)

    print(f"\n3. memory at a fixed budget of {sizes.budget} unique tokens per micro-batch")
    report_memory(
        model,
        rollouts,
        sizes.budget,
        step_fn(model, rollouts, True, sizes.budget),
        step_fn(model, rollouts, False, sizes.budget),
    )

    print(f"\n4. {sizes.steps} AdamW steps from the same seed in each layout")
    report_training(model, rollouts, sizes.budget, flat_budget, sizes.steps, seed)
