"""Gated linear attention over packed chunks (:mod:`harts.plan.packed_chunks`): the masked form of
:mod:`harts.ops.chunked.packed` without the delta term (u = v, no solve; each emitted state's map
is diagonal)."""

from __future__ import annotations

from harts.ops.chunked.packed import PackedChunks
from harts.plan.packed_chunks import PackedChunkPlan

__all__ = ["packed_gated_linear_attention"]


def packed_gated_linear_attention(q, k, v, g, plan: PackedChunkPlan, initial_state, scale=None):
    """Gated linear attention over ``plan``; shapes as
    :func:`~harts.ops.delta_rule.packed.packed_gated_delta_rule` without beta."""
    scale = 1.0 if scale is None else scale
    x = PackedChunks(plan)
    qc, kc, vc = x.cut(q) * scale, x.cut(k), x.cut(v)
    d = x.decays(g, k)
    kd, gamma, chunk = d.emit_pieces(kc)
    states = x.scan(gamma, kd.transpose(-1, -2) @ vc[:, chunk], initial_state)
    (read_q,) = x.reads(states, qc * d.gamma)
    return x.outputs(read_q + d.scores(qc, kc) @ vc, q.dtype), states
