"""Per-micro-batch token layout: what the executor and the ops need to know about one part.

A :class:`TreeLayout` holds a part of a forest (the whole forest when nothing is cut) as a local
:class:`~harts.forest.Forest` of its nodes, moves the index tensors to the compute device once,
and derives, lazily and cached:

- ``positions`` [n]: global path positions (rotary embeddings);
- the *key space* of the part: E external tokens (ancestors computed in earlier parts, read
  from handed-over keys/values and convolution inputs) followed by the part's n own tokens;
- ``attention_plan``: per-node query groups over gathered ancestor keys;
- ``predecessors(K)`` [n, K]: short-convolution windows along each path, as key-space rows;
- ``linear_plan``: the calls that run every linear-attention layer, and ``root_state_source``,
  the earlier-part node whose final state starts each cut root;
- ``export_token_rows`` / ``export_nodes``: what later parts read from this one.
"""

from __future__ import annotations

import functools
import time
from functools import cached_property

import numpy as np
import torch

from harts.forest import Forest, concat_ranges, node_depth_and_subtree_end
from harts.plan.attention import TreeAttentionPlan, plan_tree_attention
from harts.plan.linear import LinearPlan, plan_linear
from harts.plan.linear_cost import LinearCostModel, PlanMode
from harts.plan.micro_batches import Part

__all__ = ["TreeLayout", "QueryBlock", "part_forest"]

# the tokens of a block of whole trees that a sparse attention runs at once (TreeLayout.query_blocks):
# its memory is about this many queries times the keys they can see, per head
QUERY_BLOCK_TOKENS = 2048


def part_forest(forest: Forest, nodes: np.ndarray) -> tuple[Forest, np.ndarray]:
    """The nodes of one part as a forest of their own, and the global id of each local token.

    Parents outside the part become -1 (local roots); path positions stay global.
    """
    lengths = forest.node_length.numpy()[nodes]
    global_tokens = concat_ranges(forest.node_start.numpy()[nodes], lengths)
    local_of = np.full(forest.num_nodes, -1, dtype=np.int64)
    local_of[nodes] = np.arange(nodes.size)
    gparent = forest.node_parent.numpy()[nodes]
    parent = np.where(gparent >= 0, local_of[np.maximum(gparent, 0)], -1)
    depth, subtree_end = node_depth_and_subtree_end(parent)
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long)  # noqa: E731
    local = Forest(
        tokens=forest.tokens[t(global_tokens)],
        node_start=t(np.cumsum(lengths) - lengths),
        node_length=t(lengths),
        node_parent=t(parent),
        node_depth=t(depth),
        node_path_start=forest.node_path_start[t(nodes)],
        node_multiplicity=forest.node_multiplicity[t(nodes)],
        node_subtree_end=t(subtree_end),
        trajectory_end_node=torch.empty(0, dtype=torch.long),
        trajectory_length=torch.empty(0, dtype=torch.long),
        node_trajectory=forest.node_trajectory[t(nodes)],
        shares_prefixes=forest.shares_prefixes,
    )
    return local, global_tokens


def _timed(fn):
    """Add the time a lazy plan takes to build to the layout's ``build_seconds``."""

    @functools.wraps(fn)
    def wrapper(self, *args):
        start = time.perf_counter()
        try:
            return fn(self, *args)
        finally:
            self.build_seconds += time.perf_counter() - start

    return wrapper


class TreeLayout:
    """Device-side index tensors of one micro-batch (a whole forest, or one part of a cut one).

    Building a part's layout touches only the part's tokens and the context it reads: global
    token ids map to key-space rows by binary search over the part's sorted external and own
    token ids, never through a map over the whole forest. ``build_seconds`` accumulates the time
    spent building the layout and its lazy plans.
    """

    def __init__(
        self,
        forest: Forest,
        device: torch.device | str = "cpu",
        part: Part | None = None,
        linear_mode: PlanMode | str = PlanMode.AUTO,
        cost_model: LinearCostModel | None = None,
    ):
        start = time.perf_counter()
        self.build_seconds = 0.0
        self.linear_mode = linear_mode
        self.cost_model = cost_model
        self.global_forest = forest
        self.device = torch.device(device)
        if part is None:
            self.nodes = np.arange(forest.num_nodes)
            self.local, self.global_tokens = forest, np.arange(forest.num_tokens)
            self.external_tokens = np.empty(0, dtype=np.int64)
            self.root_parents: dict[int, int] = {}
            export_tokens, export_nodes = np.empty(0, dtype=np.int64), []
        else:
            self.nodes = part.nodes.numpy()
            self.local, self.global_tokens = part_forest(forest, self.nodes)
            self.external_tokens = part.external_tokens.numpy()
            self.root_parents = part.root_parents
            export_tokens, export_nodes = part.export_tokens.numpy(), part.export_nodes
        self.forest = self.local
        self.num_external = int(self.external_tokens.size)
        self.export_token_rows = torch.as_tensor(self._own_rows(export_tokens), device=self.device)
        self.export_token_ids = export_tokens
        local_node = {int(g): i for i, g in enumerate(self.nodes)}
        self.export_nodes = [(local_node[g], g) for g in export_nodes]
        #: local root node -> global node (in an earlier part) whose final state starts it
        self.root_state_source = {local_node[r]: p for r, p in self.root_parents.items()}

        self.tokens = self.local.tokens.to(self.device)
        self.positions = self.local.token_position.to(self.device)
        self._predecessors: dict[int, torch.Tensor] = {}
        self._conv: dict[tuple, object] = {}
        self.build_seconds += time.perf_counter() - start

    def _own_rows(self, global_ids: np.ndarray) -> np.ndarray:
        """Local index of each global token id, which must belong to this part."""
        rows = self.key_rows(global_ids) - self.num_external
        if (rows < 0).any():
            raise AssertionError("a part exports a token it does not hold")
        return rows

    @property
    def self_contained(self) -> bool:
        """Whole trees: the part reads nothing from earlier parts and hands nothing on."""
        return not (self.root_state_source or self.export_token_ids.size or self.export_nodes)

    def key_rows(self, global_ids: np.ndarray) -> np.ndarray:
        """Key-space row of each global token id: external rows first, then own tokens; -1 if unseen."""
        global_ids = np.asarray(global_ids, dtype=np.int64)
        out = np.full(global_ids.shape, -1, dtype=np.int64)
        for ids, base in ((self.external_tokens, 0), (self.global_tokens, self.num_external)):
            if not ids.size:
                continue
            pos = np.searchsorted(ids, global_ids)
            found = ids[np.minimum(pos, ids.size - 1)] == global_ids
            out = np.where(found, base + pos, out)
        return out

    @property
    def num_tokens(self) -> int:
        return self.local.num_tokens

    @property
    def num_keys(self) -> int:
        return self.num_external + self.num_tokens

    def _external_path_keys(self, global_node: int) -> np.ndarray:
        """Key rows of the tokens on the path ending at ``global_node`` (all in earlier parts)."""
        f = self.global_forest
        path = []
        node = global_node
        while node >= 0:
            path.append(node)
            node = int(f.node_parent[node])
        path = np.asarray(path[::-1])
        return self.key_rows(concat_ranges(f.node_start.numpy()[path], f.node_length.numpy()[path]))

    @cached_property
    @_timed
    def node_ancestor_keys(self) -> list[np.ndarray]:
        """Per local node, the key rows of every token on its ancestor nodes, in path order (host
        arrays: only the attention planner reads them)."""
        f = self.local
        parent, start, length = f.node_parent.tolist(), f.node_start.tolist(), f.node_length.tolist()
        keys: list[np.ndarray] = []
        e = self.num_external
        for n in range(f.num_nodes):
            p = parent[n]
            if p >= 0:
                keys.append(np.concatenate([keys[p], np.arange(e + start[p], e + start[p] + length[p])]))
            elif n in self.root_state_source:
                keys.append(self._external_path_keys(self.root_state_source[n]))
            else:
                keys.append(np.empty(0, dtype=np.int64))
        return keys

    @cached_property
    @_timed
    def attention_plan(self) -> TreeAttentionPlan:
        f = self.local
        return plan_tree_attention(
            f.node_start,
            f.node_length,
            f.node_start + self.num_external,
            self.node_ancestor_keys,
            num_queries=self.num_tokens,
            num_keys=self.num_keys,
            device=self.device,
        )

    @_timed
    def predecessors(self, window: int) -> torch.Tensor:
        """[n, window] key-space rows of each token's path predecessors (-1 before the path start).

        Walks back ``window - 1`` steps from the part's own tokens along the global forest's
        ``token_previous`` (built once per forest): O(n * window) per part.
        """
        if window not in self._predecessors:
            if window < 1:
                raise ValueError(f"window must be at least 1, got {window}")
            self._predecessors[window] = self._path_window(self.global_tokens, window)
        return self._predecessors[window]

    @cached_property
    @_timed
    def key_tokens(self) -> torch.Tensor:
        """[m] token id of every key-space row (external rows, then the part's own tokens)."""
        external = self.global_forest.tokens[torch.as_tensor(self.external_tokens, dtype=torch.long)]
        return torch.cat([external.to(self.device), self.tokens])

    @cached_property
    @_timed
    def key_positions(self) -> torch.Tensor:
        """[m] path position of every key-space row (external rows, then the part's own tokens)."""
        external = self.global_forest.token_position[torch.as_tensor(self.external_tokens, dtype=torch.long)]
        return torch.cat([external.to(self.device), self.positions])

    @_timed
    def query_blocks(self, limit: int | None = None) -> list[QueryBlock]:
        """The part's tokens as blocks of whole trees (root subtrees: a token sees its own tree and the
        context, nothing of another tree of the part), a few trees to a block, each block at most
        ``limit`` tokens unless one tree alone is larger: what an attention over explicit [n, m]
        masks runs block by block, so that its memory grows with a block's tokens times the keys
        they can see, not with the part's tokens squared."""
        limit = QUERY_BLOCK_TOKENS if limit is None else limit
        key = ("query_blocks", limit)
        if key not in self._conv:
            f = self.local
            roots = np.flatnonzero(f.node_parent.numpy() < 0)
            starts = f.node_start.numpy()[roots].tolist() + [self.num_tokens]
            blocks, first = [], 0
            for k in range(1, len(starts)):
                if starts[k] - starts[first] > limit and k - 1 > first:
                    blocks.append((starts[first], starts[k - 1]))
                    first = k - 1
            if self.num_tokens:
                blocks.append((starts[first], self.num_tokens))
            self._conv[key] = [QueryBlock(self, a, b) for a, b in blocks]
        return self._conv[key]

    def _path_window(self, global_ids: np.ndarray, window: int) -> torch.Tensor:
        """[len(global_ids), window] key-space rows of each token's last ``window`` path tokens (itself
        last, -1 before the path start), walking back along the forest's ``token_previous``."""
        prev = self.global_forest.token_previous.numpy()
        cols = [global_ids]
        for _ in range(window - 1):
            last = cols[-1]
            cols.append(np.where(last >= 0, prev[np.maximum(last, 0)], -1))
        glob = np.stack(cols[::-1], axis=1)
        rows = np.where(glob >= 0, self.key_rows(glob), -1)
        if bool((rows[glob >= 0] < 0).any()):
            raise AssertionError("a window along a path reaches a token this part cannot see")
        return torch.as_tensor(rows, device=self.device)

    @property
    def conv_windows(self) -> list[int]:
        """The convolution windows asked of :meth:`predecessors` so far."""
        return sorted(self._predecessors)

    def conv_context_rows(self, window: int) -> np.ndarray:
        """Ascending rows 0..E-1 of the context (external tokens) that convolutions of ``window`` read:
        the last ``window - 1`` tokens of the paths above the part's roots, not the whole context."""
        key = ("conv_context", window)
        if key not in self._conv:
            rows = self.predecessors(window).cpu().numpy()
            self._conv[key] = np.unique(rows[(rows >= 0) & (rows < self.num_external)])
        return self._conv[key]

    def conv_predecessors(self, window: int, context_window: int) -> torch.Tensor:
        """[n, window] rows of each token's path predecessors in [the context rows of
        :meth:`conv_context_rows` (``context_window``) ; the part's own tokens] (-1 before the path
        start): what a convolution reads when the hand-over gathered only those context rows."""
        if window > context_window:
            raise AssertionError(f"a convolution of window {window} over context rows for {context_window}")
        key = ("conv_predecessors", window, context_window)
        if key not in self._conv:
            rows = self.predecessors(window).cpu().numpy()
            context = self.conv_context_rows(context_window)
            own = rows >= self.num_external
            local = np.where(own, rows - self.num_external + context.size, np.searchsorted(context, rows))
            self._conv[key] = torch.as_tensor(np.where(rows < 0, -1, local), device=self.device)
        return self._conv[key]

    @cached_property
    @_timed
    def linear_plan(self) -> LinearPlan:
        return plan_linear(self.local, self.linear_mode, self.cost_model).to(self.device)


class QueryBlock:
    """A contiguous run ``[start, stop)`` of a part's tokens made of whole trees, and the key-space
    rows its tokens can see (``keys``: the context, then the block's own tokens), with what a sparse
    attention's selection reads over them, in the block's own indices (lazily):

    - ``key_positions`` [mb]: path position of each of the block's key rows;
    - ``query_positions`` [nb]: path position of each of its tokens;
    - ``path_mask`` [nb, mb] bool: the key rows each token's path holds (itself included);
    - ``key_predecessors(W)`` [mb, W]: each key row's last W path tokens as block key indices (itself
      last, -1 before the path start): the context holds whole paths and the block whole trees, so
      every predecessor is one of the block's keys.
    """

    def __init__(self, layout: TreeLayout, start: int, stop: int):
        self.layout, self.start, self.stop = layout, start, stop
        e = layout.num_external
        self.keys = torch.cat([torch.arange(e), torch.arange(e + start, e + stop)]).to(layout.device)
        self._predecessors: dict[int, torch.Tensor] = {}

    def _local(self, rows: np.ndarray) -> np.ndarray:
        """Block key index of key-space rows (context rows or the block's own; -1 stays -1)."""
        e = self.layout.num_external
        return np.where(rows < e, rows, rows - self.start)

    @cached_property
    def key_positions(self) -> torch.Tensor:
        return self.layout.key_positions[self.keys]

    @cached_property
    def query_positions(self) -> torch.Tensor:
        return self.layout.positions[self.start : self.stop]

    @cached_property
    def path_mask(self) -> torch.Tensor:
        lay, f = self.layout, self.layout.local
        e = lay.num_external
        sees = np.zeros((self.stop - self.start, self.keys.numel()), dtype=bool)
        starts, lengths = f.node_start.numpy(), f.node_length.numpy()
        nodes = np.flatnonzero((starts >= self.start) & (starts < self.stop))
        own = np.tri(int(lengths[nodes].max()) if nodes.size else 0, dtype=bool)
        for node in nodes.tolist():
            q, length = int(starts[node]) - self.start, int(lengths[node])
            sees[q : q + length, self._local(lay.node_ancestor_keys[node])] = True
            sees[q : q + length, e + q : e + q + length] = own[:length, :length]
        return torch.from_numpy(sees).to(lay.device)

    def key_predecessors(self, window: int) -> torch.Tensor:
        if window not in self._predecessors:
            lay = self.layout
            key_space = np.concatenate([lay.external_tokens, lay.global_tokens[self.start : self.stop]])
            rows = lay._path_window(key_space, window).cpu().numpy()
            self._predecessors[window] = torch.as_tensor(self._local(rows), device=lay.device)
        return self._predecessors[window]
