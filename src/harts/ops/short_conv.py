"""Causal depthwise short convolution along each token's own path.

``out[t] = act(bias + sum_j w[:, j] * x[pred_{K-1-j}(t)])`` where ``pred_d(t)`` is the token d
steps before t on its path. The window may cross several ancestor nodes when they are shorter
than the kernel; predecessors before the start of the path are zero, like the left zero padding
of ``nn.Conv1d(padding=K-1)`` in the stock models. One gather and one weighted sum: exact and
differentiable, with no halo bookkeeping.

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
    m, c = x.shape
    kernel = weight.shape[-1]
    if predecessors.dim() != 2 or predecessors.shape[1] != kernel:
        raise ValueError(f"predecessors must be [N, K={kernel}], got {tuple(predecessors.shape)}")
    low = autocast_dtype(x.device, x, weight)
    if low is not None:
        return _ACTIVATIONS[activation](_autocast_conv(x, weight, predecessors, bias, low))
    x = x.to(weight.dtype)
    # Row m of the padded input is the zero "before the path start".
    padded = torch.cat([x, x.new_zeros(1, c)], dim=0)
    window = padded[torch.where(predecessors >= 0, predecessors, m)]  # [N, K, C]
    out = torch.einsum("nkc,ck->nc", window, weight)
    if bias is not None:
        out = out + bias
    return _ACTIVATIONS[activation](out)


def _autocast_conv(x, weight, predecessors, bias, low: torch.dtype) -> torch.Tensor:
    """The convolution as ``conv1d`` under autocast computes it: input, weight and bias rounded to
    ``low``, products summed in fp32, the sum (bias included) rounded once to ``low``."""
    m, c = x.shape
    with no_autocast(x.device):
        x, weight = x.to(low).float(), weight.to(low).float()
        padded = torch.cat([x, x.new_zeros(1, c)], dim=0)
        window = padded[torch.where(predecessors >= 0, predecessors, m)]  # [N, K, C]
        out = torch.einsum("nkc,ck->nc", window, weight)
        if bias is not None:
            out = out + bias.to(low).float()
        return out.to(low)
