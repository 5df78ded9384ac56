"""Causal depthwise short convolution along each token's own path.

``out[t] = act(bias + sum_j w[:, j] * x[pred_{K-1-j}(t)])`` where ``pred_d(t)`` is the token d
steps before t on its path. The window may cross several ancestor nodes when they are shorter
than the kernel; predecessors before the start of the path are zero, like the left zero padding
of ``nn.Conv1d(padding=K-1)`` in the stock models. One gather of rows per tap, each weighted and
summed: exact and differentiable, with no halo bookkeeping. (Per tap, not as one [N, K, C] window
contracted by ``einsum``: torch runs that contraction as C batched [N, K] matrix-vector products,
about 10x slower forward and backward on the CPU; ``index_select``'s backward, an ``index_add_``,
is also several times faster than that of advanced indexing.)

Shapes: x [M, C] input rows, weight [C, K] (the depthwise ``conv1d.weight`` squeezed),
predecessors [N, K] rows of x (-1 for "before the path start"; column K-1 the token itself).
M can exceed N when x also holds context rows handed over from an earlier micro-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.ops.precision import autocast_dtype, no_autocast

__all__ = ["tree_short_conv"]

_ACTIVATIONS = {None: lambda x: x, "silu": F.silu, "swish": F.silu, "identity": lambda x: x}


def tree_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    predecessors: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution over path predecessors: x [M, C] -> [N, C]."""
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"unsupported convolution activation {activation!r}; known: {sorted(map(str, _ACTIVATIONS))}"
        )
    kernel = weight.shape[-1]
    if predecessors.dim() != 2 or predecessors.shape[1] != kernel:
        raise ValueError(f"predecessors must be [N, K={kernel}], got {tuple(predecessors.shape)}")
    low = autocast_dtype(x.device, x, weight) or _half(weight.dtype)
    if low is not None:
        return _ACTIVATIONS[activation](_autocast_conv(x, weight, predecessors, bias, low))
    out = _taps(x.to(weight.dtype), weight, predecessors)
    if bias is not None:
        out = out + bias
    return _ACTIVATIONS[activation](out)


def _half(dtype: torch.dtype) -> torch.dtype | None:
    """A 16-bit weight's dtype (None for fp32 and fp64): ``conv1d`` with bf16 or fp16 weights sums
    in fp32 and rounds once, as under autocast, where per-tap sums in the weight's dtype would round
    K times, forward and backward."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _taps(x: torch.Tensor, weight: torch.Tensor, predecessors: torch.Tensor) -> torch.Tensor:
    """sum_j w[:, j] * x[pred_j] [N, C], tap by tap in the order j = 0 .. K-1."""
    m, c = x.shape
    padded = torch.cat([x, x.new_zeros(1, c)], dim=0)  # row m: the zero "before the path start"
    rows = torch.where(predecessors >= 0, predecessors, m)
    out = padded.index_select(0, rows[:, 0]) * weight[:, 0]
    for j in range(1, weight.shape[-1]):
        out = out + padded.index_select(0, rows[:, j]) * weight[:, j]
    return out


def _autocast_conv(x, weight, predecessors, bias, low: torch.dtype) -> torch.Tensor:
    """The convolution as ``conv1d`` under autocast (or with ``low`` weights) computes it: input,
    weight and bias rounded to ``low``, products summed in fp32, the sum (bias included) rounded once
    to ``low``; the backward's sums in fp32 too, each gradient rounded once."""
    with no_autocast(x.device):
        out = _taps(x.to(low).float(), weight.to(low).float(), predecessors)
        if bias is not None:
            out = out + bias.to(low).float()
        return out.to(low)
