"""Chunked gated linear attention (no delta term), with its fp64 per-token reference.

The recurrence, with g the log-decay per key channel (<= 0):

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale * q_t)

It is MiniMax's lightning attention (g = -slope of the head, the same for every channel; HF's
``MiniMaxLightningAttention`` computes it block-wise with precomputed decays, which is this same sum),
Mamba-2's SSD (q = C, k = B, v = dt * x, g = dt * A per head) and Mamba's selective scan (g = dt * A
per channel and state entry, V = 1). A delta-rule op with beta = 0 is not this: it would drop
the k v^T term too.

Chunked like :mod:`harts.ops.delta_rule` and sharing its pieces: inside a chunk the decay-weighted
scores come from the same overflow-free binary split (``_intra_chunk_scores``), the chunk-to-chunk
state recurrence S_{n+1} = diag(last_n) S_n + D_n runs in the same hand-written-adjoint scan (given the
diagonal, applied elementwise), and the
states at inner offsets are replayed from chunk-start states by the same gather. Without the
delta term there is no triangular solve: o = (q * e^G) S0 + P v, S_next = diag(e^G_last) S0 +
(k * e^{suffix})^T v.

Limits: one state [K, V] per head (grouped layouts repeat heads first); chunk a power of two;
inputs finite. Memory is that of the delta-rule op without its C x C solve.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from harts.ops.delta_rule import _exclusive_suffix_sum, _intra_chunk_scores, _requested_states, _StateScan

__all__ = ["chunked_gated_linear_attention", "naive_recurrent_gated_linear_attention"]


def chunked_gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    output_states_at: torch.Tensor | None = None,
):
    """Gated linear attention over a batch of right-padded segments, chunked.

    Shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; initial_state [B, H, K, V] (zeros if None);
    lengths LongTensor [B]; output_states_at LongTensor [B, S] of token counts in 0..T.
    ``scale`` (default 1) multiplies q. Returns (o [B, T, H, V] in q's dtype, final_state
    [B, H, K, V] fp32[, states [B, S, H, K, V] fp32 after that many tokens]).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    scale = 1.0 if scale is None else scale
    C = chunk_size
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two, got {C}")
    q, k, v, g = (x.float() for x in (q, k, v, g))
    valid = None
    if lengths is not None:
        # Padded steps are identities: g = 0 keeps the state, k = v = 0 adds nothing.
        valid = torch.arange(T, device=k.device)[None, :] < lengths.to(k.device)[:, None]
        vm = valid[:, :, None, None]
        k, v, g = (torch.where(vm, x, 0.0) for x in (k, v, g))

    N = max(1, math.ceil(T / C))
    pad = N * C - T

    def chunks(x):  # [B, T, H, D] -> [B, H, N, C, D], zero-padded at the end (identity steps)
        return F.pad(x.transpose(1, 2), (0, 0, 0, pad)).reshape(B, H, N, C, x.shape[-1])

    q, k, v, g = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    P, _ = _intra_chunk_scores(q, k, g)  # P[t, j] = q_t . (k_j * exp(sum_{j<s<=t} g_s)), j <= t
    G = g.cumsum(-2)
    Qg = q * torch.exp(G)
    Kd = k * torch.exp(_exclusive_suffix_sum(g, -2))  # decay from j to the chunk's end
    trans = torch.exp(G[..., -1, :])  # [B, H, N, K]: the diagonal of the chunk's state map
    drive = Kd.transpose(-1, -2) @ v  # [B, H, N, K, V]
    if initial_state is None:
        S_init = torch.zeros(B, H, K, V, device=k.device, dtype=torch.float32)
    else:
        S_init = initial_state.float()
    S0, S = _StateScan.apply(trans, drive, S_init)
    o = Qg @ S0 + P @ v
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    if valid is not None:
        o = torch.where(valid[:, :, None, None], o, 0.0)
    o = o.to(out_dtype)
    if output_states_at is None:
        return o, S
    # The delta rule's inner-state replay with u = v: S_p = diag(e^{sum g}) S0 + sum_j k_j e^{..} v_j^T.
    return o, S, _requested_states(output_states_at, lengths, T, S_init, S, S0, v, k, g, C)


def naive_recurrent_gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step reference (not for training): shapes as the chunked op; (o, final) in ``dtype``."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = 1.0 if scale is None else scale
    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
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
