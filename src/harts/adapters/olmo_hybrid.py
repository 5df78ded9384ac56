"""``olmo_hybrid`` (Olmo-Hybrid): Gated DeltaNet layers and olmo3-style attention layers, a dense
SwiGLU MLP in each.

The Gated DeltaNet is qwen3_next's, with separate ``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``,
``b_proj`` projections and a dedicated output gate ``g_proj``: the depthwise causal conv over q|k|v
(one ``conv1d`` with ``hidden_act`` on 5.2x; ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` with their own
silu on 5.10, the same per-channel taps) runs along paths; the decay ``g = -exp(A_log) *
softplus(a + dt_bias)`` is one per value head; ``beta = sigmoid(b)``, doubled with
``linear_allow_neg_eigval`` (values in [0, 2]); q and k are L2-normalised in the delta rule and each
key head serves consecutive value heads, as in the stock chunked kernel; then the gated RMSNorm
``o_norm(out, g_proj(h))`` per value head and ``o_proj``.

The linear-attention layers are pre-norm (``input_layernorm`` / ``post_attention_layernorm``); the
attention layers are olmo3's post-norm ones (``post_attention_layernorm`` on the attention's output,
``post_feedforward_layernorm`` on the MLP's) with q/k RMSNorms over the whole projection. RoPE only
where the config sets ``rope_parameters`` with a ``rope_theta`` (the released checkpoints have none:
their attention runs without position embeddings, NoPE, as the stock model).
"""

from __future__ import annotations

import torch

from harts.adapters.base import TINY_COMMON, FamilyAdapter, TreeOps, register, require
from harts.adapters.mixers import gated_delta_rule, gqa_attention

__all__ = ["OlmoHybridAdapter", "olmo_hybrid_gdn", "olmo_hybrid_attention"]

_GDN = (
    "q_proj",
    "k_proj",
    "v_proj",
    "a_proj",
    "b_proj",
    "g_proj",
    "o_proj",
    "o_norm",
    "A_log",
    "dt_bias",
    "allow_neg_eigval",
    "key_dim",
    "value_dim",
    "head_k_dim",
    "head_v_dim",
    "num_k_heads",
    "num_v_heads",
)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "head_dim", "scaling")
_LINEAR_LAYER = ("linear_attn", "mlp", "input_layernorm", "post_attention_layernorm")
_ATTENTION_LAYER = ("self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm")


def _qkv_conv(attn, mixed: torch.Tensor, ctx: TreeOps) -> torch.Tensor:
    """The depthwise causal conv and activation over q|k|v [N, C] along paths, as the stock layer of
    the installed version: one ``conv1d`` and ``ACT2FN[activation]`` (5.2x), or three short
    convolutions without bias, each with its own ``act_fn`` (5.10; per channel, so their taps
    concatenated are one conv)."""
    if hasattr(attn, "conv1d"):
        from transformers.activations import ACT2FN

        conv = attn.conv1d
        out = ctx.conv(mixed, conv.weight.squeeze(1), conv.bias)
        return ACT2FN[attn.activation](out).to(mixed.dtype)
    convs = (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
    weight = torch.cat([c.weight.squeeze(1) for c in convs])
    out = ctx.conv(mixed, weight, None)
    parts = out.split([attn.key_dim, attn.key_dim, attn.value_dim], dim=-1)
    return torch.cat([c.act_fn(p) for c, p in zip(convs, parts, strict=True)], dim=-1).to(mixed.dtype)


def olmo_hybrid_gdn(attn, x, ctx: TreeOps) -> torch.Tensor:
    """Olmo-Hybrid's Gated DeltaNet, as ``OlmoHybridGatedDeltaNet.forward`` (see the module docstring)."""
    n = x.shape[1]
    mixed = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)[0]
    beta_scale = 2.0 if attn.allow_neg_eigval else 1.0
    out = gated_delta_rule(attn, _qkv_conv(attn, mixed, ctx), attn.b_proj(x), attn.a_proj(x), ctx, beta_scale)
    gate = attn.g_proj(x)
    out = attn.o_norm(out.reshape(-1, attn.head_v_dim), gate.reshape(-1, attn.head_v_dim))
    return attn.o_proj(out.reshape(1, n, -1))


def olmo_hybrid_attention(attn, x, ctx: TreeOps) -> torch.Tensor:
    """olmo3's attention (q/k norms over the whole projection), with RoPE only where the model has a
    rotary module (NoPE otherwise, as ``OlmoHybridAttention.forward`` given no position embeddings)."""
    return gqa_attention(attn, x, ctx, rope=ctx.position_embeddings is not None)


class OlmoHybridAdapter(FamilyAdapter):
    model_types = ("olmo_hybrid",)
    mixers = {
        "linear_attention": ("linear_attn", olmo_hybrid_gdn),
        "full_attention": ("self_attn", olmo_hybrid_attention),
    }
    stock_delta_rule_kernels = ("torch_chunk_gated_delta_rule",)
    # measured exact on 5.20, 5.22, 5.23, 5.24, 5.25; 5.10.4 (its own hybrid cache) 0.39 off after a branch
    # point; 5.11 to 5.19 not measured
    exact_cache_from = "5.20.0"
    small_overrides = {"olmo_hybrid": dict(linear_key_head_dim=32, linear_value_head_dim=32)}

    def check_config(self, config) -> None:
        heads_k, heads_v = config.linear_num_key_heads, config.linear_num_value_heads
        if heads_v % heads_k:
            raise ValueError(
                f"olmo_hybrid: linear_num_value_heads={heads_v} is not a multiple of "
                f"linear_num_key_heads={heads_k}"
            )

    def check_model(self, model):
        backbone = self.backbone(model)
        require("olmo_hybrid", backbone, "embed_tokens", "layers", "norm", "rotary_emb")
        for layer, layer_type in zip(backbone.layers, model.config.layer_types, strict=False):
            if layer_type == "linear_attention":
                require("olmo_hybrid", layer, *_LINEAR_LAYER)
                require("olmo_hybrid", layer.linear_attn, *_GDN)
                if not hasattr(layer.linear_attn, "conv1d"):
                    require("olmo_hybrid", layer.linear_attn, "q_conv1d", "k_conv1d", "v_conv1d")
            elif layer_type == "full_attention":
                require("olmo_hybrid", layer, *_ATTENTION_LAYER)
                require("olmo_hybrid", layer.self_attn, *_ATTENTION)

    def decoder_block(self, layer, hidden, mix, mlp):
        if hasattr(layer, "linear_attn"):  # pre-norm, as OlmoHybridLinearAttentionDecoderLayer
            hidden = hidden + mix(layer.input_layernorm(hidden))
            return hidden + mlp(layer.post_attention_layernorm(hidden))
        # post-norm, as OlmoHybridAttentionDecoderLayer (olmo3's)
        hidden = hidden + layer.post_attention_layernorm(mix(hidden))
        return hidden + layer.post_feedforward_layernorm(mlp(hidden))

    def tiny_config(self, model_type, **overrides):
        from transformers import OlmoHybridConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        )
        return OlmoHybridConfig(**{**fields, **overrides})

    def randomize_tiny(self, model):
        # the norms start at one: random, so that a norm applied in the wrong place shows
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("o_norm.weight", "q_norm.weight", "k_norm.weight", "layernorm.weight")):
                    parameter.uniform_(0.5, 1.5)


register(OlmoHybridAdapter())
