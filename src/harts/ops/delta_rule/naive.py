"""Per-token reference for the gated delta rule with per-channel log-decay.

This is the oracle the tests compare :func:`harts.ops.delta_rule.chunked_gated_delta_rule` against.
It is a plain Python loop over time (O(T) kernel launches), run in float64 by default so that its own
rounding error is negligible next to the fp32 chunked form. It is not meant for training.

The recurrence is the one in transformers' ``recurrent_kimi_delta_attention`` (Kimi Linear tech report,
eq. for KDA; Yang et al., "Gated Delta Networks", eq. 10, with the scalar gate generalised to one gate
per key channel), written in the fla-org ``naive.py`` convention of decaying the state *before* the
delta-rule read of step t:

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = S_t^T (scale * q_t)
"""

from __future__ import annotations

import torch

from harts.ops.chunked import gate_per_key

__all__ = ["naive_recurrent_gated_delta_rule"]


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step gated delta rule.

    Shapes: q, k [B, T, H, K]; g [B, T, H, K] or per head [B, T, H] / [B, T, H, 1]; v [B, T, H, V];
    beta [B, T, H]; initial_state [B, H, K, V] or None.
    Returns (o [B, T, H, V], final_state [B, H, K, V]), both in ``dtype`` (the compute dtype), so the
    caller decides how to compare. ``scale`` defaults to K ** -0.5 and multiplies q.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, gate_per_key(g, k), beta))
    if initial_state is None:
        S = torch.zeros(B, H, K, V, dtype=dtype, device=k.device)
    else:
        S = initial_state.to(dtype)
    outs = []
    for t in range(T):
        k_t = k[:, t]
        S = S * g[:, t].exp()[..., None]  # decay each key channel (row of S)
        delta = (v[:, t] - (S * k_t[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + k_t[..., None] * delta[..., None, :]
        outs.append((S * (scale * q[:, t])[..., None]).sum(-2))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, V)
    return o, S
