"""The grouped form of tree attention: query blocks against their gathered paths, in a few calls.

Each node's queries, split into query blocks, attend to [ancestor keys ; own keys], gathered by
index (:mod:`~harts.ops.tree_attention.gather`); blocks of similar shape are padded into a few
batched SDPA calls (the groups of a :class:`~harts.plan.attention.TreeAttentionPlan`). Cost is about
the exact cost, the sum of path positions, plus bounded waste (causal triangles of the blocks and
padding). The key space may be larger than the query space (keys of ancestors computed in an earlier
micro-batch). Shared prefixes, where the plan has them, run beside the groups and merge by
logsumexp (:mod:`~harts.ops.tree_attention.prefixes`).

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from harts.ops.tree_attention.flash import flash_backward, flash_forward, runs_fused, widen
from harts.ops.tree_attention.gather import gathered_groups
from harts.ops.tree_attention.prefixes import merge_prefixes, prefix_grads
from harts.plan.attention import AttentionGroup, TreeAttentionPlan

__all__ = ["grouped_tree_attention"]


def grouped_tree_attention(q, k, v, plan: TreeAttentionPlan, scaling: float, sinks=None) -> torch.Tensor:
    """[n, H, Dv]: ``plan``'s groups, and its shared prefixes merged in (the caller takes
    :meth:`~harts.plan.attention.TreeAttentionPlan.whole` where they cannot run); differentiable in q,
    k, v and ``sinks`` (module docstring, Backward)."""
    return _TreeAttention.apply(q, k, v, sinks, plan, scaling)


class _TreeAttention(torch.autograd.Function):
    """:func:`~harts.ops.tree_attention.tree_attention` by the plan's groups, with a backward that
    gathers the groups' rows again (module docstring, Backward).

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
            gathered_groups(q, k, v, plan, scaling, sinks)
        ):
            shift = None
            kernel = plan.prefixes or (kg.shape[2] > 1 and runs_fused(qg, kg, vg, mask, scaling))
            if i not in lone and kernel:
                shift = _shift(vg, g, padding)  # vg is the group's own gathered copy: shifted in place
                vg = vg if shift is None else vg.sub_(shift)
                out, lse = flash_forward(qg, kg, vg, 0.0, False, attn_mask=mask, scale=scaling)
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
            # merged output instead of their own (:mod:`~harts.ops.tree_attention.prefixes`).
            lse_all = torch.cat([x.reshape(hkv, -1) for x in lses], dim=1)  # [Hkv, R]
            lse = lse_all.reshape(-1)[out_rows]  # [n, H]
            merge_prefixes(q, k, v, plan, scaling, output, lse)
            lse_all.view(-1)[out_rows] = lse
            lses = [
                None if i in lone else x  # the exact backward for those lone keys too
                for i, x in enumerate(lse_all.split([x[0].numel() for x in lses], dim=1))
            ]
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
        groups = gathered_groups(q, k, v, plan, scaling, sinks)
        for (g, q_rows, k_rows, qg, kg, vg, padding, mask), lse, shift in zip(
            groups, lses, ctx.shifts, strict=True
        ):
            rows, dp = qg.shape[1] * qg.shape[2], qg.shape[-1]
            grad_g = widen(grad_st[:, at : at + rows], dp).reshape(qg.shape)
            if lse is not None:
                lse = lse.reshape(qg.shape[:3])
                out_g = widen(out_st[:, at : at + rows], dp).reshape(qg.shape)
                if shift is not None:
                    vg, out_g = vg.sub_(shift), out_g - shift
                gq, gk, gv = flash_backward(
                    grad_g, qg, kg, vg, out_g, lse, 0.0, False, attn_mask=mask, scale=scaling
                )
            else:
                # Any device: this group's forward once more, differentiated by autograd.
                with torch.enable_grad():
                    leaves = [x.detach().requires_grad_() for x in (qg, kg, vg)]
                    out = _attend_group(g, *leaves, mask, scaling, padding)
                    gq, gk, gv = torch.autograd.grad(out, leaves, grad_g)
            if sinks is not None:  # the sink column: its channels' gradient, then the real keys
                if need_s:
                    base = dk + g.pad_keys
                    sink_grad += gk[:, :, -1, base : base + r].sum(1).double()
                gk, gv = gk[:, :, :-1], gv[:, :, :-1]
            if need_q:
                dq_all.index_add_(1, q_rows, gq.reshape(hkv, rows, dp)[..., :dk])
            if need_k:
                dk_all.index_add_(1, k_rows, gk.reshape(hkv, -1, dp)[..., :dk].to(acc))
            if need_v:
                dv_all.index_add_(1, k_rows, gv.reshape(hkv, -1, dp)[..., :dv].to(acc))
            at += rows
        if plan.prefixes:
            prefix_grads(q, k, v, plan, scaling, grad, output, query_lse, dq_all, dk_all, dv_all)
        d_sinks = (sink_grad / scaling).reshape(h).to(sinks.dtype) if need_s else None
        return (
            dq_all.view(h, n, dk) if need_q else None,
            dk_all[:, :m].to(k.dtype) if need_k else None,
            dv_all[:, :m].to(v.dtype) if need_v else None,
            d_sinks,
            None,
            None,
        )


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


def _shift(v: torch.Tensor, g: AttentionGroup, padding) -> torch.Tensor | None:
    """[Hkv, G, 1, dp]: per block, its value if all its real values are that one value, else zero
    (module docstring, "Equal values"); None when no block has one value (always None in float16 and
    bfloat16). A first test on channel 0 alone keeps the usual case to a small read on CPU, where
    asking whether any block passed costs no device synchronisation."""
    if g.lk < 2 or v.dtype not in (torch.float32, torch.float64):
        return None
    v = v[:, :, : g.lk]  # without a sink column
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
