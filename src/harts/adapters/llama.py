"""``qwen3`` and ``llama``: plain grouped-query attention with RoPE (qwen3 with q/k norms); dense
MLPs."""

from __future__ import annotations

from harts.adapters.base import TINY_COMMON, FamilyAdapter, register
from harts.adapters.mixers import gqa_attention

__all__ = ["LlamaLikeAdapter"]


class LlamaLikeAdapter(FamilyAdapter):
    model_types = ("qwen3", "llama")
    mixers = {"full_attention": ("self_attn", gqa_attention)}
    small_overrides = {"qwen3": dict(head_dim=32)}

    def tiny_config(self, model_type, **overrides):
        from transformers import LlamaConfig, Qwen3Config

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
        )
        if model_type == "qwen3":
            return Qwen3Config(**{**fields, "head_dim": 16, **overrides})
        return LlamaConfig(**{**fields, **overrides})


register(LlamaLikeAdapter())
