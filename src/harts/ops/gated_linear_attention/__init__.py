"""Gated linear attention: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

Lightning attention (minimax), and the form of Mamba-2's SSD and Mamba's selective scan.

- :mod:`~harts.ops.gated_linear_attention.chunk`: the chunked op over right-padded segments (the
  contract's op, :data:`harts.ops.recurrence.GATED_LINEAR_ATTENTION`);
- :mod:`~harts.ops.gated_linear_attention.chunk_tree`: the same over a chunk tree;
- :mod:`~harts.ops.gated_linear_attention.naive`: the fp64 per-token reference.
"""

from harts.ops.gated_linear_attention.chunk import chunked_gated_linear_attention
from harts.ops.gated_linear_attention.chunk_tree import chunk_tree_gated_linear_attention
from harts.ops.gated_linear_attention.naive import naive_recurrent_gated_linear_attention
from harts.ops.gated_linear_attention.packed import packed_gated_linear_attention

__all__ = [
    "chunk_tree_gated_linear_attention",
    "chunked_gated_linear_attention",
    "naive_recurrent_gated_linear_attention",
    "packed_gated_linear_attention",
]
