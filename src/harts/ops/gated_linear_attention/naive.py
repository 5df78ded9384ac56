"""Per-token reference for gated linear attention (:mod:`harts.ops.gated_linear_attention.chunk`):
a plain loop over time in fp64, the oracle the tests compare against; not for training."""

from __future__ import annotations

import torch

from harts.ops.chunked import gate_per_key

__all__ = ["naive_recurrent_gated_linear_attention"]


def naive_recurrent_gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step reference: shapes as the chunked op (g per key channel or per head); returns
    (o, final) in ``dtype``."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = 1.0 if scale is None else scale
    q, k, v, g = (x.to(dtype) for x in (q, k, v, gate_per_key(g, k)))
    if initial_state is None:
        S = torch.zeros(B, H, K, V, dtype=dtype, device=k.device)
    else:
        S = initial_state.to(dtype)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((S * (scale * q[:, t])[..., None]).sum(-2))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, V)
    return o, S
