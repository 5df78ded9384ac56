"""The step the demo runs in every part, and its optimizer steps in both layouts.

The step is SFT (token-mean cross entropy over every next token) through :func:`harts.rollout_step`;
the flat layout is the same call with ``share_prefixes=False`` (each trajectory its own root, whole
trajectories packed into micro-batches and never cut), the way a flat trainer runs.
"""

from __future__ import annotations

import torch

import harts

SFT = harts.PolicyLossConfig(kind="sft")  # token-mean cross entropy over every next token


def step_fn(model, rollouts, share_prefixes: bool, budget: int | None):
    """One SFT step (forward and backward) of the rollouts in one layout, as a callable."""
    return lambda: harts.rollout_step(
        model, rollouts, SFT, budget_tokens=budget, share_prefixes=share_prefixes
    )


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


def report_training(
    model, rollouts, tree_budget: int, flat_budget: int | None, steps: int, seed: int
) -> None:
    """``steps`` AdamW steps from the same seed in both layouts, the losses side by side. They agree
    to fp32 rounding; the weights are not compared, because AdamW moves an element whose gradient
    sits at rounding level by a rounding-dependent fraction of lr whatever its size, so the first
    step's gradients (the exactness part) are what shows exactness."""
    tree_loss = train(model, rollouts, True, tree_budget, steps, seed)
    flat_loss = train(model, rollouts, False, flat_budget, steps, seed)
    print("step   loss tree      loss flat")
    for n, (lt, lf) in enumerate(zip(tree_loss, flat_loss, strict=True), start=1):
        print(f"{n:>4}   {lt:<13.7f}  {lf:<13.7f}")
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(tree_loss, flat_loss, strict=True))
    print(
        f"max loss relative diff over {steps} AdamW steps: {loss_diff:.1e} (AdamW divides each "
        "element's update by its gradient's size, so rounding of near-zero gradients grows step by "
        "step; the one-step gradients in 1. are the exact comparison)"
    )
