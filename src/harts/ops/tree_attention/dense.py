"""The dense form of tree attention: one CPU flash call over all [n, m] scores with the plan's mask.

Where the plan says one call over all [n, m] scores costs less than its groups
(:meth:`~harts.plan.attention.TreeAttentionPlan.dense_for`: small micro-batches, whose groups' fixed
costs outweigh the scores they skip), CPU flash attention in float32 or float64 runs once over q, k
and v in place with the plan's additive mask (0 on each query's path, -finfo.max / 4 elsewhere: a
finite score, so a kernel block in which a row sees no key yields no NaN, and its weight is exactly
zero beside the row's real scores). The hidden scores still read every key and value, so the
result is refused, and the groups run, when the output is not finite (a NaN would otherwise reach
queries whose paths do not hold it; :func:`harts.ops.tree_attention.tree_attention` checks). Two
cases keep the groups' exactness: a query whose path is one key (a root's first token) has weight
exactly 1 on it, and backward passes its output gradient to that value and none to the query or
key, as the groups' lone-key path does; and where the first two values of some path are equal, a
query whose visible values are all one value may exist, so the groups run
(:mod:`~harts.ops.tree_attention.grouped`, "Equal values", needs per-block shifts). Saved: q, k, v,
the output and the logsumexp [Hkv, r * n].
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from harts.ops.tree_attention.flash import flash_backward, flash_forward, fused_cpu_float, widen
from harts.plan.attention import TreeAttentionPlan

__all__ = ["dense_tree_attention", "dense_applies"]


def dense_applies(q: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan) -> bool:
    """Whether ``plan``'s dense form can run here (module docstring): CPU flash kernels in float32 or
    float64, and no path whose first two values are equal for some key/value head (a query whose
    visible values are all one value then exists, and the groups keep it exact)."""
    if not fused_cpu_float(q):
        return False
    first, second = plan.path_starts()
    if first.numel():
        a, b = v.detach()[:, first], v.detach()[:, second]
        if bool((a[..., 0] == b[..., 0]).any()) and bool((a == b).all(-1).any()):
            return False
    return True


def dense_tree_attention(q, k, v, plan: TreeAttentionPlan, scaling: float) -> torch.Tensor:
    """[n, H, Dv]: the dense call over ``plan`` (module docstring); the caller checks that it applies
    (:func:`dense_applies`) and that its output is finite."""
    return _DenseTreeAttention.apply(q, k, v, plan, scaling)


def _dense_inputs(q, k, v):
    """q [1, Hkv, r * n, dp], k and v [1, Hkv, m, dp]: a dense call's inputs at the common width."""
    h, n, dk = q.shape
    hkv, _, dv = v.shape
    dp = max(dk, dv)
    return (widen(q.reshape(hkv, (h // hkv) * n, dk), dp)[None], widen(k, dp)[None], widen(v, dp)[None])


def _heads_first(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[n, H, d] -> [Hkv, r, n, d] contiguous: the rows of a dense call (x itself where its layout
    already is, as with one query)."""
    n, h, d = x.shape
    return x.reshape(n, hkv, h // hkv, d).permute(1, 2, 0, 3).contiguous()


class _DenseTreeAttention(torch.autograd.Function):
    """:func:`~harts.ops.tree_attention.tree_attention` as one CPU flash call over all queries and keys
    with the plan's dense mask (module docstring). Saves q, k, v as passed, the output and the
    logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v, plan: TreeAttentionPlan, scaling: float):
        h, n, _ = q.shape
        hkv, _, dv = v.shape
        mask = plan.dense_mask(h // hkv, q.dtype)
        out, lse = flash_forward(*_dense_inputs(q, k, v), 0.0, False, attn_mask=mask, scale=scaling)
        output = out[0, ..., :dv].reshape(hkv, h // hkv, n, dv).permute(2, 0, 1, 3).reshape(n, h, dv)
        output = output.contiguous()  # not a view of the kernel's wider rows: saved, and returned
        ctx.save_for_backward(q, k, v, output, lse)
        ctx.plan, ctx.scaling = plan, scaling
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, output, lse = ctx.saved_tensors
        plan, scaling = ctx.plan, ctx.scaling
        h, n, dk = q.shape
        hkv, m, dv = v.shape
        r = h // hkv
        qx, kx, vx = _dense_inputs(q, k, v)
        dp = qx.shape[-1]
        # A query whose path is one key gets that value, weight exactly 1: no query or key gradient,
        # and its output's gradient goes to the value whole (the groups' lone-key path, exactly).
        lone_q, lone_k = plan.lone_queries()
        rows = _heads_first(grad, hkv)  # may be grad itself (one query): never written in place
        if lone_q.numel():
            rows = rows.index_fill(2, lone_q, 0.0)
        gq, gk, gv = flash_backward(
            widen(rows.view(1, hkv, r * n, dv), dp),
            qx,
            kx,
            vx,
            widen(_heads_first(output, hkv).view(1, hkv, r * n, dv), dp),
            lse,
            0.0,
            False,
            attn_mask=plan.dense_mask(r, q.dtype),
            scale=scaling,
        )
        d_v = gv[0, ..., :dv]
        if lone_q.numel():
            d_v = d_v.index_add(1, lone_k, grad[lone_q].reshape(-1, hkv, r, dv).sum(2).transpose(0, 1))
        return gq[0, ..., :dk].reshape(h, n, dk), gk[0, ..., :dk], d_v, None, None
