"""harts' ops under ``torch.autocast``: the precision the stock forward's ops get there.

Under autocast (mixed-precision training: fp32 parameters, matmuls in bf16 or fp16) the stock
forward's tensors change dtype along the way: linear layers, convolutions and SDPA return the
low-precision dtype, RMSNorm's ``weight * x`` gives fp32 again, the residual stream stays fp32.
harts' own ops meet those mixed tensors, so each one takes the policy of the stock op it replaces:

- tree attention: SDPA under autocast casts query, key and value to the autocast dtype, and so
  does the tree attention (:func:`attention_inputs`);
- short convolutions: ``conv1d`` under autocast rounds input, weight and bias to the autocast
  dtype and returns that dtype (:func:`harts.ops.short_conv.tree_short_conv`);
- linear-attention recurrences keep their states and chunk maths in fp32, as the fused kernels
  do (:func:`no_autocast` around them, forward and backward);
- the head's log-softmax runs in fp32 over logits the head matmul gave in the autocast dtype
  (:mod:`harts.ops.logprobs`), as a stock loss over autocast logits computes it.

Outside autocast every function here returns its input or does nothing: fp32 and fp64 paths
are untouched.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["autocast_dtype", "no_autocast", "attention_inputs", "autocast_state", "restored_autocast"]


def autocast_dtype(device: torch.device | str, *tensors: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``device``'s type, or None outside autocast. With ``tensors``,
    also None when one of them is fp64: autocast leaves fp64 operands alone, and so does harts."""
    kind = torch.device(device).type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return None
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return None
    return torch.get_autocast_dtype(kind)


def no_autocast(device: torch.device | str):
    """A context in which ``device``'s autocast is off (a no-op context when it is off already)."""
    kind = torch.device(device).type
    if autocast_dtype(kind) is None:
        return contextlib.nullcontext()
    return torch.autocast(kind, enabled=False)


def autocast_state(device: torch.device | str) -> tuple[str, torch.dtype | None]:
    """What a custom autograd function's forward saw, for :func:`restored_autocast` in its backward."""
    kind = torch.device(device).type
    return kind, autocast_dtype(kind)


def restored_autocast(state: tuple[str, torch.dtype | None]):
    """Backward in the autocast state of its forward (``torch.amp.custom_bwd``'s rule, for any
    device): the recomputed values are then the ones the forward used, whether or not backward is
    called inside an autocast region."""
    kind, dtype = state
    if not torch.amp.is_autocast_available(kind):
        return contextlib.nullcontext()
    if dtype is None:
        return no_autocast(kind)
    return torch.autocast(kind, dtype=dtype)


def attention_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Query, key and value as SDPA under autocast sees them: all in the autocast dtype (unchanged
    outside autocast)."""
    dtype = autocast_dtype(tensors[0].device)
    if dtype is None:
        return tensors
    return tuple(t if t.dtype == torch.float64 else t.to(dtype) for t in tensors)
