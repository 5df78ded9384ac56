"""``mamba`` (pure Mamba-1, e.g. state-spaces/mamba): every layer is ``residual + mixer(norm(residual))``
with a Mamba (selective scan) mixer; no attention, no MLP.

The mixer is the one harts runs inside ``jamba`` (:func:`~harts.adapters.jamba.jamba_mamba`),
without Jamba's norms on dt, B and C: ``in_proj`` -> (x, gate); the depthwise causal conv and
``hidden_act`` along paths; ``x_proj`` -> (dt, B, C); ``dt_proj`` and softplus; the selective scan
in fp32; the skip term ``D * x``, the gate ``silu(gate)`` and ``out_proj``. The backbone, its
``residual_in_fp32`` residual stream and the head's input are as in ``mamba2``
(:mod:`harts.adapters.mamba2`).

Refused: ``hidden_act`` other than silu. The stock PyTorch path applies ``hidden_act`` after the
conv, while the stock fused kernel (``mamba_inner_fn``, the training path where the kernels are
installed) applies silu whatever ``hidden_act`` says, so the model has no single reference.
``use_mambapy`` and ``use_associative_scan`` choose how the stock code computes the same scan and
do not matter here.
"""

from __future__ import annotations

from functools import partial

import torch

from harts.adapters.base import TINY_COMMON, register
from harts.adapters.jamba import jamba_mamba
from harts.adapters.mamba2 import Mamba2Adapter

__all__ = ["MambaAdapter"]

MAMBA_MIXER = (
    "in_proj",
    "conv1d",
    "act",
    "x_proj",
    "dt_proj",
    "A_log",
    "D",
    "out_proj",
    "time_step_rank",
    "ssm_state_size",
    "intermediate_size",
)


class MambaAdapter(Mamba2Adapter):
    model_types = ("mamba",)
    mixers = {"linear_attention": ("mixer", partial(jamba_mamba, norms=None))}
    mixer_attributes = MAMBA_MIXER
    inexact_cache = (
        "transformers' Mamba cache, gathered at a branch point and extended, gives log-probs off a full "
        "forward of the same tokens (measured on 5.24: 6.8e-3 for mamba, 0.21 for falcon_mamba)"
    )

    def check_config(self, config):
        if config.hidden_act != "silu":
            raise ValueError(
                f"{config.model_type}: hidden_act={config.hidden_act!r} is not supported: the stock Mamba "
                f"mixer applies hidden_act after the conv in its PyTorch path and silu in its fused kernel "
                f"(mamba_inner_fn), so the model has no single reference; use silu"
            )

    def tiny_config(self, model_type, **overrides):
        from transformers import MambaConfig

        return MambaConfig(**{**self._tiny_fields(), **overrides})

    def _tiny_fields(self) -> dict:
        fields = dict(
            TINY_COMMON,
            num_hidden_layers=3,
            state_size=8,
            expand=2,
            conv_kernel=4,
            time_step_rank="auto",
            use_conv_bias=True,
            use_bias=True,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=False,
        )
        fields.pop("rms_norm_eps")
        return fields

    def randomize_tiny(self, model):
        # D starts at one: random, so that a missed skip term shows
        with torch.no_grad():
            for layer in self.backbone(model).layers:
                layer.mixer.D.uniform_(0.5, 1.5)


register(MambaAdapter())
