"""Grouped tree-attention plans: which query blocks attend to which gathered keys, in which call.

Each node's queries, split into query blocks, attend to [ancestor keys ; own keys], gathered by
index; blocks of similar shape are padded into a few batched SDPA calls (how blocks are cut and
grouped: :mod:`harts.plan.attention_blocks`). Cost is about the exact cost, the sum of path
positions, plus bounded waste (causal triangles of the blocks and padding).
The key space may be larger than the query space (keys of ancestors computed in an earlier
micro-batch). :func:`plan_reference_mask` is the plain dense mask of the same visibility, used by
the tests. The op that runs a plan is :func:`harts.ops.tree_attention.tree_attention`.

Sliding windows run along paths: with window W a token at path position p sees the keys at path
positions p - W + 1 .. p of its own path (transformers' ``kv_idx > q_idx - sliding_window``). A
node's ancestor key list is its whole path from the root, so a key's column in a block's list is
its path position; a windowed plan (:meth:`TreeAttentionPlan.windowed`) gathers only the last
W - 1 + b keys of a block of b queries, and the block's rule becomes a bottom-right band of width
W, the same for every block of a group because keys and queries are right-aligned.

Shared prefixes (:mod:`harts.plan.attention_prefixes`): long runs of ancestor keys, a shared prompt
or the context above a cut part, run as calls of their own (a :class:`SharedPrefix`), and the blocks
gather only the rest of their paths. :meth:`TreeAttentionPlan.whole` is the plan without them, for
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

from harts.plan.attention_blocks import AttentionGroup, fill_groups, group_blocks, query_blocks
from harts.plan.attention_prefixes import SharedPrefix, shared_prefixes

__all__ = [
    "AttentionGroup",
    "SharedPrefix",
    "TreeAttentionPlan",
    "plan_tree_attention",
    "plan_reference_mask",
]

_DEFAULT_GROUP_TOKENS = 1 << 24
# Dense plans (module docstring): n * m score elements against the groups' padded cost plus, per call
# (groups and prefixes), this many score elements times query heads times channels (45,000 at 4 x 32);
# at most this many [n, m] elements (the mask holds r times as many).
_DENSE_CALL_WORK = 45_000 * 4 * 32
_DENSE_MAX_ELEMENTS = 1 << 21


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
            self._cache["whole"] = _plan(
                *nodes, self.num_queries, self.num_keys, self.key_index.device, budget, None, split=False
            )
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
            self._cache[key] = _plan(
                *nodes, self.num_queries, self.num_keys, self.key_index.device, budget, window, split=False
            )
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
                i
                for i, (g, rows) in enumerate(zip(self.groups, parts, strict=True))
                if g.lk == 1 and not reached[rows].any()
            )
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
            heads * width
        )

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
                sees[q0 : q0 + length, a] = True
                sees[q0 : q0 + length, k0 : k0 + length] = own[:length, :length]
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
            self._cache["lone_queries"] = (
                torch.from_numpy(qs[roots]).to(device),
                torch.from_numpy(ks[roots]).to(device),
            )
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
            rows = torch.cat(
                [
                    (p.view(g.size, 1, g.lq) + heads[:, None] * n).reshape(-1)
                    for p, g in zip(parts, self.groups, strict=True)
                ]
            )
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
        raise ValueError(
            f"node_query_start, node_length, node_key_start must have one shape [M], got "
            f"{qs.shape}, {ln.shape}, {ks.shape}"
        )
    if len(node_ancestor_keys) != qs.size:
        got = len(node_ancestor_keys)
        raise ValueError(f"expected {qs.size} ancestor key tensors (one per node), got {got}")
    if qs.size and (
        ln.min() < 1
        or qs.min() < 0
        or ks.min() < 0
        or (qs + ln).max() > num_queries
        or (ks + ln).max() > num_keys
    ):
        raise ValueError(
            f"node ranges fall outside [0, {num_queries}) queries / [0, {num_keys}) keys or a node is empty"
        )
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
    qs, ln, ks, anc = _check_nodes(
        node_query_start, node_length, node_key_start, node_ancestor_keys, num_queries, num_keys
    )
    return _plan(qs, ln, ks, anc, num_queries, num_keys, torch.device(device or "cpu"), budget, window)


def _plan(
    qs,
    ln,
    ks,
    anc,
    num_queries: int,
    num_keys: int,
    device,
    budget: int,
    window: int | None,
    split: bool = True,
):
    """:func:`plan_tree_attention` on checked host arrays; ``split``: with shared prefixes (never
    with a window)."""
    max_path = int(max((a.size + int(l_) for a, l_ in zip(anc, ln, strict=True)), default=0))
    if window is not None and window >= max_path:
        window = None  # the window covers every path: plain attention
    full = anc
    prefixes, anc = shared_prefixes(qs, ln, anc, budget) if split and window is None else ([], anc)
    # Blocks: (node, own offset s, queries b, first key column k0); keys are the path's columns
    # k0 .. a + s + b - 1 (ancestors and own keys up to the block's end; with a window, from the
    # first one the block's first query sees).
    blocks = [
        (m, s, b, 0 if window is None else max(0, anc[m].size + s - window + 1))
        for m in range(qs.size)
        for s, b in query_blocks(anc[m].size, int(ln[m]), budget, window)
    ]
    lq = np.array([b for _, _, b, _ in blocks], dtype=np.int64)
    lk = np.array([anc[m].size + s + b - k0 for m, s, b, k0 in blocks], dtype=np.int64)
    # Queries with one key get groups of their own (tree_attention runs them exactly), apart from
    # those that shared prefixes also reach (their partial results merge): kind 0, 1 and 2.
    reached = np.array([anc[m].size < full[m].size for m, _, _, _ in blocks], dtype=bool)
    kind = np.where(lk == 1, np.where(reached, 2, 1), 0)
    order, spans, groups = group_blocks(lq, lk, kind, budget)
    q_all, k_all, row_base, row_stride, row_offset = fill_groups(
        spans, order, np.asarray(blocks, dtype=np.int64).reshape(-1, 4), qs, ks, anc, num_queries, num_keys
    )
    padded = sum(g.size * g.lq * g.lk for g in groups)
    padded += sum((p.q1 - p.q0) * (p.k1 - p.k0) for p in prefixes)
    if window is None:  # a block's full path: its ancestors' keys, shared prefixes included
        lk_full = np.array([full[m].size + s + b for m, s, b, _ in blocks], dtype=np.int64)
        exact = int((lq * (lk_full - lq) + lq * (lq + 1) // 2).sum())
    else:  # query at path position p sees min(p + 1, W) keys; a block's queries sit at a + s .. + b - 1
        first = np.array([anc[m].size + s for m, s, _, _ in blocks], dtype=np.int64) + 1
        ramp = np.clip(window - first, 0, lq)  # queries still below the window's full width
        exact = int((ramp * first + ramp * (ramp - 1) // 2 + (lq - ramp) * window).sum())
    return TreeAttentionPlan(
        num_queries,
        num_keys,
        groups,
        *(torch.from_numpy(x).to(device) for x in (q_all, k_all, row_base, row_stride, row_offset)),
        exact,
        padded,
        window,
        max_path,
        tuple(prefixes),
        ((qs, ln, ks, full), budget, not split),
    )


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
    qs, ln, ks, anc = _check_nodes(
        node_query_start, node_length, node_key_start, node_ancestor_keys, num_queries, num_keys
    )
    mask = torch.zeros(num_queries, num_keys, dtype=torch.bool)
    for m in range(qs.size):
        q0, k0, length = int(qs[m]), int(ks[m]), int(ln[m])
        path = torch.cat([torch.from_numpy(anc[m]), torch.arange(k0, k0 + length)])
        for i in range(length):  # query i of the node sits at path position a + i
            p = anc[m].size + i
            lo = 0 if window is None else max(0, p - window + 1)
            mask[q0 + i, path[lo : p + 1]] = True
    return mask.to(device or "cpu")
