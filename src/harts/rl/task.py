"""The built-in task of ``harts rl``: a running sum over several turns, checked exactly.

An episode starts from a total ``c0`` (a digit) and a list of addends. Each turn the
environment asks ``c+b=`` (the current total and the next addend) and the model answers with one
character, the last digit of ``c + b``. After every turn but the last, the environment replies
with an observation: ``y`` or ``n`` (the checker's verdict on the answer), then ``|`` and the
next question, which shows the true total, so a wrong answer costs its own turn only. The reward
is the fraction of turns answered right, in [0, 1].

::

    <bos>add each number to the total; answer the last digit.|3+4=7y|7+5=2y|2+9=1
    \\------------------ system prompt -------------------/\\turn/ ^ answer, then observation

Why this task: the vocabulary is a few dozen characters, so a tiny randomly initialised model
can run it; the reward is verifiable and starts near chance (about 1/vocabulary); every prompt
shares the system prompt and every branch of an episode shares the earlier turns; and every
format is of fixed length (one-character totals and addends, one-character answers), so the
branches of a step sit in one unpadded batch at every turn.

What this leaves out: free-form answers of varying length and an end-of-turn token (answers are
exactly ``answer_tokens`` = 1 character), tasks other than this one, tokenizers (the task owns
its character vocabulary; the model's ``vocab_size`` must equal it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

__all__ = ["TaskKind", "TaskConfig", "Episode", "RunningSum", "build_task", "VOCAB", "SYSTEM_PROMPT"]

SYSTEM_PROMPT = "add each number to the total; answer the last digit."
# ids 0, 1, 2 are pad, eos and bos, as in the tiny model configs (harts.adapters.base.TINY_COMMON)
_SPECIALS = ("<pad>", "<eos>", "<bos>")
VOCAB: tuple[str, ...] = _SPECIALS + tuple(sorted(set("0123456789+=|yn" + SYSTEM_PROMPT)))
_ID = {ch: i for i, ch in enumerate(VOCAB)}
BOS = _ID["<bos>"]


class TaskKind(StrEnum):
    RUNNING_SUM = "running_sum"


@dataclass(frozen=True)
class TaskConfig:
    """``[task]``: which built-in task, and its size."""

    name: str = TaskKind.RUNNING_SUM.value
    turns: int = 3  # model turns per episode
    max_addend: int = 9  # addends are drawn from 1 .. max_addend

    def __post_init__(self):
        valid = [k.value for k in TaskKind]
        if self.name not in valid:
            raise ValueError(f"task.name: expected one of {', '.join(valid)}; got {self.name!r}")
        if not 1 <= self.turns <= 64:
            raise ValueError(f"task.turns: expected an integer in [1, 64], got {self.turns}")
        if not 1 <= self.max_addend <= 9:
            raise ValueError(
                f"task.max_addend: expected an integer in [1, 9] (one-digit addends), got {self.max_addend}"
            )


@dataclass(frozen=True)
class Episode:
    """One prompt: the starting total and the addend of each turn."""

    start: int
    addends: tuple[int, ...]

    def totals(self) -> list[int]:
        """The true total after each turn: the right answers."""
        out, total = [], self.start
        for b in self.addends:
            total = (total + b) % 10
            out.append(total)
        return out


def encode(text: str) -> list[int]:
    """Token ids of ``text`` in the task's character vocabulary."""
    ids = []
    for i, ch in enumerate(text):
        if ch not in _ID or ch in _SPECIALS:
            raise ValueError(f"character {ch!r} at position {i} of {text!r} is not in the task's vocabulary")
        ids.append(_ID[ch])
    return ids


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[int(i)] if VOCAB[int(i)] not in _SPECIALS else "" for i in ids)


class RunningSum:
    """The running-sum environment: prompts, observations, the checker and the reward."""

    answer_tokens = 1  # characters per model turn

    def __init__(self, config: TaskConfig):
        self.config = config
        self.vocab_size = len(VOCAB)

    @property
    def turns(self) -> int:
        return self.config.turns

    def episodes(self, n: int, rng: np.random.Generator) -> list[Episode]:
        """``n`` fresh episodes drawn from ``rng``."""
        starts = rng.integers(0, 10, size=n)
        addends = rng.integers(1, self.config.max_addend + 1, size=(n, self.turns))
        return [Episode(int(s), tuple(int(b) for b in row)) for s, row in zip(starts, addends, strict=True)]

    @staticmethod
    def _question(total: int, addend: int) -> str:
        return f"{total}+{addend}="

    def prompt(self, episode: Episode) -> list[int]:
        """The tokens before the first answer: bos, the system prompt, the first question."""
        self._check_episode(episode)
        return [BOS] + encode(SYSTEM_PROMPT + "|" + self._question(episode.start, episode.addends[0]))

    def observation(self, episode: Episode, turn: int, answer: Sequence[int]) -> list[int]:
        """What the environment says after the answer of ``turn`` (0-based; not after the last)."""
        if not 0 <= turn < self.turns - 1:
            raise ValueError(f"turn {turn}: the environment replies after turns 0 .. {self.turns - 2}")
        verdict = "y" if self.check(episode, turn, answer) else "n"
        return encode(verdict + "|" + self._question(episode.totals()[turn], episode.addends[turn + 1]))

    def check(self, episode: Episode, turn: int, answer: Sequence[int]) -> bool:
        """Whether ``answer`` (the token ids of one model turn) is the last digit of the new total."""
        if len(answer) != self.answer_tokens:
            raise ValueError(f"turn {turn}: an answer is {self.answer_tokens} token, got {len(answer)}")
        return decode(answer) == str(episode.totals()[turn])

    def reward(self, episode: Episode, answers: Sequence[Sequence[int]]) -> float:
        """The fraction of turns answered right."""
        if len(answers) != self.turns:
            raise ValueError(f"expected {self.turns} answers, got {len(answers)}")
        return sum(self.check(episode, t, a) for t, a in enumerate(answers)) / self.turns

    def _check_episode(self, episode: Episode) -> None:
        if len(episode.addends) != self.turns or not 0 <= episode.start <= 9:
            raise ValueError(f"episode {episode}: expected a start digit and {self.turns} addends")


def build_task(config: TaskConfig) -> RunningSum:
    return {TaskKind.RUNNING_SUM: RunningSum}[TaskKind(config.name)](config)
