"""Whole trees to data-parallel ranks, so that the ranks finish a step together.

A step's forest is split between ranks by whole trees: a tree on one rank computes its shared
prefix once, and a tree larger than a rank's token budget is cut into micro-batches on its rank
as on one process. Only where that lowers the most loaded rank's cost (fewer trees than ranks,
or one tree outweighing a rank's share, as when every rollout shares one system prompt) is a
tree divided at its branch points, each branch going with its prefix, which each rank holding a
branch recomputes (its cost is counted). Ranks wait for the slowest at the gradient sum, so
the assignment balances the *cost* of each rank's trees, not their token counts: a tree's cost
is a FLOP model of its forward and backward,

    cost = per_token * unique tokens + per_key * sum over unique tokens of the keys it attends
           (its path length: the prefix above it and its node's earlier tokens),

with ``per_token`` the dense work of one token (about 6 x the non-embedding parameters) and
``per_key`` the attention work of one query-key pair over the full-attention layers (about
12 x heads x head size x full-attention layers); linear attention and MoE are per-token work.
The assignment is longest-processing-time first: trees (or branches) by decreasing cost, each to
the rank with the least cost so far (within 4/3 of the optimum; ties go to the lower rank, so every rank
computes the same assignment from the same forest without communicating).

What this leaves out: measured per-rank speeds (ranks are assumed equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.forest import Forest

__all__ = ["RankCost", "assign_trees", "TreeAssignment"]


@dataclass(frozen=True)
class RankCost:
    """FLOP weights of a unique token and of an attended key (see the module docstring)."""

    per_token: float = 1.0
    per_key: float = 0.0

    def __post_init__(self):
        if not (self.per_token >= 0 and self.per_key >= 0 and self.per_token + self.per_key > 0):
            raise ValueError(f"RankCost weights must be >= 0 and not both 0, got {self}")


def _node_costs(forest: Forest, cost: RankCost) -> tuple[np.ndarray, np.ndarray]:
    """[num_nodes] cost of each node's tokens, and [num_nodes] cost of the path above each node
    (what a rank holding a branch without its ancestors recomputes)."""
    lengths = forest.node_length.numpy().astype(np.float64)
    path_start = forest.node_path_start.numpy().astype(np.float64)
    # keys attended by a node's tokens: path_start + 1, ..., path_start + length
    keys = lengths * path_start + lengths * (lengths + 1) / 2
    prefix = cost.per_token * path_start + cost.per_key * path_start * (path_start + 1) / 2
    return cost.per_token * lengths + cost.per_key * keys, prefix


@dataclass
class _Unit:
    """Trajectories ending in the pre-order node range [start, end), run together on one rank;
    ``top``: the node whose children a split makes units of their own."""

    start: int
    end: int
    top: int
    cost: float


def _children(parent: np.ndarray) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in range(parent.size)]
    for node, p in enumerate(parent.tolist()):
        if p >= 0:
            children[p].append(node)
    return children


def _lpt(costs: list[float], world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Longest processing time first: (rank of each unit, load of each rank)."""
    load = np.zeros(world_size)
    rank = np.empty(len(costs), dtype=np.int64)
    for u in np.argsort(-np.asarray(costs), kind="stable").tolist():
        r = int(np.argmin(load))  # first minimum: the lowest rank
        rank[u] = r
        load[r] += costs[u]
    return rank, load


@dataclass(frozen=True)
class TreeAssignment:
    """``trajectories[r]``: the batch indices of the trajectories rank ``r`` trains (ascending);
    ``cost[r]``: the cost of its trees; ``divided``: how many trees were divided at branch points."""

    trajectories: list[list[int]]
    cost: list[float]
    divided: int = 0

    @property
    def imbalance(self) -> float:
        """Largest rank cost over the mean (1.0 is perfect balance)."""
        mean = sum(self.cost) / len(self.cost)
        return max(self.cost) / mean if mean > 0 else 1.0


def assign_trees(forest: Forest, world_size: int, cost: RankCost | None = None) -> TreeAssignment:
    """Trajectories of ``forest`` to ``world_size`` ranks by whole trees, balancing ``cost``
    (default: unique tokens).

    A tree is divided only when that lowers the most loaded rank's cost (a batch of fewer trees
    than ranks, or one tree outweighing a rank's share, as when every rollout shares one system
    prompt): then at its branch points, each branch with its shared prefix, which every rank
    holding a branch of it recomputes (the cost counts it). Raises ValueError when there are
    fewer trajectories than ranks.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if forest.num_trajectories < world_size:
        raise ValueError(
            f"the step has {forest.num_trajectories} trajectories for {world_size} ranks: every "
            f"rank needs one (put more rollouts in each step)"
        )
    cost = cost or RankCost()
    node_cost, prefix_cost = _node_costs(forest, cost)
    running = np.concatenate([[0.0], np.cumsum(node_cost)])
    parent = forest.node_parent.numpy()
    ends = forest.node_subtree_end.numpy()
    children = _children(parent)

    def unit(start: int, end: int, top: int) -> _Unit:
        return _Unit(start, end, top, float(running[end] - running[start] + prefix_cost[start]))

    def loads(units: list[_Unit]) -> tuple[np.ndarray, np.ndarray]:
        """LPT by unit cost, then each rank's exact cost: a prefix that several of a rank's
        branches share is computed once there."""
        rank, _ = _lpt([u.cost for u in units], world_size)
        held = np.zeros((world_size, parent.size), dtype=bool)
        for u, r in zip(units, rank.tolist(), strict=True):
            held[r, u.start : u.end] = True
            node = int(parent[u.start])
            while node >= 0 and not held[r, node]:
                held[r, node] = True
                node = int(parent[node])
        return rank, held.astype(np.float64) @ node_cost

    units = [unit(r, int(ends[r]), r) for r in np.flatnonzero(parent < 0).tolist()]
    _, load = loads(units)
    divided = 0
    while True:
        splittable = [i for i, u in enumerate(units) if children[u.top]]
        if not splittable:
            break
        i = max(splittable, key=lambda j: units[j].cost)
        u, kids = units[i], children[units[i].top]
        parts = [unit(u.start, int(ends[kids[0]]), kids[0])]  # trajectories ending above stay with it
        parts += [unit(k, int(ends[k]), k) for k in kids[1:]]
        trial = units[:i] + parts + units[i + 1 :]
        _, trial_load = loads(trial)
        if len(units) >= world_size and trial_load.max() >= load.max():
            break
        units, load, divided = trial, trial_load, divided + 1
    if len(units) < world_size:  # only single trajectories ending inside one another remain
        raise ValueError(
            f"the step's {forest.num_trajectories} trajectories cannot be divided among "
            f"{world_size} ranks (at most {len(units)} groups)"
        )
    rank, load = loads(units)
    starts = np.array([u.start for u in units])
    order = np.argsort(starts)
    trajectories: list[list[int]] = [[] for _ in range(world_size)]
    for t, node in enumerate(forest.trajectory_end_node.tolist()):
        u = order[np.searchsorted(starts[order], node, side="right") - 1]  # the unit whose range holds it
        trajectories[int(rank[u])].append(t)
    return TreeAssignment(trajectories, load.tolist(), divided)
