"""Full attention over a forest of tokens.

A token attends to every token on its own path: the tokens of its ancestor nodes and the earlier
tokens of its own node. This is exactly causal attention of each root-to-leaf trajectory,
computed once per unique query token.

Two forms live here:

- the plain form (:func:`masked_tree_attention`, :func:`blockwise_tree_attention`): one
  scaled_dot_product_attention (SDPA) call per root tree with a dense boolean ancestor mask
  [n, n]. Exact and simple, the reference for the grouped form; cost and memory O(n^2) per tree.
- the grouped form (:func:`plan_tree_attention`, :func:`tree_attention`): each node's queries,
  split into query blocks, attend to [ancestor keys ; own keys], gathered by index; blocks of
  similar shape are padded into a few batched SDPA calls. Cost is about the exact cost, the sum
  of path positions, plus bounded waste (causal triangles of the blocks and padding). The key
  space may be larger than the query space (keys of ancestors computed in an earlier
  micro-batch).

How padding stays exact without a per-block mask: inside a group, keys are right-aligned (left
padding, ancestors, own keys ending at the last column) and queries right-aligned too, so every
block's causal rule is the same bottom-right triangle and one [Lq, Lk] mask serves the group.
Padding keys are removed through one extra head channel: queries carry 1 there, real keys 0 and
the padding key a huge negative number, so a padding key's score is exactly -huge (weight 0, and
finite, so a query row that sees only padding yields no NaN) and real scores are unchanged.

Limits: SDPA saves each group's gathered keys/values for backward, so attention memory grows
with the key rows summed over query blocks (about the flat token count), not the unique tokens.
In float16 a padding key's weight is exp(-finfo.max / 4 * scale - max score), zero only while
scores stay above about -1000. CPU SDPA runs its fast (flash) kernel only when the key and value
head sizes match; queries and keys get one extra channel and values are zero-padded to match.

Shapes: q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv] (heads first, no batch); outputs [n, H, Dv].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "ancestor_mask",
    "masked_tree_attention",
    "blockwise_tree_attention",
    "TreeAttentionPlan",
    "plan_tree_attention",
    "plan_reference_mask",
    "tree_attention",
]

# Query blocks: a block's own causal triangle is wasted work, about b / (2 (a + s + b)) of it for a
# block of b queries at offset s below a ancestor keys; b <= (a + s) / 3 keeps that under 1/8.
_MIN_QUERY_BLOCK = 128
# Grouping: a group's padded cost may exceed its blocks' exact cost by this factor plus a fixed
# allowance per call (in score elements), which lets small blocks share a call.
_PAD_SLACK = 1.25
_CALL_ALLOWANCE = 8192
# Short query blocks are counted as this many rows in the budget, which also bounds gathered keys.
_MIN_BUDGET_ROWS = 64
_DEFAULT_GROUP_TOKENS = 1 << 24


def ancestor_mask(token_node: torch.Tensor, node_ancestor: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: ``mask[i, j]`` is True when token j lies on token i's path at or before i.

    ``token_node`` [N] is each token's node and ``node_ancestor`` [M, M] says whether node b is an
    ancestor of node a or a itself. Tokens are stored parents-first and node-contiguous, so a
    token of a strict ancestor node always has a smaller index; inside one node the causal
    lower triangle decides.
    """
    same_path = node_ancestor[token_node][:, token_node]
    n = token_node.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=token_node.device).tril_()
    return same_path & causal


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


def blockwise_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks, scaling: float
) -> torch.Tensor:
    """:func:`masked_tree_attention` over independent blocks ``(start, end, mask)``. Returns [N, H, Dv]."""
    outs = [masked_tree_attention(q[:, s:e], k[:, s:e], v[:, s:e], mask, scaling) for s, e, mask in blocks]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


# ---- grouped form ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """One SDPA call: G query blocks padded to Lq queries and Lk keys."""

    query_index: torch.Tensor  # [G, Lq] query rows, right-aligned, padding reads row 0
    key_index: torch.Tensor  # [G * Lk] key rows, right-aligned, padding reads row m (the pad key)
    size: int  # G
    lq: int
    lk: int


@dataclass(eq=False)
class TreeAttentionPlan:
    """Index tensors of one micro-batch's grouped tree attention, reused by every layer.

    A query t, head s of its key/value head's r query heads, lands on row
    ``r * row_base[t] + s * row_stride[t] + row_offset[t]`` of the groups' outputs stacked
    (each group's output laid out [G, r, Lq]). ``exact_cost`` is the number of (query, key)
    pairs on paths, ``padded_cost`` the score elements the groups compute (per head).
    """

    num_queries: int
    num_keys: int
    groups: list[_Group]
    row_base: torch.Tensor  # [n]
    row_stride: torch.Tensor  # [n]
    row_offset: torch.Tensor  # [n]
    exact_cost: int
    padded_cost: int
    _masks: dict = field(default_factory=dict, repr=False)

    def mask(self, lq: int, lk: int, r: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """[1, 1, r * Lq, Lk] additive bottom-right causal mask, cached so layers share one tensor."""
        if lq == 1:
            return None  # the single query row sees every key
        key = (lq, lk, r, dtype, device)
        if key not in self._masks:
            allowed = torch.ones(lq, lk, dtype=torch.bool, device=device).tril_(lk - lq)
            additive = torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
            self._masks[key] = additive.repeat(r, 1)[None, None]
        return self._masks[key]


def _check_nodes(node_query_start, node_length, node_key_start, node_ancestor_keys, num_queries, num_keys):
    """Host-side int64 copies of the node description, checked; raises on inconsistent input."""
    qs, ln, ks = (np.asarray(torch.as_tensor(x).detach().cpu(), dtype=np.int64).reshape(-1)
                  for x in (node_query_start, node_length, node_key_start))
    if not (qs.shape == ln.shape == ks.shape):
        raise ValueError(f"node_query_start, node_length, node_key_start must have one shape [M], got "
                         f"{qs.shape}, {ln.shape}, {ks.shape}")
    if len(node_ancestor_keys) != qs.size:
        got = len(node_ancestor_keys)
        raise ValueError(f"expected {qs.size} ancestor key tensors (one per node), got {got}")
    if qs.size and (ln.min() < 1 or qs.min() < 0 or ks.min() < 0
                    or (qs + ln).max() > num_queries or (ks + ln).max() > num_keys):
        raise ValueError(f"node ranges fall outside [0, {num_queries}) queries / [0, {num_keys}) keys "
                         "or a node is empty")
    cover = np.zeros(num_queries + 1, dtype=np.int64)
    np.add.at(cover, qs, 1)
    np.add.at(cover, qs + ln, -1)
    if (np.cumsum(cover)[:num_queries] != 1).any():
        raise ValueError(f"nodes must cover each of the {num_queries} query rows exactly once")
    anc = [np.asarray(torch.as_tensor(a).cpu(), dtype=np.int64).reshape(-1) for a in node_ancestor_keys]
    bad = [i for i, a in enumerate(anc) if a.size and (a.min() < 0 or a.max() >= num_keys)]
    if bad:
        raise ValueError(f"node {bad[0]}: ancestor key rows must lie in [0, {num_keys})")
    return qs, ln, ks, anc


def _query_blocks(a: int, length: int, budget: int) -> list[tuple[int, int]]:
    """(start, size) of one node's query blocks, given ``a`` ancestor keys and a score budget."""
    blocks, s = [], 0
    while s < length:
        b = max(_MIN_QUERY_BLOCK, (a + s) // 3)
        # Largest b with b * (a + s + b) <= budget: the block alone must fit one call.
        fit = int((-(a + s) + ((a + s) ** 2 + 4 * budget) ** 0.5) / 2)
        b = max(1, min(b, fit, length - s))
        if 0 < length - s - b <= b // 4 and (length - s) * (a + length) <= budget:
            b = length - s  # fold a short tail into this block rather than start another call
        blocks.append((s, b))
        s += b
    return blocks


def plan_tree_attention(
    node_query_start: torch.Tensor,
    node_length: torch.Tensor,
    node_key_start: torch.Tensor,
    node_ancestor_keys: list[torch.Tensor],
    num_queries: int,
    num_keys: int,
    device=None,
    max_group_tokens: int | None = None,
) -> TreeAttentionPlan:
    """Group one micro-batch's nodes into batched attention calls. Loops over nodes once, on the host.

    Node m owns query rows ``[node_query_start[m], + node_length[m])`` and key rows
    ``[node_key_start[m], + node_length[m])``; ``node_ancestor_keys[m]`` lists the key rows of all
    tokens on its ancestor nodes in path order. Nodes must cover the query rows exactly once.
    ``max_group_tokens`` bounds one call's G * max(Lq, 64) * Lk score elements per head (default
    2**24); a single query block whose key row alone exceeds it still runs, one query at a time.
    """
    budget = int(max_group_tokens or _DEFAULT_GROUP_TOKENS)
    if budget < 1:
        raise ValueError(f"max_group_tokens must be positive, got {max_group_tokens}")
    qs, ln, ks, anc = _check_nodes(node_query_start, node_length, node_key_start, node_ancestor_keys,
                                   num_queries, num_keys)
    device = torch.device(device or "cpu")
    # Blocks: (node, own offset s, queries b); keys are a + s + b (ancestors and own keys up to its end).
    blocks = [(m, s, b) for m in range(qs.size) for s, b in _query_blocks(anc[m].size, int(ln[m]), budget)]
    lq = np.array([b for _, _, b in blocks], dtype=np.int64)
    lk = np.array([anc[m].size + s + b for m, s, b in blocks], dtype=np.int64)
    # Similar shapes next to each other: query-size class (powers of two), then keys descending.
    order = np.lexsort((-lq, -lk, -np.ceil(np.log2(np.maximum(lq, 1)))))
    spans, start, g_lq, g_lk, exact = [], 0, 0, 0, 0
    for pos, j in enumerate(order):
        n_lq, n_lk, n_exact, n_g = max(g_lq, lq[j]), max(g_lk, lk[j]), exact + lq[j] * lk[j], pos - start + 1
        over = n_g * max(n_lq, _MIN_BUDGET_ROWS) * n_lk > budget
        if pos > start and (over or n_g * n_lq * n_lk > _PAD_SLACK * n_exact + _CALL_ALLOWANCE):
            spans.append((start, pos, g_lq, g_lk))
            start, n_lq, n_lk, n_exact = pos, lq[j], lk[j], lq[j] * lk[j]
        g_lq, g_lk, exact = n_lq, n_lk, n_exact
    if order.size:
        spans.append((start, order.size, g_lq, g_lk))

    n = num_queries
    row_base, row_stride, row_offset = (np.zeros(n, dtype=np.int64) for _ in range(3))
    groups, base, padded = [], 0, 0
    for g0, g1, g_lq, g_lk in spans:
        g_lq, g_lk, size = int(g_lq), int(g_lk), g1 - g0
        q_index = np.zeros((size, g_lq), dtype=np.int64)
        k_index = np.full((size, g_lk), num_keys, dtype=np.int64)
        for slot, j in enumerate(order[g0:g1]):
            m, s, b = blocks[j]
            a = anc[m].size
            rows = qs[m] + s + np.arange(b)
            q_index[slot, g_lq - b:] = rows
            k_index[slot, g_lk - a - s - b: g_lk - s - b] = anc[m]
            k_index[slot, g_lk - s - b:] = ks[m] + np.arange(s + b)
            row_base[rows] = base + slot * g_lq
            row_stride[rows] = g_lq
            row_offset[rows] = g_lq - b + np.arange(b)
        q_index, k_index = (torch.from_numpy(x).to(device) for x in (q_index, k_index.reshape(-1)))
        groups.append(_Group(q_index, k_index, size, g_lq, g_lk))
        base += size * g_lq
        padded += size * g_lq * g_lk
    exact = int((lq * (lk - lq) + lq * (lq + 1) // 2).sum())
    return TreeAttentionPlan(num_queries, num_keys, groups, *(torch.from_numpy(x).to(device)
                             for x in (row_base, row_stride, row_offset)), exact, padded)


def plan_reference_mask(
    node_query_start: torch.Tensor,
    node_length: torch.Tensor,
    node_key_start: torch.Tensor,
    node_ancestor_keys: list[torch.Tensor],
    num_queries: int,
    num_keys: int,
    device=None,
    max_group_tokens: int | None = None,
) -> torch.Tensor:
    """[n, m] bool: the keys each query may see, built densely node by node (tests only)."""
    qs, ln, ks, anc = _check_nodes(node_query_start, node_length, node_key_start, node_ancestor_keys,
                                   num_queries, num_keys)
    mask = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    for m in range(qs.size):
        q0, k0, length = int(qs[m]), int(ks[m]), int(ln[m])
        mask[q0: q0 + length, torch.from_numpy(anc[m])] = True
        mask[q0: q0 + length, k0: k0 + length] = torch.ones(length, length, dtype=torch.bool).tril_()
    return mask.to(device or "cpu")


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan, scaling: float
) -> torch.Tensor:
    """Exact tree attention by the groups of ``plan``. Returns [n, H, Dv]; differentiable in q, k, v.

    q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv]; query head h reads key/value head h // (H // Hkv).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    h, n, dk = q.shape
    hkv, m, dv = v.shape
    if k.shape[:2] != (hkv, m) or k.shape[2] != dk or h % hkv:
        raise ValueError(f"inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(H must be a multiple of Hkv)")
    if (n, m) != (plan.num_queries, plan.num_keys):
        raise ValueError(f"plan is for {plan.num_queries} queries and {plan.num_keys} keys, got {n} and {m}")
    r = h // hkv
    if n == 0:
        return q.new_zeros(0, h, dv)
    if plan.row_base.device != q.device:
        raise ValueError(f"plan lives on {plan.row_base.device}, tensors on {q.device}")
    # One extra channel removes padding keys (module docstring); values are padded to the same
    # width because CPU flash attention needs equal key and value head sizes.
    dp = max(dk + 1, dv)
    huge = torch.finfo(k.dtype).max / 4 / max(scaling, 1.0)
    q1 = torch.cat([q, q.new_ones(h, n, 1), q.new_zeros(h, n, dp - dk - 1)], dim=-1).reshape(hkv, r * n, dp)
    pad_key = k.new_zeros(hkv, 1, dp)
    pad_key[..., dk] = -huge
    k1 = torch.cat([torch.cat([k, k.new_zeros(hkv, m, dp - dk)], dim=-1), pad_key], dim=1)
    v1 = torch.cat([torch.cat([v, v.new_zeros(hkv, m, dp - dv)], dim=-1), v.new_zeros(hkv, 1, dp)], dim=1)
    heads = torch.arange(r, device=q.device)
    outs = []
    for g in plan.groups:
        # [G, r, Lq]: query heads sharing a key/value head become extra query rows of one call
        rows = (g.query_index[:, None, :] + heads[None, :, None] * n).reshape(-1)
        qg = q1.index_select(1, rows).view(hkv, g.size, r * g.lq, dp)
        kg = k1.index_select(1, g.key_index).view(hkv, g.size, g.lk, dp)
        vg = v1.index_select(1, g.key_index).view(hkv, g.size, g.lk, dp)
        mask = plan.mask(g.lq, g.lk, r, q.dtype, q.device)
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling)
        outs.append(out[..., :dv].reshape(hkv, -1, dv))
    stacked = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [Hkv, R, Dv]
    total = stacked.shape[1]
    # out[t, kv * r + s] = stacked[kv, r * base[t] + s * stride[t] + offset[t]]: one gather.
    within = r * plan.row_base[:, None] + heads[None, :] * plan.row_stride[:, None] + plan.row_offset[:, None]
    flat = (torch.arange(hkv, device=q.device)[None, :, None] * total + within[:, None, :]).reshape(n, h)
    return stacked.reshape(hkv * total, dv)[flat]
