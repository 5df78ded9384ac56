"""``RunConfig(verify=True)`` on an FSDP2-sharded model: every rank runs the check in lock step.

No rank holds the whole model, so no rank can run the stock forward alone; every rank runs the
same passes on the same sample instead, and each pass's collectives meet:

- **the sample** is rank 0's (its trajectories and routes broadcast), so every rank runs the same
  forwards and backwards, and an error names rank 0's trajectories;
- **stock** is the sharded model's own forward (FSDP2 gathers each unit in its hooks as every rank
  calls it) and backward (its reduce-scatter averages the ranks' gradients: the same gradient on
  every rank, so the average is that gradient, to the rounding of a sum of equal terms, exact on
  two ranks);
- **harts** runs the sample in its sharded step (:func:`harts.runtime.distributed.
  data_parallel_step`), which sums the ranks' gradients: the sum of ``W`` equal gradients,
  divided by ``W`` here (in fp64);
- **the truth** is a shard copy of the model in fp64 (:func:`sharded_truth`): the same classes
  built from the model's config, ``fully_shard`` applied to the same units on the same mesh, and
  each rank's shards copied into it (exactly: every fp32 value is an fp64 value). Each rank holds
  its shards in fp64 while the check runs, never the whole model; the copy's stock forward
  gathers its units as the model's does;
- **the verdict**: each rank holds its shard of every gradient; the gradient figures are sums of
  squares over a parameter's elements, summed over the ranks (one all-reduce), so every rank
  judges the whole gradient; the row values are every rank's own (the same sample on the same
  weights); then the ranks agree (:func:`agree`): a failure on any rank raises on every rank, with
  the first failing rank's message, before the call computes anything.

What it does not run: low precision (bf16 parameters, a ``MixedPrecisionPolicy`` whose
``param_dtype`` is not the parameters' own, autocast) is refused under FSDP2, its fp32 copy of
the algorithm check not being built here; a value head (the critic) and LoRA adapters under
FSDP2 likewise.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["is_sharded", "sharded_truth", "broadcast_sample", "agree", "local_grad", "refuse_low"]

Tensor = torch.Tensor


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 units (its parameters are shards)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def low_precision_refusal(model: nn.Module, low: bool = False) -> str | None:
    """Why the check cannot run on this FSDP2-sharded model (low precision: ``low``, parameters
    below fp32, or a MixedPrecisionPolicy that computes below them), or None."""
    from torch.distributed.fsdp import FSDPModule

    policies = [m._get_fsdp_state()._mp_policy for m in model.modules() if isinstance(m, FSDPModule)]
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    mixed = any(p.param_dtype not in (None, dtype) for p in policies)
    if low or mixed or dtype not in (torch.float32, torch.float64):
        return (
            "on an FSDP2-sharded model the check runs fp32 parameters without a lower "
            "MixedPrecisionPolicy param_dtype or autocast: verify in fp32, or under DDP / on one process"
        )
    return None


def refuse_low(model: nn.Module, low: bool, gradients: bool) -> None:
    """ValueError where the check would need what it does not build under FSDP2 (module docstring)."""
    reason = low_precision_refusal(model, low)
    if reason is not None:
        raise ValueError(f"RunConfig(verify=True): {reason}")
    if not gradients:
        raise ValueError(
            "RunConfig(verify=True) of a forward-only pass on an FSDP2-sharded model is not supported: "
            "the sharded check runs a training step's sample; verify the step, or on one process"
        )
    if getattr(model, "vision_language", None) is not None or not hasattr(model, "config"):
        raise ValueError("RunConfig(verify=True) under FSDP2 checks a causal LM sharded by fully_shard")


def _plain_class(module: nn.Module) -> type:
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def sharded_truth(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of the sharded ``model`` in ``dtype``, sharded as it is: built from its config on
    the meta device, ``fully_shard`` on the same units and mesh, each rank's shards and the
    buffers copied in (module docstring)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    device = next(model.parameters()).device
    with torch.device("meta"):
        truth = _plain_class(model)(copy.deepcopy(model.config))
    mesh = next(p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh"))
    for name in sorted(units, key=lambda n: -len(n.split(".")) if n else 1):  # the root last
        fully_shard(truth.get_submodule(name), mesh=mesh)
    truth.to_empty(device=device)
    truth.to(dtype)
    mine = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in truth.named_parameters():
            src, dst = local_grad(mine[name]), local_grad(p)
            if src.shape != dst.shape:
                raise ValueError(
                    f"RunConfig(verify=True): parameter {name} is sharded other than fully_shard's default "
                    f"({tuple(src.shape)} on this rank): its fp64 copy cannot take the same shards"
                )
            dst.copy_(src)
            p.requires_grad_(mine[name].requires_grad)
        own_buffers = dict(model.named_buffers())
        for name, b in truth.named_buffers():
            b.copy_(own_buffers[name])
    truth.train(model.training)
    owner = truth if hasattr(truth, "set_experts_implementation") else None
    if owner is not None and dtype == torch.float64:
        try:
            owner.set_experts_implementation("eager")
        except (ValueError, AttributeError):  # a model without experts
            pass
    return truth


def local_grad(t: Tensor) -> Tensor:
    """This rank's shard of a sharded tensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def broadcast_sample(sample: list, trajectories: list, routes) -> tuple[list, list, object]:
    """Rank 0's sample (trajectory indices and tokens kept, token ids, routes) on every rank."""
    box = [(sample, [t.cpu() for t in trajectories], routes)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(message: str | None) -> str | None:
    """The first failing rank's message on every rank (None where every rank passed)."""
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return None
    rank, first = failed[0]
    return first if rank == dist.get_rank() else f"{first} (on rank {rank})"
