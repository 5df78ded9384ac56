"""The training API: one step over rollouts or a forest, built on :mod:`harts.runtime`."""

from harts.train.moe import MoEObserver, moe_stats
from harts.train.step import forest_step, rollout_step
from harts.train.value_step import value_step

__all__ = ["rollout_step", "forest_step", "value_step", "moe_stats", "MoEObserver"]
