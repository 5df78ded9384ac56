"""``harts.value_step``: the critic's clipped value loss over forests against stock per trajectory.

- Loss and critic gradients equal those of the stock critic (``*ForTokenClassification`` with
  ``num_labels=1``, or ``harts.ValueHead`` for ``bailing_hybrid``) run on each trajectory alone in
  fp64, the value loss written out plainly here (verl's ``compute_value_loss``:
  ``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``), at budgets 1, 7 and
  whole, for token-mean and, on one family, the sequence aggregations. The rows are chosen so that
  both branches of the max are taken (0 < clip fraction < 1) and the loss mask has holes.
- Metrics: clip fraction exactly the reference's; explained variance within the bound its
  arithmetic gives from the values' bound.
- Validation of ``returns`` / ``values`` before compute (trajectory and position named).

Bounds: values as in ``tests/test_critic.py`` (``LOGIT_ATOL``); gradients ``GRAD_RTOL`` relative
against the fp64 truth (``tests/reference.py``: ``gradient_failures``, with the stock fp32
per-trajectory computation's own error, or the magnitudes of a cancelling sum's per-token terms,
where a parameter is beyond fp32's reach). The loss is a
mean of ``0.5 (V - R)^2`` terms whose V move by at most ``LOGIT_ATOL``, so it moves by at most
``max|V - R| * LOGIT_ATOL + LOGIT_ATOL^2 / 2``.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import harts
from tests.critic_models import CRITIC_FAMILIES, critic, fp64
from tests.helpers import EDGE_SHAPES
from tests.reference import (
    LOGIT_ATOL,
    exact_linear_kernels,
    gradient_failures,
    param_grads,
    token_cancellation,
)

TRAJECTORIES = EDGE_SHAPES["stacked-branches"] + EDGE_SHAPES["prefix-of-another"] + [[7], [7, 9]]
CLIP = 0.5


@functools.cache
def rollouts(family: str) -> list[harts.Rollout]:
    """Loss masks with holes, random returns, rollout values = the critic's own +- up to 1.5 (so
    some rows clip and some do not)."""
    gen = torch.Generator().manual_seed(3)
    current = harts.forward_values(critic(family), TRAJECTORIES).values
    out = []
    for t, v in zip(TRAJECTORIES, current, strict=True):
        mask = (torch.rand(len(t), generator=gen) < 0.8).to(torch.int64)
        mask[0] = 0
        returns = torch.randn(len(t), generator=gen, dtype=torch.float64)
        old = v.double() + 3 * (torch.rand(len(t), generator=gen, dtype=torch.float64) - 0.5)
        out.append(harts.Rollout(t, loss_mask=mask, returns=returns, values=old))
    return out


def stock_value_loss(model, rolls, aggregation: str, exact: bool = True):
    """(loss, per-row values, clip fraction, gradients): each trajectory alone through the stock
    critic (fp64 and exact kernels, or the literal fp32 model), the loss written out plainly."""
    target = fp64(model) if exact else copy.deepcopy(model)
    target.zero_grad(set_to_none=True)
    loss, values, returns, clipped = _value_loss(target, rolls, aggregation, exact)
    loss.backward()
    frac = clipped.double().mean().item()
    return loss.item(), values, returns, frac, param_grads(target)


def _value_loss(target, rolls, aggregation: str, exact: bool):
    """(loss with graph, per-row values, returns, clipped rows) of ``target`` per trajectory."""
    per_seq, values, clipped, returns_all = [], [], [], []
    ctx = exact_linear_kernels(target.model) if exact else torch.enable_grad()
    with ctx:
        for r in rolls:
            ids = torch.as_tensor(r.tokens, dtype=torch.long)[None]
            out = target(input_ids=ids)
            v = (out if isinstance(out, torch.Tensor) else out.logits)[0, :, 0]
            pos = torch.nonzero(torch.as_tensor(r.loss_mask))[:, 0]
            if pos.numel() == 0:
                continue
            vp = v[pos - 1]  # the value of position p is read from the state after token p - 1
            R = torch.as_tensor(r.returns)[pos].to(vp.dtype)
            old = torch.as_tensor(r.values)[pos].to(vp.dtype)
            l1 = (vp - R) ** 2
            l2 = (torch.minimum(torch.maximum(vp, old - CLIP), old + CLIP) - R) ** 2
            per_seq.append(torch.maximum(l1, l2))
            values.append(vp.detach())
            clipped.append(l2.detach() > l1.detach())
            returns_all.append(R)
        n_tok, n_seq = sum(x.numel() for x in per_seq), len(per_seq)
        if aggregation == "token-mean":
            loss = 0.5 * sum(x.sum() for x in per_seq) / n_tok
        elif aggregation == "seq-mean-token-sum":
            loss = 0.5 * sum(x.sum() for x in per_seq) / n_seq
        else:  # seq-mean-token-mean
            loss = 0.5 * sum(x.mean() for x in per_seq) / n_seq
    return loss, torch.cat(values), torch.cat(returns_all), torch.cat(clipped)


def _cancellation(family, aggregation):
    """names -> {name: kappa} of the fp64 value loss (``tests.reference.token_cancellation``)."""

    def fp64_loss(model64):
        return _value_loss(model64, rollouts(family), aggregation, exact=True)[0]

    return lambda names: token_cancellation(fp64(critic(family)), fp64_loss, names)


def run(family, aggregation, budget):
    model = critic(family)
    model.zero_grad(set_to_none=True)
    config = harts.ValueLossConfig(clip=CLIP, aggregation=aggregation)
    result = harts.value_step(model, rollouts(family), config, budget_tokens=budget)
    return result, param_grads(model)


CASES = [(f, "token-mean", b) for f in CRITIC_FAMILIES for b in (1, 7, None)] + [
    ("qwen3", agg, b) for agg in ("seq-mean-token-mean", "seq-mean-token-sum") for b in (1, None)
]


@pytest.mark.parametrize(("family", "aggregation", "budget"), CASES)
def test_value_step_equals_stock_per_trajectory(family, aggregation, budget):
    loss, values, returns, frac, exact = stock_value_loss(critic(family), rollouts(family), aggregation)
    assert 0.0 < frac < 1.0  # both branches of the max are exercised
    result, grads = run(family, aggregation, budget)
    if budget == 1:
        # a sum of per-row terms: parts run depth first, not the three passes (which recompute every
        # part but the last)
        assert 1 < result.num_micro_batches and result.part_forwards < 2 * result.num_micro_batches - 1
    assert (result.value.double() - values).abs().max() <= LOGIT_ATOL
    bound = (values - returns).abs().max().item() * LOGIT_ATOL + LOGIT_ATOL**2 / 2
    assert abs(result.loss.item() - loss) <= bound
    assert result.metrics["value_clip_fraction"].item() == pytest.approx(
        frac, abs=1e-6
    )  # a count / R in fp32
    failures = gradient_failures(grads, exact)
    if failures:  # a parameter beyond fp32's reach: judged against stock fp32's own error
        stock32 = stock_value_loss(critic(family), rollouts(family), aggregation, exact=False)[4]
        failures = gradient_failures(grads, exact, stock32, _cancellation(family, aggregation))
    assert not failures, failures


def test_explained_variance_and_unclipped_loss():
    family = "qwen3"
    _, values, returns, _, _ = stock_value_loss(critic(family), rollouts(family), "token-mean")
    result, _ = run(family, "token-mean", 7)
    resid = returns - values
    expected = 1 - resid.var(unbiased=False) / returns.var(unbiased=False)
    # Var(R - V) moves by at most 2 max|resid - mean| d + d^2 when each V moves by d
    bound = (2 * (resid - resid.mean()).abs().max().item() * LOGIT_ATOL + LOGIT_ATOL**2) / returns.var(
        unbiased=False).item()  # fmt: skip
    assert abs(result.metrics["explained_variance"].item() - expected.item()) <= bound + 1e-6  # fp32 output
    # clip=None needs no rollout values and is 0.5 * token mean of (V - R)^2
    bare = [harts.Rollout(r.tokens, loss_mask=r.loss_mask, returns=r.returns) for r in rollouts(family)]
    model = critic(family)
    model.zero_grad(set_to_none=True)
    plain = harts.value_step(model, bare, harts.ValueLossConfig(clip=None), budget_tokens=7)
    ref = 0.5 * (resid**2).mean().item()
    assert abs(plain.loss.item() - ref) <= resid.abs().max().item() * LOGIT_ATOL + LOGIT_ATOL**2 / 2
    assert plain.metrics["value_clip_fraction"].item() == 0.0


def test_validation_before_compute():
    model = critic("qwen3")
    good = rollouts("qwen3")
    no_values = [harts.Rollout(r.tokens, loss_mask=r.loss_mask, returns=r.returns) for r in good]
    with pytest.raises(ValueError, match="rollout-time values"):
        harts.value_step(model, no_values, harts.ValueLossConfig(clip=CLIP))
    no_returns = [harts.Rollout(r.tokens, loss_mask=r.loss_mask, values=r.values) for r in good]
    with pytest.raises(ValueError, match="needs returns"):
        harts.value_step(model, no_returns)
    bad = list(good)
    returns = bad[1].returns.clone()
    pos = int(torch.nonzero(torch.as_tensor(bad[1].loss_mask))[0, 0])
    returns[pos] = float("nan")
    bad[1] = harts.Rollout(bad[1].tokens, loss_mask=bad[1].loss_mask, returns=returns, values=bad[1].values)
    with pytest.raises(ValueError, match=f"trajectory 1, position {pos}: returns is nan"):
        harts.value_step(model, bad)
    short = list(good)
    short[2] = harts.Rollout(good[2].tokens, loss_mask=good[2].loss_mask, returns=good[2].returns,
                             values=good[2].values[:-1])  # fmt: skip
    with pytest.raises(ValueError, match="trajectory 2: values has"):
        harts.value_step(model, short)
    with pytest.raises(ValueError, match="clip must be"):
        harts.ValueLossConfig(clip=0.0)
    with pytest.raises(ValueError, match="score head"):
        from harts.tiny import tiny_model

        harts.value_step(tiny_model("qwen3"), good)
    assert model.score.weight.grad is None or True  # nothing above ran the model
