"""``lfm2`` (Liquid LFM2): gated short-convolution blocks and grouped-query attention with q/k
norms; dense SwiGLU feed-forward.

A conv block is ``out_proj(C * conv(B * x))`` with ``B, C, x = in_proj(h)`` and a depthwise causal
conv without activation: the conv runs along each token's path (``ctx.conv``), across short
ancestor nodes, its inputs handed over at cuts. The block's norms are ``operator_norm`` and
``ffn_norm`` around ``feed_forward``, the final norm ``embedding_norm``.

Left out: the vision-language ``lfm2_vl`` (another family). ``lfm2_moe`` is :mod:`harts.adapters.lfm2_moe`.
"""

from __future__ import annotations

import torch

from harts.adapters.base import (
    TINY_COMMON,
    FamilyAdapter,
    TreeOps,
    hf_function,
    register,
    require,
)

__all__ = ["Lfm2Adapter", "lfm2_attention", "lfm2_conv"]

_LAYER = ("operator_norm", "ffn_norm", "feed_forward")
_CONV = ("in_proj", "conv", "out_proj")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj", "q_layernorm", "k_layernorm", "head_dim", "scaling")


def lfm2_attention(attn, x, ctx: TreeOps) -> torch.Tensor:
    """GQA with per-head q/k RMSNorm before RoPE, as ``Lfm2Attention.forward``."""
    n = x.shape[1]
    shape = (1, n, -1, attn.head_dim)
    query = attn.q_layernorm(attn.q_proj(x).view(shape)).transpose(1, 2)
    key = attn.k_layernorm(attn.k_proj(x).view(shape)).transpose(1, 2)
    value = attn.v_proj(x).view(shape).transpose(1, 2)
    cos, sin = ctx.position_embeddings
    query, key = hf_function(attn, "apply_rotary_pos_emb")(query, key, cos, sin)
    return attn.out_proj(ctx.attend(query, key, value, attn.scaling).reshape(1, n, -1))


def lfm2_conv(block, x, ctx: TreeOps) -> torch.Tensor:
    """The gated short convolution, as ``Lfm2ShortConv.forward``, its conv along paths."""
    b, c, h = block.in_proj(x)[0].chunk(3, dim=-1)  # [N, D] each
    bx = b * h
    conv = block.conv
    y = ctx.conv(bx, conv.weight.squeeze(1), conv.bias).to(bx.dtype)
    return block.out_proj((c * y)[None])


class Lfm2Adapter(FamilyAdapter):
    model_types = ("lfm2",)
    mixers = {"conv": ("conv", lfm2_conv), "full_attention": ("self_attn", lfm2_attention)}
    exact_cache_from = "5.24.0"  # 5.10.4: 0.20 off after a branch point

    def check_model(self, model):
        backbone = self.backbone(model)
        require(self.model_types[0], backbone, "embed_tokens", "layers", "embedding_norm", self.rotary_name)
        for layer, layer_type in zip(backbone.layers, model.config.layer_types, strict=False):
            require(self.model_types[0], layer, *_LAYER)
            if layer_type == "conv":
                require(self.model_types[0], layer, "conv")
                require(self.model_types[0], layer.conv, *_CONV)
            else:
                require(self.model_types[0], layer, "self_attn")
                require(self.model_types[0], layer.self_attn, *_ATTENTION)

    rotary_name = "rotary_emb"  # the backbone's rotary module (lfm2_moe: ``pos_emb``)

    def rotary(self, backbone):
        return getattr(backbone, self.rotary_name)

    def final_norm(self, backbone):
        return backbone.embedding_norm

    def decoder_block(self, layer, hidden, mix, mlp):
        hidden = hidden + mix(layer.operator_norm(hidden))
        return hidden + layer.feed_forward(layer.ffn_norm(hidden))

    def tiny_config(self, model_type, **overrides):
        from transformers import Lfm2Config

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            norm_eps=1e-5,
            conv_L_cache=3,
            conv_bias=True,
            block_auto_adjust_ff_dim=False,
            layer_types=["conv", "full_attention", "conv", "conv"],
            rope_theta=10000.0,
        )
        fields.pop("rms_norm_eps")
        return Lfm2Config(**{**fields, **overrides})


register(Lfm2Adapter())
