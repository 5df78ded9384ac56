"""``harts train`` on several processes: ranks from ``torchrun``, DDP or FSDP2, trees to ranks,
checkpoints any world size resumes from.

Started by ``torchrun --nproc_per_node=N -m harts train CONFIG`` (or ``torch.distributed.run``
on several machines), each process reads the environment torchrun sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``) and joins the default process group
(gloo on CPU, NCCL on CUDA) with the config's ``distributed.timeout_s``: a rank that dies or
hangs makes the others' next collective fail within that time instead of waiting forever.

Each step every rank reads the same rollouts, builds the same forest and estimates the same
advantages; :func:`~harts.plan.ranks.assign_trees` then gives each rank whole trees, balanced by
a FLOP model of the model (:func:`rank_cost`), and each rank trains on its own trees through
:func:`harts.forest_step` on the wrapped model, which sums the normalisers and the gradients over
the ranks once per step (:mod:`harts.runtime.distributed`).

Checkpoints keep the model and optimizer state in ``state/``, written with
``torch.distributed.checkpoint`` (each rank its shard under FSDP2; replicated state once under
DDP): a run on any number of ranks resumes from it, one process included. ``model.safetensors``
(the whole model, written by rank 0) stays loadable by ``from_pretrained``.

Muon under FSDP2 gathers each matrix's update for its Newton-Schulz step
(:mod:`harts.trainer.sharded_muon`).

What this leaves out: tensor, pipeline and context parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from harts.objectives.rollout import Rollout
from harts.objectives.rows import LossRows
from harts.plan.ranks import RankCost, TreeAssignment, assign_trees

__all__ = [
    "Ranks",
    "start_ranks",
    "wrap_model",
    "fsdp_shard",
    "rank_cost",
    "local_rollouts",
    "save_state",
    "load_state",
    "RankFailure",
    "stop_together",
    "reports",
]

STATE_DIR = "state"
# how long a rank that stops on an error every rank meets waits for the others to meet it too: they
# run the same code on the same input, so they reach it moments apart, not minutes
STOP_WAIT_S = 30.0


class RankFailure(RuntimeError):
    """A collective with the other ranks failed: a rank died, hung past the timeout, or stopped
    on an error of its own."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    strategy: str  # "ddp" or "fsdp"
    balance: str  # "cost" or "tokens"
    cost: RankCost = RankCost()  # the model's FLOP weights (rank_cost), set once the model is loaded

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        dist.barrier()

    def agree(self, error: str | None) -> str | None:
        """The first error any rank reports (None when none does): every rank stops together, with
        the same message, when one rank's data is bad."""
        found: list[str | None] = [None] * self.world_size
        dist.all_gather_object(found, error)
        return next((e for e in found if e is not None), None)


def start_ranks(strategy: str, balance: str, timeout_s: float, device: str) -> Ranks | None:
    """Join the process group torchrun describes; None when this is a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if not dist.is_available():
        raise ValueError("WORLD_SIZE > 1 but this torch has no torch.distributed")
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Ranks(dist.get_rank(), dist.get_world_size(), strategy, balance)


def reports() -> bool:
    """Whether this process prints an error every rank meets alike (bad input, a step that
    diverged): rank 0 of torchrun's ranks, or the only process."""
    return os.environ.get("RANK", "0") == "0"


def stop_together(wait_s: float = STOP_WAIT_S) -> None:
    """Under torchrun (nothing on one process): stop on an error every rank meets alike with every
    rank's exit status the same.

    torchrun terminates the other ranks (SIGTERM) as soon as one exits; a rank terminated before it
    has met the error itself would report the signal, not the error's status. So from here on this
    rank ignores SIGTERM, and it waits (at most ``wait_s``) until every rank has stopped, counted in
    the rendezvous store; before the process group exists (a config error) it joins it to wait.
    A rank that never comes (the error was this rank's alone) ends the wait at ``wait_s``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    joined = False
    try:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=wait_s))
            joined = True
        store = dist.distributed_c10d._get_default_store()
        key = f"harts/stopped/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        deadline = time.monotonic() + wait_s
        count = store.add(key, 1)
        while count < world and time.monotonic() < deadline:
            time.sleep(0.02)
            count = store.add(key, 0)
    except Exception:  # noqa: BLE001 - a peer or the store gone: nothing left to wait for
        pass
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def wrap_model(model: nn.Module, ranks: Ranks) -> nn.Module:
    """``model`` in DDP, or sharded with FSDP2 (each decoder layer, then the model)."""
    if ranks.strategy == "ddp":
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return fsdp_shard(model)


def fsdp_shard(model: nn.Module) -> nn.Module:
    """``model`` sharded in place by FSDP2: ``fully_shard`` on each decoder layer, then the model
    (the units harts' step gathers one at a time). A peft model's layers are its base model's:
    each unit then holds a layer's frozen base weights and its adapters."""
    from torch.distributed.fsdp import fully_shard

    from harts.adapters import adapter_for

    base = model.get_base_model() if hasattr(model, "peft_config") else model
    for layer in adapter_for(base).backbone(base).layers:
        fully_shard(layer)
    return fully_shard(model)


def rank_cost(model: nn.Module) -> RankCost:
    """The FLOP weights of :mod:`harts.plan.ranks` for ``model``: 6 x non-embedding parameters per
    token (forward and backward of the dense work), 12 x heads x head size x full-attention layers
    per attended key (QK^T and AV, forward and backward)."""
    config = model.config
    embed = {
        id(p)
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        if m is not None
        for p in m.parameters()
    }
    dense = sum(p.numel() for p in model.parameters() if id(p) not in embed)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    full = sum(t in ("full_attention", "attention") for t in types[: config.num_hidden_layers])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return RankCost(per_token=6.0 * dense, per_key=12.0 * config.num_attention_heads * head_dim * full)


def local_rollouts(
    rollouts: list[Rollout], rows: LossRows, forest, ranks: Ranks
) -> tuple[list[Rollout], TreeAssignment]:
    """This rank's trees' rollouts, with the advantages of ``rows`` (estimated on the whole step)
    written into each rollout, so the rank's own rows carry the step's values."""
    assignment = assign_trees(forest, ranks.world_size, ranks.cost if ranks.balance == "cost" else None)
    mine = assignment.trajectories[ranks.rank]
    local = []
    trajectory = rows.trajectory.cpu().numpy()
    position = rows.position.cpu().numpy()
    advantage = rows.advantage.detach().cpu().double().numpy()
    for i in mine:
        r = rollouts[i]
        if rows.has_advantage:
            values = np.zeros(len(r.tokens))
            at = trajectory == i
            values[position[at]] = advantage[at]
            r = dataclasses.replace(r, advantages=values)
        local.append(r)
    return local, assignment


def _optimizers(optim) -> list[torch.optim.Optimizer]:
    return list(optim.optimizers.values())


def _state(model: nn.Module, optim, with_model: bool = True) -> dict:
    """The checkpoint's model and optimizer state, as ``torch.distributed.checkpoint`` names it.

    With fp32 master weights the optimizer state is that of the masters (named as the model's
    parameters), saved beside them under ``masters``; the model's own low-precision weights are
    their rounding, saved under ``model`` for reading but restored from the masters."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optim.masters is None:
        model_state, optim_state = get_state_dict(model, _optimizers(optim), options=_options(model))
        return {"model": model_state, "optim": optim_state}
    masters, optim_state = get_state_dict(optim.masters.module, _optimizers(optim))
    state = {"masters": masters, "optim": optim_state}
    if with_model:
        state["model"] = get_model_state_dict(model, options=_options(model))
    return state


def _options(model: nn.Module):
    """A peft model's state without its frozen base weights (reloaded from their source on resume,
    so a checkpoint's ``state/`` is the size of the adapter; loading it leaves them as they are);
    every parameter otherwise."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    adapter = hasattr(model, "peft_config")
    return StateDictOptions(ignore_frozen_params=adapter, strict=not adapter)


def save_state(directory: Path, model: nn.Module, optim) -> None:
    """Model and optimizer state (and fp32 master weights) into ``directory/state`` (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optim), checkpoint_id=directory / STATE_DIR)


def load_state(directory: Path, model: nn.Module, optim) -> None:
    """Model and optimizer state from ``directory/state``, resharded to this run's ranks; with
    master weights, the masters and their state, and the model rounded from the masters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, optim, with_model=optim.masters is None)
    dcp.load(state, checkpoint_id=directory / STATE_DIR)
    if optim.masters is None:
        set_state_dict(
            model,
            _optimizers(optim),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=_options(model),
        )
        return
    set_state_dict(
        optim.masters.module,
        _optimizers(optim),
        model_state_dict=state["masters"],
        optim_state_dict=state["optim"],
    )
    optim.masters.refresh()


def full_model_state(model: nn.Module, ranks: Ranks | None) -> dict | None:
    """The whole model's state on rank 0 (None elsewhere), for ``save_pretrained``."""
    if ranks is None or ranks.strategy == "ddp":
        return None  # save_pretrained reads the (whole) module itself
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if ranks.main else None


@contextlib.contextmanager
def plain_class(model: nn.Module):
    """``model`` seen as its own class while ``save_pretrained`` runs: FSDP2 swaps in a subclass
    (``FSDP<Name>``), whose name transformers' weight renaming for saving does not know."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        yield model
        return
    swapped = type(model)
    if not isinstance(model, FSDPModule):
        yield model
        return
    model.__class__ = next(c for c in swapped.__mro__[1:] if not issubclass(c, FSDPModule))
    try:
        yield model
    finally:
        model.__class__ = swapped
