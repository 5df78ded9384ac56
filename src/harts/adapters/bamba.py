"""``bamba`` (IBM Bamba): Mamba-2 layers and grouped-query attention layers with partial RoPE (the
layers ``attn_layer_indices`` names), each followed by a dense SwiGLU MLP.

The Mamba-2 layers run :func:`~harts.adapters.mixers.mamba2_mixer` (the module's own gated
RMSNorm over ``mamba_n_groups`` groups); the attention layers
:func:`~harts.adapters.mixers.gqa_attention` with the module's own rotary helper (the first
``partial_rotary_factor`` of each head rotated). The decoder layer's norms are ``input_layernorm``
and ``pre_ff_layernorm`` around ``feed_forward``, the final norm ``final_layernorm``.

``z_loss_coefficient`` is a term of the stock loss when the forward is given labels, not of the
logits: harts' objectives read the logits and do not add it.
"""

from __future__ import annotations

import torch

from harts.adapters.base import TINY_COMMON, FamilyAdapter, register, require
from harts.adapters.mixers import MAMBA2_MIXER_ATTRIBUTES, gqa_attention, mamba2_mixer

__all__ = ["BambaAdapter"]

_LAYER = ("input_layernorm", "pre_ff_layernorm", "feed_forward")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


class BambaAdapter(FamilyAdapter):
    model_types = ("bamba",)
    mixers = {"linear_attention": ("mamba", mamba2_mixer), "full_attention": ("self_attn", gqa_attention)}
    inexact_cache = (
        "transformers' Bamba cache, gathered at a branch point and extended, gives log-probs 0.020 off a "
        "full forward of the same tokens (measured on 5.24)"
    )

    def check_model(self, model):
        backbone = self.backbone(model)
        require("bamba", backbone, "embed_tokens", "layers", "final_layernorm", "rotary_emb")
        require("bamba", model.config, "layers_block_type")
        for i, layer in enumerate(backbone.layers[: model.config.num_hidden_layers]):
            require("bamba", layer, *_LAYER)
            if self.layer_type(model, i) == "linear_attention":
                require("bamba", layer, "mamba")
                require("bamba", layer.mamba, *MAMBA2_MIXER_ATTRIBUTES)
            else:
                require("bamba", layer, "self_attn")
                require("bamba", layer.self_attn, *_ATTENTION)

    def final_norm(self, backbone):
        return backbone.final_layernorm

    def layer_type(self, model, index):
        # Mamba layers are "mamba" or "linear_attention" depending on the transformers version
        kind = model.config.layers_block_type[index]
        return "linear_attention" if kind in ("mamba", "linear_attention") else "full_attention"

    def decoder_block(self, layer, hidden, mix, mlp):
        hidden = hidden + mix(layer.input_layernorm(hidden))
        return hidden + layer.feed_forward(layer.pre_ff_layernorm(hidden))

    def tiny_config(self, model_type, **overrides):
        from transformers import BambaConfig

        # mamba, attention, mamba
        fields = dict(
            TINY_COMMON,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            mamba_n_heads=8,
            mamba_d_head="auto",
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
            mamba_conv_bias=True,
            mamba_proj_bias=True,
            tie_word_embeddings=False,
            rope_theta=10000.0,
        )
        return BambaConfig(**{**fields, **overrides})

    def randomize_tiny(self, model):
        # the gated norms' weights, D and dt_bias start at one: random, so that a missed term shows
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("mamba.norm.weight", "mamba.D")):
                    parameter.uniform_(0.5, 1.5)
                elif name.endswith("mamba.dt_bias"):
                    parameter.uniform_(-1.0, 1.0)


register(BambaAdapter())
