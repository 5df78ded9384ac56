"""The config sections only ``harts train`` has: ``[moe]``, ``[distributed]``, ``[reference]``,
``[ppo]``, ``[lora]``, ``[eval]``, ``[samples]``, ``[critic]``.

:mod:`harts.trainer.config` holds the sections ``harts rl`` reads too (``[model]``,
``[objective]``, ``[run]``, ...) and the whole run's :class:`~harts.trainer.config.TrainConfig`,
which reads these with the rest, key by key; the shared value checks (``one_of``,
``positive_int``) live here. Every key, its default and meaning: ``docs/training.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harts.objectives.losses import Aggregation
from harts.trainer.toml_sections import path_or

__all__ = [
    "MoESection",
    "DistributedSection",
    "ReferenceSection",
    "PPOSection",
    "LoRASection",
    "EvalSection",
    "SamplesSection",
    "CriticSection",
    "one_of",
    "positive_int",
    "ALL_LINEAR",
    "DTYPES",
    "INITIAL",
    "FROM_POLICY",
    "CRITIC_AGGREGATIONS",
]

#: ``lora.target_modules`` for every linear layer but the output head (peft's own shorthand)
ALL_LINEAR = "all-linear"
#: the dtypes a model (policy, reference, critic) may run in
DTYPES = ("float32", "bfloat16", "float16", "float64")
#: ``reference.model`` for the run's starting weights
INITIAL = "initial"
#: ``critic.model`` for the policy's starting weights under a fresh value head
FROM_POLICY = "policy"
#: the value loss's aggregations (Dr. GRPO's constant normaliser has no meaning for a critic)
CRITIC_AGGREGATIONS = tuple(a.value for a in Aggregation if a is not Aggregation.SEQ_MEAN_TOKEN_SUM_NORM)


def one_of(key: str, value: Any, valid) -> None:
    valid = [str(v) for v in valid]
    if value not in valid:
        raise ValueError(f"{key}: expected one of {', '.join(valid)}; got {value!r}")


def positive_int(key: str, value, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ValueError(
            f"{key}: expected {'a non-negative' if allow_zero else 'a positive'} integer, got {value}"
        )


@dataclass(frozen=True)
class MoESection:
    """MoE statistics and balancing (``harts.MoEConfig``); MoE families only."""

    enabled: bool = False
    aux_loss_coef: float | None = None  # None: the model config's, for aux-loss families
    bias_update_speed: float = 0.0  # bias-balanced families: score-correction bias step after each update

    def __post_init__(self):
        if (self.aux_loss_coef is not None or self.bias_update_speed) and not self.enabled:
            raise ValueError("moe: set moe.enabled = true to use aux_loss_coef or bias_update_speed")
        if self.aux_loss_coef is not None and not self.aux_loss_coef >= 0:
            raise ValueError(f"moe.aux_loss_coef: expected >= 0, got {self.aux_loss_coef}")
        if not self.bias_update_speed >= 0:
            raise ValueError(f"moe.bias_update_speed: expected >= 0, got {self.bias_update_speed}")


@dataclass(frozen=True)
class DistributedSection:
    """Used when torchrun starts several processes (``WORLD_SIZE`` > 1); ignored on one."""

    strategy: str = "ddp"  # ddp: every rank holds the model; fsdp: FSDP2 shards it (fully_shard)
    balance: str = "cost"  # trees to ranks by a FLOP model ("cost") or by unique tokens ("tokens")
    timeout_s: float = 600.0  # a collective that waits longer (a dead or hung rank) fails

    def __post_init__(self):
        one_of("distributed.strategy", self.strategy, ["ddp", "fsdp"])
        one_of("distributed.balance", self.balance, ["cost", "tokens"])
        if not self.timeout_s > 0:
            raise ValueError(f"distributed.timeout_s: expected > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class ReferenceSection:
    """The KL term's reference policy, run by the trainer: ``model`` is ``"initial"`` (the run's
    starting weights, a frozen copy) or a local Hugging Face directory. It runs in eval mode
    without autograd; ``dtype`` / ``device`` default to the policy's (``[model]``)."""

    model: str = path_or(INITIAL)  # a directory, resolved against the file's, or "initial"
    dtype: str | None = None
    device: str | None = None

    def __post_init__(self):
        if self.dtype is not None:
            one_of("reference.dtype", self.dtype, DTYPES)

    @property
    def initial(self) -> bool:
        return self.model == INITIAL


@dataclass(frozen=True)
class PPOSection:
    """Several optimizer updates per step of rollouts (PPO's epochs over mini-batches).

    Each step's old log-probs are computed once, before its first update, with the weights of
    that moment (``old_logprobs = "policy"``; not for ``sft``, which reads none), or read from the
    file (``"rollout"``: the sampler's); then ``epochs`` passes, each over ``mini_batches``
    mini-batches of whole groups, shuffled by (``shuffle_seed``, the step, the epoch); every
    mini-batch is one optimizer update with its own normalisers.
    """

    epochs: int = 1
    mini_batches: int = 1
    shuffle_seed: int | None = None  # None: the top-level seed
    old_logprobs: str = "policy"

    def __post_init__(self):
        positive_int("ppo.epochs", self.epochs)
        positive_int("ppo.mini_batches", self.mini_batches)
        one_of("ppo.old_logprobs", self.old_logprobs, ("policy", "rollout"))

    @property
    def updates(self) -> int:
        """Optimizer updates per step of rollouts."""
        return self.epochs * self.mini_batches


@dataclass(frozen=True)
class LoRASection:
    """Train LoRA adapters (peft) instead of the model's weights, which stay frozen.

    ``dropout`` must be 0: a dropout mask drawn over the forest would be shared by every
    trajectory through a shared token, where training each trajectory alone draws one mask per
    trajectory, so the gradients would not be those of per-trajectory training. Adapters start
    with B = 0 (peft's default), so the starting policy is the base model's.
    """

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    merge_on_save: bool = False  # also write each checkpoint's merged model (checkpoint/merged/)

    def __post_init__(self):
        positive_int("lora.r", self.r)
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha: expected a positive number, got {self.alpha}")
        if self.dropout != 0:
            raise ValueError(
                f"lora.dropout: {self.dropout} is refused: a dropout mask over the forest is shared by every "
                f"trajectory through a shared token, so the gradients would not be per-trajectory "
                f"training's; set it to 0"
            )
        if not self.target_modules or not all(self.target_modules):
            raise ValueError(
                f'lora.target_modules: expected module names (e.g. ["q_proj", "v_proj"]) '
                f'or ["{ALL_LINEAR}"], got {list(self.target_modules)}'
            )

    @property
    def targets(self) -> str | list[str]:
        """What peft's ``LoraConfig.target_modules`` takes."""
        names = list(self.target_modules)
        return ALL_LINEAR if names == [ALL_LINEAR] else names


@dataclass(frozen=True)
class EvalSection:
    """Held-out rollouts scored every ``every_steps`` optimizer updates (and after the last),
    forward only: the loss, the mean token log-prob and, with ``[reference]``, the KL."""

    file: Path
    every_steps: int = 100
    budget_tokens: int | None = None  # None: the run's run.budget_tokens

    def __post_init__(self):
        positive_int("eval.every_steps", self.every_steps)
        positive_int("eval.budget_tokens", self.budget_tokens)


@dataclass(frozen=True)
class SamplesSection:
    """Completions of fixed prompts by the model's own ``generate``, every ``every_steps``
    updates (and after the last), appended to ``OUT/samples.jsonl``."""

    prompts: Path
    every_steps: int = 100
    max_new_tokens: int = 32
    greedy: bool = True
    tokenizer: Path | None = None  # None: data.tokenizer (needed for prompts given as text)

    def __post_init__(self):
        positive_int("samples.every_steps", self.every_steps)
        positive_int("samples.max_new_tokens", self.max_new_tokens)


@dataclass(frozen=True)
class CriticSection:
    """A learned critic (value model) trained beside the policy, for ``objective.advantage = "gae"``.

    ``model``: ``"policy"`` (the policy's starting weights, ``[model]``, under a fresh scalar head)
    or a local directory: a ``*ForTokenClassification`` with ``num_labels = 1`` (verl's critic), a
    critic a ``harts train`` checkpoint wrote (``step-N/critic``), or a causal LM whose backbone gets
    a fresh head. A fresh head is the family's ``*ForTokenClassification`` where transformers has
    one, else :class:`harts.ValueHead` (``harts.trainer.critic``). Its own AdamW (``lr``,
    ``weight_decay``, ``betas``, ``eps``) follows the run's ``[schedule]``; its gradients are
    clipped to ``max_grad_norm`` (absent: the run's; 0: not clipped). The value loss is verl's,
    ``value_clip`` its ``cliprange_value`` (0: unclipped), over ``aggregation``, under
    ``budget_tokens`` unique tokens per micro-batch (absent: ``run.budget_tokens``).
    """

    model: str = path_or(FROM_POLICY, "")  # a directory, resolved against the file's, or "policy"
    dtype: str | None = None  # None: the policy's
    device: str | None = None  # None: the policy's
    seed: int | None = None  # the fresh head's initialisation; None: the top-level seed
    lr: float = 1e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = None  # None: the run's max_grad_norm; 0: no clipping
    value_clip: float = 0.5  # 0: the unclipped loss
    aggregation: str = "token-mean"
    budget_tokens: int | None = None  # None: the run's run.budget_tokens

    def __post_init__(self):
        if not self.model:
            raise ValueError(f"critic.model: expected \"{FROM_POLICY}\" or a local model directory, got ''")
        if self.dtype is not None:
            one_of("critic.dtype", self.dtype, DTYPES)
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"critic.lr: expected a positive number, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"critic.weight_decay: expected >= 0, got {self.weight_decay}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"critic.betas: expected two numbers in [0, 1), got {list(self.betas)}")
        if not self.eps > 0:
            raise ValueError(f"critic.eps: expected a positive number, got {self.eps}")
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            raise ValueError(f"critic.max_grad_norm: expected >= 0, got {self.max_grad_norm}")
        if not 0 <= self.value_clip < float("inf"):
            raise ValueError(
                f"critic.value_clip: expected a number >= 0 (0: unclipped), got {self.value_clip}"
            )
        one_of("critic.aggregation", self.aggregation, CRITIC_AGGREGATIONS)
        positive_int("critic.budget_tokens", self.budget_tokens)

    @property
    def from_policy(self) -> bool:
        return self.model == FROM_POLICY
