"""``qwen3_5`` and ``qwen3_5_moe`` text causal LMs: Gated DeltaNet with separate q|k|v, z, b, a
projections and grouped value heads; gated attention with partial (M)RoPE and zero-centred q/k
norms; a dense MLP (``qwen3_5``) or a softmax-routed MoE with a gated shared expert trained with the
Switch load-balancing loss (``qwen3_5_moe``).

The text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``; config types ``qwen3_5_text`` /
``qwen3_5_moe_text``) run as they are; for text tokens the three MRoPE axes carry the same position,
so the rotary tables at path positions are exactly the stock ones. The multimodal
``*ForConditionalGeneration`` models (types ``qwen3_5`` / ``qwen3_5_moe``) run as their text causal
LM beside their vision tower (:mod:`harts.adapters.qwen3_5_vision`): image features replace the
image tokens' embeddings and the stock M-RoPE positions replace path positions; videos are refused.
"""

from __future__ import annotations

from functools import partial

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, register, require
from harts.adapters.mixers import QWEN3_5_GDN_ATTRIBUTES, gdn_mixer, gqa_attention, qwen3_5_gdn_projections
from harts.adapters.qwen3_5_vision import Qwen3_5VisionLanguage

__all__ = ["Qwen3_5Adapter", "Qwen3_5MoeAdapter"]

_ATTENTION_ATTRIBUTES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "head_dim", "scaling")
_LAYER_ATTRIBUTES = ("mlp", "input_layernorm", "post_attention_layernorm")


class Qwen3_5Adapter(FamilyAdapter):
    model_types = ("qwen3_5",)
    config_aliases = {"qwen3_5_text": "qwen3_5"}
    family = "qwen3_5"
    mixers = {
        "full_attention": ("self_attn", partial(gqa_attention, output_gate=True)),
        "linear_attention": ("linear_attn", partial(gdn_mixer, projections=qwen3_5_gdn_projections)),
    }
    stock_delta_rule_kernels = ("torch_chunk_gated_delta_rule",)
    small_overrides = {"qwen3_5": dict(head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)}
    vision_language = Qwen3_5VisionLanguage("qwen3_5")

    def check_config(self, config) -> None:
        if hasattr(config, "text_config"):
            raise ValueError(
                f"{self.family}: the multimodal {self.family} model (config type {config.model_type!r}) runs "
                f"as its *ForConditionalGeneration, whose text causal LM ({config.model_type}_text) harts "
                f"takes beside its vision tower; other heads over the multimodal model are not supported"
            )
        heads_k, heads_v = config.linear_num_key_heads, config.linear_num_value_heads
        if heads_v % heads_k:
            raise ValueError(
                f"{self.family}: linear_num_value_heads={heads_v} is not a multiple of "
                f"linear_num_key_heads={heads_k}"
            )

    def check_model(self, model):
        backbone = self.backbone(model)
        require(self.family, backbone, "embed_tokens", "layers", "norm", "rotary_emb")
        for layer, layer_type in zip(backbone.layers, model.config.layer_types, strict=False):
            require(self.family, layer, *_LAYER_ATTRIBUTES)
            if layer_type == "linear_attention":
                require(self.family, layer, "linear_attn")
                require(self.family, layer.linear_attn, *QWEN3_5_GDN_ATTRIBUTES)
            elif layer_type == "full_attention":
                require(self.family, layer, "self_attn")
                require(self.family, layer.self_attn, *_ATTENTION_ATTRIBUTES)

    def _fields(self):
        return dict(
            TINY_COMMON,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
            },
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        )

    def tiny_config(self, model_type, **overrides):
        from transformers.models.qwen3_5 import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**{**self._fields(), "intermediate_size": 96, **overrides})


class Qwen3_5MoeAdapter(Qwen3_5Adapter):
    model_types = ("qwen3_5_moe",)
    config_aliases = {"qwen3_5_moe_text": "qwen3_5_moe"}
    family = "qwen3_5_moe"
    router_class = "Qwen3_5MoeTopKRouter"
    moe_balancing = MoEBalancing.AUX_LOSS
    vision_language = Qwen3_5VisionLanguage("qwen3_5_moe")
    small_overrides = {
        "qwen3_5_moe": dict(
            Qwen3_5Adapter.small_overrides["qwen3_5"],
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
    }

    def tiny_config(self, model_type, **overrides):
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

        fields = dict(
            self._fields(),
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
        )
        return Qwen3_5MoeTextConfig(**{**fields, **overrides})


register(Qwen3_5Adapter())
register(Qwen3_5MoeAdapter())
