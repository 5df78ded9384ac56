"""The ``fla`` backend: flash-linear-attention's varlen delta-rule kernels and FlexAttention tree attention.

Selected with ``harts.ops.backends.use_backend("fla")``, a context around any entry point
(docs/gpu.md). Needs the ``gpu`` extra (flash-linear-attention, triton); fla and triton are imported
only when the backend is first selected, so the CPU install never loads them.

Delta rule (:func:`fla_delta_rule`, the signature of
:func:`harts.ops.delta_rule.chunked_gated_delta_rule`, registered under the recurrence's name in
:data:`RECURRENCES`). harts hands a call as right-padded segments
[B, T, H, K] with per-segment fp32 initial states; fla's chunked kernels take one packed sequence
[1, sum L, H, K] with ``cu_seqlens`` and one initial state per sequence, and backpropagate into the
initial states and from the final states. The conversion:

- the valid slots of every segment are gathered into the packed sequence (padding never reaches the
  kernel) and the outputs scattered back, zeros at padded slots, as the plain kernel returns them;
- q and k are used as given (``use_qk_l2norm_in_kernel=False``: the mixers normalise before the
  call), ``scale`` multiplies q·k as in harts (default K ** -0.5), beta is post-sigmoid, g is the
  log-decay (``use_gate_in_kernel=False``; fla takes natural-log gates and rescales them itself);
- the gate: a per-head gate (GDN's, [B, T, H] or [B, T, H, 1] as the contract lets it come,
  :data:`~harts.ops.recurrence.DELTA_RULE`'s ``per_head_inputs``) runs ``chunk_gated_delta_rule``,
  which takes it as it is and returns its per-head gradient; a gate per key channel [B, T, H, K]
  runs ``chunk_kda``, exact for every gate, even one whose K channels happen to be equal (their
  gradients are K free values, which the per-head kernel would sum into one);
- ``output_states_at`` (the states after inner nodes of a chain segment): fla returns only final
  states, so each segment is split at the requested offsets into pieces that run in rounds: round r
  runs the r-th piece of every segment in one packed call, from the final states of round r - 1.
  A call without inner offsets (the depth plan, or a chain call of one-node segments) is one kernel
  call; a chain call costs one kernel call per piece of its longest chain.
- ``chunk_size`` (the plain kernel's CPU-tuned chunk) is not passed on: fla's kernels use their own.

Tree attention (:func:`flex_tree_attention`, the signature of
:func:`harts.ops.tree_attention.tree_attention`): one ``flex_attention`` call over the whole key space
with a block mask. The mask comes from the plan itself: each row of a group's gathered keys is one
path (ancestor keys, then the node's own), so adjacent key columns give every key's predecessor on
its path; a pre-order numbering of that key forest makes "key j lies on query i's path" the
interval test ``pre[j] <= pre[self(i)] < end[j]`` (ancestor or self), evaluated per block by
``create_block_mask``. GQA by ``enable_gqa``. On CUDA the call is compiled (eager flex_attention
materialises the scores); elsewhere it runs eager, forward only: torch refuses FlexAttention's
backward on the CPU, and so does this function, before any compute.

Left out: the short convolution stays on its plain gather (a memory-bound weighted sum along paths,
with no sequence layout for fla's ``causal_conv1d`` to exploit); bf16 numerics are fla's (its
kernels accumulate in fp32, matmul inputs in the input dtype).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from harts.ops.chunked import head_gate
from harts.plan.attention import TreeAttentionPlan

__all__ = ["RECURRENCES", "require_fla", "fla_delta_rule", "flex_tree_attention", "tree_block_mask"]


def require_fla() -> None:
    """Raises ImportError naming the extra when fla or triton is missing (before any compute)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.kda  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"the 'fla' backend needs flash-linear-attention and triton (pip install 'harts[gpu]'): {e}"
        ) from e


# ---- delta rule -------------------------------------------------------------------------------------


def _check_delta_inputs(q, k, v, g, beta, initial_state, lengths, output_states_at):
    if k.dim() != 4 or q.shape != k.shape:
        raise ValueError(
            f"expected q, k [B, T, H, K] of one shape, got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    B, T, H, K = k.shape
    if g.shape not in ((B, T, H), (B, T, H, 1), (B, T, H, K)):
        raise ValueError(
            f"expected g [B={B}, T={T}, H={H}, K={K}] or per head [B, T, H] / [B, T, H, 1], "
            f"got {tuple(g.shape)}"
        )
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"expected v [B={B}, T={T}, H={H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"expected beta [B={B}, T={T}, H={H}], got {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(
            f"expected initial_state [B={B}, H={H}, K={K}, V={v.shape[-1]}], got {tuple(initial_state.shape)}"
        )
    if lengths is not None and (lengths.shape != (B,) or bool(((lengths < 0) | (lengths > T)).any())):
        raise ValueError(f"lengths must be [B={B}] in [0, T={T}], got {lengths.tolist()}")
    if output_states_at is not None and (output_states_at.dim() != 2 or output_states_at.shape[0] != B):
        raise ValueError(f"output_states_at must be [B={B}, S], got {tuple(output_states_at.shape)}")


def fla_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    output_states_at: torch.Tensor | None = None,
):
    """:func:`harts.ops.delta_rule.chunked_gated_delta_rule` by fla's varlen kernels (module docstring).

    q, k [B, T, H, K]; g [B, T, H, K], or per head [B, T, H] / [B, T, H, 1]; v [B, T, H, V]; beta
    [B, T, H]; initial_state [B, H, K, V] fp32 (zeros if None); lengths [B]; output_states_at [B, S]
    token counts. Returns (o [B, T, H, V] in q's dtype,
    final state [B, H, K, V] fp32[, states [B, S, H, K, V] fp32]). ``chunk_size`` is accepted and
    ignored (fla's kernels pick their own chunk).
    """
    del chunk_size
    _check_delta_inputs(q, k, v, g, beta, initial_state, lengths, output_states_at)
    B, T, H, K = k.shape
    V = v.shape[-1]
    lens = [T] * B if lengths is None else [int(x) for x in lengths.tolist()]
    if initial_state is None:
        initial_state = torch.zeros(B, H, K, V, dtype=torch.float32, device=k.device)
    # Each segment's cut points: 0, the requested inner offsets, its length. A piece runs between two.
    at = None if output_states_at is None else output_states_at.tolist()
    cuts = [
        sorted({0, n} | ({min(max(int(a), 0), n) for a in at[b]} if at is not None else set()))
        for b, n in enumerate(lens)
    ]
    per_head = head_gate(g, k)
    gate = g.reshape(B * T, H, K) if per_head is None else per_head.reshape(B * T, H)
    flat = (
        q.reshape(B * T, H, K),
        k.reshape(B * T, H, K),
        v.reshape(B * T, H, V),
        gate,
        beta.reshape(B * T, H),
    )
    state = list(initial_state.float().unbind(0))
    reached = [{0: state[b]} for b in range(B)]  # state after c tokens, per cut c
    rows, outs = [], []
    for r in range(max(len(c) for c in cuts) - 1):
        pieces = [(b, cuts[b][r], cuts[b][r + 1]) for b in range(B) if r + 1 < len(cuts[b])]
        pieces = [p for p in pieces if p[2] > p[1]]
        if not pieces:
            continue
        idx = torch.cat([torch.arange(b * T + s, b * T + e) for b, s, e in pieces]).to(k.device)
        seqlens = torch.tensor([0] + [e - s for _, s, e in pieces]).cumsum(0)
        o, final = _run_packed(
            *(x[idx][None] for x in flat),
            torch.stack([state[b] for b, _, _ in pieces]),
            seqlens,
            scale,
            per_head=per_head is not None,
        )
        for i, (b, _, e) in enumerate(pieces):
            state[b] = final[i]
            reached[b][e] = final[i]
        rows.append(idx)
        outs.append(o[0])
    o = q.new_zeros(B * T, H, V, dtype=q.dtype)
    if outs:
        o = o.index_copy(0, torch.cat(rows), torch.cat(outs).to(q.dtype))
    o = o.view(B, T, H, V)
    final_state = torch.stack(state)
    if at is None:
        return o, final_state
    states = torch.stack(
        [
            torch.stack([reached[b][min(max(int(a), 0), lens[b])] for a in at[b]])
            if at[b]
            else initial_state.new_zeros(0, H, K, V)
            for b in range(B)
        ]
    )
    return o, final_state, states


#: the recurrences this backend has a kernel for, by name (:data:`harts.ops.recurrence.DELTA_RULE`'s)
RECURRENCES = {"delta_rule": fla_delta_rule}


def _run_packed(q, k, v, g, beta, init, seqlens, scale, per_head: bool):
    """One fla call over a packed sequence [1, L, H, .] of len(seqlens) - 1 segments; g [1, L, H]
    per head (``per_head``) or [1, L, H, K]."""
    cu_cpu = seqlens.to(torch.long)
    cu = cu_cpu.to(q.device)
    if per_head:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        return chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=init,
            output_final_state=True,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )
    from fla.ops.kda import chunk_kda

    return chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=init,
        output_final_state=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )


# ---- tree attention ---------------------------------------------------------------------------------


def _key_forest(plan: TreeAttentionPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre [m], end [m], self key [n]): pre-order interval of every key in the forest of key paths,
    and the key row of each query itself, all read from the plan's gathered index layout."""
    n, m = plan.num_queries, plan.num_keys
    key_index = plan.key_index.cpu().numpy()
    q_sizes = [gr.size * gr.lq for gr in plan.groups]
    k_sizes = [gr.size * gr.lk for gr in plan.groups]
    q_start, k_start = np.cumsum([0] + q_sizes), np.cumsum([0] + k_sizes)
    parent = np.full(m + 1, -1, dtype=np.int64)
    for gi, gr in enumerate(plan.groups):
        rows = key_index[k_start[gi] : k_start[gi + 1]].reshape(gr.size, gr.lk)
        # Adjacent real keys of one gathered row are consecutive on one path (ancestors, then own).
        left, right = rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1)
        real = (left != m) & (right != m)
        parent[right[real]] = left[real]
    # Query t sits at column c of its group slot; its own key is column Lk - Lq + c of that slot.
    pos = (plan.row_base + plan.row_offset).cpu().numpy()
    group = np.searchsorted(q_start, pos, side="right") - 1
    lq = np.array([gr.lq for gr in plan.groups], dtype=np.int64)[group]
    lk = np.array([gr.lk for gr in plan.groups], dtype=np.int64)[group]
    within = pos - q_start[group]
    self_key = key_index[k_start[group] + (within // lq) * lk + lk - lq + within % lq] if n else pos
    # Pre-order numbering by an explicit stack (keys are few per micro-batch: one host pass).
    parent = parent[:m]
    order = np.argsort(parent, kind="stable")
    first = np.searchsorted(parent[order], np.arange(-1, m), side="left")
    last = np.searchsorted(parent[order], np.arange(-1, m), side="right")
    pre, end = np.zeros(m, dtype=np.int64), np.zeros(m, dtype=np.int64)
    counter, stack = 0, [(int(x), False) for x in order[first[0] : last[0]][::-1]]
    while stack:
        node, done = stack.pop()
        if done:
            end[node] = counter
            continue
        pre[node] = counter
        counter += 1
        stack.append((node, True))
        stack.extend((int(c), False) for c in order[first[node + 1] : last[node + 1]][::-1])
    return pre, end, np.asarray(self_key, dtype=np.int64)


def tree_block_mask(plan: TreeAttentionPlan, device: torch.device | str):
    """FlexAttention BlockMask [1, 1, n, m] of the plan's visibility, cached on the plan."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = torch.device(device)
    key = ("flex_block_mask", str(device))
    if key not in plan._cache:
        pre, end, self_key = _key_forest(plan.whole())  # whole paths: no keys left out for prefixes
        kv_pre, kv_end = (torch.from_numpy(x).to(device) for x in (pre, end))
        q_pre = torch.from_numpy(pre[self_key] if self_key.size else self_key).to(device)

        def on_path(b, h, q_idx, kv_idx):  # key kv_idx is an ancestor-or-self of query q_idx's own key
            return (kv_pre[kv_idx] <= q_pre[q_idx]) & (q_pre[q_idx] < kv_end[kv_idx])

        plan._cache[key] = create_block_mask(
            on_path, B=None, H=None, Q_LEN=plan.num_queries, KV_LEN=plan.num_keys, device=device
        )
    return plan._cache[key]


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def flex_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TreeAttentionPlan,
    scaling: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`harts.ops.tree_attention.tree_attention` by one ``flex_attention`` call. Returns [n, H, Dv].

    q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv]; query head h reads key/value head h // (H // Hkv).
    Differentiable on CUDA; elsewhere forward only (refused when a gradient is wanted).
    """
    from torch.nn.attention.flex_attention import flex_attention

    if plan.windowed(window) is not plan or sinks is not None:
        raise ValueError(
            "the 'fla' backend's tree attention has no sliding window or attention sinks; "
            "run a model whose layers use them (a window set in its config, or sinks) on the "
            "'torch' backend"
        )
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"expected q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv], got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    h, n, dk = q.shape
    hkv, m, dv = v.shape
    if k.shape[:2] != (hkv, m) or k.shape[2] != dk or h % hkv:
        raise ValueError(
            f"inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(H must be a multiple of Hkv)"
        )
    if (n, m) != (plan.num_queries, plan.num_keys):
        raise ValueError(f"plan is for {plan.num_queries} queries and {plan.num_keys} keys, got {n} and {m}")
    cuda = q.device.type == "cuda"
    if not cuda and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            f"the 'fla' backend's tree attention (FlexAttention) backpropagates on CUDA only, "
            f"and these tensors are on {q.device}: use the 'torch' backend there"
        )
    if n == 0:
        return q.new_zeros(0, h, dv)
    run = _compiled_flex() if cuda else flex_attention
    out = run(
        q[None],
        k[None],
        v[None],
        block_mask=tree_block_mask(plan, q.device),
        scale=scaling,
        enable_gqa=h != hkv,
    )
    return out[0].transpose(0, 1)
