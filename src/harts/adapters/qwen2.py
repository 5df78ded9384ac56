"""``qwen2`` and ``mistral``: dense grouped-query attention with RoPE (qwen2 with q/k/v biases);
sliding windows along paths (qwen2 on the layers past ``max_window_layers`` when
``use_sliding_window``; mistral on every layer when ``sliding_window`` is set)."""

from __future__ import annotations

from harts.adapters.base import TINY_COMMON, register
from harts.adapters.gqa_family import GQAFamilyAdapter

__all__ = ["Qwen2Adapter"]


class Qwen2Adapter(GQAFamilyAdapter):
    model_types = ("qwen2", "mistral")
    small_overrides = {"mistral": dict(head_dim=32)}

    def tiny_config(self, model_type, **overrides):
        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
        )
        if model_type == "qwen2":
            from transformers import Qwen2Config

            # layers 1 and 2 slide over 5 tokens: the tests' paths run far past the window
            fields.update(use_sliding_window=True, sliding_window=5, max_window_layers=1)
            return Qwen2Config(**{**fields, **overrides})
        from transformers import MistralConfig

        return MistralConfig(**{**fields, "head_dim": 16, "sliding_window": 6, **overrides})


register(Qwen2Adapter())
