"""The recurrent-mixer contract: what a linear-attention or state-space layer must provide.

Every recurrent token mixer harts runs over a forest (KDA, Gated DeltaNet, lightning attention,
Mamba-2's SSD, ...) is described once by a :class:`Recurrence`:

- ``inputs``: the names of its per-token inputs, each a tensor [N, H, ...] over the unique tokens
  (heads second), in the order the chunked op takes them;
- its state: one fp32 tensor [H, K, V] per sequence (:meth:`Recurrence.state_shape` reads H, K, V
  from the inputs), the only thing that crosses a node boundary or a micro-batch cut;
- ``chunked``: the op that runs a batch of right-padded segments, each from its own initial state:

      op(*inputs [B, T, H, ...], initial_state [B, H, K, V] fp32, lengths [B], chunk_size, scale,
         output_states_at [B, S] | None)
        -> (o [B, T, H, V], final [B, H, K, V] fp32[, states [B, S, H, K, V]])

  differentiable in every input and in ``initial_state``; positions at or past a segment's length
  leave its state unchanged and give zero output; ``states`` are the states after that many tokens
  (inner node boundaries of a chain segment, :mod:`harts.plan.waves`). Resolved on every call, so
  the backend seam (:mod:`harts.ops.backends`) can swap the kernel;
- ``reference``: a plain per-token loop, ``ref(*inputs [B, T, H, ...], initial_state, scale) ->
  (o, final)`` in fp64, the oracle the tests compare the chunked op (and the tree runs) against.

The tree executor (:func:`harts.ops.tree_delta_rule.tree_recurrence`), the linear plans and the
hand-over at cuts (:mod:`harts.runtime.handoff`) see only this contract, so a layer that meets it
runs over any forest, under any budget, with no change to them.

Built in: :data:`DELTA_RULE` (gated delta rule with per-channel log-decay: KDA, and GDN with its
per-head gate expanded over K) and :data:`GATED_LINEAR_ATTENTION` (S_t = diag(exp(g_t)) S_{t-1} +
k_t v_t^T, o_t = S_t^T q_t: lightning attention, Mamba-2, Mamba). What this leaves out: recurrences
whose state is not one [H, K, V] tensor per sequence (e.g. several states per layer), and
backend kernels for anything but the delta rule (the others run their plain-PyTorch chunked op on
every backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Recurrence", "DELTA_RULE", "GATED_LINEAR_ATTENTION"]


@dataclass(frozen=True)
class Recurrence:
    """One recurrent layer kind under the contract above.

    ``kernel()`` returns the chunked op to run now (a backend may supply it); ``reference`` is the
    fp64 loop. ``value_input`` and ``key_input`` name the inputs whose last dimensions are V and
    K (H is dimension 1 of the key input).
    """

    name: str
    inputs: tuple[str, ...]
    kernel: Callable[[], Callable]
    reference: Callable
    key_input: str = "k"
    value_input: str = "v"
    # the same recurrence over a chunk tree (:mod:`harts.ops.chunk_tree`), or None
    tree_kernel: Callable | None = None

    def state_shape(self, inputs: tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
        """(H, K, V) of the state, from the per-token inputs [N, H, ...]."""
        k = inputs[self.inputs.index(self.key_input)]
        v = inputs[self.inputs.index(self.value_input)]
        return k.shape[1], k.shape[-1], v.shape[-1]

    def check(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """ValueError naming the input when the count or the token/head dimensions disagree."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{self.name} takes {len(self.inputs)} inputs {self.inputs}, got {len(inputs)}")
        n, h = inputs[0].shape[:2]
        for name, x in zip(self.inputs, inputs, strict=True):
            if x.dim() < 2 or x.shape[:2] != (n, h):
                raise ValueError(
                    f"{self.name}: input {name!r} must be [N={n}, H={h}, ...], got {tuple(x.shape)}"
                )


def _delta_rule_kernel() -> Callable:
    from harts.ops.backends import current_backend

    return current_backend().delta_rule


def _delta_rule_reference(*args, **kwargs):
    from harts.ops.delta_rule_naive import naive_recurrent_gated_delta_rule

    return naive_recurrent_gated_delta_rule(*args, **kwargs)


def _gla_kernel() -> Callable:
    from harts.ops.gated_linear_attention import chunked_gated_linear_attention

    return chunked_gated_linear_attention


def _gla_reference(*args, **kwargs):
    from harts.ops.gated_linear_attention import naive_recurrent_gated_linear_attention

    return naive_recurrent_gated_linear_attention(*args, **kwargs)


def _delta_rule_tree(*args, **kwargs):
    from harts.ops.chunk_tree import chunk_tree_gated_delta_rule

    return chunk_tree_gated_delta_rule(*args, **kwargs)


def _gla_tree(*args, **kwargs):
    from harts.ops.chunk_tree import chunk_tree_gated_linear_attention

    return chunk_tree_gated_linear_attention(*args, **kwargs)


#: q, k [N, H, K]; v [N, H, V]; g [N, H, K] log-decay per key channel; beta [N, H]. Scale default K^-0.5.
DELTA_RULE = Recurrence(
    "delta_rule", ("q", "k", "v", "g", "beta"), _delta_rule_kernel, _delta_rule_reference,
    tree_kernel=_delta_rule_tree,
)  # fmt: skip

#: q, k [N, H, K]; v [N, H, V]; g [N, H, K] log-decay per key channel. Scale default 1.
GATED_LINEAR_ATTENTION = Recurrence(
    "gated_linear_attention", ("q", "k", "v", "g"), _gla_kernel, _gla_reference, tree_kernel=_gla_tree
)
