"""Grouped tree-attention plans: which query blocks attend to which gathered keys, in which call.

Each node's queries, split into query blocks, attend to [ancestor keys ; own keys], gathered by
index; blocks of similar shape are padded into a few batched SDPA calls. Cost is about the exact
cost, the sum of path positions, plus bounded waste (causal triangles of the blocks and padding).
The key space may be larger than the query space (keys of ancestors computed in an earlier
micro-batch). :func:`plan_reference_mask` is the plain dense mask of the same visibility, used by
the tests. The op that runs a plan is :func:`harts.ops.tree_attention.tree_attention`.

Sliding windows run along paths: with window W a token at path position p sees the keys at path
positions p - W + 1 .. p of its own path (transformers' ``kv_idx > q_idx - sliding_window``). A
node's ancestor key list is its whole path from the root, so a key's column in a block's list is
its path position; a windowed plan (:meth:`TreeAttentionPlan.windowed`) gathers only the last
W - 1 + b keys of a block of b queries, and the block's rule becomes a bottom-right band of width
W, the same for every block of a group because keys and queries are right-aligned.

Shared prefixes: on a forest with a long shared prompt, every block below it would gather the
prompt's keys again (on the agentic bench forest, 26K gathered key rows for 2.5K tokens), and a
part cut below a long context would gather and mask thousands of context keys. The plan instead
makes a long run of ancestor keys a call of its own (a :class:`SharedPrefix`: all the queries
below it against its keys, contiguous rows, no mask), and the blocks gather only the rest of their
paths; the op merges the calls by their logsumexp
(:mod:`harts.ops.tree_attention`). :meth:`TreeAttentionPlan.whole` is the plan without them, for
the op's paths that cannot merge. A windowed plan has none.

Dense plans: on a small micro-batch the groups' fixed costs (a gather of queries, keys and values
per group, a scatter-add of their gradients, a kernel call each way) outweigh the score elements
they save. Where a plan's [n, m] scores cost less than its groups' by the estimate below
(:meth:`TreeAttentionPlan.dense_for`), the op runs one call over all queries and keys with the
plan's additive mask (:meth:`TreeAttentionPlan.dense_mask`), no gather and no scatter. On 2 CPU
threads (fwd + bwd, 4 heads of 32 channels) a call cost about as much as 45,000 score elements, a
fixed cost that is fewer elements for more heads or wider ones: a 130-token star of one prompt and
8 completions took 0.57 ms dense against 1.79 ms in 2 groups, while its flat form (417 tokens, 8
separate trajectories) took 3.68 ms dense against 2.79 ms in one group.

A plan depends only on the forest's structure, so it is built once per micro-batch and reused by
every full-attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from harts.forest import concat_ranges

__all__ = ["AttentionGroup", "SharedPrefix", "TreeAttentionPlan", "plan_tree_attention",
           "plan_reference_mask"]

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
# Shared prefixes (module docstring): a run of ancestor keys becomes a call of its own when it is at
# least this long and the key rows its call keeps from being gathered (one gather per query block,
# forward and backward, one scatter-add of key and value gradients, and mask columns) reach this count.
_MIN_PREFIX_KEYS = 32
_MIN_PREFIX_SAVED = 2048
# Dense plans (module docstring): n * m score elements against the groups' padded cost plus, per call
# (groups and prefixes), this many score elements times query heads times channels (45,000 at 4 x 32);
# at most this many [n, m] elements (the mask holds r times as many).
_DENSE_CALL_WORK = 45_000 * 4 * 32
_DENSE_MAX_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class AttentionGroup:
    """One SDPA call: ``size`` (G) query blocks padded to Lq queries and Lk keys."""

    size: int
    lq: int
    lk: int
    pad_keys: bool  # some block has fewer than Lk keys: the call needs the padding channel


@dataclass(frozen=True)
class SharedPrefix:
    """One call over keys ``[k0, k1)`` for queries ``[q0, q1)``, every one of which sees all of them."""

    k0: int
    k1: int
    q0: int
    q1: int


@dataclass(eq=False)
class TreeAttentionPlan:
    """Index tensors of one micro-batch's grouped tree attention, reused by every layer.

    ``query_index`` [sum G * Lq] and ``key_index`` [sum G * Lk] hold the groups' rows one after
    another, each group laid out [G, Lq] / [G, Lk], right-aligned; padding queries read row 0 and
    padding keys row m (the pad key). With r query heads per key/value head, query t's head s
    lands on row ``r * row_base[t] + s * row_stride[t] + row_offset[t]`` of the groups' outputs
    stacked (each laid out [G, r, Lq]). ``exact_cost`` counts the (query, key) pairs on paths,
    ``padded_cost`` the score elements the groups and shared prefixes compute (per head).
    ``prefixes``: the shared-prefix calls (module docstring); the groups' key rows then leave those
    keys out, and :meth:`whole` is the same plan without them. Where :meth:`dense_for` says so, the
    op runs the plan as one call with :meth:`dense_mask` instead of its groups.
    """

    num_queries: int
    num_keys: int
    groups: list[AttentionGroup]
    query_index: torch.Tensor
    key_index: torch.Tensor
    row_base: torch.Tensor  # [n]
    row_stride: torch.Tensor  # [n]
    row_offset: torch.Tensor  # [n]
    exact_cost: int
    padded_cost: int
    window: int | None = None  # sliding window along paths (None: whole paths)
    max_path_length: int = 0  # longest path (ancestors + own node) among the plan's nodes
    prefixes: tuple[SharedPrefix, ...] = ()
    _nodes: tuple | None = field(default=None, repr=False)  # the node description, for re-planning
    _cache: dict = field(default_factory=dict, repr=False)

    def whole(self) -> TreeAttentionPlan:
        """The plan of the same nodes without shared prefixes (every block gathers its whole path);
        this plan when it has none. Cached."""
        if not self.prefixes:
            return self
        if "whole" not in self._cache:
            nodes, budget, _ = self._nodes
            self._cache["whole"] = _plan(*nodes, self.num_queries, self.num_keys, self.key_index.device,
                                         budget, None, split=False)
        return self._cache["whole"]

    def windowed(self, window: int | None) -> TreeAttentionPlan:
        """The plan of the same nodes where each token sees only the last ``window`` tokens of its path
        (itself included); this plan when ``window`` is None or covers every path. Cached."""
        if window is None or window >= self.max_path_length:
            return self
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding window must be a positive integer, got {window!r}")
        key = ("windowed", window)
        if key not in self._cache:
            nodes, budget, _ = self._nodes
            self._cache[key] = _plan(*nodes, self.num_queries, self.num_keys, self.key_index.device,
                                     budget, window, split=False)
        return self._cache[key]

    def lone_unmerged(self) -> frozenset[int]:
        """The groups whose blocks have one key each and whose queries no shared prefix reaches:
        queries whose whole path is that key (a root's first token, with no context). Cached."""
        if "lone_unmerged" not in self._cache:
            reached = torch.zeros(self.num_queries + 1, dtype=torch.long)  # +1 at q0, -1 at q1
            for p in self.prefixes:
                reached[p.q0] += 1
                reached[p.q1] -= 1
            reached = reached.cumsum(0)[:-1] > 0
            parts = self.query_index.cpu().split([g.size * g.lq for g in self.groups])
            self._cache["lone_unmerged"] = frozenset(
                i for i, (g, rows) in enumerate(zip(self.groups, parts, strict=True))
                if g.lk == 1 and not reached[rows].any())
        return self._cache["lone_unmerged"]

    def dense_for(self, heads: int, width: int) -> bool:
        """Whether one call over all [n, m] scores is estimated cheaper than the groups' calls for
        ``heads`` query heads of ``width`` channels (module docstring, Dense plans); never for a
        windowed plan or the plan without prefixes of one that has them."""
        if self.window is not None or self._nodes is None or self._nodes[2]:
            return False
        scores = self.num_queries * self.num_keys
        calls = len(self.groups) + len(self.prefixes)
        return scores <= _DENSE_MAX_ELEMENTS and scores <= self.padded_cost + _DENSE_CALL_WORK * calls / (
            heads * width)

    def dense_mask(self, r: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, r * n, m] additive mask of the whole plan: 0 where a query sees a key (its path),
        else -finfo.max / 4, a finite score whose weight is exactly zero beside any real score (and
        no NaN in a kernel block where a row sees no key); query rows repeated for the r query heads
        of a key/value head. Cached, so layers share one tensor."""
        key = ("dense_mask", r, dtype)
        if key not in self._cache:
            (qs, ln, ks, anc), *_ = self._nodes
            sees = np.zeros((self.num_queries, self.num_keys), dtype=bool)
            own = np.tri(int(ln.max()) if ln.size else 0, dtype=bool)
            for q0, length, k0, a in zip(qs.tolist(), ln.tolist(), ks.tolist(), anc, strict=True):
                sees[q0: q0 + length, a] = True
                sees[q0: q0 + length, k0: k0 + length] = own[:length, :length]
            hidden = torch.from_numpy(~sees).to(self.key_index.device)
            additive = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
            additive.masked_fill_(hidden, -torch.finfo(dtype).max / 4)
            self._cache[key] = additive.repeat(r, 1)[None, None]
        return self._cache[key]

    def path_starts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Key rows of the first and second token of every path of two or more tokens, one pair per
        distinct start: a query whose visible values are all one value has such a pair of equal
        values. Cached."""
        if "path_starts" not in self._cache:
            (qs, ln, ks, anc), *_ = self._nodes
            pairs = set()
            for length, k0, a in zip(ln.tolist(), ks.tolist(), anc, strict=True):
                path = np.concatenate([a[:2], k0 + np.arange(min(length, 2))])[:2]
                if path.size == 2:
                    pairs.add((int(path[0]), int(path[1])))
            rows = torch.tensor(sorted(pairs), dtype=torch.long).reshape(-1, 2).to(self.key_index.device)
            self._cache["path_starts"] = rows[:, 0], rows[:, 1]
        return self._cache["path_starts"]

    def lone_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query rows, key rows) of the queries whose whole path is one key: a root's first token
        with no context. Cached."""
        if "lone_queries" not in self._cache:
            (qs, ln, ks, anc), *_ = self._nodes
            roots = np.array([a.size == 0 for a in anc], dtype=bool)
            device = self.key_index.device
            self._cache["lone_queries"] = (torch.from_numpy(qs[roots]).to(device),
                                           torch.from_numpy(ks[roots]).to(device))
        return self._cache["lone_queries"]

    def mask(self, lq: int, lk: int, r: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[1, 1, r * Lq, Lk] additive bottom-right causal mask (a band of the plan's window), cached
        so layers share one tensor."""
        if lq == 1:
            return None  # the single query row sees every key (a windowed block gathers only its window)
        key = ("mask", lq, lk, r, dtype)
        if key not in self._cache:
            allowed = torch.ones(lq, lk, dtype=torch.bool, device=self.key_index.device).tril_(lk - lq)
            if self.window is not None:  # keys more than window - 1 columns left of the query's own
                allowed.triu_(lk - lq - self.window + 1)
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


def _host_ints(a) -> np.ndarray:
    """A 1-D int64 host array of a tensor (any device) or an array."""
    a = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return a.astype(np.int64, copy=False).reshape(-1)


def _check_nodes(node_query_start, node_length, node_key_start, node_ancestor_keys, num_queries, num_keys):
    """Host-side int64 copies of the node description, checked; raises on inconsistent input."""
    qs, ln, ks = (_host_ints(x) for x in (node_query_start, node_length, node_key_start))
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
    anc = [_host_ints(a) for a in node_ancestor_keys]
    if anc:
        rows = np.concatenate(anc)
        bad = np.flatnonzero((rows < 0) | (rows >= num_keys))
        if bad.size:
            node = int(np.searchsorted(np.cumsum([a.size for a in anc]), bad[0], side="right"))
            raise ValueError(f"node {node}: ancestor key rows must lie in [0, {num_keys})")
    return qs, ln, ks, anc


def _query_blocks(a: int, length: int, budget: int, window: int | None = None) -> list[tuple[int, int]]:
    """(start, size) of one node's query blocks, given ``a`` ancestor keys and a score budget."""
    blocks, s = [], 0
    while s < length:
        # keys before the block's first query: its path so far, or the window's W - 1
        before = a + s if window is None else min(a + s, window - 1)
        b = max(_MIN_QUERY_BLOCK, before // _BLOCK_DIV)
        if window is not None:  # a block's keys are W - 1 + b for W * b visible pairs: b <= W / 4
            b = min(b, max(1, window // _BLOCK_DIV))
        # Largest b with b * (before + b) <= budget: the block alone must fit one call.
        fit = int((-before + (before ** 2 + 4 * budget) ** 0.5) / 2)
        b = max(1, min(b, fit, length - s))
        if 0 < length - s - b <= b // 4 and (length - s) * (before + length - s) <= budget:
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
    window: int | None = None,
) -> TreeAttentionPlan:
    """Group one micro-batch's nodes into batched attention calls. Loops over nodes once, on the host.

    Node m owns query rows ``[node_query_start[m], + node_length[m])`` and key rows
    ``[node_key_start[m], + node_length[m])``; ``node_ancestor_keys[m]`` lists the key rows of all
    tokens on its ancestor nodes in path order (the whole path from the root, so that a key's place
    in it is its path position). Nodes must cover the query rows exactly once.
    ``max_group_tokens`` bounds one call's G * max(Lq, 64) * Lk score elements per head (default
    2**24); a single query block whose key row alone exceeds it still runs, one query at a time.
    ``window``: each token sees only the last ``window`` tokens of its path (module docstring);
    the plan's :meth:`~TreeAttentionPlan.windowed` gives the same for an existing plan.
    """
    budget = int(max_group_tokens or _DEFAULT_GROUP_TOKENS)
    if budget < 1:
        raise ValueError(f"max_group_tokens must be positive, got {max_group_tokens}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding window must be a positive integer, got {window!r}")
    qs, ln, ks, anc = _check_nodes(node_query_start, node_length, node_key_start, node_ancestor_keys,
                                   num_queries, num_keys)
    return _plan(qs, ln, ks, anc, num_queries, num_keys, torch.device(device or "cpu"), budget, window)


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


def _shared_prefixes(qs, ln, anc, budget: int) -> tuple[list[SharedPrefix], list[np.ndarray]]:
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
            node_blocks[m] = len(_query_blocks(anc[m].size, int(ln[m]), budget))
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


def _plan(qs, ln, ks, anc, num_queries: int, num_keys: int, device, budget: int, window: int | None,
          split: bool = True):
    """:func:`plan_tree_attention` on checked host arrays; ``split``: with shared prefixes (never
    with a window)."""
    max_path = int(max((a.size + int(l_) for a, l_ in zip(anc, ln, strict=True)), default=0))
    if window is not None and window >= max_path:
        window = None  # the window covers every path: plain attention
    full = anc
    prefixes, anc = _shared_prefixes(qs, ln, anc, budget) if split and window is None else ([], anc)
    # Blocks: (node, own offset s, queries b, first key column k0); keys are the path's columns
    # k0 .. a + s + b - 1 (ancestors and own keys up to the block's end; with a window, from the
    # first one the block's first query sees).
    blocks = [(m, s, b, 0 if window is None else max(0, anc[m].size + s - window + 1))
              for m in range(qs.size) for s, b in _query_blocks(anc[m].size, int(ln[m]), budget, window)]
    lq = np.array([b for _, _, b, _ in blocks], dtype=np.int64)
    lk = np.array([anc[m].size + s + b - k0 for m, s, b, k0 in blocks], dtype=np.int64)
    # Queries with one key get groups of their own (tree_attention runs them exactly), apart from
    # those that shared prefixes also reach (their partial results merge): kind 0, 1 and 2.
    reached = np.array([anc[m].size < full[m].size for m, _, _, _ in blocks], dtype=bool)
    kind = np.where(lk == 1, np.where(reached, 2, 1), 0)
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
    spans.sort(key=lambda sp: bool((lk[order[sp[0]:sp[1]]] < sp[3]).any()))

    groups = [AttentionGroup(g1 - g0, int(g_lq), int(g_lk), bool((lk[order[g0:g1]] < g_lk).any()))
              for g0, g1, g_lq, g_lk in spans]  # fmt: skip
    q_all, k_all, row_base, row_stride, row_offset = _fill_groups(
        spans, order, np.asarray(blocks, dtype=np.int64).reshape(-1, 4), qs, ks, anc, num_queries, num_keys)
    padded = sum(g.size * g.lq * g.lk for g in groups)
    padded += sum((p.q1 - p.q0) * (p.k1 - p.k0) for p in prefixes)
    if window is None:  # a block's full path: its ancestors' keys, shared prefixes included
        lk_full = np.array([full[m].size + s + b for m, s, b, _ in blocks], dtype=np.int64)
        exact = int((lq * (lk_full - lq) + lq * (lq + 1) // 2).sum())
    else:  # query at path position p sees min(p + 1, W) keys; a block's queries sit at a + s .. + b - 1
        first = np.array([anc[m].size + s for m, s, _, _ in blocks], dtype=np.int64) + 1
        ramp = np.clip(window - first, 0, lq)  # queries still below the window's full width
        exact = int((ramp * first + ramp * (ramp - 1) // 2 + (lq - ramp) * window).sum())
    return TreeAttentionPlan(num_queries, num_keys, groups, *(torch.from_numpy(x).to(device)
                             for x in (q_all, k_all, row_base, row_stride, row_offset)), exact, padded,
                             window, max_path, tuple(prefixes), ((qs, ln, ks, full), budget, not split))


def _fill_groups(spans, order, blocks, qs, ks, anc, num_queries: int, num_keys: int):
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


def plan_reference_mask(
    node_query_start: torch.Tensor,
    node_length: torch.Tensor,
    node_key_start: torch.Tensor,
    node_ancestor_keys: list[torch.Tensor],
    num_queries: int,
    num_keys: int,
    device=None,
    max_group_tokens: int | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """[n, m] bool: the keys each query may see, built densely node by node (tests only); with
    ``window``, only the last ``window`` tokens of each query's path."""
    qs, ln, ks, anc = _check_nodes(node_query_start, node_length, node_key_start, node_ancestor_keys,
                                   num_queries, num_keys)
    mask = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    for m in range(qs.size):
        q0, k0, length = int(qs[m]), int(ks[m]), int(ln[m])
        path = torch.cat([torch.from_numpy(anc[m]), torch.arange(k0, k0 + length)])
        for i in range(length):  # query i of the node sits at path position a + i
            p = anc[m].size + i
            lo = 0 if window is None else max(0, p - window + 1)
            mask[q0 + i, path[lo: p + 1]] = True
    return mask.to(device or "cpu")
