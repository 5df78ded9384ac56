"""Model-family adapters. Importing this package registers every supported family."""

from harts.adapters import bailing_hybrid, kimi_linear, llama, qwen3_next  # noqa: F401  (registration)
from harts.adapters.base import FamilyUnavailable, adapter_for, adapter_for_type, supported_families

__all__ = ["adapter_for", "adapter_for_type", "supported_families", "FamilyUnavailable"]
