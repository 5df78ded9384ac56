"""Shared prefixes: runs of ancestor keys that the grouped form attends to in calls of their own.

A plan may run some runs of ancestor keys as calls of their own (the plan's ``prefixes``,
:class:`~harts.plan.attention.SharedPrefix`): every query below a shared prompt attends to its keys
in one call over contiguous rows, no mask and no gather, and the query blocks gather only the rest
of their paths. Each call returns its output and logsumexp; a query's results merge by weights
exp(lse_i - lse), lse = log sum_i exp(lse_i), which is its softmax over all its keys. Backward runs
each call's fused kernel with the merged output and logsumexp: its scores then give exactly the
whole softmax's weights on its keys, so the gradients are the whole attention's (split-key
attention backward, as ring attention runs it).

The prefixes run with CPU flash attention in float32 and float64 only, and not where some prefix's
values are one value for a key/value head ("Equal values" of :mod:`~harts.ops.tree_attention.grouped`
would then hold only to rounding): the op runs the plan's
:meth:`~harts.plan.attention.TreeAttentionPlan.whole` form instead, as it does on other devices and
in half precision. A sink joins each query's block, so the softmax counts it once. Blocks of one key
that no prefix reaches (a one-token root: its key is its whole path) keep their groups and the exact
"lone key" path (:meth:`~harts.plan.attention.TreeAttentionPlan.lone_unmerged`), so their output is
the value and their query gradient zero by construction, not by the fused kernel's rounding.
"""

from __future__ import annotations

import torch

from harts.ops.tree_attention.flash import flash_backward, flash_forward, fused_cpu_float, widen
from harts.plan.attention import TreeAttentionPlan

__all__ = ["prefixes_apply", "merge_prefixes", "prefix_grads"]


def prefixes_apply(q: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan) -> bool:
    """Whether ``plan``'s shared prefixes can run here (module docstring): CPU flash kernels in float32
    or float64, and no prefix whose values are one value for some key/value head (the whole plan then
    keeps "Equal values" exact)."""
    if not fused_cpu_float(q):
        return False
    for k0, k1 in {(p.k0, p.k1) for p in plan.prefixes}:
        block = v[:, k0:k1]
        first_channel = (block[..., 0] == block[:, :1, 0]).all(1).any()  # a small read first
        if first_channel and (block == block[:, :1]).flatten(1).all(1).any():
            return False
    return True


def _prefix_inputs(q, k, v, plan: TreeAttentionPlan):
    """Per shared prefix: (prefix, its queries [Hkv, r, nP, dp], keys and values [Hkv, r, L, dp]),
    views of q, k and v (widened to a common width dp for CPU flash attention)."""
    h, n, dk = q.shape
    hkv, _, dv = v.shape
    r, dp = h // hkv, max(dk, v.shape[-1])
    qx, kx, vx = widen(q, dp).view(hkv, r, n, dp), widen(k, dp), widen(v, dp)
    for p in plan.prefixes:
        keys = (hkv, r, p.k1 - p.k0, dp)
        yield (
            p,
            qx[:, :, p.q0 : p.q1],
            kx[:, None, p.k0 : p.k1].expand(keys),
            vx[:, None, p.k0 : p.k1].expand(keys),
        )


def merge_prefixes(q, k, v, plan: TreeAttentionPlan, scaling: float, output, lse) -> None:
    """Each shared prefix's attention merged into ``output`` [n, H, Dv] and ``lse`` [n, H] (the
    groups' results), in place: weights exp(lse_i - lse) of the merged logsumexp."""
    h, dv = q.shape[0], v.shape[-1]
    for p, qp, kp, vp in _prefix_inputs(q, k, v, plan):
        out_p, lse_p = flash_forward(qp, kp, vp, 0.0, False, attn_mask=None, scale=scaling)
        rows = p.q1 - p.q0
        out_p = out_p[..., :dv].permute(2, 0, 1, 3).reshape(rows, h, dv)
        lse_p = lse_p.permute(2, 0, 1).reshape(rows, h)
        before = lse[p.q0 : p.q1]
        merged = torch.logaddexp(before, lse_p)
        out = output[p.q0 : p.q1]
        out.mul_((before - merged).exp_().unsqueeze(-1)).add_(out_p * (lse_p - merged).exp_().unsqueeze(-1))
        before.copy_(merged)


def prefix_grads(
    q, k, v, plan: TreeAttentionPlan, scaling: float, grad, output, lse, dq_all, dk_all, dv_all
) -> None:
    """Each shared prefix's share of the gradients, added in place: the fused backward of its call
    with the merged output and logsumexp, which gives exactly its keys' part of the softmax."""
    h, n, dk = q.shape
    hkv, _, dv = v.shape
    r = h // hkv
    for p, qp, kp, vp in _prefix_inputs(q, k, v, plan):
        rows, dp = p.q1 - p.q0, qp.shape[-1]
        # the prefix's query rows heads first, [Hkv, r, nP, .], as its call lays them out
        grad_p, out_p, lse_p = (
            x[p.q0 : p.q1].reshape(rows, hkv, r, -1).permute(1, 2, 0, 3) for x in (grad, output, lse)
        )
        gq, gk, gv = flash_backward(
            widen(grad_p, dp).contiguous(),
            qp,
            kp,
            vp,
            widen(out_p, dp).contiguous(),
            lse_p[..., 0].contiguous(),
            0.0,
            False,
            attn_mask=None,
            scale=scaling,
        )
        if dq_all is not None:
            dq_all.view(hkv, r, n, dk)[:, :, p.q0 : p.q1] += gq[..., :dk]
        if dk_all is not None:
            dk_all[:, p.k0 : p.k1] += gk.sum(1)[..., :dk].to(dk_all.dtype)
        if dv_all is not None:
            dv_all[:, p.k0 : p.k1] += gv.sum(1)[..., :dv].to(dv_all.dtype)
