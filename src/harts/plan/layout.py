"""Per-micro-batch token layout: what the executor and the ops need to know about a forest.

A :class:`TreeLayout` moves a :class:`~harts.forest.Forest`'s index tensors to the compute
device once and derives, lazily and cached:

- ``positions`` [N]: path positions for rotary embeddings;
- ``attention_blocks``: per root tree, its token range and ancestor mask (plain tree attention);
- ``predecessors(K)`` [N, K]: short-convolution windows along each path;
- ``linear_plan``: the calls that run every linear-attention layer (see :mod:`harts.plan.waves`).

What this leaves out: packing several forests into micro-batches, and cutting a tree.
"""

from __future__ import annotations

from functools import cached_property

import torch

from harts.forest import Forest
from harts.ops.tree_attention import ancestor_mask
from harts.plan.waves import LinearPlan, depth_wave_plan

__all__ = ["TreeLayout"]


class TreeLayout:
    """Device-side index tensors of one forest (one micro-batch)."""

    def __init__(self, forest: Forest, device: torch.device | str = "cpu"):
        self.forest = forest
        self.device = torch.device(device)
        self.tokens = forest.tokens.to(self.device)
        self.positions = forest.token_position.to(self.device)
        self.token_node = forest.token_node.to(self.device)
        self._predecessors: dict[int, torch.Tensor] = {}

    @property
    def num_tokens(self) -> int:
        return self.forest.num_tokens

    @cached_property
    def node_ancestor(self) -> torch.Tensor:
        """[M, M] bool: ``a[m, b]`` is True when node b is m itself or one of its ancestors."""
        f = self.forest
        m = f.num_nodes
        anc = torch.eye(m, dtype=torch.bool)
        # Parents precede children, so each row copies its parent's finished row.
        parent = f.node_parent.tolist()
        for node in range(m):
            p = parent[node]
            if p >= 0:
                anc[node] |= anc[p]
        return anc.to(self.device)

    @cached_property
    def attention_blocks(self) -> list[tuple[int, int, torch.Tensor]]:
        """One (token start, token end, ancestor mask [n, n]) per root tree.

        Trees never attend to each other, so attention runs tree by tree and its cost is the
        sum of squared tree sizes, not the square of the micro-batch.
        """
        f = self.forest
        roots = (f.node_parent < 0).nonzero().squeeze(1).tolist()
        ends = f.node_subtree_end.tolist()
        starts = f.node_start.tolist()
        blocks = []
        for root in roots:
            last = ends[root] - 1
            t0, t1 = starts[root], starts[last] + int(f.node_length[last])
            n0, n1 = root, ends[root]
            node_anc = self.node_ancestor[n0:n1, n0:n1]
            blocks.append((t0, t1, ancestor_mask(self.token_node[t0:t1] - n0, node_anc)))
        return blocks

    def predecessors(self, window: int) -> torch.Tensor:
        if window not in self._predecessors:
            self._predecessors[window] = self.forest.token_predecessors(window).to(self.device)
        return self._predecessors[window]

    @cached_property
    def linear_plan(self) -> LinearPlan:
        return depth_wave_plan(self.forest).to(self.device)
