"""The chunk-to-chunk state recurrence S_end = T S_start + D, with hand-written adjoints.

A chunked op reduces each chunk to an affine map of its start state; only these maps run one
after the other: along each segment (:class:`StateScan`) or down a chunk tree, one level of
chunks per step (:class:`TreeStateScan`). A diagonal T (gated linear attention: a decay per key
channel) is passed as its diagonal and applied elementwise: K times less work than the K x K
product, which matters where K is large against V (Mamba's selective scan has V = 1).

Autograd through a Python loop would keep every step's state twice (the matmul's saved input and
the stacked chunk-start states) and pay one graph node per chunk; these keep the stacked states
once (they are the output, which the caller's ops save anyway) and run the adjoint recurrence in
one backward call, in fp32 even inside an autocast region.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from harts.ops.precision import no_autocast

__all__ = ["StateScan", "TreeStateScan"]


class StateScan(torch.autograd.Function):
    """S_{n+1} = T_n S_n + D_n along each segment; the adjoint g_n = T_n^T g_{n+1} + dS0_n.

    trans [B, H, N, K, K] (or its diagonal [B, H, N, K]), drive [B, H, N, K, V], initial
    [B, H, K, V] -> (starts [B, H, N, K, V]: S_0 .. S_{N-1}, final S_N [B, H, K, V]).
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
                S = torch.baddbmm(
                    drive[:, :, n].flatten(0, 1), trans[:, :, n].flatten(0, 1), S.flatten(0, 1)
                ).view_as(S)
        ctx.save_for_backward(trans, starts)
        ctx.diagonal = diagonal
        return starts, S

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_starts, grad_final):
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


class TreeStateScan(torch.autograd.Function):
    """S_start[m] = states[source[m]], S_end[m] = T[m] S_start[m] + D[m], level by level.

    trans [M, H, K, K] (or its diagonal [M, H, K]), drive [M, H, K, V], initial [R, H, K, V],
    source [M], levels (chunk ids per level: index tensors, or slices where the chunks are numbered
    level by level, whose rows are read and written as views) -> (starts [M, H, K, V], ends
    [M, H, K, V]). The states buffer holds the R initial states, then the M end states; a chunk's
    source row is filled by an earlier level. Backward runs the adjoint up the tree: a chunk's
    end-state gradient is complete once every chunk of the next levels has added its start-state
    gradient to its source.
    """

    @staticmethod
    def forward(ctx, trans, drive, initial, source, levels):
        r = initial.shape[0]
        diagonal = trans.dim() == drive.dim() - 1  # [M, H, K]: a decay per key channel
        buf = torch.empty((r + trans.shape[0], *drive.shape[1:]), dtype=drive.dtype, device=drive.device)
        buf[:r] = initial
        # Chunk-major work rows, so that a level of slices is one block; the starts are returned in
        # ``drive``'s layout, which the caller's products read without copying (and saving) them.
        starts = drive.new_empty(drive.shape)
        for idx in levels:
            if isinstance(idx, slice):  # write each level's rows in place: two ops per level
                s0 = torch.index_select(buf, 0, source[idx], out=starts[idx])
                end = buf[_shifted(idx, r)]
                if diagonal:
                    torch.addcmul(drive[idx], trans[idx][..., None], s0, out=end)
                else:
                    torch.baddbmm(
                        drive[idx].flatten(0, 1),
                        trans[idx].flatten(0, 1),
                        s0.flatten(0, 1),
                        out=end.flatten(0, 1),
                    )
                continue
            s0 = buf.index_select(0, source[idx])
            starts[idx] = s0
            if diagonal:
                end = torch.addcmul(drive[idx], trans[idx][..., None], s0)
            else:
                end = torch.baddbmm(drive[idx].flatten(0, 1), trans[idx].flatten(0, 1), s0.flatten(0, 1))
            buf[idx + r] = end.view_as(s0)
        if not drive.is_contiguous():  # in drive's layout, which its readers share
            starts = torch.empty_like(drive).copy_(starts)
        ctx.save_for_backward(trans, starts, source)
        ctx.levels, ctx.r, ctx.diagonal = levels, r, diagonal
        ctx.set_materialize_grads(False)  # end states no later part reads get no zero gradient
        return starts, buf[r:]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_starts, grad_ends):
        trans, starts, source = ctx.saved_tensors  # once: checkpointing's saved tensors unpack only once
        with no_autocast(trans.device):
            r = ctx.r
            if grad_ends is None:
                grad = starts.new_zeros((r + trans.shape[0], *starts.shape[1:]))
            else:
                grad = torch.cat([grad_ends.new_zeros((r, *grad_ends.shape[1:])), grad_ends])
            grad_trans = trans.new_empty(trans.shape)  # chunk-major: a level's rows are one block
            for idx in reversed(ctx.levels):
                g_end = grad[_shifted(idx, r)]  # complete: every reader of this end state is in a later level
                if ctx.diagonal:
                    grad_trans[idx] = (g_end * starts[idx]).sum(-1)
                    g_start = trans[idx][..., None] * g_end
                    if grad_starts is not None:
                        g_start = g_start + grad_starts[idx]
                elif isinstance(idx, slice):  # in place, with the start-state gradient fused
                    torch.matmul(g_end, starts[idx].transpose(-1, -2), out=grad_trans[idx])
                    t_t = trans[idx].transpose(-1, -2).flatten(0, 1)
                    if grad_starts is not None:
                        g_start = torch.baddbmm(grad_starts[idx].flatten(0, 1), t_t, g_end.flatten(0, 1))
                    else:
                        g_start = torch.bmm(t_t, g_end.flatten(0, 1))
                    g_start = g_start.view_as(g_end)
                else:
                    grad_trans[idx] = g_end @ starts[idx].transpose(-1, -2)
                    g_start = trans[idx].transpose(-1, -2) @ g_end
                    if grad_starts is not None:
                        g_start = g_start + grad_starts[idx]
                grad.index_add_(0, source[idx], g_start)
            return grad_trans, grad[r:].clone(), grad[:r].clone(), None, None


def _shifted(idx: torch.Tensor | slice, r: int) -> torch.Tensor | slice:
    """Rows ``idx`` of the end states as rows of the states buffer (after its R initial states)."""
    return slice(idx.start + r, idx.stop + r) if isinstance(idx, slice) else idx + r
