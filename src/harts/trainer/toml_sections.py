"""TOML tables read into typed, frozen dataclasses: the layer under every config file harts reads.

Why a typed layer over the TOML table: a typo in a key (``lerning_rate``) or a value of the wrong
type would otherwise be ignored or fail deep inside a run. A section is a frozen dataclass whose
fields are its keys and whose type hints say what each takes; :func:`build_section` checks every
key of a table against them, and every error is one line naming the key (``optimizer.lr:
expected a number, got 'fast' (str)``), an unknown key listing the valid ones;
:func:`read_toml_config` puts the file's name in front. The sections themselves (``harts
train``'s in :mod:`harts.trainer.config` and :mod:`harts.trainer.sections`, ``harts rl``'s in
:mod:`harts.rl.config`) say only what their keys mean and which values they refuse.

Paths: a field typed ``Path`` is resolved against the file's directory, so a config and its data
can move together; a string field marked with :func:`path_or` is too, unless it holds one of its
keywords (``reference.model = "initial"``).

A section that mirrors a library dataclass (``[objective]``: ``harts.PolicyLossConfig``,
``[run]``: ``harts.RunConfig``) has its keys generated from that class by :func:`keys_of`, so a
field the class gains is a key of the file too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import tomllib
from dataclasses import field
from enum import Enum
from pathlib import Path
from typing import Union, get_args, get_origin, get_type_hints

__all__ = ["build_section", "read_toml_config", "convert", "describe", "keys_of", "enum_fields", "path_or"]

#: a field's metadata key: the keywords a path-or-keyword string field keeps as they are
_KEYWORDS = "harts_keywords"

#: what a value of each scalar type is called in an error
_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Path: "a string"}


def describe(value) -> str:
    """A value as an error shows it: ``'fast' (str)``."""
    return f"{value!r} ({type(value).__name__})"


def _is_union(hint) -> bool:
    return get_origin(hint) is Union or type(hint).__name__ == "UnionType"


def convert(key: str, value, hint):
    """``value`` as ``hint`` (TOML has no null, so ``X | None`` takes an X; ``X | Y`` takes the first
    of them the value is); errors name ``key``."""
    if _is_union(hint):
        options = [a for a in get_args(hint) if a is not type(None)]
        if len(options) > 1:
            for option in options:
                try:
                    return convert(key, value, option)
                except ValueError:
                    pass
            expected = " or ".join(_EXPECTED[o] for o in options)
            raise ValueError(f"{key}: expected {expected}, got {describe(value)}")
        hint = options[0]
    if hint in (bool, int, float, str, Path):
        return _convert_scalar(key, value, hint)
    origin = get_origin(hint) or hint
    if origin is tuple and get_args(hint)[-1] is Ellipsis:  # a list of any length
        if not isinstance(value, list):
            raise ValueError(f"{key}: expected a list, got {describe(value)}")
        return tuple(convert(f"{key}[{i}]", v, get_args(hint)[0]) for i, v in enumerate(value))
    if origin is tuple:
        items = get_args(hint)
        if not isinstance(value, list) or len(value) != len(items):
            raise ValueError(f"{key}: expected a list of {len(items)} numbers, got {describe(value)}")
        return tuple(convert(f"{key}[{i}]", v, h) for i, (v, h) in enumerate(zip(value, items, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a table, got {describe(value)}")
        return dict(value)
    raise TypeError(f"{key}: no converter for {hint}")  # pragma: no cover - a field type without one


def _convert_scalar(key: str, value, hint):
    """``value`` as one of TOML's scalars (a bool is no number; an int is a float)."""
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"{key}: expected a number, got {describe(value)}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected a string, got {describe(value)}")
    return Path(value) if hint is Path else value


def path_or(*keywords: str):
    """A required string field holding a local directory (resolved against the file's directory)
    or one of ``keywords`` (kept as it is)."""
    return field(metadata={_KEYWORDS: keywords})


def _is_path(hint) -> bool:
    return hint is Path or (_is_union(hint) and Path in get_args(hint))


def build_section(cls, table: dict, section: str, base: Path, sections=()):
    """``cls`` from one TOML table: unknown keys refused (listing the valid ones), types checked,
    paths resolved against ``base``. ``section`` is the table's name ("" for the top level, where a
    table under an unknown key is an unknown section, one of ``sections`` being valid)."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"[{section}]" if section else "the top level"
    kwargs = {}
    for key, value in table.items():
        dotted = f"{section}.{key}" if section else key
        if key not in fields:
            if not section and isinstance(value, dict):
                raise ValueError(f"unknown section [{key}]; valid sections: {', '.join(sections)}")
            raise ValueError(f"{dotted}: unknown key in {where}; valid keys: {', '.join(fields)}")
        value = convert(dotted, value, hints[key])
        if _is_path(hints[key]):
            value = (base / value.expanduser()).resolve()
        elif _KEYWORDS in fields[key].metadata and value not in fields[key].metadata[_KEYWORDS]:
            value = str((base / Path(value).expanduser()).resolve())
        kwargs[key] = value
    missing = [
        f.name
        for f in fields.values()
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{section + '.' if section else ''}{missing[0]}: required key missing in {where}")
    return cls(**kwargs)


def read_toml_config(path: str | Path, parse):
    """``parse(table, base, source=, text=)`` of the TOML file ``path`` (relative paths in it are
    relative to its folder); every error names the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such config file") from None
    try:
        return parse(tomllib.loads(text), path.parent.resolve(), source=path.resolve(), text=text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from None
    except (ValueError, FileNotFoundError) as exc:
        raise type(exc)(f"{path}: {exc}") from None


# ---- keys generated from a library dataclass ------------------------------------------------------


def _enum(hint) -> type[Enum] | None:
    return hint if isinstance(hint, type) and issubclass(hint, Enum) else None


def enum_fields(cls) -> dict[str, type[Enum]]:
    """``cls``'s fields that take an enum (alone, not in a union): in a file, one of its values."""
    return {name: enum for name, hint in get_type_hints(cls).items() if (enum := _enum(hint))}


def _file_type(hint):
    """``hint`` as a file gives it: an enum (alone or in a union) is its values' type (str)."""
    if _enum(hint):
        return type(next(iter(hint)).value)
    if _is_union(hint):
        return functools.reduce(operator.or_, (_file_type(a) for a in get_args(hint)))
    return hint


def keys_of(cls, name: str, module: str, exclude=()) -> type:
    """A frozen dataclass whose fields are ``cls``'s (less ``exclude``) as file keys, in ``cls``'s
    order: an enum is given by its value, so an enum field takes its values' type and an enum
    default becomes its value (a default is read by what it equals, never by its class, so a field
    whose default turns into an enum member keeps the same key and default)."""
    hints = get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        default = f.default.value if isinstance(f.default, Enum) else f.default
        keys.append(
            (f.name, _file_type(hints[f.name]), field(default=default, default_factory=f.default_factory))
        )
    generated = dataclasses.make_dataclass(name, keys, frozen=True)
    generated.__module__ = module
    return generated
