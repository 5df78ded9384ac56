"""The packed chunk plan: chunks of C tokens that hold the tokens of several nodes.

The chunk tree (:mod:`harts.plan.chunk_tree`) pads every node to whole chunks, which on forests
of short nodes costs many padded slots and forces small chunks. This plan instead cuts the
forest's unique tokens, in their stored order (parents before children, nodes in pre-order), into
chunks of ``chunk_size`` tokens regardless of node boundaries: a chunk may hold a node's tail,
its children's heads, several small sibling subtrees. Only the last chunk is padded.

Inside a chunk each token t enters from one state: the state after its nearest ancestor token
outside the chunk (its *entry*: an earlier chunk's emitted state, or a root's initial state), and
sees its in-chunk ancestors through the ancestor mask. The masked WY form (the causal chunk form
with the causal mask replaced by the ancestor mask and the cumulative log-gate sum by the path
sum from the entry) is then exact per token.

A chunk must *emit* the state after a token when a later chunk's token enters from it (a node
that ends inside the chunk with children in later chunks, or a node that continues into the next
chunk) and at every node's last token (the executor hands node states to later micro-batches, and
the recurrence contract returns every node's final state). Each emitted state is an affine map of
its token's entry state (S_p = T_p S_entry + D_p); the emits form a DAG (each reads one earlier
emit or a root) whose depth levels run the state recurrence one level per step, as the chunk
tree's levels do.

Tokens of a chunk that share an entry form a *group* (in pre-order a contiguous run of the
chunk); a chunk has as many groups as distinct entries, and each group reads its entry state once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.forest import Forest
from harts.plan.linear_cost import PlanMode

__all__ = ["DEFAULT_PACKED_CHUNK", "PackedChunkPlan", "packed_chunk_plan"]

#: The chunk :func:`packed_chunk_plan` takes when none is given (measured, docs/benchmarks.md).
DEFAULT_PACKED_CHUNK = 16


@dataclass
class PackedChunkPlan:
    """N unique tokens in M chunks of C slots (token t in slot t of the flat [M * C] layout).

    - ``ancestors`` [M, C, C] bool: ``ancestors[m, a, b]``: slot b is a strict in-chunk ancestor of
      slot a (strictly lower triangular);
    - ``emit_token`` [P]: the tokens whose state is emitted, in token order; ``emit_source`` [P]:
      the row of its entry state in the states buffer [R + P] (rows 0..R-1 the roots' initial
      states, ``root_nodes[r]``'s; row R + p the state after ``emit_token[p]``); ``levels``: emit
      ids by depth in the emit DAG (each emit's source is in an earlier level);
    - ``group_chunk`` [G], ``group_source`` [G]: each group's chunk and entry row;
      ``slot_group`` [M, C]: the group of each slot (padded slots: their chunk's last group);
    - ``node_state_row`` [nodes]: the states-buffer row of each node's final state.
    """

    chunk_size: int
    ancestors: torch.Tensor
    emit_token: torch.Tensor
    emit_source: torch.Tensor
    levels: list[torch.Tensor]
    group_chunk: torch.Tensor
    group_source: torch.Tensor
    slot_group: torch.Tensor
    root_nodes: list[int]
    node_state_row: torch.Tensor
    num_tokens: int

    @property
    def num_chunks(self) -> int:
        return int(self.ancestors.shape[0])

    @property
    def num_groups(self) -> int:
        return int(self.group_chunk.shape[0])

    @property
    def num_emits(self) -> int:
        return int(self.emit_token.shape[0])

    @property
    def num_calls(self) -> int:
        return 1

    @property
    def mode(self) -> PlanMode:
        return PlanMode.PACKED

    @property
    def scan_steps(self) -> int:
        """Sequential steps of the state recurrence: the emit DAG's depth."""
        return len(self.levels)

    @property
    def padded_tokens(self) -> int:
        return self.num_chunks * self.chunk_size - self.num_tokens

    def to(self, device) -> PackedChunkPlan:
        t = lambda x: x.to(device)  # noqa: E731
        return PackedChunkPlan(
            self.chunk_size,
            t(self.ancestors),
            t(self.emit_token),
            t(self.emit_source),
            [t(lv) for lv in self.levels],
            t(self.group_chunk),
            t(self.group_source),
            t(self.slot_group),
            self.root_nodes,
            t(self.node_state_row),
            self.num_tokens,
        )


def _hops_to_root(up: np.ndarray) -> np.ndarray:
    """Steps from each element to the top of its chain (``up`` -1 at a top), by pointer jumping."""
    hops = (up >= 0).astype(np.int64)
    up = up.copy()
    while (up >= 0).any():
        live = np.flatnonzero(up >= 0)
        hops[live] += hops[up[live]]  # right side read before any write: one synchronous round
        up[live] = up[up[live]]
    return hops


def _in_chunk_ancestors(parent_slot: np.ndarray, m: int, c: int) -> np.ndarray:
    """[m, c, c] bool: slot ``b`` of a chunk is an ancestor of slot ``a`` within it. ``parent_slot``
    [n]: each token's parent's slot in its chunk (-1: none there). One slot at a time over every
    chunk: a parent's row is complete before its children's (parents first)."""
    slots = np.full(m * c, -1, dtype=np.int64)
    slots[: parent_slot.size] = parent_slot
    slots = slots.reshape(m, c)
    anc = np.zeros((m, c, c), dtype=bool)
    chunks = np.arange(m)
    for a in range(1, c):
        ps = slots[:, a]
        has = ps >= 0
        anc[chunks[has], a] = anc[chunks[has], ps[has]]
        anc[chunks[has], a, ps[has]] = True
    return anc


def _entry_groups(row: np.ndarray, m: int, c: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tokens of a chunk that share an entry row form a group: (each group's chunk, its entry
    row, each slot's group); ``rows``: more than any row index. Padded slots join the last group."""
    n = row.size
    slot_row = np.full(m * c, -1, dtype=np.int64)
    slot_row[:n] = row
    slot_row[n:] = row[n - 1] if n else 0
    key = (np.arange(m * c) // c) * rows + slot_row
    uniq, slot_group = np.unique(key, return_inverse=True)
    return uniq // rows, uniq % rows, slot_group


def packed_chunk_plan(forest: Forest, chunk_size: int | None = None) -> PackedChunkPlan:
    """The packed chunks of ``forest`` (nodes stored parents first) at ``chunk_size`` (a power of
    two; default :data:`DEFAULT_PACKED_CHUNK`)."""
    c = chunk_size or DEFAULT_PACKED_CHUNK
    if c < 1 or c & (c - 1):
        raise ValueError(f"chunk_size must be a power of two, got {c}")
    lengths = forest.node_length.numpy().astype(np.int64)
    starts = forest.node_start.numpy().astype(np.int64)
    parent = forest.node_parent.numpy().astype(np.int64)
    n_nodes, n = lengths.size, int(lengths.sum())
    m = max(1, -(-n // c))
    roots = np.flatnonzero(parent < 0)
    root_of = np.empty(n_nodes, dtype=np.int64)  # root index r of each node's tree
    for v in range(n_nodes):  # parents first
        root_of[v] = np.searchsorted(roots, v) if parent[v] < 0 else root_of[parent[v]]
    r = roots.size

    # The token each token continues from (-1 at a root's first token): the previous token of its
    # node, or its parent node's last token (-1 again when that parent is empty: walk up).
    node_end = starts + lengths - 1
    node_of = np.repeat(np.arange(n_nodes), lengths)
    entered = np.full(n_nodes, -1, dtype=np.int64)  # token a node's first token continues from
    for v in range(n_nodes):
        p = parent[v]
        if p >= 0:
            entered[v] = node_end[p] if lengths[p] else entered[p]
    tok = np.arange(n)
    prev = np.where(tok == starts[node_of], entered[node_of], tok - 1)
    in_chunk = (prev >= 0) & (prev // c == tok // c)

    # Each token's entry: the token its in-chunk top ancestor continues from (or its root).
    top = np.where(in_chunk, prev, tok)
    while True:  # pointer jumping: log2(C) rounds
        nxt = top[top]
        if np.array_equal(nxt, top):
            break
        top = nxt
    entry_token = prev[top]  # -1: the root's initial state
    emit_token = np.unique(np.concatenate([entry_token[entry_token >= 0], node_end[lengths > 0]]))
    emit_index = np.full(n, -1, dtype=np.int64)
    emit_index[emit_token] = np.arange(emit_token.size)
    row = np.where(entry_token >= 0, r + emit_index[np.maximum(entry_token, 0)], root_of[node_of])
    emit_source = row[emit_token]
    depth = _hops_to_root(np.where(emit_source >= r, emit_source - r, -1))
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(depth.max() + 2 if depth.size else 1))
    levels = [torch.as_tensor(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]

    anc = _in_chunk_ancestors(np.where(in_chunk, prev % c, -1), m, c)
    group_chunk, group_source, slot_group = _entry_groups(row, m, c, r + emit_token.size + 1)

    node_state_row = np.where(lengths > 0, r + emit_index[np.maximum(node_end, 0)], -1)
    for v in np.flatnonzero(lengths == 0):  # an empty node ends where it starts
        e = entered[v]
        node_state_row[v] = r + emit_index[e] if e >= 0 else root_of[v]
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long)  # noqa: E731
    return PackedChunkPlan(
        c,
        torch.as_tensor(anc),
        t(emit_token),
        t(emit_source),
        levels,
        t(group_chunk),
        t(group_source),
        t(slot_group.reshape(m, c)),
        roots.tolist(),
        t(node_state_row),
        n,
    )
