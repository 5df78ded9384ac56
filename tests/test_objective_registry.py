"""The registries' declared facts hold: each loss kind and estimator reads what its entry says, and
``harts train``'s ``[objective]`` keys follow ``PolicyLossConfig``'s fields."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from harts.forest import build_forest
from harts.objectives import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageEstimator,
    EstimatorEntry,
    LossKind,
    PolicyLossConfig,
    PolicyLossEntry,
    Rollout,
    build_loss_rows,
    compute_loss,
    dr_grpo_advantages,
    estimate_advantages,
    gae_advantages,
    grpo_advantages,
    normalizers_for,
    pitfall_advantages,
    rloo_advantages,
    tree_advantages,
)
from harts.trainer.config import TRAIN_ESTIMATORS, ObjectiveConfig

TOKENS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 7, 8]]


def _rows(**annotations):
    rollouts = [Rollout(t, group_id=0, **{k: v[i] for k, v in annotations.items()})
                for i, t in enumerate(TOKENS)]  # fmt: skip
    forest = build_forest([r.tokens for r in rollouts])
    return forest, build_loss_rows(forest, rollouts, dtype=torch.float64)


def _loss(kind, rows, index=None):
    lp = -torch.linspace(0.5, 1.5, rows.num_rows, dtype=torch.float64)
    norm = normalizers_for(rows)
    if index is not None:
        rows, lp = rows.select(index), lp[index]
    return compute_loss(lp, None, rows, PolicyLossConfig(kind=kind, clip_low=0.05, clip_high=0.05), norm)[0]


def test_every_kind_and_estimator_has_an_entry():
    assert list(POLICY_LOSSES) == list(LossKind)
    assert all(isinstance(e, PolicyLossEntry) for e in POLICY_LOSSES.values())
    assert list(ADVANTAGE_ESTIMATORS) == list(AdvantageEstimator)
    assert all(isinstance(e, EstimatorEntry) for e in ADVANTAGE_ESTIMATORS.values())
    assert [k for k, e in POLICY_LOSSES.items() if not e.online_rl] == [LossKind.SFT]


@pytest.mark.parametrize("kind", list(LossKind))
def test_a_kind_reads_what_its_entry_declares(kind):
    entry = POLICY_LOSSES[kind]
    logprobs = [[-1.0 + 0.1 * p for p in range(len(t))] for t in TOKENS]
    advantages = [1.0, -1.0, 0.5]
    for given, needed, match in (
        ({"rollout_logprobs": logprobs}, entry.needs_advantages, "needs advantages"),
        ({"advantages": advantages}, entry.needs_behaviour_logprobs, "behaviour policy's log-probs"),
    ):
        _, rows = _rows(**given)
        if needed:
            with pytest.raises(ValueError, match=match):
                _loss(kind, rows)
        else:
            _loss(kind, rows)
    # separable rows: the losses of any subsets of rows add up to the whole's (not GSPO's)
    _, rows = _rows(advantages=advantages, rollout_logprobs=logprobs)
    whole = _loss(kind, rows)
    parts = sum(_loss(kind, rows, torch.tensor([r])) for r in range(rows.num_rows))
    assert torch.allclose(parts, whole, rtol=1e-12, atol=0) == entry.separable_rows


def test_clip_defaults_and_kind_fields_come_from_the_entries():
    assert PolicyLossConfig(kind="ppo").clip() == POLICY_LOSSES[LossKind.PPO].clip
    assert PolicyLossConfig(kind="gspo").clip() == POLICY_LOSSES[LossKind.GSPO].clip
    with pytest.raises(ValueError, match="dual_clip applies to PPO only, not gspo"):
        PolicyLossConfig(kind="gspo", dual_clip=3.0)


def test_an_estimators_params_are_its_functions_keywords():
    functions = {
        "grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages,
        "tree": tree_advantages, "pitfall": pitfall_advantages, "gae": gae_advantages,
    }  # fmt: skip
    inputs = {"reward", "group", "forest", "rows"}
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        keywords = [p for p in inspect.signature(functions[name]).parameters if p not in inputs]
        assert list(entry.params) == keywords, name


def test_an_estimator_reads_what_its_entry_declares():
    forest, rows = _rows(reward=[1.0, 0.0, 0.5], values=[[0.1] * len(t) for t in TOKENS])
    _, no_reward = _rows(values=[[0.1] * len(t) for t in TOKENS])
    _, no_values = _rows(reward=[1.0, 0.0, 0.5])
    for name, entry in ADVANTAGE_ESTIMATORS.items():
        estimate_advantages(rows, name, forest)
        for lacking, needed, match in ((no_reward, entry.needs_reward, "reward"),
                                       (no_values, entry.needs_critic, "values")):  # fmt: skip
            if needed:
                with pytest.raises(ValueError, match=match):
                    estimate_advantages(lacking, name, forest)
            else:
                estimate_advantages(lacking, name, forest)
        if entry.needs_forest:
            with pytest.raises(ValueError, match="needs the forest"):
                estimate_advantages(rows, name)
    assert TRAIN_ESTIMATORS == tuple(n for n, e in ADVANTAGE_ESTIMATORS.items() if not e.needs_critic)


def test_objective_keys_are_the_loss_fields_and_the_estimate():
    loss_fields = [f.name for f in dataclasses.fields(PolicyLossConfig)]
    keys = [f.name for f in dataclasses.fields(ObjectiveConfig)]
    assert keys == [*loss_fields, "advantage", "advantage_params", "max_length"]
    objective = ObjectiveConfig(kind="gspo", clip_low=0.01, kl_coef=0.1, aggregation="seq-mean-token-mean")
    assert objective.loss_config() == PolicyLossConfig(
        kind=LossKind.GSPO, clip_low=0.01, kl_coef=0.1, aggregation="seq-mean-token-mean"
    )
    assert ObjectiveConfig().loss_config() == PolicyLossConfig()
