"""Execution plans for linear-attention layers over a forest.

A linear-attention layer has one sequential dependency in a tree: a node's recurrence starts
from its parent's final state. A *call* runs a batch of segments, each from its own initial
state, right-padded to the longest segment (padding is neutral: k = v = 0, beta = 0, g = 0
leave the state unchanged). A plan is a list of calls in which every segment's initial state is
produced by an earlier call.

- ``depth_wave_plan``: one call per tree depth, each node its own segment. Simple and always
  valid; its number of calls is the forest's depth plus one.
- ``chain_plan``: a segment runs a chain of nodes (a parent continues into its "heavy" child) and
  the kernel also emits the states at the node boundaries inside the segment. The fewest calls
  then follow from one post-order pass (:func:`min_calls`, the Horton-Strahler order), at most
  log2(leaves) + 1 against the depth plus one of the depth plan. With a call budget K, chains
  continue only where the budget forces them: plans between the two extremes.
- ``plan_linear``: depth, fewest-calls chain, the one-call chunk tree
  (:mod:`harts.plan.chunk_tree`), or for ``"auto"`` the plan that :class:`LinearCostModel`
  (:mod:`harts.plan.linear_cost`) says is cheapest among depth, fewest-calls, every budget
  between, and the chunk tree. Fewer calls are not always faster: a chain segment pads every other
  segment of its call to its own length, and its chunk steps run one after the other; the chunk
  tree has no per-call cost but pads every node to whole chunks, so it wins on forests of many
  short nodes and loses on long flat segments.

What this leaves out: placing a chain later than its parent allows (it always starts one call
after its parent's chain), and packing several short segments into one row of a call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from harts.forest import Forest
from harts.plan.chunk_tree import ChunkTreePlan, choose_chunk, chunk_tree_plan
from harts.plan.linear_cost import LinearCostModel, PlanMode
from harts.plan.packed_chunks import PackedChunkPlan, packed_chunk_plan

__all__ = [
    "LinearCall",
    "LinearPlan",
    "chain_plan",
    "depth_wave_plan",
    "min_calls",
    "plan_linear",
    "bucket_by_length",
    "choose_chunks",
]


@dataclass
class LinearCall:
    """One batched recurrence call over W segments of at most T tokens.

    - ``token_index`` [W, T]: unique-token index of each slot (0 where padded);
    - ``lengths`` [W]: true segment lengths;
    - ``init_node`` list[W]: node whose final state starts the segment, -1 for a root (zeros, or
      a state handed over from an earlier micro-batch);
    - ``start_node`` list[W]: first node of each segment;
    - ``end_node`` list[W]: last node of each segment, whose final state the segment ends with;
    - ``boundary_nodes`` list[W] of lists: the nodes of each segment before ``end_node``, in path
      order (empty for one-node segments); their final states are emitted inside the segment;
    - ``boundary_offsets`` [W, S]: token count within the segment at which each boundary node
      ends (S = the most boundary nodes of any segment; unused columns hold the segment length);
    - ``chunk_size``: the kernel's chunk for this call (short calls use short chunks, so a call
      of 20-token segments is not padded to 64).
    """

    token_index: torch.Tensor
    lengths: torch.Tensor
    init_node: list[int]
    start_node: list[int]
    end_node: list[int]
    boundary_nodes: list[list[int]] = field(default=None)  # type: ignore[assignment]
    boundary_offsets: torch.Tensor = field(default=None)  # type: ignore[assignment]
    chunk_size: int = 64

    def __post_init__(self):
        if self.boundary_nodes is None:
            self.boundary_nodes = [[] for _ in self.start_node]
        if self.boundary_offsets is None:
            self.boundary_offsets = torch.zeros(len(self.start_node), 0, dtype=torch.long)

    @property
    def valid(self) -> torch.Tensor:
        t = self.token_index.shape[1]
        return torch.arange(t, device=self.lengths.device)[None, :] < self.lengths[:, None]

    @property
    def padded_tokens(self) -> int:
        """Padding slots: W x T minus the real tokens."""
        return int(self.token_index.numel() - self.lengths.sum())

    @property
    def num_boundaries(self) -> int:
        """S: columns of ``boundary_offsets`` (inner node boundaries of the longest chain)."""
        return int(self.boundary_offsets.shape[1])

    def to(self, device) -> LinearCall:
        return LinearCall(
            self.token_index.to(device),
            self.lengths.to(device),
            self.init_node,
            self.start_node,
            self.end_node,
            self.boundary_nodes,
            self.boundary_offsets.to(device),
            self.chunk_size,
        )

    def rows(self, keep: torch.Tensor, chunk_size: int) -> LinearCall:
        """The sub-call of the segments ``keep`` [W'], trimmed to their longest length."""
        lengths = self.lengths[keep]
        t = int(lengths.max())
        idx = keep.tolist()
        return LinearCall(
            self.token_index[keep, :t],
            lengths,
            [self.init_node[i] for i in idx],
            [self.start_node[i] for i in idx],
            [self.end_node[i] for i in idx],
            [self.boundary_nodes[i] for i in idx],
            self.boundary_offsets[keep],
            chunk_size,
        )


@dataclass
class LinearPlan:
    """Calls in run order; ``mode`` names the planner that made them (never AUTO)."""

    calls: list[LinearCall]
    num_tokens: int
    mode: PlanMode = PlanMode.DEPTH

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def padded_tokens(self) -> int:
        """Padding slots over all calls (sum of W x T_max minus real tokens)."""
        return sum(c.padded_tokens for c in self.calls)

    @property
    def cost(self) -> float:
        """Estimated cost (microseconds) under the default :class:`LinearCostModel`."""
        return LinearCostModel().plan(self)

    def to(self, device) -> LinearPlan:
        return LinearPlan([c.to(device) for c in self.calls], self.num_tokens, self.mode)

    def output_order(self) -> torch.Tensor:
        """[N] position of each unique token in the concatenation of the calls' valid slots."""
        flat = torch.cat([c.token_index[c.valid] for c in self.calls])
        inverse = torch.empty_like(flat)
        inverse[flat] = torch.arange(flat.numel(), device=flat.device)
        return inverse


def depth_wave_plan(forest: Forest) -> LinearPlan:
    """One call per depth level; every node is a segment of its own."""
    depth = forest.node_depth
    calls = []
    for d in range(forest.max_depth + 1):
        nodes = (depth == d).nonzero().squeeze(1)
        lengths = forest.node_length[nodes]
        t = int(lengths.max())
        offsets = torch.arange(t)[None, :]
        index = forest.node_start[nodes][:, None] + offsets
        index = torch.where(offsets < lengths[:, None], index, 0)
        calls.append(
            LinearCall(
                token_index=index,
                lengths=lengths,
                init_node=forest.node_parent[nodes].tolist(),
                start_node=nodes.tolist(),
                end_node=nodes.tolist(),
            )
        )
    return LinearPlan(calls, forest.num_tokens, PlanMode.DEPTH)


def min_calls(forest: Forest) -> tuple[list[int], list[int]]:
    """Fewest calls per subtree and the heavy child of every node, from one post-order pass.

    f(leaf) = 1 and f(v) = max(f(c*), 1 + max over other children f(c)), with c* the child of
    largest f: v's chain continues into c* inside v's call, every other child starts a chain in a
    later call. This is the Horton-Strahler stream order (Horton 1945, Strahler 1952) up to its
    tie rule: two children of equal top order raise the parent's order by one, so
    f <= log2(leaves) + 1. Ties between children of equal f go to the longer heavy path in tokens,
    so the long path stays in one segment of the early calls, where it pads the fewest others.

    Returns (f [M], heavy [M], -1 for leaves). Nodes are stored parents first, so a reverse scan
    sees every child before its parent.
    """
    m = forest.num_nodes
    parent = forest.node_parent.tolist()
    length = forest.node_length.tolist()
    f = [1] * m
    heavy = [-1] * m
    path = [0] * m  # tokens along the heavy path from the node down to its leaf
    second = [0] * m  # largest f among the children other than heavy
    for v in range(m - 1, -1, -1):
        h = heavy[v]
        if h >= 0:
            f[v] = max(f[h], second[v] + 1)
            path[v] = length[v] + path[h]
        else:
            path[v] = length[v]
        p = parent[v]
        if p < 0:
            continue
        hp = heavy[p]
        if hp < 0:
            heavy[p] = v
        elif (f[v], path[v]) > (f[hp], path[hp]):
            second[p] = max(second[p], f[hp])
            heavy[p] = v
        else:
            second[p] = max(second[p], f[v])
    return f, heavy


def chain_plan(forest: Forest, max_calls: int | None = None) -> LinearPlan:
    """Segments are heavy-child chains; every chain starts one call after its parent's chain.

    ``max_calls=None``: the fewest calls, max over roots of f(root) (:func:`min_calls`); every
    node continues into its heavy child, so segments are as long as they can be.
    ``max_calls=K`` (K >= the fewest): at most K calls, and a node continues into its heavy child
    only where the budget forces it (the child's f equals the calls left to the node), so
    segments stay as short, and calls as evenly padded, as K allows; K = depth + 1 cuts every
    chain (the depth plan's segments). :func:`plan_linear` searches over K with the cost model.
    """
    f, heavy = min_calls(forest)
    chains, chain_call = _chains(forest, f, heavy, max_calls)
    parent = forest.node_parent.tolist()
    by_call: list[list[list[int]]] = [[] for _ in range(max(chain_call) + 1)]
    for nodes, c in zip(chains, chain_call, strict=True):
        by_call[c].append(nodes)
    starts, lengths = forest.node_start.numpy(), forest.node_length.numpy()
    calls = [_chain_call(segs, parent, starts, lengths) for segs in by_call]
    return LinearPlan(calls, forest.num_tokens, PlanMode.CHAIN)


def _chains(
    forest: Forest, f: list[int], heavy: list[int], max_calls: int | None
) -> tuple[list[list[int]], list[int]]:
    """Chains (node lists in path order) and the call of each, in one top-down pass.

    A node continues its parent's chain (same call, same budget) when it is the parent's heavy
    child and either there is no budget (fewest calls) or the budget forces it; any other child
    starts a chain in the next call with one call less to spend. Children never need more than
    they get: a non-heavy child has f <= f(parent) - 1 <= budget - 1.
    """
    parent = forest.node_parent.tolist()
    m = forest.num_nodes
    roots = [r for r in range(m) if parent[r] < 0]
    fewest = max(f[r] for r in roots)
    if max_calls is not None and max_calls < fewest:
        raise ValueError(f"max_calls={max_calls} is below the fewest calls this forest needs ({fewest})")
    budget = [max_calls or fewest] * m
    chain_of = list(range(m))
    call_of = [0] * m
    chains: list[list[int]] = []
    chain_call: list[int] = []
    for v in range(m):  # parents first
        p = parent[v]
        if p >= 0 and heavy[p] == v and (max_calls is None or f[v] >= budget[p]):
            chain_of[v], call_of[v], budget[v] = chain_of[p], call_of[p], budget[p]
            chains[chain_of[v]].append(v)
            continue
        if p >= 0:
            call_of[v], budget[v] = call_of[p] + 1, budget[p] - 1
        chain_of[v] = len(chains)
        chains.append([v])
        chain_call.append(call_of[v])
    return chains, chain_call


def _call_segments(
    chains: list[list[int]], chain_call: list[int], lengths: list[int]
) -> list[tuple[np.ndarray, int]]:
    """(segment lengths, S) of each call of a chain assignment: what costing a call and its length
    buckets needs, without building index tensors."""
    segments: dict[int, list[int]] = {}
    inner: dict[int, int] = {}  # the most inner node boundaries of any segment of the call
    for nodes, c in zip(chains, chain_call, strict=True):
        segments.setdefault(c, []).append(sum(lengths[v] for v in nodes))
        inner[c] = max(inner.get(c, 0), len(nodes) - 1)
    return [(np.asarray(segments[c], dtype=np.int64), inner[c]) for c in sorted(segments)]


def _unsplit_cost(calls: list[tuple[np.ndarray, int]], model: LinearCostModel) -> float:
    """Cost of calls as they are: W segments padded to the longest, each at its best chunk."""
    return sum(model.shape(seg.size, int(seg.max()), s) for seg, s in calls)


def _length_buckets(lengths: np.ndarray, max_chunk: int) -> list[np.ndarray]:
    """Indices of a call's segments per length bucket (ascending keys): powers of two up to
    ``max_chunk``, then whole multiples of it."""
    small = np.array([1 << max(0, int(x) - 1).bit_length() for x in lengths.tolist()], dtype=np.int64)
    key = np.where(lengths <= max_chunk, small, max_chunk * -(-lengths // max_chunk))
    return [np.flatnonzero(key == k) for k in np.unique(key)]


def _bucketed(lengths: np.ndarray, s: int, model: LinearCostModel) -> tuple[float, list[np.ndarray] | None]:
    """A call's cost after :func:`bucket_by_length`, and its buckets where splitting pays (else
    None). A sub-call keeps the call's S boundary columns."""
    whole = model.shape(lengths.size, int(lengths.max()), s)
    buckets = _length_buckets(lengths, model.max_chunk)
    if len(buckets) > 1:
        split = sum(model.shape(b.size, int(lengths[b].max()), s) for b in buckets)
        if split < whole:
            return split, buckets
    return whole, None


def _chain_call(
    segs: list[list[int]], parent: list[int], starts: np.ndarray, lengths: np.ndarray
) -> LinearCall:
    """Gather W chains into one right-padded call, with their inner boundary offsets."""
    nodes = np.asarray([v for seg in segs for v in seg], dtype=np.int64)
    seg_of = np.repeat(np.arange(len(segs)), [len(s) for s in segs])
    node_len = lengths[nodes]
    seg_len = np.bincount(seg_of, weights=node_len, minlength=len(segs)).astype(np.int64)
    # Offset of each node inside its segment: inclusive cumsum, minus the segment's earlier total.
    ends = np.cumsum(node_len)
    seg_base = np.cumsum(seg_len) - seg_len
    node_end = ends - seg_base[seg_of]  # token count at the node's end, inside its segment
    t = int(seg_len.max())
    index = np.zeros((len(segs), t), dtype=np.int64)
    tok_seg = np.repeat(seg_of, node_len)
    tok_pos = np.arange(int(node_len.sum())) - np.repeat(seg_base[seg_of], node_len)
    index[tok_seg, tok_pos] = (
        np.arange(int(node_len.sum()))
        - np.repeat(ends - node_len, node_len)
        + np.repeat(starts[nodes], node_len)
    )
    s = max(len(seg) for seg in segs) - 1
    offsets = np.repeat(seg_len[:, None], s, axis=1)
    boundary_nodes = [seg[:-1] for seg in segs]
    pos = 0
    for w, seg in enumerate(segs):
        offsets[w, : len(seg) - 1] = node_end[pos : pos + len(seg) - 1]
        pos += len(seg)
    return LinearCall(
        token_index=torch.from_numpy(index),
        lengths=torch.from_numpy(seg_len),
        init_node=[parent[seg[0]] for seg in segs],
        start_node=[seg[0] for seg in segs],
        end_node=[seg[-1] for seg in segs],
        boundary_nodes=boundary_nodes,
        boundary_offsets=torch.from_numpy(offsets),
    )


def plan_linear(
    forest: Forest,
    mode: PlanMode | str = PlanMode.AUTO,
    cost_model: LinearCostModel | None = None,
    bucket: bool = True,
) -> LinearPlan | ChunkTreePlan | PackedChunkPlan:
    """The linear-attention plan of ``mode``; for AUTO, the cheapest under ``cost_model``.

    AUTO costs, from call shapes alone (no gathers), the depth plan, the fewest-calls chain plan,
    and the budgeted chain plans for every budget between the fewest calls and the depth (each
    one O(nodes)), and builds the cheapest; ties go to fewer calls. With cheap calls (CPU) that is
    usually the least padded plan; with dear calls (GPU launches) the one with fewest calls.
    ``bucket`` then splits calls by segment length where that is cheaper (:func:`bucket_by_length`).
    Last, unless ``cost_model.consider_chunk_tree`` is off, the chunk tree at its cheapest chunk
    replaces that plan when its estimate is below ``cost_model.chunk_tree_margin`` times the plan's.
    """
    try:
        mode = PlanMode(mode)
    except ValueError:
        raise ValueError(
            f"unknown plan mode {mode!r}; expected one of {[m.value for m in PlanMode]}"
        ) from None
    model = cost_model or LinearCostModel()
    finish = (lambda p: bucket_by_length(p, model)) if bucket else (lambda p: choose_chunks(p, model))
    if mode is PlanMode.DEPTH:
        return finish(depth_wave_plan(forest))
    if mode is PlanMode.CHAIN:
        return finish(chain_plan(forest))
    if mode is PlanMode.TREE:
        return chunk_tree_plan(forest, cost_model=model)
    if mode is PlanMode.PACKED:
        return packed_chunk_plan(forest)
    f, heavy = min_calls(forest)
    lengths = forest.node_length.tolist()
    roots = (forest.node_parent < 0).nonzero().squeeze(1).tolist()
    # Every candidate is costed from its calls' segment lengths alone; only the winner is built.
    one_node_chains = [[v] for v in range(forest.num_nodes)]
    depth_calls = _call_segments(one_node_chains, forest.node_depth.tolist(), lengths)
    candidates = [(PlanMode.DEPTH, None, depth_calls)]  # budget None with CHAIN: the fewest calls
    for budget in [None, *range(max(f[r] for r in roots), forest.max_depth + 1)]:
        chains = _chains(forest, f, heavy, budget)
        candidates.append((PlanMode.CHAIN, budget, _call_segments(*chains, lengths)))
    best, budget, calls = min(candidates, key=lambda c: (_unsplit_cost(c[2], model), len(c[2])))

    def finished(cs: list[tuple[np.ndarray, int]]) -> float:
        return sum(_bucketed(seg, s, model)[0] for seg, s in cs) if bucket else _unsplit_cost(cs, model)

    cost = finished(calls)
    if bucket and best is not PlanMode.DEPTH:
        # Splitting by length helps one-node segments most: the bucketed depth plan can win.
        depth_cost = finished(depth_calls)
        if depth_cost < cost:
            best, cost = PlanMode.DEPTH, depth_cost
    if model.consider_chunk_tree:
        chunk, tree_cost = choose_chunk(forest, model)
        if tree_cost < model.chunk_tree_margin * cost:
            return chunk_tree_plan(forest, chunk)
    return finish(depth_wave_plan(forest) if best is PlanMode.DEPTH else chain_plan(forest, max_calls=budget))


def _with_best_chunk(call: LinearCall, keep: torch.Tensor, model: LinearCostModel) -> LinearCall:
    """The sub-call of the segments ``keep``, with the chunk the cost model prefers for it."""
    w, t = int(keep.numel()), int(call.lengths[keep].max())
    return call.rows(keep, model.chunk_for(w, t, call.num_boundaries))


def choose_chunks(plan: LinearPlan, cost_model: LinearCostModel | None = None) -> LinearPlan:
    """The same calls, each with the chunk the cost model prefers for its shape."""
    model = cost_model or LinearCostModel()
    calls = [
        _with_best_chunk(c, torch.arange(c.token_index.shape[0], device=c.lengths.device), model)
        for c in plan.calls
    ]
    return LinearPlan(calls, plan.num_tokens, plan.mode)


def bucket_by_length(plan: LinearPlan, cost_model: LinearCostModel | None = None) -> LinearPlan:
    """Split each call into calls of similar segment lengths where the cost model says it pays.

    Segments of one call never depend on each other, so any split of a call into consecutive
    calls keeps the plan valid. Buckets are powers of two up to the largest chunk, then whole
    largest chunks; every call, split or not, gets the chunk the cost model prefers for its shape.
    A call is split only when the sum of its buckets' costs (each paying ``call_cost``) is below
    its own.
    """
    model = cost_model or LinearCostModel()
    calls = []
    for call in plan.calls:
        lengths = call.lengths.cpu().numpy()
        _, buckets = _bucketed(lengths, call.num_boundaries, model)
        keeps = [torch.from_numpy(b) for b in buckets] if buckets else [torch.arange(lengths.size)]
        calls.extend(_with_best_chunk(call, keep.to(call.lengths.device), model) for keep in keeps)
    return LinearPlan(calls, plan.num_tokens, plan.mode)
