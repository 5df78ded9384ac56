"""Query blocks and the calls that run them: how a tree-attention plan cuts each node's queries into
blocks and packs blocks of similar shape into one batched call each.

A block of b queries at offset s in a node below a ancestor keys attends to the path's keys up to
its end, a + s + b of them (with a window W, the last W - 1 + b); its own causal triangle is wasted
work, so blocks are cut short enough to keep that small (:func:`query_blocks`). Blocks of similar
shape are padded into one call (an :class:`AttentionGroup`: G blocks padded to Lq queries and Lk
keys, right-aligned, so that one bottom-right mask serves the whole call) while the padding stays
within a fraction of their work plus about one call's fixed cost (:func:`group_blocks`).
:func:`fill_groups` writes every group's query and key rows into the plan's flat index tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.forest import concat_ranges

__all__ = ["AttentionGroup", "query_blocks", "group_blocks", "fill_groups"]

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


@dataclass(frozen=True)
class AttentionGroup:
    """One SDPA call: ``size`` (G) query blocks padded to Lq queries and Lk keys."""

    size: int
    lq: int
    lk: int
    pad_keys: bool  # some block has fewer than Lk keys: the call needs the padding channel


def query_blocks(a: int, length: int, budget: int, window: int | None = None) -> list[tuple[int, int]]:
    """(start, size) of one node's query blocks, given ``a`` ancestor keys and a score budget."""
    blocks, s = [], 0
    while s < length:
        # keys before the block's first query: its path so far, or the window's W - 1
        before = a + s if window is None else min(a + s, window - 1)
        b = max(_MIN_QUERY_BLOCK, before // _BLOCK_DIV)
        if window is not None:  # a block's keys are W - 1 + b for W * b visible pairs: b <= W / 4
            b = min(b, max(1, window // _BLOCK_DIV))
        # Largest b with b * (before + b) <= budget: the block alone must fit one call.
        fit = int((-before + (before**2 + 4 * budget) ** 0.5) / 2)
        b = max(1, min(b, fit, length - s))
        if 0 < length - s - b <= b // 4 and (length - s) * (before + length - s) <= budget:
            b = length - s  # fold a short tail into this block rather than start another call
        blocks.append((s, b))
        s += b
    return blocks


def group_blocks(lq: np.ndarray, lk: np.ndarray, kind: np.ndarray, budget: int):
    """Blocks of ``lq`` queries and ``lk`` keys packed into calls: (order, spans, groups). ``order``
    lists the blocks sorted so that similar shapes sit together; span (g0, g1, Lq, Lk) of each call
    is the range ``order[g0:g1]``; ``groups`` are its :class:`AttentionGroup`. Blocks of different
    ``kind`` never share a call; a call holds at most ``budget`` score elements per head (short
    blocks counted as :data:`_MIN_BUDGET_ROWS` rows)."""
    # Similar shapes next to each other: query-size class (powers of two), then keys descending.
    order = np.lexsort((kind, -lq, -lk, -np.ceil(np.log2(np.maximum(lq, 1)))))
    # Greedy: a block joins the open group while the padding it adds, and the group's padding in
    # all, stay within a fraction of the work plus a fixed allowance (about one call's overhead).
    # Large blocks thus get calls of their own, which costs little.
    spans, start, g_lq, g_lk, g_exact = [], 0, 0, 0, 0
    g_kind = kind[order[0]] if order.size else 0
    for pos, j in enumerate(order):
        size, n_lq, n_lk, e = pos - start, max(g_lq, lq[j]), max(g_lk, lk[j]), lq[j] * lk[j]
        padded = (size + 1) * n_lq * n_lk
        added = padded - size * g_lq * g_lk - e > _CALL_ALLOWANCE + _PAD_SLACK * e
        total = padded - g_exact - e > _CALL_ALLOWANCE + _PAD_SLACK * (g_exact + e)
        over = (size + 1) * max(n_lq, _MIN_BUDGET_ROWS) * n_lk > budget
        if size and (over or added or total or kind[j] != g_kind):
            spans.append((start, pos, g_lq, g_lk))
            start, n_lq, n_lk, g_exact, g_kind = pos, lq[j], lk[j], 0, kind[j]
        g_lq, g_lk, g_exact = n_lq, n_lk, g_exact + e
    if order.size:
        spans.append((start, order.size, g_lq, g_lk))
    # Groups without key padding first: they skip the padding channel (+1 head width costs CPU
    # flash attention more than its share, about 15% at 32 channels), and a tensor's gathers
    # stay one contiguous index range per kind.
    spans.sort(key=lambda sp: bool((lk[order[sp[0] : sp[1]]] < sp[3]).any()))
    groups = [
        AttentionGroup(g1 - g0, int(g_lq), int(g_lk), bool((lk[order[g0:g1]] < g_lk).any()))
        for g0, g1, g_lq, g_lk in spans
    ]
    return order, spans, groups


def fill_groups(spans, order, blocks, qs, ks, anc, num_queries: int, num_keys: int):
    """The groups' flat query and key index tensors and each query's row in them, for all blocks
    at once. Group g is [size, lq] queries and [size, lk] keys, each block right-aligned in its
    slot (query padding 0, key padding ``num_keys``); a block's keys are its path's columns from
    k0: its ancestors' keys, then its own node's up to the block's end."""
    g_size = np.array([g1 - g0 for g0, g1, _, _ in spans], dtype=np.int64)
    g_lq = np.array([x for _, _, x, _ in spans], dtype=np.int64)
    g_lk = np.array([x for _, _, _, x in spans], dtype=np.int64)
    q_base, k_base = np.cumsum(g_size * g_lq) - g_size * g_lq, np.cumsum(g_size * g_lk) - g_size * g_lk
    seq = np.concatenate([order[g0:g1] for g0, g1, _, _ in spans]) if spans else np.zeros(0, dtype=np.int64)
    group = np.repeat(np.arange(len(spans)), g_size)
    slot = np.arange(seq.size) - np.repeat(np.cumsum(g_size) - g_size, g_size)
    m, s, b, k0 = (blocks[seq, i] for i in range(4))
    lq, lk = g_lq[group], g_lk[group]
    # queries: rows qs[m] + s + i, at slot * lq + lq - b + i of their group
    i = concat_ranges(np.zeros_like(b), b)
    rows = np.repeat(qs[m] + s, b) + i
    q_all = np.zeros(int((g_size * g_lq).sum()), dtype=np.int64)
    slot_row = q_base[group] + slot * lq
    q_all[np.repeat(slot_row + lq - b, b) + i] = rows
    row_base, row_stride, row_offset = (np.zeros(num_queries, dtype=np.int64) for _ in range(3))
    row_base[rows] = np.repeat(slot_row, b)
    row_stride[rows] = np.repeat(lq, b)
    row_offset[rows] = np.repeat(lq - b, b) + i
    # keys: path columns k0 .. a + s + b - 1 (a ancestors), at slot * lk + lk - width + t of their group
    sizes = np.fromiter((x.size for x in anc), dtype=np.int64, count=len(anc))
    a = sizes[m]
    width = a + s + b - k0
    t = concat_ranges(np.zeros_like(width), width)
    col, a_t, m_t = np.repeat(k0, width) + t, np.repeat(a, width), np.repeat(m, width)
    anc_all = np.concatenate([*anc, np.zeros(1, dtype=np.int64)])  # a spare entry keeps every index in range
    from_anc = anc_all[np.minimum((np.cumsum(sizes) - sizes)[m_t] + col, anc_all.size - 1)]
    keys = np.where(col < a_t, from_anc, ks[m_t] + col - a_t)
    k_all = np.full(int((g_size * g_lk).sum()), num_keys, dtype=np.int64)
    k_all[np.repeat(k_base[group] + slot * lk + lk - width, width) + t] = keys
    return q_all, k_all, row_base, row_stride, row_offset
