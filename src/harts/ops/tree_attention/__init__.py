"""Full attention over a forest of tokens.

A token attends to every token on its own path: the tokens of its ancestor nodes and the earlier
tokens of its own node. This is exactly causal attention of each root-to-leaf trajectory,
computed once per unique query token.

:func:`tree_attention` runs a plan from :mod:`harts.plan.attention` in one of its forms, each a
module here:

- :mod:`~harts.ops.tree_attention.grouped`: each node's queries, split into query blocks, attend to
  their gathered paths in a few batched SDPA calls (the groups), rows gathered by
  :mod:`~harts.ops.tree_attention.gather`, where padding and sinks are made exact;
- :mod:`~harts.ops.tree_attention.prefixes`: beside the groups, long runs of shared ancestor keys
  (a shared prompt) in calls of their own, merged by logsumexp, where the plan has them and the
  CPU flash kernels run in float32 or float64 (else the plan's
  :meth:`~harts.plan.attention.TreeAttentionPlan.whole` form runs);
- :mod:`~harts.ops.tree_attention.dense`: one call over all [n, m] scores with the plan's mask,
  where the plan says it costs less than the groups (small micro-batches) and its output is finite;
- :mod:`~harts.ops.tree_attention.masked`: the plain form, one SDPA call with a dense boolean mask,
  and the per-query definition, which the tests hold the others to.

:mod:`~harts.ops.tree_attention.flash` holds what they share: CPU flash attention's fused kernels
(called directly, so backward saves logsumexps instead of gathered rows) and the switch that sends
every call down the recompute path other devices take.

Sliding windows (``tree_attention(..., window=W)``) run the plan's windowed form
(:meth:`~harts.plan.attention.TreeAttentionPlan.windowed`: each token sees the last W tokens of its
path); sinks (``sinks=s``, a learned per-head logit in the softmax denominator, gpt-oss) run as one
more key per block (:mod:`~harts.ops.tree_attention.gather`).

Measured on 2 CPU cores, fp32, 4 heads of 32: about 27 ns per (query, key) pair for fwd+bwd, tree
or flat.

Shapes: q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv] (heads first, no batch); outputs [n, H, Dv].
"""

from __future__ import annotations

import torch

from harts.ops.tree_attention.dense import dense_applies, dense_tree_attention
from harts.ops.tree_attention.grouped import grouped_tree_attention
from harts.ops.tree_attention.masked import masked_tree_attention, path_attention_reference
from harts.ops.tree_attention.prefixes import prefixes_apply
from harts.plan.attention import TreeAttentionPlan

__all__ = ["masked_tree_attention", "tree_attention", "path_attention_reference"]


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TreeAttentionPlan,
    scaling: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact tree attention over ``plan``: its dense call or its groups (with its shared prefixes), as
    the module docstring says. Returns [n, H, Dv]; differentiable in q, k, v (and ``sinks``).

    q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv]; query head h reads key/value head h // (H // Hkv).
    ``window``: each token sees the last ``window`` tokens of its path (None: all of it);
    ``sinks`` [H]: a logit per query head added to the softmax denominator
    (:mod:`~harts.ops.tree_attention.gather`).
    Backward saves q, k, v as passed, the returned output and small per-group logsumexps, and
    gathers again (:mod:`~harts.ops.tree_attention.grouped`, Backward); it supports no double backward.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"expected q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    h, n, dk = q.shape
    hkv, m, dv = v.shape
    if k.shape[:2] != (hkv, m) or k.shape[2] != dk or h % hkv:
        raise ValueError(
            f"inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(H must be a multiple of Hkv)"
        )
    if (n, m) != (plan.num_queries, plan.num_keys):
        raise ValueError(f"plan is for {plan.num_queries} queries and {plan.num_keys} keys, got {n} and {m}")
    if n == 0:
        return q.new_zeros(0, h, dv)
    if plan.key_index.device != q.device:
        raise ValueError(f"plan lives on {plan.key_index.device}, tensors on {q.device}")
    if sinks is not None and (sinks.shape != (h,) or sinks.device != q.device):
        raise ValueError(
            f"sinks must be [H] = [{h}] on {q.device}, got {tuple(sinks.shape)} on {sinks.device}"
        )
    plan = plan.windowed(window)
    if sinks is None and plan.dense_for(h, max(dk, dv)) and dense_applies(q, v, plan):
        out = dense_tree_attention(q, k, v, plan, scaling)
        if bool(out.isfinite().all()):  # else the groups' result: a NaN stays in the rows it reaches
            return out
    if plan.prefixes and not prefixes_apply(q, v, plan):
        plan = plan.whole()
    return grouped_tree_attention(q, k, v, plan, scaling, sinks)
