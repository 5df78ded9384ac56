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

Backward: the gathered rows are not saved (on forests of short nodes the gathered key rows are
several times the token count). Saved are q, k, v as passed, the returned output and, per group
run by CPU flash attention, its logsumexp ([Hkv, G, r * Lq] floats); backward gathers each group's
rows again, runs the fused CPU flash backward kernel on them and adds the gradients back by index
(key and value gradients, summed over blocks, in float32 for float16/bfloat16). Groups SDPA would
not run by CPU flash attention (any other device) recompute their forward in backward and
differentiate it by autograd: one more forward per group, and then the output is not saved.
Where it is, modifying it in place before backward raises. No double backward (the backward is
once-differentiable).

Limits: in float16 a padding key's weight is exp(-finfo.max / 4 * scale - max score), zero only
while scores stay above about -1000. CPU SDPA runs its fast (flash) kernel only with equal key and
value head sizes and a 4-D mask, so the narrower of keys and values is zero-padded. Measured on
2 CPU cores, fp32, 4 heads of 32: about 27 ns per (query, key) pair for fwd+bwd, tree or flat.

Shapes: q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv] (heads first, no batch); outputs [n, H, Dv].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

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
    Backward saves q, k, v as passed, the returned output and small per-group logsumexps, and
    gathers again (module docstring, Backward); it supports no double backward.
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
    if n == 0:
        return q.new_zeros(0, h, dv)
    if plan.key_index.device != q.device:
        raise ValueError(f"plan lives on {plan.key_index.device}, tensors on {q.device}")
    return _TreeAttention.apply(q, k, v, plan, scaling)


# CPU groups run the fused flash kernels directly, so backward needs only each group's logsumexp;
# False sends every group down the recompute path that other devices take (the tests use it).
_FUSED_CPU = True
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _TreeAttention(torch.autograd.Function):
    """:func:`tree_attention` with a backward that gathers the groups' rows again.

    Autograd through the gathers would save every group's gathered queries, keys and values (the
    key rows are several times the token count on forests of short nodes); this saves q, k, v as
    passed, the returned output and, per fused CPU group, its logsumexp [Hkv, G, r * Lq].
    """

    @staticmethod
    def forward(ctx, q, k, v, plan: TreeAttentionPlan, scaling: float):
        hkv, _, dv = v.shape
        r = q.shape[0] // hkv
        outs, lses = [], []
        for g, _, _, qg, kg, vg in _gathered_groups(q, k, v, plan, scaling):
            mask = plan.mask(g.lq, g.lk, r, q.dtype)
            if g.lk > 1 and _fused(qg, kg, vg, mask, scaling):
                out, lse = _flash_forward(qg, kg, vg, 0.0, False, attn_mask=mask, scale=scaling)
            else:
                out, lse = _attend_group(g, qg, kg, vg, mask, scaling), None
            outs.append(out[..., :dv].reshape(hkv, -1, dv))
            lses.append(lse)
        stacked = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [Hkv, R, Dv]
        output = stacked.reshape(-1, dv)[plan.head_rows(hkv, r)[1]]
        fused = any(lse is not None for lse in lses)
        # The output is saved only for the fused backward (which reads it in sum(dO * O)); callers
        # usually keep it anyway (the next op saves it), so it costs no extra memory there.
        ctx.save_for_backward(q, k, v, output if fused else None, *lses)
        ctx.plan, ctx.scaling = plan, scaling
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, output, *lses = ctx.saved_tensors
        plan, scaling = ctx.plan, ctx.scaling
        h, n, dk = q.shape
        hkv, m, dv = v.shape
        r = h // hkv
        # The groups' stacked layout [Hkv, R, Dv] of the output's gradient (and of the output):
        # padding query rows get zero gradient, which makes their output values irrelevant.
        out_rows = plan.head_rows(hkv, r)[1].reshape(-1)
        total = r * sum(g.size * g.lq for g in plan.groups)

        def stacked(x):
            rows = x.new_zeros(hkv * total, dv).index_put_((out_rows,), x.reshape(-1, dv))
            return rows.view(hkv, total, dv)

        grad_st, out_st = stacked(grad), None if output is None else stacked(output)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # A query row gets one group's gradient; a key row sums over every block that reads it,
        # accumulated in float32 for float16/bfloat16 inputs. Row m: the padding key, dropped.
        acc = torch.float32 if k.dtype in (torch.float16, torch.bfloat16) else k.dtype
        dq_all = q.new_zeros(hkv, r * n, dk) if need_q else None
        dk_all = k.new_zeros(hkv, m + 1, dk, dtype=acc) if need_k else None
        dv_all = v.new_zeros(hkv, m + 1, dv, dtype=acc) if need_v else None
        at = 0
        for (g, q_rows, k_rows, qg, kg, vg), lse in zip(_gathered_groups(q, k, v, plan, scaling), lses,
                                                         strict=True):
            rows, dp = qg.shape[1] * qg.shape[2], qg.shape[-1]
            grad_g = _widen(grad_st[:, at: at + rows], dp).reshape(qg.shape)
            mask = plan.mask(g.lq, g.lk, r, q.dtype)
            if lse is not None:
                out_g = _widen(out_st[:, at: at + rows], dp).reshape(qg.shape)
                gq, gk, gv = _flash_backward(grad_g, qg, kg, vg, out_g, lse, 0.0, False,
                                             attn_mask=mask, scale=scaling)
            else:
                # Any device: this group's forward once more, differentiated by autograd.
                with torch.enable_grad():
                    leaves = [x.detach().requires_grad_() for x in (qg, kg, vg)]
                    out = _attend_group(g, *leaves, mask, scaling)
                    gq, gk, gv = torch.autograd.grad(out, leaves, grad_g)
            if need_q:
                dq_all.index_add_(1, q_rows, gq.reshape(hkv, rows, dp)[..., :dk])
            if need_k:
                dk_all.index_add_(1, k_rows, gk.reshape(hkv, -1, dp)[..., :dk].to(acc))
            if need_v:
                dv_all.index_add_(1, k_rows, gv.reshape(hkv, -1, dp)[..., :dv].to(acc))
            at += rows
        return (dq_all.view(h, n, dk) if need_q else None, dk_all[:, :m].to(k.dtype) if need_k else None,
                dv_all[:, :m].to(v.dtype) if need_v else None, None, None)


def _gathered_groups(q, k, v, plan: TreeAttentionPlan, scaling: float):
    """Per group of ``plan``, in order: (group, its rows of q [Hkv, r n, .], its key rows, and its
    queries [Hkv, G, r * Lq, dp], keys and values [Hkv, G, Lk, dp], gathered and widened)."""
    h, n, dk = q.shape
    hkv, _, dv = v.shape
    r = h // hkv
    q_rows = plan.head_rows(hkv, r)[0]
    n_plain = sum(not g.pad_keys for g in plan.groups)
    q_at, k_at = 0, 0
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
        # Gathered one group at a time: only one group's rows live at once. Query heads sharing a
        # key/value head become extra query rows of one call ([G, r, Lq]).
        for g in groups:
            qr = q_rows[q_at: q_at + g.size * r * g.lq]
            kr = plan.key_index[k_at: k_at + g.size * g.lk]
            q_at, k_at = q_at + qr.numel(), k_at + kr.numel()
            yield (g, qr, kr, qx.index_select(1, qr).view(hkv, g.size, r * g.lq, dp),
                   kx.index_select(1, kr).view(hkv, g.size, g.lk, dp),
                   vx.index_select(1, kr).view(hkv, g.size, g.lk, dp))


def _attend_group(g: _Group, qg, kg, vg, mask, scaling: float) -> torch.Tensor:
    """One group's attention [Hkv, G, r * Lq, dp] by autograd-able ops (any device)."""
    if g.lk == 1:
        # A lone key gets weight 1: its value, exactly, and exactly zero gradient for the query
        # and key, which SDPA's backward leaves at rounding noise (~1e-6 in fp32). The zero term
        # keeps q and k in the graph (and propagates NaN as SDPA would).
        return vg.expand(*qg.shape[:3], -1) + 0 * (qg[..., :1] + kg[..., :1])
    return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling)


def _fused(qg, kg, vg, mask, scaling: float) -> bool:
    """Whether SDPA would run this call by CPU flash attention: then its fused kernels serve."""
    return (_FUSED_CPU and qg.device.type == "cpu"
            and torch._fused_sdp_choice(qg, kg, vg, mask, 0.0, False, scale=scaling) == _FLASH)


def _widen(x: torch.Tensor, width: int, channel: float | None = None) -> torch.Tensor:
    """[..., D] -> [..., width] with zero columns; ``channel``, when given, fills column D."""
    parts = [x] if channel is None else [x, x.new_full((*x.shape[:-1], 1), channel)]
    fill = width - x.shape[-1] - len(parts) + 1
    if fill:
        parts.append(x.new_zeros(*x.shape[:-1], fill))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else x
