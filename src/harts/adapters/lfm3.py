"""``lfm3`` (Liquid LFM3): :mod:`lfm2`'s gated short convolutions, and attention layers, sliding
(``sliding_attention``, along paths) or full, with per-head q/k RMSNorms, a rotary table per layer
type (the full layers' ``proportional`` partial RoPE) and, with ``use_attention_gate``, a sigmoid
gate per head (``g_proj`` of the layer input) on the attention output; dense SwiGLU feed-forward.

With ``use_sandwich_norm`` the operator's and the feed-forward's outputs are normed
(``post_operator_norm``, ``post_ffn_norm``) before they join the residual stream; without, those
are the stock identities. The final norm is ``embedding_norm``.
"""

from __future__ import annotations

from functools import partial

import torch

from harts.adapters.base import TINY_COMMON, TreeOps, hf_function, register, require
from harts.adapters.gqa_family import LayerTypeRotary
from harts.adapters.lfm2 import Lfm2Adapter, lfm2_conv

__all__ = ["Lfm3Adapter", "lfm3_attention"]

_LAYER = ("operator_norm", "ffn_norm", "feed_forward", "post_operator_norm", "post_ffn_norm")
_CONV = ("in_proj", "conv", "out_proj")
_ATTENTION = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_norm",
    "k_norm",
    "g_proj",
    "head_dim",
    "scaling",
    "sliding_window",
)


def lfm3_attention(attn, x, ctx: TreeOps, layer_type: str) -> torch.Tensor:
    """As ``Lfm3Attention.forward``: per-head q/k RMSNorm, the layer type's RoPE, attention along paths
    (within ``sliding_window`` on sliding layers), each head's output times sigmoid(``g_proj(x)``)."""
    n = x.shape[1]
    shape = (1, n, -1, attn.head_dim)
    query = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
    key = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
    value = attn.v_proj(x).view(shape).transpose(1, 2)
    cos, sin = ctx.position_embeddings[layer_type]
    query, key = hf_function(attn, "apply_rotary_pos_emb")(query, key, cos, sin)
    out = ctx.attend(query, key, value, attn.scaling, window=attn.sliding_window)  # [1, n, H, d]
    if attn.g_proj is not None:
        out = out * torch.sigmoid(attn.g_proj(x)).unsqueeze(-1)
    return attn.o_proj(out.reshape(1, n, -1))


class Lfm3Adapter(Lfm2Adapter):
    model_types = ("lfm3",)
    sliding_windows = True
    mixers = {
        "conv": ("conv", lfm2_conv),
        "full_attention": ("self_attn", partial(lfm3_attention, layer_type="full_attention")),
        "sliding_attention": ("self_attn", partial(lfm3_attention, layer_type="sliding_attention")),
    }
    exact_cache_from = None  # its stock cache measured exact from its first version (5.23) on

    def check_model(self, model):
        backbone = self.backbone(model)
        require("lfm3", backbone, "embed_tokens", "layers", "embedding_norm", "rotary_emb")
        require("lfm3", backbone.rotary_emb, "layer_types")
        for layer, layer_type in zip(backbone.layers, model.config.layer_types, strict=False):
            require("lfm3", layer, *_LAYER)
            if layer_type == "conv":
                require("lfm3", layer, "conv")
                require("lfm3", layer.conv, *_CONV)
            else:
                require("lfm3", layer, "self_attn")
                require("lfm3", layer.self_attn, *_ATTENTION)

    def rotary(self, backbone):
        # one table per attention layer type (conv layers have none), as Lfm3Model.forward
        rotary = backbone.rotary_emb
        return LayerTypeRotary(rotary, rotary.layer_types)

    def decoder_block(self, layer, hidden, mix, mlp):
        # the sandwich: h += post_operator_norm(mix(operator_norm(h))); h += post_ffn_norm(ffn(ffn_norm(h)))
        hidden = hidden + layer.post_operator_norm(mix(layer.operator_norm(hidden)))
        return hidden + layer.post_ffn_norm(layer.feed_forward(layer.ffn_norm(hidden)))

    def tiny_config(self, model_type, **overrides):
        from transformers.models.lfm3 import Lfm3Config

        # conv, sliding attention, conv, full attention, conv
        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            norm_eps=1e-5,
            conv_L_cache=3,
            conv_bias=True,
            sliding_window=4,
            tie_word_embeddings=False,
            layer_types=["conv", "sliding_attention", "conv", "full_attention", "conv"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "rope_theta": 100000.0,
                    "partial_rotary_factor": 0.5,
                },
            },
        )
        fields.pop("rms_norm_eps")
        return Lfm3Config(**{**fields, **overrides})

    def randomize_tiny(self, model):
        # the norms start at one: random, so that a norm in the wrong place shows
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.uniform_(0.5, 1.5)


register(Lfm3Adapter())
