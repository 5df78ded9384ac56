"""The prologue and epilogue of a chunked op over a chunk tree (:mod:`harts.plan.chunk_tree`).

Every node of the plan is cut into chunks of C slots (a padded slot is an identity step: every
input zero there, so a node's last chunk ends with the node's final state), all M chunks form one
batch [M, H, C, .], and the chunk-to-chunk maps run down the tree by :class:`TreeStateScan`.

The batch is chunk-major ([M, H], not [H, M]): the chunk products then give the state maps and
the chunk-start states as the scan reads and writes them, one level of chunks a contiguous block of
rows, so no level copies its rows in forward or backward.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from harts.ops.chunked.inputs import ChunkedInputs, chunked_inputs
from harts.ops.chunked.scan import TreeStateScan
from harts.plan.chunk_tree import ChunkTreePlan

__all__ = ["TreeChunks"]


class TreeChunks:
    """The N unique tokens of ``plan`` in its M chunks, as one batch [M, H, C, .]."""

    def __init__(self, plan: ChunkTreePlan):
        self.plan = plan

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, D] per unique token -> [M, H, C, D] per chunk slot (padded slots zero)."""
        p = self.plan
        slots = _RowGather.apply(x, p.token_index.view(-1), p.output_index, True, False)
        return slots.view(*p.token_index.shape, *x.shape[1:]).transpose(1, 2)

    def inputs(self, q, k, v, g, scalars: tuple[torch.Tensor, ...], scale: float) -> ChunkedInputs:
        """q, k, g [N, H, K] (g may be per head), v [N, H, V], scalars [N, H] in chunks."""
        return chunked_inputs(self.cut, q, k, v, g, scalars, scale)

    def scan(self, trans, drive, initial):
        """(chunk-start states, end states [M, H, K, V]) down the chunk tree from the roots' initial
        states ``initial`` [R, H, K, V]; ``trans`` [M, H, K, K] (or its diagonal [M, H, K]), ``drive``
        [M, H, K, V]."""
        return TreeStateScan.apply(trans, drive, initial.float(), self.plan.source, self.plan.levels)

    def outputs(self, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[M, H, C, V] per chunk slot -> [N, H, V] per unique token, in ``dtype``."""
        m, h, c, v = o.shape
        slots = o.transpose(1, 2).reshape(m * c, h, v)
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
