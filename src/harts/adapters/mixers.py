"""Tree-aware token mixers shared by the families: attention and linear attention.

Every function takes the stock module, its normed input ``x`` [1, N, D] over the unique tokens
of a forest, and a :class:`~harts.adapters.base.TreeOps` context; it returns the mixer output
[1, N, D]. Projections, norms, gates and rotary embeddings are the module's own, applied in the
order of the stock forward; only the sequence mixing is replaced:

- attention by ``ctx.attend`` (each token sees its path),
- the short convolution by ``ctx.conv`` (windows along paths),
- every recurrence (delta rule, gated linear attention) by ``ctx.recurrence`` with its
  :class:`~harts.ops.recurrence.Recurrence` (state handoff from parent to child).

The context also hands keys/values, conv inputs and states across micro-batch cuts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from harts.adapters.base import TreeOps, hf_function
from harts.ops.recurrence import DELTA_RULE, GATED_LINEAR_ATTENTION

__all__ = [
    "MAMBA2_MIXER_ATTRIBUTES",
    "QWEN3_5_GDN_ATTRIBUTES",
    "gqa_attention",
    "mla_attention",
    "kda_mixer",
    "gdn_mixer",
    "gated_delta_rule",
    "qwen3_5_gdn_projections",
    "lightning_mixer",
    "mamba2_mixer",
]


def gqa_attention(
    attn,
    x,
    ctx: TreeOps,
    output_gate: bool = False,
    window: int | None = None,
    sinks: bool = False,
    rope_key: str = "full_attention",
    rope: bool = True,
    select=None,
) -> torch.Tensor:
    """Grouped-query attention (llama, qwen2/3, mistral, olmo3, gemma3, gpt_oss, ...): the module's
    projections (with their biases), optional q/k norms, RoPE, and optionally qwen3_next's output
    gate, a sliding ``window`` along paths, or gpt-oss's per-head attention ``sinks``.

    q/k norms: over each head (qwen3, gemma3, glm4_moe) when the norm's width is the head size,
    else over the whole projection before it is split into heads (olmo3). ``rope_key``: the layer
    type whose rotary table this layer reads, when the context holds one per layer type (gemma3).
    ``rope=False``: no position embedding at all (nemotron_h's attention layers). ``select``: the
    keys each query attends to, a selection within its path (an indexer's; ``TreeOps.attend``).
    """
    n = x.shape[1]
    head_dim = attn.head_dim
    hidden_shape = (1, n, -1, head_dim)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    per_head = q_norm is not None and q_norm.weight.shape[-1] == head_dim
    if output_gate:
        query, gate = torch.chunk(attn.q_proj(x).view(1, n, -1, head_dim * 2), 2, dim=-1)
        gate = gate.reshape(1, n, -1)
    else:
        query, gate = attn.q_proj(x), None
        if q_norm is not None and not per_head:  # olmo3: one norm over all heads
            query = q_norm(query)
        query = query.view(hidden_shape)
    key = attn.k_proj(x)
    if k_norm is not None and not per_head:
        key = k_norm(key)
    key = key.view(hidden_shape)
    if per_head:  # qwen3, qwen3_next, gemma3, glm4_moe: RMSNorm over each head
        query, key = q_norm(query), k_norm(key)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = attn.v_proj(x).view(hidden_shape).transpose(1, 2)
    if rope:
        tables = ctx.position_embeddings
        cos, sin = tables[rope_key] if isinstance(tables, dict) else tables
        query, key = hf_function(attn, "apply_rotary_pos_emb")(query, key, cos, sin)
    out = ctx.attend(
        query, key, value, attn.scaling, window=window, sinks=attn.sinks if sinks else None, select=select
    ).reshape(1, n, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return attn.o_proj(out)


def mla_attention(
    attn, x, ctx: TreeOps, rope: bool, head_gate: bool, interleave: bool = True
) -> torch.Tensor:
    """Multi-head latent attention: bailing_hybrid (interleaved RoPE, per-head gate), kimi_linear (NoPE),
    deepseek_v3 (RoPE interleaved or not, per ``config.rope_interleave``).

    The compressed latent (``kv_a_proj_with_mqa`` and its norm) is computed once per unique token
    and expanded by the module's own ``expand_kv`` (or, in transformers versions without it, by
    ``kv_b_proj`` as their forward does).
    """
    n = x.shape[1]
    if getattr(attn, "q_lora_rank", None) is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    query = q.view(1, n, -1, attn.qk_head_dim).transpose(1, 2)
    compressed = attn.kv_a_proj_with_mqa(x)
    kv_nope, k_rot = torch.split(compressed, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    kv_nope = attn.kv_a_layernorm(kv_nope).view(1, 1, n, attn.kv_lora_rank)
    k_rot = k_rot.view(1, 1, n, attn.qk_rope_head_dim)
    if rope:
        q_pass, q_rot = torch.split(query, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        cos, sin = ctx.position_embeddings
        name = "apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb"
        q_rot, k_rot = hf_function(attn, name)(q_rot, k_rot, cos, sin)
        query = torch.cat((q_pass, q_rot), dim=-1)
    if hasattr(attn, "expand_kv"):
        key, value = attn.expand_kv(kv_nope, k_rot)
    else:
        kv = attn.kv_b_proj(kv_nope[:, 0]).view(1, n, -1, attn.qk_nope_head_dim + attn.v_head_dim)
        k_nope, value = torch.split(kv.transpose(1, 2), [attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
        key = torch.cat((k_nope, k_rot.expand(*k_nope.shape[:-1], -1)), dim=-1)
    out = ctx.attend(query, key, value, attn.scaling)  # [1, N, H, dv]
    if head_gate:
        gate = torch.sigmoid(attn.g_proj(x).float()).to(x.dtype)
        out = out * gate.unsqueeze(-1)
    return attn.o_proj(out.reshape(1, n, -1))


def _conv(module, mixed, ctx: TreeOps) -> torch.Tensor:
    """The module's depthwise causal conv1d and activation, over path windows. mixed: [N, C]."""
    conv = module.conv1d
    out = ctx.conv(mixed, conv.weight.squeeze(1), conv.bias)
    if module.activation is not None:
        out = ACT2FN[module.activation](out)
    return out.to(mixed.dtype)


def _state_dtype(x: torch.Tensor) -> torch.dtype:
    """Linear-attention maths runs in fp32 (the stock kernels' choice), or fp64 for fp64 models."""
    return torch.promote_types(x.dtype, torch.float32)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # The stock fallbacks normalise q and k in fp32 inside the kernel (fla's convention).
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_mixer(attn, x, ctx: TreeOps, output_gate) -> torch.Tensor:
    """Kimi Delta Attention (bailing_hybrid, kimi_linear): conv, per-channel forget gate, delta rule.

    ``output_gate(attn, x)`` gives the pre-activation gate of the gated output norm [1, N, H*d].
    """
    n = x.shape[1]
    heads, head_dim = attn.num_heads, attn.head_dim
    mixed = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)[0]
    mixed = _conv(attn, mixed, ctx)
    query, key, value = (
        t.reshape(n, heads, head_dim) for t in torch.split(mixed, [attn.qkv_dim] * 3, dim=-1)
    )
    f = _state_dtype(x)
    g = attn.forget_gate(x)[0].to(f)  # [N, H, K]
    beta = torch.sigmoid(attn.b_proj(x))[0].to(f)  # [N, H]
    out = ctx.recurrence(DELTA_RULE, _l2norm(query.to(f)), _l2norm(key.to(f)), value.to(f), g, beta)
    # In the dtype the stock fallback returns, its query's (the conv's output): under autocast the
    # low one, where x is fp32, so the gated norm gets the output rounded as in the stock forward.
    out = out.to(query.dtype)
    gate = output_gate(attn, x).view(1, n, heads, head_dim)
    out = attn.o_norm(out[None], gate).reshape(1, n, -1)
    return attn.o_proj(out)


def _qwen3_next_gdn_projections(attn, x):
    """qwen3_next's fused, head-interleaved projections: (q|k|v [N, C] for the conv, z, b, a)."""
    n = x.shape[1]
    query, key, value, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
    mixed = torch.cat([t.reshape(1, n, -1) for t in (query, key, value)], dim=-1)[0]
    return mixed, z, b, a


#: what :func:`qwen3_5_gdn_projections` and the Gated DeltaNet core read from a layer's mixer module
QWEN3_5_GDN_ATTRIBUTES = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv1d",
    "activation",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "key_dim",
    "value_dim",
    "head_k_dim",
    "head_v_dim",
    "num_k_heads",
    "num_v_heads",
)


def qwen3_5_gdn_projections(attn, x):
    """qwen3_5's separate projections: (q|k|v [N, C] as ``in_proj_qkv`` lays them out, z, b, a)."""
    return attn.in_proj_qkv(x)[0], attn.in_proj_z(x), attn.in_proj_b(x), attn.in_proj_a(x)


def gated_delta_rule(attn, mixed, b, a, ctx: TreeOps, beta_scale: float = 1.0) -> torch.Tensor:
    """The Gated DeltaNet core after the conv, as the stock layers and their chunked kernel: q|k|v
    ``mixed`` [N, C] split per head, ``beta = sigmoid(b) * beta_scale`` and one decay
    ``-exp(A_log) * softplus(a + dt_bias)`` per value head, each key head serving consecutive value
    heads, q and k L2-normalised: the delta rule's output [N, Hv, V] in the conv output's dtype."""
    n = mixed.shape[0]
    query, key, value = torch.split(mixed, [attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
    f, out_dtype = _state_dtype(mixed), query.dtype  # the stock fallback's output dtype (see kda_mixer)
    query = query.reshape(n, -1, attn.head_k_dim).to(f)
    key = key.reshape(n, -1, attn.head_k_dim).to(f)
    value = value.reshape(n, -1, attn.head_v_dim).to(f)
    beta = b.sigmoid()
    if beta_scale != 1.0:  # olmo_hybrid's linear_allow_neg_eigval: beta in [0, 2]
        beta = beta * beta_scale
    beta = beta[0].to(f)  # [N, Hv]
    g = (-attn.A_log.to(f).exp() * F.softplus(a.to(f) + attn.dt_bias))[0]  # [N, Hv], per head as is
    groups = attn.num_v_heads // attn.num_k_heads
    if groups > 1:  # each key head serves `groups` consecutive value heads
        query = query.repeat_interleave(groups, dim=1)
        key = key.repeat_interleave(groups, dim=1)
    return ctx.recurrence(DELTA_RULE, _l2norm(query), _l2norm(key), value, g, beta).to(out_dtype)


def gdn_mixer(attn, x, ctx: TreeOps, projections=_qwen3_next_gdn_projections) -> torch.Tensor:
    """Gated DeltaNet (qwen3_next; qwen3_5 with ``projections=qwen3_5_gdn_projections``): conv,
    per-head decay, grouped value heads, gated RMSNorm on the output."""
    n = x.shape[1]
    mixed, z, b, a = projections(attn, x)
    out = gated_delta_rule(attn, _conv(attn, mixed, ctx), b, a, ctx)
    out = attn.norm(out.reshape(-1, attn.head_v_dim), z.reshape(-1, attn.head_v_dim))
    return attn.out_proj(out.reshape(1, n, -1))


def lightning_mixer(attn, x, ctx: TreeOps) -> torch.Tensor:
    """MiniMax lightning attention: silu(qkv), gated linear attention with one fixed decay per head
    (``exp(-slope_rate)``, no scale), RMSNorm over all heads, sigmoid output gate.

    The stock forward computes the same recurrence block by block with precomputed decay tables
    (``query_decay``, ``key_decay``, ``diagonal_decay``); here it is the contract's
    :data:`~harts.ops.recurrence.GATED_LINEAR_ATTENTION` with g = -slope_rate for every channel.
    """
    n = x.shape[1]
    heads, head_dim = attn.num_attention_heads, attn.head_dim
    qkv = attn.act_fn(attn.qkv_proj(x))[0].reshape(n, heads, 3 * head_dim)
    f = _state_dtype(x)
    query, key, value = (t.to(f) for t in torch.split(qkv, head_dim, dim=-1))
    g = (-attn.slope_rate.to(f).reshape(1, heads, 1)).expand(n, heads, head_dim)
    out = ctx.recurrence(GATED_LINEAR_ATTENTION, query, key, value, g, scale=1.0).to(x.dtype)
    out = attn.norm(out.reshape(1, n, heads * head_dim))
    out = torch.sigmoid(attn.output_gate(x)) * out
    return attn.out_proj(out)


#: what :func:`mamba2_mixer` (with its gated norm) reads from a layer's Mamba-2 mixer module
MAMBA2_MIXER_ATTRIBUTES = (
    "in_proj",
    "conv1d",
    "activation",
    "dt_bias",
    "A_log",
    "D",
    "norm",
    "out_proj",
    "num_heads",
    "head_dim",
    "ssm_state_size",
    "intermediate_size",
    "n_groups",
    "conv_dim",
    "time_step_limit",
)


def mamba2_mixer(mixer, x, ctx: TreeOps, gated_norm: bool = True, project=None) -> torch.Tensor:
    """Mamba-2's SSD layer (nemotron_h, granitemoehybrid, falcon_h1), as the stock ``torch_forward``.

    ``in_proj`` gives (gate z, x|B|C, dt) after any unused leading columns; the depthwise conv and
    activation run on x|B|C along paths; dt = clamp(softplus(dt + dt_bias), *time_step_limit) per head; the
    scan h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, y_t = C_t h_t + D x_t (B and C shared by each
    group of heads) is :data:`~harts.ops.recurrence.GATED_LINEAR_ATTENTION` with q = C, k = B,
    v = dt * x and g = dt * A over the state channels, in fp32 as the stock chunked scan. Then the
    gated RMSNorm ``norm(y, z)`` (``gated_norm=False``: no norm, ``y * silu(z)`` with the gate in the
    model's dtype, as falcon_h1 without ``mamba_rms_norm``) and ``out_proj``. ``project(mixer, x)``
    replaces ``mixer.in_proj(x)`` where the family scales around it (falcon_h1's muP multipliers).
    """
    n = x.shape[1]
    heads, head_dim, state = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size
    inner, groups = mixer.intermediate_size, mixer.n_groups
    projected = (mixer.in_proj(x) if project is None else project(mixer, x))[0]  # [N, P]
    used = inner + mixer.conv_dim + heads
    gate, xbc, dt = projected[:, projected.shape[-1] - used :].split([inner, mixer.conv_dim, heads], dim=-1)
    xbc = _conv(mixer, xbc, ctx)
    hidden, b, c = torch.split(xbc, [inner, groups * state, groups * state], dim=-1)
    f = _state_dtype(x)
    dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype))
    dt_min, dt_max = mixer.time_step_limit
    dt = torch.clamp(dt, min=dt_min, max=dt_max).to(f)  # [N, H]
    a = -torch.exp(mixer.A_log.to(f))  # [H]
    hidden = hidden.reshape(n, heads, head_dim).to(f)
    per_group = heads // groups
    b = b.reshape(n, groups, state).to(f).repeat_interleave(per_group, dim=1)
    c = c.reshape(n, groups, state).to(f).repeat_interleave(per_group, dim=1)
    g = (a * dt)[..., None].expand(-1, -1, state)
    y = ctx.recurrence(GATED_LINEAR_ATTENTION, c, b, hidden * dt[..., None], g, scale=1.0)
    y = (y + mixer.D.to(f)[:, None] * hidden).reshape(1, n, inner)
    if gated_norm:
        y = mixer.norm(y, gate[None])
    else:
        y = y * F.silu(gate[None])
    return mixer.out_proj(y.to(x.dtype))
