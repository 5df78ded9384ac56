"""Small, randomly initialised models of every supported family, for tests, the demo and benchmarks.

``tiny_config(family)`` keeps each family's architecture (layer kinds, MLA, KDA/GDN, MoE with
shared experts) at toy widths. Layer patterns mix linear and full layers, and every config has
at least one MoE layer and one dense layer. ``initializer_range`` is raised from the usual 0.02
so that activations and logits are of order one and the equivalence tests are sensitive.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    BailingHybridConfig,
    KimiLinearConfig,
    LlamaConfig,
    Qwen3Config,
    Qwen3NextConfig,
)

__all__ = ["FAMILIES", "tiny_config", "tiny_model"]

FAMILIES = ("bailing_hybrid", "kimi_linear", "qwen3_next", "qwen3", "llama")

_COMMON = dict(
    vocab_size=128, hidden_size=64, rms_norm_eps=1e-6, initializer_range=0.08,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip


def tiny_config(family: str, **overrides):
    """A toy configuration of ``family``; keyword arguments override any field."""
    if family == "bailing_hybrid":
        fields = dict(
            _COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, head_dim=16, kv_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, short_conv_kernel_size=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            num_mtp_layers=0, rope_theta=10000.0,
        )
        cls = BailingHybridConfig
    elif family == "kimi_linear":
        fields = dict(
            _COMMON, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        )
        cls = KimiLinearConfig
    elif family == "qwen3_next":
        fields = dict(
            _COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[0], partial_rotary_factor=0.5, rope_theta=10000.0,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        )
        cls = Qwen3NextConfig
    elif family == "qwen3":
        fields = dict(
            _COMMON, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rope_theta=10000.0,
        )
        cls = Qwen3Config
    elif family == "llama":
        fields = dict(
            _COMMON, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            rope_theta=10000.0,
        )
        cls = LlamaConfig
    else:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    fields.update(overrides)
    return cls(**fields)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised tiny ``*ForCausalLM`` of ``family`` in eval mode (no dropout)."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    # grouped_mm (the default experts kernel) has no fp64 path; fp64 references use the eager loop.
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    if family in ("bailing_hybrid", "kimi_linear"):
        # Router score-correction biases start at zero; make them non-trivial so their use is tested.
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.uniform_(-0.05, 0.05)
    return model.eval()
