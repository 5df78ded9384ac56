"""Tree forward/backward equals the stock forward of every trajectory alone, for every family.

For each forest: max |logit diff| <= 1e-4 for every trajectory, next-token log-probs match, and
the parameter gradients of a random linear functional of all logits match the sum of the
per-trajectory gradients with relative error <= 1e-4 (fp32). Through the one training step
(``harts.rollout_step``), cut into micro-batches of a few tokens: the SFT loss and its gradients
match the stock per-trajectory ones to the same bounds. A parameter whose gradient fp32 cannot
reach within 1e-4 of the fp64 truth (Qwen4-Exp's n-gram gate, ``sqrt(|g|)`` near zero) is held to
twice the error of the stock fp32 training it replaces (``tests.reference.assert_gradients``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import harts
from harts.tiny import FAMILIES
from tests.helpers import EDGE_SHAPES
from tests.reference import (
    LOGIT_ATOL,
    assert_gradients,
    cached_model,
    functional_weights,
    param_grads,
    reference_grads,
    reference_sft_grads,
    stock_fp32_grads,
    stock_logits,
)

VOCAB = 128


def model_of(family: str):
    return cached_model(family, seed=7)




def check_forest(model, trajectories, run: harts.RunConfig | None = None) -> tuple[float, float]:
    """Compare tree and per-trajectory logits, log-probs and gradients; return the worst errors."""
    weights = functional_weights(trajectories, model.config.get_text_config().vocab_size)
    ref_logits, ref_grads = reference_grads(model, trajectories, weights)

    with torch.no_grad():  # the literal fp32 stock forward, kernels and all
        stock32 = [stock_logits(model, t) for t in trajectories]
    model.zero_grad(set_to_none=True)
    forest = harts.build_forest(trajectories)
    out = harts.forward(model, forest, run)
    loss = 0.0
    worst_logit = 0.0
    for i, w in enumerate(weights):
        logits = out.trajectory_logits(i)
        assert logits.shape == ref_logits[i].shape
        worst_logit = max(
            worst_logit,
            (logits.detach() - ref_logits[i]).abs().max().item(),
            (logits.detach() - stock32[i]).abs().max().item(),
        )
        loss = loss + (logits * w).sum()
    loss.backward()
    assert worst_logit <= LOGIT_ATOL, f"max |logit diff| {worst_logit:.3g} > {LOGIT_ATOL}"
    # GRAD_RTOL, or twice stock fp32's own error where a parameter's gradient is ill-conditioned
    worst_grad = assert_gradients(param_grads(model), ref_grads, lambda: stock_fp32_grads(
        model, trajectories, lambda i, logits: (logits * weights[i]).sum()))

    with torch.no_grad():
        for i, t in enumerate(trajectories):
            ref_lp = torch.log_softmax(ref_logits[i][:-1].float(), -1).gather(
                1, torch.tensor(t[1:])[:, None]
            )[:, 0]
            assert torch.allclose(out.trajectory_logprobs(i), ref_lp, atol=LOGIT_ATOL, rtol=0)
    return worst_logit, worst_grad


@pytest.mark.parametrize("shape", list(EDGE_SHAPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_edge_shapes(family, shape):
    check_forest(model_of(family), EDGE_SHAPES[shape])


SUM = harts.Normalizers(torch.tensor(1.0), torch.tensor(1.0))  # token mean over 1: the plain sum


def check_step(model, trajectories, budget: int | None, run: harts.RunConfig | None = None) -> None:
    """The SFT sum through the one step under ``budget`` against the stock fp64 per-trajectory sum."""
    ref_loss, ref_grads = reference_sft_grads(model, trajectories)
    model.zero_grad(set_to_none=True)
    rollouts = [harts.Rollout(t) for t in trajectories]
    result = harts.rollout_step(model, rollouts, harts.PolicyLossConfig(kind="sft"), normalizers=SUM,
                                budget_tokens=budget, run=run)  # fmt: skip
    if budget is not None:
        assert max(result.tokens_per_micro_batch) <= budget
    assert abs(float(result.loss) - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
    assert_gradients(param_grads(model), ref_grads, lambda: stock_fp32_grads(
        model, trajectories, lambda i, logits: _sft(i, logits, trajectories)))


def _sft(i: int, logits: torch.Tensor, trajectories) -> torch.Tensor:
    """Minus the next-token log-probs of trajectory ``i`` from its ``logits``."""
    ids = torch.as_tensor(list(trajectories[i]), dtype=torch.long)
    return -torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None]).sum()


@pytest.mark.parametrize("shape", list(EDGE_SHAPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_edge_shapes_through_the_budgeted_step(family, shape):
    check_step(model_of(family), EDGE_SHAPES[shape], budget=7)


def test_reference_is_sensitive():
    """The comparison can fail: a one-token change in one trajectory breaks it."""
    model = model_of("bailing_hybrid")
    trajs = EDGE_SHAPES["star-P20-G4"]
    forest = harts.build_forest(trajs)
    with torch.no_grad():
        out = harts.forward(model, forest)
        other = list(trajs[1])
        other[3] = (other[3] + 1) % VOCAB
        ref = model(input_ids=torch.tensor([other])).logits[0]
        assert (out.trajectory_logits(1) - ref).abs().max() > 1e-2


@st.composite
def random_forests(draw):
    """Trajectories drawn as random walks down a random trie, so prefixes collide often."""
    n = draw(st.integers(1, 6))
    alphabet = st.integers(3, 8)  # a small alphabet makes shared prefixes and duplicates likely
    base = draw(st.lists(alphabet, min_size=1, max_size=24))
    trajs = []
    for _ in range(n):
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(alphabet, min_size=0 if cut else 1, max_size=12))
        trajs.append(base[:cut] + tail)
    return trajs


#: one family per linear kernel: Gated DeltaNet (a gate per head), KDA (per key channel), lightning
#: attention (gated linear attention, a fixed gate per head), Mamba-2 (gated linear attention)
PACKED_FAMILIES = [f for f in ("qwen3_next", "kimi_linear", "minimax", "nemotron_h") if f in FAMILIES]
PACKED_SHAPES = ["stacked-branches", "short-parents", "chunk-edges-63-64-65", "unrelated-roots"]


@pytest.mark.parametrize("shape", PACKED_SHAPES)
@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_packed_linear_plan(family, shape):
    """Linear layers over packed chunks (chunks spanning nodes): the same bounds, whole forest and
    through the budgeted step (node states handed to later micro-batches)."""
    run = harts.RunConfig(linear_plan="packed")
    check_forest(model_of(family), EDGE_SHAPES[shape], run)
    check_step(model_of(family), EDGE_SHAPES[shape], budget=7, run=run)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories=random_forests())
def test_random_forests(family, trajectories):
    check_forest(model_of(family), trajectories)
