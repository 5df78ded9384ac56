"""What crosses a micro-batch cut, and the context through which tree mixers reach the sequence.

- :class:`LayerHandoff`: per layer, what one micro-batch hands to the later ones that continue
  its paths (keys/values and conv inputs of tokens, final linear-attention states of nodes).
- :class:`MixerContext`: the :class:`~harts.adapters.base.TreeOps` of one micro-batch. Mixers call
  ``attend``, ``conv`` and ``recurrence`` (any layer of :mod:`harts.ops.recurrence`); the context
  runs the ops over the micro-batch's layout, reads what earlier micro-batches handed over and
  collects what this one hands on.
- :class:`HandoffBanks`: the hand-overs of every part run so far, gathered into the rows a later
  part reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from harts.ops.backends import current_backend
from harts.ops.precision import attention_inputs
from harts.ops.recurrence import Recurrence
from harts.ops.short_conv import tree_short_conv
from harts.ops.tree_attention.masked import masked_tree_attention
from harts.ops.tree_recurrence import tree_recurrence
from harts.plan.layout import TreeLayout

__all__ = ["LayerHandoff", "MixerContext", "HandoffBanks"]


@dataclass
class LayerHandoff:
    """What one layer hands from a micro-batch to the later ones that continue its paths.

    - ``key`` / ``value`` [Hkv, X, d]: attention keys (after RoPE and norms) and values of tokens;
    - ``conv_input`` [X, C]: short-convolution inputs of tokens;
    - ``states``: {global node: final linear-attention state [H, K, V]};
    - ``index_rows`` [X, C]: per-token rows that carry no gradient and that later parts read at
      every context row (a sparse-attention indexer's keys: its selection is discrete);
    - ``conv_window``: on a reader's side, the convolution window whose context rows
      ``conv_input`` holds (:meth:`~harts.plan.layout.TreeLayout.conv_context_rows`), or None
      when it holds every context row.
    """

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    conv_input: torch.Tensor | None = None
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    conv_window: int | None = None
    index_rows: torch.Tensor | None = None

    def detached(self) -> LayerHandoff:
        """The same hand-over without its graph (the tensors share storage): what readers take from
        a part whose graph is held, so that dropping the graph frees it."""
        d = lambda t: None if t is None else t.detach()  # noqa: E731
        states = {n: t.detach() for n, t in self.states.items()}
        return LayerHandoff(
            d(self.key), d(self.value), d(self.conv_input), states, self.conv_window, d(self.index_rows)
        )


class MixerContext:
    """What a token mixer needs beyond its input, and the three sequence ops it calls.

    ``layout`` describes the micro-batch; ``position_embeddings`` are the rotary cos/sin
    [1, n, d] at path positions; ``layer`` is set by the executor before each layer.
    ``external[layer]`` holds the context handed over by earlier micro-batches (key space rows
    0..E-1 for keys/values and conv inputs; states of cut roots' parents); ``exports[layer]``
    collects what this micro-batch hands on. Mixers never see either: they call
    :meth:`attend`, :meth:`conv` and :meth:`recurrence`. ``recompute_linear``: recurrent calls
    keep only their inputs for backward and run again there (:func:`tree_recurrence`).
    """

    def __init__(
        self,
        layout: TreeLayout,
        position_embeddings,
        external: list[LayerHandoff] | None = None,
        recompute_linear: bool = False,
        rotary_at=None,
    ):
        self.layout = layout
        # positions [1, r] -> the model's rotary (cos, sin) there (key_position_embeddings), or None
        self.rotary_at = rotary_at
        self._key_tables = None
        self._conv_channels = 0
        self.recompute_linear = recompute_linear
        self.position_embeddings = position_embeddings
        self.external = external
        self.exports: list[LayerHandoff] = []
        self.layer = -1
        self.recording = True
        # what one layer leaves for a later layer of the same part (a shared sparse-attention
        # selection); a replayed layer computes the same values again
        self.carry: dict[str, object] = {}

    def begin_layer(self, index: int) -> None:
        """Start layer ``index``. A layer run again (an activation checkpoint replaying it in
        backward) reads the same context and records nothing: its exports were taken the first time."""
        self.layer = index
        self.recording = index == len(self.exports)
        self._conv_channels = 0  # channels of this layer's hand-over the layer's convolutions took so far
        if self.recording:
            self.exports.append(LayerHandoff())

    def _ext(self) -> LayerHandoff | None:
        return self.external[self.layer] if self.external is not None else None

    def path_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [n, C] of the part's tokens (no gradient: an indexer's keys) preceded by the same
        rows of the context that earlier parts computed: [m, C] over the key space."""
        rows = rows.detach()
        exported = rows[self.layout.export_token_rows]
        if self.recording and exported.numel():
            self.exports[self.layer].index_rows = exported
        ext = self._ext()
        if ext is not None and ext.index_rows is not None:
            rows = torch.cat([ext.index_rows.to(rows.dtype), rows], dim=0)
        return rows

    def attend(
        self, query, key, value, scaling: float, window: int | None = None, sinks=None, select=None
    ) -> torch.Tensor:
        """Tree attention of [1, H, n, d] query/key/value over the key space; returns [1, n, H, dv].
        ``window``: each token sees the last ``window`` tokens of its path; ``sinks`` [H]: per-head
        logits added to the softmax denominator; ``select(block)`` -> [nb, mb] bool: the keys each
        query of a :class:`~harts.plan.layout.QueryBlock` sees (a selection within its path), one
        masked call per block instead of the plan."""
        key, value = key[0], value[0]
        rows = self.layout.export_token_rows
        if rows.numel():  # computed on a replay too, so that it saves what the first run saved
            exported = key[:, rows], value[:, rows]
            if self.recording:
                self.exports[self.layer].key, self.exports[self.layer].value = exported
        ext = self._ext()
        if ext is not None and ext.key is not None:
            key, value = torch.cat([ext.key, key], dim=1), torch.cat([ext.value, value], dim=1)
        extra = {k: x for k, x in (("window", window), ("sinks", sinks)) if x is not None}
        query, key, value = attention_inputs(query[0], key, value)  # as SDPA under autocast
        if select is not None:
            out = []
            for b in self.layout.query_blocks():
                q, k, v = query[:, b.start : b.stop], key[:, b.keys], value[:, b.keys]
                out.append(masked_tree_attention(q, k, v, select(b), scaling))
            return torch.cat(out, dim=0)[None]
        plan = self.layout.attention_plan
        return current_backend().attention(query, key, value, plan, scaling, **extra)[None]

    def conv(self, mixed: torch.Tensor, weight, bias) -> torch.Tensor:
        """Depthwise causal conv of ``mixed`` [n, C] along paths (pre-activation); returns [n, C]."""
        rows = self.layout.export_token_rows
        if rows.numel():  # a layer's convolutions hand their inputs over side by side, in call order
            exported = mixed[rows]
            if self.recording:
                earlier = self.exports[self.layer].conv_input
                if earlier is not None:
                    wide = torch.promote_types(earlier.dtype, exported.dtype)
                    exported = torch.cat([earlier.to(wide), exported.to(wide)], dim=1)
                self.exports[self.layer].conv_input = exported
        ext = self._ext()
        window = weight.shape[-1]
        if ext is not None and ext.conv_window is not None:  # only the context rows convolutions reach
            predecessors = self.layout.conv_predecessors(window, ext.conv_window)
        else:
            predecessors = self.layout.predecessors(window)
        if ext is not None and ext.conv_input is not None:
            first, self._conv_channels = self._conv_channels, self._conv_channels + mixed.shape[1]
            context = ext.conv_input[:, first : self._conv_channels]
            mixed = torch.cat([context.to(mixed.dtype), mixed], dim=0)
        return tree_short_conv(mixed, weight, predecessors, bias)

    @property
    def query_blocks(self):
        """The part's tokens in blocks of whole trees (:meth:`~harts.plan.layout.TreeLayout.query_blocks`),
        in token order: the blocks ``attend(select=...)`` runs."""
        return self.layout.query_blocks()

    @property
    def key_position_embeddings(self):
        """The rotary (cos, sin) [1, m, d] at every key-space row's path position (context rows
        included): what an indexer reads for keys pooled from earlier tokens."""
        if self._key_tables is None:
            if self.rotary_at is None:
                raise ValueError("this model has no rotary embedding to read at key positions")
            self._key_tables = self.rotary_at(self.layout.key_positions[None])
        return self._key_tables

    def path_token_ids(self, window: int) -> torch.Tensor:
        """[n, window] token ids of each token's last ``window`` path tokens (itself last; -1 before
        the path start)."""
        rows = self.layout.predecessors(window)
        return torch.where(rows >= 0, self.layout.key_tokens[rows.clamp(min=0)], -1)

    def recurrence(self, recurrence: Recurrence, *inputs, scale: float | None = None) -> torch.Tensor:
        """``recurrence`` over the layout's linear plan, states handed from parent to child and
        across cuts; inputs [n, H, ...] in the recurrence's order; returns [n, H, V]."""
        ext = self._ext()
        root_states = None
        if ext is not None and self.layout.root_state_source:
            root_states = {local: ext.states[glob] for local, glob in self.layout.root_state_source.items()}
        out, states = tree_recurrence(
            recurrence,
            inputs,
            self.layout.linear_plan,
            scale=scale,
            root_states=root_states,
            recompute=self.recompute_linear,
        )
        for local, glob in self.layout.export_nodes:
            # clone: a state is often a view of a whole call's stacked states, which would stay alive
            exported = states[local].clone()
            if self.recording:
                self.exports[self.layer].states[glob] = exported
        return out


class HandoffBanks:
    """The hand-overs of a cut forest's parts, and the gradients later parts send back to them.

    Part ``q`` exports the rows of its ``export_token_ids`` (keys/values and conv inputs, per
    layer) and the final states of its ``export_nodes``. A later part reads some of those rows:
    :meth:`gather` picks them from the few parts that produced them (by index, in the order of the
    reader's ``external_tokens``), so its cost grows with the rows read, not with the number of
    parts run so far. In backward, :meth:`send_back` adds a reader's leaf gradients to the
    producers' export gradients, which :meth:`received` hands to the producer's own backward.
    """

    def __init__(self, layouts: list[TreeLayout], num_tokens: int):
        self.layouts = layouts
        sizes = [lay.export_token_ids.size for lay in layouts]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        # global token -> its row in the concatenation of every part's exports
        self.export_row = np.full(num_tokens, -1, dtype=np.int64)
        for q, lay in enumerate(layouts):
            self.export_row[lay.export_token_ids] = self.offsets[q] + np.arange(sizes[q])
        self.state_producer = {glob: q for q, lay in enumerate(layouts) for _, glob in lay.export_nodes}
        self.exports: list[list[LayerHandoff] | None] = [None] * len(layouts)
        self.grads: list[dict[tuple[int, str, int | None], torch.Tensor]] = [{} for _ in layouts]
        self._sources: dict[
            int | tuple[int, int], tuple[list[tuple[int, torch.Tensor, torch.Tensor]], torch.Tensor | None]
        ] = {}
        self._conv_window: dict[int, int | None] = {}  # per reader: the window its last gather took

    def put(self, part: int, exports: list[LayerHandoff]) -> None:
        self.exports[part] = exports

    def release(self, part: int) -> None:
        """Drop a part's exports once every part that reads them is done."""
        self.exports[part] = None

    def sources(self, part: int, conv_window: int | None = None):
        """For the reader ``part``: ([(producer, positions in the reader's rows, rows in the producer)],
        the permutation from producer order back to the reader's order, or None when already in order).
        The reader's rows are its context rows, or with ``conv_window`` those that convolutions of
        that window read (:meth:`~harts.plan.layout.TreeLayout.conv_context_rows`)."""
        key = part if conv_window is None else (part, conv_window)
        if key not in self._sources:
            lay = self.layouts[part]
            tokens = lay.external_tokens
            if conv_window is not None:
                tokens = tokens[lay.conv_context_rows(conv_window)]
            rows = self.export_row[tokens]
            if rows.size and rows.min() < 0:
                raise AssertionError("a part reads a token no earlier part exports")
            producer = np.searchsorted(self.offsets, rows, side="right") - 1
            order = np.argsort(producer, kind="stable")
            device = lay.device
            groups = []
            for q in np.unique(producer).tolist():
                sel = np.flatnonzero(producer == q)
                groups.append(
                    (
                        q,
                        torch.as_tensor(sel, device=device),
                        torch.as_tensor(rows[sel] - self.offsets[q], device=device),
                    )
                )
            identity = bool((order == np.arange(order.size)).all())
            inverse = None if identity else torch.as_tensor(np.argsort(order), device=device)
            self._sources[key] = (groups, inverse)
        return self._sources[key]

    def producers(self, part: int) -> set[int]:
        """The earlier parts whose exports ``part`` reads (rows and states)."""
        lay = self.layouts[part]
        if not lay.root_state_source:
            return set()
        groups, _ = self.sources(part)
        states = {self.state_producer[n] for n in lay.root_state_source.values()}
        return {q for q, _, _ in groups} | states

    def gather(self, part: int, num_layers: int, conv_window: int | None = None) -> list[LayerHandoff] | None:
        """What ``part`` reads from earlier parts, per layer (None for a part without context).

        Keys and values are gathered for every context row; convolution inputs, with ``conv_window``
        (the model's widest convolution, once a part has run it), only for the rows a convolution of
        that window reaches (the last ``conv_window - 1`` tokens above each root), which on a long
        context is a few rows instead of all of them, and so are their gradients sent back.
        """
        lay = self.layouts[part]
        if not lay.root_state_source:
            return None
        self._conv_window[part] = conv_window
        every_row = self.sources(part)
        by_name = {
            "key": every_row,
            "value": every_row,
            "conv_input": self.sources(part, conv_window),
            "index_rows": every_row,
        }
        nodes = sorted(set(lay.root_state_source.values()))
        out = []
        for layer in range(num_layers):
            picked = {}
            for name, dim in (("key", 1), ("value", 1), ("conv_input", 0), ("index_rows", 0)):
                groups, inverse = by_name[name]
                pieces = [
                    getattr(self.exports[q][layer], name).index_select(dim, local)
                    for q, _, local in groups
                    if getattr(self.exports[q][layer], name) is not None
                ]
                if not pieces:
                    picked[name] = None
                    continue
                joined = torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]
                picked[name] = joined.index_select(dim, inverse) if inverse is not None else joined
            held = ((n, self.exports[self.state_producer[n]][layer].states) for n in nodes)
            states = {n: by_node[n] for n, by_node in held if n in by_node}  # linear layers only
            out.append(LayerHandoff(states=states, conv_window=conv_window, **picked))
        return out

    def send_back(self, part: int, layer: int, name: str, node: int | None, grad: torch.Tensor) -> None:
        """Add the gradient of a leaf of ``part`` (a gathered tensor or a state) to its producers."""
        if name == "state":
            q = self.state_producer[node]
            key = (layer, name, node)
            self.grads[q][key] = self.grads[q][key] + grad if key in self.grads[q] else grad
            return
        dim = 1 if name in ("key", "value") else 0
        groups, _ = self.sources(part, self._conv_window.get(part) if name == "conv_input" else None)
        for q, sel, local in groups:
            key = (layer, name, None)
            if key not in self.grads[q]:
                self.grads[q][key] = torch.zeros_like(getattr(self.exports[q][layer], name))
            self.grads[q][key].index_add_(dim, local, grad.index_select(dim, sel))

    def received(self, part: int) -> dict[tuple[int, str, int | None], torch.Tensor]:
        """{(layer, "key" | "value" | "conv_input" | "state", node or None): gradient}: what later
        parts sent back to ``part``'s exports; handed over once."""
        grads, self.grads[part] = self.grads[part], {}
        return grads
