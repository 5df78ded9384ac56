"""Full attention over a forest of tokens.

A token attends to every token on its own path: the tokens of its ancestor nodes and the earlier
tokens of its own node. This is exactly causal attention of each root-to-leaf trajectory,
computed once per unique query token.

Two forms live here:

- the plain form (:func:`masked_tree_attention` with :func:`plan_reference_mask`): one
  scaled_dot_product_attention (SDPA) call with a dense boolean mask [n, m]. Exact and simple,
  the reference the tests hold the grouped form to; cost and memory O(n m).
- the grouped form (:func:`tree_attention` over a plan from :mod:`harts.plan.attention`): each
  node's queries, split into query blocks, attend to [ancestor keys ; own keys], gathered by
  index; blocks of similar shape are padded into a few batched SDPA calls. Cost is about the
  exact cost, the sum of path positions, plus bounded waste (causal triangles of the blocks and
  padding). The key
  space may be larger than the query space (keys of ancestors computed in an earlier
  micro-batch).

How padding stays exact: inside a group, keys are right-aligned (left padding, ancestors, own keys
ending at the last column) and queries right-aligned too, so every block's causal rule is the same
bottom-right triangle and one [Lq, Lk] mask serves the group. In groups with key padding,
padding keys are removed in one of two ways, each giving a padding key the finite score -huge
(weight exactly 0, and no NaN for a padding query row that sees only padding) and leaving real
scores unchanged:

- a per-block mask: the causal mask plus -huge at each block's padding columns, [G, r * Lq, Lk]
  for the group, built once per plan and shared by the layers. The padding columns gather any
  real key (their weight is 0, and so are their gradients). It costs no copy of q, k, v and keeps
  the head width, but its memory grows with the group's scores, so the plan's groups take it in
  order while the masks of all of them stay within :data:`_MASKED_PADDING_ELEMENTS` (4 MiB in
  float32 per plan and head layout);
- one extra head channel: queries carry 1 there, real keys 0 and the padding key a huge negative
  number. One [Lq, Lk] mask serves the group whatever its size, for one more channel (CPU flash
  attention runs a width of 33 about 15% slower than 32) and a widened copy of q, k and v.

Groups without key padding (all large blocks, which run alone) need neither.

Equal values: where all the real values of a block (of a key/value head) are one value c (a
repeated token whose hidden states are equal, with values that carry no position), the block
attends to its values less c and adds c back. Softmax weights sum to one, so the result is the
same in exact arithmetic, and in floating point it is then exact too: the output is c and the
query and key gradients are zero, not rounding noise (~1e-6 in fp32, the stock attention's too,
which gradient checks of exactly-zero gradients count as error). c's own gradient, the sum over
rows i of dO_i (1 - sum_j P_ij) over all the block's columns j (the sink and padding keys'
included), is zero in exact arithmetic, so none is passed back: the values' gradients stay P^T dO.
Other blocks are untouched (shifting every block by its first value doubles the rounding error of
outputs whose values have no common part, measured), as are float16 and bfloat16.

Shared prefixes: a plan may run some runs of ancestor keys as calls of their own (the plan's
``prefixes``, :class:`~harts.plan.attention.SharedPrefix`): every query below a shared prompt
attends to its keys in one call over contiguous rows, no mask and no gather, and the query blocks
gather only the rest of their paths. Each call returns its output and logsumexp; a query's results
merge by weights exp(lse_i - lse), lse = log sum_i exp(lse_i), which is its softmax over all its
keys. Backward runs each call's fused kernel with the merged output and logsumexp: its scores then
give exactly the whole softmax's weights on its keys, so the gradients are the whole attention's
(split-key attention backward, as ring attention runs it). The prefixes run with CPU flash
attention in float32 and float64 only, and not where some prefix's values are one value for a
key/value head ("Equal values" would then hold only to rounding): the op runs the plan's
:meth:`~harts.plan.attention.TreeAttentionPlan.whole` form instead, as it does on other devices
and in half precision. A sink joins each query's block, so the softmax counts it once. Blocks of
one key that no prefix reaches (a one-token root: its key is its whole path) keep their groups and
the exact "lone key" path (:meth:`~harts.plan.attention.TreeAttentionPlan.lone_unmerged`), so
their output is the value and their query gradient zero by construction, not by the fused
kernel's rounding.

Dense plans: where the plan says one call over all [n, m] scores costs less than its groups
(:meth:`~harts.plan.attention.TreeAttentionPlan.dense_for`: small micro-batches, whose groups' fixed
costs outweigh the scores they skip), CPU flash attention in float32 or float64 runs once over q, k
and v in place with the plan's additive mask (0 on each query's path, -finfo.max / 4 elsewhere: a
finite score, so a kernel block in which a row sees no key yields no NaN, and its weight is exactly
zero beside the row's real scores). The hidden scores still read every key and value, so the
result is refused, and the groups run, when the output is not finite (a NaN would otherwise reach
queries whose paths do not hold it). Two cases keep the groups' exactness: a query whose path is
one key (a root's first token) has weight exactly 1 on it, and backward passes its output gradient
to that value and none to the query or key, as the lone-key path does; and where the first two
values of some path are equal, a query whose visible values are all one value may exist, so the
groups run ("Equal values" below needs per-block shifts). Saved: q, k, v, the output and the
logsumexp [Hkv, r * n].

Backward: the gathered rows are not saved (on forests of short nodes the gathered key rows are
several times the token count). Saved are q, k, v as passed, the returned output and, per group
run by CPU flash attention, its logsumexp ([Hkv, G, r * Lq] floats) and, where some block's values
are one value, the shift of "Equal values" ([Hkv, G, 1, dp]); backward gathers each group's
rows again, runs the fused CPU flash backward kernel on them and adds the gradients back by index
(key and value gradients, summed over blocks, in float32 for float16/bfloat16). Groups SDPA would
not run by CPU flash attention (any other device) recompute their forward in backward and
differentiate it by autograd: one more forward per group, and then the output is not saved.
Where it is, modifying it in place before backward raises. No double backward (the backward is
once-differentiable).

Sliding windows and attention sinks (``tree_attention(..., window=W, sinks=s)``): a window runs
the plan's windowed form (:meth:`~harts.plan.attention.TreeAttentionPlan.windowed`: each token sees
the last W tokens of its path). A sink is a learned per-head logit s_h added to the softmax
denominator (gpt-oss): the weights become exp(score_j) / (sum_j exp(score_j) + exp(s_h)). It runs
as one more key per block, appended after the block's keys and always visible, whose score is s_h
and whose value is zero: r more channels, where query head s of a key/value head carries 1 in
channel s and the sink key carries s_h / scaling, real and padding keys 0. Its gradient is that
key's gradient in those channels, summed over blocks.

Limits: in float16 a padding key's weight is exp(-finfo.max / 4 * scale - max score), zero only
while scores stay above about -1000. CPU SDPA runs its fast (flash) kernel only with equal key and
value head sizes and a 4-D mask, so the narrower of keys and values is zero-padded. Measured on
2 CPU cores, fp32, 4 heads of 32: about 27 ns per (query, key) pair for fwd+bwd, tree or flat.

Shapes: q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv] (heads first, no batch); outputs [n, H, Dv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from harts.plan.attention import AttentionGroup, TreeAttentionPlan

__all__ = ["masked_tree_attention", "tree_attention", "path_attention_reference"]


def masked_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of every query over the keys its mask [N, M] allows. Returns [N, H, Dv].

    Grouped-query attention: query head h reads key/value head h // (H // Hkv), as in
    transformers' ``repeat_kv``.
    """
    h, hkv = q.shape[0], k.shape[0]
    if h != hkv:
        if h % hkv:
            raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
        k = k.repeat_interleave(h // hkv, dim=0)
        v = v.repeat_interleave(h // hkv, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(0, 1)


def path_attention_reference(q, k, v, paths: list[torch.Tensor], scaling: float, window: int | None = None,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The plain definition, one query at a time in float64 (tests only). Returns [n, H, Dv].

    ``paths[t]``: the key rows of query t's path, root first, itself last. With ``window``, the
    query sees the last ``window`` of them; with ``sinks`` [H], a logit per head joins the softmax
    denominator and its weight is dropped.
    """
    h, hkv = q.shape[0], k.shape[0]
    q, k, v = q.double(), k.double(), v.double()
    rows = []
    for t, path in enumerate(paths):
        keys = path if window is None else path[max(0, path.numel() - window):]
        heads = []
        for head in range(h):
            kv = head // (h // hkv)
            scores = (k[kv, keys] @ q[head, t]) * scaling  # [L]
            if sinks is not None:
                scores = torch.cat([scores, sinks[head].double().reshape(1)])
            weights = torch.softmax(scores, dim=0)[: keys.numel()]
            heads.append(weights @ v[kv, keys])
        rows.append(torch.stack(heads))
    return torch.stack(rows) if rows else v.new_zeros(0, h, v.shape[-1])


# ---- grouped form ------------------------------------------------------------------------------


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan, scaling: float,
    window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact tree attention by the groups of ``plan``. Returns [n, H, Dv]; differentiable in q, k, v
    (and ``sinks``).

    q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv]; query head h reads key/value head h // (H // Hkv).
    ``window``: each token sees the last ``window`` tokens of its path (None: all of it);
    ``sinks`` [H]: a logit per query head added to the softmax denominator (module docstring).
    Backward saves q, k, v as passed, the returned output and small per-group logsumexps, and
    gathers again (module docstring, Backward); it supports no double backward.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"expected q [H, n, Dk], k [Hkv, m, Dk], v [Hkv, m, Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    h, n, dk = q.shape
    hkv, m, dv = v.shape
    if k.shape[:2] != (hkv, m) or k.shape[2] != dk or h % hkv:
        raise ValueError(f"inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(H must be a multiple of Hkv)")
    if (n, m) != (plan.num_queries, plan.num_keys):
        raise ValueError(f"plan is for {plan.num_queries} queries and {plan.num_keys} keys, got {n} and {m}")
    if n == 0:
        return q.new_zeros(0, h, dv)
    if plan.key_index.device != q.device:
        raise ValueError(f"plan lives on {plan.key_index.device}, tensors on {q.device}")
    if sinks is not None and (sinks.shape != (h,) or sinks.device != q.device):
        raise ValueError(f"sinks must be [H] = [{h}] on {q.device}, "
                         f"got {tuple(sinks.shape)} on {sinks.device}")
    plan = plan.windowed(window)
    if sinks is None and plan.dense_for(h, max(dk, dv)) and _dense_applies(q, v, plan):
        out = _DenseTreeAttention.apply(q, k, v, plan, scaling)
        if bool(out.isfinite().all()):  # else the groups' result: a NaN stays in the rows it reaches
            return out
    if plan.prefixes and not _prefixes_apply(q, v, plan):
        plan = plan.whole()
    return _TreeAttention.apply(q, k, v, sinks, plan, scaling)


# CPU groups run the fused flash kernels directly, so backward needs only each group's logsumexp;
# False sends every group down the recompute path that other devices take (the tests use it).
_FUSED_CPU = True
# Groups with key padding take per-block masks ([G, r * Lq, Lk] each) in plan order while all
# their masks hold at most this many elements (4 MiB in float32); the others the padding channel
# (module docstring). 0: always the channel (the tests run both).
_MASKED_PADDING_ELEMENTS = 1 << 20
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _TreeAttention(torch.autograd.Function):
    """:func:`tree_attention` with a backward that gathers the groups' rows again.

    Autograd through the gathers would save every group's gathered queries, keys and values (the
    key rows are several times the token count on forests of short nodes); this saves q, k, v as
    passed, the returned output and, per fused CPU group, its logsumexp [Hkv, G, r * Lq].
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: TreeAttentionPlan, scaling: float):
        hkv, _, dv = v.shape
        r = q.shape[0] // hkv
        outs, lses, shifts = [], [], []
        # With shared prefixes every group runs the fused kernel (merging needs its logsumexp) but
        # those of lone keys no prefix reaches: a query whose whole path is one key takes the exact
        # path, whose logsumexp is that key's score, forward and backward.
        lone = plan.lone_unmerged() if plan.prefixes else frozenset()
        for i, (g, _, _, qg, kg, vg, padding, mask) in enumerate(
                _gathered_groups(q, k, v, plan, scaling, sinks)):
            shift = None
            if i not in lone and (plan.prefixes or (kg.shape[2] > 1 and _fused(qg, kg, vg, mask, scaling))):
                shift = _shift(vg, g, padding)  # vg is the group's own gathered copy: shifted in place
                vg = vg if shift is None else vg.sub_(shift)
                out, lse = _flash_forward(qg, kg, vg, 0.0, False, attn_mask=mask, scale=scaling)
                out = out if shift is None else out.add_(shift)
            else:
                out = _attend_group(g, qg, kg, vg, mask, scaling, padding)
                lse = (qg * kg).sum(-1) * scaling if plan.prefixes else None
            outs.append(out[..., :dv].reshape(hkv, -1, dv))
            lses.append(lse)
            shifts.append(shift)
        stacked = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [Hkv, R, Dv]
        out_rows = plan.head_rows(hkv, r)[1]
        output = stacked.reshape(-1, dv)[out_rows]
        lse = None
        if plan.prefixes:
            # Every query's logsumexp over all its keys: the groups' backward reads it and the
            # merged output instead of their own (module docstring, Shared prefixes).
            lse_all = torch.cat([x.reshape(hkv, -1) for x in lses], dim=1)  # [Hkv, R]
            lse = lse_all.reshape(-1)[out_rows]  # [n, H]
            _merge_prefixes(q, k, v, plan, scaling, output, lse)
            lse_all.view(-1)[out_rows] = lse
            lses = [None if i in lone else x  # the exact backward for those lone keys too
                    for i, x in enumerate(lse_all.split([x[0].numel() for x in lses], dim=1))]
        fused = any(x is not None for x in lses)
        # The output is saved only for the fused backward (which reads it in sum(dO * O)); callers
        # usually keep it anyway (the next op saves it), so it costs no extra memory there.
        ctx.save_for_backward(q, k, v, sinks, output if fused else None, lse, *lses)
        ctx.plan, ctx.scaling = plan, scaling
        ctx.shifts = shifts  # [Hkv, G, 1, dp] per fused group, or None: backward shifts by the same
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, sinks, output, query_lse, *lses = ctx.saved_tensors
        plan, scaling = ctx.plan, ctx.scaling
        h, n, dk = q.shape
        hkv, m, dv = v.shape
        r = h // hkv
        # The groups' stacked layout [Hkv, R, Dv] of the output's gradient (and of the output):
        # padding query rows get zero gradient, which makes their output values irrelevant.
        out_rows = plan.head_rows(hkv, r)[1].reshape(-1)
        total = r * sum(g.size * g.lq for g in plan.groups)

        def stacked(x):
            rows = x.new_zeros(hkv * total, dv).index_put_((out_rows,), x.reshape(-1, dv))
            return rows.view(hkv, total, dv)

        grad_st, out_st = stacked(grad), None if output is None else stacked(output)
        need_q, need_k, need_v, need_s = ctx.needs_input_grad[:4]
        sink_grad = q.new_zeros(hkv, r, dtype=torch.float64) if need_s else None
        # A query row gets one group's gradient; a key row sums over every block that reads it,
        # accumulated in float32 for float16/bfloat16 inputs. Row m: the padding key, dropped.
        acc = torch.float32 if k.dtype in (torch.float16, torch.bfloat16) else k.dtype
        dq_all = q.new_zeros(hkv, r * n, dk) if need_q else None
        dk_all = k.new_zeros(hkv, m + 1, dk, dtype=acc) if need_k else None
        dv_all = v.new_zeros(hkv, m + 1, dv, dtype=acc) if need_v else None
        at = 0
        groups = _gathered_groups(q, k, v, plan, scaling, sinks)
        for (g, q_rows, k_rows, qg, kg, vg, padding, mask), lse, shift in zip(groups, lses, ctx.shifts,
                                                                              strict=True):
            rows, dp = qg.shape[1] * qg.shape[2], qg.shape[-1]
            grad_g = _widen(grad_st[:, at: at + rows], dp).reshape(qg.shape)
            if lse is not None:
                lse = lse.reshape(qg.shape[:3])
                out_g = _widen(out_st[:, at: at + rows], dp).reshape(qg.shape)
                if shift is not None:
                    vg, out_g = vg.sub_(shift), out_g - shift
                gq, gk, gv = _flash_backward(grad_g, qg, kg, vg, out_g, lse, 0.0, False,
                                             attn_mask=mask, scale=scaling)
            else:
                # Any device: this group's forward once more, differentiated by autograd.
                with torch.enable_grad():
                    leaves = [x.detach().requires_grad_() for x in (qg, kg, vg)]
                    out = _attend_group(g, *leaves, mask, scaling, padding)
                    gq, gk, gv = torch.autograd.grad(out, leaves, grad_g)
            if sinks is not None:  # the sink column: its channels' gradient, then the real keys
                if need_s:
                    base = dk + g.pad_keys
                    sink_grad += gk[:, :, -1, base: base + r].sum(1).double()
                gk, gv = gk[:, :, :-1], gv[:, :, :-1]
            if need_q:
                dq_all.index_add_(1, q_rows, gq.reshape(hkv, rows, dp)[..., :dk])
            if need_k:
                dk_all.index_add_(1, k_rows, gk.reshape(hkv, -1, dp)[..., :dk].to(acc))
            if need_v:
                dv_all.index_add_(1, k_rows, gv.reshape(hkv, -1, dp)[..., :dv].to(acc))
            at += rows
        if plan.prefixes:
            _prefix_grads(q, k, v, plan, scaling, grad, output, query_lse, dq_all, dk_all, dv_all)
        d_sinks = (sink_grad / scaling).reshape(h).to(sinks.dtype) if need_s else None
        return (dq_all.view(h, n, dk) if need_q else None, dk_all[:, :m].to(k.dtype) if need_k else None,
                dv_all[:, :m].to(v.dtype) if need_v else None, d_sinks, None, None)


def _dense_applies(q: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan) -> bool:
    """Whether ``plan``'s dense form can run here (module docstring, Dense plans): CPU flash kernels in
    float32 or float64, and no path whose first two values are equal for some key/value head (a
    query whose visible values are all one value then exists, and the groups keep it exact)."""
    if not (_FUSED_CPU and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)):
        return False
    first, second = plan.path_starts()
    if first.numel():
        a, b = v.detach()[:, first], v.detach()[:, second]
        if bool((a[..., 0] == b[..., 0]).any()) and bool((a == b).all(-1).any()):
            return False
    return True


def _dense_inputs(q, k, v):
    """q [1, Hkv, r * n, dp], k and v [1, Hkv, m, dp]: a dense call's inputs at the common width."""
    h, n, dk = q.shape
    hkv, _, dv = v.shape
    dp = max(dk, dv)
    return (_widen(q.reshape(hkv, (h // hkv) * n, dk), dp)[None], _widen(k, dp)[None], _widen(v, dp)[None])


def _heads_first(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[n, H, d] -> [Hkv, r, n, d] contiguous: the rows of a dense call (x itself where its layout
    already is, as with one query)."""
    n, h, d = x.shape
    return x.reshape(n, hkv, h // hkv, d).permute(1, 2, 0, 3).contiguous()


class _DenseTreeAttention(torch.autograd.Function):
    """:func:`tree_attention` as one CPU flash call over all queries and keys with the plan's dense
    mask (module docstring, Dense plans). Saves q, k, v as passed, the output and the logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v, plan: TreeAttentionPlan, scaling: float):
        h, n, _ = q.shape
        hkv, _, dv = v.shape
        mask = plan.dense_mask(h // hkv, q.dtype)
        out, lse = _flash_forward(*_dense_inputs(q, k, v), 0.0, False, attn_mask=mask, scale=scaling)
        output = out[0, ..., :dv].reshape(hkv, h // hkv, n, dv).permute(2, 0, 1, 3).reshape(n, h, dv)
        output = output.contiguous()  # not a view of the kernel's wider rows: saved, and returned
        ctx.save_for_backward(q, k, v, output, lse)
        ctx.plan, ctx.scaling = plan, scaling
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, output, lse = ctx.saved_tensors
        plan, scaling = ctx.plan, ctx.scaling
        h, n, dk = q.shape
        hkv, m, dv = v.shape
        r = h // hkv
        qx, kx, vx = _dense_inputs(q, k, v)
        dp = qx.shape[-1]
        # A query whose path is one key gets that value, weight exactly 1: no query or key gradient,
        # and its output's gradient goes to the value whole (the groups' lone-key path, exactly).
        lone_q, lone_k = plan.lone_queries()
        rows = _heads_first(grad, hkv)  # may be grad itself (one query): never written in place
        if lone_q.numel():
            rows = rows.index_fill(2, lone_q, 0.0)
        gq, gk, gv = _flash_backward(_widen(rows.view(1, hkv, r * n, dv), dp), qx, kx, vx,
                                     _widen(_heads_first(output, hkv).view(1, hkv, r * n, dv), dp), lse, 0.0,
                                     False, attn_mask=plan.dense_mask(r, q.dtype), scale=scaling)
        d_v = gv[0, ..., :dv]
        if lone_q.numel():
            d_v = d_v.index_add(1, lone_k, grad[lone_q].reshape(-1, hkv, r, dv).sum(2).transpose(0, 1))
        return gq[0, ..., :dk].reshape(h, n, dk), gk[0, ..., :dk], d_v, None, None


def _prefixes_apply(q: torch.Tensor, v: torch.Tensor, plan: TreeAttentionPlan) -> bool:
    """Whether ``plan``'s shared prefixes can run here (module docstring, Shared prefixes): CPU flash
    kernels in float32 or float64, and no prefix whose values are one value for some key/value head
    (the whole plan then keeps "Equal values" exact)."""
    if not (_FUSED_CPU and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)):
        return False
    for k0, k1 in {(p.k0, p.k1) for p in plan.prefixes}:
        block = v[:, k0:k1]
        first_channel = (block[..., 0] == block[:, :1, 0]).all(1).any()  # a small read first
        if first_channel and (block == block[:, :1]).flatten(1).all(1).any():
            return False
    return True


def _prefix_inputs(q, k, v, plan: TreeAttentionPlan):
    """Per shared prefix: (prefix, its queries [Hkv, r, nP, dp], keys and values [Hkv, r, L, dp]),
    views of q, k and v (widened to a common width dp for CPU flash attention)."""
    h, n, dk = q.shape
    hkv, _, dv = v.shape
    r, dp = h // hkv, max(dk, v.shape[-1])
    qx, kx, vx = _widen(q, dp).view(hkv, r, n, dp), _widen(k, dp), _widen(v, dp)
    for p in plan.prefixes:
        keys = (hkv, r, p.k1 - p.k0, dp)
        yield (p, qx[:, :, p.q0: p.q1], kx[:, None, p.k0: p.k1].expand(keys),
               vx[:, None, p.k0: p.k1].expand(keys))


def _merge_prefixes(q, k, v, plan: TreeAttentionPlan, scaling: float, output, lse) -> None:
    """Each shared prefix's attention merged into ``output`` [n, H, Dv] and ``lse`` [n, H] (the
    groups' results), in place: weights exp(lse_i - lse) of the merged logsumexp."""
    h, dv = q.shape[0], v.shape[-1]
    for p, qp, kp, vp in _prefix_inputs(q, k, v, plan):
        out_p, lse_p = _flash_forward(qp, kp, vp, 0.0, False, attn_mask=None, scale=scaling)
        rows = p.q1 - p.q0
        out_p = out_p[..., :dv].permute(2, 0, 1, 3).reshape(rows, h, dv)
        lse_p = lse_p.permute(2, 0, 1).reshape(rows, h)
        before = lse[p.q0: p.q1]
        merged = torch.logaddexp(before, lse_p)
        out = output[p.q0: p.q1]
        out.mul_((before - merged).exp_().unsqueeze(-1)).add_(out_p * (lse_p - merged).exp_().unsqueeze(-1))
        before.copy_(merged)


def _prefix_grads(q, k, v, plan: TreeAttentionPlan, scaling: float, grad, output, lse,
                  dq_all, dk_all, dv_all) -> None:
    """Each shared prefix's share of the gradients, added in place: the fused backward of its call
    with the merged output and logsumexp, which gives exactly its keys' part of the softmax."""
    h, n, dk = q.shape
    hkv, _, dv = v.shape
    r = h // hkv
    for p, qp, kp, vp in _prefix_inputs(q, k, v, plan):
        rows, dp = p.q1 - p.q0, qp.shape[-1]
        # the prefix's query rows heads first, [Hkv, r, nP, .], as its call lays them out
        grad_p, out_p, lse_p = (x[p.q0: p.q1].reshape(rows, hkv, r, -1).permute(1, 2, 0, 3)
                                for x in (grad, output, lse))
        gq, gk, gv = _flash_backward(_widen(grad_p, dp).contiguous(), qp, kp, vp,
                                     _widen(out_p, dp).contiguous(), lse_p[..., 0].contiguous(), 0.0, False,
                                     attn_mask=None, scale=scaling)
        if dq_all is not None:
            dq_all.view(hkv, r, n, dk)[:, :, p.q0: p.q1] += gq[..., :dk]
        if dk_all is not None:
            dk_all[:, p.k0: p.k1] += gk.sum(1)[..., :dk].to(dk_all.dtype)
        if dv_all is not None:
            dv_all[:, p.k0: p.k1] += gv.sum(1)[..., :dv].to(dv_all.dtype)


def _group_mask(plan: TreeAttentionPlan, g: AttentionGroup, r: int, dtype, sink: bool):
    """The group's additive mask; with a sink, one more column (the sink key), always visible."""
    mask = plan.mask(g.lq, g.lk, r, dtype)
    if not sink or mask is None:
        return mask
    key = ("sink_mask", g.lq, g.lk, r, dtype)
    if key not in plan._cache:
        plan._cache[key] = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], 1)], dim=-1)
    return plan._cache[key]


def _sink_channels(q, k, sinks, scaling: float, at: int, dp: int):
    """q widened with r one-hot head channels at column ``at`` (query head s of each key/value head:
    1 in column at + s), and the sink key [Hkv, dp] carrying s_h / scaling there (module docstring)."""
    h, n, dk = q.shape
    hkv = k.shape[0]
    r = h // hkv
    onehot = torch.eye(r, dtype=q.dtype, device=q.device).repeat(hkv, 1)  # [H, r]
    pad = q.new_zeros(h, n, at - dk) if at > dk else None
    if pad is not None:  # the padding channel: 1 for queries (module docstring)
        pad[..., 0] = 1.0
    parts = [q] + ([pad] if pad is not None else []) + [onehot[:, None, :].expand(h, n, r)]
    qx = _widen(torch.cat(parts, dim=-1), dp)
    sink_key = k.new_zeros(hkv, dp)
    sink_key[:, at: at + r] = (sinks.detach().to(k.dtype) / scaling).view(hkv, r)
    return qx, sink_key


def _masked_groups(plan: TreeAttentionPlan, r: int, sinks) -> frozenset[int]:
    """The groups of ``plan`` that remove their key padding by a per-block mask: those with key
    padding, in order, while their masks together stay within :data:`_MASKED_PADDING_ELEMENTS`
    elements (module docstring); none with sinks. Cached, so every layer, forward and backward,
    makes the same choice."""
    if sinks is not None:
        return frozenset()
    key = ("masked_groups", r, _MASKED_PADDING_ELEMENTS)
    if key not in plan._cache:
        chosen, total = [], 0
        for i, g in enumerate(plan.groups):
            size = g.size * r * g.lq * g.lk
            if g.pad_keys and total + size <= _MASKED_PADDING_ELEMENTS:
                chosen.append(i)
                total += size
        plan._cache[key] = frozenset(chosen)
    return plan._cache[key]


def _padded_group_mask(plan: TreeAttentionPlan, g: AttentionGroup, r: int, dtype, padding, at: int):
    """[1, G, r * Lq, Lk] additive mask of a group with key padding: its causal mask, and -huge at
    each block's padding columns (the same finite score the padding channel gives). Cached."""
    key = ("padded_mask", at, r, dtype)
    if key not in plan._cache:
        causal = plan.mask(g.lq, g.lk, r, dtype)  # [1, 1, r * Lq, Lk] or None (Lq = 1)
        base = causal if causal is not None else torch.zeros(1, 1, r * g.lq, g.lk, dtype=dtype,
                                                             device=plan.key_index.device)
        huge = -torch.finfo(dtype).max / 4
        plan._cache[key] = base.masked_fill(padding[1][None, :, None, :], huge)
    return plan._cache[key]


def _real_key_rows(plan: TreeAttentionPlan, kr: torch.Tensor, at: int) -> torch.Tensor:
    """``kr`` with the padding key (row m) replaced by row 0: a group removing its padding by mask
    gathers from k itself, which has no row m. Cached."""
    key = ("real_rows", at)
    if key not in plan._cache:
        plan._cache[key] = kr.masked_fill(kr == plan.num_keys, 0)
    return plan._cache[key]


def _gathered_groups(q, k, v, plan: TreeAttentionPlan, scaling: float, sinks=None):
    """Per group of ``plan``, in order: (group, its rows of q [Hkv, r n, .], its key rows (row m:
    padding), its queries [Hkv, G, r * Lq, dp], keys and values [Hkv, G, Lk, dp], gathered and
    widened, its key padding and its mask; with ``sinks``, the keys and values get the sink column
    Lk + 1)."""
    h, n, dk = q.shape
    hkv, _, dv = v.shape
    r = h // hkv
    q_rows = plan.head_rows(hkv, r)[0]
    widened = {}

    def tensors(pad: bool):
        """(queries [Hkv, r n, dp], keys, values [Hkv, m (+1), dp], sink key) at the width a group
        needs: the padding channel (and the pad key at row m) or none. Built once per width."""
        if pad not in widened:
            # Values are zero-padded to the key width since CPU flash attention needs equal widths;
            # with the padding channel, the extra channel (module docstring) and the pad key at row
            # m join; with sinks, r head channels after it.
            dp = max(dk + pad + (r if sinks is not None else 0), dv)
            sink_key = None
            if sinks is None:
                qx = _widen(q, dp, 1.0 if pad else None).reshape(hkv, r * n, dp)
            else:
                qx, sink_key = _sink_channels(q, k, sinks, scaling, dk + pad, dp)
                qx = qx.reshape(hkv, r * n, dp)
            kx, vx = _widen(k, dp), _widen(v, dp)
            if pad:
                pad_key = k.new_zeros(hkv, 1, dp)
                pad_key[..., dk] = -torch.finfo(k.dtype).max / 4 / max(scaling, 1.0)
                kx, vx = torch.cat([kx, pad_key], dim=1), torch.cat([vx, v.new_zeros(hkv, 1, dp)], dim=1)
            widened[pad] = qx, kx, vx, sink_key
        return widened[pad]

    q_at, k_at = 0, 0
    by_mask = _masked_groups(plan, r, sinks)
    # Gathered one group at a time: only one group's rows live at once. Query heads sharing a
    # key/value head become extra query rows of one call ([G, r, Lq]).
    for i, g in enumerate(plan.groups):
        qr = q_rows[q_at: q_at + g.size * r * g.lq]
        kr = plan.key_index[k_at: k_at + g.size * g.lk]
        q_at, k_at = q_at + qr.numel(), k_at + kr.numel()
        padding = _padding(plan, g, kr, k_at)
        masked = i in by_mask
        qx, kx, vx, sink_key = tensors(g.pad_keys and not masked)
        dp = qx.shape[-1]
        gather = _real_key_rows(plan, kr, k_at) if masked else kr
        kg = kx.index_select(1, gather).view(hkv, g.size, g.lk, dp)
        vg = vx.index_select(1, gather).view(hkv, g.size, g.lk, dp)
        if sinks is not None:
            kg = torch.cat([kg, sink_key[:, None, None].expand(hkv, g.size, 1, dp)], dim=2)
            vg = torch.cat([vg, vg.new_zeros(hkv, g.size, 1, dp)], dim=2)
        if masked:
            mask = _padded_group_mask(plan, g, r, q.dtype, padding, k_at)
        else:
            mask = _group_mask(plan, g, r, q.dtype, sinks is not None)
        yield g, qr, kr, qx.index_select(1, qr).view(hkv, g.size, r * g.lq, dp), kg, vg, padding, mask


def _attend_group(g: AttentionGroup, qg, kg, vg, mask, scaling: float, padding=None) -> torch.Tensor:
    """One group's attention [Hkv, G, r * Lq, dp] by autograd-able ops (any device)."""
    if kg.shape[2] == 1:
        # A lone key gets weight 1: its value, exactly, and exactly zero gradient for the query
        # and key, which SDPA's backward leaves at rounding noise (~1e-6 in fp32). The zero term
        # keeps q and k in the graph (and propagates NaN as SDPA would).
        return vg.expand(*qg.shape[:3], -1) + 0 * (qg[..., :1] + kg[..., :1])
    shift = _shift(vg.detach(), g, padding)
    if shift is None:
        return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scaling)
    return F.scaled_dot_product_attention(qg, kg, vg - shift, attn_mask=mask, scale=scaling) + shift


def _padding(plan: TreeAttentionPlan, g: AttentionGroup, kr: torch.Tensor, at: int):
    """Group ``g``'s key padding (key rows ``kr``, ending at ``at`` in the plan's key index): per block,
    the column of its first real key [G] and which columns are padding [G, Lk]; None when no block is
    padded. Cached."""
    if not g.pad_keys:
        return None
    key = ("padding", at)
    if key not in plan._cache:
        pad = kr.view(g.size, g.lk) == plan.num_keys
        plan._cache[key] = pad.sum(1), pad
    return plan._cache[key]


def _shift(v: torch.Tensor, g: AttentionGroup, padding) -> torch.Tensor | None:
    """[Hkv, G, 1, dp]: per block, its value if all its real values are that one value, else zero
    (module docstring, "Equal values"); None when no block has one value (always None in float16 and
    bfloat16). A first test on channel 0 alone keeps the usual case to a small read on CPU, where
    asking whether any block passed costs no device synchronisation."""
    if g.lk < 2 or v.dtype not in (torch.float32, torch.float64):
        return None
    v = v[:, :, :g.lk]  # without a sink column
    first, pad = padding if padding is not None else (None, None)
    c = v[:, :, :1] if first is None else v[:, torch.arange(g.size, device=v.device), first].unsqueeze(2)

    def one_value(x, ref, pad):
        same = x == ref
        return (same if pad is None else same | pad).flatten(2).all(-1)  # [Hkv, G]

    flags = one_value(v[..., 0], c[..., 0], pad)
    if v.device.type == "cpu" and not flags.any():
        return None
    flags &= one_value(v, c, None if pad is None else pad[..., None]) & c.isfinite().flatten(2).all(-1)
    return torch.where(flags[..., None, None], c, 0.0)


def _fused(qg, kg, vg, mask, scaling: float) -> bool:
    """Whether SDPA would run this call by CPU flash attention: then its fused kernels serve."""
    return (_FUSED_CPU and qg.device.type == "cpu"
            and torch._fused_sdp_choice(qg, kg, vg, mask, 0.0, False, scale=scaling) == _FLASH)


def _widen(x: torch.Tensor, width: int, channel: float | None = None) -> torch.Tensor:
    """[..., D] -> [..., width] with zero columns; ``channel``, when given, fills column D."""
    parts = [x] if channel is None else [x, x.new_full((*x.shape[:-1], 1), channel)]
    fill = width - x.shape[-1] - len(parts) + 1
    if fill:
        parts.append(x.new_zeros(*x.shape[:-1], fill))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else x
