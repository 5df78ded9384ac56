"""Rollout checks: every bad input is refused before compute, naming trajectory and position."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from harts.forest import build_forest
from harts.objectives import Rollout, build_loss_rows, validate_rollouts

L = 8


def good(**kw) -> Rollout:
    base = dict(
        tokens=list(range(1, L + 1)),
        loss_mask=[0, 0, 0, 1, 1, 1, 1, 1],
        rollout_logprobs=[0.0] + [-0.5] * (L - 1),
        ref_logprobs=[0.0] + [-0.7] * (L - 1),
        advantages=[0.5] * L,
        reward=1.0,
        group_id="g",
    )
    return Rollout(**{**base, **kw})


def batch_with(bad: Rollout) -> list[Rollout]:
    return [good(), good(), bad, good()]


def with_value(name: str, pos: int, value: float) -> list[float]:
    values = list(getattr(good(), name))
    values[pos] = value
    return values


T2, P0, P5 = "trajectory 2", "trajectory 2, position 0", "trajectory 2, position 5"
# (id, bad rollout for trajectory 2, exception, fragments the message must contain)
CASES = [
    ("mask-length", good(loss_mask=[0, 1, 1]), ValueError, [T2, "loss_mask has 3 values", "8 tokens"]),
    ("logprob-length", good(rollout_logprobs=[-1.0] * 9), ValueError, [T2, "rollout_logprobs has 9"]),
    ("adv-2d", good(advantages=np.zeros((2, 4))), ValueError, [T2, "1-D"]),
    ("logprob-nan", good(rollout_logprobs=with_value("rollout_logprobs", 5, math.nan)), ValueError,
     [P5, "nan"]),
    ("ref-inf", good(ref_logprobs=with_value("ref_logprobs", 5, -math.inf)), ValueError,
     [P5, "ref_logprobs"]),
    ("adv-inf", good(advantages=with_value("advantages", 5, math.inf)), ValueError,
     [P5, "advantages"]),
    ("logprob-positive", good(rollout_logprobs=with_value("rollout_logprobs", 5, 0.3)), ValueError,
     [P5, "<= 0"]),
    ("mask-position0", good(loss_mask=[1] + [1] * (L - 1)), ValueError, [P0]),
    ("mask-not-binary", good(loss_mask=[0, 0, 0, 0, 0, 0.5, 1, 1]), ValueError, [P5]),
    ("mask-strings", good(loss_mask=list("abcdefgh")), TypeError, [T2, "loss_mask"]),
    ("reward-nan", good(reward=math.nan), ValueError, [T2, "reward"]),
    ("reward-bool", good(reward=True), TypeError, [T2, "reward"]),
    ("reward-string", good(reward="1"), TypeError, [T2, "reward"]),
    ("token-negative", good(tokens=[1, 2, 3, 4, 5, -1, 7, 8]), ValueError, [P5, "negative"]),
    ("token-float", good(tokens=np.arange(L, dtype=np.float32)), TypeError, [T2]),
    ("first-error-out", good(first_error_position=8), ValueError, [T2, "first_error_position"]),
    ("first-error-bool", good(first_error_position=True), TypeError, [T2, "first_error_position"]),
    ("group-unhashable", good(group_id=[1]), TypeError, [T2, "group_id"]),
    ("logprob-scalar", good(rollout_logprobs=-1.0), TypeError, [T2, "one value per token"]),
    ("missing-logprobs", good(rollout_logprobs=None), ValueError, ["trajectory 2 has no rollout_logprobs"]),
]  # fmt: skip


@pytest.mark.parametrize(("bad", "exc", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_rollouts_are_refused_with_trajectory_and_position(bad, exc, fragments):
    with pytest.raises(exc) as info:
        validate_rollouts(batch_with(bad))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_token_outside_vocabulary():
    bad = good(tokens=[1, 2, 3, 4, 5, 99, 7, 8])
    validate_rollouts(batch_with(bad))  # no vocabulary given: fine
    with pytest.raises(ValueError, match=r"trajectory 2, position 5: token id 99 .*vocab_size=50"):
        validate_rollouts(batch_with(bad), vocab_size=50)


def test_not_a_batch_of_rollouts():
    with pytest.raises(TypeError, match="sequence of Rollout"):
        validate_rollouts(good())
    with pytest.raises(TypeError, match="trajectory 1: expected a Rollout"):
        validate_rollouts([good(), {"tokens": [1, 2]}])
    with pytest.raises(ValueError, match="empty batch"):
        validate_rollouts([])


def test_masked_positions_may_hold_anything():
    # Samplers rarely score prompt tokens: NaN or positive values at masked positions are ignored.
    lp = [math.nan, math.nan, 5.0] + [-0.5] * (L - 3)
    (checked,) = validate_rollouts([good(rollout_logprobs=lp, advantages=[math.nan] * 3 + [1.0] * (L - 3))])
    assert checked.loss_mask.tolist() == [False, False, False] + [True] * (L - 3)


def test_defaults_and_accepted_forms():
    (c,) = validate_rollouts([Rollout(tokens=torch.tensor([3, 4, 5]))])
    assert c.loss_mask.tolist() == [False, True, True]
    assert c.rollout_logprobs is None and c.advantages is None and c.reward is None
    (c,) = validate_rollouts(
        [
            Rollout(
                np.array([3, 4, 5]), loss_mask=torch.tensor([False, True, True]), advantages=np.float32(2.0)
            )
        ]
    )
    assert c.advantages.tolist() == [2.0, 2.0, 2.0]
    (c,) = validate_rollouts([Rollout([3, 4, 5], rollout_logprobs=torch.tensor([0.0, -1.0, 1e-7]))])
    assert c.rollout_logprobs.dtype == np.float64  # 1e-7 > 0 is within LOGPROB_SLACK


def test_rows_refuse_a_forest_of_other_tokens():
    rollouts = [good(), good(tokens=[1, 2, 3, 4, 5, 6, 7, 9])]
    forest = build_forest([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]])
    with pytest.raises(ValueError, match="trajectory 1, position 7"):
        build_loss_rows(forest, rollouts)
    with pytest.raises(ValueError, match="2 trajectories but 1 rollouts"):
        build_loss_rows(forest, rollouts[:1])
