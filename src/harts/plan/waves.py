"""Execution plans for linear-attention layers over a forest.

A linear-attention layer has one sequential dependency in a tree: a node's recurrence starts
from its parent's final state. A *call* runs a batch of segments, each from its own initial
state, right-padded to the longest segment (padding is neutral: k = v = 0, beta = 0, g = 0
leave the state unchanged). A plan is a list of calls in which every segment's initial state is
produced by an earlier call.

``depth_wave_plan``: one call per tree depth, each node its own segment. Simple and always valid;
its number of calls is the forest's depth plus one.

What this leaves out: chain segments spanning several nodes (fewer calls), and cost models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harts.forest import Forest

__all__ = ["LinearCall", "LinearPlan", "depth_wave_plan"]


@dataclass
class LinearCall:
    """One batched recurrence call over W segments of at most T tokens.

    - ``token_index`` [W, T]: unique-token index of each slot (0 where padded);
    - ``lengths`` [W]: true segment lengths;
    - ``init_node`` list[W]: node whose final state starts the segment, -1 for a root (zeros, or
      a state handed over from an earlier micro-batch);
    - ``start_node`` list[W]: first node of each segment;
    - ``end_node`` list[W]: node whose final state this segment produces.
    """

    token_index: torch.Tensor
    lengths: torch.Tensor
    init_node: list[int]
    start_node: list[int]
    end_node: list[int]

    @property
    def valid(self) -> torch.Tensor:
        t = self.token_index.shape[1]
        return torch.arange(t, device=self.lengths.device)[None, :] < self.lengths[:, None]

    @property
    def padded_tokens(self) -> int:
        return int(self.token_index.numel() - self.lengths.sum())

    def to(self, device) -> LinearCall:
        return LinearCall(
            self.token_index.to(device),
            self.lengths.to(device),
            self.init_node,
            self.start_node,
            self.end_node,
        )


@dataclass
class LinearPlan:
    calls: list[LinearCall]
    num_tokens: int

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def padded_tokens(self) -> int:
        return sum(c.padded_tokens for c in self.calls)

    def to(self, device) -> LinearPlan:
        return LinearPlan([c.to(device) for c in self.calls], self.num_tokens)

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
    return LinearPlan(calls, forest.num_tokens)
