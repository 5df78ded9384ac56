"""``lara_mini`` (Lara-Mini): Gated DeltaNet layers (qwen3_5's: separate q|k|v, z, b, a projections,
grouped value heads, gated RMSNorm), sliding-window attention layers with RoPE and full attention
layers without position embeddings (NoPE), both with per-head q/k RMSNorms; a softmax-routed MoE
with an ungated shared expert in every layer, trained with the Switch load-balancing loss.

The decoder layers are pre-norm (``input_layernorm`` / ``post_attention_layernorm`` around the MoE
block ``mlp``). The sliding layers attend to the last ``sliding_window`` tokens of each path.
"""

from __future__ import annotations

from functools import partial

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, TreeOps, register, require
from harts.adapters.gqa_family import layer_window
from harts.adapters.mixers import QWEN3_5_GDN_ATTRIBUTES, gdn_mixer, gqa_attention, qwen3_5_gdn_projections

__all__ = ["LaraMiniAdapter", "lara_mini_attention"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "head_dim", "scaling")
_LAYER = ("mlp", "input_layernorm", "post_attention_layernorm")


def lara_mini_attention(attn, x, ctx: TreeOps, layer_type: str):
    """As ``LaraMiniAttention.forward``: per-head q/k norms; RoPE and the window on the sliding layers
    only (the stock model hands the full layers no position embeddings)."""
    window = layer_window(attn.config, layer_type)
    return gqa_attention(attn, x, ctx, window=window, rope=layer_type == "sliding_attention")


class LaraMiniAdapter(FamilyAdapter):
    model_types = ("lara_mini",)
    router_class = "LaraMiniTopKRouter"
    moe_balancing = MoEBalancing.AUX_LOSS
    sliding_windows = True
    mixers = {
        "linear_attention": ("linear_attn", partial(gdn_mixer, projections=qwen3_5_gdn_projections)),
        "sliding_attention": ("self_attn", partial(lara_mini_attention, layer_type="sliding_attention")),
        "full_attention": ("self_attn", partial(lara_mini_attention, layer_type="full_attention")),
    }
    stock_delta_rule_kernels = ("torch_chunk_gated_delta_rule",)
    small_overrides = {
        "lara_mini": dict(
            head_dim=32,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
    }

    def check_model(self, model):
        backbone = self.backbone(model)
        require("lara_mini", backbone, "embed_tokens", "layers", "norm", "rotary_emb")
        for layer, layer_type in zip(backbone.layers, model.config.layer_types, strict=False):
            require("lara_mini", layer, *_LAYER)
            if layer_type == "linear_attention":
                require("lara_mini", layer, "linear_attn")
                require("lara_mini", layer.linear_attn, *QWEN3_5_GDN_ATTRIBUTES)
            else:
                require("lara_mini", layer, "self_attn")
                require("lara_mini", layer.self_attn, *_ATTENTION, "config")

    def tiny_config(self, model_type, **overrides):
        from transformers.models.lara_mini import LaraMiniConfig

        # GDN, sliding, GDN, full, sliding
        fields = dict(
            TINY_COMMON,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            sliding_window=4,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            layer_types=[
                "linear_attention",
                "sliding_attention",
                "linear_attention",
                "full_attention",
                "sliding_attention",
            ],
        )
        return LaraMiniConfig(**{**fields, **overrides})

    def randomize_tiny(self, model):
        # the gated norms start at one: random, so that a norm in the wrong place shows
        import torch

        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("linear_attn.norm.weight", "q_norm.weight", "k_norm.weight")):
                    parameter.uniform_(0.5, 1.5)


register(LaraMiniAdapter())
