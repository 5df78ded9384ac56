"""``qwen3_next``: Gated DeltaNet with grouped value heads; gated attention with partial RoPE and
q/k norms; softmax-routed MoE with a gated shared expert, trained with the Switch load-balancing
loss."""

from __future__ import annotations

from functools import partial

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, register
from harts.adapters.mixers import gdn_mixer, gqa_attention

__all__ = ["Qwen3NextAdapter"]


class Qwen3NextAdapter(FamilyAdapter):
    model_types = ("qwen3_next",)
    router_class = "Qwen3NextTopKRouter"
    moe_balancing = MoEBalancing.AUX_LOSS
    mixers = {
        "full_attention": ("self_attn", partial(gqa_attention, output_gate=True)),
        "linear_attention": ("linear_attn", gdn_mixer),
    }
    stock_delta_rule_kernels = ("torch_chunk_gated_delta_rule",)
    small_overrides = {
        "qwen3_next": dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, head_dim=32)
    }

    def tiny_config(self, model_type, **overrides):
        from transformers import Qwen3NextConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            partial_rotary_factor=0.5,
            rope_theta=10000.0,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        )
        return Qwen3NextConfig(**{**fields, **overrides})


register(Qwen3NextAdapter())
