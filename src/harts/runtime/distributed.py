"""Data-parallel models (DDP and FSDP2) run exactly: harts synchronises the gradients itself.

harts runs a model's parts over a forest, never the wrapper's forward, so the machinery a
wrapper keeps in its forward does not run: DDP's reducer is only armed by ``DDP.forward``, and
FSDP2's ``fully_shard`` gathers parameters and reduce-scatters gradients from hooks on the
forward of each sharded module. :func:`data_parallel_step` does that work for one whole step
(every micro-batch):

- **DDP** (``torch.nn.parallel.DistributedDataParallel``): the step runs on ``ddp.module``; at
  the end each gradient is summed over the ranks (one flat all-reduce per dtype).
- **FSDP2** (``torch.distributed.fsdp.fully_shard``): the step gathers the units itself, one at a
  time (:mod:`harts.runtime.sharded`): the model and backbone units (embeddings, final norm,
  head) for the whole step, each decoder layer's unit around that layer's forward and again
  for its backward, right after which its gradient is summed over the ranks and this rank's
  shard added to the sharded parameter's ``.grad`` (a DTensor, as FSDP2 leaves it). A rank
  holds its shards, the outer units and two layer units at a time (the running one and the
  next, whose gather overlaps its compute; one with ``RunConfig(fsdp_overlap=False)``). With a
  ``MixedPrecisionPolicy``, the step computes in its ``param_dtype`` (the unsharded
  parameters') and gradients are summed in the sharded parameters' dtype.

The sum, not the mean: harts' losses divide by normalisers of the whole step over all ranks
(``normalizers_for(..., all_reduce=...)``), so each rank's gradient is its share of one global
loss and the shares add up. A parameter no rank used keeps ``.grad`` None, as on one process.
Gradients a step finds already in ``.grad`` (accumulated by an earlier call) are kept: DDP sets
them aside and adds them back after the sum, FSDP2 adds each unit's new shard to them, so each
call synchronises its own contribution once. After an error inside an FSDP2 step its gradients
are partial (the other ranks fail at their next collective, within the group's timeout).

What this leaves out: FSDP1 (``FullyShardedDataParallel``: flat parameters) and tensor,
pipeline or context parallelism are refused. Communication does not overlap compute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from harts.runtime.model_checks import resolve_model, sharded_step
from harts.runtime.sharded import ShardedStep

__all__ = [
    "DataParallel",
    "all_reduce_sum",
    "close_process_group",
    "data_parallel",
    "data_parallel_step",
    "forward_only_step",
    "unwrap_data_parallel",
    "warn_unwrapped",
]

Tensor = torch.Tensor


@dataclass(frozen=True)
class DataParallel:
    """A data-parallel model: ``kind`` "ddp" or "fsdp", the ``wrapper`` the user holds, the
    process ``group`` its gradients are summed over (None: the default group)."""

    kind: str
    wrapper: nn.Module
    group: object | None = None
    sharded: ShardedStep | None = None  # inside an FSDP2 step: its units, gathered one at a time

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """``t`` summed over the ranks (in place, returned)."""
        return all_reduce_sum(t, self.group)


def all_reduce_sum(t: Tensor, group=None) -> Tensor:
    """``t`` summed over the ranks of ``group`` (in place, returned), wherever it lives: NCCL
    reduces CUDA tensors only, so a CPU tensor (counts, flags) goes through the current GPU."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    if device is None or t.device == device:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t
    on_device = t.to(device)
    dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=group)
    return t.copy_(on_device)


def close_process_group(*, wait: bool) -> None:
    """Destroy the default process group safely, from every rank's ``finally``.

    ``wait``: first wait for every rank (pass it when this rank ran to its end, which in a program
    whose ranks run the same code every other rank does too), so that no rank closes its gloo
    connections while a peer may still be reading from them. Never after an error: a peer that
    failed would not arrive. FSDP2 modules and DTensors hold the process group in reference
    cycles: they are collected here, while it exists. Left to the interpreter's exit, after the
    group is gone, a rank aborted now and then ("terminate called without an active exception").
    """
    if not dist.is_initialized():
        return
    if wait:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def data_parallel(model: nn.Module) -> DataParallel | None:
    """What kind of data-parallel wrapper ``model`` is (None for a plain model).

    Raises ValueError for wrappers harts cannot run exactly (FSDP1) or a wrapper used without an
    initialised process group.
    """
    if any(c.__name__ == "FullyShardedDataParallel" for c in type(model).__mro__):
        raise ValueError(
            "the model is wrapped in FullyShardedDataParallel (FSDP1), whose flat parameters harts "
            "cannot run part by part: shard it with FSDP2 (torch.distributed.fsdp.fully_shard) instead"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DataParallel("ddp", model, model.process_group)
    if _fsdp_modules(model):
        if not dist.is_initialized():
            raise ValueError("the model is sharded with fully_shard but no process group is initialised")
        return DataParallel("fsdp", model, None)
    return None


def unwrap_data_parallel(model: nn.Module) -> nn.Module:
    """The module whose parts harts runs: ``ddp.module`` for DDP; the model itself otherwise."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


_WARNED: set[int] = set()


def warn_unwrapped(model: nn.Module) -> None:
    """Warn once per model when several ranks train a model that is not data-parallel: its
    gradients would stay this rank's own."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if id(model) in _WARNED:
        return
    _WARNED.add(id(model))
    warnings.warn(
        f"torch.distributed runs {dist.get_world_size()} ranks but the model is not wrapped in DDP or "
        f"sharded with fully_shard: harts computes this rank's gradients only (and the loss over this "
        f"rank's normalisers). Pass the wrapped model to synchronise them, as on one process",
        stacklevel=3,
    )


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _take_grads(params: list[nn.Parameter]) -> list[Tensor | None]:
    """The gradients ``params`` hold now, set aside (``.grad`` None), to be added back later."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    return held


def _sum_over_ranks(dp: DataParallel, grads: list[Tensor | None], like: list[Tensor]) -> list[Tensor | None]:
    """Each gradient summed over the ranks; None where no rank has one (zeros stand in for a
    rank without one). One flag all-reduce, then one flat all-reduce per dtype."""
    present = torch.tensor([g is not None for g in grads], dtype=torch.float32)
    dp.all_reduce_sum(present)
    out: list[Tensor | None] = [None] * len(grads)
    by_dtype: dict[tuple, list[int]] = {}
    for i, ref in enumerate(like):
        if present[i] > 0:
            by_dtype.setdefault((ref.dtype, ref.device), []).append(i)
    for (dtype, device), index in by_dtype.items():
        flat = torch.cat(
            [
                (grads[i] if grads[i] is not None else torch.zeros_like(like[i])).reshape(-1).to(dtype)
                for i in index
            ]
        ).to(device)
        dp.all_reduce_sum(flat)
        for i, piece in zip(index, flat.split([like[i].numel() for i in index]), strict=True):
            out[i] = piece.view(like[i].shape)
    return out


def _add_back(params: list[nn.Parameter], held: list[Tensor | None], summed: list[Tensor | None]) -> None:
    for p, before, new in zip(params, held, summed, strict=True):
        if new is None:
            p.grad = before
        else:
            new = new.to(p.dtype)
            p.grad = new if before is None else before + new


@contextlib.contextmanager
def _ddp_step(dp: DataParallel) -> Iterator[nn.Module]:
    module = dp.wrapper.module
    named = _trainable(module)
    params = [p for _, p in named]
    held = _take_grads(params)
    try:
        yield module
    except BaseException:
        _restore(params, held)  # this call's partial gradients are dropped, earlier ones kept
        raise
    summed = _sum_over_ranks(dp, [p.grad for p in params], params)
    _add_back(params, held, summed)


def _restore(params: list[nn.Parameter], held: list[Tensor | None]) -> None:
    for p, before in zip(params, held, strict=True):
        p.grad = before


def _check_fsdp_units(model: nn.Module, causal_lm: nn.Module, modules: list[nn.Module]) -> None:
    """FSDP2 units only where harts never calls the module's forward (the model, a peft wrapper's
    causal LM, its backbone, its decoder layers): on a module harts calls (embedding, MLP, head)
    FSDP2's hooks would reshard the parameters in the middle of the step."""
    from harts.adapters import adapter_for

    backbone = adapter_for(causal_lm).backbone(causal_lm)
    allowed = {id(model), id(causal_lm), id(backbone), *(id(layer) for layer in backbone.layers)}
    names = {id(m): n for n, m in model.named_modules()}
    other = [names[id(m)] for m in modules if id(m) not in allowed]
    if other:
        raise ValueError(
            f"fully_shard was applied to {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}: harts "
            f"runs that module's forward itself, where FSDP2's hooks would reshard its parameters "
            f"mid-step; shard the decoder layers and the model (fully_shard(layer) for each layer, "
            f"then fully_shard(model))"
        )


@contextlib.contextmanager
def _fsdp_step(
    dp: DataParallel, overlap: bool, forward_only: bool = False
) -> Iterator[tuple[nn.Module, DataParallel]]:
    from harts.adapters import adapter_for

    model = dp.wrapper
    modules = _fsdp_modules(model)
    with sharded_step(model):
        causal_lm = resolve_model(model)  # a peft model's causal LM; the model itself otherwise
    _check_fsdp_units(model, causal_lm, modules)
    layers = list(adapter_for(causal_lm).backbone(causal_lm).layers[: causal_lm.config.num_hidden_layers])
    step = ShardedStep(model, layers, modules, dp.group, overlap=overlap, forward_only=forward_only)
    step.begin()
    try:
        with sharded_step(model):
            yield model, dataclasses.replace(dp, sharded=step)
    except BaseException:
        step.abort()
        raise
    step.end()


@contextlib.contextmanager
def forward_only_step(
    model: nn.Module, overlap: bool = True
) -> Iterator[tuple[nn.Module, ShardedStep | None]]:
    """``(module, sharded)`` for a pass without autograd on ``model``: DDP's module (no gradient
    to synchronise) or a plain model with ``sharded`` None; an FSDP2 model with its units gathered
    layer by layer in lock step with the other ranks (every rank must enter, one with no trees
    too: it stands in for the others' gathers), nothing summed."""
    dp = data_parallel(model)
    if dp is None:
        yield model, None
    elif dp.kind == "ddp":
        yield dp.wrapper.module, None
    else:
        with _fsdp_step(dp, overlap, forward_only=True) as (module, sharded_dp):
            yield module, sharded_dp.sharded


@contextlib.contextmanager
def data_parallel_step(
    model: nn.Module, overlap: bool = True
) -> Iterator[tuple[nn.Module, DataParallel | None]]:
    """Run one step's work on ``(module, dp)``: the plain module to run harts on and the
    data-parallel description (None, and ``model`` itself, for a plain model). On leaving, the
    gradients of the work done inside are summed over the ranks (see the module docstring).
    ``overlap`` (FSDP2): collectives overlap compute (``RunConfig.fsdp_overlap``)."""
    dp = data_parallel(model)
    if dp is None:
        warn_unwrapped(model)
        yield model, None
        return
    if dp.kind == "ddp":
        with _ddp_step(dp) as module:
            yield module, dp
    else:
        with _fsdp_step(dp, overlap) as (module, sharded_dp):
            yield module, sharded_dp
