"""``kimi_linear``: KDA with low-rank forget and output gates; NoPE MLA with q-LoRA; sigmoid-routed
MoE with a score-correction bias (no auxiliary loss)."""

from __future__ import annotations

from functools import partial

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, register
from harts.adapters.mixers import kda_mixer, mla_attention

__all__ = ["KimiLinearAdapter"]


class KimiLinearAdapter(FamilyAdapter):
    model_types = ("kimi_linear",)
    router_class = "KimiLinearTopkRouter"
    moe_balancing = MoEBalancing.BIAS
    mixers = {
        "full_attention": ("self_attn", partial(mla_attention, rope=False, head_gate=False)),
        "linear_attention": (
            "self_attn",
            partial(kda_mixer, output_gate=lambda attn, x: attn.g_b_proj(attn.g_a_proj(x))),
        ),
    }
    stock_delta_rule_kernels = ("chunk_kimi_delta_attention",)
    small_overrides = {"kimi_linear": dict(moe_intermediate_size=64, linear_head_dim=32)}

    def tiny_config(self, model_type, **overrides):
        from transformers import KimiLinearConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=24,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        )
        return KimiLinearConfig(**{**fields, **overrides})


register(KimiLinearAdapter())
