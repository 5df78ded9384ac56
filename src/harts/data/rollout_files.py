"""Rollout files: JSONL and Parquet, one trajectory per line or row, read as :class:`harts.Rollout`.

Two forms (docs/rollout_files.md has every field and an example of each):

- **token form**: the fields of :class:`harts.Rollout`: ``tokens`` (required), ``loss_mask``,
  ``rollout_logprobs``, ``ref_logprobs``, ``advantages`` (a list, or one number for every
  position), ``reward``, ``group_id``, ``first_error_position``.
- **chat form**: ``messages`` (a conversation, :mod:`harts.data.chat`), optional ``tools`` (the
  tool schemas the template renders), ``reward``, ``group_id`` and ``advantages`` (one number). It
  is tokenised with the chat template of the ``tokenizer`` the reader is given (a local directory
  or a loaded tokenizer), and the loss mask is true exactly on the assistant turns' tokens.

A file holds one form: its first line or row sets it, and a line of the other form is refused.
Any other field is free metadata, kept beside the rollout. Every line or row is checked as it is
read (the same checks as :func:`harts.objectives.validate_rollouts`; with a tokenizer, token ids
must also lie in its vocabulary), and a bad one raises ValueError (TypeError for wrong kinds)
naming the file, the line (JSONL, 1-based) or row (Parquet, 0-based) and the field, before any
compute.

:func:`iter_rollout_steps` streams a file as the batches of an optimizer step, keeping every group (the
rollouts of one ``group_id``, which must sit on consecutive lines) whole in one step, since a
group's advantage baseline needs all of it.

What this leaves out: shuffling, and files too large for one pass per epoch (the reads stream,
but nothing is cached).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harts.data.chat import load_tokenizer, tokenize_chat
from harts.objectives.rollout import Rollout, validate_rollouts

__all__ = [
    "FileRollout", "iter_rollouts", "read_rollouts", "iter_rollout_steps", "ROLLOUT_FIELDS", "CHAT_FIELDS",
]  # fmt: skip

ROLLOUT_FIELDS = (
    "tokens", "loss_mask", "rollout_logprobs", "ref_logprobs", "advantages", "reward", "group_id",
    "first_error_position",
)  # fmt: skip
# the chat form's fields; the token form's per-position ones and first_error_position have no place there
CHAT_FIELDS = ("messages", "tools", "advantages", "reward", "group_id")
_TOKEN_ONLY = tuple(f for f in ROLLOUT_FIELDS if f not in CHAT_FIELDS)


@dataclass(frozen=True)
class FileRollout:
    """One rollout read from a file, with where it came from and its free metadata.

    ``form`` is ``"tokens"`` or ``"chat"``; a chat rollout's ``mask_from`` says how its loss mask
    was derived (``"progressive"`` or ``"generation markers"``, :mod:`harts.data.chat`).
    """

    rollout: Rollout
    where: str  # "file, line N" or "file, row N"
    metadata: dict[str, Any] = field(default_factory=dict)
    form: str = "tokens"
    mask_from: str | None = None


def _records(path: Path) -> Iterator[tuple[str, dict]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with path.open("r", encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                where = f"{path}, line {number}"
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
                yield where, record
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover - pyarrow ships with harts' extras
            raise ImportError("reading Parquet rollouts needs pyarrow: pip install 'harts[files]'") from None
        try:
            table = pq.ParquetFile(path)
        except Exception as exc:
            raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
        row = 0
        for batch in table.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield f"{path}, row {row}", record
                row += 1
    else:
        raise ValueError(f"{path}: unknown rollout file type {suffix!r}; expected .jsonl or .parquet")


def _field_error(where: str, message: str) -> ValueError:
    return ValueError(f"{where}, {message}")


def _reward_and_group(where: str, record: dict) -> tuple[Any, Any]:
    reward = record.get("reward")
    if isinstance(reward, float) and math.isnan(reward):
        raise _field_error(where, "field 'reward': NaN")
    group = record.get("group_id")
    if isinstance(group, (list, dict)):
        group = json.dumps(group, sort_keys=True)  # a hashable id for a structured one
    return reward, group


def _validated(where: str, rollout: Rollout, vocab_size: int | None) -> None:
    try:
        validate_rollouts([rollout], vocab_size=vocab_size)
    except (TypeError, ValueError) as exc:
        # "trajectory 0, position 3: ..." -> "file, line 7, position 3: ..."
        raise type(exc)(f"{where}{str(exc).removeprefix('trajectory 0')}") from None


def _rollout(where: str, record: dict, vocab_size: int | None = None) -> FileRollout:
    if "tokens" not in record or record["tokens"] is None:
        raise _field_error(
            where, "field 'tokens': missing (every line needs its token ids, or 'messages' in the chat form)"
        )
    for name in ("loss_mask", "rollout_logprobs", "ref_logprobs"):
        value = record.get(name)
        if value is not None and not isinstance(value, (list, tuple)):
            raise _field_error(where, f"field {name!r}: expected a list, got {type(value).__name__}")
    advantages = record.get("advantages")
    if advantages is not None and not isinstance(advantages, (list, tuple, int, float)):
        kind = type(advantages).__name__
        raise _field_error(where, f"field 'advantages': expected a list or a number, got {kind}")
    reward, group = _reward_and_group(where, record)
    rollout = Rollout(
        tokens=record["tokens"],
        loss_mask=record.get("loss_mask"),
        rollout_logprobs=record.get("rollout_logprobs"),
        ref_logprobs=record.get("ref_logprobs"),
        advantages=advantages,
        reward=reward,
        group_id=group,
        first_error_position=record.get("first_error_position"),
    )
    _validated(where, rollout, vocab_size)
    metadata = {k: v for k, v in record.items() if k not in ROLLOUT_FIELDS}
    return FileRollout(rollout, where, metadata)


def _chat_rollout(where: str, record: dict, tokenizer: Any) -> FileRollout:
    if tokenizer is None:
        raise _field_error(
            where,
            "field 'messages': the chat form needs a tokenizer (pass tokenizer= a local tokenizer "
            "directory or a loaded tokenizer) to apply its chat template",
        )
    for name in _TOKEN_ONLY:
        if record.get(name) is not None:
            raise _field_error(
                where,
                f"field {name!r}: not part of the chat form (a line has 'tokens' or 'messages', and "
                f"the chat form's loss mask comes from the roles)",
            )
    advantages = record.get("advantages")
    if advantages is not None and (isinstance(advantages, bool) or not isinstance(advantages, (int, float))):
        kind = type(advantages).__name__
        raise _field_error(
            where,
            f"field 'advantages': the chat form takes one number (token positions are not known "
            f"before tokenisation), got {kind}",
        )
    reward, group = _reward_and_group(where, record)
    chat = tokenize_chat(record["messages"], tokenizer, tools=record.get("tools"), where=where)
    rollout = Rollout(tokens=chat.tokens, loss_mask=chat.loss_mask, advantages=advantages, reward=reward,
                      group_id=group)  # fmt: skip
    _validated(where, rollout, len(tokenizer))
    metadata = {k: v for k, v in record.items() if k not in CHAT_FIELDS}
    return FileRollout(rollout, where, metadata, form="chat", mask_from=chat.mask_from)


def iter_rollouts(path: str | Path, tokenizer: Any = None) -> Iterator[FileRollout]:
    """Each rollout of a ``.jsonl`` or ``.parquet`` file, checked as it is read.

    ``tokenizer``: a local tokenizer directory (``str`` / ``Path``, loaded once, never downloaded)
    or a loaded tokenizer. The chat form needs it; with it, the token form's ids are also checked
    against its vocabulary.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such rollout file")
    if tokenizer is not None:
        tokenizer = load_tokenizer(tokenizer)
    vocab_size = None if tokenizer is None else len(tokenizer)
    first: tuple[str, str] | None = None  # (form, where) of the first line: the file's form
    for where, record in _records(path):
        form = "chat" if record.get("messages") is not None else "tokens"
        if form == "chat" and record.get("tokens") is not None:
            raise _field_error(where, "fields 'tokens' and 'messages': a line has one or the other, not both")
        if first is None:
            first = (form, where)
        elif form != first[0]:
            name = "messages" if form == "chat" else "tokens"
            raise _field_error(
                where,
                f"field {name!r}: this line is in the {form} form but {first[1]} is in the {first[0]} "
                f"form; a file holds one form",
            )
        if form == "chat":
            yield _chat_rollout(where, record, tokenizer)
        else:
            yield _rollout(where, record, vocab_size)


def read_rollouts(path: str | Path, tokenizer: Any = None) -> list[Rollout]:
    """Every rollout of a file (see the module docstring for the fields; ``tokenizer`` as in
    :func:`iter_rollouts`)."""
    return [r.rollout for r in iter_rollouts(path, tokenizer)]


def iter_rollout_steps(
    path: str | Path, rollouts_per_step: int, tokenizer: Any = None
) -> Iterator[list[Rollout]]:
    """The file as optimizer steps of at least ``rollouts_per_step`` rollouts, groups kept whole.

    A step closes at the first group boundary once it holds ``rollouts_per_step`` rollouts (the
    last step may hold fewer). A rollout without ``group_id`` is a group of its own. A group
    whose lines are not consecutive is refused, naming the line where it comes back.
    ``tokenizer`` as in :func:`iter_rollouts`.
    """
    if isinstance(rollouts_per_step, bool) or not isinstance(rollouts_per_step, int) or rollouts_per_step < 1:
        raise ValueError(f"rollouts_per_step must be a positive int, got {rollouts_per_step!r}")
    step: list[Rollout] = []
    seen: set = set()
    current = object()
    for item in iter_rollouts(path, tokenizer):
        group = item.rollout.group_id
        new_group = group is None or group != current
        if new_group and group is not None and group in seen:
            raise ValueError(
                f"{item.where}, field 'group_id': group {group!r} comes back after other groups; "
                f"keep each group's rollouts on consecutive lines"
            )
        if new_group and len(step) >= rollouts_per_step:
            yield step
            step = []
        if group is not None:
            seen.add(group)
        current = group if group is not None else object()
        step.append(item.rollout)
    if step:
        yield step
