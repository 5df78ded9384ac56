"""Rollouts: one trajectory's tokens with the annotations the objectives read, and their checks.

A :class:`Rollout` is what a sampler hands to training. Per-position annotations have one value
per token of the trajectory (``L`` values for ``L`` tokens); position ``p`` describes token ``p``,
which the model predicts from position ``p - 1``. Position 0 is never loss-bearing: nothing
predicts the first token.

Defaults, when an annotation is absent:

- ``loss_mask`` None: every position ``1 .. L-1`` is loss-bearing (plain SFT on the whole text).
- ``rollout_logprobs`` / ``ref_logprobs`` / ``advantages`` None: the loss rows flag them absent and
  objectives that need them refuse to run (see ``LossRows.has_*``).
- ``advantages`` may also be one number, which applies to every position.

Annotations are read only at loss-bearing positions, so only those are checked for NaN/inf and
for log-probs above 0; masked positions (prompt tokens, tool outputs) may hold anything, NaN
included, since samplers rarely score them.

:func:`validate_rollouts` checks everything before any compute and names the trajectory and the
position of the first problem. What this leaves out: loss rows (``rows.py``), advantages
(``advantages.py``) and the prefix merge (``harts.forest``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np
import torch

from harts.batch_positions import BatchLayout, batch_layout
from harts.forest import as_token_array
from harts.forest_routes import as_route_array

__all__ = [
    "Rollout",
    "CheckedRollout",
    "validate_rollouts",
    "LOGPROB_SLACK",
    "BatchRollouts",
    "rollouts_from_batch",
    "trajectory_sources",
]

# Samplers compute log_softmax in low precision; a log-prob this far above 0 is rounding, not a bug.
LOGPROB_SLACK = 1e-6

_PER_POSITION = (
    "loss_mask",
    "rollout_logprobs",
    "ref_logprobs",
    "advantages",
    "returns",
    "values",
    "old_logprobs",
)


@dataclass(frozen=True, eq=False)
class Rollout:
    """One trajectory and its annotations. Sequences may be lists, numpy arrays or 1-D tensors.

    - ``tokens`` [L]: token ids (integers >= 0).
    - ``loss_mask`` [L] or None: bool or 0/1; which tokens the policy generated and is trained on.
    - ``rollout_logprobs`` [L] or None: log-prob the sampler gave each token (position 0 ignored):
      the behaviour policy, the engine that drew the rollout.
    - ``old_logprobs`` [L] or None: log-prob of each token under the trainer's policy before the
      update (PPO's ratio denominator); None: the ratio reads ``rollout_logprobs``. An importance
      correction (``PolicyLossConfig.correction``) reads both.
    - ``ref_logprobs`` [L] or None: log-prob of each token under the reference policy (for KL).
    - ``advantages`` [L], a number, or None: advantage of each token.
    - ``returns`` [L] or None: the critic's regression target at each token (GAE's returns), for
      :func:`harts.value_step`.
    - ``values`` [L] or None: the critic's values at rollout time, aligned as
      :func:`harts.forward_values` gives them (position ``p`` read from the state after token
      ``p - 1``): the clipping anchor of the value loss and the baseline of GAE.
    - ``reward``: the trajectory's scalar reward, or None.
    - ``group_id``: hashable id of the trajectory's group (GRPO group: same prompt); None makes the
      trajectory a group of its own.
    - ``first_error_position``: position of the first wrong step of a failed trajectory (pitfall
      advantages), in ``[0, L)``; None for a trajectory without a located error.
    - ``pixel_values`` [P, W] and ``image_grid_thw`` [n, 3], or None: the trajectory's images as
      the model's processor gives them (the rows of its images in order, and their grids), for a
      multimodal model; checked against the model and its image tokens when the forest is built
      (:func:`harts.image_forest`).
    - ``routed_experts`` [L, decoder layers, top-k] integers, or None: the experts the inference
      engine routed each token to in each MoE layer (-1 where a layer has no routed experts or the
      token was not recorded), for routing replay: the trainer's routers then choose these, and
      trajectories share a token only where ids and routes agree (:mod:`harts.forest_routes`).
    - ``trajectory_id``: the trajectory this rollout is a piece of, or None (a whole trajectory of
      its own). The pieces of a trajectory split where its context drifted (the turns form) share
      it, and its reward and group: group advantage estimators and the per-trajectory figures count
      the trajectory once, every piece taking its advantage.
    """

    tokens: Any
    loss_mask: Any = None
    rollout_logprobs: Any = None
    ref_logprobs: Any = None
    advantages: Any = None
    reward: float | None = None
    group_id: Hashable | None = None
    first_error_position: int | None = None
    returns: Any = None
    values: Any = None
    pixel_values: Any = None
    image_grid_thw: Any = None
    old_logprobs: Any = None
    routed_experts: Any = None
    trajectory_id: Hashable | None = None


@dataclass(frozen=True, eq=False)
class CheckedRollout:
    """A rollout after :func:`validate_rollouts`: numpy arrays of length L, defaults applied.

    ``loss_mask`` is bool [L]; the float annotations are float64 [L] or None (absent).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray | None
    ref_logprobs: np.ndarray | None
    advantages: np.ndarray | None
    reward: float | None
    group_id: Hashable | None
    first_error_position: int | None
    returns: np.ndarray | None = None
    values: np.ndarray | None = None
    old_logprobs: np.ndarray | None = None
    routed_experts: np.ndarray | None = None  # int32 [L, layers, top-k]


def _to_numpy(values, name: str, index: int) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dtype == torch.bfloat16:
            values = values.float()
        return values.numpy()
    if isinstance(values, (str, bytes)):
        raise TypeError(
            f"trajectory {index}: {name} must be a sequence of numbers, got {type(values).__name__}"
        )
    try:
        return np.asarray(values)
    except (TypeError, ValueError) as err:
        raise TypeError(f"trajectory {index}: {name} must be a sequence of numbers ({err})") from None


def _check_shape(arr: np.ndarray, name: str, index: int, length: int) -> None:
    if arr.ndim != 1:
        raise ValueError(
            f"trajectory {index}: {name} must be 1-D with one value per token, got shape {arr.shape}"
        )
    if arr.shape[0] != length:
        raise ValueError(
            f"trajectory {index}: {name} has {arr.shape[0]} values but the trajectory has {length} tokens"
        )


def _loss_mask(values, index: int, length: int) -> np.ndarray:
    if values is None:
        mask = np.ones(length, dtype=bool)
        mask[0] = False
        return mask
    arr = _to_numpy(values, "loss_mask", index)
    _check_shape(arr, "loss_mask", index, length)
    if arr.dtype != bool:
        if arr.dtype.kind not in "iuf":
            raise TypeError(f"trajectory {index}: loss_mask must be bool or 0/1, got dtype {arr.dtype}")
        bad = ~((arr == 0) | (arr == 1))
        if bad.any():
            pos = int(np.argmax(bad))
            raise ValueError(f"trajectory {index}, position {pos}: loss_mask must be 0 or 1, got {arr[pos]}")
        arr = arr == 1
    if arr[0]:
        raise ValueError(
            f"trajectory {index}, position 0: loss_mask is set on the first token, which nothing predicts"
        )
    return arr.copy()


def _float_annotation(values, name: str, index: int, length: int, mask: np.ndarray) -> np.ndarray | None:
    if values is None:
        return None
    scalar = isinstance(values, Real) or (isinstance(values, (np.ndarray, torch.Tensor)) and values.ndim == 0)
    if isinstance(values, (bool, np.bool_)):
        raise TypeError(f"trajectory {index}: {name} must be numbers, got a bool")
    if scalar:
        if name != "advantages":
            raise TypeError(f"trajectory {index}: {name} needs one value per token, got a single number")
        arr = np.full(length, float(values), dtype=np.float64)
    else:
        arr = _to_numpy(values, name, index)
        _check_shape(arr, name, index, length)
        if arr.dtype.kind not in "iuf":
            raise TypeError(f"trajectory {index}: {name} must be numbers, got dtype {arr.dtype}")
        arr = arr.astype(np.float64)
    bad = mask & ~np.isfinite(arr)
    if bad.any():
        pos = int(np.argmax(bad))
        raise ValueError(
            f"trajectory {index}, position {pos}: {name} is {arr[pos]} at a loss-bearing position"
        )
    if name.endswith("logprobs"):
        bad = mask & (arr > LOGPROB_SLACK)
        if bad.any():
            pos = int(np.argmax(bad))
            raise ValueError(
                f"trajectory {index}, position {pos}: {name} is {arr[pos]}, but a log-probability is <= 0"
            )
    return arr


def _check_one(rollout, index: int, vocab_size: int | None) -> CheckedRollout:
    if not isinstance(rollout, Rollout):
        raise TypeError(f"trajectory {index}: expected a Rollout, got {type(rollout).__name__}")
    tokens = as_token_array(rollout.tokens, index)
    length = tokens.size
    if vocab_size is not None and tokens.max() >= vocab_size:
        pos = int(np.argmax(tokens >= vocab_size))
        raise ValueError(
            f"trajectory {index}, position {pos}: token id {int(tokens[pos])} is outside the vocabulary "
            f"(vocab_size={vocab_size})"
        )
    mask = _loss_mask(rollout.loss_mask, index, length)
    floats = {
        name: _float_annotation(getattr(rollout, name), name, index, length, mask)
        for name in _PER_POSITION[1:]
    }
    reward = rollout.reward
    if reward is not None:
        if isinstance(reward, (bool, np.bool_)) or not isinstance(reward, Real):
            raise TypeError(f"trajectory {index}: reward must be a real number or None, got {reward!r}")
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"trajectory {index}: reward is {reward}")
    if not isinstance(rollout.group_id, Hashable):
        raise TypeError(
            f"trajectory {index}: group_id must be hashable, got {type(rollout.group_id).__name__}"
        )
    err = rollout.first_error_position
    if err is not None:
        if isinstance(err, (bool, np.bool_)) or not isinstance(err, (int, np.integer)):
            raise TypeError(f"trajectory {index}: first_error_position must be an int or None, got {err!r}")
        if not 0 <= err < length:
            raise ValueError(
                f"trajectory {index}, position {int(err)}: first_error_position is outside the trajectory "
                f"(length {length})"
            )
        err = int(err)
    routes = getattr(rollout, "routed_experts", None)
    return CheckedRollout(
        tokens,
        mask,
        reward=reward,
        group_id=rollout.group_id,
        first_error_position=err,
        routed_experts=None if routes is None else as_route_array(routes, index, length),
        **floats,
    )


def validate_rollouts(rollouts: Sequence[Rollout], vocab_size: int | None = None) -> list[CheckedRollout]:
    """Check a batch of rollouts before any compute; return them as :class:`CheckedRollout`.

    Raises TypeError (wrong kinds) or ValueError (wrong values) naming the trajectory index and,
    where there is one, the position: annotation lengths that differ from the tokens, NaN/inf in
    log-probs, advantages or reward, a loss mask on position 0, log-probs above 0, token ids
    outside ``[0, vocab_size)``, a first error position outside the trajectory, routed experts of
    the wrong shape, and per-position annotations given for some trajectories of the batch but not
    for others (routed experts excepted: a trajectory without them is routed by the router).
    """
    if isinstance(rollouts, Rollout) or not isinstance(rollouts, Sequence):
        raise TypeError(f"expected a sequence of Rollout, got {type(rollouts).__name__}")
    if len(rollouts) == 0:
        raise ValueError("empty batch: at least one rollout is needed")
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1
    ):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    checked = [_check_one(r, i, vocab_size) for i, r in enumerate(rollouts)]
    _check_pieces(rollouts)
    for name in _PER_POSITION[1:]:
        present = [getattr(r, name) is not None for r in rollouts]
        if any(present) and not all(present):
            have, lack = present.index(True), present.index(False)
            raise ValueError(
                f"trajectory {lack} has no {name} but trajectory {have} has them: give every trajectory of "
                f"a batch the same annotations"
            )
    return checked


def _check_pieces(rollouts: Sequence[Rollout]) -> None:
    """The pieces of one trajectory (one ``trajectory_id``) carry its reward and group, the same on
    every piece: they count as that one trajectory."""
    first: dict = {}
    for i, r in enumerate(rollouts):
        key = getattr(r, "trajectory_id", None)
        if key is None:
            continue
        if not isinstance(key, Hashable):
            raise TypeError(f"trajectory {i}: trajectory_id must be hashable, got {type(key).__name__}")
        j = first.setdefault(key, i)
        other = rollouts[j]
        for name in ("reward", "group_id"):
            if getattr(r, name) != getattr(other, name):
                raise ValueError(
                    f"trajectory {i}: a piece of trajectory {key!r} with {name} {getattr(r, name)!r}, but "
                    f"trajectory {j}, another piece of it, has {getattr(other, name)!r}"
                )


def trajectory_sources(rollouts: Sequence) -> list[int]:
    """[B] the index of the trajectory each rollout is a piece of, dense in order of first appearance
    (a rollout without ``trajectory_id`` is a trajectory of its own)."""
    ids: dict = {}
    out = []
    for r in rollouts:
        key = getattr(r, "trajectory_id", None)
        out.append(len(ids) if key is None else ids.setdefault(("id", key), len(ids)))
        if key is None:
            ids[("own", len(out))] = out[-1]
    return out


class BatchRollouts(list):
    """A list of :class:`Rollout` made from a padded or packed batch; ``layout`` says where each
    trajectory's tokens sat, for results in the caller's layout (``StepResult.to_batch``)."""

    def __init__(self, rollouts, layout: BatchLayout):
        super().__init__(rollouts)
        self.layout = layout


def rollouts_from_batch(
    input_ids,
    attention_mask=None,
    *,
    cu_seqlens=None,
    position_ids=None,
    loss_mask=None,
    rollout_logprobs=None,
    ref_logprobs=None,
    advantages=None,
    rewards=None,
    group_ids=None,
    returns=None,
    values=None,
    old_logprobs=None,
) -> BatchRollouts:
    """Rollouts from a padded batch (``input_ids`` [B, L] and ``attention_mask``) or a packed one
    (``input_ids`` [T] or [1, T] and ``cu_seqlens`` or ``position_ids``).

    Per-token annotations (``loss_mask``, e.g. verl's response mask over the whole sequence;
    ``rollout_logprobs``; ``old_logprobs``; ``ref_logprobs``; ``advantages``; a critic's ``returns``
    and ``values``)
    have the shape of ``input_ids``: each trajectory takes its own tokens' values, padding is
    dropped. Per-trajectory ``rewards`` and ``group_ids`` have one entry per trajectory. A 2-D
    ``input_ids`` without a mask is refused.
    """
    layout = batch_layout(input_ids, attention_mask, cu_seqlens, position_ids)
    tokens = layout.split(input_ids, "input_ids")
    per_token = {
        "loss_mask": loss_mask,
        "rollout_logprobs": rollout_logprobs,
        "ref_logprobs": ref_logprobs,
        "advantages": advantages,
        "returns": returns,
        "values": values,
        "old_logprobs": old_logprobs,
    }
    split = {name: layout.split(v, name) for name, v in per_token.items() if v is not None}
    n = layout.num_trajectories
    for name, values in (("rewards", rewards), ("group_ids", group_ids)):
        if values is not None and len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} trajectories")
    rollouts = []
    for b in range(n):
        reward = None if rewards is None else rewards[b]
        reward = float(reward) if isinstance(reward, torch.Tensor) else reward
        group = None if group_ids is None else group_ids[b]
        group = group.item() if isinstance(group, torch.Tensor) else group
        rollouts.append(
            Rollout(
                tokens[b],
                reward=reward,
                group_id=group,
                **{name: values[b] for name, values in split.items()},
            )
        )
    return BatchRollouts(rollouts, layout)
