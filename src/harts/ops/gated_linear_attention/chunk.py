"""Chunked gated linear attention (no delta term).

The recurrence, with g the log-decay per key channel (<= 0):

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale * q_t)

It is MiniMax's lightning attention (g = -slope of the head, the same for every channel; HF's
``MiniMaxLightningAttention`` computes it block-wise with precomputed decays, which is this same sum),
Mamba-2's SSD (q = C, k = B, v = dt * x, g = dt * A per head) and Mamba's selective scan (g = dt * A
per channel and state entry, V = 1). A delta-rule op with beta = 0 is not this: it would drop
the k v^T term too.

Chunked like :mod:`harts.ops.delta_rule.chunk` on the same pieces (:mod:`harts.ops.chunked`): the
overflow-free intra-chunk scores, the chunk-to-chunk scan S_{n+1} = diag(last_n) S_n + D_n (given
the diagonal, applied elementwise), and the replay of states at inner offsets from chunk-start
states. Without the delta term there is no triangular solve: o = (q * e^G) S0 + P v, S_next =
diag(e^G_last) S0 + (k * e^{suffix})^T v.

Limits: one state [K, V] per head (grouped layouts repeat heads first); chunk a power of two;
inputs finite. Memory is that of the delta-rule op without its C x C solve.
"""

from __future__ import annotations

import torch

from harts.ops.chunked import (
    ChunkedInputs,
    SegmentChunks,
    chunk_prefix_sum,
    exclusive_suffix_sum,
    intra_chunk_scores,
)

__all__ = ["chunked_gated_linear_attention", "gated_linear_attention_chunks"]


def gated_linear_attention_chunks(x: ChunkedInputs, scan, initial: torch.Tensor):
    """Gated linear attention's arithmetic over chunks [..., C, .] of any layout; ``scan`` as in
    :func:`~harts.ops.delta_rule.chunk.delta_rule_chunks`. Returns (o [..., C, V], chunk-start
    states, final states)."""
    q, k, v, g = x.q, x.k, x.v, x.g
    P, _ = intra_chunk_scores(q, k, g, keys=False)  # P[t, j] = q_t . (k_j * exp(sum_{j<s<=t} g_s)), j <= t
    G = chunk_prefix_sum(g)
    decay = torch.exp(G)
    Qg = q * decay
    Kd = k * torch.exp(exclusive_suffix_sum(g, -2))  # decay from j to the chunk's end
    trans = decay[..., -1, :]  # [..., K]: the diagonal of the chunk's state map
    drive = Kd.transpose(-1, -2) @ v  # [..., K, V]
    S0, S = scan(trans, drive, initial)
    return Qg @ S0 + P @ v, S0, S


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

    Shapes: q, k [B, T, H, K]; g [B, T, H, K] or one per head [B, T, H] / [B, T, H, 1]; v [B, T, H, V];
    initial_state [B, H, K, V] (zeros if None); lengths LongTensor [B]; output_states_at LongTensor
    [B, S] of token counts in 0..T. ``scale`` (default 1) multiplies q. Returns (o [B, T, H, V] in
    q's dtype, final_state [B, H, K, V] fp32[, states [B, S, H, K, V] fp32 after that many tokens]).
    """
    scale = 1.0 if scale is None else scale
    seg = SegmentChunks(k, lengths, chunk_size)
    x = seg.inputs(q, k, v, g, (), scale)
    initial = seg.initial(initial_state, x)
    o, S0, S = gated_linear_attention_chunks(x, seg.scan, initial)
    o = seg.outputs(o, q.dtype)
    if output_states_at is None:
        return o, S
    # The delta rule's inner-state replay with u = v: S_p = diag(e^{sum g}) S0 + sum_j k_j e^{..} v_j^T.
    return o, S, seg.states_at(output_states_at, initial, S, S0, x.v, x)
