"""GAE (``harts.gae_advantages``, estimator ``"gae"``) against a plain per-trajectory loop.

The reference is verl's ``compute_gae_advantage_return`` written out per trajectory over every
position with the loss mask (masked positions, e.g. tool outputs between turns, carry the next
value and advantage through unchanged), then whitened over all masked positions with the unbiased
variance. harts sweeps only the rows. Both compute in fp64 with the same operations per step;
only the whitening's mean and variance sum in another order, so they agree to a few ulps of the
sums: 1e-12 on values of order 1.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.objectives import advantages_to_rollouts, build_loss_rows

TRAJECTORIES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 8, 9], [1, 2, 10, 11, 12, 13, 14, 15], [1, 16], [17]]
GAMMA, LAM = 0.9, 0.8


def make_rollouts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, t in enumerate(TRAJECTORIES):
        mask = (torch.rand(len(t), generator=gen) < 0.7).long()
        mask[0] = 0
        values = torch.randn(len(t), generator=gen, dtype=torch.float64)
        out.append(harts.Rollout(t, loss_mask=mask, values=values, reward=float(i) - 1.5))
    return out


def reference(rollouts, token_rewards):
    """verl's loop per trajectory over all positions, masked positions carried; then whitening."""
    advantages, returns, masks = [], [], []
    for r, rewards in zip(rollouts, token_rewards, strict=True):
        mask = torch.as_tensor(r.loss_mask).double()
        values = torch.as_tensor(r.values).double()
        next_value = last = 0.0
        adv = torch.zeros(len(mask), dtype=torch.float64)
        for t in reversed(range(len(mask))):
            delta = rewards[t] + GAMMA * next_value - values[t]
            new = delta + GAMMA * LAM * last
            next_value = values[t] * mask[t] + (1 - mask[t]) * next_value
            last = new * mask[t] + (1 - mask[t]) * last
            adv[t] = last
        advantages.append(adv)
        returns.append(adv + values)
        masks.append(mask.bool())
    flat = torch.cat([a[m] for a, m in zip(advantages, masks, strict=True)])
    mean, var = flat.mean(), flat.var(unbiased=True)
    white = [(a - mean) * torch.rsqrt(var + 1e-8) for a in advantages]
    return (torch.cat([a[m] for a, m in zip(white, masks, strict=True)]),
            torch.cat([a[m] for a, m in zip(returns, masks, strict=True)]))  # fmt: skip


def rows_of(rollouts):
    forest = harts.build_forest([r.tokens for r in rollouts])
    return forest, build_loss_rows(forest, rollouts, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_equals_per_trajectory_loop(seed):
    rollouts = make_rollouts(seed)
    forest, rows = rows_of(rollouts)
    # outcome rewards: each trajectory's reward on its last loss-bearing token (verl's placement)
    token_rewards = []
    for r in rollouts:
        per = torch.zeros(len(r.tokens), dtype=torch.float64)
        pos = torch.nonzero(torch.as_tensor(r.loss_mask))[:, 0]
        if pos.numel():
            per[pos[-1]] = r.reward
        token_rewards.append(per)
    adv_ref, ret_ref = reference(rollouts, token_rewards)
    adv, ret = harts.gae_advantages(rows, gamma=GAMMA, lam=LAM)
    torch.testing.assert_close(adv, adv_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(ret, ret_ref, atol=1e-12, rtol=0)
    # the registry gives the same advantages; per-token rewards given explicitly give the same too
    est = harts.estimate_advantages(rows, "gae", forest, gamma=GAMMA, lam=LAM)
    torch.testing.assert_close(est.advantage, adv, atol=0, rtol=0)
    dense = torch.cat(
        [t[torch.as_tensor(r.loss_mask).bool()] for r, t in zip(rollouts, token_rewards, strict=True)]
    )
    torch.testing.assert_close(harts.gae_advantages(rows, gamma=GAMMA, lam=LAM, token_rewards=dense)[0], adv,
                               atol=0, rtol=0)  # fmt: skip
    # dense per-token rewards (a process reward on every token), unwhitened
    gen = torch.Generator().manual_seed(seed + 10)
    per_token = [torch.randn(len(r.tokens), generator=gen, dtype=torch.float64) for r in rollouts]
    dense = torch.cat(
        [t[torch.as_tensor(r.loss_mask).bool()] for r, t in zip(rollouts, per_token, strict=True)]
    )
    adv_ref, ret_ref = reference(rollouts, per_token)
    _, ret = harts.gae_advantages(rows, gamma=GAMMA, lam=LAM, token_rewards=dense, whiten=False)
    torch.testing.assert_close(ret, ret_ref, atol=1e-12, rtol=0)


def test_gae_returns_to_rollouts_and_refusals():
    rollouts = make_rollouts()
    _, rows = rows_of(rollouts)
    adv, ret = harts.gae_advantages(rows, gamma=GAMMA, lam=LAM)
    written = advantages_to_rollouts(rollouts, rows, adv, returns=ret)
    again = build_loss_rows(harts.build_forest([r.tokens for r in written]), written, dtype=torch.float64)
    torch.testing.assert_close(again.value_target, ret, atol=0, rtol=0)
    no_values = [harts.Rollout(r.tokens, loss_mask=r.loss_mask, reward=r.reward) for r in rollouts]
    with pytest.raises(ValueError, match="rollout-time values"):
        harts.gae_advantages(rows_of(no_values)[1])
    bad = torch.zeros(rows.num_rows, dtype=torch.float64)
    bad[3] = float("inf")
    with pytest.raises(
        ValueError, match=f"trajectory {int(rows.trajectory[3])}, position {int(rows.position[3])}"
    ):
        harts.gae_advantages(rows, token_rewards=bad)
    with pytest.raises(ValueError, match="gamma"):
        harts.gae_advantages(rows, gamma=1.5)
