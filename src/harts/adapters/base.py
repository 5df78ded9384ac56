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
from dataclasses import dataclass, field

import torch
from torch import nn

from harts.ops.backends import current_backend
from harts.ops.short_conv import tree_short_conv
from harts.ops.tree_delta_rule import tree_gated_delta_rule
from harts.plan.layout import TreeLayout

__all__ = [
    "LayerHandoff",
    "MixerContext",
    "FamilyAdapter",
    "register",
    "adapter_for",
    "supported_families",
    "hf_function",
]


@dataclass
class LayerHandoff:
    """What one layer hands from a micro-batch to the later ones that continue its paths.

    - ``key`` / ``value`` [Hkv, X, d]: attention keys (after RoPE and norms) and values of tokens;
    - ``conv_input`` [X, C]: short-convolution inputs of tokens;
    - ``states``: {global node: final linear-attention state [H, K, V]}.
    """

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    conv_input: torch.Tensor | None = None
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        out = [t for t in (self.key, self.value, self.conv_input) if t is not None]
        return out + [self.states[n] for n in sorted(self.states)]


class MixerContext:
    """What a token mixer needs beyond its input, and the three sequence ops it calls.

    ``layout`` describes the micro-batch; ``position_embeddings`` are the rotary cos/sin
    [1, n, d] at path positions; ``layer`` is set by the executor before each layer.
    ``external[layer]`` holds the context handed over by earlier micro-batches (key space rows
    0..E-1 for keys/values and conv inputs; states of cut roots' parents); ``exports[layer]``
    collects what this micro-batch hands on. Mixers never see either: they call
    :meth:`attend`, :meth:`conv` and :meth:`delta_rule`. ``recompute_linear``: linear-attention
    calls keep only their inputs for backward and run again there (:func:`tree_gated_delta_rule`).
    """

    def __init__(
        self,
        layout: TreeLayout,
        position_embeddings,
        external: list[LayerHandoff] | None = None,
        recompute_linear: bool = False,
    ):
        self.layout = layout
        self.recompute_linear = recompute_linear
        self.position_embeddings = position_embeddings
        self.external = external
        self.exports: list[LayerHandoff] = []
        self.layer = -1

    def begin_layer(self, index: int) -> None:
        self.layer = index
        self.exports.append(LayerHandoff())

    def _ext(self) -> LayerHandoff | None:
        return self.external[self.layer] if self.external is not None else None

    def attend(self, query, key, value, scaling: float) -> torch.Tensor:
        """Tree attention of [1, H, n, d] query/key/value over the key space; returns [1, n, H, dv]."""
        key, value = key[0], value[0]
        rows = self.layout.export_token_rows
        if rows.numel():
            self.exports[-1].key, self.exports[-1].value = key[:, rows], value[:, rows]
        ext = self._ext()
        if ext is not None and ext.key is not None:
            key, value = torch.cat([ext.key, key], dim=1), torch.cat([ext.value, value], dim=1)
        return current_backend().attention(query[0], key, value, self.layout.attention_plan, scaling)[None]

    def conv(self, mixed: torch.Tensor, weight, bias) -> torch.Tensor:
        """Depthwise causal conv of ``mixed`` [n, C] along paths (pre-activation); returns [n, C]."""
        rows = self.layout.export_token_rows
        if rows.numel():
            self.exports[-1].conv_input = mixed[rows]
        ext = self._ext()
        if ext is not None and ext.conv_input is not None:
            mixed = torch.cat([ext.conv_input.to(mixed.dtype), mixed], dim=0)
        return tree_short_conv(mixed, weight, self.layout.predecessors(weight.shape[-1]), bias)

    def delta_rule(self, q, k, v, g, beta) -> torch.Tensor:
        """Gated delta rule over the layout's linear plan with state handoff; returns [n, H, V]."""
        ext = self._ext()
        root_states = None
        if ext is not None and self.layout.root_state_source:
            root_states = {local: ext.states[glob] for local, glob in self.layout.root_state_source.items()}
        out, states = tree_gated_delta_rule(
            q, k, v, g, beta, self.layout.linear_plan, root_states=root_states,
            recompute=self.recompute_linear,
        )  # fmt: skip
        for local, glob in self.layout.export_nodes:
            # clone: a state is often a view of a whole call's stacked states, which would stay alive
            self.exports[-1].states[glob] = states[local].clone()
        return out


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
