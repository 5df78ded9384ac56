"""``make demo``: training steps on a rollout forest in tree layout against the flat layout.

A randomly initialised model with the Ling 3 architecture (KDA linear layers, an MLA full
layer with interleaved RoPE and output gate, MoE with a shared expert) and a synthetic agentic
rollout set (a long shared system prompt, several turns, branches where earlier-turn thinking is
dropped). The flat layout is the same :func:`harts.rollout_step` with ``share_prefixes=False``
(same code and kernels, each trajectory its own root, whole trajectories packed into
micro-batches and never cut), the way a flat trainer runs.

It prints, in order:

1. exactness of one step: the loss and every parameter's gradient in tree layout against the
   flat layout (relative errors; the tolerance is 1e-4, docs/architecture.md), and the logits;
2. speed: one step (forward and backward) timed ``--repeats`` times after a warm-up, the layouts
   interleaved, the median of each. The flat layout is timed at the tree's budget, without a
   budget and at 1024 and 4096 tokens (the distinct ones), and the fastest is the baseline, as
   ``harts bench`` does: one flat micro-batch per budget is not the strongest flat trainer;
3. the tensor peak of one step in each layout (the flat one at its fastest budget), the tree's
   with its default, which keeps the graphs of parts that later parts read (up to twice the
   budget in all), and with ``hold_tokens=0``, which runs those parts forward again instead;
4. ``--steps`` AdamW steps from the same seed in both layouts, losses side by side. They agree
   to fp32 rounding; the weights are not compared, because AdamW moves an element whose gradient
   sits at rounding level by a rounding-dependent fraction of lr whatever its size, so the
   first step's gradients (1.) are what shows exactness.

Usage: ``python -m harts.demo [--steps 3] [--repeats 3] [--budget 2048] [--system-len 1000] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

import harts
from harts.bench.cases import flat_budget_variants, flat_run
from harts.bench.memory import tensor_peak_bytes
from harts.data.synthetic import agentic
from harts.runtime.flops import flop_model, ideal_speedup
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


FLAT_BUDGETS = (1024, 4096, 8192)  # besides the tree's budget
SFT = harts.PolicyLossConfig(kind="sft")  # token-mean cross entropy over every next token


def step_fn(model, rollouts, share_prefixes: bool, budget: int | None):
    """One SFT step (forward and backward) of the rollouts in one layout, as a callable."""
    return lambda: harts.rollout_step(model, rollouts, SFT, budget_tokens=budget,
                                      share_prefixes=share_prefixes)  # fmt: skip


def train(model, rollouts, share_prefixes: bool, budget: int | None, steps: int, seed: int) -> list[float]:
    """``steps`` SFT optimizer steps from the model's current weights (restored after); the losses."""
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step, losses = step_fn(model, rollouts, share_prefixes, budget), []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(step().loss))
        optimizer.step()
    model.load_state_dict(initial)
    return losses


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


def gradients(model, step) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = float(step().loss)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads


@contextlib.contextmanager
def native_stderr_to_devnull():
    """Send file descriptor 2 to /dev/null: the profiler's C++ code writes lines about its own
    bookkeeping there (kineto's start and stop, CPUAllocator's note that a block allocated before
    profiling began was freed), which would land in the middle of the report. Python errors are
    raised, and printed, after it is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_mib(model, step) -> float:
    """Tensor peak of one step (forward and backward), in MiB."""
    with native_stderr_to_devnull():
        return tensor_peak_bytes(step, lambda: model.zero_grad(set_to_none=True)) / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-len", type=int, default=1000, help="shared system prompt tokens")
    parser.add_argument("--budget", type=int, default=2048, help="unique tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per layout")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout and budget")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # each line as it is printed, also into a pipe

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
    print(f"redundancy (flat / unique tokens): {tree.redundancy:.2f}; "
          f"tree budget {args.budget} unique tokens")  # fmt: skip
    rollouts = [harts.Rollout(t) for t in trajectories]

    # One micro-batch of the whole flat forest (37k tokens here) is far slower and larger than any
    # of these, so it is not a candidate; a budget that holds the whole forest runs it as one.
    flat_variants = {
        name: flat_run(harts.RunConfig(budget_tokens=b), flat).budget_tokens
        for name, b in flat_budget_variants(args.budget, FLAT_BUDGETS, flat).items() if name != "flat_whole"
    }
    fns = {"tree": step_fn(model, rollouts, True, args.budget)}
    fns.update({name: step_fn(model, rollouts, False, b) for name, b in flat_variants.items()})

    # 1. exactness of one step, tree against flat (the flat layout is the per-trajectory computation)
    loss_t, grads_t = gradients(model, fns["tree"])
    loss_f, grads_f = gradients(model, fns["flat"])
    grad_err = max(float((grads_t[n] - g).norm() / g.norm()) for n, g in grads_f.items() if g.norm() > 0)
    with torch.no_grad():
        out_t, out_f = harts.forward(model, tree), harts.forward(model, flat)
        logit_diff = max(
            (out_t.trajectory_logits(i) - out_f.trajectory_logits(i)).abs().max().item()
            for i in range(tree.num_trajectories)
        )
    print(f"one step, tree vs flat: loss relative diff {abs(loss_t - loss_f) / abs(loss_f):.1e}, "
          f"largest gradient relative error over {len(grads_f)} parameters {grad_err:.1e} (bound 1e-4), "
          f"max |logit diff| {logit_diff:.1e}")  # fmt: skip

    # 2. speed, against flat at its fastest budget
    median, raced = time_steps(model, fns, flat_variants, args.repeats)
    best = min(raced & set(flat_variants), key=median.get)
    print("layout   budget   median s per step (forward and backward)")
    for name, seconds in median.items():
        layout, budget = ("tree", args.budget) if name == "tree" else ("flat", flat_variants[name])
        mark = "   <- fastest flat" if name == best else ""
        mark = mark if name in raced else "   (warm-up step only: too slow to be the fastest)"
        print(f"{layout:<8} {budget or 'none':>6}   {seconds:.2f}{mark}")
    ideal = ideal_speedup(flop_model(model), tree, flat)
    print(f"speedup against flat at its fastest budget: {median[best] / median['tree']:.2f}x "
          f"(FLOP-ideal {ideal:.2f}x)")  # fmt: skip

    # 3. memory: the tree's default keeps the shared prefix's graph for the parts that read it,
    # so its step peaks above one part; hold_tokens=0 runs that part forward again instead
    no_hold = harts.RunConfig(budget_tokens=args.budget, hold_tokens=0)

    def tree_no_hold():
        return harts.rollout_step(model, rollouts, SFT, run=no_hold)

    steps = {"tree": fns["tree"], "tree_no_hold": tree_no_hold, best: fns[best]}
    peaks = {name: peak_mib(model, step) for name, step in steps.items()}
    print(f"tensor peak of one step: tree {peaks['tree']:.1f} MiB (default: keeps the graphs later parts "
          f"read), {peaks['tree_no_hold']:.1f} MiB with RunConfig(hold_tokens=0) (runs those parts forward "
          f"again); flat {peaks[best]:.1f} MiB")  # fmt: skip

    # 4. training steps from the same seed
    tree_loss = train(model, rollouts, True, args.budget, args.steps, args.seed)
    flat_loss = train(model, rollouts, False, flat_variants[best], args.steps, args.seed)
    print("step   loss tree      loss flat")
    for n, (lt, lf) in enumerate(zip(tree_loss, flat_loss, strict=True), start=1):
        print(f"{n:>4}   {lt:<13.7f}  {lf:<13.7f}")
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(tree_loss, flat_loss, strict=True))
    print(f"max loss relative diff over {args.steps} AdamW steps: {loss_diff:.1e} (AdamW divides each "
          "element's update by its gradient's size, so rounding of near-zero gradients grows step by "
          "step; the one-step gradients above are the exact comparison)")  # fmt: skip


if __name__ == "__main__":
    main()
