"""Model-family adapters. Importing this package registers every supported family.

The import order below is the families' order (``harts.tiny.ALL_FAMILIES``: the order tests run
them in, and the family tests pick first or last): a new family's module goes last.
"""

# isort: off
from harts.adapters import bailing_hybrid, kimi_linear, qwen3_next, llama, qwen3_5, lfm2  # noqa: F401
from harts.adapters import minimax, nemotron_h, qwen2, moe_gqa, olmo3, gemma3, gpt_oss  # noqa: F401
from harts.adapters import deepseek_v3, jamba, granitemoehybrid, falcon_h1  # noqa: F401
from harts.adapters import glm5_next, qwen4_exp, mamba2, bamba, mamba, falcon_mamba, lfm2_moe  # noqa: F401
from harts.adapters import olmo_hybrid, lfm3, lara_mini  # noqa: F401

# isort: on
from harts.adapters.base import FamilyUnavailable, adapter_for, adapter_for_type, supported_families

__all__ = ["adapter_for", "adapter_for_type", "supported_families", "FamilyUnavailable"]
