"""Gated linear attention over a chunk tree (:mod:`harts.plan.chunk_tree`): one call per layer,
the chunked op's arithmetic per chunk, the chunks' diagonal state maps chained down the tree."""

from __future__ import annotations

from harts.ops.chunked import TreeChunks
from harts.ops.gated_linear_attention.chunk import gated_linear_attention_chunks
from harts.plan.chunk_tree import ChunkTreePlan

__all__ = ["chunk_tree_gated_linear_attention"]


def chunk_tree_gated_linear_attention(q, k, v, g, plan: ChunkTreePlan, initial_state, scale=None):
    """Gated linear attention over ``plan``; shapes as
    :func:`~harts.ops.delta_rule.chunk_tree.chunk_tree_gated_delta_rule` without beta."""
    scale = 1.0 if scale is None else scale
    tree = TreeChunks(plan)
    o, _, ends = gated_linear_attention_chunks(tree.inputs(q, k, v, g, (), scale), tree.scan, initial_state)
    return tree.outputs(o, q.dtype), ends
