"""``gpt_oss``: grouped-query attention with q/k/v/o biases and attention sinks (a learned logit per
head added to the softmax denominator, run as one more always-visible key of value zero, see
:mod:`harts.ops.tree_attention`); sliding-window layers alternating with full ones per
``layer_types``, along paths; MoE with a biased linear router (softmax over the top-k logits),
clamped SwiGLU experts, trained with the Switch load-balancing loss (``router_aux_loss_coef``)."""

from __future__ import annotations

from harts.adapters.base import TINY_COMMON, MoEBalancing, register
from harts.adapters.gqa_family import GQAFamilyAdapter, gqa_mixers

__all__ = ["GptOssAdapter"]


class GptOssAdapter(GQAFamilyAdapter):
    model_types = ("gpt_oss",)
    router_class = "GptOssTopKRouter"
    moe_balancing = MoEBalancing.AUX_LOSS
    sinks = True
    mixers = gqa_mixers(sinks=True)
    small_overrides = {"gpt_oss": dict(head_dim=32)}

    def tiny_config(self, model_type, **overrides):
        from transformers import GptOssConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_theta=10000.0,
        )
        return GptOssConfig(**{**fields, **overrides})


register(GptOssAdapter())
