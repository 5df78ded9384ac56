"""What a resume says of how this session differs from the one that wrote its checkpoint.

An exact resume ends with an uninterrupted run's bytes only on the same world size, thread count
(floating-point reductions depend on it), library versions and config; a resume that differs in
any of them still runs, and says which, so a result that is not bit-identical is never a surprise.
A checkpoint records what it needs for this (``state.json``: ``world_size``, ``threads``,
``versions``; ``config.toml``, the config as written).
"""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib

import torch

from harts.trainer.checkpoint import Checkpoint
from harts.trainer.config import TrainConfig
from harts.trainer.run import CONFIG

__all__ = ["run_versions", "resume_differences"]


def run_versions() -> dict:
    """What produced a checkpoint (bit-identical resume needs the same)."""
    out = {"python": sys.version.split()[0]}
    for name in ("harts", "torch", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
            out[name] = "unknown"
    return out


def _flatten(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_differences(start: Checkpoint, state: dict, config: TrainConfig, world: int) -> list[str]:
    """The lines saying where this session differs from ``start``'s (``state``: its ``state.json``):
    its rank count, thread count, library versions, config keys (``out`` aside)."""
    name, lines = start.path.name, []
    if state.get("world_size", 1) != world:
        lines.append(
            f"{name} was written by {state.get('world_size', 1)} rank(s), this run has {world}: the "
            f"state is resharded; the result matches an uninterrupted run to floating-point "
            f"rounding, not bit for bit"
        )
    threads = config.threads or torch.get_num_threads()
    if state.get("threads") != threads:
        lines.append(
            f"warning: {name} ran with {state.get('threads')} threads, this run with {threads}: the "
            f"result will not be bit-identical to an uninterrupted run"
        )
    versions = {k: v for k, v in run_versions().items() if state.get("versions", {}).get(k) != v}
    if versions:
        now = ", ".join(f"{k} {v}" for k, v in versions.items())
        lines.append(
            f"warning: {name} was written with other versions than this run's ({now}): the result "
            f"may not be bit-identical to an uninterrupted run"
        )
    try:
        before = _flatten(tomllib.loads((start.path / CONFIG).read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError):
        before = {}
    now = _flatten(config.table)
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k) and k != "out")
    if changed:
        lines.append(
            f"warning: the config differs from {name}'s in {', '.join(changed)}: the resumed run "
            f"follows the new one"
        )
    return lines
