"""``harts rl``: online RL with tree rollouts on a built-in multi-turn task, tree or flat layout.

The layer above ``trainer``, whose pieces it reuses (config sections, optimizers, checkpoints,
metrics); nothing below imports it.

- ``task``: the running-sum environment (character vocabulary, prompts, observations, checker);
- ``sampler``: tree rollouts sampled by the model with its own cache, branching at turn boundaries;
- ``config``: the TOML file as typed dataclasses (``load_rl_config``);
- ``loop``: ``run_rl(config, out)``: sample, score, advantages, ``harts.rollout_step``, repeat;
- ``report``: a run's plot, and the tree-against-flat comparison's numbers and figure;
- ``command``: the ``harts rl`` command line.

Guide: ``docs/online_rl.md``.
"""

from harts.rl.config import Layout, RLConfig, load_rl_config
from harts.rl.loop import rl_step, run_rl
from harts.rl.sampler import SamplingConfig, TreeSample, sample_tree
from harts.rl.task import Episode, RunningSum, TaskConfig, build_task

__all__ = [
    "Layout",
    "RLConfig",
    "load_rl_config",
    "rl_step",
    "run_rl",
    "SamplingConfig",
    "TreeSample",
    "sample_tree",
    "Episode",
    "RunningSum",
    "TaskConfig",
    "build_task",
]
