"""``deepseek_v3``: multi-head latent attention (q-LoRA, a compressed key/value latent computed
once per unique token, RoPE interleaved or not per ``rope_interleave``); sigmoid routing over expert
groups with a score-correction bias and a shared expert (no auxiliary loss), dense layers before
``first_k_dense_replace``. The multi-token-prediction layers are not run (``num_mtp_layers`` is
not part of the forward transformers runs either)."""

from __future__ import annotations

import torch

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, register, require
from harts.adapters.gqa_family import PRE_NORM_FIELDS, router_if_it_chooses
from harts.adapters.mixers import mla_attention

__all__ = ["DeepseekV3Adapter", "deepseek_v3_attention"]

_MLA_FIELDS = (
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
    "o_proj",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "qk_head_dim",
    "v_head_dim",
    "scaling",
)


def deepseek_v3_attention(attn, x, ctx) -> torch.Tensor:
    """MLA with RoPE, interleaved or not as the module's config says (``rope_interleave``)."""
    interleave = bool(attn.config.rope_interleave)
    return mla_attention(attn, x, ctx, rope=True, head_gate=False, interleave=interleave)


class DeepseekV3Adapter(FamilyAdapter):
    model_types = ("deepseek_v3",)
    moe_balancing = MoEBalancing.BIAS
    mixers = {"full_attention": ("self_attn", deepseek_v3_attention)}

    @property
    def router_class(self):
        return router_if_it_chooses("deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter")

    def check_model(self, model):
        backbone = self.backbone(model)
        require("deepseek_v3", backbone, "embed_tokens", "layers", "norm", "rotary_emb")
        layer = backbone.layers[0]
        require("deepseek_v3", layer, *PRE_NORM_FIELDS)
        require("deepseek_v3", layer.self_attn, *_MLA_FIELDS, "config")
        require("deepseek_v3", layer.self_attn.config, "rope_interleave")

    def tiny_config(self, model_type, **overrides):
        from transformers import DeepseekV3Config

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=24,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            rope_theta=10000.0,
        )
        return DeepseekV3Config(**{**fields, **overrides})


register(DeepseekV3Adapter())
