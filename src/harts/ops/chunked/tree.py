"""The prologue and epilogue of a chunked op over a chunk tree (:mod:`harts.plan.chunk_tree`).

Every node of the plan is cut into chunks of C slots (a padded slot is an identity step: every
input zero there, so a node's last chunk ends with the node's final state), all M chunks form one
batch [1, H, M, C, .], and the chunk-to-chunk maps run down the tree by :class:`TreeStateScan`.
"""

from __future__ import annotations

import torch

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
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])], 0)
        return padded[self.plan.token_index].permute(2, 0, 1, 3)[None]

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
        return o[0].permute(1, 2, 0, 3).reshape(m * c, h, v)[self.plan.output_index].to(dtype)
