"""The supported families and which tree mixer runs each of their layers.

- ``bailing_hybrid`` (Ling 3): KDA linear layers; MLA full layers with interleaved RoPE and a
  per-head sigmoid output gate; sigmoid-routed MoE with shared experts.
- ``kimi_linear``: KDA with low-rank forget and output gates; NoPE MLA; MoE.
- ``qwen3_next``: Gated DeltaNet; gated attention with partial RoPE and q/k norms; MoE with a
  gated shared expert.
- ``qwen3`` and ``llama``: plain grouped-query attention (qwen3 with q/k norms).

Layer patterns come from ``config.layer_types``, so any order and ratio of linear and full layers
runs. Each adapter checks the configuration options it cannot honour exactly and refuses them.
"""

from __future__ import annotations

from functools import partial

from harts.adapters.base import FamilyAdapter, register
from harts.adapters.mixers import gdn_mixer, gqa_attention, kda_mixer, mla_attention

__all__ = ["BailingHybridAdapter", "KimiLinearAdapter", "Qwen3NextAdapter", "LlamaLikeAdapter"]


def _unknown_layer(family: str, layer_type: str):
    return ValueError(
        f"{family}: layer type {layer_type!r} is not supported (expected full_attention or linear_attention)"
    )


class BailingHybridAdapter(FamilyAdapter):
    model_types = ("bailing_hybrid",)

    def mixer(self, layer, layer_type):
        if layer_type == "full_attention":
            return layer.self_attn, partial(mla_attention, rope=True, head_gate=True)
        if layer_type == "linear_attention":
            return layer.self_attn, partial(kda_mixer, output_gate=lambda attn, x: attn.g_proj(x))
        raise _unknown_layer("bailing_hybrid", layer_type)


class KimiLinearAdapter(FamilyAdapter):
    model_types = ("kimi_linear",)

    def mixer(self, layer, layer_type):
        if layer_type == "full_attention":
            return layer.self_attn, partial(mla_attention, rope=False, head_gate=False)
        if layer_type == "linear_attention":
            return layer.self_attn, partial(
                kda_mixer, output_gate=lambda attn, x: attn.g_b_proj(attn.g_a_proj(x))
            )
        raise _unknown_layer("kimi_linear", layer_type)


class Qwen3NextAdapter(FamilyAdapter):
    model_types = ("qwen3_next",)

    def mixer(self, layer, layer_type):
        if layer_type == "full_attention":
            return layer.self_attn, partial(gqa_attention, output_gate=True)
        if layer_type == "linear_attention":
            return layer.linear_attn, gdn_mixer
        raise _unknown_layer("qwen3_next", layer_type)


class LlamaLikeAdapter(FamilyAdapter):
    model_types = ("qwen3", "llama")

    def check_config(self, config):
        if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
            getattr(config, "layer_types", None) or []
        ):
            raise ValueError(f"{config.model_type}: sliding-window attention is not supported by harts yet")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") == "dynamic":
            raise ValueError(
                f"{config.model_type}: dynamic RoPE rescales by sequence length, "
                "which differs per trajectory; "
                "use a static rope_type"
            )

    def mixer(self, layer, layer_type):
        if layer_type == "full_attention":
            return layer.self_attn, gqa_attention
        raise _unknown_layer(type(layer).__name__, layer_type)


for _adapter in (BailingHybridAdapter(), KimiLinearAdapter(), Qwen3NextAdapter(), LlamaLikeAdapter()):
    register(_adapter)
