"""Recurrences over a chunk tree (:mod:`harts.plan.chunk_tree`): one call per layer.

The chunked ops of :mod:`harts.ops.delta_rule` and :mod:`harts.ops.gated_linear_attention` reduce
a chunk to an affine map of its start state: S_end = T S_start + D, o = Qg S_start + (terms of the
chunk alone). Those terms do not depend on where the chunk sits, so here they are computed for
every chunk of every node at once, as one batch of [M] chunks; only the maps are chained, down the
chunk tree, one level (all chunks at one depth) per step, by :class:`_TreeStateScan`. A padded
slot is an identity step (k = v = g = beta = 0), so a node's last chunk ends with the node's
final state. The arithmetic per chunk is the chunked op's, so the results agree with it (and with
the fp64 reference) to fp32 rounding.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from harts.ops.delta_rule import _exclusive_suffix_sum, _intra_chunk_scores
from harts.ops.precision import no_autocast
from harts.plan.chunk_tree import ChunkTreePlan

__all__ = ["chunk_tree_gated_delta_rule", "chunk_tree_gated_linear_attention"]


class _TreeStateScan(torch.autograd.Function):
    """S_start[m] = states[source[m]], S_end[m] = T[m] S_start[m] + D[m], level by level.

    trans [M, H, K, K] (or its diagonal [M, H, K], applied elementwise), drive [M, H, K, V],
    initial [R, H, K, V] -> (starts [M, H, K, V], ends [M, H, K, V]). The states buffer holds the
    R initial states, then the M end states; a chunk's source row is filled by an earlier level.
    Backward runs the adjoint up the tree: a chunk's end-state gradient is complete once every
    chunk of the next levels has added its start-state gradient to its source.
    """

    @staticmethod
    def forward(ctx, trans, drive, initial, source, levels):
        r = initial.shape[0]
        diagonal = trans.dim() == drive.dim() - 1  # [M, H, K]: a decay per key channel
        buf = torch.empty((r + trans.shape[0], *drive.shape[1:]), dtype=drive.dtype, device=drive.device)
        buf[:r] = initial
        starts = torch.empty_like(drive)
        for idx in levels:
            s0 = buf.index_select(0, source[idx])
            starts[idx] = s0
            if diagonal:
                buf[r + idx] = torch.addcmul(drive[idx], trans[idx][..., None], s0)
            else:
                buf[r + idx] = torch.baddbmm(
                    drive[idx].flatten(0, 1), trans[idx].flatten(0, 1), s0.flatten(0, 1)
                ).view_as(s0)
        ctx.save_for_backward(trans, starts, source)
        ctx.levels, ctx.r, ctx.diagonal = levels, r, diagonal
        return starts, buf[r:]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_starts, grad_ends):
        # Called inside an autocast region, the adjoint stays in the forward's fp32 all the same.
        trans, starts, source = ctx.saved_tensors  # once: checkpointing's saved tensors unpack only once
        with no_autocast(trans.device):
            r = ctx.r
            grad = starts.new_zeros((r + trans.shape[0], *starts.shape[1:]))
            if grad_ends is not None:
                grad[r:] = grad_ends
            grad_trans = torch.empty_like(trans)
            for idx in reversed(ctx.levels):
                g_end = grad[r + idx]  # complete: every reader of this end state is in a later level
                if ctx.diagonal:
                    grad_trans[idx] = (g_end * starts[idx]).sum(-1)
                    g_start = trans[idx][..., None] * g_end
                else:
                    grad_trans[idx] = g_end @ starts[idx].transpose(-1, -2)
                    g_start = trans[idx].transpose(-1, -2) @ g_end
                if grad_starts is not None:
                    g_start = g_start + grad_starts[idx]
                grad.index_add_(0, source[idx], g_start)
            return grad_trans, grad[r:].clone(), grad[:r].clone(), None, None


def _chunks(x: torch.Tensor, plan: ChunkTreePlan) -> torch.Tensor:
    """[N, H, D] per unique token -> [1, H, M, C, D] per chunk slot (padded slots zero)."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)
    return padded[plan.token_index].permute(2, 0, 1, 3)[None]


def _tokens(o: torch.Tensor, plan: ChunkTreePlan) -> torch.Tensor:
    """[1, H, M, C, V] per chunk slot -> [N, H, V] per unique token."""
    h, m, c, v = o.shape[1:]
    return o[0].permute(1, 2, 0, 3).reshape(m * c, h, v)[plan.output_index]


def _scan(trans, drive, initial, plan: ChunkTreePlan):
    """Chunk-start states [1, H, M, K, V] and end states [M, H, K, V] down the chunk tree."""
    t = trans[0].transpose(0, 1)  # [M, H, K, K], or [M, H, K] for a diagonal map
    d = drive[0].transpose(0, 1)  # [M, H, K, V]
    starts, ends = _TreeStateScan.apply(t, d, initial.float(), plan.source, plan.levels)
    return starts.transpose(0, 1)[None], ends


def chunk_tree_gated_delta_rule(q, k, v, g, beta, plan: ChunkTreePlan, initial_state, scale=None):
    """The gated delta rule (:func:`~harts.ops.delta_rule.chunked_gated_delta_rule`'s arithmetic)
    over ``plan``. q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; initial_state [R, H, K, V] for the
    plan's roots. Returns (o [N, H, V] in q's dtype, end states [M, H, K, V] fp32)."""
    out_dtype = q.dtype
    kd = k.shape[-1]
    vd = v.shape[-1]
    scale = kd**-0.5 if scale is None else scale
    q, k, v, g = (_chunks(x.float(), plan) for x in (q, k, v, g))
    q = q * scale
    beta = _chunks(beta.float().unsqueeze(-1), plan)  # [1, H, M, C, 1]
    P, A = _intra_chunk_scores(q, k, g)
    G = g.cumsum(-2)
    rhs = torch.cat([v * beta, k * torch.exp(G) * beta], -1)
    X = torch.linalg.solve_triangular(beta * A, rhs, upper=False, unitriangular=True)
    W, Kc = X[..., :vd], X[..., vd:]
    Qg = q * torch.exp(G)
    Kd_t = (k * torch.exp(_exclusive_suffix_sum(g, -2))).transpose(-1, -2)
    trans = torch.diag_embed(torch.exp(G[..., -1, :])) - Kd_t @ Kc
    drive = Kd_t @ W
    S0, ends = _scan(trans, drive, initial_state, plan)
    o = Qg @ S0 + P @ (W - Kc @ S0)
    return _tokens(o, plan).to(out_dtype), ends


def chunk_tree_gated_linear_attention(q, k, v, g, plan: ChunkTreePlan, initial_state, scale=None):
    """Gated linear attention (:func:`~harts.ops.gated_linear_attention.chunked_gated_linear_attention`'s
    arithmetic) over ``plan``; shapes as :func:`chunk_tree_gated_delta_rule` without beta."""
    out_dtype = q.dtype
    scale = 1.0 if scale is None else scale
    q, k, v, g = (_chunks(x.float(), plan) for x in (q, k, v, g))
    q = q * scale
    P, _ = _intra_chunk_scores(q, k, g)
    G = g.cumsum(-2)
    Kd_t = (k * torch.exp(_exclusive_suffix_sum(g, -2))).transpose(-1, -2)
    S0, ends = _scan(torch.exp(G[..., -1, :]), Kd_t @ v, initial_state, plan)  # diagonal state map
    o = (q * torch.exp(G)) @ S0 + P @ v
    return _tokens(o, plan).to(out_dtype), ends
