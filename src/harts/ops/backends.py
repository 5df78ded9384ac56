"""Op backends: the one seam where device-specific kernels plug in.

The executor and the adapters never call a kernel directly. A recurrence
(:class:`~harts.ops.recurrence.Recurrence`) asks :func:`current_backend` for the kernel registered
under its name (the contract's chunked-op signature: batched right-padded segments, per-segment fp32
initial states, final states, optional states at inner positions) and runs its own plain-PyTorch op
when the backend has none; tree attention asks for the backend's attention kernel (the signature of
:func:`harts.ops.tree_attention.tree_attention` over a
:class:`~harts.plan.attention.TreeAttentionPlan`), which is the plain one unless the backend gives
its own. A backend names only what it accelerates. Planners and adapters are untouched when a
backend is added: register it with :func:`register_backend` and select it with :func:`use_backend`.

Built in: ``torch``, plain PyTorch on any device (the CPU path, and a correct GPU path through
SDPA and batched matmuls), the default: a :class:`Backend` with nothing of its own, so every
recurrence runs its plain op and attention the plain tree attention.
Registered: ``fla`` (:mod:`harts.ops.fla_backend`): flash-linear-attention's varlen ``chunk_kda`` /
``chunk_gated_delta_rule`` for the delta rule and a FlexAttention block mask for tree attention,
for CUDA devices; it needs the ``gpu`` extra and is imported only when first selected, so an
install without it never loads fla or triton (docs/gpu.md says what was validated where).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from harts.ops.tree_attention import tree_attention

__all__ = [
    "Backend",
    "register_backend",
    "use_backend",
    "current_backend",
    "available_backends",
    "resolve_backend",
    "gpu_extra_installed",
    "temporary_backend",
]


@dataclass(frozen=True)
class Backend:
    """A set of kernels, each defaulting to the plain one: ``recurrences`` maps a recurrence's name
    (``Recurrence.name``) to the chunked op that replaces its plain one (none: every recurrence runs
    its own); ``attention`` is the tree-attention kernel (by default
    :func:`~harts.ops.tree_attention.tree_attention`)."""

    name: str
    recurrences: Mapping[str, Callable] = field(default_factory=dict)
    attention: Callable = tree_attention


def _torch_backend() -> Backend:
    return Backend("torch")


def _fla_backend() -> Backend:
    from harts.ops.fla_backend import RECURRENCES, flex_tree_attention, require_fla

    require_fla()
    return Backend("fla", RECURRENCES, flex_tree_attention)


_REGISTRY: dict[str, Callable[[], Backend]] = {"torch": _torch_backend, "fla": _fla_backend}
_ACTIVE = ["torch"]
_CACHE: dict[str, Backend] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Make ``factory()`` (called lazily, so optional imports stay optional) selectable by ``name``."""
    _REGISTRY[name] = factory
    _CACHE.pop(name, None)


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def current_backend() -> Backend:
    name = _ACTIVE[-1]
    if name not in _CACHE:
        _CACHE[name] = _REGISTRY[name]()
    return _CACHE[name]


@functools.cache
def gpu_extra_installed() -> bool:
    """Whether flash-linear-attention and triton (the ``gpu`` extra) are importable (not imported);
    looked up once per process, not on every step."""
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


def resolve_backend(name: str, device) -> tuple[str, str]:
    """The backend a run configured with ``name`` uses on ``device``, and why, in a few words.

    A named backend is used as named. ``auto`` keeps the backend of an enclosing :func:`use_backend`
    context; outside one, it picks ``fla`` on a CUDA device when the ``gpu`` extra is installed and
    ``torch`` otherwise.
    """
    if name != "auto":
        if name not in _REGISTRY:
            raise ValueError(f"unknown backend {name!r}; available: auto, {', '.join(available_backends())}")
        return name, "configured"
    if len(_ACTIVE) > 1:
        return _ACTIVE[-1], "the enclosing use_backend context"
    cuda = getattr(device, "type", str(device).split(":")[0]) == "cuda"
    if cuda and gpu_extra_installed():
        return "fla", "auto: a CUDA device and the gpu extra installed"
    if cuda:
        return "torch", "auto: a CUDA device without the gpu extra (pip install 'harts[gpu]' for fla)"
    return "torch", f"auto: {device} device"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[Backend]:
    """Run the enclosed code with backend ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(available_backends())}")
    _ACTIVE.append(name)
    try:
        yield current_backend()
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def temporary_backend(key: str, backend: Backend) -> Iterator[str]:
    """``backend`` selectable as ``key`` while the block runs, and unknown again after it (a check
    that watches a call's kernels runs them under a backend of its own, never left registered).
    ``backend.name`` may be another's: what a plan decides by the backend's name (the executor's
    chunk tree under a device backend) is then decided as under that one."""
    if key in _REGISTRY:
        raise ValueError(f"a backend named {key!r} is already registered")
    register_backend(key, lambda: backend)
    try:
        yield key
    finally:
        _REGISTRY.pop(key, None)
        _CACHE.pop(key, None)
