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

Reused from ``harts train`` (:mod:`harts.trainer`): the config sections, the optimizers and
schedules, atomic checkpoints with a manifest (``step-NNNNNN/``: the model as
``save_pretrained`` writes it, ``trainer_state.pt``, ``state.json``, ``config.toml``),
``metrics.jsonl`` and the ``[logging] backends`` (TensorBoard, wandb). What this leaves out:
several optimizer steps per batch (the loss is on-policy: the ratio is 1 up to rounding and
PPO's clip never acts), a reference model for KL, MoE statistics and balancing, evaluation on
held-out episodes.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TextIO

import numpy as np
import torch

from harts.forest import Forest
from harts.objectives.advantages import advantages_to_rollouts, estimate_advantages
from harts.objectives.losses import PolicyLossConfig, normalizers_for
from harts.objectives.rollout import Rollout
from harts.rl.config import Layout, RLConfig
from harts.rl.report import plot_run
from harts.rl.sampler import TreeSample, sample_tree
from harts.rl.task import build_task
from harts.runtime.config import RunConfig
from harts.runtime.step import StepResult
from harts.testing import tiny_model
from harts.train.step import rollout_step, step_inputs
from harts.trainer.checkpoint import latest, list_checkpoints, prune, run_lock, write_checkpoint
from harts.trainer.config import ObjectiveConfig
from harts.trainer.inputs import load_model, own_memory, quiet_transformers
from harts.trainer.logging_backends import check_backends, open_backends
from harts.trainer.loop import TrainingDiverged
from harts.trainer.optim import build_optimizers
from harts.trainer.progress import MetricsLog

__all__ = ["run_rl", "rl_step", "step_randomness", "TrainingDiverged"]

TRAINER_STATE = "trainer_state.pt"
STATE = "state.json"
CONFIG = "config.toml"


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
    result = rollout_step(model, scored, loss, share_prefixes=Layout(layout) is Layout.TREE,
                          normalizers=normalizers, run=run)  # fmt: skip
    return result, forest


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def progress_line(record: dict, total: int, eta: float) -> str:
    """``step 4/150 | reward 0.312 | loss -0.0123 | gnorm 0.51 | tree: 523 tokens for 8,400 flat ...``."""
    return " | ".join([
        f"step {record['step']}/{total}",
        f"reward {record['reward']:.3f}",
        f"loss {record['loss']:.4f}",
        f"gnorm {record['grad_norm']:.3g}",
        f"{record['layout']}: {record['computed_tokens']:,} tokens for {record['tokens']:,} flat "
        f"(shared {record['redundancy']:.1f}x)",
        f"sample {record['sample_seconds']:.2f} s train {record['train_seconds']:.2f} s",
        f"eta {_duration(eta)}",
    ])  # fmt: skip


class _Run:
    """The state of one ``run_rl`` call: model, optimizers, task, position; its save and restore."""

    def __init__(self, config: RLConfig, out: Path, log: TextIO):
        self.config, self.out, self.log = config, out, log
        self.root = out / "checkpoints"
        self.task = build_task(config.task)
        self.layout = Layout(config.layout)
        self.loss = config.loss_config()
        self.run_config = config.run.run_config()

    def say(self, line: str) -> None:
        print(f"harts rl: {line}", file=self.log, flush=True)

    def setup(self, resume: bool) -> dict | None:
        config = self.config
        if config.model.gradient_checkpointing:
            raise ValueError("model.gradient_checkpointing: the sampler needs the model's cache, which "
                             "transformers turns off under gradient checkpointing in train mode")  # fmt: skip
        start = latest(self.root) if resume else None  # verified before anything of it is read
        if resume and start is None:
            self.say(f"no checkpoint in {self.root}: starting from step 0")
        if not resume and list_checkpoints(self.root):
            newest = list_checkpoints(self.root)[-1].path.name
            raise ValueError(f"{self.out} already holds checkpoints ({newest}): pass --resume to continue "
                             f"from the newest, or choose another --out")  # fmt: skip
        state = json.loads((start.path / STATE).read_text()) if start else None
        if state is not None:
            if state["layout"] != config.layout or state["seed"] != config.seed:
                raise ValueError(f"{start.path.name} is of a run with layout {state['layout']} and seed "
                                 f"{state['seed']}: resume with the same layout and seed")  # fmt: skip
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
        self.optim, split = build_optimizers(self.model, config.optimizer, config.schedule, config.steps)
        self.step, self.wall = 0, 0.0
        if start is not None:
            trainer = torch.load(start.path / TRAINER_STATE, weights_only=True)
            self.optim.load_state_dict(trainer["optimizers"])
            self.step, self.wall = state["step"], state["wall_seconds"]
            self.say(f"resuming from {start.path} (step {self.step})")
        params = sum(p.numel() for p in self.model.parameters())
        threads = torch.get_num_threads()
        sampling = config.sampling
        self.say(
            f"model tiny {config.model.tiny} ({params / 1e6:.2f}M parameters, {config.model.dtype}, "
            f"{config.model.device}, {threads} thread{'s' if threads > 1 else ''}); {split.describe()}"
        )
        self.say(f"task {config.task.name}: {config.task.turns} turns, vocabulary {self.task.vocab_size}; "
                 f"{sampling.prompts_per_step} episodes x {sampling.leaves()} branches per step "
                 f"(branching {list(sampling.branching)}, temperature {sampling.temperature}); layout "
                 f"{self.layout.value}; {config.steps} steps; out {self.out}")  # fmt: skip
        return state

    def save(self) -> Path:
        state = {"step": self.step, "layout": self.layout.value, "seed": self.config.seed,
                 "wall_seconds": self.wall, "threads": torch.get_num_threads()}  # fmt: skip

        def write(directory: Path) -> None:
            with quiet_transformers():
                self.model.save_pretrained(directory, safe_serialization=True)
            torch.save({"optimizers": self.optim.state_dict()}, directory / TRAINER_STATE)
            (directory / STATE).write_text(json.dumps(state, indent=1), encoding="utf-8")
            (directory / CONFIG).write_text(self.config.text, encoding="utf-8")

        path = write_checkpoint(self.root, self.step, write)
        prune(self.root, self.config.checkpoint.keep_last)
        return path

    def sample(self, step: int) -> TreeSample:
        config = self.config
        rng, generator = step_randomness(config.seed, step)
        episodes = self.task.episodes(config.sampling.prompts_per_step, rng)
        groups = [(step - 1) * len(episodes) + g for g in range(len(episodes))]
        return sample_tree(self.model, self.task, episodes, config.sampling, generator, groups)

    def update(self, rollouts: list[Rollout]) -> tuple[StepResult, Forest, float, dict]:
        config = self.config
        try:
            result, forest = rl_step(self.model, rollouts, config.objective, self.loss, self.run_config,
                                     self.layout)  # fmt: skip
        except ValueError as exc:
            raise type(exc)(f"step {self.step + 1}: {exc}") from None
        clip = config.max_grad_norm if config.max_grad_norm else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.optim.take_gradients(), clip))  # fp32 masters
        if not (math.isfinite(grad_norm) and math.isfinite(float(result.loss))):
            raise TrainingDiverged(f"step {self.step + 1}: loss {float(result.loss)}, gradient norm "
                                   f"{grad_norm}: not finite; stopped before the update")  # fmt: skip
        lrs = self.optim.lrs()
        self.optim.step()
        self.optim.zero_grad()
        return result, forest, grad_norm, lrs


def _record(run: _Run, sample: TreeSample, result: StepResult, forest: Forest, grad_norm: float,
            lrs: dict, sample_s: float, train_s: float) -> dict:  # fmt: skip
    rewards = sample.rewards
    record = {"step": run.step, "layout": run.layout.value, "reward": float(rewards.mean()),
              "reward_std": float(rewards.std(unbiased=False)), "loss": float(result.loss)}  # fmt: skip
    record.update({k: float(v) for k, v in result.metrics.items() if k != "loss"})
    computed = forest.num_tokens if run.layout is Layout.TREE else forest.num_flat_tokens
    record.update(grad_norm=grad_norm, **lrs)
    record.update(
        rollouts=len(sample.rollouts),
        tokens=forest.num_flat_tokens,
        unique_tokens=forest.num_tokens,
        computed_tokens=computed,
        redundancy=forest.redundancy,
        micro_batches=result.num_micro_batches,
        sample_tokens=sample.model_tokens,
        sample_seconds=sample_s,
        train_seconds=train_s,
        seconds=sample_s + train_s,
        wall_seconds=run.wall,
        computed_tokens_per_s=computed / train_s,
    )
    return record


def run_rl(config: RLConfig, out: str | Path, resume: bool = False, log: TextIO | None = None) -> dict:
    """Run ``config`` into ``out`` (``resume``: from its newest checkpoint); returns a summary.

    Raises ValueError for bad input, CheckpointError for a checkpoint that fails verification,
    :class:`TrainingDiverged` for a non-finite step.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    run = _Run(config, out, sys.stderr if log is None else log)
    try:
        with run_lock(out, "harts rl"):
            return _loop(run, resume)
    finally:
        torch.set_num_threads(threads)


def _loop(run: _Run, resume: bool) -> dict:
    config = run.config
    check_backends(config.logging.writers)  # a missing package refused before the model loads
    run.setup(resume)
    first = run.step
    metrics = MetricsLog(run.out / "metrics.jsonl", run.step)
    backends = open_backends(config.logging.writers, run.out, config.table)
    last, session, rewards = None, 0.0, []
    try:
        while run.step < config.steps:
            began = time.perf_counter()
            sample = run.sample(run.step + 1)
            sampled = time.perf_counter()
            result, forest, grad_norm, lrs = run.update(sample.rollouts)
            ended = time.perf_counter()
            run.step += 1
            session += ended - began
            run.wall += ended - began
            record = _record(run, sample, result, forest, grad_norm, lrs, sampled - began, ended - sampled)
            rewards.append(record["reward"])
            metrics.write(record)
            for backend in backends:
                backend.write(record)
            done = run.step == config.steps
            if done or run.step % config.logging.every == 0:
                eta = session / (run.step - first) * (config.steps - run.step)
                print(progress_line(record, config.steps, eta), file=run.log, flush=True)
            every = config.checkpoint.every
            if done or (every and run.step % every == 0):
                last = run.save()
                run.say(f"checkpoint {last}")
    finally:
        metrics.close()
        for backend in backends:
            backend.close()
    if config.logging.plot:
        run.say(plot_run(run.out / "metrics.jsonl", run.out / "metrics.png"))
    tail = rewards[-max(1, len(rewards) // 10) :] if rewards else [float("nan")]
    head = rewards[0] if rewards else float("nan")
    run.say(f"done: {run.step} steps, {session:.1f} s; reward {head:.3f} at the first step of this session, "
            f"{sum(tail) / len(tail):.3f} over its last {len(tail)}")  # fmt: skip
    return {"steps": run.step, "checkpoint": str(last) if last else None, "resumed_from": first,
            "seconds": session, "final_reward": sum(tail) / len(tail)}  # fmt: skip
