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

__all__ = ["TreeLayout", "part_forest"]


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
    def key_predecessors(self, window: int) -> torch.Tensor:
        """[m, window] key-space rows of the path predecessors of every key-space row, external rows
        included (-1 before the path start): the context above a part holds whole paths, so the
        predecessors of an external row are external rows too."""
        key = ("key_predecessors", window)
        if key not in self._conv:
            if window < 1:
                raise ValueError(f"window must be at least 1, got {window}")
            key_space = np.concatenate([self.external_tokens, self.global_tokens])
            self._conv[key] = self._path_window(key_space, window)
        return self._conv[key]

    @cached_property
    @_timed
    def path_mask(self) -> torch.Tensor:
        """[n, m] bool: the key-space rows each of the part's tokens sees (its path: ancestors and
        the earlier tokens of its node, itself included)."""
        f = self.local
        sees = np.zeros((self.num_tokens, self.num_keys), dtype=bool)
        e = self.num_external
        own = np.tri(int(f.node_length.max()) if f.num_nodes else 0, dtype=bool)
        starts, lengths = f.node_start.tolist(), f.node_length.tolist()
        for node, (start, length) in enumerate(zip(starts, lengths, strict=True)):
            sees[start: start + length, self.node_ancestor_keys[node]] = True
            sees[start: start + length, e + start: e + start + length] = own[:length, :length]
        return torch.from_numpy(sees).to(self.device)

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
