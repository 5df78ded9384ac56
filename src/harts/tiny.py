"""Tiny randomly initialised models of every supported family, for tests, demos and benchmarks.

Each family's tiny configuration lives with its adapter (:mod:`harts.adapters`); this module
builds the stock Hugging Face model from it.
"""

from __future__ import annotations

import torch

from harts.adapters import adapter_for_type, supported_families
from harts.adapters.base import all_families, registered_adapter

__all__ = [
    "ALL_FAMILIES",
    "FAMILIES",
    "VISION_LANGUAGE_FAMILIES",
    "tiny_config",
    "tiny_model",
    "tiny_vision_language_model",
]

#: every family harts has an adapter for, in registration order (adapters/__init__.py), including
#: those the installed transformers lacks (tests parametrised over it skip them, saying why)
ALL_FAMILIES = tuple(all_families())
#: the families the installed transformers has, in the order above
FAMILIES = tuple(f for f in ALL_FAMILIES if f in supported_families())
#: the families whose multimodal model harts runs (an adapter with ``vision_language``), in the order above
VISION_LANGUAGE_FAMILIES = tuple(
    f
    for f in ALL_FAMILIES
    if getattr(getattr(registered_adapter(f), "vision_language", None), "runs_images", False)
)


def tiny_config(family: str, **overrides):
    """A toy configuration of ``family``; keyword arguments override any field."""
    return adapter_for_type(family).tiny_config(family, **overrides)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised tiny ``*ForCausalLM`` of ``family`` in eval mode (no dropout)."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    # grouped_mm (the default experts kernel) has no fp64 path; fp64 references use the eager loop.
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = adapter_for_type(family).model_from_config(config, dtype=dtype, **extra)
    # Router score-correction biases start at zero; make them non-trivial so their use is tested.
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(-0.05, 0.05)
    adapter_for_type(family).randomize_tiny(model)
    return model.eval()


def tiny_vision_language_model(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, vision: dict | None = None, **overrides
):
    """A randomly initialised tiny multimodal model of ``family`` (its ``*ForConditionalGeneration``:
    the tiny text model of :func:`tiny_model` with ``overrides``, beside a two-block vision tower
    with ``vision``'s fields) in eval mode."""
    from transformers import AutoModelForImageTextToText

    adapter = adapter_for_type(family)
    config = adapter.vision_language.tiny_config(tiny_config(family, **overrides), **(vision or {}))
    torch.manual_seed(seed)
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    return AutoModelForImageTextToText.from_config(config, dtype=dtype, **extra).eval()
