"""``granitemoehybrid`` (IBM Granite 4.0 hybrids): Mamba-2 layers and grouped-query attention
layers (with RoPE, or without position embedding when ``position_embedding_type`` is not
``"rope"``), each followed by a softmax-routed MoE block (trained with the Switch load-balancing
loss) plus a shared MLP, or by the shared MLP alone when ``num_local_experts`` is 0.

Granite's multipliers, as the stock forward applies them:

- ``embedding_multiplier``: the token embeddings are scaled before the first layer;
- ``residual_multiplier``: each block's output is scaled before it joins the residual stream;
- ``attention_multiplier``: the attention's softmax scale (the module's ``scaling``);
- ``logits_scaling``: the stock forward divides the logits by it after ``lm_head``. harts reads
  the head from the final hidden states (per trajectory, or chunked log-probs that use the head's
  weight directly), so the division is applied to the final norm's output instead: for a head
  without bias, ``lm_head(h / s) = lm_head(h) / s`` (equal up to rounding). The final hidden
  states harts returns are therefore the stock ones divided by ``logits_scaling``.

The Mamba-2 layers run :func:`~harts.adapters.mixers.mamba2_mixer` (the gated RMSNorm is the
module's own, over ``n_groups`` groups where the installed version normalises per group).

MoE statistics need a router module that returns its choice (``GraniteMoeHybridTopKRouter``); in
transformers versions whose top-k gating still sorts the tokens itself, the model trains but MoE
statistics are refused as for a dense family.
"""

from __future__ import annotations

import importlib

import torch

from harts.adapters.base import TINY_COMMON, FamilyAdapter, MoEBalancing, Scaled, register, require
from harts.adapters.mixers import MAMBA2_MIXER_ATTRIBUTES, gqa_attention, mamba2_mixer

__all__ = ["GraniteMoeHybridAdapter", "granite_attention"]

_LAYER = (
    "input_layernorm",
    "post_attention_layernorm",
    "shared_mlp",
    "block_sparse_moe",
    "residual_multiplier",
)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "config")


def granite_attention(attn, x, ctx) -> torch.Tensor:
    """Grouped-query attention with RoPE, or without position embedding when the config's
    ``position_embedding_type`` is not ``"rope"``."""
    return gqa_attention(attn, x, ctx, rope=attn.config.position_embedding_type == "rope")


class GraniteMoeHybridAdapter(FamilyAdapter):
    model_types = ("granitemoehybrid",)
    moe_balancing = MoEBalancing.AUX_LOSS
    mixers = {"linear_attention": ("mamba", mamba2_mixer), "full_attention": ("self_attn", granite_attention)}
    exact_cache_from = "5.24.0"  # 5.10.4: 0.015 off after a branch point

    @property
    def router_class(self):
        module = importlib.import_module("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
        return "GraniteMoeHybridTopKRouter" if hasattr(module, "GraniteMoeHybridTopKRouter") else None

    def check_model(self, model):
        backbone = self.backbone(model)
        require("granitemoehybrid", backbone, "embed_tokens", "layers", "norm", "embedding_multiplier")
        require("granitemoehybrid", model.config, "layers_block_type", "logits_scaling")
        if model.config.logits_scaling != 1 and getattr(model.lm_head, "bias", None) is not None:
            raise ValueError(
                f"granitemoehybrid: logits_scaling={model.config.logits_scaling} with a biased lm_head: "
                f"harts folds the scaling into the head's input, which is exact only for a head without bias"
            )
        for i, layer in enumerate(backbone.layers[: model.config.num_hidden_layers]):
            require("granitemoehybrid", layer, *_LAYER)
            if self.layer_type(model, i) == "linear_attention":
                require("granitemoehybrid", layer, "mamba")
                require("granitemoehybrid", layer.mamba, *MAMBA2_MIXER_ATTRIBUTES)
            else:
                require("granitemoehybrid", layer, "self_attn")
                require("granitemoehybrid", layer.self_attn, *_ATTENTION)

    def embedding(self, backbone):
        return Scaled(backbone.embed_tokens, backbone.embedding_multiplier)

    folds_logit_scale = True  # final_norm scales by the head multiplier (module docstring)

    def final_norm(self, backbone):
        return Scaled(backbone.norm, 1.0 / backbone.config.logits_scaling)

    def layer_type(self, model, index):
        # Mamba layers are "mamba" or "linear_attention" depending on the transformers version
        kind = model.config.layers_block_type[index]
        return "linear_attention" if kind in ("mamba", "linear_attention") else "full_attention"

    def decoder_block(self, layer, hidden, mix, mlp):
        hidden = hidden + mix(layer.input_layernorm(hidden)) * layer.residual_multiplier
        x = layer.post_attention_layernorm(hidden)
        if layer.block_sparse_moe is not None:
            out = layer.block_sparse_moe(x) + layer.shared_mlp(x)
        else:
            out = layer.shared_mlp(x)
        return hidden + out * layer.residual_multiplier

    def tiny_config(self, model_type, **overrides):
        from transformers import GraniteMoeHybridConfig

        # mamba, attention, mamba; every layer with MoE and the shared MLP; non-trivial multipliers
        types = ["mamba", "attention", "mamba"]
        fields = dict(
            TINY_COMMON,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=32,
            shared_intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_head="auto",
            mamba_d_conv=4,
            mamba_chunk_size=8,
            mamba_conv_bias=True,
            position_embedding_type="rope",
            embedding_multiplier=1.5,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.0,
            layer_types=_layer_names(types),
        )
        return GraniteMoeHybridConfig(**{**fields, **overrides})


def _layer_names(kinds: list[str]) -> list[str]:
    """``config.layer_types`` in the installed version's names ("mamba"/"attention" in older ones,
    "linear_attention"/"full_attention" in newer ones)."""
    from transformers import GraniteMoeHybridConfig

    default = GraniteMoeHybridConfig(num_hidden_layers=1, mamba_n_heads=8, hidden_size=64).layer_types[0]
    if default == "mamba":
        return kinds
    return ["linear_attention" if k == "mamba" else "full_attention" for k in kinds]


register(GraniteMoeHybridAdapter())
