"""gemma3_text with ``final_logit_softcapping``: the stock forward caps the head's logits,
``c * tanh(logits / c)``, and every reader of harts' head must do the same, before any sampling
temperature (``model(...).logits / T``, as TRL and verl divide the stock logits).

- The chunked head alone (plain-weight and module paths, with and without a temperature) against
  the stock capped head on the stock model's own hidden states.
- The model over forests: logits and log-probs of ``harts.forward`` and the gradients of a
  functional of the logits (the equivalence suite's check); the SFT sum through ``rollout_step``
  cut into micro-batches; log-probs, entropies and gradients of a loss of both at a temperature
  through ``forest_backward`` with and without a budget; the forward-only readers
  (``forest_logprobs`` under a budget, ``batch_logprobs``). All against the stock forward of each
  trajectory alone, in fp64.

Tolerances are the suite's (``LOGIT_ATOL``, ``GRAD_RTOL``): ``c * tanh(x / c)`` is 1-Lipschitz, so
an error in the head's output does not grow through the cap, and its derivative ``1 - tanh^2``
lies in (0, 1], so neither do gradient errors. The cap is live: at ``SOFTCAP`` the capped logits
differ from the uncapped ones by far more than the tolerance (asserted on each forest), so a
reader that skipped the cap would fail.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.adapters.base import supported_families
from harts.integrations import batch_logprobs
from harts.ops.logprobs import head_token_logprobs, softcap_logits, token_logprobs
from harts.runtime.backward import next_token_rows
from harts.tiny import tiny_model
from tests.helpers import EDGE_SHAPES
from tests.reference import (
    GRAD_RTOL,
    LOGIT_ATOL,
    gradient_failures,
    param_grads,
    row_loss_cancellation,
    stock_logits,
    stock_row_loss_grads,
)
from tests.test_equivalence import check_forest, check_step

pytestmark = pytest.mark.skipif("gemma3_text" not in supported_families(),
                                reason="transformers lacks gemma3_text")  # fmt: skip

# The tiny gemma3's logits reach ~2.3 in size: at a cap of 2, tanh is far from linear (the capped
# logits differ from the plain ones by up to ~0.6, thousands of times the tolerance).
SOFTCAP = 2.0


def capped_model():
    """The tiny gemma3 (seed 7, as the equivalence suite's) with the cap set."""
    return tiny_model("gemma3_text", seed=7, final_logit_softcapping=SOFTCAP)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("path", ["weight", "module"])
def test_gemma3_softcapped_head_equals_stock(path, temperature):
    """The chunked head with ``softcap`` (chunks of 3 predictors; the plain head's weight, or the
    head called as a module) on the stock model's final hidden states: log-probs and entropies
    within ``LOGIT_ATOL`` of the stock capped logits' (``model(...).logits / T``), and the gradients
    of a loss of both (hidden states, head weight) within ``GRAD_RTOL`` of fp64 autograd through the
    stock ops. The cap is live: the capped logits are far from the plain head's."""
    model = capped_model()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42, 90]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        stock = model(input_ids=ids).logits[0]
        plain = model.lm_head(hidden[None])[0]
    assert torch.equal(softcap_logits(plain, SOFTCAP), stock)  # the stock forward's order of ops
    assert (stock - plain).abs().max() > 1000 * LOGIT_ATOL
    predictor = torch.tensor([0, 1, 2, 2, 5, 7, 9, 12, 12, 12])
    target = torch.tensor([4, 5, 6, 9, 1, 100, 11, 90, 3, 90])
    weights = torch.randn(2, predictor.numel(), generator=torch.Generator().manual_seed(3))

    def loss_of(logprob, entropy):
        return (logprob * weights[0].to(logprob.dtype)).sum() + (entropy * weights[1].to(entropy.dtype)).sum()

    h = hidden.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    if path == "weight":
        weight = model.lm_head.weight.detach().clone().requires_grad_()
        logprob, entropy = token_logprobs(h, weight, predictor, target, chunk_rows=3, temperature=temperature,
                                          softcap=SOFTCAP)  # fmt: skip
    else:
        weight = model.lm_head.weight
        logprob, entropy = head_token_logprobs(h, model.lm_head, predictor, target, chunk_rows=3,
                                               temperature=temperature, softcap=SOFTCAP)  # fmt: skip
    loss_of(logprob, entropy).backward()

    ref_logp = torch.log_softmax(stock / temperature, -1)
    assert (logprob.detach() - ref_logp[predictor, target]).abs().max() <= LOGIT_ATOL
    ref_entropy = -(ref_logp.exp() * ref_logp).sum(-1)[predictor]
    assert (entropy.detach() - ref_entropy).abs().max() <= LOGIT_ATOL

    h64 = hidden.double().requires_grad_()
    w64 = model.lm_head.weight.detach().double().requires_grad_()
    logits64 = h64 @ w64.t()
    logits64 = torch.tanh(logits64 / SOFTCAP) * SOFTCAP / temperature
    logp64 = torch.log_softmax(logits64, -1)
    loss_of(logp64[predictor, target], -(logp64.exp() * logp64).sum(-1)[predictor]).backward()
    for got, exact in ((h.grad, h64.grad), (weight.grad, w64.grad)):
        err = (got.double() - exact).norm() / exact.norm()
        assert err <= GRAD_RTOL, f"relative gradient error {err:.2e}"




FORESTS = ("star-P20-G4", "stacked-branches", "duplicates", "long-branch-T130")


def assert_cap_is_live(model, trajectories):
    """The stock capped logits are far from the same weights' uncapped logits on this forest."""
    model.config.final_logit_softcapping = None
    try:
        with torch.no_grad():
            plain = [stock_logits(model, t) for t in trajectories]
    finally:
        model.config.final_logit_softcapping = SOFTCAP
    with torch.no_grad():
        capped = [stock_logits(model, t) for t in trajectories]
    gap = max((c - p).abs().max().item() for c, p in zip(capped, plain, strict=True))
    assert gap > 1000 * LOGIT_ATOL, f"the cap bends the logits by only {gap:.2e}"


@pytest.mark.parametrize("shape", FORESTS)
def test_capped_gemma3_forest_equals_stock(shape):
    """Logits, log-probs and functional gradients of ``harts.forward``; the SFT sum and its
    gradients through ``rollout_step`` in micro-batches of 7 tokens."""
    model, trajectories = capped_model(), EDGE_SHAPES[shape]
    assert_cap_is_live(model, trajectories)
    check_forest(model, trajectories)
    check_step(model, trajectories, budget=7)


class RowLoss:
    """Random weights on every row's log-prob and entropy: gradients reach the head through both."""

    separable_rows = True

    def __init__(self, num_rows, rows=None):
        self.w = torch.randn(2, num_rows, generator=torch.Generator().manual_seed(5))
        self.rows = torch.arange(num_rows) if rows is None else rows

    def __call__(self, logprob, entropy):
        w = self.w[:, self.rows].to(logprob.dtype)
        return (logprob * w[0]).sum() + (entropy * w[1]).sum()

    def subset(self, rows):
        out = RowLoss.__new__(RowLoss)
        out.w, out.rows = self.w, self.rows[rows.cpu()]
        return out


TEMPERATURE = 0.7


@pytest.mark.parametrize("budget", [None, 5])
def test_capped_gemma3_rows_and_gradients_at_a_temperature(budget):
    """``forest_backward`` at T = 0.7: row log-probs and entropies within ``LOGIT_ATOL`` of the
    stock ``log_softmax(capped logits / T)`` of each trajectory alone, gradients within
    ``GRAD_RTOL`` of the fp64 truth (or of the magnitudes of a cancelling sum's per-token terms, or
    twice stock fp32's own error, :func:`gradient_failures`)."""
    model, trajectories = capped_model(), EDGE_SHAPES["stacked-branches"] + EDGE_SHAPES["unrelated-roots"]
    forest = harts.build_forest(trajectories)
    predictor, target = next_token_rows(forest)
    loss = RowLoss(predictor.numel())
    exact_logp, exact_ent, exact = stock_row_loss_grads(model, trajectories, loss, temperature=TEMPERATURE)
    _, _, stock32 = stock_row_loss_grads(model, trajectories, loss, exact=False, temperature=TEMPERATURE)
    model.zero_grad(set_to_none=True)
    result = harts.forest_backward(model, forest, predictor, target, loss, budget_tokens=budget,
                                   temperature=TEMPERATURE)  # fmt: skip
    if budget is not None:
        assert result.num_micro_batches > 2 and result.num_cuts >= 1
    assert (result.logprob.double() - exact_logp).abs().max() <= LOGIT_ATOL
    assert (result.entropy.double() - exact_ent).abs().max() <= LOGIT_ATOL
    cancellation = row_loss_cancellation(model, trajectories, loss, temperature=TEMPERATURE)
    assert not gradient_failures(param_grads(model), exact, stock32, cancellation)


def test_capped_gemma3_forward_only_readers():
    """``forest_logprobs`` cut into micro-batches, ``out.logprobs`` and the padded ``batch_logprobs``
    at T = 0.7: the stock capped rows of each trajectory alone, entropies included."""
    model, trajectories = capped_model(), EDGE_SHAPES["star-P20-G4"]
    forest = harts.build_forest(trajectories)
    predictor, target = next_token_rows(forest)
    exact_logp, exact_ent, _ = stock_row_loss_grads(model, trajectories, lambda lp, en: lp.sum(),
                                                    temperature=TEMPERATURE)  # fmt: skip
    with torch.no_grad():
        budgeted = harts.forest_logprobs(model, trajectories, budget_tokens=9, temperature=TEMPERATURE,
                                         entropies=True)  # fmt: skip
        assert budgeted.num_micro_batches > 2
        whole = harts.forward(model, forest).logprobs(predictor, target, temperature=TEMPERATURE)
        width = max(map(len, trajectories))
        ids = torch.zeros(len(trajectories), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(trajectories):  # left padding, as generation leaves it
            ids[i, width - len(t) :], mask[i, width - len(t) :] = torch.tensor(t), 1
        batch = batch_logprobs(model, ids, mask, temperature=TEMPERATURE)
    lengths = [len(t) - 1 for t in trajectories]
    budget_rows = [torch.cat([lp[1:] for lp in values]) for values in (budgeted.logprobs, budgeted.entropies)]
    batch_rows = [torch.cat([row[width - n :] for row, n in zip(values, lengths, strict=True)])
                  for values in (batch.logprobs, batch.entropies)]  # fmt: skip
    for logp, ent in (budget_rows, whole, batch_rows):
        assert logp.shape == exact_logp.shape == ent.shape
        assert (logp.double() - exact_logp).abs().max() <= LOGIT_ATOL
        assert (ent.double() - exact_ent).abs().max() <= LOGIT_ATOL
