"""The gradient bounds of ``tests/reference.py`` themselves: the cancellation factor of a sum of
per-token terms is the one written out by hand, a module that mixes tokens gets none, and a
parameter's bound widens by exactly that factor."""

from __future__ import annotations

import pytest
import torch

from harts.adapters.base import supported_families
from tests.reference import (
    GRAD_RTOL,
    cached_model,
    exact_linear_kernels,
    fp64_copy,
    gradient_failures,
    stock_logits,
    token_cancellation,
)


class _Scale(torch.nn.Module):
    """out_t = a * x_t per token (a [D]); ``mix`` adds the previous token (x_t + x_{t-1})."""

    def __init__(self, dim: int, mix: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim, dtype=torch.float64))
        self.mix = mix

    def forward(self, x):
        if self.mix:
            x = x + torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
        return self.a * x


class _Net(torch.nn.Module):
    def __init__(self, mix: bool):
        super().__init__()
        self.scale = _Scale(3, mix)


def _loss_of(x, w):
    return lambda net: (net.scale(x) * w).sum()


def test_cancellation_factor_is_the_sum_of_term_magnitudes_over_the_gradient():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 3, generator=gen, dtype=torch.float64)
    w = torch.randn(2, 7, 3, generator=gen, dtype=torch.float64)
    kappa = token_cancellation(_Net(mix=False), _loss_of(x, w), ["scale.a"])
    terms = (w * x).flatten(0, 1)  # d/da of token t's output against its weight: w_t x_t
    expected = terms.abs().sum(0).norm() / terms.sum(0).norm()
    assert kappa["scale.a"] == pytest.approx(float(expected), rel=1e-12)
    assert kappa["scale.a"] > 1.0


def test_a_module_that_mixes_tokens_gets_no_factor():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 3, generator=gen, dtype=torch.float64)
    w = torch.randn(1, 6, 3, generator=gen, dtype=torch.float64)
    assert token_cancellation(_Net(mix=True), _loss_of(x, w), ["scale.a"]) == {}


def test_the_bound_widens_by_the_factor_and_only_for_parameters_that_miss():
    exact = {"p": torch.ones(4, dtype=torch.float64), "q": torch.ones(4, dtype=torch.float64)}
    got = {"p": exact["p"] * (1 + 5 * GRAD_RTOL), "q": exact["q"] * (1 + 0.5 * GRAD_RTOL)}
    asked = []

    def cancellation(names):
        asked.extend(names)
        return {"p": 4.0}

    assert set(gradient_failures(got, exact)) == {"p"}
    assert set(gradient_failures(got, exact, cancellation=lambda names: {"p": 6.0})) == set()
    assert set(gradient_failures(got, exact, cancellation=cancellation)) == {"p"}
    assert asked == ["p"]


@pytest.mark.skipif("bailing_hybrid" not in supported_families(), reason="transformers lacks bailing_hybrid")
def test_a_real_gate_decomposes_and_its_convolution_does_not():
    """bailing_hybrid's KDA forget gate acts token by token, its short convolution does not."""
    model = cached_model("bailing_hybrid")
    model64 = fp64_copy(model, cache=False)
    tokens = list(range(3, 15))

    def loss(m):
        with exact_linear_kernels(m):
            return stock_logits(m, tokens).pow(2).mean()

    gate, conv = "model.layers.0.self_attn.forget_gate", "model.layers.0.self_attn.conv1d.weight"
    kappa = token_cancellation(model64, loss, [f"{gate}.A_log", f"{gate}.dt_bias", conv])
    assert set(kappa) == {f"{gate}.A_log", f"{gate}.dt_bias"}
    assert min(kappa.values()) >= 1.0
