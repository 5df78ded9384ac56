"""Model-family adapters: how to run one stock Hugging Face decoder layer over a forest.

All supported families share the pre-norm decoder block

    h = h + mixer(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))

The norms, the MLP and the MoE block are token-wise, so the executor calls the model's own
modules on the [1, N, D] unique tokens. Only the token mixer (attention or linear attention)
sees the sequence, and an adapter supplies a tree-aware version of it built from the same
module's parameters and helper functions (no weight copies, no changes to the model).

An adapter is a small object holding one family's knowledge: which modules hold the embedding,
layers, final norm, rotary embedding and head; which mixer function runs each layer; which
config options it refuses; which module is its MoE router and how the family balances experts;
and a tiny configuration for tests and demos. Mixers reach the sequence only through a
:class:`TreeOps` context, which the runtime implements (:mod:`harts.runtime.handoff`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import StrEnum
from typing import Protocol

import torch
from torch import nn

__all__ = [
    "TreeOps",
    "MoEBalancing",
    "FamilyAdapter",
    "register",
    "adapter_for",
    "supported_families",
    "adapter_for_type",
    "hf_function",
]


class TreeOps(Protocol):
    """The three sequence operations a tree mixer calls, and the rotary tables it reads.

    - ``position_embeddings``: the rotary (cos, sin) at each token's path position, or None;
    - ``attend(query [1, H, n, d], key, value, scaling)`` -> [1, n, H, dv]: each token attends
      to its path;
    - ``conv(mixed [n, C], weight [C, K], bias)`` -> [n, C]: depthwise causal conv along paths;
    - ``delta_rule(q, k, v, g, beta)`` -> [n, H, V]: gated delta rule with parent-to-child
      state hand-off.
    """

    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None

    def attend(self, query, key, value, scaling: float) -> torch.Tensor: ...

    def conv(self, mixed: torch.Tensor, weight, bias) -> torch.Tensor: ...

    def delta_rule(self, q, k, v, g, beta) -> torch.Tensor: ...


Mixer = Callable[[nn.Module, torch.Tensor, TreeOps], torch.Tensor]


class MoEBalancing(StrEnum):
    """How a family keeps its experts balanced in training."""

    AUX_LOSS = "aux_loss"  # softmax routing trained with the Switch load-balancing loss
    BIAS = "bias"  # sigmoid routing with a score-correction bias, no aux loss (DeepSeek-V3)


class FamilyAdapter:
    """Base adapter for ``*ForCausalLM`` models whose backbone is ``model.model``.

    ``router_class``: class name of the family's MoE router (None: no MoE); every router returns
    ``(router_logits [N, E], weights [N, k], indices [N, k])``. ``moe_balancing``: how the family
    balances its experts (None: no MoE).
    """

    model_types: tuple[str, ...] = ()
    router_class: str | None = None
    moe_balancing: MoEBalancing | None = None

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

    def tiny_config(self, model_type: str, **overrides):
        """A toy configuration of ``model_type`` (tests, demos, benchmarks); keywords override fields."""
        raise NotImplementedError


# Fields every tiny configuration shares: a 128-token vocabulary and 64-wide hidden states.
TINY_COMMON = dict(
    vocab_size=128, hidden_size=64, rms_norm_eps=1e-6, initializer_range=0.08,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip


def unknown_layer(family: str, layer_type: str) -> ValueError:
    return ValueError(
        f"{family}: layer type {layer_type!r} is not supported (expected full_attention or linear_attention)"
    )


_REGISTRY: dict[str, FamilyAdapter] = {}


def register(adapter: FamilyAdapter) -> FamilyAdapter:
    for name in adapter.model_types:
        _REGISTRY[name] = adapter
    return adapter


def supported_families() -> list[str]:
    return sorted(_REGISTRY)


def adapter_for_type(model_type: str) -> FamilyAdapter:
    """The adapter registered for ``model_type``; ValueError naming the supported families."""
    if model_type not in _REGISTRY:
        raise ValueError(f"unknown family {model_type!r}; harts supports: {', '.join(supported_families())}")
    return _REGISTRY[model_type]


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
