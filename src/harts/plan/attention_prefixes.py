"""Shared prefixes: long runs of ancestor keys that a tree-attention plan runs as calls of their own.

On a forest with a long shared prompt, every query block below it would gather the prompt's keys
again (on the agentic bench forest, 26K gathered key rows for 2.5K tokens), and a part cut below a
long context would gather and mask thousands of context keys. The plan instead makes a long run of
ancestor keys a call of its own (a :class:`SharedPrefix`: all the queries below it against its
keys, contiguous rows, no mask), and the blocks gather only the rest of their paths; the op merges
the calls by their logsumexp (:mod:`harts.ops.tree_attention.prefixes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.plan.attention_blocks import query_blocks

__all__ = ["SharedPrefix", "shared_prefixes"]

# A run of ancestor keys becomes a call of its own when it is at least this long and the key rows its
# call keeps from being gathered (one gather per query block, forward and backward, one scatter-add
# of key and value gradients, and mask columns) reach this count.
_MIN_PREFIX_KEYS = 32
_MIN_PREFIX_SAVED = 2048


@dataclass(frozen=True)
class SharedPrefix:
    """One call over keys ``[k0, k1)`` for queries ``[q0, q1)``, every one of which sees all of them."""

    k0: int
    k1: int
    q0: int
    q1: int


def _key_runs(anc: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of consecutive key rows in every node's ancestor list, in node order: first row,
    last row + 1, and node of each run (one pass over the concatenated lists)."""
    sizes = np.fromiter((a.size for a in anc), dtype=np.int64, count=len(anc))
    if not sizes.sum():
        return (np.zeros(0, dtype=np.int64),) * 3
    rows = np.concatenate(anc)
    node = np.repeat(np.arange(len(anc)), sizes)
    first = np.ones(rows.size, dtype=bool)  # a run starts at a node's first key or where rows jump
    first[1:] = (np.diff(rows) != 1) | (node[1:] != node[:-1])
    starts = np.flatnonzero(first)
    lasts = np.append(starts[1:], rows.size) - 1
    return rows[starts], rows[lasts] + 1, node[starts]


def shared_prefixes(qs, ln, anc, budget: int) -> tuple[list[SharedPrefix], list[np.ndarray]]:
    """The shared-prefix calls worth making, and each node's ancestor keys without their keys.

    Ancestor key lists are cut into pieces at every place where some list's run of consecutive rows
    starts or ends; a piece is then read by every node whose path holds it, whole. Adjacent pieces
    read by the same nodes join. A piece becomes calls (one per contiguous range of its readers'
    query rows) when it holds at least :data:`_MIN_PREFIX_KEYS` keys and the gathered key rows it
    saves, its keys times the query blocks reading it, reach :data:`_MIN_PREFIX_SAVED` (a call reads
    its keys in place, and its scores need no mask).
    """
    lo, hi, run_node = _key_runs(anc)
    if not lo.size:
        return [], anc
    edges = np.unique(np.concatenate([lo, hi]))
    # Each run covers the edge intervals first .. last - 1; list (interval, node) for every cover.
    first, last = np.searchsorted(edges, lo), np.searchsorted(edges, hi)
    count = last - first
    interval = np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
    reader = np.repeat(run_node, count)
    order = np.lexsort((reader, interval))  # by interval, readers ascending (a node covers it once)
    interval, reader = interval[order], reader[order].tolist()
    bounds = [0, *(np.flatnonzero(np.diff(interval)) + 1).tolist(), interval.size]  # one span per interval
    pieces: list[list] = []  # [first key, last key + 1, readers], adjacent intervals of equal readers joined
    for i, j in zip(bounds[:-1], bounds[1:], strict=False):
        a, b, nodes = int(edges[interval[i]]), int(edges[interval[i] + 1]), reader[i:j]
        if pieces and pieces[-1][1] == a and pieces[-1][2] == nodes:
            pieces[-1][1] = b
        else:
            pieces.append([a, b, nodes])
    prefixes, split = [], np.zeros(int(edges[-1]), dtype=bool)
    node_blocks: dict[int, int] = {}  # query blocks per node, counted once for the nodes that matter

    def blocks(m: int) -> int:
        if m not in node_blocks:
            node_blocks[m] = len(query_blocks(anc[m].size, int(ln[m]), budget))
        return node_blocks[m]

    for a, b, nodes in pieces:
        if b - a < _MIN_PREFIX_KEYS:
            continue
        spans: list[list[int]] = []
        for q0, q1 in sorted((int(qs[m]), int(qs[m] + ln[m])) for m in nodes):
            if spans and spans[-1][1] == q0:
                spans[-1][1] = q1
            else:
                spans.append([q0, q1])
        if (b - a) * sum(blocks(m) for m in nodes) < _MIN_PREFIX_SAVED:
            continue
        split[a:b] = True
        prefixes.extend(SharedPrefix(a, b, q0, q1) for q0, q1 in spans)
    if not prefixes:
        return [], anc
    return prefixes, [a[~split[a]] for a in anc]
