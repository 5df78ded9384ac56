"""``bailing_hybrid`` (Ling 3): KDA linear layers; MLA full layers with interleaved RoPE and a
per-head sigmoid output gate; sigmoid-routed MoE with shared experts and a score-correction bias
(no auxiliary loss)."""

from __future__ import annotations

from functools import partial

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, register
from harts.adapters.mixers import kda_mixer, mla_attention

__all__ = ["BailingHybridAdapter"]


class BailingHybridAdapter(FamilyAdapter):
    model_types = ("bailing_hybrid",)
    router_class = "BailingHybridTopkRouter"
    moe_balancing = MoEBalancing.BIAS
    mixers = {
        "full_attention": ("self_attn", partial(mla_attention, rope=True, head_gate=True)),
        "linear_attention": ("self_attn", partial(kda_mixer, output_gate=lambda attn, x: attn.g_proj(x))),
    }
    stock_delta_rule_kernels = ("chunk_kimi_delta_attention",)
    small_overrides = {
        "bailing_hybrid": dict(moe_intermediate_size=64, head_dim=32, qk_nope_head_dim=32, v_head_dim=32)
    }

    def tiny_config(self, model_type, **overrides):
        from transformers import BailingHybridConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            kv_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,
            short_conv_kernel_size=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            num_mtp_layers=0,
            rope_theta=10000.0,
        )
        return BailingHybridConfig(**{**fields, **overrides})


register(BailingHybridAdapter())
