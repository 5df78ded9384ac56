"""``make demo``: one tree step against one flat step on a small Ling 3 (bailing_hybrid) model.

A randomly initialised model with the Ling 3 architecture (KDA linear layers, an MLA full
layer with interleaved RoPE and output gate, MoE with a shared expert) and a synthetic agentic
forest (a long shared system prompt, several turns, branches where earlier-turn thinking is
dropped). One training step, :func:`harts.rollout_step` with the SFT objective, runs in the tree
layout and in the flat layout (``share_prefixes=False``: the same code and kernels, each
trajectory its own root), both in micro-batches of at most ``--budget`` unique tokens, the way a
trainer bounds memory; the demo prints the redundancy, both times, the speedup (and the
FLOP-ideal one, see docs/benchmarks.md), and the largest logit, loss and gradient differences
between the two layouts.

Usage: ``python -m harts.demo [--system-len 1000] [--budget 2048] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import time

import torch

import harts
from harts.bench.flops import flop_model, ideal_speedup
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


def step(model, rollouts, share_prefixes: bool, budget: int) -> tuple[float, float, dict[str, torch.Tensor]]:
    """One forward+backward of the summed next-token log-probs; returns time, loss, gradients."""
    model.zero_grad(set_to_none=True)
    sft, total = harts.PolicyLossConfig(kind="sft"), torch.tensor(1.0)
    start = time.perf_counter()
    result = harts.rollout_step(model, rollouts, sft, normalizers=harts.Normalizers(total, total),
                                budget_tokens=budget, share_prefixes=share_prefixes)  # fmt: skip
    elapsed = time.perf_counter() - start
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return elapsed, float(result.loss), grads


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-len", type=int, default=1000, help="shared system prompt tokens")
    parser.add_argument("--budget", type=int, default=2048, help="unique tokens per micro-batch")
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
    step(model, rollouts, True, args.budget)  # warm-up: first-call allocations and lazy initialisation
    t_tree, loss_tree, g_tree = step(model, rollouts, True, args.budget)
    t_flat, loss_flat, g_flat = step(model, rollouts, False, args.budget)
    with torch.no_grad():
        out_t, out_f = harts.forward(model, tree), harts.forward(model, flat)
        logit_diff = max(
            (out_t.trajectory_logits(i) - out_f.trajectory_logits(i)).abs().max().item()
            for i in range(tree.num_trajectories)
        )
    grad_err = max((g_tree[n] - g_flat[n]).norm().item() / max(g_flat[n].norm().item(), 1e-6) for n in g_flat)

    print(f"redundancy (flat tokens / unique tokens): {tree.redundancy:.2f}")
    print(f"tree step (harts.rollout_step, budget {args.budget}): {t_tree:.3f} s")
    print(f"flat step (share_prefixes=False, budget {args.budget}): {t_flat:.3f} s")
    print(f"speedup: {t_flat / t_tree:.2f}x (FLOP-ideal {ideal_speedup(flop_model(model), tree, flat):.2f}x)")
    print(f"max |logit diff| tree vs flat: {logit_diff:.2e}")
    print(f"loss relative diff tree vs flat: {abs(loss_tree - loss_flat) / abs(loss_flat):.2e}")
    print(f"max gradient relative diff tree vs flat: {grad_err:.2e}")


if __name__ == "__main__":
    main()
