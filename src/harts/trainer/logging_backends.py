"""Where a run's step records go besides ``metrics.jsonl``: TensorBoard event files, a wandb run.

``metrics.jsonl`` (:mod:`harts.trainer.progress`) is the record a resume trims and the plot
reads; the backends here are copies of the same records for the tools people watch runs with.
Each is checked to import before the model loads, and a missing package is refused naming the
extra that installs it (``pip install 'harts[logging]'``), not skipped: a run asked to log
somewhere and silently not doing it would be found out only after it ended.

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` into ``OUT/tensorboard``; every
  numeric field of a record is a scalar at the record's ``step``;
- ``wandb``: a run under ``OUT/wandb`` with the config as its ``config``, offline unless the
  user set ``WANDB_MODE`` (a training machine is often without network, and a run should not
  upload anywhere it was not told to); each session (a resume too) is a wandb run of its own,
  since wandb's steps only grow and a resumed run logs again the steps after its checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_backends", "open_backends", "Backend"]

_PACKAGES = {"tensorboard": ("tensorboard", "torch.utils.tensorboard"), "wandb": ("wandb", "wandb")}


def _import(name: str):
    package, module = _PACKAGES[name]
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ValueError(
            f"logging.backends: {name!r} needs the {package} package, which is not installed: "
            f"pip install 'harts[logging]' (or pip install {package})"
        ) from None


def check_backends(names: list[str]) -> None:
    """Every backend's package imports (ValueError naming the extra otherwise); before any compute."""
    for name in names:
        _import(name)


class Backend:
    """One destination of the step records: ``write(record)`` per step, ``close()`` at the end."""

    def write(self, record: dict) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def _scalars(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


class _TensorBoard(Backend):
    def __init__(self, out: Path):
        self._writer = _import("tensorboard").SummaryWriter(str(out / "tensorboard"))

    def write(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self._writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._writer.close()


class _Wandb(Backend):
    def __init__(self, out: Path, config: dict):
        wandb = _import("wandb")
        os.environ.setdefault("WANDB_MODE", "offline")
        settings = wandb.Settings(silent=True, console="off")
        self._run = wandb.init(project="harts", dir=str(out), name=out.name, config=config, settings=settings)

    def write(self, record: dict) -> None:
        self._run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


def open_backends(names: list[str], out: Path, config: dict) -> list[Backend]:
    """The backends ``names`` (``logging.writers``) writing under ``out``; ``config``: the TOML table."""
    return [_TensorBoard(out) if name == "tensorboard" else _Wandb(out, config) for name in names]
