"""``gemma3_text`` (Gemma 3 as a text model, ``Gemma3ForCausalLM``): sandwich norms (one before and
one after each of attention and MLP); local sliding-window and global layers per ``layer_types``,
each with its own rotary base; q/k norms per head; ``query_pre_attn_scalar`` as the attention
scale; the embedding's scaling by sqrt(hidden) (inside the model's own embedding module);
``final_logit_softcapping`` (``c * tanh(logits / c)`` after the head, which every reader of harts'
head applies in the stock order: cap, then any sampling temperature).

Refused: ``attn_logit_softcapping`` (a tanh on every score, which a fused softmax cannot take) and
bidirectional attention (embedding models). The multimodal ``gemma3``
(``Gemma3ForConditionalGeneration``) is not run.
"""

from __future__ import annotations

from harts.adapters.base import TINY_COMMON, register
from harts.adapters.gqa_family import GQAFamilyAdapter

__all__ = ["Gemma3Adapter"]


class Gemma3Adapter(GQAFamilyAdapter):
    model_types = ("gemma3_text",)
    modeling_package = {"gemma3_text": "gemma3"}
    layer_fields = (
        "self_attn",
        "mlp",
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )
    attention_fields = (*GQAFamilyAdapter.attention_fields, "q_norm", "k_norm")
    final_logit_softcapping = True  # Gemma3ForCausalLM.forward caps its logits after lm_head
    small_overrides = {"gemma3_text": dict(head_dim=32)}

    def check_config(self, config):
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError(
                f"gemma3_text: attn_logit_softcapping={config.attn_logit_softcapping} applies a tanh to "
                f"every attention score, which harts' fused tree attention does not; set it to None"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                "gemma3_text: use_bidirectional_attention (embedding models) is not causal; "
                "harts trains causal language models"
            )

    def decoder_block(self, layer, hidden, mix, mlp):
        # as Gemma3DecoderLayer.forward: a norm before and after each sub-block
        hidden = hidden + layer.post_attention_layernorm(mix(layer.input_layernorm(hidden)))
        return hidden + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(hidden)))

    def tiny_config(self, model_type, **overrides):
        from transformers import Gemma3TextConfig

        fields = dict(
            TINY_COMMON,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        return Gemma3TextConfig(**{**fields, **overrides})


register(Gemma3Adapter())
