"""Micro-batch planning: pack whole trees under a token budget, cut larger trees at node boundaries.

A micro-batch (a *part*) is a set of forest nodes whose parents are either in the part or in an
earlier part. The forest is first refined so that no node is longer than the budget (a long
node becomes a chain of pieces: the same tokens, the same paths). A tree larger than the budget
has a *spine*: its nodes whose subtree exceeds the budget, a connected top of the tree (the
shared prefixes). Spines are cut into consecutive runs of their nodes in pre-order, as few as the
budget allows and of about equal size; pre-order makes every such run closed (a node's parent is
in the run or before it). Everything else is a whole tree or a subtree hanging off a spine that
fits the budget; these are packed whole, first-fit decreasing: whole trees first, a spine's
subtrees right after the spine run they hang off. So only spine parts are read by later parts: a
step that must hold or recompute what later parts read (:mod:`harts.runtime.backward`) does so for
the spines alone, and holds only the chain of spine runs above the running part.

For each part the plan records what crosses its boundary: the *external* tokens (tokens of
ancestors in earlier parts, whose keys/values and convolution inputs the part reads) and the
external parents of its roots (whose final linear-attention states start its segments); and, in
the other direction, which of its own tokens and nodes later parts read (its exports).

The budget counts a part's own tokens plus ``context_weight`` times the tokens on the paths above
its roots (the context it reads from earlier parts). A context token costs a
part only its handed-over keys/values and convolution inputs and their gradients, not a token's
activations: about a fifth of a token on the bailing_hybrid bench config (about 17 KB against
85 KB per token), hence the default of 0.25. A run always takes at least one node, so a part whose
single node sits below a very long context can exceed the budget by that context.

What this leaves out: activation-memory models per layer type (the budget is in tokens) and
balancing across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from harts.forest import Forest, concat_ranges, node_depth_and_subtree_end

__all__ = ["Part", "MicroBatchPlan", "split_long_nodes", "plan_micro_batches"]


def split_long_nodes(forest: Forest, max_length: int) -> Forest:
    """The same forest with every node longer than ``max_length`` cut into a chain of pieces.

    Tokens, token order, paths and trajectories are unchanged; only node boundaries are added,
    so every op gives the same result on the refined forest.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    lengths = forest.node_length.numpy()
    if lengths.max(initial=0) <= max_length:
        return forest
    pieces = -(-lengths // max_length)  # ceil
    first_piece = np.cumsum(pieces) - pieces  # new index of each old node's first piece
    new_count = int(pieces.sum())
    old_of_new = np.repeat(np.arange(lengths.size), pieces)
    piece_idx = np.arange(new_count) - first_piece[old_of_new]
    start = forest.node_start.numpy()[old_of_new] + piece_idx * max_length
    length = np.minimum(max_length, lengths[old_of_new] - piece_idx * max_length)
    old_parent = forest.node_parent.numpy()
    # First piece hangs under the parent's last piece; later pieces under the previous piece.
    parent_last = np.where(old_parent >= 0, first_piece[old_parent] + pieces[old_parent] - 1, -1)
    parent = np.where(piece_idx == 0, parent_last[old_of_new], np.arange(new_count) - 1)
    path_start = forest.node_path_start.numpy()[old_of_new] + piece_idx * max_length
    depth, subtree_end = node_depth_and_subtree_end(parent)
    last_piece = first_piece + pieces - 1
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long)  # noqa: E731
    return Forest(
        tokens=forest.tokens,
        node_start=t(start),
        node_length=t(length),
        node_parent=t(parent),
        node_depth=t(depth),
        node_path_start=t(path_start),
        node_multiplicity=forest.node_multiplicity[t(old_of_new)],
        node_subtree_end=t(subtree_end),
        trajectory_end_node=t(last_piece[forest.trajectory_end_node.numpy()]),
        trajectory_length=forest.trajectory_length,
        node_trajectory=forest.node_trajectory[t(old_of_new)],
        shares_prefixes=forest.shares_prefixes,
        images=forest.images,
        routed_experts=forest.routed_experts,
    )


@dataclass
class Part:
    """One micro-batch: ``nodes`` (global ids, ascending) and what crosses its boundary.

    - ``external_tokens`` [E]: global token ids on ancestor paths in earlier parts, ascending;
    - ``root_parents``: {global root node in this part: its global parent in an earlier part};
    - ``export_tokens`` [X]: this part's global token ids that later parts read;
    - ``export_nodes``: this part's global nodes whose final states later parts read.
    """

    nodes: torch.Tensor
    external_tokens: torch.Tensor
    root_parents: dict[int, int]
    export_tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    export_nodes: list[int] = field(default_factory=list)

    def num_tokens(self, forest: Forest) -> int:
        return int(forest.node_length[self.nodes].sum())


@dataclass
class MicroBatchPlan:
    forest: Forest  # the refined forest the parts index into
    parts: list[Part]

    @property
    def num_micro_batches(self) -> int:
        return len(self.parts)

    @property
    def num_cuts(self) -> int:
        """Parts that read context from an earlier part."""
        return sum(1 for p in self.parts if p.root_parents)


def _runs(lengths, path_start, nodes: np.ndarray, cap: int, context_weight: float) -> list[np.ndarray]:
    """``nodes`` (pre-order, each node's parent among them or before them) cut greedily into runs
    costing at most ``cap``.

    A run costs its tokens plus ``context_weight`` per token on the path above its first node
    (pre-order: every external ancestor of the run is on that path); it takes at least one node.
    """
    runs, run, used = [], [], 0.0
    for node in nodes.tolist():
        if run and used + lengths[node] > cap:
            runs.append(np.asarray(run))
            run = []
        if not run:
            used = context_weight * float(path_start[node])
        run.append(node)
        used += int(lengths[node])
    if run:
        runs.append(np.asarray(run))
    return runs


def _balanced_runs(lengths, path_start, nodes: np.ndarray, budget: int, context_weight: float):
    """As few runs as the budget allows, and among cuts into that many runs the one with the
    smallest largest run (bisection on a cap): the largest part sets the peak memory."""
    count = len(_runs(lengths, path_start, nodes, budget, context_weight))
    lo, hi = 1, budget
    while lo < hi:
        cap = (lo + hi) // 2
        if len(_runs(lengths, path_start, nodes, cap, context_weight)) <= count:
            hi = cap
        else:
            lo = cap + 1
    return _runs(lengths, path_start, nodes, hi, context_weight)


def _first_fit(
    units: np.ndarray,
    own: np.ndarray,
    alone: np.ndarray,
    parent: np.ndarray,
    lengths: np.ndarray,
    budget: int,
    context_weight: float,
) -> list[list[int]]:
    """Units (subtree roots, ``own`` tokens each, ``alone`` their cost in a bin of their own) packed
    first-fit decreasing into bins of ``budget``.

    A bin costs its units' tokens plus ``context_weight`` per token on the union of the paths above
    them: a part reads a context its units share once (24 completions under one prompt cost the
    prompt once, not 24 times). The union of root paths is closed upwards, so a unit's new context
    is found by walking up from its parent to the first node the bin already reads.
    """
    bins: list[list[int]] = []
    room: list[float] = []
    above: list[set[int]] = []  # per bin: the nodes on the paths above its units

    def new_context(unit: int, seen: set[int]) -> tuple[list[int], int]:
        nodes, tokens, a = [], 0, int(parent[unit])
        while a >= 0 and a not in seen:
            nodes.append(a)
            tokens += int(lengths[a])
            a = int(parent[a])
        return nodes, tokens

    for i in np.argsort(-alone, kind="stable").tolist():
        unit = int(units[i])
        for b, left in enumerate(room):
            nodes, tokens = new_context(unit, above[b])
            cost = float(own[i]) + context_weight * tokens
            if cost <= left:
                bins[b].append(unit)
                room[b] -= cost
                above[b].update(nodes)
                break
        else:
            nodes, _ = new_context(unit, set())
            bins.append([unit])
            room.append(budget - float(alone[i]))
            above.append(set(nodes))
    return bins


def _pack(forest: Forest, budget: int, context_weight: float) -> list[np.ndarray]:
    """Node groups: whole trees packed first-fit decreasing; each oversized tree's spine cut in
    pre-order runs, each run followed by the subtrees hanging off it, packed the same way.

    The *spine* of a tree larger than the budget is its nodes whose subtree exceeds the budget (a
    connected top of the tree: the shared prefixes, and the first pieces of long nodes). Every
    other node lies in a subtree that fits the budget and hangs off a spine node; such a subtree
    is packed whole, like a small tree, a part of them costing their tokens plus ``context_weight``
    per token of the union of the paths above them (one subtree whose context alone makes it cost
    more than the budget is cut in pre-order runs itself). Later
    parts read only spine parts, and a spine run's readers come right after it (its subtrees) or
    descend from it (later runs in pre-order): a step walking the parts depth first holds the
    chain of spine runs above the running part, never the whole spine.
    """
    lengths = forest.node_length.numpy()
    path_start = forest.node_path_start.numpy()
    parent = forest.node_parent.numpy()
    ends = forest.node_subtree_end.numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)])  # pre-order node ids: a subtree is a range
    subtree = offsets[ends] - offsets[np.arange(lengths.size)]
    spine = subtree > budget

    def packed(units: np.ndarray) -> list[np.ndarray]:
        costs = subtree[units] + context_weight * path_start[units]
        fits = costs <= budget
        groups = [
            np.concatenate([np.arange(r, ends[r]) for r in sorted(b)])
            for b in _first_fit(
                units[fits], subtree[units[fits]], costs[fits], parent, lengths, budget, context_weight
            )
        ]
        for unit in units[~fits].tolist():
            nodes = np.arange(unit, ends[unit])
            groups.extend(_balanced_runs(lengths, path_start, nodes, budget, context_weight))
        return groups

    roots = np.flatnonzero(parent < 0)
    groups = packed(roots[~spine[roots]])  # whole trees
    hanging = np.flatnonzero(~spine & (parent >= 0))
    hanging = hanging[spine[parent[hanging]]]  # subtrees off a spine node
    run_of = np.full(lengths.size, -1, dtype=np.int64)
    for root in roots[spine[roots]].tolist():
        nodes = np.arange(root, ends[root])
        runs = _balanced_runs(lengths, path_start, nodes[spine[nodes]], budget, context_weight)
        for r, run in enumerate(runs):
            run_of[run] = r
        mine = hanging[(hanging >= root) & (hanging < ends[root])]
        by_run = run_of[parent[mine]]
        for r, run in enumerate(runs):
            groups.append(run)
            groups.extend(packed(mine[by_run == r]))
    return groups


DEFAULT_CONTEXT_WEIGHT = 0.25


def _node_tokens(starts: np.ndarray, lengths: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """Token ids of ``nodes`` (ascending node ids give ascending tokens)."""
    return concat_ranges(starts[nodes], lengths[nodes])


def plan_micro_batches(
    forest: Forest, budget_tokens: int | None, context_weight: float = DEFAULT_CONTEXT_WEIGHT
) -> MicroBatchPlan:
    """Split ``forest`` into parts of at most ``budget_tokens`` unique tokens (None: one part).

    A cut run also counts ``context_weight`` per token of context above it (module docstring).
    """
    if not 0.0 <= context_weight <= 1.0:
        raise ValueError(f"context_weight must lie in [0, 1], got {context_weight}")
    if budget_tokens is None or budget_tokens >= forest.num_tokens:
        part = Part(torch.arange(forest.num_nodes), torch.empty(0, dtype=torch.long), {})
        return MicroBatchPlan(forest, [part])
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    refined = split_long_nodes(forest, budget_tokens)
    groups = _pack(refined, budget_tokens, context_weight)
    parent = refined.node_parent.numpy()
    starts, lengths = refined.node_start.numpy(), refined.node_length.numpy()
    part_of = np.full(refined.num_nodes, -1, dtype=np.int64)
    for p, nodes in enumerate(groups):
        part_of[nodes] = p
    parts = []
    # per producer part: arrays of its token ids and nodes that later parts read
    export_tokens: list[list[np.ndarray]] = [[] for _ in groups]
    export_nodes: list[set[int]] = [set() for _ in groups]
    for p, nodes in enumerate(groups):
        root_parents = {}
        ext_nodes: set[int] = set()
        for node in nodes:
            par = int(parent[node])
            if par >= 0 and part_of[par] != p:
                if part_of[par] > p:
                    raise AssertionError("a part must come after the parts holding its ancestors")
                root_parents[int(node)] = par
                export_nodes[part_of[par]].add(par)
                a = par
                while a >= 0 and part_of[a] != p and a not in ext_nodes:
                    ext_nodes.add(a)
                    a = int(parent[a])
        ext = np.asarray(sorted(ext_nodes), dtype=np.int64)
        ext_tokens = _node_tokens(starts, lengths, ext)
        for q in np.unique(part_of[ext]).tolist():
            export_tokens[q].append(_node_tokens(starts, lengths, ext[part_of[ext] == q]))
        parts.append(Part(torch.as_tensor(np.sort(nodes)), torch.as_tensor(ext_tokens), root_parents))
    for p, part in enumerate(parts):
        tokens = (
            np.unique(np.concatenate(export_tokens[p])) if export_tokens[p] else np.empty(0, dtype=np.int64)
        )
        part.export_tokens = torch.as_tensor(tokens, dtype=torch.long)
        part.export_nodes = sorted(export_nodes[p])
    return MicroBatchPlan(refined, parts)
