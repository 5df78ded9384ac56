"""One optimizer step's forward and backward over rollouts or a forest, built on :mod:`harts.runtime`.

:mod:`~harts.steps.policy` (``rollout_step``, ``forest_step``), :mod:`~harts.steps.value`
(``value_step``, critics), :mod:`~harts.steps.router_statistics` (MoE statistics and the
load-balancing loss across micro-batches). A whole run of many steps is :mod:`harts.trainer`.
"""

from harts.steps.policy import forest_step, rollout_step
from harts.steps.router_statistics import MoEObserver, moe_stats
from harts.steps.value import value_step

__all__ = ["rollout_step", "forest_step", "value_step", "moe_stats", "MoEObserver"]
