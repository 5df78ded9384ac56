"""The config of ``harts train``: one TOML file read into typed, validated dataclasses.

Every key is checked here, before a model loads, and every error is one line naming the file and
the key (``train.toml: optimizer.lr: expected a number, got 'fast' (str)``); an unknown key lists
the valid ones. The reading and type checking are :mod:`harts.trainer.toml_sections`'s; this
module (with :mod:`harts.trainer.sections`, the sections only ``harts train`` has) says what each
section holds and which values it refuses.

Layout (every key, its default and meaning: ``docs/training.md``)::

    seed, steps | epochs, max_grad_norm, threads, out      top-level keys
    [model]      path (local HF directory) | tiny (family), seed, dtype, device, gradient_checkpointing
    [data]       path (.jsonl / .parquet), rollouts_per_step, tokenizer, split_drift
    [objective]  the fields of harts.PolicyLossConfig (kind, clip, KL, entropy, aggregation, temperature,
                 correction and its bounds), advantage, advantage_params, max_length
    [run]        the harts.RunConfig fields that make sense in a file
    [optimizer]  kind (adamw | muon), lr, muon_lr, weight_decay, betas, eps, momentum, adjust_lr,
                 freeze_router, master_weights
    [schedule]   kind (constant | linear | cosine), warmup_steps, min_lr_ratio
    [checkpoint] every, keep_last
    [logging]    every, backends (jsonl | tensorboard | wandb), tensorboard, plot
    [moe]        enabled, aux_loss_coef, bias_update_speed
    [reference]  model ("initial" | a local HF directory), dtype, device: the KL term's reference
    [ppo]        epochs, mini_batches, shuffle_seed, old_logprobs ("policy" | "rollout")
    [lora]       r, alpha, dropout (0), target_modules, merge_on_save: train peft LoRA adapters
    [eval]       file, every_steps, budget_tokens: held-out rollouts scored forward only
    [samples]    prompts, every_steps, max_new_tokens, greedy, tokenizer: generate() completions
    [critic]     model ("policy" | a local directory), dtype, device, seed, lr, weight_decay, betas, eps,
                 max_grad_norm, value_clip, aggregation, budget_tokens: a value model for gae

Relative paths are resolved against the config file's directory, so a config and its data can
move together.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from harts.adapters import FamilyUnavailable, adapter_for_type
from harts.objectives.advantages import ADVANTAGE_ESTIMATORS
from harts.objectives.losses import POLICY_LOSSES, PolicyLossConfig
from harts.plan.linear_cost import PlanMode
from harts.runtime.config import RunConfig
from harts.tiny import ALL_FAMILIES
from harts.trainer.sections import (
    DTYPES,
    FROM_POLICY,
    INITIAL,
    CriticSection,
    DistributedSection,
    EvalSection,
    LoRASection,
    MoESection,
    PPOSection,
    ReferenceSection,
    SamplesSection,
    one_of,
    positive_int,
)
from harts.trainer.toml_sections import (
    build_section,
    convert,
    describe,
    enum_fields,
    keys_of,
)

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "DataConfig",
    "ObjectiveConfig",
    "RunSection",
    "OptimizerConfig",
    "ScheduleConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "MoESection",
    "ReferenceSection",
    "PPOSection",
    "LoRASection",
    "EvalSection",
    "SamplesSection",
    "CriticSection",
    "BACKENDS",
    "TRAIN_ESTIMATORS",
    "CRITIC_ESTIMATORS",
    "parse_config",
    "DTYPES",
    "INITIAL",
    "FROM_POLICY",
]


@dataclass(frozen=True)
class ModelConfig:
    """What to train: a local Hugging Face directory (``path``) or a built-in tiny model (``tiny``)."""

    path: Path | None = None
    tiny: str | None = None
    seed: int | None = None  # the tiny model's init seed; None: the top-level seed
    dtype: str = "float32"
    device: str = "cpu"
    gradient_checkpointing: bool = False

    def __post_init__(self):
        if (self.path is None) == (self.tiny is None):
            raise ValueError(
                f"model: give exactly one of path (a local Hugging Face directory) or tiny "
                f"(one of {', '.join(ALL_FAMILIES)})"
            )
        if self.tiny is not None:
            one_of("model.tiny", self.tiny, ALL_FAMILIES)
            try:
                adapter_for_type(self.tiny)
            except FamilyUnavailable as exc:  # kept as such: tests skip, saying so
                raise FamilyUnavailable(f"model.tiny: {exc}") from None
        one_of("model.dtype", self.dtype, DTYPES)


@dataclass(frozen=True)
class DataConfig:
    """The rollout file, read in order, ``rollouts_per_step`` (groups kept whole) per optimizer step."""

    path: Path
    rollouts_per_step: int
    tokenizer: Path | None = None  # for files of chat messages (harts.data.rollout_files)
    # turns form: split a trajectory where its context drifted (true) or refuse the file (false)
    split_drift: bool = True

    def __post_init__(self):
        positive_int("data.rollouts_per_step", self.rollouts_per_step)


#: the estimators that read no critic: ``objective.advantage`` of a run without ``[critic]``
TRAIN_ESTIMATORS = tuple(name.value for name, entry in ADVANTAGE_ESTIMATORS.items() if not entry.needs_critic)
#: the estimators that read a critic's values (GAE): a run with them needs ``[critic]``
CRITIC_ESTIMATORS = tuple(name.value for name, entry in ADVANTAGE_ESTIMATORS.items() if entry.needs_critic)
#: estimator parameters a file sets that are not numbers, and those it cannot set (per-token tensors)
_PARAM_TYPES = {"whiten": bool}
_TENSOR_PARAMS = {"token_rewards": "each rollout's reward is put on its last loss position"}


#: PolicyLossConfig's fields that take an enum (kind, kl_estimator, aggregation): in a file, its strings
_LOSS_ENUMS = enum_fields(PolicyLossConfig)
# the loss's keys, read from PolicyLossConfig so that a field it gains is a key of [objective] too
_LossKeys = keys_of(PolicyLossConfig, "_LossKeys", __name__)


@dataclass(frozen=True)
class ObjectiveConfig(_LossKeys):
    """The loss: :class:`harts.PolicyLossConfig`'s fields (its enums as their strings), and how the
    step gets its advantages.

    ``advantage`` names an estimator (``harts.ADVANTAGE_ESTIMATORS``) run on each step's rows from
    the rollouts' rewards and group ids, with ``advantage_params`` its declared parameters (one of
    ``CRITIC_ESTIMATORS`` needs a ``[critic]``, which :class:`TrainConfig` checks); ``max_length``
    is Dr. GRPO's constant for the ``seq-mean-token-sum-norm`` aggregation.
    """

    advantage: str | None = None
    advantage_params: dict = field(default_factory=dict)
    max_length: float | None = None

    def __post_init__(self):
        for name, enum in _LOSS_ENUMS.items():  # kind: the names of harts.POLICY_LOSSES
            one_of(f"objective.{name}", getattr(self, name), [e.value for e in enum])
        try:
            loss = self.loss_config()
        except ValueError as exc:
            raise ValueError(f"objective: {exc}") from None
        if self.advantage is None:
            if self.advantage_params:
                raise ValueError("objective.advantage_params: set objective.advantage to use them")
        else:
            one_of("objective.advantage", self.advantage, TRAIN_ESTIMATORS + CRITIC_ESTIMATORS)
            entry = ADVANTAGE_ESTIMATORS[self.advantage]
            settable = [p for p in entry.params if p not in _TENSOR_PARAMS]
            for name, value in self.advantage_params.items():
                if name in _TENSOR_PARAMS:
                    raise ValueError(
                        f"objective.advantage_params.{name}: a per-token tensor, not set from a "
                        f"config: {_TENSOR_PARAMS[name]}"
                    )
                if name not in entry.params:
                    raise ValueError(
                        f"objective.advantage_params: {self.advantage} takes no parameter {name!r}; "
                        f"valid: {', '.join(settable) or 'none'}"
                    )
                convert(f"objective.advantage_params.{name}", value, _PARAM_TYPES.get(name, float))
        if self.max_length is not None and not self.max_length > 0:
            raise ValueError(f"objective.max_length: expected a positive number, got {self.max_length}")
        if loss.needs_max_length and self.max_length is None:
            raise ValueError(
                f"objective.max_length: {self.aggregation} needs Dr. GRPO's constant "
                f"(e.g. the generation budget in tokens)"
            )

    def loss_config(self) -> PolicyLossConfig:
        names = {f.name for f in dataclasses.fields(PolicyLossConfig)}
        return PolicyLossConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})


#: RunConfig's fields a file does not set: the cost model is an object (fitted by harts bench), and
#: which updates are checked against the stock forward is the trainer's choice (``verify`` below)
_RUN_NOT_KEYS = ("cost_model", "verify")
# the run's keys, read from RunConfig so that a field it gains is a key of [run] too
_RunKeys = keys_of(RunConfig, "_RunKeys", __name__, exclude=_RUN_NOT_KEYS)


@dataclass(frozen=True)
class RunSection(_RunKeys):
    """:class:`harts.RunConfig`: how each step's forest is run (time and memory, never the result).

    Its keys are RunConfig's fields (an enum as its string) but ``cost_model``; ``verify`` is the
    file's own: which updates the trainer checks, where RunConfig's says whether one call is."""

    # the step checked against the stock forward: "first" (the first update of a run and the first
    # after a resume), "never", or N (every N-th update, the first included)
    verify: str | int = "first"

    def __post_init__(self):
        one_of("run.linear_plan", self.linear_plan, [m.value for m in PlanMode])
        verify = self.verify
        every = isinstance(verify, int) and not isinstance(verify, bool) and verify >= 1
        if not (every or (isinstance(verify, str) and verify in ("first", "never"))):
            raise ValueError(f'run.verify: expected "first", "never" or a positive int, got {verify!r}')
        try:
            self.run_config()
        except ValueError as exc:
            raise ValueError(f"run: {exc}") from None

    def run_config(self) -> RunConfig:
        """The RunConfig of every update (whether an update is verified is decided per update)."""
        return RunConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(_RunKeys)})

    def verifies(self, update: int, first_of_session: bool) -> bool:
        """Whether optimizer update ``update`` (1-based) is checked against the stock forward."""
        if self.verify == "never":
            return False
        if first_of_session:
            return True
        return isinstance(self.verify, int) and (update - 1) % self.verify == 0


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW on everything, or Muon on the hidden 2-D matrices and AdamW on the rest (``optim.py``)."""

    kind: str = "adamw"
    lr: float = 1e-5
    muon_lr: float | None = None  # None: lr (with adjust_lr = "match_rms_adamw" the same scale fits)
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.95  # Muon's
    adjust_lr: str = "match_rms_adamw"  # Muon's learning-rate scaling (torch.optim.Muon adjust_lr_fn)
    freeze_router: bool = False
    # a bf16 / fp16 model: step fp32 masters and round them into it (False: step it in place)
    master_weights: bool = True

    def __post_init__(self):
        one_of("optimizer.kind", self.kind, ("adamw", "muon"))
        one_of("optimizer.adjust_lr", self.adjust_lr, ("match_rms_adamw", "original"))
        for key in ("lr", "muon_lr"):
            value = getattr(self, key)
            if value is not None and not (0 < value < math.inf):
                raise ValueError(f"optimizer.{key}: expected a positive number, got {value}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optimizer.weight_decay: expected >= 0, got {self.weight_decay}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas: expected two numbers in [0, 1), got {list(self.betas)}")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps: expected a positive number, got {self.eps}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"optimizer.momentum: expected a number in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate factor per step: linear warm-up, then constant, linear or cosine decay."""

    kind: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the factor linear and cosine decay approach (reached one step past the last)

    def __post_init__(self):
        one_of("schedule.kind", self.kind, ("constant", "linear", "cosine"))
        positive_int("schedule.warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"schedule.min_lr_ratio: expected a number in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 100  # steps between checkpoints (0: only at the end); the last step always saves
    keep_last: int = 3

    def __post_init__(self):
        positive_int("checkpoint.every", self.every, allow_zero=True)
        positive_int("checkpoint.keep_last", self.keep_last)


#: where the step records go: ``metrics.jsonl`` (always), TensorBoard event files, a wandb run
BACKENDS = ("jsonl", "tensorboard", "wandb")


@dataclass(frozen=True)
class LoggingConfig:
    every: int = 1  # steps between progress lines (metrics.jsonl gets every step)
    backends: tuple[str, ...] = ("jsonl",)
    tensorboard: bool = False  # the older spelling of "tensorboard" in backends
    plot: bool = True

    def __post_init__(self):
        positive_int("logging.every", self.every)
        for name in self.backends:
            one_of("logging.backends", name, BACKENDS)
        if "jsonl" not in self.backends:
            raise ValueError(
                'logging.backends: metrics.jsonl is what --resume and the plot read; keep "jsonl" in the list'
            )

    @property
    def writers(self) -> list[str]:
        """The backends beyond ``metrics.jsonl``, each once."""
        names = [*self.backends, *(["tensorboard"] if self.tensorboard else [])]
        return [n for i, n in enumerate(names) if n != "jsonl" and n not in names[:i]]


@dataclass(frozen=True)
class TrainConfig:
    """A whole run. ``steps`` or ``epochs`` (default: one epoch) sets its length."""

    model: ModelConfig
    data: DataConfig
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    run: RunSection = field(default_factory=RunSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    moe: MoESection = field(default_factory=MoESection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    reference: ReferenceSection | None = None
    ppo: PPOSection | None = None
    lora: LoRASection | None = None
    eval: EvalSection | None = None
    samples: SamplesSection | None = None
    critic: CriticSection | None = None
    seed: int = 0
    steps: int | None = None
    epochs: int | None = None
    max_grad_norm: float | None = 1.0  # None or 0: no clipping (the norm is still reported)
    threads: int | None = None  # torch.set_num_threads; None leaves torch's default
    out: Path | None = None  # --out overrides; None: runs/<config name>
    # where it came from (not TOML keys)
    source: Path | None = field(default=None, compare=False)
    text: str = field(default="", compare=False, repr=False)
    table: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                "steps and epochs: give one (steps counts optimizer steps, epochs passes over the file)"
            )
        positive_int("steps", self.steps)
        positive_int("epochs", self.epochs)
        positive_int("threads", self.threads)
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm: expected >= 0, got {self.max_grad_norm}")
        if self.reference is not None and not self.objective.kl_coef > 0:
            raise ValueError(
                "reference: objective.kl_coef is 0, so nothing would read the reference's "
                "log-probs: set objective.kl_coef or remove [reference]"
            )
        correction = self.objective.correction
        if correction is not None and (self.ppo is None or self.ppo.old_logprobs != "policy"):
            got = "no [ppo] section" if self.ppo is None else f"ppo.old_logprobs = {self.ppo.old_logprobs!r}"
            raise ValueError(
                f"objective.correction = {correction!r} weighs the old policy's log-probs "
                f"against the sampler's, and a rollout file carries only the sampler's: set "
                f'[ppo] old_logprobs = "policy" (got {got})'
            )
        self._check_critic()

    def _check_critic(self) -> None:
        """A critic estimator with a ``[critic]`` and a ``[critic]`` with one: each alone is refused."""
        advantage = self.objective.advantage
        if advantage in CRITIC_ESTIMATORS and self.critic is None:
            raise ValueError(
                f"objective.advantage: {advantage} needs a critic's values at every token: add "
                f"a [critic] section (a value model trained beside the policy; "
                f"docs/training.md)"
            )
        if self.critic is None:
            return
        if advantage not in CRITIC_ESTIMATORS:
            what = "is not set" if advantage is None else f"is {advantage!r}, which reads no critic"
            only = ", ".join(CRITIC_ESTIMATORS)
            raise ValueError(
                f"critic: objective.advantage {what}; only {only} reads the critic's values, so "
                f"its training would change nothing: set objective.advantage = "
                f'"{CRITIC_ESTIMATORS[0]}" or remove [critic]'
            )
        if not self.objective.loss_config().policy_loss.needs_advantages:
            kinds = ", ".join(k for k, entry in POLICY_LOSSES.items() if entry.needs_advantages)
            raise ValueError(
                f"critic: objective.kind = {self.objective.kind!r} reads no advantages, so "
                f"nothing would read the critic: use a kind that does ({kinds}) or remove "
                f"[critic]"
            )

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per step of rollouts: ``ppo.epochs * ppo.mini_batches``, else 1."""
        return 1 if self.ppo is None else self.ppo.updates


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "objective": ObjectiveConfig,
    "run": RunSection,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "moe": MoESection,
    "distributed": DistributedSection,
    "reference": ReferenceSection,
    "ppo": PPOSection,
    "lora": LoRASection,
    "eval": EvalSection,
    "samples": SamplesSection,
    "critic": CriticSection,
}


def parse_config(table: dict, base: Path, source: Path | None = None, text: str = "") -> TrainConfig:
    """A :class:`TrainConfig` from a parsed TOML table; relative paths resolved against ``base``."""
    top = {k: v for k, v in table.items() if k not in SECTIONS}
    sections = {}
    for name, cls in SECTIONS.items():
        if name not in table:
            continue
        if not isinstance(table[name], dict):
            raise ValueError(f"{name}: expected a [{name}] section, got {describe(table[name])}")
        sections[name] = build_section(cls, table[name], name, base)
    for name in ("model", "data"):
        if name not in sections:
            raise ValueError(f"[{name}]: required section missing")
    scalars = build_section(_TopLevel, top, "", base, SECTIONS)
    return TrainConfig(**sections, **dataclasses.asdict(scalars), source=source, text=text, table=table)


@dataclass(frozen=True)
class _TopLevel:
    """The top-level keys alone (the sections are built on their own)."""

    seed: int = 0
    steps: int | None = None
    epochs: int | None = None
    max_grad_norm: float | None = 1.0
    threads: int | None = None
    out: Path | None = None
