"""Model-family adapters: how to run one stock Hugging Face decoder layer over a forest.

All supported families share the pre-norm decoder block

    h = h + mixer(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))

The norms, the MLP and the MoE block are token-wise, so the executor calls the model's own
modules on the [1, N, D] unique tokens. Only the token mixer (attention or linear attention)
sees the sequence, and an adapter supplies a tree-aware version of it built from the same
module's parameters and helper functions (no weight copies, no changes to the model).

An adapter is a small object: which modules hold the embedding, layers, final norm, rotary
embedding and head, and which mixer function runs each layer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from harts.plan.layout import TreeLayout

__all__ = ["MixerContext", "FamilyAdapter", "register", "adapter_for", "supported_families", "hf_function"]


@dataclass
class MixerContext:
    """What a token mixer needs beyond its input: the layout and the rotary cos/sin [1, N, d]."""

    layout: TreeLayout
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None


Mixer = Callable[[nn.Module, torch.Tensor, MixerContext], torch.Tensor]


class FamilyAdapter:
    """Base adapter for ``*ForCausalLM`` models whose backbone is ``model.model``."""

    model_types: tuple[str, ...] = ()

    def check_config(self, config) -> None:
        """Raise ValueError for configurations the adapter cannot run exactly."""

    def backbone(self, model: nn.Module) -> nn.Module:
        return model.model

    def rotary(self, backbone: nn.Module) -> nn.Module | None:
        return getattr(backbone, "rotary_emb", None)

    def layer_type(self, model: nn.Module, index: int) -> str:
        types = getattr(model.config, "layer_types", None)
        return types[index] if types is not None else "full_attention"

    def mixer(self, layer: nn.Module, layer_type: str) -> tuple[nn.Module, Mixer]:
        """Return (module, mixer function) for one decoder layer."""
        raise NotImplementedError


_REGISTRY: dict[str, FamilyAdapter] = {}


def register(adapter: FamilyAdapter) -> FamilyAdapter:
    for name in adapter.model_types:
        _REGISTRY[name] = adapter
    return adapter


def supported_families() -> list[str]:
    return sorted(_REGISTRY)


def adapter_for(model: nn.Module) -> FamilyAdapter:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _REGISTRY:
        raise ValueError(
            f"unsupported model family {model_type!r} ({type(model).__name__}); "
            f"harts supports: {', '.join(supported_families())}"
        )
    if not hasattr(model, "lm_head") or not hasattr(model, "model"):
        raise ValueError(
            "expected a causal LM with .model and .lm_head (e.g. AutoModelForCausalLM), "
            f"got {type(model).__name__}"
        )
    adapter = _REGISTRY[model_type]
    adapter.check_config(config)
    return adapter


def hf_function(module: nn.Module, name: str):
    """A helper function (e.g. ``apply_rotary_pos_emb``) from the module's own modeling file.

    Using the family's own helper keeps conventions such as interleaved or partial rotary
    dimensions exactly as the stock model applies them.
    """
    return getattr(sys.modules[type(module).__module__], name)
