"""The gated delta rule with per-channel log-decay: KDA, and Gated DeltaNet with its per-head gate.

    S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (scale q_t)

- :mod:`~harts.ops.delta_rule.chunk`: the chunked op over right-padded segments (the contract's
  op, :data:`harts.ops.recurrence.DELTA_RULE`), and its arithmetic over chunks of any layout;
- :mod:`~harts.ops.delta_rule.chunk_tree`: the same over a chunk tree, one call per layer;
- :mod:`~harts.ops.delta_rule.naive`: the fp64 per-token reference the tests compare against.

Device kernels for it are a backend's (:mod:`harts.ops.fla_backend`).
"""

from harts.ops.delta_rule.chunk import chunked_gated_delta_rule
from harts.ops.delta_rule.chunk_tree import chunk_tree_gated_delta_rule
from harts.ops.delta_rule.naive import naive_recurrent_gated_delta_rule
from harts.ops.delta_rule.packed import packed_gated_delta_rule

__all__ = [
    "chunk_tree_gated_delta_rule",
    "chunked_gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "packed_gated_delta_rule",
]
