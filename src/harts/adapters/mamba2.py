"""``mamba2`` (pure Mamba-2, e.g. mamba-codestral): every layer is ``residual + mixer(norm(residual))``
with a Mamba-2 SSD mixer; no attention, no MLP.

The mixer runs :func:`~harts.adapters.mixers.mamba2_mixer` (the module's own gated RMSNorm, over
``n_groups`` groups). The causal LM's backbone is ``model.backbone`` (not ``model.model``); its
embedding is ``embeddings`` and its final norm ``norm_f``.

``residual_in_fp32`` (the default) keeps the residual stream in fp32 whatever the model's dtype, as
the stock block does: the block casts its norm's input to the norm's dtype and adds the mixer's
output to the fp32 residual, and the stock head reads the final norm's output cast to the head's
dtype (the model's: a no-op for fp32 parameters, with or without autocast).
"""

from __future__ import annotations

import torch

from harts.adapters.base import TINY_COMMON, FamilyAdapter, register, require
from harts.adapters.mixers import MAMBA2_MIXER_ATTRIBUTES, mamba2_mixer

__all__ = ["Mamba2Adapter"]

#: what :func:`~harts.adapters.mixers.mamba2_mixer` reads from a stock Mamba-2 mixer


class _HeadInput:
    """The final norm, its output cast to the head's dtype as the stock causal LM does before
    ``lm_head`` (fp32 residuals in a low-precision model)."""

    def __init__(self, norm, dtype: torch.dtype):
        self.norm, self.dtype = norm, dtype

    def __call__(self, hidden):
        return self.norm(hidden).to(self.dtype)


class Mamba2Adapter(FamilyAdapter):
    model_types = ("mamba2",)
    mixers = {"linear_attention": ("mixer", mamba2_mixer)}
    # 5.10.4: the forward returns its cache as ``cache_params``, not the ``past_key_values`` that
    # harts rl's sampler extends; 5.24 and 5.25 measured exact after a branch point
    exact_cache_from = "5.24.0"

    def backbone(self, model):
        # the causal LM's ``backbone``; a value head built on it (harts.ValueHead) holds it as ``model``
        return model.backbone if hasattr(model, "backbone") else model.model

    mixer_attributes = MAMBA2_MIXER_ATTRIBUTES  # what the mixer function reads from each layer's ``mixer``

    def check_model(self, model):
        family = self.model_types[0]
        backbone = self.backbone(model)
        require(family, backbone, "embeddings", "layers", "norm_f")
        for layer in backbone.layers[: model.config.num_hidden_layers]:
            require(family, layer, "norm", "mixer", "residual_in_fp32")
            require(family, layer.mixer, *self.mixer_attributes)

    def embedding(self, backbone):
        return backbone.embeddings

    def final_norm(self, backbone):
        return _HeadInput(backbone.norm_f, backbone.norm_f.weight.dtype)

    def layer_type(self, model, index):
        return "linear_attention"

    def decoder_block(self, layer, hidden, mix, mlp):
        residual = hidden.to(torch.float32) if layer.residual_in_fp32 else hidden
        return residual + mix(layer.norm(hidden.to(dtype=layer.norm.weight.dtype)))

    def tiny_config(self, model_type, **overrides):
        from transformers import Mamba2Config

        fields = dict(
            TINY_COMMON,
            num_hidden_layers=3,
            num_heads=8,
            head_dim=16,
            expand=2,
            state_size=16,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
            use_conv_bias=True,
            use_bias=False,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=False,
        )
        fields.pop("rms_norm_eps")
        return Mamba2Config(**{**fields, **overrides})

    def randomize_tiny(self, model):
        # the gated norms' weights start at one and D at one: random, so that a missed term shows
        with torch.no_grad():
            for layer in self.backbone(model).layers:
                layer.mixer.norm.weight.uniform_(0.5, 1.5)
                layer.mixer.D.uniform_(0.5, 1.5)


register(Mamba2Adapter())
