"""The recurrent-mixer contract: what a linear-attention or state-space layer must provide.

Every recurrent token mixer harts runs over a forest (KDA, Gated DeltaNet, lightning attention,
Mamba-2's SSD, ...) is described once by a :class:`Recurrence`:

- ``inputs``: the names of its per-token inputs, each a tensor [N, H, ...] over the unique tokens
  (heads second), in the order the chunked op takes them; ``per_head_inputs`` names those that may
  come as one value per head ([N, H] or [N, H, 1], a gate that is the same for every key channel)
  instead of one per key channel ([N, H, K]): every kernel of the recurrence takes both (the plain
  ones expand over K themselves, :func:`harts.ops.chunked.gate_per_key`), so a per-head gate
  reaches a device kernel that has a per-head form unexpanded;
- its state: one fp32 tensor [H, K, V] per sequence (:meth:`Recurrence.state_shape` reads H, K, V
  from the inputs), the only thing that crosses a node boundary or a micro-batch cut;
- ``chunked``: the plain-PyTorch op that runs a batch of right-padded segments, each from its own
  initial state:

      op(*inputs [B, T, H, ...], initial_state [B, H, K, V] fp32, lengths [B], chunk_size, scale,
         output_states_at [B, S] | None)
        -> (o [B, T, H, V], final [B, H, K, V] fp32[, states [B, S, H, K, V]])

  differentiable in every input and in ``initial_state``; positions at or past a segment's length
  leave its state unchanged and give zero output; ``states`` are the states after that many tokens
  (inner node boundaries of a chain segment, :mod:`harts.plan.linear`). :meth:`Recurrence.kernel`
  resolves the op on every call: the active backend's kernel registered under the recurrence's
  ``name`` (:mod:`harts.ops.backends`), else ``chunked``;
- ``tree_kernel``: the same over a chunk tree (:mod:`harts.plan.chunk_tree`), one call per layer;
- ``packed_kernel``: the same over packed chunks (:mod:`harts.plan.packed_chunks`: chunks that hold
  the tokens of several nodes), one call per layer, returning the states buffer (the roots'
  initial states, then every emitted state) in place of per-chunk end states;
- ``reference``: a plain per-token loop, ``ref(*inputs [B, T, H, ...], initial_state, scale) ->
  (o, final)`` in fp64, the oracle the tests compare the chunked op (and the tree runs) against.

The tree executor (:func:`harts.ops.tree_recurrence.tree_recurrence`), the linear plans and the
hand-over at cuts (:mod:`harts.runtime.handoff`) see only this contract, so a layer that meets it
runs over any forest, under any budget, with no change to them.

Built in: :data:`DELTA_RULE` (gated delta rule with per-channel log-decay: KDA; GDN with its
per-head gate) and :data:`GATED_LINEAR_ATTENTION` (S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,
o_t = S_t^T q_t: lightning attention, Mamba-2, Mamba), each laid out as a package of its forms
(:mod:`harts.ops.delta_rule`, :mod:`harts.ops.gated_linear_attention`), and both listed in
:data:`ALL_RECURRENCES`. What this leaves out:
recurrences whose state is not one [H, K, V] tensor per sequence (e.g. several states per layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harts.ops.backends import current_backend
from harts.ops.delta_rule import (
    chunk_tree_gated_delta_rule,
    chunked_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    packed_gated_delta_rule,
)
from harts.ops.gated_linear_attention import (
    chunk_tree_gated_linear_attention,
    chunked_gated_linear_attention,
    naive_recurrent_gated_linear_attention,
    packed_gated_linear_attention,
)

__all__ = ["Recurrence", "DELTA_RULE", "GATED_LINEAR_ATTENTION", "ALL_RECURRENCES"]


@dataclass(frozen=True)
class Recurrence:
    """One recurrent layer kind under the contract above.

    ``value_input`` and ``key_input`` name the inputs whose last dimensions are V and K (H is
    dimension 1 of the key input).
    """

    name: str
    inputs: tuple[str, ...]
    chunked: Callable
    reference: Callable
    key_input: str = "k"
    value_input: str = "v"
    tree_kernel: Callable | None = None
    packed_kernel: Callable | None = None
    per_head_inputs: tuple[str, ...] = ()

    def kernel(self) -> Callable:
        """The chunked op to run now: the active backend's for this recurrence, else ``chunked``."""
        return current_backend().recurrences.get(self.name, self.chunked)

    def state_shape(self, inputs: tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
        """(H, K, V) of the state, from the per-token inputs [N, H, ...]."""
        k = inputs[self.inputs.index(self.key_input)]
        v = inputs[self.inputs.index(self.value_input)]
        return k.shape[1], k.shape[-1], v.shape[-1]

    def check(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """ValueError naming the input when the count, the token/head dimensions or the shape of a
        per-head input disagree."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{self.name} takes {len(self.inputs)} inputs {self.inputs}, got {len(inputs)}")
        n, h = inputs[0].shape[:2]
        kd = inputs[self.inputs.index(self.key_input)].shape[-1]
        for name, x in zip(self.inputs, inputs, strict=True):
            if x.dim() < 2 or x.shape[:2] != (n, h):
                raise ValueError(
                    f"{self.name}: input {name!r} must be [N={n}, H={h}, ...], got {tuple(x.shape)}"
                )
            if name in self.per_head_inputs and x.shape[2:] not in ((), (1,), (kd,)):
                raise ValueError(
                    f"{self.name}: input {name!r} must be [N, H, K={kd}] or one per head [N, H] or "
                    f"[N, H, 1], got {tuple(x.shape)}"
                )


#: q, k [N, H, K]; v [N, H, V]; g [N, H, K] log-decay per key channel, or per head [N, H] (GDN);
#: beta [N, H]. Scale default K^-0.5.
DELTA_RULE = Recurrence(
    "delta_rule",
    ("q", "k", "v", "g", "beta"),
    chunked_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    tree_kernel=chunk_tree_gated_delta_rule,
    packed_kernel=packed_gated_delta_rule,
    per_head_inputs=("g",),
)

#: q, k [N, H, K]; v [N, H, V]; g [N, H, K] log-decay per key channel, or per head [N, H]. Scale default 1.
GATED_LINEAR_ATTENTION = Recurrence(
    "gated_linear_attention",
    ("q", "k", "v", "g"),
    chunked_gated_linear_attention,
    naive_recurrent_gated_linear_attention,
    tree_kernel=chunk_tree_gated_linear_attention,
    packed_kernel=packed_gated_linear_attention,
    per_head_inputs=("g",),
)

#: Every recurrence harts runs. The contract's checks (outputs, every node's state and all gradients
#: against the fp64 reference, under every linear plan) run over this tuple, so a recurrence listed
#: here is checked whole.
ALL_RECURRENCES: tuple[Recurrence, ...] = (DELTA_RULE, GATED_LINEAR_ATTENTION)
