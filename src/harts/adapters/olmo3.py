"""``olmo3``: post-norm decoder layers (the norm on each sub-block's output, none on its input);
q/k RMSNorms over the whole projection; sliding-window and full layers per ``layer_types``, along
paths; dense MLP."""

from __future__ import annotations

from harts.adapters.base import TINY_COMMON, register
from harts.adapters.gqa_family import GQAFamilyAdapter

__all__ = ["Olmo3Adapter"]


class Olmo3Adapter(GQAFamilyAdapter):
    model_types = ("olmo3",)
    layer_fields = ("self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm")
    attention_fields = (*GQAFamilyAdapter.attention_fields, "q_norm", "k_norm")

    def decoder_block(self, layer, hidden, mix, mlp):
        # h += norm(attn(h)); h += norm(mlp(h)), as Olmo3DecoderLayer.forward
        hidden = hidden + layer.post_attention_layernorm(mix(hidden))
        return hidden + layer.post_feedforward_layernorm(mlp(hidden))

    def tiny_config(self, model_type, **overrides):
        from transformers import Olmo3Config

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
            rope_theta=10000.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        return Olmo3Config(**{**fields, **overrides})


register(Olmo3Adapter())
