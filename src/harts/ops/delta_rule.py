"""Chunked gated delta rule with per-channel log-decay (KDA; GDN when the gate is constant over K).

Plain PyTorch (CPU and GPU), differentiable through autograd, fp32 throughout. It computes exactly the
recurrence of transformers' ``recurrent_kimi_delta_attention`` (see ``delta_rule_naive``), but chunk by
chunk: a Python loop over T / chunk_size chunks carries the [K, V] state, everything inside a chunk is
batched matmuls plus one unit-lower-triangular solve (the WY / UT form of Yang et al., "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length", and "Gated Delta Networks", sec. 3).

Limits: same number of heads for q/k and v (the caller repeats heads for grouped layouts); g must be
<= 0 (a decay); inputs are assumed finite; chunk_size a power of two. Extra memory is O(B H T (C + K))
per call (C x C chunk matrices); autograd also keeps the chunk-start states (B H T/C K V).

Overflow and cancellation. With per-channel decay the intra-chunk products need the decay inside the
K-contraction: sum_c a_t[c] b_j[c] exp(G_t[c] - G_j[c]) with G the in-chunk cumulative log-decay. The
usual factorisation (a * exp(G)) @ (b * exp(-G))^T overflows fp32 once -G > 88 (5 steps of g = -20);
the stock transformers chunk avoids that by building a [C, C, K] decay tensor per chunk, which is slow.
Here the chunk is split recursively in halves (C/2, C/4, ..., 1): each pair j < t is separated at
exactly one level, with j in the left half and t in the right half of a block, and the reference point
r is the last position of the left half. Then both factors exp(G_t - G_r) and exp(G_r - G_j) are <= 1
(no overflow for any g <= 0) and each level is one batched matmul, C log2(C) K work in elementwise ops.
Every exponent is formed as a direct sum of the g's it spans (cumulative sums inside a half-block),
never as a difference of two long cumulative sums, so a large early decay costs no precision later.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from harts.ops.precision import no_autocast


def _exclusive_suffix_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """out[t] = sum_{s > t} x[s] along ``dim``, accumulated from the end (no cancellation)."""
    inclusive = x.flip(dim).cumsum(dim).flip(dim)
    n = x.shape[dim]
    return torch.cat([inclusive.narrow(dim, 1, n - 1), torch.zeros_like(inclusive.narrow(dim, 0, 1))], dim)


@functools.lru_cache(maxsize=16)
def _pair_layout(C: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (t, j) entry of a C x C chunk matrix lives in the concatenated per-level values.

    Level s (s = 1, 2, ..., C/2) holds, for each parent block of 2s positions, the s x s products of its
    right half (rows t) with its left half (cols j). Every pair j < t belongs to exactly one level: the
    one of the highest bit where t and j differ. Returns flat indices for P (lower incl. diagonal, the
    diagonal stored after all levels) and A (strictly lower); the last slot is a zero.
    """
    t = torch.arange(C)[:, None].expand(C, C)
    j = torch.arange(C)[None, :].expand(C, C)
    n_lower = C * (C - 1) // 2
    idx_p = torch.full((C, C), n_lower + C, dtype=torch.long)  # zero slot
    lower = j < t
    diff = torch.where(lower, t ^ j, torch.ones_like(t))
    s = 1 << (torch.floor(torch.log2(diff.double())).long())  # half size of the splitting level
    offset = (C // 2) * (s - 1)  # sum over smaller levels s' of (C / 2s') * s'^2 = (C/2) (s - 1)
    par = t // (2 * s)
    slot = offset + par * s * s + (t - par * 2 * s - s) * s + (j - par * 2 * s)
    idx_p = torch.where(lower, slot, idx_p)
    idx_a = torch.where(lower, slot, torch.full_like(idx_p, n_lower))
    idx_p = torch.where(t == j, n_lower + t, idx_p)
    return idx_p.reshape(-1).to(device), idx_a.reshape(-1).to(device)


def _intra_chunk_scores(q, k, g):
    """Decay-weighted scores inside each chunk.

    q, k, g: [..., C, K], C a power of two. Returns (P, A) of shape [..., C, C]:
      P[t, j] = sum_c q_t[c] k_j[c] exp(sum_{j<s<=t} g_s[c])  for j <= t, else 0
      A[t, j] = same with k_t in place of q_t, for j < t only (strictly lower).
    Binary split: in each block of 2s positions, rows t of the right half meet cols j of the left half
    through the reference r = last position of the left half, so j <= r < t and
      exp(sum_{j<s<=t} g_s) = exp(sum_{r<s<=t} g_s) * exp(sum_{j<s<=r} g_s),
    both factors <= 1 and both sums of g's (no difference of sums): no overflow, no cancellation.
    """
    *lead, C, K = k.shape
    q_vals, k_vals = [], []
    s = 1
    while s < C:
        n_par = C // (2 * s)
        gs, qs, ks = (x.reshape(*lead, n_par, 2, s, K) for x in (g, q, k))
        row_w = torch.exp(gs[..., 1, :, :].cumsum(-2))  # exp(sum_{r<s'<=t} g)
        col_w = torch.exp(_exclusive_suffix_sum(gs[..., 0, :, :], -2))  # exp(sum_{j<s'<=r} g)
        rows = torch.cat([qs[..., 1, :, :] * row_w, ks[..., 1, :, :] * row_w], -2)  # [..., n_par, 2s, K]
        cols = ks[..., 0, :, :] * col_w  # [..., n_par, s, K]
        blk = rows @ cols.transpose(-1, -2)  # [..., n_par, 2s, s]
        q_vals.append(blk[..., :s, :].reshape(*lead, -1))
        k_vals.append(blk[..., s:, :].reshape(*lead, -1))
        s *= 2
    zero = k.new_zeros(*lead, 1)
    diag = (q * k).sum(-1)  # P[t, t] = q_t . k_t (no decay between a token and itself)
    idx_p, idx_a = _pair_layout(C, k.device)
    P = torch.cat(q_vals + [diag, zero], -1).index_select(-1, idx_p).reshape(*lead, C, C)
    A = torch.cat(k_vals + [zero], -1).index_select(-1, idx_a).reshape(*lead, C, C)
    return P, A


class _StateScan(torch.autograd.Function):
    """The chunk-to-chunk recurrence S_{n+1} = T_n S_n + D_n, with a hand-written backward.

    Autograd through a Python loop would keep every step's state twice (the matmul's saved input
    and the stacked chunk-start states) and pay one graph node per chunk; this keeps the stacked
    states once (they are the output, which the caller's ops save anyway) and runs the adjoint
    recurrence g_n = T_n^T g_{n+1} + dS0_n in one backward call.
    trans [B, H, N, K, K], drive [B, H, N, K, V], initial [B, H, K, V] ->
    (starts [B, H, N, K, V]: S_0 .. S_{N-1}, final S_N [B, H, K, V]).
    A diagonal T (gated linear attention: a decay per key channel) is passed as its diagonal
    [B, H, N, K] and applied elementwise: K times less work than the K x K product, which
    matters where K is large against V (Mamba's selective scan has V = 1).
    """

    @staticmethod
    def forward(ctx, trans, drive, initial):
        n_chunks = trans.shape[2]
        diagonal = trans.dim() == drive.dim() - 1
        starts = drive.new_empty(drive.shape)
        S = initial
        for n in range(n_chunks):
            starts[:, :, n] = S
            if diagonal:
                S = torch.addcmul(drive[:, :, n], trans[:, :, n, :, None], S)
            else:
                S = torch.baddbmm(drive[:, :, n].flatten(0, 1), trans[:, :, n].flatten(0, 1),
                                  S.flatten(0, 1)).view_as(S)
        ctx.save_for_backward(trans, starts)
        ctx.diagonal = diagonal
        return starts, S

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_starts, grad_final):
        # Called inside an autocast region, the adjoint stays in the forward's fp32 all the same.
        trans, starts = ctx.saved_tensors  # once: checkpointing's saved tensors unpack only once
        with no_autocast(trans.device):
            B, H, n_chunks, K, V = starts.shape
            g = grad_final if grad_final is not None else starts.new_zeros(B, H, K, V)
            grad_trans = torch.empty_like(trans)
            grad_drive = torch.empty_like(starts)
            for n in range(n_chunks - 1, -1, -1):
                grad_drive[:, :, n] = g
                if ctx.diagonal:
                    grad_trans[:, :, n] = (g * starts[:, :, n]).sum(-1)
                    g = trans[:, :, n, :, None] * g
                else:
                    grad_trans[:, :, n] = g @ starts[:, :, n].transpose(-1, -2)
                    g = trans[:, :, n].transpose(-1, -2) @ g
                if grad_starts is not None:
                    g = g + grad_starts[:, :, n]
            return grad_trans, grad_drive, g


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

    Shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V] (zeros if
    None); lengths LongTensor [B] (true lengths; positions >= length leave the state unchanged and give
    zero output); output_states_at LongTensor [B, S] of token counts in 0..T.
    g is the log-decay per key channel (<= 0); pass a per-head gate expanded over K for GDN. q and k
    are used as given (no l2norm here); ``scale`` (default K ** -0.5) multiplies q.

    Returns (o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32), plus states [B, S, H, K, V]
    fp32 as a third output when ``output_states_at`` is given (the state after that many tokens).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    scale = K**-0.5 if scale is None else scale
    C = chunk_size
    if C < 1 or C & (C - 1):
        raise ValueError(f"chunk_size must be a power of two, got {C}")
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    valid = None
    if lengths is not None:
        # Padded steps become identities: g = 0 keeps the state, beta = k = v = 0 adds nothing.
        valid = torch.arange(T, device=k.device)[None, :] < lengths.to(k.device)[:, None]  # [B, T]
        vm = valid[:, :, None, None]
        k, v, g = (torch.where(vm, x, 0.0) for x in (k, v, g))
        beta = torch.where(valid[:, :, None], beta, 0.0)

    N = max(1, math.ceil(T / C))
    pad = N * C - T

    def chunks(x):  # [B, T, H, D] -> [B, H, N, C, D], zero-padded at the end (identity steps)
        return F.pad(x.transpose(1, 2), (0, 0, 0, pad)).reshape(B, H, N, C, x.shape[-1])

    q, k, v, g = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]

    P, A = _intra_chunk_scores(q, k, g)
    G = g.cumsum(-2)  # sum_{s<=t} g_s from the chunk start
    # Within a chunk, u_t = beta_t (v_t - k_t^T S_{t-1}') solves (I + diag(beta) A) U = beta (V - (K*e^G) S0)
    # (UT transform, Yang et al. 2024); solve once for both right-hand sides.
    rhs = torch.cat([v * beta, k * torch.exp(G) * beta], -1)
    X = torch.linalg.solve_triangular(beta * A, rhs, upper=False, unitriangular=True)
    W, Kc = X[..., :V], X[..., V:]  # U = W - Kc @ S0
    Qg = q * torch.exp(G)
    Kd = k * torch.exp(_exclusive_suffix_sum(g, -2))  # k_j * exp(sum_{s>j} g_s): decay to chunk end
    last = torch.exp(G[..., -1, :])  # [B, H, N, K]
    # S_next = diag(last) S0 + Kd^T U = (diag(last) - Kd^T Kc) S0 + Kd^T W
    Kd_t = Kd.transpose(-1, -2)
    trans = torch.diag_embed(last) - Kd_t @ Kc  # [B, H, N, K, K]
    drive = Kd_t @ W  # [B, H, N, K, V]

    if initial_state is None:
        S_init = torch.zeros(B, H, K, V, device=k.device, dtype=torch.float32)
    else:
        S_init = initial_state.float()
    S0, S = _StateScan.apply(trans, drive, S_init)  # chunk-start states [B, H, N, K, V], final state
    U = W - Kc @ S0
    o = Qg @ S0 + P @ U  # [B, H, N, C, V]
    o = o.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    if valid is not None:
        o = torch.where(valid[:, :, None, None], o, 0.0)
    o = o.to(out_dtype)
    if output_states_at is None:
        return o, S
    return o, S, _requested_states(output_states_at, lengths, T, S_init, S, S0, U, k, g, C)


def _requested_states(at, lengths, T, S_init, S_final, S0, U, k, g, C):
    """[B, S, H, K, V]: the state after ``at`` [B, S] tokens of each segment.

    0 tokens is the initial state and a segment's length or more its final state (padded steps
    are identities); only the offsets strictly inside a segment replay part of a chunk, gathered
    as one flat list, so unused columns of ``at`` (a call's segments emit different numbers of
    states) cost nothing.
    """
    at = at.to(S0.device)
    length = (lengths.to(at.device) if lengths is not None else torch.full_like(at[:, 0], T))[:, None]
    shape = (*at.shape, *S_final.shape[1:])
    states = torch.where(
        (at <= 0)[..., None, None, None], S_init[:, None].expand(shape), S_final[:, None].expand(shape)
    )
    b, s = ((at > 0) & (at < length)).nonzero(as_tuple=True)
    if not b.numel():
        return states
    # Autograd keeps each request's gathered chunk of k and u ([P, H, C, K + V]) for backward:
    # real requests only, about 2 MiB at the peak of a 1000-token bailing_hybrid micro-batch,
    # where recomputing them in backward cost 6% of the step.
    inner = _states_at(b, at[b, s], S0, U, k, g, C)
    return states.index_put((b, s), inner)


def _states_at(b, p, S0, U, k, g, C):
    """State of segment ``b[i]`` after ``p[i]`` tokens (0 < p <= its length), for P requests:
    gather chunk n = (p-1)//C and replay m = p - nC steps.

    S_p = diag(exp(sum_{s<m} g_s)) S0_n + sum_{j<m} (k_j exp(sum_{j<s<m} g_s)) u_j^T   (chunk-local s, j).
    """
    n = (p - 1) // C
    m = p - n * C

    def pick(x):  # [B, H, N, ...] -> [P, H, ...]
        return x[b, :, n]

    keep = (torch.arange(C, device=p.device) < m[:, None])[:, None, :, None]  # [P, 1, C, 1]
    g_kept = pick(g) * keep
    decay0 = torch.exp(g_kept.sum(-2))  # [P, H, K]
    kw = pick(k) * torch.exp(_exclusive_suffix_sum(g_kept, -2)) * keep
    return decay0[..., None] * pick(S0) + kw.transpose(-1, -2) @ pick(U)
