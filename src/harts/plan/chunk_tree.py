"""The chunk-tree plan: every linear-attention layer of a micro-batch in one call.

The call plans of :mod:`harts.plan.linear` run a layer as several batched calls (one per depth
level, or per chain), each a chunked recurrence over right-padded segments: on forests of many
short nodes the per-call fixed cost dominates. This plan instead cuts every node into chunks of
``chunk_size`` tokens (its last chunk right-padded with identity steps) and links the chunks into
a tree: a chunk starts from the state its predecessor in the node ends with, or, for a node's
first chunk, from the state its parent node ends with (a root's from a handed-over state or
zeros). The chunked kernels then compute every chunk's intra-chunk terms in one batch, and only
the small state recurrence S_end = T S_start + D runs level by level down the chunk tree
(each recurrence's ``chunk_tree`` form, on :mod:`harts.ops.chunked.tree`): as many sequential
steps as the longest path has chunks, each over every chunk at that depth. Each node ends at a
chunk boundary, so every node's final state is a chunk's end state, with no replay.

The price is padding: each node is padded to whole chunks, so short nodes want short chunks, while
long nodes want long ones (fewer chunks and scan levels). :func:`chunk_tree_plan` picks the chunk
the cost model (:mod:`harts.plan.linear_cost`) finds cheapest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.forest import Forest
from harts.plan.linear_cost import LinearCostModel, PlanMode

__all__ = ["ChunkTreePlan", "chunk_tree_plan"]


@dataclass
class ChunkTreePlan:
    """Chunks of every node, linked parent to child.

    - ``token_index`` [M, C]: unique-token row of each slot; padded slots hold ``num_tokens`` (a
      zero row the kernels append);
    - ``source`` [M]: where each chunk's initial state comes from, as a row of the states buffer
      [R + M]: rows 0..R-1 are the roots' initial states (``root_nodes[r]``'s), row R + m the end
      state of chunk m;
    - ``levels``: chunk ids by depth in the chunk tree (every chunk's source is in an earlier
      level), each a ``slice``: chunks are numbered level by level, so the scan reads and writes
      each level's rows as one contiguous block (a view) instead of gathering and scattering them;
    - ``node_last_chunk`` [nodes]: the chunk whose end state is the node's final state;
    - ``output_index`` [num_tokens]: the slot (m * C + i) of each unique token.

    A node's chunks are a chain of sources (chunk m > its first starts from chunk
    ``source[m] - R``), one chunk in each of consecutive levels.
    """

    chunk_size: int
    token_index: torch.Tensor
    source: torch.Tensor
    levels: list[slice]
    root_nodes: list[int]
    node_last_chunk: torch.Tensor
    output_index: torch.Tensor
    num_tokens: int

    @property
    def num_chunks(self) -> int:
        return int(self.token_index.shape[0])

    @property
    def num_calls(self) -> int:
        return 1

    @property
    def mode(self) -> PlanMode:
        return PlanMode.TREE

    @property
    def scan_steps(self) -> int:
        """Sequential steps of the state scan: the chunk tree's depth + 1."""
        return len(self.levels)

    @property
    def padded_tokens(self) -> int:
        return self.token_index.numel() - self.num_tokens

    @property
    def cost(self) -> float:
        """Estimated cost (microseconds) under the default :class:`LinearCostModel`."""
        return LinearCostModel().chunk_tree(self.num_chunks, self.scan_steps, self.chunk_size)

    def to(self, device) -> ChunkTreePlan:
        return ChunkTreePlan(
            self.chunk_size,
            self.token_index.to(device),
            self.source.to(device),
            self.levels,
            self.root_nodes,
            self.node_last_chunk.to(device),
            self.output_index.to(device),
            self.num_tokens,
        )


def chunk_tree_shape(forest: Forest, chunk_size: int) -> tuple[int, int]:
    """(chunks, scan levels) of ``forest``'s chunk tree at ``chunk_size``, without building it."""
    lengths = forest.node_length.numpy()
    if not lengths.size:
        return 0, 1
    per_node = np.maximum(1, np.ceil(lengths / chunk_size)).astype(np.int64)
    return int(per_node.sum()), int(_chunk_depths(forest, per_node).max()) + 1


def choose_chunk(forest: Forest, cost_model: LinearCostModel | None = None) -> tuple[int, float]:
    """The chunk with the cheapest chunk tree under ``cost_model`` (ties: the larger), and its cost.

    Short nodes want short chunks (each node pads to whole chunks), long ones long chunks (fewer
    chunks, fewer scan levels).
    """
    model = cost_model or LinearCostModel()
    costs = {c: model.chunk_tree(*chunk_tree_shape(forest, c), c) for c in model.chunk_sizes}
    best = min(costs, key=lambda c: (costs[c], -c))
    return best, costs[best]


def _chunk_depths(forest: Forest, per_node: np.ndarray) -> np.ndarray:
    """Depth in the chunk tree of each node's last chunk: one vectorised step per forest depth
    (AUTO prices every chunk size of every micro-batch, so no loop over nodes)."""
    parent = forest.node_parent.numpy()
    depth = forest.node_depth.numpy()
    last = per_node.astype(np.int64) - 1
    for d in range(1, int(depth.max()) + 1 if depth.size else 0):
        nodes = np.flatnonzero(depth == d)
        last[nodes] += last[parent[nodes]] + 1
    return last


def chunk_tree_plan(
    forest: Forest, chunk_size: int | None = None, cost_model: LinearCostModel | None = None
) -> ChunkTreePlan:
    """The chunk tree of ``forest``, chunks numbered level by level (in forest order within a
    level); the chunk is ``chunk_size``, or the one ``cost_model`` (default:
    :class:`LinearCostModel`) finds cheapest."""
    c = chunk_size or choose_chunk(forest, cost_model)[0]
    if c < 1 or c & (c - 1):
        raise ValueError(f"chunk_size must be a power of two, got {c}")
    lengths = forest.node_length.numpy().astype(np.int64)
    starts = forest.node_start.numpy().astype(np.int64)
    parent = forest.node_parent.numpy()
    n_nodes, n_tokens = lengths.size, int(lengths.sum())
    per_node = np.maximum(1, np.ceil(lengths / c)).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(per_node)[:-1]]).astype(np.int64)
    last = first + per_node - 1
    m = int(per_node.sum())
    chunk_node = np.repeat(np.arange(n_nodes), per_node)
    j = np.arange(m) - first[chunk_node]  # chunk index within its node
    roots = np.flatnonzero(parent < 0)
    root_slot = np.full(n_nodes, -1, dtype=np.int64)
    root_slot[roots] = np.arange(roots.size)
    r = roots.size
    first_source = np.where(parent >= 0, r + last[np.maximum(parent, 0)], root_slot)
    source = np.where(j > 0, r + np.arange(m) - 1, first_source[chunk_node])
    depth_last = _chunk_depths(forest, per_node)
    depth = depth_last[chunk_node] - (per_node[chunk_node] - 1 - j)
    # Renumber the chunks level by level: chunk `order[i]` (in node order) becomes chunk i.
    order = np.argsort(depth, kind="stable")
    new_id = np.empty(m, dtype=np.int64)
    new_id[order] = np.arange(m)
    bounds = np.searchsorted(depth[order], np.arange(depth.max() + 2 if m else 1))
    levels = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    source = source[order]
    inner = source >= r
    source[inner] = r + new_id[source[inner] - r]
    offset = j * c  # token offset of each chunk in its node
    slot = np.arange(c)[None, :]
    valid = slot < (lengths[chunk_node] - offset)[:, None]
    token_index = np.where(valid, starts[chunk_node][:, None] + offset[:, None] + slot, n_tokens)[order]
    valid = valid[order]
    flat = np.flatnonzero(valid.reshape(-1))  # slots of real tokens
    output_index = np.empty(n_tokens, dtype=np.int64)
    output_index[token_index.reshape(-1)[flat]] = flat
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long)  # noqa: E731
    return ChunkTreePlan(
        c, t(token_index), t(source), levels, roots.tolist(), t(new_id[last]), t(output_index), n_tokens
    )
