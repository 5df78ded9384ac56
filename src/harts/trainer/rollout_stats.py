"""What an RL user reads of every update: its rollouts' rewards, their groups, the advantages the
loss reads and the length of the responses.

Every metrics record of ``harts train`` holds, over the update's rollouts:

- ``reward_mean``, ``reward_std`` (population), ``reward_min``, ``reward_max``: over the
  trajectories that carry a reward (the pieces of a trajectory split where its context drifted,
  ``trajectory_id``, count once); absent when none does;
- ``groups_same_reward``: the share of the groups (``group_id``; None is a group of its own) whose
  rewards are all equal, over the groups with at least one reward (rollouts without one are left
  out of their group). Such a group gives a group-relative estimator (GRPO, RLOO) no signal: all
  its advantages are zero. A group of one counts as such;
- ``advantage_mean``, ``advantage_std`` (population): over the loss-bearing rows of the update, of
  the advantages the loss reads; absent when it reads none;
- ``response_tokens_mean``, ``response_tokens_max``: loss-bearing tokens per trajectory (the
  loss-mask positions but the first, as ``loss_tokens`` counts them).

Pure functions of the rollouts (and of the loss rows' advantages), no model, no device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from harts.objectives.rollout import trajectory_sources

__all__ = ["rollout_stats", "reward_stats", "groups_same_reward", "response_tokens", "advantage_stats"]


def whole_trajectories(rollouts: Sequence) -> list:
    """The rollouts with the pieces of one trajectory (``trajectory_id``) kept once, its first piece
    standing for it: the pieces share its reward and group."""
    source = trajectory_sources(rollouts)
    first = {}
    for i, s in enumerate(source):
        first.setdefault(s, i)
    return [rollouts[i] for i in first.values()]


def reward_stats(rollouts: Sequence) -> dict:
    """``reward_mean``, ``reward_std``, ``reward_min``, ``reward_max`` over the trajectories with a
    reward (the pieces of one counted once); empty when none has one."""
    rollouts = whole_trajectories(rollouts)
    rewards = np.array([float(r.reward) for r in rollouts if r.reward is not None], dtype=np.float64)
    if rewards.size == 0:
        return {}
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "reward_min": float(rewards.min()),
        "reward_max": float(rewards.max()),
    }


def groups_same_reward(rollouts: Sequence) -> float | None:
    """The share of the groups with a reward whose rewards are all equal; None without rewards."""
    groups: dict = {}
    for i, r in enumerate(whole_trajectories(rollouts)):
        if r.reward is None:
            continue
        key = ("own", i) if r.group_id is None else ("id", r.group_id)
        groups.setdefault(key, []).append(float(r.reward))
    if not groups:
        return None
    same = sum(min(rewards) == max(rewards) for rewards in groups.values())
    return same / len(groups)


def _response_tokens(rollout) -> int:
    mask = rollout.loss_mask
    if mask is None:
        return max(len(rollout.tokens) - 1, 0)
    return int(np.asarray(torch.as_tensor(mask).cpu(), dtype=bool)[1:].sum())


def response_tokens(rollouts: Sequence) -> dict:
    """``response_tokens_mean`` and ``response_tokens_max``: loss-bearing tokens per trajectory (its
    pieces' together)."""
    if not rollouts:
        return {}
    source = trajectory_sources(rollouts)
    counts = [int(c) for c in np.bincount(source, weights=[_response_tokens(r) for r in rollouts])]
    return {"response_tokens_mean": sum(counts) / len(counts), "response_tokens_max": max(counts)}


def advantage_stats(advantage: torch.Tensor) -> dict:
    """``advantage_mean`` and ``advantage_std`` of the loss rows' advantages (one per loss-bearing
    position); empty when there are no rows."""
    values = advantage.detach().to("cpu", torch.float64)
    if values.numel() == 0:
        return {}
    mean = float(values.mean())
    return {"advantage_mean": mean, "advantage_std": math.sqrt(float(((values - mean) ** 2).mean()))}


def rollout_stats(rollouts: Sequence) -> dict:
    """The reward, group and response-length figures of an update's rollouts (not the advantages,
    which are the loss rows')."""
    out = reward_stats(rollouts)
    same = groups_same_reward(rollouts)
    if same is not None:
        out["groups_same_reward"] = same
    out.update(response_tokens(rollouts))
    return out
