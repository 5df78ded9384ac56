"""Chunked gated delta rule with per-channel log-decay (KDA; GDN with its per-head gate).

Plain PyTorch (CPU and GPU), differentiable through autograd, fp32 throughout. It computes exactly the
recurrence of transformers' ``recurrent_kimi_delta_attention`` (see :mod:`~harts.ops.delta_rule.naive`),
but chunk by chunk: a Python loop over T / chunk_size chunks carries the [K, V] state, everything
inside a chunk is batched matmuls plus one unit-lower-triangular solve (the WY / UT form of Yang et
al., "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", and "Gated Delta
Networks", sec. 3). The intra-chunk scores are the overflow-free binary split of
:mod:`harts.ops.chunked.scores`; the chunk-to-chunk recurrence is the scan of
:mod:`harts.ops.chunked.scan`.

Limits: same number of heads for q/k and v (the caller repeats heads for grouped layouts); g must be
<= 0 (a decay); inputs are assumed finite; chunk_size a power of two. Extra memory is O(B H T (C + K))
per call (C x C chunk matrices); autograd also keeps the chunk-start states (B H T/C K V).
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

__all__ = ["chunked_gated_delta_rule", "delta_rule_chunks"]


def delta_rule_chunks(x: ChunkedInputs, scan, initial: torch.Tensor):
    """The delta rule's arithmetic over chunks [..., C, .] of any layout (segments, chunk tree).

    ``scan(trans, drive, initial)`` chains the chunks' state maps S_end = trans S_start + drive and
    returns (chunk-start states, final states). Returns (o [..., C, V], chunk-start states, final
    states, U [..., C, V]: what each step writes into the state).
    """
    q, k, v, g = x.q, x.k, x.v, x.g
    (beta,) = x.scalars
    V = v.shape[-1]
    P, A = intra_chunk_scores(q, k, g)
    G = chunk_prefix_sum(g)  # sum_{s<=t} g_s from the chunk start
    # Within a chunk, u_t = beta_t (v_t - k_t^T S_{t-1}') solves (I + diag(beta) A) U = beta (V - (K*e^G) S0)
    # (UT transform, Yang et al. 2024); solve once for both right-hand sides.
    decay = torch.exp(G)  # formed once for its three readers
    rhs = torch.cat([v * beta, k * decay * beta], -1)
    X = torch.linalg.solve_triangular(beta * A, rhs, upper=False, unitriangular=True)
    W, Kc = X[..., :V], X[..., V:]  # U = W - Kc @ S0
    Qg = q * decay
    Kd = k * torch.exp(exclusive_suffix_sum(g, -2))  # k_j * exp(sum_{s>j} g_s): decay to chunk end
    # S_next = diag(last) S0 + Kd^T U = (diag(last) - Kd^T Kc) S0 + Kd^T W
    Kd_t = Kd.transpose(-1, -2)
    trans = torch.diag_embed(decay[..., -1, :]) - Kd_t @ Kc  # [..., K, K]
    drive = Kd_t @ W  # [..., K, V]
    S0, S = scan(trans, drive, initial)
    U = W - Kc @ S0
    return Qg @ S0 + P @ U, S0, S, U


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    output_states_at: torch.Tensor | None = None,
):
    """Gated delta rule over a batch of right-padded segments, chunked.

    Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (the log-decay per key channel, <= 0),
    or one per head [B, T, H] / [B, T, H, 1] (GDN), expanded over K here; beta [B, T, H];
    initial_state [B, H, K, V] (zeros if None); lengths LongTensor [B] (true lengths; positions >=
    length leave the state unchanged and give zero output); output_states_at LongTensor [B, S] of
    token counts in 0..T. q and k are used as given (no l2norm here); ``scale`` (default K ** -0.5)
    multiplies q.

    Returns (o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32), plus states [B, S, H, K, V]
    fp32 as a third output when ``output_states_at`` is given (the state after that many tokens).
    """
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    seg = SegmentChunks(k, lengths, chunk_size)
    x = seg.inputs(q, k, v, g, (beta,), scale)
    initial = seg.initial(initial_state, x)
    o, S0, S, U = delta_rule_chunks(x, seg.scan, initial)
    o = seg.outputs(o, q.dtype)
    if output_states_at is None:
        return o, S
    return o, S, seg.states_at(output_states_at, initial, S, S0, U, x)
