"""The config sections of what a run does besides training: ``[lora]``, ``[eval]``, ``[samples]``.

They live apart from :mod:`harts.trainer.config` (which reads them with the rest, key by key) to
keep that module small; the shared value checks (``one_of``, ``positive_int``) live here too.
Every key, its default and meaning: ``docs/training.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LoRASection", "EvalSection", "SamplesSection", "one_of", "positive_int", "ALL_LINEAR"]

#: ``lora.target_modules`` for every linear layer but the output head (peft's own shorthand)
ALL_LINEAR = "all-linear"


def one_of(key: str, value: Any, valid) -> None:
    valid = [str(v) for v in valid]
    if value not in valid:
        raise ValueError(f"{key}: expected one of {', '.join(valid)}; got {value!r}")


def positive_int(key: str, value, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ValueError(f"{key}: expected {'a non-negative' if allow_zero else 'a positive'} integer, "
                         f"got {value}")  # fmt: skip


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
            raise ValueError(f"lora.target_modules: expected module names (e.g. [\"q_proj\", \"v_proj\"]) "
                             f"or [\"{ALL_LINEAR}\"], got {list(self.target_modules)}")  # fmt: skip

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
