"""Grouped-query attention with MoE feed-forward layers:

- ``qwen3_moe``: q/k norms per head; softmax top-k routing trained with the Switch load-balancing
  loss (``router_aux_loss_coef``); sliding windows on every layer when ``use_sliding_window``.
- ``glm4_moe``: partial RoPE, optional q/k norms (``use_qk_norm``) and q/k/v biases; sigmoid routing
  over expert groups with a score-correction bias and shared experts (no auxiliary loss), dense
  layers before ``first_k_dense_replace``.

Routing is token-wise, so each unique token is routed once by the model's own router.
"""

from __future__ import annotations

from harts.adapters.base import TINY_COMMON, MoEBalancing, register
from harts.adapters.gqa_family import GQAFamilyAdapter, router_if_it_chooses

__all__ = ["Qwen3MoeAdapter", "Glm4MoeAdapter"]


class Qwen3MoeAdapter(GQAFamilyAdapter):
    model_types = ("qwen3_moe",)
    router_class = "Qwen3MoeTopKRouter"
    moe_balancing = MoEBalancing.AUX_LOSS
    small_overrides = {"qwen3_moe": dict(moe_intermediate_size=64, head_dim=32)}

    def tiny_config(self, model_type, **overrides):
        from transformers import Qwen3MoeConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=True,
            rope_theta=10000.0,
        )
        return Qwen3MoeConfig(**{**fields, **overrides})


class Glm4MoeAdapter(GQAFamilyAdapter):
    model_types = ("glm4_moe",)
    moe_balancing = MoEBalancing.BIAS
    small_overrides = {"glm4_moe": dict(moe_intermediate_size=64, head_dim=32)}

    @property
    def router_class(self):
        return router_if_it_chooses("glm4_moe", "Glm4MoeMoE", "Glm4MoeTopkRouter")

    def tiny_config(self, model_type, **overrides):
        from transformers import Glm4MoeConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
            rope_theta=10000.0,
        )
        return Glm4MoeConfig(**{**fields, **overrides})


register(Qwen3MoeAdapter())
register(Glm4MoeAdapter())
