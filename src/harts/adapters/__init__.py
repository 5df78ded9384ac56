"""Model-family adapters. Importing this package registers every supported family."""

from harts.adapters import (  # noqa: F401  (registration)
    bailing_hybrid,
    deepseek_v3,
    falcon_h1,
    gemma3,
    gpt_oss,
    granitemoehybrid,
    jamba,
    kimi_linear,
    lfm2,
    llama,
    minimax,
    moe_gqa,
    nemotron_h,
    olmo3,
    qwen2,
    qwen3_5,
    qwen3_next,
)
from harts.adapters.base import FamilyUnavailable, adapter_for, adapter_for_type, supported_families

__all__ = ["adapter_for", "adapter_for_type", "supported_families", "FamilyUnavailable"]
