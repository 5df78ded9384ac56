"""Full attention over a forest of tokens.

A token attends to every token on its own path: the tokens of its ancestor nodes and the earlier
tokens of its own node. This is exactly causal attention of each root-to-leaf trajectory,
computed once per unique query token.

Two forms live here:

- the plain form (:func:`masked_tree_attention` with :func:`plan_reference_mask`): one
  scaled_dot_product_attention (SDPA) call with a dense boolean mask [n, m]. Exact and simple,
  the reference the tests hold the grouped form to; cost and memory O(n m).
- the grouped form (:func:`plan_tree_attention`, :func:`tree_attention`): each node's queries,
  split into query blocks, attend to [ancestor keys ; own keys], gathered by index; blocks of
  similar shape are padded into a few batched SDPA calls. Cost is about the exact cost, the sum
  of path positions, plus bounded waste (causal triangles of the blocks and padding). The key
  space may be larger than the query space (keys of ancestors computed in an earlier
  micro-batch).

How padding stays exact without a per-block mask: inside a group, keys are right-aligned (left
padding, ancestors, own keys ending at the last column) and queries right-aligned too, so every
block's causal rule is the same bottom-right triangle and one [Lq, Lk] mask serves the group.
In groups with key padding, padding keys are removed through one extra head channel: queries
carry 1 there, real keys 0 and the padding key a huge negative number, so a padding key's score
is exactly -huge (weight 0, and finite, so a query row that sees only padding yields no NaN) and
real scores are unchanged. Groups without key padding (all large blocks, which run alone) skip it.

Limits: SDPA saves each group's gathered keys/values for backward, so attention memory grows
with the key rows summed over query blocks (about the flat token count), not the unique tokens.
In float16 a padding key's weight is exp(-finfo.max / 4 * scale - max score), zero only while
scores stay above about -1000. CPU SDPA runs its fast (flash) kernel only with equal key and
value head sizes and a 4-D mask, so the narrower of keys and values is zero-padded. Measured on
2 CPU cores, fp32, 4 heads of 32: about 27 ns per (query, key) pair for fwd+bwd, tree or flat.

Shapes: q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv] (heads first, no batch); outputs [n, H, Dv].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "masked_tree_attention",
    "TreeAttentionPlan",
    "plan_tree_attention",
    "plan_reference_mask",
    "tree_attention",
]

# Query blocks: a block's own causal triangle is wasted work, about b / (2 (a + s + b)) of it for a
# block of b queries at offset s below a ancestor keys; b <= (a + s) / 4 keeps that under 1/10.
_MIN_QUERY_BLOCK = 128
_BLOCK_DIV = 4
# Grouping: the padding a block adds to its group may reach this fraction of its own work plus a
# fixed allowance (score elements, about the cost of one more call), so small blocks share calls.
_PAD_SLACK = 0.2
_CALL_ALLOWANCE = 2048
# Short query blocks are counted as this many rows in the budget, which also bounds gathered keys.
_MIN_BUDGET_ROWS = 64
_DEFAULT_GROUP_TOKENS = 1 << 24


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


# ---- grouped form ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """One SDPA call: ``size`` (G) query blocks padded to Lq queries and Lk keys."""

    size: int
    lq: int
    lk: int
    pad_keys: bool  # some block has fewer than Lk keys: the call needs the padding channel


@dataclass(eq=False)
class TreeAttentionPlan:
    """Index tensors of one micro-batch's grouped tree attention, reused by every layer.

    ``query_index`` [sum G * Lq] and ``key_index`` [sum G * Lk] hold the groups' rows one after
    another, each group laid out [G, Lq] / [G, Lk], right-aligned; padding queries read row 0 and
    padding keys row m (the pad key). With r query heads per key/value head, query t's head s
    lands on row ``r * row_base[t] + s * row_stride[t] + row_offset[t]`` of the groups' outputs
    stacked (each laid out [G, r, Lq]). ``exact_cost`` counts the (query, key) pairs on paths,
    ``padded_cost`` the score elements the groups compute (per head).
    """

    num_queries: int
    num_keys: int
    groups: list[_Group]
    query_index: torch.Tensor
    key_index: torch.Tensor
    row_base: torch.Tensor  # [n]
    row_stride: torch.Tensor  # [n]
    row_offset: torch.Tensor  # [n]
    exact_cost: int
    padded_cost: int
    _cache: dict = field(default_factory=dict, repr=False)

    def mask(self, lq: int, lk: int, r: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[1, 1, r * Lq, Lk] additive bottom-right causal mask, cached so layers share one tensor."""
        if lq == 1:
            return None  # the single query row sees every key
        key = ("mask", lq, lk, r, dtype)
        if key not in self._cache:
            allowed = torch.ones(lq, lk, dtype=torch.bool, device=self.key_index.device).tril_(lk - lq)
            additive = torch.zeros(lq, lk, dtype=dtype, device=allowed.device)
            self._cache[key] = additive.masked_fill_(~allowed, float("-inf")).repeat(r, 1)[None, None]
        return self._cache[key]

    def head_rows(self, hkv: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of q [Hkv, r * n, .] for all groups ([sum G * r * Lq]) and of the stacked outputs
        [Hkv * R, .] for every (query, head) ([n, H]); cached per head layout."""
        key = ("rows", hkv, r)
        if key not in self._cache:
            n, heads = self.num_queries, torch.arange(r, device=self.key_index.device)
            parts = self.query_index.split([g.size * g.lq for g in self.groups])
            rows = torch.cat([(p.view(g.size, 1, g.lq) + heads[:, None] * n).reshape(-1)
                              for p, g in zip(parts, self.groups, strict=True)])
            total = r * sum(g.size * g.lq for g in self.groups)
            within = r * self.row_base[:, None] + heads * self.row_stride[:, None] + self.row_offset[:, None]
            kv = torch.arange(hkv, device=heads.device)[None, :, None]
            self._cache[key] = rows, (kv * total + within[:, None, :]).reshape(n, hkv * r)
        return self._cache[key]


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
        b = max(_MIN_QUERY_BLOCK, (a + s) // _BLOCK_DIV)
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
    # Greedy: a block joins the open group while the padding it adds, and the group's padding in
    # all, stay within a fraction of the work plus a fixed allowance (about one call's overhead).
    # Large blocks thus get calls of their own, which costs little.
    spans, start, g_lq, g_lk, g_exact = [], 0, 0, 0, 0
    for pos, j in enumerate(order):
        size, n_lq, n_lk, e = pos - start, max(g_lq, lq[j]), max(g_lk, lk[j]), lq[j] * lk[j]
        padded = (size + 1) * n_lq * n_lk
        added = padded - size * g_lq * g_lk - e > _CALL_ALLOWANCE + _PAD_SLACK * e
        total = padded - g_exact - e > _CALL_ALLOWANCE + _PAD_SLACK * (g_exact + e)
        over = (size + 1) * max(n_lq, _MIN_BUDGET_ROWS) * n_lk > budget
        lone = (lk[j] == 1) != (g_lk == 1)  # queries with one key get groups of their own (tree_attention)
        if size and (over or added or total or lone):
            spans.append((start, pos, g_lq, g_lk))
            start, n_lq, n_lk, g_exact = pos, lq[j], lk[j], 0
        g_lq, g_lk, g_exact = n_lq, n_lk, g_exact + e
    if order.size:
        spans.append((start, order.size, g_lq, g_lk))
    # Groups without key padding first: they skip the padding channel (+1 head width costs CPU
    # flash attention more than its share, about 15% at 32 channels), and a tensor's gathers
    # stay one contiguous index range per kind.
    spans.sort(key=lambda sp: bool((lk[order[sp[0]:sp[1]]] < sp[3]).any()))

    n = num_queries
    row_base, row_stride, row_offset = (np.zeros(n, dtype=np.int64) for _ in range(3))
    groups, q_parts, k_parts, base, padded = [], [], [], 0, 0
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
        q_parts.append(q_index.reshape(-1))
        k_parts.append(k_index.reshape(-1))
        groups.append(_Group(size, g_lq, g_lk, bool((lk[order[g0:g1]] < g_lk).any())))
        base += size * g_lq
        padded += size * g_lq * g_lk
    exact = int((lq * (lk - lq) + lq * (lq + 1) // 2).sum())
    q_all, k_all = (np.concatenate(x) if x else np.zeros(0, dtype=np.int64) for x in (q_parts, k_parts))
    return TreeAttentionPlan(num_queries, num_keys, groups, *(torch.from_numpy(x).to(device)
                             for x in (q_all, k_all, row_base, row_stride, row_offset)), exact, padded)


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
    if plan.key_index.device != q.device:
        raise ValueError(f"plan lives on {plan.key_index.device}, tensors on {q.device}")
    q_rows, out_rows = plan.head_rows(hkv, r)
    n_plain = sum(not g.pad_keys for g in plan.groups)
    outs, q_at, k_at = [], 0, 0
    for groups, pad in ((plan.groups[:n_plain], False), (plan.groups[n_plain:], True)):
        if not groups:
            continue
        # Values are zero-padded to the key width since CPU flash attention needs equal widths;
        # with key padding, the extra channel (module docstring) and the pad key at row m join.
        dp = max(dk + pad, dv)
        qx = _widen(q, dp, 1.0 if pad else None).reshape(hkv, r * n, dp)
        kx, vx = _widen(k, dp), _widen(v, dp)
        if pad:
            pad_key = k.new_zeros(hkv, 1, dp)
            pad_key[..., dk] = -torch.finfo(k.dtype).max / 4 / max(scaling, 1.0)
            kx, vx = torch.cat([kx, pad_key], dim=1), torch.cat([vx, v.new_zeros(hkv, 1, dp)], dim=1)
        # One gather per tensor, then split: per-group gathers would each cost a zero-filled
        # gradient of the whole input in backward. Query heads sharing a key/value head become
        # extra query rows of one call ([G, r, Lq]).
        q_sizes, k_sizes = [g.size * r * g.lq for g in groups], [g.size * g.lk for g in groups]
        q_split = qx.index_select(1, q_rows[q_at: q_at + sum(q_sizes)]).split(q_sizes, dim=1)
        k_rows = plan.key_index[k_at: k_at + sum(k_sizes)]
        k_split = kx.index_select(1, k_rows).split(k_sizes, dim=1)
        v_split = vx.index_select(1, k_rows).split(k_sizes, dim=1)
        q_at, k_at = q_at + sum(q_sizes), k_at + sum(k_sizes)
        for g, qg, kg, vg in zip(groups, q_split, k_split, v_split, strict=True):
            qg = qg.view(hkv, g.size, r * g.lq, dp)
            kg, vg = kg.view(hkv, g.size, g.lk, dp), vg.view(hkv, g.size, g.lk, dp)
            if g.lk == 1:
                # A lone key gets weight 1: its value, exactly, and exactly zero gradient for the
                # query and key, which SDPA's backward leaves at rounding noise (~1e-6 in fp32).
                # The zero term keeps q and k in the graph (and propagates NaN as SDPA would).
                out = vg.expand(hkv, g.size, r, dp) + 0 * (qg[..., :1] + kg[..., :1])
            else:
                mask = plan.mask(g.lq, g.lk, r, q.dtype)
                out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling)
            outs.append(out[..., :dv].reshape(hkv, -1, dv))
    stacked = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [Hkv, R, Dv]
    return stacked.reshape(-1, dv)[out_rows]


def _widen(x: torch.Tensor, width: int, channel: float | None = None) -> torch.Tensor:
    """[..., D] -> [..., width] with zero columns; ``channel``, when given, fills column D."""
    parts = [x] if channel is None else [x, x.new_full((*x.shape[:-1], 1), channel)]
    fill = width - x.shape[-1] - len(parts) + 1
    if fill:
        parts.append(x.new_zeros(*x.shape[:-1], fill))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else x
