"""The gated delta rule over packed chunks (:mod:`harts.plan.packed_chunks`): chunks that hold the
tokens of several nodes, in the masked WY form of :mod:`harts.ops.chunked.packed`. One call per
layer; per-key gates (KDA) or one per head (GDN)."""

from __future__ import annotations

import torch

from harts.ops.chunked.packed import PackedChunks
from harts.plan.packed_chunks import PackedChunkPlan

__all__ = ["packed_gated_delta_rule"]


def packed_gated_delta_rule(q, k, v, g, beta, plan: PackedChunkPlan, initial_state, scale=None):
    """The gated delta rule over ``plan``. q, k [N, H, K]; g [N, H, K] or per head [N, H] / [N, H, 1];
    v [N, H, V]; beta [N, H]; initial_state [R, H, K, V] for the plan's roots. Returns
    (o [N, H, V] in q's dtype, states [R + P, H, K, V] fp32: the roots' then every emitted state)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    x = PackedChunks(plan)
    qc, kc, vc = x.cut(q) * scale, x.cut(k), x.cut(v)
    b = x.cut(beta)[..., None]  # [H, M, C, 1]
    d = x.decays(g, k)
    Gamma = d.gamma
    P = d.scores(qc, kc)
    A = d.scores(kc, kc, strict=True)  # strict ancestors: unit lower triangular system
    V = vc.shape[-1]
    rhs = torch.cat([vc * b, kc * Gamma * b], -1)
    X = torch.linalg.solve_triangular(b * A, rhs, upper=False, unitriangular=True)
    W, Kc = X[..., :V], X[..., V:]  # u = W - Kc S0_e
    kd, gamma, chunk = d.emit_pieces(kc)
    kd_t = kd.transpose(-1, -2)  # [H, P, K, C]
    trans = torch.diag_embed(gamma) - kd_t @ Kc[:, chunk]
    states = x.scan(trans, kd_t @ W[:, chunk], initial_state)
    read_q, read_k = x.reads(states, qc * Gamma, Kc)
    U = W - read_k
    return x.outputs(read_q + P @ U, q.dtype), states
