"""What the grouped-query-attention families share: sliding windows per layer, rotary tables per
layer type, and the load-time check of the modules the tree mixer reads.

Families built on it: ``qwen2``, ``mistral``, ``qwen3_moe``, ``glm4_moe``, ``olmo3``, ``gemma3``,
``gpt_oss`` (each in its own file with its refused options, MoE router and tiny configuration).
Not here: MLA (``deepseek_v3``) and the hybrid families.
"""

from __future__ import annotations

import importlib
from functools import partial

import torch

from harts.adapters.base import FamilyAdapter, require
from harts.adapters.mixers import gqa_attention

__all__ = ["GQAFamilyAdapter", "LayerTypeRotary", "gqa_mixers", "layer_window", "router_if_it_chooses"]

# What gqa_attention reads from an attention module, and the executor from a pre-norm layer.
ATTENTION_FIELDS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
PRE_NORM_FIELDS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def layer_window(config, layer_type: str) -> int | None:
    """The sliding window of a layer, as the stock model masks it: with ``config.layer_types``, only
    ``sliding_attention`` layers slide (qwen2, olmo3, gemma3, gpt_oss); without, every layer uses
    ``config.sliding_window`` when it is set (mistral, qwen3_moe)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "layer_types", None) is not None:
        return window if layer_type == "sliding_attention" else None
    return window


def _layer_type_attention(attn, x, ctx, layer_type: str, sinks: bool) -> torch.Tensor:
    """Grouped-query attention of one layer type: its window (:func:`layer_window`) and its rotary
    table."""
    window = layer_window(attn.config, layer_type)
    return gqa_attention(attn, x, ctx, window=window, sinks=sinks, rope_key=layer_type)


def gqa_mixers(sinks: bool = False) -> dict:
    """The mixer table of the grouped-query-attention families: full and sliding layers on
    ``self_attn`` (with attention sinks: gpt_oss)."""
    return {
        t: ("self_attn", partial(_layer_type_attention, layer_type=t, sinks=sinks))
        for t in ("full_attention", "sliding_attention")
    }


def router_if_it_chooses(model_type: str, block: str, router: str) -> str | None:
    """``router`` when the installed transformers' router returns (logits, weights, experts), which
    MoE statistics record; None where the MoE ``block`` still chooses the experts itself
    (``route_tokens_to_experts``, glm4_moe and deepseek_v3 before 5.2x): the model then trains, but
    MoE statistics are refused as for a dense family."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return None if hasattr(getattr(module, block), "route_tokens_to_experts") else router


class LayerTypeRotary:
    """Rotary tables for each layer type, for families whose rotary module keeps one per type
    (gemma3's local and global bases; olmo3 in the transformers versions that do the same).

    Called like the rotary module, ``(hidden, positions)``; returns {layer type: (cos, sin)}, which
    :func:`~harts.adapters.mixers.gqa_attention` reads with its ``rope_key``.
    """

    def __init__(self, rotary, layer_types):
        self.rotary, self.layer_types = rotary, sorted(set(layer_types))

    def __call__(self, hidden, positions):
        return {t: self.rotary(hidden, positions, t) for t in self.layer_types}


class GQAFamilyAdapter(FamilyAdapter):
    """Pre-norm decoder layers with grouped-query attention on ``self_attn``, sliding windows along
    paths where the configuration has them. Subclasses set ``model_types``, the MoE router and the
    tiny configuration; ``sinks`` and ``mixers = gqa_mixers(sinks=True)`` for attention sinks
    (gpt_oss)."""

    sliding_windows = True
    sinks = False
    mixers = gqa_mixers()
    layer_fields: tuple[str, ...] = PRE_NORM_FIELDS
    attention_fields: tuple[str, ...] = ATTENTION_FIELDS

    def rotary(self, backbone):
        rotary = getattr(backbone, "rotary_emb", None)
        layer_types = getattr(rotary, "layer_types", None)
        return LayerTypeRotary(rotary, layer_types) if layer_types else rotary

    def check_model(self, model):
        family = model.config.model_type
        backbone = self.backbone(model)
        require(family, backbone, "embed_tokens", "layers", "norm")
        layer = backbone.layers[0]
        require(family, layer, *self.layer_fields)
        require(family, layer.self_attn, *self.attention_fields, *(("sinks",) if self.sinks else ()))
