"""``falcon_mamba`` (TII Falcon Mamba): the pure Mamba-1 model of :mod:`harts.adapters.mamba` with
RMSNorms without weight on dt, B and C inside the mixer (after ``x_proj``, before ``dt_proj`` and
the scan), where Jamba's mixer has its weighted ones: :func:`~harts.adapters.jamba.jamba_mamba`
with the stock norms, the mixer's modules (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``) or,
in transformers versions without them, the modeling file's ``rms_forward`` with ``mixer_rms_eps``.

The stock mixer computes ``dt_proj`` as ``dt_proj.weight @ dt`` with the bias added in the scan
(``dt_proj(dt) - bias`` for quantized models): the same sum as the ``dt_proj`` call harts makes, up
to rounding. Refused, as for ``mamba``: ``hidden_act`` other than silu (older versions also gate
the scan output with ``hidden_act``, newer ones with silu).
"""

from __future__ import annotations

import sys
from functools import partial

from harts.adapters.base import hf_function, register, require
from harts.adapters.jamba import jamba_mamba, module_norms
from harts.adapters.mamba import MambaAdapter

__all__ = ["FalconMambaAdapter", "falcon_mamba_norms"]

_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def falcon_mamba_norms(mixer, time_step, b, c):
    """The stock mixer's norms on dt, B and C: its modules, or the modeling file's ``rms_forward``."""
    if hasattr(mixer, "dt_layernorm"):
        return module_norms(mixer, time_step, b, c)
    norm = partial(hf_function(mixer, "rms_forward"), variance_epsilon=mixer.rms_eps)
    return norm(time_step), norm(b), norm(c)


class FalconMambaAdapter(MambaAdapter):
    model_types = ("falcon_mamba",)
    mixers = {"linear_attention": ("mixer", partial(jamba_mamba, norms=falcon_mamba_norms))}

    def check_model(self, model):
        super().check_model(model)
        for layer in self.backbone(model).layers[: model.config.num_hidden_layers]:
            if not all(hasattr(layer.mixer, name) for name in _NORMS):  # older versions: a norm function
                require("falcon_mamba", layer.mixer, "rms_eps")
                require("falcon_mamba", sys.modules[type(layer.mixer).__module__], "rms_forward")

    def tiny_config(self, model_type, **overrides):
        from transformers import FalconMambaConfig

        return FalconMambaConfig(**{**self._tiny_fields(), "mixer_rms_eps": 1e-6, **overrides})


register(FalconMambaAdapter())
