"""What a run starts from and a checkpoint must restore: the model, the data position, the RNG.

Why each piece is here:

- the model is built the same way on a fresh start and on resume (same dtype, same stock
  ``from_pretrained`` path, same modes), so a resumed run computes with the same modules;
- the data are streamed in file order, epoch after epoch, and a position (epoch, index of the
  next step in it) is enough to continue exactly where a run stopped; the file's sha256 is kept
  so a resume on a changed file is refused instead of silently training on other data;
- the random states (Python, NumPy, torch, CUDA) are saved and restored whole, so anything in
  the step that draws random numbers draws the same ones after a resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from harts.data.rollout_files import iter_rollout_steps
from harts.objectives.rollout import Rollout
from harts.testing import tiny_model
from harts.trainer.config import DataConfig, ModelConfig

__all__ = [
    "Position", "load_model", "own_memory", "rollout_steps", "count_steps", "data_stream", "fingerprint",
    "rng_state", "set_rng_state", "seed_everything",
]  # fmt: skip


@dataclass
class Position:
    """Where a run stands: steps done, the next step's (epoch, index) in the file, running totals."""

    step: int = 0
    epoch: int = 0
    index: int = 0
    rollouts: int = 0
    unique_tokens: int = 0
    flat_tokens: int = 0
    seconds: float = 0.0

    def advance(self, rollouts: int, unique: int, flat: int, seconds: float, steps_per_epoch: int) -> None:
        self.step += 1
        self.index += 1
        if self.index == steps_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        self.rollouts += rollouts
        self.unique_tokens += unique
        self.flat_tokens += flat
        self.seconds += seconds

    def to_dict(self) -> dict:
        return asdict(self)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' load/save progress bars off, so stderr carries only the run's own lines."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_model(config: ModelConfig, seed: int, checkpoint: Path | None = None) -> torch.nn.Module:
    """The model to train: from ``checkpoint`` when resuming, else ``config.path`` or a tiny model."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, config.dtype)
    # grouped_mm (the default experts kernel) has no fp64 path (as in harts.testing.tiny_model)
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    with quiet_transformers():
        source = checkpoint if checkpoint is not None else config.path
        if source is not None:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True, **extra)
        else:
            model = tiny_model(config.tiny, seed=seed if config.seed is None else config.seed, dtype=dtype)
    model.to(config.device)
    own_memory(model)
    if config.gradient_checkpointing:  # the newer name where transformers has it
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model.train()


def own_memory(model: torch.nn.Module) -> None:
    """Every parameter and buffer moved into memory of its own, freshly allocated (and so aligned).

    Why: loading from safetensors leaves tensors at arbitrary offsets, and CPU kernels take other
    vectorised paths for memory that is not aligned, which changes the low-order bits of
    reductions. Without this, the same weights loaded from a checkpoint compute slightly
    different gradients than the weights of the run that wrote it, and a resumed run drifts from
    an uninterrupted one. Tied weights stay tied (a shared Parameter is one object).
    """
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()


def rollout_steps(data: DataConfig) -> Iterator[list[Rollout]]:
    """One pass over the file as optimizer steps (``harts.iter_rollout_steps``; groups kept whole)."""
    if data.tokenizer is None:
        return iter_rollout_steps(data.path, data.rollouts_per_step)
    if "tokenizer" not in inspect.signature(iter_rollout_steps).parameters:
        raise ValueError(
            "data.tokenizer: this harts reads token-id rollout files only (its iter_rollout_steps takes no "
            "tokenizer); remove data.tokenizer or give a file of token ids"
        )
    return iter_rollout_steps(data.path, data.rollouts_per_step, tokenizer=str(data.tokenizer))


def count_steps(data: DataConfig) -> tuple[int, int]:
    """(optimizer steps, rollouts) in one pass over the file; reading it checks every line first."""
    steps = rollouts = 0
    for batch in rollout_steps(data):
        steps += 1
        rollouts += len(batch)
    if steps == 0:
        raise ValueError(f"data.path: {data.path} holds no rollouts")
    return steps, rollouts


def data_stream(data: DataConfig, epoch: int, index: int) -> Iterator[tuple[int, int, list[Rollout]]]:
    """``(epoch, index, rollouts)`` of every step from (``epoch``, ``index``) on, epoch after epoch."""
    while True:
        for i, batch in enumerate(rollout_steps(data)):
            if i >= index:
                yield epoch, i, batch
        epoch, index = epoch + 1, 0


def fingerprint(path: Path) -> dict:
    """Size and sha256 of a file: what a resume compares to refuse changed data."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every random state a step could draw from, in types ``torch.load(weights_only=True)`` reads."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
