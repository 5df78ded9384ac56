"""Decay-weighted scores inside each chunk, without overflow or cancellation.

With per-channel decay the intra-chunk products need the decay inside the K-contraction:
sum_c a_t[c] b_j[c] exp(G_t[c] - G_j[c]) with G the in-chunk cumulative log-decay. The usual
factorisation (a * exp(G)) @ (b * exp(-G))^T overflows fp32 once -G > 88 (5 steps of g = -20); the
stock transformers chunk avoids that by building a [C, C, K] decay tensor per chunk, which is slow.
Two forms here, both exact to a few ulps per factor:

- Factored about each chunk's midpoint (the usual case). G is summed in fp64 (each G_t a direct
  sum of the chunk's g's, exact to fp64 rounding), and where every chunk's G stays within a spread
  of :data:`FACTOR_SPAN` per key channel, exp(G_t - G_j) = exp(G_t - mid) exp(mid - G_j) with
  mid the midpoint of the chunk's range: both factors within e^{+-20}, each formed in fp64 and
  rounded once to fp32, so the scores are two masked matmuls (about 30 ops forward for a layer's
  call, against about 130 for the split below, which the small micro-batches of a cut tree pay as
  a fixed cost).
- Binary split, for strong decays (a chunk's G spanning more than :data:`FACTOR_SPAN`): the chunk
  is split recursively in halves (C/2, C/4, ..., 1): each pair j < t is separated at exactly one
  level, with j in the left half and t in the right half of a block, and the reference point r is
  the last position of the left half. Then both factors exp(G_t - G_r) and exp(G_r - G_j) are <= 1
  (no overflow for any g <= 0) and each level is one batched matmul, C log2(C) K work in
  elementwise ops. Every exponent is formed as a direct sum of the g's it spans (cumulative sums
  inside a half-block), never as a difference of two long cumulative sums, so a large early decay
  costs no precision later.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from harts.ops.precision import no_autocast

__all__ = ["FACTOR_SPAN", "chunk_prefix_sum", "exclusive_suffix_sum", "intra_chunk_scores"]


#: Longest chunk whose sums along it run as one product with a 0/1 triangle.
_MAX_PRODUCT_SUM = 128

#: Largest spread (max - min) of a chunk's path sums, per key channel, for which the per-key decays
#: factor as e^{G_t - mid} e^{mid - G_j}: each factor within e^{+-20} (no overflow; each formed in
#: fp64 and rounded once to fp32, at most half an ulp of relative error apiece).
FACTOR_SPAN = 40.0


@functools.lru_cache(maxsize=32)
def _triangle(n: int, upper: bool, diagonal: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, n] 0/1: ``torch.ones(n, n).triu(diagonal)`` if ``upper`` else ``.tril(diagonal)``."""
    ones = torch.ones(n, n, dtype=dtype, device=device)
    return ones.triu(diagonal) if upper else ones.tril(diagonal)


def _by_product(x: torch.Tensor, dim: int) -> bool:
    return dim % x.dim() == x.dim() - 2 and x.shape[dim] <= _MAX_PRODUCT_SUM


def chunk_prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_{s <= t} x[s] along the chunk dimension (second to last) of x [..., C, K].

    One product with the lower triangular 0/1 matrix: each out[t] a direct sum of x[0..t] (the zero
    terms are exact), as ``cumsum`` gives, but one op each way where cumsum's backward takes three
    (flip, cumsum, flip). ``matmul`` broadcasts the triangle over the batch without a copy of x
    (``einsum`` permuted and copied x both ways: 1.5-2.5x the time, forward and backward, on chunk
    tree inputs [M, H, C, K] and on small ones). Chunks longer than :data:`_MAX_PRODUCT_SUM`:
    ``cumsum``.
    """
    if not _by_product(x, -2):
        return x.cumsum(-2)
    return torch.matmul(_triangle(x.shape[-2], False, 0, x.dtype, x.device), x)


def exclusive_suffix_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """out[t] = sum_{s > t} x[s] along ``dim``: a direct sum of those terms (no cancellation).

    Along the chunk dimension (second to last, up to :data:`_MAX_PRODUCT_SUM` long) it is one
    product with the strictly upper triangular 0/1 matrix (the zero terms are exact): one op each
    way instead of flip, cumsum and flip, which cost 2-3x as much on a chunk tree's [M, H, C, K]
    inputs. Elsewhere, cumulative sums from the end.
    """
    if _by_product(x, dim):
        return torch.matmul(_triangle(x.shape[dim], True, 1, x.dtype, x.device), x)
    inclusive = x.flip(dim).cumsum(dim).flip(dim)
    dim = dim % x.dim()
    # shift by one towards the start, a zero last: (0, 0) for each dimension after ``dim``, then (0, 1)
    return F.pad(inclusive.narrow(dim, 1, x.shape[dim] - 1), (0, 0) * (x.dim() - 1 - dim) + (0, 1))


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


def intra_chunk_scores(q, k, g, keys: bool = True):
    """Decay-weighted scores inside each chunk.

    q, k, g: [..., C, K], C a power of two. Returns (P, A) of shape [..., C, C]:
      P[t, j] = sum_c q_t[c] k_j[c] exp(sum_{j<s<=t} g_s[c])  for j <= t, else 0
      A[t, j] = same with k_t in place of q_t, for j < t only (strictly lower);
    A is None when ``keys`` is False (a caller without a delta term), where the factored form
    skips it. Factored about each chunk's midpoint where the spread allows (module docstring),
    else the binary split: in each block of 2s positions, rows t of the right half meet cols j of
    the left half through the reference r = last position of the left half, so j <= r < t and
      exp(sum_{j<s<=t} g_s) = exp(sum_{r<s<=t} g_s) * exp(sum_{j<s<=r} g_s),
    both factors <= 1 and both sums of g's (no difference of sums): no overflow, no cancellation.
    """
    factored = _factored_scores(q, k, g, keys)
    if factored is not None:
        return factored
    *lead, C, K = k.shape
    q_vals, k_vals = [], []
    s = 1
    while s < C:
        n_par = C // (2 * s)
        # left and right halves of each block by unbind, whose backward is one stack (a select's
        # is a zero tensor and a copy each, and a sum where two selects read one tensor)
        (g_left, g_right), (_, q_right), (k_left, k_right) = (
            x.reshape(*lead, n_par, 2, s, K).unbind(-3) for x in (g, q, k)
        )
        if s == 1:  # pairs (2i, 2i + 1): the row weight is exp(g_t), the column weight exp(0) = 1
            row_w, cols = torch.exp(g_right), k_left
        else:
            row_w = torch.exp(chunk_prefix_sum(g_right))  # exp(sum_{r<s'<=t} g)
            col_w = torch.exp(exclusive_suffix_sum(g_left, -2))  # exp(sum_{j<s'<=r} g)
            cols = k_left * col_w  # [..., n_par, s, K]
        rows = torch.cat([q_right * row_w, k_right * row_w], -2)  # [..., n_par, 2s, K]
        blk = rows @ cols.transpose(-1, -2)  # [..., n_par, 2s, s]
        q_vals.append(blk[..., :s, :].reshape(*lead, -1))
        k_vals.append(blk[..., s:, :].reshape(*lead, -1))
        s *= 2
    zero = k.new_zeros(*lead, 1)
    diag = (q * k).sum(-1)  # P[t, t] = q_t . k_t (no decay between a token and itself)
    idx_p, idx_a = _pair_layout(C, k.device)
    P = torch.cat(q_vals + [diag, zero], -1).index_select(-1, idx_p).reshape(*lead, C, C)
    A = torch.cat(k_vals + [zero], -1).index_select(-1, idx_a).reshape(*lead, C, C)
    return P, (A if keys else None)


def _factored_scores(q, k, g, keys: bool):
    """(P, A) as two masked products about each chunk's midpoint path sum, or None where some
    chunk's path sums spread wider than :data:`FACTOR_SPAN` in some key channel.

    The spread test reads one number back from the device (a sync on a GPU, where the fla kernels
    usually run instead)."""
    G = chunk_prefix_sum(g.double())  # each G_t a direct sum of the chunk's g_0..g_t, in fp64
    hi, lo = G.detach().amax(-2, keepdim=True), G.detach().amin(-2, keepdim=True)
    if float((hi - lo).max()) > FACTOR_SPAN:
        return None
    mid = (hi + lo) / 2  # the scores do not depend on it (its factors cancel): no gradient
    out = _FactoredScores.apply(q, k, G, mid, keys)
    return out if keys else (out[0], None)


class _FactoredScores(torch.autograd.Function):
    """P (and A when ``keys``) from q, k [..., C, K], the path sums G [..., C, K] (fp64) and
    ``mid`` [..., 1, K], the midpoint of each chunk's range: with r = e^{G_t - mid} and
    c = e^{mid - G_j} (both within e^{+-20}; each formed in fp64 and rounded once to fp32),

        P = ((q r) (k c)^T) * strict + diag(q . k),    A = ((k r) (k c)^T) * strict.

    The diagonal carries no decay: formed as q_t . k_t, not as r_t c_t q_t . k_t, whose two
    factors' gradients would cancel only to rounding in g's gradient (noise against a small true
    gradient: GDN's per-head gate sums it over K). Backward keeps q, k, r and c (fp32) and forms
    the products again; the scores do not depend on mid (its factors cancel), so G's gradient is
    dr r - dc c.
    """

    @staticmethod
    def forward(ctx, q, k, G, mid, keys: bool):
        C = k.shape[-2]
        r, c = torch.exp(G - mid).float(), torch.exp(mid - G).float()
        strict = _triangle(C, False, -1, k.dtype, k.device)
        kc_t = (k * c).transpose(-1, -2)
        if keys:
            P, A = (torch.cat([q * r, k * r], -2) @ kc_t).split(C, -2)
            A = A * strict
        else:
            P, A = (q * r) @ kc_t, None
        P = P * strict + torch.diag_embed((q * k).sum(-1))
        ctx.save_for_backward(q, k, r, c)
        ctx.keys = keys
        return (P, A) if keys else (P,)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_p, grad_a=None):
        with no_autocast(grad_p.device):  # fp32 as the forward (a backward called inside autocast)
            return _FactoredScores._backward(ctx, grad_p, grad_a)

    @staticmethod
    def _backward(ctx, grad_p, grad_a):
        q, k, r, c = ctx.saved_tensors
        strict = _triangle(k.shape[-2], False, -1, k.dtype, k.device)
        kc, qr = k * c, q * r
        dp = grad_p * strict
        d_diag = grad_p.diagonal(dim1=-2, dim2=-1)[..., None]
        d_qr = dp @ kc  # [..., C, K]
        d_kc = dp.transpose(-1, -2) @ qr
        d_r = d_qr * q
        dq = d_qr * r + d_diag * k
        dk = d_diag * q
        if ctx.keys and grad_a is not None:
            da = grad_a * strict
            d_kr = da @ kc
            d_kc = d_kc + da.transpose(-1, -2) @ (k * r)
            d_r = d_r + d_kr * k
            dk = dk + d_kr * r
        dk = dk + d_kc * c
        dG = (d_r * r - d_kc * k * c).double()
        return dq, dk, dG, None, None
