"""Rollout files: JSONL and Parquet, one trajectory per line or row, read as :class:`harts.Rollout`.

Two forms (docs/rollout_files.md has every field and an example of each):

- **token form**: the fields of :class:`harts.Rollout`: ``tokens`` (required), ``loss_mask``,
  ``rollout_logprobs``, ``ref_logprobs``, ``advantages`` (a list, or one number for every
  position), ``reward``, ``group_id``, ``first_error_position``, ``routed_experts`` (the engine's
  MoE routes, ``[tokens][decoder layers][top-k]``, for routing replay), and for a multimodal model
  ``images`` (keys of pixel rows in a safetensors file, with their grids; optional ``image_file``:
  :mod:`harts.data.rollout_images`), read as ``pixel_values`` and ``image_grid_thw``.
- **chat form**: ``messages`` (a conversation, :mod:`harts.data.chat`), optional ``tools`` (the
  tool schemas the template renders), ``reward``, ``group_id`` and ``advantages`` (one number). It
  is tokenised with the chat template of the ``tokenizer`` the reader is given (a local directory
  or a loaded tokenizer), and the loss mask is true exactly on the assistant turns' tokens.

- **turns form**: one record per engine request, as an agent stack logs it: ``trajectory_id``,
  ``turn``, ``prompt_token_ids`` (the whole context), ``completion_token_ids``, optional
  ``completion_logprobs``, ``group_id`` and, on one turn, ``reward``; a group's records are
  gathered and each trajectory stitched exactly (:mod:`harts.data.turns`), split into pieces where
  its context drifted (or refused, with ``split_drift=False``).

A file holds one form: its first line or row sets it, and a line of the other form is refused.
Any other field is free metadata, kept beside the rollout, unless its name is a near miss of one
of the form's fields (``lossmask``, ``advantage``, ``Loss-Mask``: :func:`difflib.get_close_matches`
on the names lowercased without ``_``/``-``) and its value could be that field's: then the field
would silently take its default, so the line is refused, naming the field it resembles. Every
line or row is checked as it is read (the same checks as
:func:`harts.objectives.validate_rollouts`; with a tokenizer or a ``vocab_size``, token ids must
also lie in the vocabulary), and a bad one raises ValueError (TypeError for wrong kinds) naming
the file, the line (JSONL, 1-based) or row (Parquet, 0-based) and the field, before any compute.

:func:`iter_rollout_steps` streams a file as the batches of an optimizer step, keeping every group (the
rollouts of one ``group_id``, which must sit on consecutive lines) whole in one step, since a
group's advantage baseline needs all of it, and refusing a step whose rollouts do not carry the
same annotations (``rollout_logprobs``, ``ref_logprobs``, ``advantages``: all or none), as
:func:`harts.objectives.validate_rollouts` would at the step, naming the two lines.

What this leaves out: shuffling, and files too large for one pass per epoch (the reads stream,
but nothing is cached).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harts.data.chat import load_tokenizer, tokenize_chat
from harts.data.field_names import CHAT_FIELDS, ROLLOUT_FIELDS, STEP_ANNOTATIONS, check_names
from harts.data.rollout_images import IMAGE_FIELDS, ImageStore
from harts.data.turns import TURNS_FIELDS, TURNS_MARKERS, ContextDriftWarning, check_turn, stitch_trajectory
from harts.objectives.rollout import Rollout, validate_rollouts

__all__ = [
    "FileRollout",
    "iter_rollouts",
    "read_rollouts",
    "iter_rollout_steps",
    "iter_file_steps",
    "ROLLOUT_FIELDS",
    "CHAT_FIELDS",
    "TURNS_FIELDS",
    "IMAGE_FIELDS",
    "STEP_ANNOTATIONS",
    "ContextDriftWarning",
]

_TOKEN_ONLY = tuple(f for f in ROLLOUT_FIELDS if f not in CHAT_FIELDS)


@dataclass(frozen=True)
class FileRollout:
    """One rollout read from a file, with where it came from and its free metadata.

    ``form`` is ``"tokens"``, ``"chat"`` or ``"turns"``; a chat rollout's ``mask_from`` says how its
    loss mask was derived (``"progressive"`` or ``"generation markers"``, :mod:`harts.data.chat`). A
    turns-form trajectory split where its context drifted gives one rollout per piece: ``piece`` is
    (index, count), ``drift`` where the trajectory was first split.
    """

    rollout: Rollout
    where: str  # "file, line N" or "file, row N"
    metadata: dict[str, Any] = field(default_factory=dict)
    form: str = "tokens"
    mask_from: str | None = None
    piece: tuple[int, int] = (0, 1)
    drift: str | None = None


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


def _refuse_images(where: str, record: dict, form: str) -> None:
    """Images are read by reference in the token form only (:mod:`harts.data.rollout_images`): a line
    with the processor's image fields inline, or with images in another form, would otherwise keep
    them as metadata and train its image tokens as text."""
    for name in ("pixel_values", "image_grid_thw"):
        if name in record:
            raise _field_error(
                where,
                f"field {name!r}: rollout files hold token ids only, not images inline; name the line's "
                f'images in \'images\' ([{{"key": ..., "grid": [t, h, w]}}, ...]) and put their pixel rows '
                f"under those keys in a safetensors file (docs/rollout_files.md, images)",
            )
    for name in IMAGE_FIELDS:
        if form != "tokens" and record.get(name) is not None:
            raise _field_error(
                where,
                f"field {name!r}: images are read in the token form only (the {form} "
                f"form's token ids are derived, so image tokens would not line up)",
            )


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


def _rollout(
    where: str, record: dict, vocab_size: int | None = None, images: ImageStore | None = None
) -> FileRollout:
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
    pixels = images.pixels(where, record) if images is not None else None
    rollout = Rollout(
        tokens=record["tokens"],
        loss_mask=record.get("loss_mask"),
        rollout_logprobs=record.get("rollout_logprobs"),
        ref_logprobs=record.get("ref_logprobs"),
        advantages=advantages,
        reward=reward,
        group_id=group,
        first_error_position=record.get("first_error_position"),
        routed_experts=record.get("routed_experts"),
        pixel_values=None if pixels is None else pixels[0],
        image_grid_thw=None if pixels is None else pixels[1],
    )
    _validated(where, rollout, vocab_size)
    metadata = {k: v for k, v in record.items() if k not in ROLLOUT_FIELDS and k not in IMAGE_FIELDS}
    return FileRollout(rollout, where, metadata)


def _chat_rollout(where: str, record: dict, tokenizer: Any, vocab_size: int | None = None) -> FileRollout:
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
    rollout = Rollout(
        tokens=chat.tokens, loss_mask=chat.loss_mask, advantages=advantages, reward=reward, group_id=group
    )
    _validated(where, rollout, len(tokenizer) if vocab_size is None else vocab_size)
    metadata = {k: v for k, v in record.items() if k not in CHAT_FIELDS}
    return FileRollout(rollout, where, metadata, form="chat", mask_from=chat.mask_from)


def _form(record: dict) -> str:
    if record.get("messages") is not None:
        return "chat"
    if record.get("tokens") is None and any(record.get(name) is not None for name in TURNS_MARKERS):
        return "turns"
    return "tokens"


class _Turns:
    """The turns form's records gathered one group at a time (a trajectory's records may come in any
    order within its group; groups are consecutive), then stitched into trajectories."""

    def __init__(self, vocab_size: int | None, split_drift: bool):
        self.vocab_size, self.split_drift = vocab_size, split_drift
        self.key: Any = None
        self.group: Any = None
        self.records: dict[Any, list] = {}  # trajectory id -> [(where, record, checked)]
        self.seen: dict[Any, str] = {}  # every trajectory id of the file so far -> its first line
        self.groups: set = set()

    def add(self, where: str, record: dict) -> Iterator[FileRollout]:
        checked = check_turn(where, record, self.vocab_size)
        trajectory = checked[0]
        _, group = _reward_and_group(where, record)
        key = ("group", group) if group is not None else ("trajectory", trajectory)
        if key != self.key:
            yield from self.flush()
            if key in self.groups and key[0] == "group":
                raise _field_error(
                    where,
                    f"trajectory {trajectory!r}, field 'group_id': group {group!r} comes back after other "
                    f"groups; keep each group's records on consecutive lines",
                )
            self.key, self.group = key, group
            self.groups.add(key)
        if trajectory in self.seen and trajectory not in self.records:
            raise _field_error(
                where,
                f"trajectory {trajectory!r}, field 'trajectory_id': trajectory "
                f"{trajectory!r} also has records in another group or earlier "
                f"({self.seen[trajectory]}); a trajectory's records stay within their "
                f"group, the group's on consecutive lines",
            )
        self.seen.setdefault(trajectory, where)
        first = self.records.setdefault(trajectory, [])
        if first and record.get("group_id") != first[0][1].get("group_id"):
            raise _field_error(
                where,
                f"trajectory {trajectory!r}, field 'group_id': {record.get('group_id')!r}, but "
                f"{first[0][0]} gives {first[0][1].get('group_id')!r}",
            )
        first.append((where, record, checked))

    def flush(self) -> Iterator[FileRollout]:
        records, self.records = self.records, {}
        for turns in records.values():
            for piece in stitch_trajectory(turns, self.group, self.split_drift):
                _validated(piece.where, piece.rollout, self.vocab_size)
                yield FileRollout(
                    piece.rollout,
                    piece.where,
                    piece.metadata,
                    form="turns",
                    piece=(piece.piece, piece.pieces),
                    drift=piece.drift,
                )


def iter_rollouts(
    path: str | Path,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    split_drift: bool = True,
    warn: bool = True,
) -> Iterator[FileRollout]:
    """Each rollout of a ``.jsonl`` or ``.parquet`` file, checked as it is read.

    ``tokenizer``: a local tokenizer directory (``str`` / ``Path``, loaded once, never downloaded)
    or a loaded tokenizer. The chat form needs it; with it, the token form's ids are also checked
    against its vocabulary. ``vocab_size`` (a model's): token ids of any form must lie below it too.
    ``split_drift``: in the turns form, split a trajectory where its context drifted (else refuse
    it); ``warn``: then issue one :class:`ContextDriftWarning` saying how many were split and where
    the first is, once the file is read.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such rollout file")
    if tokenizer is not None:
        tokenizer = load_tokenizer(tokenizer)
    if tokenizer is not None:
        vocab_size = len(tokenizer) if vocab_size is None else min(vocab_size, len(tokenizer))
    first: tuple[str, str] | None = None  # (form, where) of the first line: the file's form
    names: dict = {}  # (field name, known names) -> the field it resembles, or None
    turns = _Turns(vocab_size, split_drift)
    images = ImageStore(path)  # each image read once in the pass
    split: list[str] = []
    for where, record in _records(path):
        form = _form(record)
        if form == "chat" and record.get("tokens") is not None:
            raise _field_error(where, "fields 'tokens' and 'messages': a line has one or the other, not both")
        if first is None:
            first = (form, where)
        elif form != first[0]:
            name = {"chat": "messages", "tokens": "tokens", "turns": "prompt_token_ids"}[form]
            raise _field_error(
                where,
                f"field {name!r}: this line is in the {form} form but {first[1]} is in the {first[0]} "
                f"form; a file holds one form",
            )
        check_names(where, record, form, names)
        _refuse_images(where, record, form)
        if form == "chat":
            yield _chat_rollout(where, record, tokenizer, vocab_size)
        elif form == "turns":
            for item in turns.add(where, record):
                split += [item.drift] if item.piece[0] == 0 and item.piece[1] > 1 else []
                yield item
        else:
            yield _rollout(where, record, vocab_size, images)
    for item in turns.flush():
        split += [item.drift] if item.piece[0] == 0 and item.piece[1] > 1 else []
        yield item
    if split and warn:
        warnings.warn(ContextDriftWarning(drift_line(path, len(split), split[0])), stacklevel=2)


def drift_line(path: Path, count: int, first: str) -> str:
    """One line saying how many trajectories were split where their context drifted, and the first."""
    return (
        f"{Path(path).name}: {count} trajector{'ies' if count > 1 else 'y'} split where the context "
        f"drifted (a turn's prompt does not start with the previous turn's prompt and completion), each "
        f"piece trained as its own sequence; first at {first}"
    )


def read_rollouts(path: str | Path, tokenizer: Any = None, split_drift: bool = True) -> list[Rollout]:
    """Every rollout of a file (see the module docstring for the fields; ``tokenizer`` and
    ``split_drift`` as in :func:`iter_rollouts`)."""
    return [r.rollout for r in iter_rollouts(path, tokenizer, split_drift=split_drift)]


def iter_rollout_steps(
    path: str | Path, rollouts_per_step: int, tokenizer: Any = None, split_drift: bool = True
) -> Iterator[list[Rollout]]:
    """The file as optimizer steps of at least ``rollouts_per_step`` rollouts, groups kept whole.

    A step closes at the first group boundary once it holds ``rollouts_per_step`` rollouts (the
    last step may hold fewer). A rollout without ``group_id`` is a group of its own. A group
    whose lines are not consecutive is refused, naming the line where it comes back, and so is a
    step whose rollouts carry different annotations (:data:`STEP_ANNOTATIONS`), naming two lines.
    ``tokenizer`` and ``split_drift`` as in :func:`iter_rollouts`; a piece of a split trajectory counts
    as one rollout.
    """
    for step in iter_file_steps(path, rollouts_per_step, tokenizer, split_drift=split_drift):
        yield [item.rollout for item in step]


def iter_file_steps(
    path: str | Path,
    rollouts_per_step: int,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    split_drift: bool = True,
    warn: bool = True,
) -> Iterator[list[FileRollout]]:
    """:func:`iter_rollout_steps` with each rollout's :class:`FileRollout` (where it is, its metadata);
    ``vocab_size``, ``split_drift`` and ``warn`` as in :func:`iter_rollouts`."""
    if isinstance(rollouts_per_step, bool) or not isinstance(rollouts_per_step, int) or rollouts_per_step < 1:
        raise ValueError(f"rollouts_per_step must be a positive int, got {rollouts_per_step!r}")
    step: list[FileRollout] = []
    seen: set = set()
    current = object()
    for item in iter_rollouts(path, tokenizer, vocab_size, split_drift, warn):
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
        if step:
            _same_annotations(step[0], item)
        step.append(item)
    if step:
        yield step


def _same_annotations(first: FileRollout, item: FileRollout) -> None:
    for name in STEP_ANNOTATIONS:
        has, had = getattr(item.rollout, name) is not None, getattr(first.rollout, name) is not None
        if has != had:
            raise ValueError(
                f"{item.where}, field {name!r}: {'given' if has else 'missing'}, but {first.where}, in the "
                f"same step, {'has none' if has else 'has it'}: the rollouts of a step carry the same "
                f"annotations (give {name!r} to every line or to none)"
            )
