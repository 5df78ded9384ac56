"""Checkpoints that survive a kill at any instant: written aside, verified before anything loads.

A checkpoint is a directory ``OUT/checkpoints/step-000012/``. It is written into a temporary
sibling (``.tmp-step-000012-<pid>``); every file is flushed to disk (``fsync``) and hashed; the
manifest (``manifest.json``: each file's size and sha256) is written last, and only then is the
directory renamed to its final name, one atomic ``os.replace``, followed by an ``fsync`` of the
parent. So a ``step-*`` directory either holds a whole checkpoint or does not exist; a kill
leaves at most a ``.tmp-*`` directory, which is never read and is removed by the next save.

Before anything of a checkpoint is loaded, :func:`verify` re-reads every file the manifest lists
and compares sizes and hashes: a truncated or altered checkpoint is refused with the file named,
never half-loaded. Old checkpoints beyond ``keep_last`` are renamed aside (``.old-*``) before
they are deleted, so a kill during the deletion leaves no half-deleted ``step-*`` directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "list_checkpoints",
    "write_checkpoint",
    "verify",
    "latest",
    "prune",
    "run_lock",
]

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_SCRATCH = (".tmp-", ".old-")


class CheckpointError(ValueError):
    """A checkpoint that is incomplete or does not match its manifest."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """The ``step-*`` directories under ``root``, oldest first (scratch directories are not listed)."""
    if not root.is_dir():
        return []
    found = [Checkpoint(p, int(m.group(1))) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found, key=lambda c: c.step)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _remove(path: Path, root: Path) -> None:
    """Delete a directory by first renaming it to a scratch name, so no partial ``step-*`` remains."""
    aside = root / f".old-{path.name}-{os.getpid()}"
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def remove_scratch(root: Path) -> list[str]:
    """Remove what killed saves and deletions left behind (``.tmp-*``, ``.old-*``); their names."""
    if not root.is_dir():
        return []
    removed = []
    for p in root.iterdir():
        if p.name.startswith(_SCRATCH):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
    return sorted(removed)


def write_checkpoint(
    root: Path,
    step: int,
    write: Callable[[Path], None],
    main: bool = True,
    barrier: Callable[[], None] | None = None,
) -> Path:
    """Call ``write(directory)`` to fill a fresh directory, then publish it atomically as step ``step``.

    Several ranks: every rank calls this with its own ``write`` (each writes its files into the
    same directory); ``main`` (one rank) prepares, hashes and publishes, and ``barrier`` waits for
    every rank between the phases.
    """
    barrier = barrier or (lambda: None)
    final = root / step_name(step)
    tmp = root / f".tmp-{final.name}"  # one name for every rank; the run lock keeps runs apart
    if main:
        root.mkdir(parents=True, exist_ok=True)
        remove_scratch(root)
        tmp.mkdir()
    barrier()
    write(tmp)
    barrier()
    if main:
        _publish(root, step, tmp, final)
    barrier()
    return final


def _publish(root: Path, step: int, tmp: Path, final: Path) -> None:
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(path)
        files[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = tmp / MANIFEST
    with manifest.open("w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda p: -len(p.parts)):
        _fsync(d)
    if final.exists():  # the same step saved again (a resumed run that had already reached it)
        _remove(final, root)
    os.replace(tmp, final)
    _fsync(root)


def verify(checkpoint: Checkpoint) -> dict:
    """The manifest of ``checkpoint`` after checking every file's size and sha256 against it."""
    path = checkpoint.path

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} is incomplete or corrupt: {why}")

    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise bad(f"no {MANIFEST} (it is written last, so the save never finished)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"{MANIFEST} is not valid JSON ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
        raise bad(f"{MANIFEST} is not a harts checkpoint manifest (format {FORMAT})")
    if manifest.get("step") != checkpoint.step:
        raise bad(f"{MANIFEST} is for step {manifest.get('step')}, the directory for step {checkpoint.step}")
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise bad(f"{name} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise bad(f"{name} has {size} bytes, the manifest says {entry['size']} (truncated?)")
        if _sha256(file) != entry["sha256"]:
            raise bad(f"{name} does not match its sha256 in the manifest")
    return manifest


def latest(root: Path) -> Checkpoint | None:
    """The newest checkpoint under ``root``, verified; None when there is none.

    A newest checkpoint that fails verification is refused (CheckpointError naming the file and
    the previous checkpoint), not skipped: a silent fall-back would hide lost steps.
    """
    found = list_checkpoints(root)
    if not found:
        return None
    newest = found[-1]
    try:
        verify(newest)
    except CheckpointError as exc:
        hint = (
            f"; delete it to resume from {found[-2].path.name}"
            if len(found) > 1
            else "; delete it to start over"
        )
        raise CheckpointError(f"{exc}{hint}") from None
    return newest


def prune(root: Path, keep_last: int) -> list[Checkpoint]:
    """Delete all but the newest ``keep_last`` checkpoints; returns the deleted ones."""
    found = list_checkpoints(root)
    doomed = found[: max(0, len(found) - keep_last)]
    for checkpoint in doomed:
        _remove(checkpoint.path, root)
    return doomed


@contextlib.contextmanager
def run_lock(out: Path, command: str):
    """One run per output directory: an exclusive lock the OS drops when the process dies."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield
        return
    with (out / ".lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{out} is in use by another {command}") from None
        yield
