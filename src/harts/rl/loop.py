"""The loop of ``harts rl``: sample tree rollouts, score them, estimate advantages, one step, repeat.

Each step::

    episodes of the step (seeded by (seed, step)) -> sample_tree: the model's own turns, branching at
    turn boundaries, scored by the task's checker -> rollouts (rewards, group per episode)
    -> advantages on the rollouts' prefix tree (objective.advantage) -> harts.rollout_step
       (layout tree: share_prefixes=True; flat: each trajectory alone, the per-trajectory baseline)
    -> clip to max_grad_norm -> optimizer step -> schedule step -> zero_grad

The advantages are computed on the merged forest in both layouts: they are a function of the
rollouts (the ``tree`` estimator reads the tree of the sampled branches), not of how the step is
run, so the two layouts train on the same numbers and differ only by floating-point rounding.
The episodes and the sampler's random numbers of step k come from ``(seed, k)`` alone, so two
runs with equal parameters sample equal rollouts, and a resumed run samples what an
uninterrupted one would.

Reused from ``harts train`` (:mod:`harts.trainer`): the config sections and the run skeleton
(:class:`harts.trainer.run.Run`): the optimizers and schedules, clip-and-step, atomic checkpoints
with a manifest (``step-NNNNNN/``: the model as ``save_pretrained`` writes it,
``trainer_state.pt``, ``state.json``, ``config.toml``), ``metrics.jsonl`` and the ``[logging]
backends`` (TensorBoard, wandb), the progress line's cadence and the plot. What this leaves out:
several optimizer steps per batch (the loss is on-policy: the ratio is 1 up to rounding and
PPO's clip never acts), a reference model for KL, MoE statistics and balancing, evaluation on
held-out episodes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from harts.forest import Forest
from harts.objectives.advantages import advantages_to_rollouts, estimate_advantages
from harts.objectives.losses import PolicyLossConfig, normalizers_for
from harts.objectives.rollout import Rollout
from harts.rl.config import Layout, RLConfig
from harts.rl.report import PLOTTED, progress_line
from harts.rl.sampler import TreeSample, sample_tree
from harts.rl.task import build_task
from harts.runtime.backward import StepResult
from harts.runtime.config import RunConfig
from harts.steps.policy import rollout_step, step_inputs
from harts.tiny import tiny_model
from harts.trainer.checkpoint import Checkpoint
from harts.trainer.config import ObjectiveConfig
from harts.trainer.inputs import load_model, own_memory, quiet_transformers
from harts.trainer.logging_backends import check_backends
from harts.trainer.rollout_stats import groups_same_reward, response_tokens
from harts.trainer.run import Run, TrainingDiverged, update_metrics
from harts.trainer.throughput import Throughput

__all__ = ["run_rl", "rl_step", "step_randomness", "TrainingDiverged"]


def step_randomness(seed: int, step: int) -> tuple[np.random.Generator, torch.Generator]:
    """The episode and sampling random streams of step ``step`` (1-based) of a run seeded ``seed``."""
    sequence = np.random.SeedSequence([seed, step])
    episodes_seed, sampler_seed = sequence.generate_state(2, dtype=np.uint64)
    generator = torch.Generator().manual_seed(int(sampler_seed) & (2**63 - 1))
    return np.random.default_rng(int(episodes_seed)), generator


def rl_step(
    model: torch.nn.Module,
    rollouts: list[Rollout],
    objective: ObjectiveConfig,
    loss: PolicyLossConfig,
    run: RunConfig,
    layout: Layout,
) -> tuple[StepResult, Forest]:
    """Forward and backward of one step over scored rollouts, gradients into ``.grad``.

    Advantages come from ``objective.advantage`` on the merged forest (whatever the layout); the
    step is :func:`harts.rollout_step` with ``share_prefixes`` set by ``layout``. Returns the
    result and the merged forest (its unique and flat token counts).
    """
    forest, rows = step_inputs(model, rollouts)
    rows = estimate_advantages(rows, objective.advantage, forest, **objective.advantage_params)
    scored = advantages_to_rollouts(rollouts, rows, rows.advantage)
    normalizers = normalizers_for(rows, max_length=objective.max_length)
    result = rollout_step(
        model, scored, loss, share_prefixes=Layout(layout) is Layout.TREE, normalizers=normalizers, run=run
    )
    return result, forest


class _RL(Run):
    """One ``run_rl`` call on the run skeleton: the task, the sampler, the layout, the rewards."""

    command = "harts rl"
    progress_line = staticmethod(progress_line)
    plotted = PLOTTED
    plot_markers = False

    def __init__(self, config: RLConfig, out: Path, log: TextIO):
        super().__init__(config, out, log)
        self.task = build_task(config.task)
        self.layout = Layout(config.layout)
        self.loss = config.loss_config()
        self.run_config = config.run.run_config()
        self.updated = False  # an update ran in this session (the first is verified by default)
        self.total, self.wall, self.rewards = config.steps, 0.0, []

    def setup(self, resume: bool) -> Checkpoint | None:
        config = self.config
        check_backends(config.logging.writers)  # a missing package refused before the model loads
        if config.model.gradient_checkpointing:
            raise ValueError(
                "model.gradient_checkpointing: the sampler needs the model's cache, which "
                "transformers turns off under gradient checkpointing in train mode"
            )
        start, state = self.resume_point(resume)
        if state is not None:
            if state["layout"] != config.layout or state["seed"] != config.seed:
                raise ValueError(
                    f"{start.path.name} is of a run with layout {state['layout']} and seed "
                    f"{state['seed']}: resume with the same layout and seed"
                )
            if state["step"] > config.steps:
                raise ValueError(f"{start.path.name} is past the run's {config.steps} steps: raise steps")
        seed = config.seed if config.model.seed is None else config.model.seed
        if start is not None:
            self.model = load_model(config.model, seed, start.path)
        else:
            with quiet_transformers():
                dtype = getattr(torch, config.model.dtype)
                vocab = self.task.vocab_size
                self.model = tiny_model(config.model.tiny, seed=seed, dtype=dtype, vocab_size=vocab)
            self.model.to(config.model.device)
            own_memory(self.model)
            self.model.train()
        self.wrapped = self.model
        self.throughput = Throughput(self.model)
        split = self.build_optimizers(config.steps)
        if start is not None:
            self.restore_optimizers(start)
            self.step, self.wall = state["step"], state["wall_seconds"]
            self.say(f"resuming from {start.path} (step {self.step})")
        sampling = config.sampling
        self.describe_model(split)
        self.say(
            f"task {config.task.name}: {config.task.turns} turns, vocabulary {self.task.vocab_size}; "
            f"{sampling.prompts_per_step} episodes x {sampling.leaves()} branches per step "
            f"(branching {list(sampling.branching)}, temperature {sampling.temperature}); layout "
            f"{self.layout.value}; {config.steps} steps; out {self.out}"
        )
        return start

    def sample(self, step: int) -> TreeSample:
        config = self.config
        rng, generator = step_randomness(config.seed, step)
        episodes = self.task.episodes(config.sampling.prompts_per_step, rng)
        groups = [(step - 1) * len(episodes) + g for g in range(len(episodes))]
        return sample_tree(self.model, self.task, episodes, config.sampling, generator, groups)

    def update(self, rollouts: list[Rollout]) -> tuple[StepResult, Forest, float, dict]:
        config = self.config
        verify = config.run.verifies(self.step + 1, not self.updated)
        run = dataclasses.replace(self.run_config, verify=True) if verify else self.run_config
        began = time.perf_counter()
        with self.numbered():
            result, forest = rl_step(self.model, rollouts, config.objective, self.loss, run, self.layout)
        if verify:
            took = time.perf_counter() - began
            self.say(
                f"step {self.step + 1} verified against the stock forward (a sample of its "
                f"trajectories, within the bounds of docs/verification.md; {took:.2f} s with the check)"
            )
        self.updated = True
        grad_norm, lrs = self.clip_and_step(result)
        return result, forest, grad_norm, lrs

    def updates(self) -> Iterator[dict]:
        while self.step < self.total:
            began = time.perf_counter()
            sample = self.sample(self.step + 1)
            sampled = time.perf_counter()
            result, forest, grad_norm, lrs = self.update(sample.rollouts)
            ended = time.perf_counter()
            self.step += 1
            self.session += ended - began
            self.wall += ended - began
            record = self._record(sample, result, forest, grad_norm, lrs, sampled - began, ended - sampled)
            self.rewards.append(record["reward"])
            yield record

    def _record(
        self,
        sample: TreeSample,
        result: StepResult,
        forest: Forest,
        grad_norm: float,
        lrs: dict,
        sample_s: float,
        train_s: float,
    ) -> dict:
        rewards = sample.rewards
        record = {
            "step": self.step,
            "layout": self.layout.value,
            "reward": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            **update_metrics(result, grad_norm, lrs),
        }
        same = groups_same_reward(sample.rollouts)
        if same is not None:
            record["groups_same_reward"] = same
        record["response_tokens_mean"] = response_tokens(sample.rollouts)["response_tokens_mean"]
        computed = forest.num_tokens if self.layout is Layout.TREE else forest.num_flat_tokens
        record.update(
            rollouts=len(sample.rollouts),
            tokens=forest.num_flat_tokens,
            unique_tokens=forest.num_tokens,
            computed_tokens=computed,
            redundancy=forest.redundancy,
            micro_batches=result.num_micro_batches,
            recomputed_parts=len(result.recomputed_parts),
            sample_tokens=sample.model_tokens,
            sample_seconds=sample_s,
            train_seconds=train_s,
            seconds=sample_s + train_s,
            wall_seconds=self.wall,
            computed_tokens_per_s=computed / train_s,
        )
        rates = self.throughput.record(forest, sample.rollouts, train_s)
        record.update(
            loss_tokens=rates["loss_tokens"],
            loss_tokens_per_s=rates["loss_tokens_per_s"],
            flat_tokens_per_s=rates["flat_tokens_per_s"],
        )
        if "model_flops_per_s" in rates:  # the layout's own work: the flat one computes every token
            tree = self.layout is Layout.TREE
            record["model_flops_per_s"] = rates["model_flops_per_s" if tree else "flat_flops_per_s"]
        return record

    def checkpoint_state(self) -> dict:
        return {
            "step": self.step,
            "layout": self.layout.value,
            "seed": self.config.seed,
            "wall_seconds": self.wall,
            "threads": torch.get_num_threads(),
        }

    def trainer_state(self) -> dict:
        return {"optimizers": self.optim.state_dict()}

    def finish(self, last: Path | None, first: int) -> dict:
        rewards, session = self.rewards, self.session
        tail = rewards[-max(1, len(rewards) // 10) :] if rewards else [float("nan")]
        head = rewards[0] if rewards else float("nan")
        self.say(
            f"done: {self.step} steps, {session:.1f} s; reward {head:.3f} at the first step of this "
            f"session, {sum(tail) / len(tail):.3f} over its last {len(tail)}"
        )
        return {
            "steps": self.step,
            "checkpoint": str(last) if last else None,
            "resumed_from": first,
            "seconds": session,
            "final_reward": sum(tail) / len(tail),
        }


def run_rl(config: RLConfig, out: str | Path, resume: bool = False, log: TextIO | None = None) -> dict:
    """Run ``config`` into ``out`` (``resume``: from its newest checkpoint); returns a summary.

    Raises ValueError for bad input, CheckpointError for a checkpoint that fails verification,
    :class:`TrainingDiverged` for a non-finite step.
    """
    return _RL.execute(config, out, resume, log)
