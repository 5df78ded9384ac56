"""The skeleton of a training run, shared by ``harts train`` and ``harts rl``.

:class:`Run` owns what every run does the same way: the output directory locked and the thread
count set (:meth:`Run.execute`), the checkpoint to resume from (verified) and the refusal of a
directory that holds checkpoints already, the optimizers and schedules over the model, their
state restored from a checkpoint, clip-and-step (gradient clipping, optimizer and schedule step,
MoE router-bias updates), the step's metrics, ``metrics.jsonl`` and the ``[logging]`` backends,
the progress line, atomic checkpoints every ``checkpoint.every`` updates and at the end, and the
plot. A command subclasses it with what differs: how the model is made, what one update trains
on (:meth:`Run.updates`: ``harts train`` reads the rollout file and runs its reference, old
log-prob, eval and sample passes; ``harts rl`` samples rollouts from the policy and scores them),
what its checkpoints hold beside the model, and its progress line and summary.

A checkpoint holds the model as ``save_pretrained`` writes it, ``trainer_state.pt``,
``state.json`` (the command's position) and ``config.toml`` (the config as written); the
optimizer state is either in ``state/`` (``torch.distributed.checkpoint``, any world size:
``harts train``) or in ``trainer_state.pt`` under ``optimizers`` (one process: ``harts rl``), and
a resume reads whichever the checkpoint has.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch

from harts.objectives.moe import bias_update
from harts.ops.backends import resolve_backend
from harts.runtime.backward import StepResult
from harts.runtime.distributed import close_process_group
from harts.runtime.executor import model_device
from harts.trainer.checkpoint import Checkpoint, latest, list_checkpoints, prune, run_lock, write_checkpoint
from harts.trainer.inputs import quiet_transformers
from harts.trainer.logging_backends import open_backends
from harts.trainer.optim import ParameterSplit, build_optimizers
from harts.trainer.processes import STATE_DIR, RankFailure, Ranks, load_state, plain_class, stop_together
from harts.trainer.progress import PLOTTED, MetricsLog, progress_line, write_plot

__all__ = [
    "Run",
    "Terminated",
    "TrainingDiverged",
    "collective",
    "update_metrics",
    "TRAINER_STATE",
    "STATE",
    "CONFIG",
    "METRICS",
]

TRAINER_STATE = "trainer_state.pt"
STATE = "state.json"
CONFIG = "config.toml"
METRICS = "metrics.jsonl"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a run stops the way Ctrl-C stops it. torchrun
    sends it to every other rank as soon as one rank exits, so a rank may meet it for another's
    failure."""


class TrainingDiverged(ArithmeticError):
    """A step's loss or gradient norm is not finite; the run stops before applying it."""


def collective(fn, *args, **kwargs):
    """``fn`` whose collectives a failed rank breaks: a RankFailure saying so, not a backend trace."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (or DistError, a subclass)
        if not _collective_failure(exc):
            raise
        raise RankFailure(
            f"rank {torch.distributed.get_rank()}: a collective with the other ranks failed (a rank died, "
            f"stopped on an error, or did not answer within distributed.timeout_s): "
            f"{str(exc).splitlines()[0]}"
        ) from None


_COLLECTIVE_WORDS = ("gloo", "nccl", "connection closed", "timed out", "timeout", "socket", "peer")


def _collective_failure(exc: BaseException) -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(word in text for word in _COLLECTIVE_WORDS)


def clip_gradients(params, clip: float) -> float:
    """Clip to ``clip``; the total norm (over every rank's shard under FSDP2)."""
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    if type(norm).__name__ == "DTensor":
        norm = norm.full_tensor()
    return float(norm)


def _check_param_names(saved: dict, now: dict) -> None:
    """Refuse a checkpoint whose optimizers trained other parameters than this run's would."""
    if set(saved) != set(now):
        raise ValueError(
            f"the checkpoint's optimizers are {sorted(saved)}, the config's {sorted(now)}: "
            f"resume with the optimizer.kind the run started with"
        )
    for name, names in now.items():
        if list(saved[name]) != names:
            differ = sorted(set(saved[name]) ^ set(names))[:3]
            raise ValueError(
                f"the checkpoint's {name} state does not fit this run's parameters (they differ in "
                f"{', '.join(differ) or 'order'}); resume with the model, optimizer.kind and "
                f"optimizer.freeze_router the run started with"
            )


def update_metrics(result: StepResult, grad_norm: float, lrs: dict) -> dict:
    """What every run records of an update, in this order: the loss and the loss's metrics, the
    MoE load (when the step counted experts), the gradient norm and the learning rates."""
    record = {"loss": float(result.loss)}
    record.update({k: float(v) for k, v in result.metrics.items() if k != "loss"})
    if result.moe is not None:
        counts = result.moe.expert_counts.double()
        record["moe_max_load"] = float((counts.max(-1).values / counts.mean(-1).clamp(min=1e-12)).mean())
    record.update(grad_norm=grad_norm, **lrs)
    return record


class Run:
    """One run of a command: its model and optimizers, its position, its save and restore, its loop.

    A subclass sets ``command`` (and its own ``progress_line`` and ``plotted``, where they are not
    ``harts train``'s), makes ``model`` (and ``wrapped``, the model the step runs: DDP or FSDP2
    under torchrun) and ``total`` in :meth:`setup`, counts the updates done in ``step``, and yields
    one record per update from :meth:`updates`.
    """

    command = "harts"
    progress_line = staticmethod(progress_line)  # (record, total, eta) -> the line of an update
    plotted: tuple[str, ...] = PLOTTED  # the metrics the plot draws
    plot_markers = True  # a marker per point when a curve has few
    step = 0  # optimizer updates done
    total = 0  # optimizer updates of the whole run

    def __init__(self, config, out: Path, log: TextIO, ranks: Ranks | None = None):
        self.config, self.out, self.log, self.ranks = config, out, log, ranks
        self.root = out / "checkpoints"
        self.router_biases: list = []  # MoE routers' score-correction biases, which follow the expert loads
        self.session = 0.0  # seconds of this session's work (the progress line's eta reads it)

    @classmethod
    def execute(cls, config, out: str | Path, resume: bool, log: TextIO | None, **options) -> dict:
        """Run ``config`` into ``out`` with ``config.threads`` threads (the count restored after), the
        directory locked against a second run, the process group of torchrun's ranks left at the end."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        threads = torch.get_num_threads()
        if config.threads:
            torch.set_num_threads(config.threads)
        run, finished = None, False
        try:
            run = cls(config, out, sys.stderr if log is None else log, **options)
            with run_lock(out, cls.command) if run.main else contextlib.nullcontext():
                result = run.run(resume)
            finished = True
            return result
        except (ValueError, TrainingDiverged):  # met by every rank alike: every rank's status the same
            if run is not None and run.ranks is not None:
                stop_together()
            raise
        finally:
            torch.set_num_threads(threads)
            if run is not None and run.ranks is not None:
                close_process_group(wait=finished)

    @property
    def main(self) -> bool:
        """Whether this process writes the logs and publishes checkpoints (rank 0, or the only one)."""
        return self.ranks is None or self.ranks.main

    def say(self, line: str) -> None:
        if self.main:
            print(f"{self.command}: {line}", file=self.log, flush=True)

    # ---- what a command provides ---------------------------------------------------------------
    def setup(self, resume: bool) -> Checkpoint | None:
        """Check the config, make the model and optimizers, restore a checkpoint; the one resumed from."""
        raise NotImplementedError

    def updates(self) -> Iterator[dict]:
        """Run the updates left, yielding each one's record once it is applied and counted in ``step``
        (``session`` counting its seconds)."""
        raise NotImplementedError

    def checkpoint_state(self) -> dict:
        """``state.json`` of a checkpoint: where the run is."""
        raise NotImplementedError

    def trainer_state(self) -> dict:
        """``trainer_state.pt`` of a checkpoint (written by the main process)."""
        raise NotImplementedError

    def finish(self, last: Path | None, first: int) -> dict:
        """Say the run's summary (``first``: the step this session started from); return it."""
        raise NotImplementedError

    def interrupted(self, terminated: bool = False) -> None:
        """Ctrl-C (or SIGTERM: ``terminated``) during the updates: say where the run stands (the
        interrupt goes on)."""

    # ---- the skeleton ----------------------------------------------------------------------------
    def run(self, resume: bool) -> dict:
        return self.loop(self.setup(resume))

    def resume_point(self, resume: bool) -> tuple[Checkpoint | None, dict | None]:
        """The checkpoint to start from (verified before anything of it is read) and its
        ``state.json``; refuses to start afresh over the checkpoints of another run."""
        start = None
        if resume:
            start = latest(self.root)
            if start is None:
                self.say(f"no checkpoint in {self.root}: starting from step 0")
        elif list_checkpoints(self.root):
            newest = list_checkpoints(self.root)[-1].path.name
            raise ValueError(
                f"{self.out} already holds checkpoints ({newest}): pass --resume to continue "
                f"from the newest, or choose another --out"
            )
        state = json.loads((start.path / STATE).read_text()) if start else None
        return start, state

    def build_optimizers(self, total: int) -> ParameterSplit:
        """The optimizers and schedules (of ``total`` updates) over ``model``'s trainable
        parameters, and which parameter each trains, by name (``param_names``: a resume must find
        the same)."""
        config = self.config
        self.optim, split = build_optimizers(self.model, config.optimizer, config.schedule, total)
        names = {"adamw": [n for n, _ in split.decay + split.no_decay], "muon": [n for n, _ in split.muon]}
        self.param_names = {k: v for k, v in names.items() if v}
        return split

    def restore_optimizers(self, start: Checkpoint) -> dict:
        """The optimizer and schedule state (and the model's, from ``state/``) of ``start``; its
        ``trainer_state.pt``."""
        trainer = torch.load(start.path / TRAINER_STATE, weights_only=True)
        if (start.path / STATE_DIR).is_dir():  # any world size: resharded to this run's ranks
            self.optim.check_masters(trainer.get("master_weights", False))
            _check_param_names(trainer.get("params", {}), self.param_names)
            load_state(start.path, self.wrapped, self.optim)
            self.optim.own_memory()
            self.optim.load_scheduler_state(trainer["schedulers"])
        else:
            self.optim.load_state_dict(trainer["optimizers"])
        return trainer

    def describe_model(self, split: ParameterSplit, frozen: list[str] = ()) -> None:
        model = self.config.model
        name = f"tiny {model.tiny}" if model.tiny else str(model.path)
        params = sum(p.numel() for p in self.model.parameters())
        threads = torch.get_num_threads()
        self.say(
            f"model {name} ({params / 1e6:.2f}M parameters, {model.dtype}, {model.device}, {threads} "
            f"thread{'s' if threads > 1 else ''}); {split.describe()}"
            f"{f', {len(frozen)} router tensors frozen' if frozen else ''}"
        )
        backend, why = resolve_backend(self.config.run.backend, model_device(self.model))
        self.say(f"kernels: {backend} backend ({why})")

    @contextlib.contextmanager
    def numbered(self):
        """A ValueError of the coming update named by its step."""
        try:
            yield
        except ValueError as exc:
            raise type(exc)(f"step {self.step + 1}: {exc}") from None

    def clip_and_step(self, result: StepResult) -> tuple[float, dict]:
        """Clip the gradients the step left in ``.grad`` to ``max_grad_norm``, step the optimizers and
        schedules, move the routers' biases, zero the gradients; the norm before clipping and the
        learning rates the update used."""
        optim = self.optim
        clip = self.config.max_grad_norm if self.config.max_grad_norm else math.inf
        grad_norm = collective(clip_gradients, optim.take_gradients(), clip)  # fp32 with master weights
        if not (math.isfinite(grad_norm) and math.isfinite(float(result.loss))):
            raise TrainingDiverged(
                f"step {self.step + 1}: loss {float(result.loss)}, gradient norm {grad_norm}: not "
                f"finite; stopped before the update (the last checkpoint is kept)"
            )
        lrs = optim.lrs()  # the rates this step uses
        optim.step()
        if self.router_biases:
            delta = bias_update(result.moe.expert_counts, self.config.moe.bias_update_speed)
            with torch.no_grad():
                for bias, d in zip(self.router_biases, delta, strict=True):
                    bias.add_(d.to(bias))
        optim.zero_grad()
        return grad_norm, lrs

    def write_model(self, directory: Path, whole: dict | None = None) -> None:
        """The model as ``from_pretrained`` loads it (``whole``: its state gathered from the ranks)."""
        with quiet_transformers(), plain_class(self.model):
            self.model.save_pretrained(directory, safe_serialization=True, state_dict=whole)

    def write_weights(self, directory: Path) -> None:
        """What every process writes of the weights into a checkpoint; by default the main one the
        model (a command keeping sharded state overrides it)."""
        if self.main:
            self.write_model(directory)

    def save(self) -> Path:
        """An atomic checkpoint of the run at ``step``; older ones beyond ``checkpoint.keep_last`` go."""
        state = self.checkpoint_state()

        def write(directory: Path) -> None:
            self.write_weights(directory)
            if not self.main:
                return
            torch.save(self.trainer_state(), directory / TRAINER_STATE)
            (directory / STATE).write_text(json.dumps(state, indent=1), encoding="utf-8")
            (directory / CONFIG).write_text(self.config.text, encoding="utf-8")

        barrier = self.ranks.barrier if self.ranks is not None else None
        path = collective(write_checkpoint, self.root, self.step, write, main=self.main, barrier=barrier)
        if self.main:
            prune(self.root, self.config.checkpoint.keep_last)
        return path

    def loop(self, start: Checkpoint | None) -> dict:
        """The updates, each recorded in ``metrics.jsonl`` and the backends, a progress line every
        ``logging.every`` and a checkpoint every ``checkpoint.every`` (and both after the last); the
        plot; the summary."""
        config, first = self.config, self.step
        metrics = MetricsLog(self.out / METRICS, self.step) if self.main else None
        backends = open_backends(config.logging.writers, self.out, config.table) if self.main else []
        last = start.path if start else None
        try:
            with contextlib.closing(self.updates()) as updates:
                for record in updates:
                    if metrics is not None:
                        metrics.write(record)
                    for backend in backends:
                        backend.write(record)
                    done = self.step == self.total
                    if self.main and (self.step % config.logging.every == 0 or done):
                        eta = self.session / (self.step - first) * (self.total - self.step)
                        print(self.progress_line(record, self.total, eta), file=self.log, flush=True)
                    every = config.checkpoint.every
                    if done or (every and self.step % every == 0):
                        last = self.save()
                        self.say(f"checkpoint {last}")
        except KeyboardInterrupt as stop:
            self.interrupted(isinstance(stop, Terminated))
            raise
        finally:
            if metrics is not None:
                metrics.close()
            for backend in backends:
                backend.close()
        if config.logging.plot and self.main:
            png = self.out / "metrics.png"
            self.say(write_plot(self.out / METRICS, png, self.plotted, self.plot_markers))
        return self.finish(last, first)
