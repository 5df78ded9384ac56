"""Synthetic rollout generators: token-id trajectories shaped like agentic RL rollout forests.

Each generator is deterministic given ``seed`` and ``vocab_size`` and returns ``list[list[int]]``
with every id in ``[0, vocab_size)``. The token ids are random: these shapes exercise the forest,
the planner and the executor (prefix sharing, branch points, depths, lengths), not a model's
language, so nothing here is tokenised text, and nothing carries annotations (loss masks,
advantages); those belong to the loss rows built elsewhere.

Shapes:

- :func:`star`: one prompt, G completions (a GRPO group).
- :func:`agentic`: a long system prompt, tasks, multi-turn rollouts that branch at turn
  boundaries, and dropped earlier-turn thinking (defaults: redundancy about 9).
- :func:`paper_like`: the same generator tuned to redundancy about 5.6.
- :func:`deep`: a long trunk and a full tree of branch points below it.
- :func:`random_forest`: arbitrary small shapes for property tests.

:func:`scaled` shrinks or grows any shape's lengths by one factor, so a benchmark can run the same
shape on a tiny CPU model (a few hundred tokens per trajectory) or at full size.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["star", "agentic", "paper_like", "deep", "random_forest", "scaled", "SHAPES"]


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=max(int(n), 0)).tolist()


def _jitter(rng: np.random.Generator, mean: int, spread: float = 0.5) -> int:
    """A length drawn uniformly from ``mean * [1 - spread, 1 + spread]``, at least 1.

    Real turns vary in length; equal lengths would hide bugs that only show when node boundaries
    fall at different positions in different subtrees.
    """
    lo, hi = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return int(rng.integers(lo, hi + 1))


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")


def star(
    prompt_len: int = 2048,
    num_completions: int = 8,
    completion_len: int = 512,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[list[int]]:
    """One prompt followed by ``num_completions`` independent completions (a GRPO group).

    Completion lengths vary by +-50% around ``completion_len``, as sampled completions do.
    """
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    prompt = _tokens(rng, prompt_len, vocab_size)
    return [prompt + _tokens(rng, _jitter(rng, completion_len), vocab_size) for _ in range(num_completions)]


@dataclass
class _Turn:
    """One assistant turn: thinking, the visible action, the tool's answer, and whether later
    turns' history drops this turn's thinking."""

    think: list[int]
    action: list[int]
    tool: list[int]
    drop_thinking: bool


def agentic(
    system_len: int = 4800,
    num_tasks: int = 4,
    rollouts_per_task: int = 8,
    turns: int = 6,
    turn_len: int = 700,
    branch_prob: float = 0.3,
    drop_thinking_prob: float = 0.9,
    user_len: int | None = None,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[list[int]]:
    """Multi-turn agentic rollouts over a shared system prompt.

    Every trajectory starts with the same ``system_len``-token system prompt, then its task's user
    prompt (``user_len``, default ``turn_len // 2``). A rollout is ``turns`` turns, each thinking
    (40% of ``turn_len``), an action (20%) and a tool answer (40%), lengths jittered +-50%.

    Rollout 0 of a task samples every turn. Rollout ``j > 0`` follows a random earlier rollout of
    the same task turn by turn, and at each turn boundary resamples with probability
    ``branch_prob``, after which all its later turns are its own (branches at turn boundaries).

    Dropped thinking: with probability ``drop_thinking_prob`` a turn's thinking is left out of the
    history of later turns. The sample that ends with that turn is then a trajectory of its own,
    and the rollout continues as a new trajectory that branches off at the start of the dropped
    thinking, the shape a chat template that strips earlier reasoning produces.

    Followed turns copy their drop decision too, so identical histories stay identical; two
    rollouts can thus emit identical trajectories (kept, as duplicates are real).
    """
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    user_len = turn_len // 2 if user_len is None else user_len
    system = _tokens(rng, system_len, vocab_size)
    out: list[list[int]] = []
    for _task in range(num_tasks):
        user = _tokens(rng, max(1, user_len), vocab_size)
        rollouts: list[list[_Turn]] = []
        for j in range(rollouts_per_task):
            parent = rollouts[int(rng.integers(j))] if j else None
            following = parent is not None
            record: list[_Turn] = []
            for t in range(turns):
                if following and rng.random() < branch_prob:
                    following = False
                if following:
                    assert parent is not None
                    record.append(parent[t])
                    continue
                record.append(
                    _Turn(
                        think=_tokens(rng, _jitter(rng, 0.4 * turn_len), vocab_size),
                        action=_tokens(rng, _jitter(rng, 0.2 * turn_len), vocab_size),
                        tool=_tokens(rng, _jitter(rng, 0.4 * turn_len), vocab_size),
                        drop_thinking=bool(rng.random() < drop_thinking_prob) and t < turns - 1,
                    )
                )
            rollouts.append(record)
            out.extend(_render(system + user, record))
    return out


def _render(context: list[int], record: list[_Turn]) -> list[list[int]]:
    """Trajectories of one rollout: one per dropped-thinking turn, plus the full final one."""
    trajectories = []
    context = list(context)
    for turn in record:
        if turn.drop_thinking:
            trajectories.append(context + turn.think + turn.action + turn.tool)
            context = context + turn.action + turn.tool
        else:
            context = context + turn.think + turn.action + turn.tool
    trajectories.append(context)
    return trajectories


def paper_like(
    system_len: int = 4800,
    num_tasks: int = 4,
    rollouts_per_task: int = 8,
    turns: int = 6,
    turn_len: int = 700,
    branch_prob: float = 0.5,
    drop_thinking_prob: float = 0.5,
    user_len: int | None = None,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[list[int]]:
    """:func:`agentic` with more branching and less dropped thinking: redundancy about 5.6, the
    figure HARTS measured on real agentic rollouts (the system prompt and turn sizes are kept)."""
    return agentic(
        system_len=system_len,
        num_tasks=num_tasks,
        rollouts_per_task=rollouts_per_task,
        turns=turns,
        turn_len=turn_len,
        branch_prob=branch_prob,
        drop_thinking_prob=drop_thinking_prob,
        user_len=user_len,
        vocab_size=vocab_size,
        seed=seed,
    )


def deep(
    trunk_len: int = 2048,
    depth: int = 4,
    branching: int = 3,
    seg_len: int = 256,
    end_prob: float = 0.1,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[list[int]]:
    """A trunk, then a full ``branching``-ary tree of ``depth`` levels of segments below it.

    Each leaf is a trajectory (``branching ** depth`` of them); in addition, with probability
    ``end_prob`` a trajectory also ends at an inner segment, so trajectories end at internal
    nodes too. Segment lengths jitter +-50%, so branch points sit at many different positions:
    this stresses execution planning (many waves, short nodes at depth).
    """
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    out: list[list[int]] = []

    def grow(prefix: list[int], level: int) -> None:
        if level == depth:
            out.append(prefix)
            return
        for _ in range(branching):
            child = prefix + _tokens(rng, _jitter(rng, seg_len), vocab_size)
            if level + 1 < depth and rng.random() < end_prob:
                out.append(child)
            grow(child, level + 1)

    grow(_tokens(rng, max(1, trunk_len), vocab_size), 0)
    return out


def random_forest(
    num_trajectories: int = 16,
    max_len: int = 24,
    vocab_size: int = 4,
    seed: int = 0,
) -> list[list[int]]:
    """Arbitrary small shapes for property tests: fresh trajectories, trajectories that share a
    random-length prefix with an earlier one, exact duplicates, and prefixes of earlier ones.

    A small ``vocab_size`` (the default 4) makes fresh trajectories collide on short prefixes too.
    """
    _check_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    for _ in range(num_trajectories):
        kind = rng.random() if out else 0.0
        if kind < 0.3:  # fresh
            out.append(_tokens(rng, int(rng.integers(1, max_len + 1)), vocab_size))
            continue
        base = out[int(rng.integers(len(out)))]
        if kind < 0.75:  # shared prefix, own suffix
            keep = int(rng.integers(0, len(base) + 1))
            extra = int(rng.integers(0 if keep else 1, max(max_len - keep, 1) + 1))
            out.append(base[:keep] + _tokens(rng, extra, vocab_size))
        elif kind < 0.88:  # exact duplicate
            out.append(list(base))
        else:  # prefix of an earlier trajectory
            out.append(base[: int(rng.integers(1, len(base) + 1))])
    return out


SHAPES: dict[str, Callable[..., list[list[int]]]] = {
    "star": star,
    "agentic": agentic,
    "paper_like": paper_like,
    "deep": deep,
    "random": random_forest,
}

# Length parameters that `scaled` multiplies; counts (tasks, turns, branching) stay as they are.
_LENGTH_PARAMS = (
    "prompt_len",
    "completion_len",
    "system_len",
    "turn_len",
    "user_len",
    "trunk_len",
    "seg_len",
    "max_len",
)


def scaled(shape_name: str, scale: float, **kwargs) -> list[list[int]]:
    """Shape ``shape_name`` (a key of :data:`SHAPES`) with every length default times ``scale``.

    Counts and probabilities are kept, so the tree's shape (and, roughly, its redundancy) stays
    while the token count shrinks: ``scaled("agentic", 0.03)`` gives trajectories of a few hundred
    tokens. Explicit ``kwargs`` override the scaled defaults.
    """
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}; expected one of {sorted(SHAPES)}")
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    params = inspect.signature(SHAPES[shape_name]).parameters.values()
    args = {
        p.name: max(1, round(p.default * scale))
        for p in params
        if p.name in _LENGTH_PARAMS and isinstance(p.default, int)
    }
    args.update(kwargs)
    return SHAPES[shape_name](**args)
