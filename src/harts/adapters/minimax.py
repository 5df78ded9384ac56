"""``minimax`` (MiniMax-Text-01): lightning attention (linear attention with a fixed per-head decay)
interleaved with grouped-query attention; softmax-routed MoE in every layer, trained with the
Switch load-balancing loss.

The decoder layer is not the pre-norm block: the normed input is the residual, and each branch is
mixed as ``alpha * residual + beta * branch`` with per-layer-kind factors
(``MiniMaxDecoderLayer.forward``), which :meth:`MiniMaxAdapter.decoder_block` reproduces.

Refused: ``sliding_window`` (full-attention layers would slide), ``router_jitter_noise`` > 0
(random multiplicative noise on the MoE input in training).
"""

from __future__ import annotations

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, register, require
from harts.adapters.mixers import gqa_attention, lightning_mixer

__all__ = ["MiniMaxAdapter"]

_LAYER = (
    "self_attn",
    "mlp",
    "input_layernorm",
    "post_attention_layernorm",
    "attn_alpha_factor",
    "attn_beta_factor",
    "mlp_alpha_factor",
    "mlp_beta_factor",
)
_LIGHTNING = (
    "qkv_proj",
    "act_fn",
    "slope_rate",
    "norm",
    "output_gate",
    "out_proj",
    "num_attention_heads",
    "head_dim",
)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


class MiniMaxAdapter(FamilyAdapter):
    model_types = ("minimax",)
    router_class = "MiniMaxTopKRouter"
    moe_balancing = MoEBalancing.AUX_LOSS
    mixers = {
        "full_attention": ("self_attn", gqa_attention),
        "linear_attention": ("self_attn", lightning_mixer),
    }
    inexact_cache = (
        "transformers' MiniMax cache, extended by several tokens at once, gives log-probs up to 0.19 off a "
        "full forward of the same tokens"
    )
    small_overrides = {"minimax": dict(head_dim=32)}

    def check_config(self, config):
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError(f"minimax: sliding_window={config.sliding_window} is not supported by harts")
        if getattr(config, "router_jitter_noise", 0.0):
            raise ValueError(
                f"minimax: router_jitter_noise={config.router_jitter_noise} multiplies the MoE input by "
                f"random noise in training, which no per-trajectory run reproduces; set it to 0"
            )

    def check_model(self, model):
        backbone = self.backbone(model)
        require("minimax", backbone, "embed_tokens", "layers", "norm", "rotary_emb")
        for layer, layer_type in zip(backbone.layers, model.config.layer_types, strict=False):
            require("minimax", layer, *_LAYER)
            fields = _LIGHTNING if layer_type == "linear_attention" else _ATTENTION
            require("minimax", layer.self_attn, *fields)

    def decoder_block(self, layer, hidden, mix, mlp):
        hidden = layer.input_layernorm(hidden)
        hidden = hidden * layer.attn_alpha_factor + mix(hidden) * layer.attn_beta_factor
        hidden = layer.post_attention_layernorm(hidden)
        return hidden * layer.mlp_alpha_factor + mlp(hidden) * layer.mlp_beta_factor

    def tiny_config(self, model_type, **overrides):
        from transformers import MiniMaxConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            block_size=16,
            rope_theta=10000.0,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            full_attn_alpha_factor=1.3,
            full_attn_beta_factor=0.8,
            linear_attn_alpha_factor=0.9,
            linear_attn_beta_factor=1.2,
            mlp_alpha_factor=1.1,
            mlp_beta_factor=0.7,
        )
        return MiniMaxConfig(**{**fields, **overrides})


register(MiniMaxAdapter())
