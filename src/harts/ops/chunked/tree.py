"""The prologue and epilogue of a chunked op over a chunk tree (:mod:`harts.plan.chunk_tree`).

Every node of the plan is cut into chunks of C slots (a padded slot is an identity step: every
input zero there, so a node's last chunk ends with the node's final state), all M chunks form one
batch [1, H, M, C, .], and the chunk-to-chunk maps run down the tree by :class:`TreeStateScan`.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from harts.ops.chunked.inputs import ChunkedInputs, chunked_inputs
from harts.ops.chunked.scan import TreeStateScan
from harts.plan.chunk_tree import ChunkTreePlan

__all__ = ["TreeChunks"]


class TreeChunks:
    """The N unique tokens of ``plan`` in its M chunks, as one batch [1, H, M, C, .]."""

    def __init__(self, plan: ChunkTreePlan):
        self.plan = plan

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, D] per unique token -> [1, H, M, C, D] per chunk slot (padded slots zero)."""
        p = self.plan
        slots = _RowGather.apply(x, p.token_index.view(-1), p.output_index, True, False)
        return slots.view(*p.token_index.shape, *x.shape[1:]).permute(2, 0, 1, 3)[None]

    def inputs(self, q, k, v, g, scalars: tuple[torch.Tensor, ...], scale: float) -> ChunkedInputs:
        """q, k, g [N, H, K] (g may be per head), v [N, H, V], scalars [N, H] in chunks."""
        return chunked_inputs(self.cut, q, k, v, g, scalars, scale)

    def scan(self, trans, drive, initial):
        """(chunk-start states [1, H, M, K, V], end states [M, H, K, V]) down the chunk tree, from
        the roots' initial states ``initial`` [R, H, K, V]."""
        t = trans[0].transpose(0, 1)  # [M, H, K, K], or [M, H, K] for a diagonal map
        d = drive[0].transpose(0, 1)  # [M, H, K, V]
        starts, ends = TreeStateScan.apply(t, d, initial.float(), self.plan.source, self.plan.levels)
        return starts.transpose(0, 1)[None], ends

    def outputs(self, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[1, H, M, C, V] per chunk slot -> [N, H, V] per unique token, in ``dtype``."""
        h, m, c, v = o.shape[1:]
        slots = o[0].permute(1, 2, 0, 3).reshape(m * c, h, v)
        p = self.plan
        return _RowGather.apply(slots, p.output_index, p.token_index.view(-1), False, True).to(dtype)


class _RowGather(torch.autograd.Function):
    """``y = x[index]`` whose backward is the gather ``grad_x = grad_y[inverse]``.

    Each unique token sits in exactly one chunk slot, so the slot map and the token map are inverse
    to each other, and the gradient of one gather is the other gather: one ``index_select`` instead
    of autograd's scatter-add (``index_put_`` with accumulation, which on CPU runs several times
    slower). ``pad_forward`` / ``pad_backward``: the source of that direction gets one zero row
    appended, which the padded slots (index N) read.
    """

    @staticmethod
    def forward(ctx, x, index, inverse, pad_forward: bool, pad_backward: bool):
        ctx.save_for_backward(inverse)
        ctx.pad_backward = pad_backward
        return _padded(x, pad_forward).index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _padded(grad, ctx.pad_backward).index_select(0, inverse), None, None, None, None


def _padded(x: torch.Tensor, pad: bool) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0) if pad else x
