"""Critics and reward models on forests (``harts.forward_values``, ``harts.score``, ``harts.ValueHead``).

- Values: per family (full attention; Gated DeltaNet hybrid with MoE; KDA + MLA hybrid with MoE
  through ``harts.ValueHead``) and budget (one token per micro-batch, 7, the whole forest), every
  trajectory's values equal the stock model's head outputs of that trajectory alone in fp64,
  aligned as verl reads its critic: ``values[p] = V(h_{p-1})``, position 0 the fill.
- Scores: each trajectory's score equals stock ``*ForSequenceClassification`` on it alone, read
  where stock reads it (rightmost non-pad token), for trajectories ending in pad tokens, made of
  pad tokens only, and with no pad token configured.
- Refusals before compute: a head with several outputs, a causal LM given as a critic, a critic
  given to a log-prob pass, train-mode dropout, a family whose adapter folds a logit scale.

Bound: the head is ``nn.Linear`` over the final hidden states, the same kind of readout as the
logits (initialised at the same scale by the config's ``initializer_range``), so a value moves by
no more than a logit does: ``LOGIT_ATOL`` (1e-4) of ``tests/reference.py``.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.tiny import FAMILIES, tiny_config, tiny_model
from tests.critic_models import CRITIC_FAMILIES, REWARD_FAMILIES, critic, reward_model, stock_outputs
from tests.helpers import EDGE_SHAPES
from tests.reference import LOGIT_ATOL

TRAJECTORIES = (
    EDGE_SHAPES["stacked-branches"] + EDGE_SHAPES["prefix-of-another"] + EDGE_SHAPES["one-token-trajectories"]
)  # fmt: skip
BUDGETS = [1, 7, None]
FILL = -3.5


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", CRITIC_FAMILIES)
def test_values_equal_stock_critic_per_trajectory(family, budget):
    model = critic(family)
    truth = stock_outputs(model, TRAJECTORIES)
    out = harts.forward_values(model, TRAJECTORIES, budget_tokens=budget, fill=FILL)
    assert out.forest.redundancy > 1  # prefixes were shared
    if budget == 1:
        assert out.rows.num_micro_batches == out.forest.num_tokens
    for i, (got, ref) in enumerate(zip(out.values, truth, strict=True)):
        assert got.shape == (len(TRAJECTORIES[i]),)
        assert got[0] == FILL
        err = (got[1:].double() - ref[:-1]).abs().max().item() if got.numel() > 1 else 0.0
        assert err <= LOGIT_ATOL, f"trajectory {i}: max |value - stock| = {err:.2e}"


def test_values_flat_layout_and_rollouts():
    """Rollouts in, the flat layout (each its own root) gives the values of the shared one."""
    model = critic("qwen3")
    rollouts = [harts.Rollout(t) for t in TRAJECTORIES]
    shared = harts.forward_values(model, rollouts, budget_tokens=7)
    flat = harts.forward_values(model, rollouts, budget_tokens=7, share_prefixes=False)
    assert flat.forest.redundancy == 1
    for a, b in zip(shared.values, flat.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # the split bound of tests/test_split.py


# a trajectory ending in pad tokens, one of pad tokens only, one with a pad token inside
PAD = tiny_config("qwen3").pad_token_id
SCORED = TRAJECTORIES + [[5, 6, 7, PAD, PAD], [PAD, PAD], [5, PAD, 9, 10], [5, 6, 7, PAD]]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("family", REWARD_FAMILIES)
def test_scores_equal_stock_sequence_classifier(family, budget):
    model = reward_model(family)
    truth = stock_outputs(model, SCORED)  # [1] each: stock pools at the rightmost non-pad token
    out = harts.score(model, SCORED, budget_tokens=budget)
    assert out.positions[-4:] == [2, 0, 3, 2]
    assert out.scores.shape == (len(SCORED),)
    err = (out.scores.double() - torch.stack([t.reshape(()) for t in truth])).abs().max().item()
    assert err <= LOGIT_ATOL, f"max |score - stock| = {err:.2e}"


def test_scores_without_pad_token_read_the_last_token():
    model = reward_model("qwen3", pad_token_id=None)
    out = harts.score(model, SCORED, budget_tokens=7)
    assert out.positions == [len(t) - 1 for t in SCORED]
    truth = torch.stack([t.reshape(()) for t in stock_outputs(model, SCORED)])
    assert (out.scores.double() - truth).abs().max() <= LOGIT_ATOL


def test_refusals_before_compute():
    from transformers import AutoModelForTokenClassification

    two = AutoModelForTokenClassification.from_config(tiny_config("qwen3", num_labels=2)).eval()
    with pytest.raises(ValueError, match="num_labels=2"):
        harts.forward_values(two, TRAJECTORIES)
    with pytest.raises(ValueError, match="score head"):
        harts.forward_values(tiny_model("qwen3"), TRAJECTORIES)
    with pytest.raises(ValueError, match="has no lm_head"):
        harts.forest_logprobs(critic("qwen3"), TRAJECTORIES)
    with pytest.raises(ValueError, match="harts.forward_values"):
        harts.forward(critic("qwen3"), harts.build_forest(TRAJECTORIES))
    training = AutoModelForTokenClassification.from_config(tiny_config("qwen3", num_labels=1)).train()
    with pytest.raises(ValueError, match="dropout is active"):
        harts.forward_values(training, TRAJECTORIES)
    training.config.classifier_dropout = 0.0  # no dropout configured: train mode runs, exactly
    training.dropout.p = 0.0
    harts.forward_values(training, TRAJECTORIES)
    if "falcon_h1" in FAMILIES:
        with pytest.raises(ValueError, match="folds the family's logit scale"):
            harts.ValueHead(tiny_model("falcon_h1"))


def test_value_head_is_its_backbone_and_a_scalar_head():
    lm = tiny_model("qwen3")
    head = harts.ValueHead(lm, zero_init=True)
    assert head.model is lm.model and not hasattr(head, "lm_head")
    assert head.score.out_features == 1 and float(head.score.weight.detach().abs().sum()) == 0.0
    ids = torch.tensor([[3, 4, 5]])
    assert head(ids).shape == (1, 3, 1)
