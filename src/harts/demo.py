"""``make demo``: a few training steps in tree layout against the same steps in flat layout.

A randomly initialised model with the Ling 3 architecture (KDA linear layers, an MLA full
layer with interleaved RoPE and output gate, MoE with a shared expert) and a synthetic agentic
rollout set (a long shared system prompt, several turns, branches where earlier-turn thinking is
dropped). From the same seed, ``--steps`` optimizer steps (SFT, AdamW) run once in the tree
layout and once in the flat layout (``share_prefixes=False``: the same :func:`harts.rollout_step`,
code and kernels, each trajectory its own root), both in micro-batches of at most ``--budget``
unique tokens, the way a trainer bounds memory. The flat layout runs as a flat trainer does: whole
trajectories packed up to the budget (never cut; the budget is raised to the longest trajectory
if needed), each micro-batch forward and backward once. The demo prints the redundancy, the loss of
every step side by side (equal up to fp32 rounding), the time per step, each layout's tensor
peak for one step, and the speedup beside the FLOP-ideal one (docs/benchmarks.md).

Usage: ``python -m harts.demo [--steps 3] [--budget 2048] [--system-len 1000] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import harts
from harts.bench.cases import flat_run
from harts.bench.flops import flop_model, ideal_speedup
from harts.bench.memory import tensor_peak_bytes
from harts.data.synthetic import agentic
from harts.testing import tiny_model

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


SFT = harts.PolicyLossConfig(kind="sft")  # token-mean cross entropy over every next token


def train(model, rollouts, share_prefixes: bool, budget: int, steps: int, seed: int):
    """``steps`` SFT optimizer steps from the model's current weights (restored after); returns
    the loss and the seconds of each step and the final weights."""
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, seconds = [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        result = harts.rollout_step(model, rollouts, SFT, budget_tokens=budget, share_prefixes=share_prefixes)
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(result.loss))
    final = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(initial)
    return losses, seconds, final


def peak_mib(model, rollouts, share_prefixes: bool, budget: int) -> float:
    """Tensor peak of one step (forward and backward), in MiB."""

    def step():
        harts.rollout_step(model, rollouts, SFT, budget_tokens=budget, share_prefixes=share_prefixes)

    return tensor_peak_bytes(step, lambda: model.zero_grad(set_to_none=True)) / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-len", type=int, default=1000, help="shared system prompt tokens")
    parser.add_argument("--budget", type=int, default=2048, help="unique tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per layout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = tiny_model("bailing_hybrid", seed=args.seed, **DEMO_MODEL)
    params = sum(p.numel() for p in model.parameters())
    trajectories = agentic(
        system_len=args.system_len,
        num_tasks=2,
        rollouts_per_task=4,
        turns=4,
        turn_len=100,
        vocab_size=DEMO_MODEL["vocab_size"],
        seed=args.seed,
    )
    tree = harts.build_forest(trajectories)
    flat = harts.build_forest(trajectories, share_prefixes=False)
    print(
        f"model: bailing_hybrid (Ling 3 architecture), {params / 1e6:.2f}M parameters, "
        f"layers {model.config.layer_types}"
    )
    print(f"forest: {tree.describe()}")

    rollouts = [harts.Rollout(t) for t in trajectories]
    train(model, rollouts, True, args.budget, 1, args.seed)  # warm-up: first-call allocations
    tree_loss, tree_s, tree_w = train(model, rollouts, True, args.budget, args.steps, args.seed)
    flat_budget = flat_run(harts.RunConfig(budget_tokens=args.budget), flat).budget_tokens  # never cut
    flat_loss, flat_s, flat_w = train(model, rollouts, False, flat_budget, args.steps, args.seed)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own start/stop lines
    peaks = [peak_mib(model, rollouts, share, b) for share, b in ((True, args.budget), (False, flat_budget))]
    with torch.no_grad():
        out_t, out_f = harts.forward(model, tree), harts.forward(model, flat)
        logit_diff = max(
            (out_t.trajectory_logits(i) - out_f.trajectory_logits(i)).abs().max().item()
            for i in range(tree.num_trajectories)
        )
    weight_diff = max((tree_w[k] - w).abs().max().item() for k, w in flat_w.items() if w.is_floating_point())

    print(f"redundancy (flat / unique tokens): {tree.redundancy:.2f}; budget {args.budget} unique tokens")
    print("step   loss tree      loss flat      s tree   s flat")
    for n, (lt, lf, st, sf) in enumerate(zip(tree_loss, flat_loss, tree_s, flat_s, strict=True), start=1):
        print(f"{n:>4}   {lt:<13.7f}  {lf:<13.7f}  {st:6.2f}   {sf:6.2f}")
    t_tree, t_flat = sum(tree_s) / len(tree_s), sum(flat_s) / len(flat_s)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(tree_loss, flat_loss, strict=True))
    print(f"speedup: {t_flat / t_tree:.2f}x (FLOP-ideal {ideal_speedup(flop_model(model), tree, flat):.2f}x)")
    print(f"tensor peak of one step: tree {peaks[0]:.1f} MiB, flat {peaks[1]:.1f} MiB")
    print(f"max loss relative diff tree vs flat: {loss_diff:.1e}; max weight diff after {args.steps} steps: "
          f"{weight_diff:.1e}; max |logit diff| of the initial model: {logit_diff:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
