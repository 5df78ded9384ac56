"""How the grouped form gathers a group's rows, and how padding and sinks stay exact.

A group of the plan (:class:`~harts.plan.attention.AttentionGroup`) is G query blocks padded to Lq
queries and Lk keys. Inside a group, keys are right-aligned (left padding, ancestors, own keys
ending at the last column) and queries right-aligned too, so every block's causal rule is the same
bottom-right triangle and one [Lq, Lk] mask serves the group. In groups with key padding, padding
keys are removed in one of two ways, each giving a padding key the finite score -huge (weight
exactly 0, and no NaN for a padding query row that sees only padding) and leaving real scores
unchanged:

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

Attention sinks: a sink is a learned per-head logit s_h added to the softmax denominator (gpt-oss):
the weights become exp(score_j) / (sum_j exp(score_j) + exp(s_h)). It runs as one more key per
block, appended after the block's keys and always visible, whose score is s_h and whose value is
zero: r more channels, where query head s of a key/value head carries 1 in channel s and the sink
key carries s_h / scaling, real and padding keys 0. Its gradient is that key's gradient in those
channels, summed over blocks.

Limits: in float16 a padding key's weight is exp(-finfo.max / 4 * scale - max score), zero only
while scores stay above about -1000.
"""

from __future__ import annotations

import torch

from harts.ops.tree_attention.flash import widen
from harts.plan.attention import AttentionGroup, TreeAttentionPlan

__all__ = ["gathered_groups"]

# Groups with key padding take per-block masks ([G, r * Lq, Lk] each) in plan order while all
# their masks hold at most this many elements (4 MiB in float32); the others the padding channel
# (module docstring). 0: always the channel (the tests run both).
_MASKED_PADDING_ELEMENTS = 1 << 20


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
    qx = widen(torch.cat(parts, dim=-1), dp)
    sink_key = k.new_zeros(hkv, dp)
    sink_key[:, at : at + r] = (sinks.detach().to(k.dtype) / scaling).view(hkv, r)
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
        base = (
            causal
            if causal is not None
            else torch.zeros(1, 1, r * g.lq, g.lk, dtype=dtype, device=plan.key_index.device)
        )
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


def gathered_groups(q, k, v, plan: TreeAttentionPlan, scaling: float, sinks=None):
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
                qx = widen(q, dp, 1.0 if pad else None).reshape(hkv, r * n, dp)
            else:
                qx, sink_key = _sink_channels(q, k, sinks, scaling, dk + pad, dp)
                qx = qx.reshape(hkv, r * n, dp)
            kx, vx = widen(k, dp), widen(v, dp)
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
        qr = q_rows[q_at : q_at + g.size * r * g.lq]
        kr = plan.key_index[k_at : k_at + g.size * g.lk]
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
