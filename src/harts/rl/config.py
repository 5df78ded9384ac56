"""The config of ``harts rl``: one TOML file read into typed, validated dataclasses.

The sections a training run also has are the training run's own dataclasses
(:mod:`harts.trainer.config`: ``[model]``, ``[objective]``, ``[run]``, ``[optimizer]``,
``[schedule]``, ``[checkpoint]``, ``[logging]``), parsed by the same code, so a key means the
same in both files and errors read the same (``rl.toml: optimizer.lr: expected a number, got
'fast' (str)``). What ``harts rl`` adds::

    seed, steps, layout (tree | flat), max_grad_norm, threads, out     top-level keys
    [task]       name (running_sum), turns, max_addend
    [sampling]   prompts_per_step, branching (one count per turn), temperature

and what it refuses: ``model.path`` (the task has its own character vocabulary, which no
pretrained model shares), ``objective.kind = "sft"`` (there is nothing to imitate), an
``objective.temperature`` other than the sampling temperature (the loss must read the
sampler's distribution). ``objective.advantage`` defaults to ``grpo``.

What this leaves out: ``[data]`` (the rollouts are sampled) and ``[moe]`` (no router statistics
or balancing in this loop).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from harts.objectives.losses import POLICY_LOSSES, PolicyLossConfig
from harts.rl.sampler import SamplingConfig
from harts.rl.task import TaskConfig
from harts.trainer.config import (
    CRITIC_ESTIMATORS,
    TRAIN_ESTIMATORS,
    CheckpointConfig,
    LoggingConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimizerConfig,
    RunSection,
    ScheduleConfig,
    build_section,
)
from harts.trainer.toml_sections import read_toml_config

__all__ = ["Layout", "RLConfig", "load_rl_config", "parse_rl_config", "SECTIONS"]


class Layout(StrEnum):
    """How a step's rollouts are trained: merged by common prefix, or each trajectory alone."""

    TREE = "tree"
    FLAT = "flat"


@dataclass(frozen=True)
class RLConfig:
    """A whole ``harts rl`` run."""

    model: ModelConfig
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    objective: ObjectiveConfig = field(default_factory=lambda: ObjectiveConfig(advantage="grpo"))
    run: RunSection = field(default_factory=RunSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 0
    steps: int = 100
    layout: str = Layout.TREE.value
    max_grad_norm: float | None = 1.0  # None or 0: no clipping (the norm is still reported)
    threads: int | None = None
    out: Path | None = None
    source: Path | None = field(default=None, compare=False)
    text: str = field(default="", compare=False, repr=False)
    table: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.model.path is not None:
            raise ValueError(
                "model.path: harts rl trains on its built-in task, whose character vocabulary "
                "no pretrained model shares; use model.tiny (built with that vocabulary)"
            )
        valid = [m.value for m in Layout]
        if self.layout not in valid:
            raise ValueError(f"layout: expected one of {', '.join(valid)}; got {self.layout!r}")
        if not self.steps >= 1:
            raise ValueError(f"steps: expected a positive integer, got {self.steps}")
        if self.threads is not None and not self.threads >= 1:
            raise ValueError(f"threads: expected a positive integer, got {self.threads}")
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm: expected >= 0, got {self.max_grad_norm}")
        loss = self.objective.loss_config().policy_loss
        if not loss.online_rl:
            online = " or ".join(kind for kind, entry in POLICY_LOSSES.items() if entry.online_rl)
            raise ValueError(f"objective.kind: {self.objective.kind!r} {loss.offline_only}; use {online}")
        if self.objective.correction is not None:
            raise ValueError(
                f"objective.correction: harts rl samples with the policy it trains, so its "
                f"rollouts' log-probs are the old policy's and there is no engine-trainer gap "
                f"to weigh; remove correction = {self.objective.correction!r}"
            )
        if self.objective.advantage is None:
            raise ValueError(
                f"objective.advantage: harts rl needs an estimator "
                f"({', '.join(TRAIN_ESTIMATORS)}): the sampled rollouts carry rewards, "
                f"not advantages"
            )
        if self.objective.advantage in CRITIC_ESTIMATORS:
            raise ValueError(
                f"objective.advantage: {self.objective.advantage} needs a critic's values, and "
                f"harts rl runs no critic (harts train does, with [critic]); use one of "
                f"{', '.join(TRAIN_ESTIMATORS)}"
            )
        if self.objective.temperature not in (1.0, self.sampling.temperature):
            raise ValueError(
                f"objective.temperature = {self.objective.temperature} differs from "
                f"sampling.temperature = {self.sampling.temperature}: the loss must read the "
                f"sampler's distribution; set only sampling.temperature"
            )
        if len(self.sampling.branching) != self.task.turns:
            raise ValueError(
                f"sampling.branching: {len(self.sampling.branching)} entries for "
                f"task.turns = {self.task.turns}: give one per turn"
            )

    def loss_config(self) -> PolicyLossConfig:
        """The objective's loss at the sampling temperature."""
        return dataclasses.replace(self.objective.loss_config(), temperature=self.sampling.temperature)

    def with_overrides(self, layout: str | None = None, steps: int | None = None, seed: int | None = None):
        """The config with the command line's ``--layout``, ``--steps`` (and a seed) applied, checked."""
        changes = {k: v for k, v in (("layout", layout), ("steps", steps), ("seed", seed)) if v is not None}
        return dataclasses.replace(self, **changes) if changes else self


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "task": TaskConfig,
    "sampling": SamplingConfig,
    "objective": ObjectiveConfig,
    "run": RunSection,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


@dataclass(frozen=True)
class _TopLevel:
    seed: int = 0
    steps: int = 100
    layout: str = Layout.TREE.value
    max_grad_norm: float | None = 1.0
    threads: int | None = None
    out: Path | None = None


def _sampling(table: dict, base: Path) -> SamplingConfig:
    """``[sampling]``: ``branching`` is a list of any length, which the shared parser has no type for."""
    table = dict(table)
    branching = table.pop("branching", None)
    plain = build_section(SamplingConfig, table, "sampling", base)
    if branching is None:
        return plain
    if not isinstance(branching, list) or not branching:
        raise ValueError(
            f"sampling.branching: expected a list of positive integers, one per turn, got {branching!r}"
        )
    return dataclasses.replace(plain, branching=tuple(branching))


def parse_rl_config(table: dict, base: Path, source: Path | None = None, text: str = "") -> RLConfig:
    """An :class:`RLConfig` from a parsed TOML table; relative paths resolved against ``base``."""
    top = {}
    for key, value in table.items():
        if key in SECTIONS:
            continue
        if isinstance(value, dict):
            raise ValueError(f"unknown section [{key}]; valid sections: {', '.join(SECTIONS)}")
        top[key] = value
    sections = {}
    for name, cls in SECTIONS.items():
        if name not in table:
            continue
        if not isinstance(table[name], dict):
            raise ValueError(f"{name}: expected a [{name}] section, got {table[name]!r}")
        section = dict(table[name])
        if name == "objective":
            section.setdefault("advantage", "grpo")
            given = section.get("temperature")
            sampling = table.get("sampling") if isinstance(table.get("sampling"), dict) else {}
            sampled = sampling.get("temperature", SamplingConfig.temperature)
            if given is not None and given != sampled:
                raise ValueError(
                    f"objective.temperature = {given} differs from sampling.temperature = "
                    f"{sampled}: the loss must read the sampler's distribution; set only "
                    f"sampling.temperature"
                )
        if name == "sampling":
            sections[name] = _sampling(section, base)
        else:
            sections[name] = build_section(cls, section, name, base)
    if "model" not in sections:
        raise ValueError("[model]: required section missing")
    scalars = build_section(_TopLevel, top, "", base)
    return RLConfig(**sections, **dataclasses.asdict(scalars), source=source, text=text, table=table)


def load_rl_config(path: str | Path) -> RLConfig:
    """Read and check a ``harts rl`` TOML file; every error names the file and the key."""
    return read_toml_config(path, parse_rl_config)
