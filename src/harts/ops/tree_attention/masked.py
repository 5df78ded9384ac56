"""The plain form of tree attention, and the per-query definition the tests hold every form to.

:func:`masked_tree_attention` with :func:`harts.plan.attention.plan_reference_mask`: one
scaled_dot_product_attention (SDPA) call with a dense boolean mask [n, m]. Exact and simple, the
reference the tests hold the grouped form to; cost and memory O(n m). :func:`path_attention_reference`
is the definition itself, one query at a time over its own path in float64, with sliding windows and
sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["masked_tree_attention", "path_attention_reference"]


def masked_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of every query over the keys its mask [N, M] allows. Returns [N, H, Dv].

    Grouped-query attention: query head h reads key/value head h // (H // Hkv), as in
    transformers' ``repeat_kv``.
    """
    h, hkv = q.shape[0], k.shape[0]
    if h != hkv:
        if h % hkv:
            raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
        k = k.repeat_interleave(h // hkv, dim=0)
        v = v.repeat_interleave(h // hkv, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(0, 1)


def path_attention_reference(
    q,
    k,
    v,
    paths: list[torch.Tensor],
    scaling: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain definition, one query at a time in float64 (tests only). Returns [n, H, Dv].

    ``paths[t]``: the key rows of query t's path, root first, itself last. With ``window``, the
    query sees the last ``window`` of them; with ``sinks`` [H], a logit per head joins the softmax
    denominator and its weight is dropped.
    """
    h, hkv = q.shape[0], k.shape[0]
    q, k, v = q.double(), k.double(), v.double()
    rows = []
    for t, path in enumerate(paths):
        keys = path if window is None else path[max(0, path.numel() - window) :]
        heads = []
        for head in range(h):
            kv = head // (h // hkv)
            scores = (k[kv, keys] @ q[head, t]) * scaling  # [L]
            if sinks is not None:
                scores = torch.cat([scores, sinks[head].double().reshape(1)])
            weights = torch.softmax(scores, dim=0)[: keys.numel()]
            heads.append(weights @ v[kv, keys])
        rows.append(torch.stack(heads))
    return torch.stack(rows) if rows else v.new_zeros(0, h, v.shape[-1])
