"""What a run starts from and a checkpoint must restore: the model, the data position, the RNG.

Why each piece is here:

- the model is built the same way on a fresh start and on resume (same dtype, same stock
  ``from_pretrained`` path, same modes), so a resumed run computes with the same modules;
- the data are checked whole before the model loads (:func:`check_data`: every line against the
  model's vocabulary and the objective's needs, every step's annotations), so a bad last line
  stops the run before its first step, not at the step that reads it;
- the data are streamed in file order, epoch after epoch, and a position (epoch, index of the
  next step in it) is enough to continue exactly where a run stopped; the file's sha256 is kept
  so a resume on a changed file is refused instead of silently training on other data (or, when
  asked, continues from the position on the changed file, saying what changed: :func:`data_change`);
- the random states (Python, NumPy, torch, CUDA) are saved and restored whole, so anything in
  the step that draws random numbers draws the same ones after a resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from harts.adapters.base import registered_adapter
from harts.data.rollout_files import drift_line, iter_file_steps
from harts.objectives.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from harts.objectives.rollout import Rollout
from harts.tiny import tiny_config, tiny_model, tiny_vision_language_model
from harts.trainer.config import TRAIN_ESTIMATORS, DataConfig, ModelConfig, ObjectiveConfig, PPOSection
from harts.trainer.routes_check import RoutesSeen

__all__ = [
    "Position",
    "load_model",
    "loading_options",
    "own_memory",
    "rollout_steps",
    "count_steps",
    "data_stream",
    "fingerprint",
    "rng_state",
    "set_rng_state",
    "seed_everything",
    "DataCheck",
    "check_data",
    "model_vocab_size",
    "check_embedding",
    "data_change",
    "ACCEPT_CHANGED_DATA",
    "group_spans",
    "count_groups",
]

#: the ``harts train`` flag that resumes on a changed rollout file
ACCEPT_CHANGED_DATA = "--accept-changed-data"


@dataclass
class Position:
    """Where a run stands: optimizer updates done (``step``), the (epoch, index) in the file of the
    step of rollouts in progress or next, and within it the next update's PPO epoch and
    mini-batch (both 0 between steps of rollouts, and always without ``[ppo]``); running totals."""

    step: int = 0
    epoch: int = 0
    index: int = 0
    rollouts: int = 0
    unique_tokens: int = 0
    flat_tokens: int = 0
    seconds: float = 0.0
    ppo_epoch: int = 0
    mini_batch: int = 0

    @property
    def within_step(self) -> bool:
        """Whether some but not all updates of the current step of rollouts are done."""
        return (self.ppo_epoch, self.mini_batch) != (0, 0)

    def advance(
        self,
        rollouts: int,
        unique: int,
        flat: int,
        seconds: float,
        steps_per_epoch: int,
        ppo: PPOSection | None = None,
    ) -> None:
        """One optimizer update done (over ``rollouts`` rollouts); the next step of rollouts once
        its ``ppo.epochs`` x ``ppo.mini_batches`` updates are."""
        self.step += 1
        self.mini_batch += 1
        if self.mini_batch == (ppo.mini_batches if ppo else 1):
            self.ppo_epoch, self.mini_batch = self.ppo_epoch + 1, 0
        if self.ppo_epoch == (ppo.epochs if ppo else 1):
            self.ppo_epoch, self.index = 0, self.index + 1
        if self.index == steps_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        self.rollouts += rollouts
        self.unique_tokens += unique
        self.flat_tokens += flat
        self.seconds += seconds

    def to_dict(self) -> dict:
        return asdict(self)

    def fit(self, steps_per_epoch: int) -> bool:
        """Move a position past the end of an epoch (a file that got shorter) to the next epoch's start."""
        if self.index < steps_per_epoch:
            return False
        self.epoch, self.index = self.epoch + 1, 0
        return True


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


def causal_lm_loader(source):
    """The transformers auto class that loads the checkpoint ``source`` for text training: the
    family's (:attr:`harts.adapters.base.FamilyAdapter.auto_class`), else the causal LM's."""
    import transformers
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(source, local_files_only=True).model_type
    adapter = registered_adapter(model_type)
    return getattr(transformers, adapter.auto_class if adapter is not None else "AutoModelForCausalLM")


def loading_options(dtype: torch.dtype) -> dict:
    """What ``from_pretrained`` takes to load a checkpoint as harts runs it: from the local files
    only; without the hub kernels transformers 5.25 swaps in by default (harts chooses its kernels
    through ``[run] backend``, and the stock forward it is held to is the modules' own); and eager
    MoE experts in fp64 (grouped_mm, the default experts kernel, has no fp64 path)."""
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return {"local_files_only": True, "use_kernels": False, **extra}


def load_model(
    config: ModelConfig, seed: int, checkpoint: Path | None = None, images: bool = False
) -> torch.nn.Module:
    """The model to train: from ``checkpoint`` when resuming, else ``config.path`` or a tiny model;
    ``images``: as its multimodal model (``AutoModelForImageTextToText``, vision tower and all), for
    rollouts that carry images, else as its text causal LM."""
    from transformers import AutoModelForImageTextToText

    dtype = getattr(torch, config.dtype)
    with quiet_transformers():
        source = checkpoint if checkpoint is not None else config.path
        if source is not None:
            loader = AutoModelForImageTextToText if images else causal_lm_loader(source)
            model = loader.from_pretrained(source, dtype=dtype, **loading_options(dtype))
        else:
            build = tiny_vision_language_model if images else tiny_model
            model = build(config.tiny, seed=seed if config.seed is None else config.seed, dtype=dtype)
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
    """One pass over the file as optimizer steps (``harts.iter_rollout_steps``; groups kept whole).
    Quiet about trajectories split where their context drifted: :func:`check_data` reports them."""
    tokenizer = None if data.tokenizer is None else str(data.tokenizer)
    steps = iter_file_steps(
        data.path, data.rollouts_per_step, tokenizer, split_drift=data.split_drift, warn=False
    )
    return ([item.rollout for item in step] for step in steps)


def count_steps(data: DataConfig) -> tuple[int, int]:
    """(optimizer steps, rollouts) in one pass over the file; reading it checks every line first."""
    check = check_data(data)
    return check.steps, check.rollouts


@dataclass(frozen=True)
class DataCheck:
    """What one checking pass over the rollout file found (:func:`check_data`)."""

    steps: int  # optimizer steps per epoch
    rollouts: int
    form: str  # "tokens", "chat" or "turns"
    extra_fields: dict  # field that is no rollout field -> (lines that have it, where it first is)
    max_token: tuple[int, str]  # the largest token id, and where it is ("file, line N, position P")
    # turns form: trajectories split where their context drifted, and where the first one was split
    split: tuple[int, str] | None = None
    images: tuple[int, str] | None = None  # rollouts with images, and where the first one is
    routes: RoutesSeen | None = None  # the recorded MoE routes, when any line has them

    def extra_fields_line(self, path: Path) -> str | None:
        """One line naming the fields harts does not read and the trajectories split where their
        context drifted (turns form), or None when there are neither."""
        parts = []
        if self.extra_fields:
            listed = ", ".join(
                f"{name!r} ({count} line{'s' if count > 1 else ''}, first {_line(where)})"
                for name, (count, where) in self.extra_fields.items()
            )
            what = "fields that are not rollout fields, kept as metadata, not trained on"
            parts.append(f"{path.name}: {what}: {listed}")
        if self.split is not None:
            parts.append(drift_line(path, *self.split))
        return "; ".join(parts) or None


def _line(where: str) -> str:
    """ "line N" (or "row N") of a rollout's "file, line N[, trajectory ...]"."""
    found = re.findall(r", ((?:line|row) \d+)", where)
    return found[-1] if found else where


def model_vocab_size(config: ModelConfig) -> int | None:
    """The vocabulary size of the model ``config`` names, read from its config (the model is not loaded)."""
    if config.tiny is not None:
        hf = tiny_config(config.tiny)
    else:
        from transformers import AutoConfig

        try:
            hf = AutoConfig.from_pretrained(config.path, local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
            raise ValueError(f"model.path: {config.path}: its config.json does not load ({exc})") from None
    size = getattr(hf, "vocab_size", None)
    if size is None and hasattr(hf, "get_text_config"):
        size = getattr(hf.get_text_config(), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _needs(
    objective: ObjectiveConfig, reference: bool = False, ppo: PPOSection | None = None
) -> list[tuple[str, bool, str]]:
    """(field, whether a line must have it (else: must not), why) for what ``objective`` reads,
    given whether a ``[reference]`` computes the reference log-probs and ``[ppo]`` the old ones."""
    loss = objective.loss_config()
    kind, estimator = loss.kind.value, objective.advantage
    needs = []
    if estimator is not None:
        why = f"objective.advantage = {estimator!r} estimates the advantages, but this line has its own"
        needs.append(("advantages", False, f"{why}: remove one of them"))
        if ADVANTAGE_ESTIMATORS[AdvantageEstimator(estimator)].needs_reward:
            needs.append(("reward", True, f"objective.advantage = {estimator!r} reads each rollout's reward"))
    elif loss.policy_loss.needs_advantages:
        estimators = ", ".join(TRAIN_ESTIMATORS)
        needs.append(
            (
                "advantages",
                True,
                f"objective.kind = {kind!r} needs advantages: give every line "
                f"'advantages', or set objective.advantage ({estimators}) to "
                f"estimate them from rewards",
            )
        )
    if loss.policy_loss.needs_behaviour_logprobs and (ppo is None or ppo.old_logprobs == "rollout"):
        how = "" if ppo is None else " (ppo.old_logprobs = 'rollout')"
        why = f"objective.kind = {kind!r} needs the sampler's log-probs{how}"
        needs.append(("rollout_logprobs", True, why))
    if loss.needs_ref_logprobs and reference:
        needs.append(
            (
                "ref_logprobs",
                False,
                "[reference] computes the reference log-probs: remove the file's or the [reference] section",
            )
        )
    elif loss.needs_ref_logprobs:
        needs.append(
            (
                "ref_logprobs",
                True,
                f"objective.kl_coef = {loss.kl_coef} needs reference log-probs "
                f"(or a [reference] section to compute them)",
            )
        )
    return needs


_CHAT_LOGPROBS = (
    " (the chat form has none, its text being tokenised anew: compute them with "
    "[ppo] old_logprobs = 'policy', train with objective.kind = 'sft', or log the token "
    "form)"
)


def check_data(
    data: DataConfig,
    objective: ObjectiveConfig | None = None,
    vocab_size: int | None = None,
    reference: bool = False,
    ppo: PPOSection | None = None,
) -> DataCheck:
    """One pass over the rollout file that checks all of it before any compute, one step in memory.

    Every line as :func:`harts.iter_rollout_steps` reads it (its fields, misspelled names, lengths,
    NaN/inf, log-probs, groups on consecutive lines, the same annotations within each step) with
    token ids below ``vocab_size`` (the model's), and, given ``objective``, the fields it needs on
    every line (what its loss kind and estimator declare, ``harts.POLICY_LOSSES`` and
    ``harts.ADVANTAGE_ESTIMATORS``: advantages or rewards, the sampler's ``rollout_logprobs``;
    ``ref_logprobs`` for a KL term; unless ``reference`` or ``ppo`` computes them), and at least
    ``ppo.mini_batches`` groups in every step (a group is never split). A ValueError names the
    file, the line and the step.
    """
    tokenizer = None if data.tokenizer is None else str(data.tokenizer)
    needs = _needs(objective, reference, ppo) if objective is not None else []
    steps = rollouts = 0
    form = "tokens"
    extra: dict[str, tuple[int, str]] = {}
    top = (-1, "")
    split, first_split = 0, ""
    images, first_image = 0, ""
    routes = None
    batches = iter_file_steps(
        data.path, data.rollouts_per_step, tokenizer, vocab_size, data.split_drift, warn=False
    )
    for steps, batch in enumerate(batches, 1):
        rollouts += len(batch)
        if ppo is not None and (groups := count_groups([item.rollout for item in batch])) < ppo.mini_batches:
            raise ValueError(
                f"{batch[0].where} (step {steps}): ppo.mini_batches = {ppo.mini_batches}, but this step has "
                f"{groups} group{'s' if groups > 1 else ''} ({len(batch)} rollouts) and a group is never "
                f"split across mini-batches: lower ppo.mini_batches or raise data.rollouts_per_step"
            )
        for item in batch:
            form = item.form
            if item.piece[0] == 0 and item.piece[1] > 1:
                split, first_split = split + 1, first_split or item.drift
            if item.rollout.pixel_values is not None:
                images, first_image = images + 1, first_image or item.where
            for field, wanted, why in needs:
                value = getattr(item.rollout, field)
                if (value is not None) != wanted:
                    state = "missing" if wanted else "given"
                    if field == "rollout_logprobs" and item.form == "chat":
                        why += _CHAT_LOGPROBS
                    raise ValueError(f"{item.where} (step {steps}), field {field!r}: {state}: {why}")
            for name in item.metadata:
                count, where = extra.get(name, (0, item.where))
                extra[name] = (count + 1, where)
            if item.rollout.routed_experts is not None:
                routes = RoutesSeen.add(routes, item.where, np.asarray(item.rollout.routed_experts))
            tokens = np.asarray(item.rollout.tokens)
            if tokens.size and int(tokens.max()) > top[0]:
                top = (int(tokens.max()), f"{item.where}, position {int(tokens.argmax())}")
    if steps == 0:
        raise ValueError(f"data.path: {data.path} holds no rollouts")
    return DataCheck(
        steps,
        rollouts,
        form,
        extra,
        top,
        (split, first_split) if split else None,
        (images, first_image) if images else None,
        routes,
    )


def group_spans(rollouts: list[Rollout]) -> list[range]:
    """The groups of a step as ranges of its rollouts: consecutive rollouts of one ``group_id``
    (the file keeps a group's lines together); a rollout without one is a group of its own."""
    spans: list[range] = []
    for i, r in enumerate(rollouts):
        if spans and r.group_id is not None and rollouts[i - 1].group_id == r.group_id:
            spans[-1] = range(spans[-1].start, i + 1)
        else:
            spans.append(range(i, i + 1))
    return spans


def count_groups(rollouts: list[Rollout]) -> int:
    return len(group_spans(rollouts))


def check_embedding(model: torch.nn.Module, check: DataCheck) -> None:
    """Refuse data whose largest token id has no row in the loaded model's input embedding."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    token, where = check.max_token
    if isinstance(rows, int) and token >= rows:
        raise ValueError(f"{where}: token id {token} is outside the model's input embedding ({rows} rows)")


def data_change(saved: dict, now: dict, checkpoint: str, path: Path, accept: bool) -> str | None:
    """None when the file is the one ``checkpoint`` was written on; else what changed (old -> new
    sha256, size, rollouts, steps per epoch), raised as a ValueError unless ``accept``."""
    if saved.get("sha256") == now["sha256"]:
        return None

    def pair(key: str, unit: str) -> str:
        before = saved.get(key)
        return f"{'?' if before is None else f'{before:,}'} -> {now[key]:,} {unit}"

    what = (
        f"sha256 {saved.get('sha256')} -> {now['sha256']}, {pair('size', 'bytes')}, "
        f"{pair('rollouts', 'rollouts (lines)')}, "
        f"{pair('steps_per_epoch', 'steps per epoch')}"
    )
    if not accept:
        raise ValueError(
            f"{path} changed since {checkpoint} was written ({what}): an exact resume needs the "
            f"same data; pass {ACCEPT_CHANGED_DATA} to continue from {checkpoint}'s position on "
            f"the changed file"
        )
    return f"{path.name} changed since {checkpoint} was written: {what}"


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
