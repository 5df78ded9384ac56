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
- **the truth** is a shard copy of the model one precision up (:func:`sharded_truth`): the same
  classes built from the model's config, ``fully_shard`` applied to the same units on the same
  mesh without a ``MixedPrecisionPolicy`` (the copy computes in its own dtype), and each rank's
  shards copied into it (exactly: every fp32 value is an fp64 value, every bf16 value an fp32
  one). Each rank holds its shards of the copy while the check runs, never the whole model; the
  copy's stock forward gathers its units as the model's does;
- **the verdict**: each rank holds its shard of every gradient; the gradient figures are sums of
  squares over a parameter's elements, summed over the ranks (one all-reduce), so every rank
  judges the whole gradient; the row values are every rank's own (the same sample on the same
  weights); then the ranks agree (:func:`agree`): a failure on any rank raises on every rank, with
  the first failing rank's message, before the call computes anything.

Low precision runs as on one process, every pass in lock step: bf16 / fp16 parameters, or fp32
parameters under a ``MixedPrecisionPolicy`` whose ``param_dtype`` is bf16 / fp16 (FSDP2 gathers
each unit in that dtype and computes in it; :func:`mixed_precision`). (a) harts' sharded step on
an fp32 shard copy (the policy dropped) against stock fp32 on it, both against an fp64 shard copy
made after the fp32 one is dropped; (b) each rank's own recorded attention calls against
themselves in fp32, the ranks' figures agreed (the largest ratio to its bound:
:func:`agreed_kernels`); the whole-model rule with the gradient figures summed over the shards.

What it does not run (:func:`low_precision_refusal`): autocast around a sharded model, units whose
policies compute in different dtypes, a policy over parameters other than fp32 (or computing in
other than bf16 / fp16); a value head (the critic) and LoRA adapters under FSDP2.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from harts.runtime.verify_kernels import KernelFigures

__all__ = [
    "is_sharded",
    "sharded_truth",
    "broadcast_sample",
    "agree",
    "agreed_kernels",
    "local_grad",
    "refuse_low",
    "mixed_precision",
    "low_precision_refusal",
]

Tensor = torch.Tensor


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 units (its parameters are shards)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


_LOW = (torch.bfloat16, torch.float16)


def _computes(model: nn.Module) -> tuple[torch.dtype, set]:
    """(the parameters' dtype, the dtypes the FSDP2 units compute in: a policy's ``param_dtype``,
    else the parameters' own)."""
    from torch.distributed.fsdp import FSDPModule

    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    policies = [m._get_fsdp_state()._mp_policy for m in model.modules() if isinstance(m, FSDPModule)]
    return dtype, {p.param_dtype or dtype for p in policies}


def mixed_precision(model: nn.Module) -> torch.dtype | None:
    """The dtype an FSDP2 ``MixedPrecisionPolicy`` computes ``model`` in where it is below its fp32
    parameters (bf16 / fp16, every unit the same), else None."""
    dtype, computes = _computes(model)
    (compute,) = computes if len(computes) == 1 else (None,)
    return compute if dtype == torch.float32 and compute in _LOW else None


def low_precision_refusal(model: nn.Module, autocast: bool = False) -> str | None:
    """Why the check cannot run on this FSDP2-sharded model in its precision (module docstring),
    or None: fp32 / fp64 parameters computing in their own dtype, bf16 / fp16 parameters, or fp32
    parameters under one ``MixedPrecisionPolicy`` computing in bf16 / fp16 are checked."""
    dtype, computes = _computes(model)
    if autocast:
        return (
            "autocast around an FSDP2-sharded model is not checked (its fp32 truth would be the "
            "sharded model itself): compute in bf16 by FSDP2's MixedPrecisionPolicy(param_dtype=...) "
            "or bf16 parameters, or verify under DDP / on one process"
        )
    if len(computes) > 1:
        names = sorted(str(d).removeprefix("torch.") for d in computes)
        return (
            f"the FSDP2 units compute in different dtypes ({', '.join(names)}): "
            "a model under one MixedPrecisionPolicy is checked"
        )
    (compute,) = computes
    own = dtype in (torch.float32, torch.float64, *_LOW) and compute == dtype
    if not (own or mixed_precision(model) is not None):
        return (
            f"a MixedPrecisionPolicy computing in {str(compute).removeprefix('torch.')} over "
            f"{str(dtype).removeprefix('torch.')} parameters is not checked (fp32 parameters computing in "
            "bf16 / fp16 are): verify under DDP / on one process"
        )
    return None


def refuse_low(model: nn.Module, autocast: bool, gradients: bool) -> None:
    """ValueError where the check would need what it does not build under FSDP2 (module docstring)."""
    reason = low_precision_refusal(model, autocast)
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
    """A copy of the sharded ``model`` in ``dtype`` (any: fp32 of a bf16 model, fp64), sharded as
    it is: built from its config on the meta device, ``fully_shard`` on the same units and mesh
    without the model's ``MixedPrecisionPolicy`` (the copy computes in ``dtype``), each rank's
    shards and the buffers copied in, exactly where ``dtype`` holds every value of the model's
    (module docstring)."""
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
                    f"({tuple(src.shape)} on this rank): its shard copy cannot take the same shards"
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


def agreed_kernels(figures: KernelFigures | None) -> KernelFigures | None:
    """The ranks' kernel figures agreed (each rank checks its own recorded calls): the figures of
    the rank whose error is the largest fraction of its bound, on every rank; None where no rank
    recorded a low-precision call. A collective: every rank calls it, passing or not."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    recorded = [f for f in every if f is not None]
    return max(recorded, key=lambda f: f.ratio) if recorded else None
