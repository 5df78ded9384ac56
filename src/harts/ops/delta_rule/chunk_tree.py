"""The gated delta rule over a chunk tree (:mod:`harts.plan.chunk_tree`): one call per layer.

The arithmetic per chunk is :func:`~harts.ops.delta_rule.chunk.delta_rule_chunks`, the chunked op's,
so the results agree with it (and with the fp64 reference) to fp32 rounding; only the chunks' state
maps are chained down the tree (:class:`~harts.ops.chunked.TreeChunks`).
"""

from __future__ import annotations

from harts.ops.chunked import TreeChunks
from harts.ops.delta_rule.chunk import delta_rule_chunks
from harts.plan.chunk_tree import ChunkTreePlan

__all__ = ["chunk_tree_gated_delta_rule"]


def chunk_tree_gated_delta_rule(q, k, v, g, beta, plan: ChunkTreePlan, initial_state, scale=None):
    """The gated delta rule over ``plan``. q, k [N, H, K]; g [N, H, K] or per head [N, H] / [N, H, 1];
    v [N, H, V]; beta [N, H]; initial_state [R, H, K, V] for the plan's roots. Returns
    (o [N, H, V] in q's dtype, end states [M, H, K, V] fp32)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    tree = TreeChunks(plan)
    o, _, ends, _ = delta_rule_chunks(tree.inputs(q, k, v, g, (beta,), scale), tree.scan, initial_state)
    return tree.outputs(o, q.dtype), ends
