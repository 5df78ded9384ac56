"""Time fwd+bwd of the gated delta rule: harts' chunked op vs transformers' stock KDA chunk vs the naive loop.

Why: the stock ``chunk_kimi_delta_attention`` materialises a [B, H, N, C, C, K] decay tensor and a
per-row Python loop for the triangular inverse; harts replaces both (sub-block factors + one
``solve_triangular``). This script checks the speed claim at the design-note shape.

Run: ``python -m harts.bench.delta_rule_kernel [--T 4096] [--threads 2]``. Prints medians of 3.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from harts.ops.delta_rule import chunked_gated_delta_rule, naive_recurrent_gated_delta_rule

NAIVE_BUDGET_S = 30.0


def inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2.0)
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta, s0)]


def fwd_bwd(fn, xs):
    t0 = time.perf_counter()
    o, S = fn(*xs)
    (o.float().square().mean() + S.float().square().mean()).backward()
    for x in xs:
        x.grad = None
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--K", type=int, default=32)
    ap.add_argument("--V", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    xs = inputs(args.B, args.T, args.H, args.K, args.V)
    cands = {
        "harts chunked (fp32)": lambda q, k, v, g, b, s: chunked_gated_delta_rule(q, k, v, g, b, s),
        "transformers chunk_kimi_delta_attention": lambda q, k, v, g, b, s: chunk_kimi_delta_attention(
            q, k, v, g, b, initial_state=s, output_final_state=True
        ),
        "naive loop (fp64)": lambda q, k, v, g, b, s: naive_recurrent_gated_delta_rule(q, k, v, g, b, s),
    }
    shape = f"B{args.B}-T{args.T}-H{args.H}-K{args.K}-V{args.V}"
    print(f"fwd+bwd {shape}, threads={torch.get_num_threads()}, median of 3 (after one warm-up)")
    for name, fn in cands.items():
        if name.startswith("naive"):  # linear in T: probe an eighth before committing to full runs
            probe = [x.detach()[:, : max(1, args.T // 8)].requires_grad_(True) for x in xs[:5]]
            estimate = 8 * fwd_bwd(fn, probe + [xs[5]])
            if estimate > NAIVE_BUDGET_S:
                print(f"  {name:42s} skipped: estimated {estimate:.0f} s per run")
                continue
        fwd_bwd(fn, xs)  # warm-up
        times = [fwd_bwd(fn, xs) for _ in range(3)]
        print(f"  {name:42s} {statistics.median(times):8.3f} s")


if __name__ == "__main__":
    main()
