"""What the recurrent families refuse, and their load-time checks (their exactness is in
test_equivalence / test_split, parametrised over every family).

- qwen3_5: the text causal LM runs under its config type (``qwen3_5_text``), which is
  not a family name of its own; the multimodal wrapper's config is refused.
- minimax: ``sliding_window`` and ``router_jitter_noise`` are refused before any compute.
- granitemoehybrid without RoPE, falcon_h1 without the Mamba norm or with norm-before-gate: exact and
  live; a logits factor (granite's ``logits_scaling``, falcon_h1's ``lm_head_multiplier``) with a
  biased head and a hook on falcon_h1's attention (beside its Mamba mixer) are refused.
- every family: a model lacking a module its mixer reads (a renamed attribute) fails naming the
  family and the missing piece.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.adapters import adapter_for, adapter_for_type
from harts.tiny import tiny_model

FOREST = [[5, 6, 7, 8], [5, 6, 9]]


def test_qwen3_5_text_model_runs_under_its_family():
    model = tiny_model("qwen3_5")
    assert model.config.model_type == "qwen3_5_text"
    assert adapter_for(model) is adapter_for_type("qwen3_5")
    assert "qwen3_5_text" not in harts.supported_families()


def test_qwen3_5_multimodal_config_is_refused():
    from transformers.models.qwen3_5 import Qwen3_5Config

    adapter = adapter_for_type("qwen3_5")
    text = adapter.tiny_config("qwen3_5").to_dict()
    with pytest.raises(ValueError, match="qwen3_5: the multimodal"):
        adapter.check_config(Qwen3_5Config(text_config=text))


@pytest.mark.parametrize(
    "override, message",
    [({"sliding_window": 8}, "sliding_window=8"), ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1")],
    ids=["sliding_window", "router_jitter_noise"],
)
def test_minimax_refuses(override, message):
    model = tiny_model("minimax", **override)
    with pytest.raises(ValueError, match=f"minimax: {message}"):
        harts.forward(model, harts.build_forest(FOREST))


@pytest.mark.parametrize(
    "family, path, name",
    [
        ("qwen3_5", "model.layers.0.linear_attn", "in_proj_z"),
        ("lfm2", "model.layers.0.conv", "in_proj"),
        ("lfm2", "model", "embedding_norm"),
        ("minimax", "model.layers.0.self_attn", "output_gate"),
        ("nemotron_h", "model.layers.0.mixer", "dt_bias"),
        ("nemotron_h", "model", "norm_f"),
        ("jamba", "model.layers.0.mamba", "b_layernorm"),
        ("jamba", "model", "final_layernorm"),
        ("granitemoehybrid", "model.layers.0.mamba", "dt_bias"),
        ("granitemoehybrid", "model", "embedding_multiplier"),
        ("falcon_h1", "model.layers.0.mamba", "mup_vector"),
        ("falcon_h1", "model.layers.0.self_attn", "key_multiplier"),
        ("mamba2", "backbone.layers.0.mixer", "dt_bias"),
        ("mamba2", "backbone", "norm_f"),
        ("bamba", "model.layers.0.mamba", "dt_bias"),
        ("bamba", "model.layers.1.self_attn", "o_proj"),
        ("bamba", "model", "final_layernorm"),
        ("mamba", "backbone.layers.0.mixer", "x_proj"),
        ("falcon_mamba", "backbone.layers.0.mixer", "dt_proj"),
        ("lfm2_moe", "model.layers.0.conv", "in_proj"),
        ("lfm2_moe", "model", "pos_emb"),
        ("olmo_hybrid", "model.layers.0.linear_attn", "g_proj"),
        ("olmo_hybrid", "model.layers.1.self_attn", "k_norm"),
        ("olmo_hybrid", "model.layers.1", "post_feedforward_layernorm"),
        ("lfm3", "model.layers.1.self_attn", "g_proj"),
        ("lfm3", "model.layers.0", "post_operator_norm"),
        ("lfm3", "model.layers.2.conv", "in_proj"),
        ("lara_mini", "model.layers.0.linear_attn", "in_proj_z"),
        ("lara_mini", "model.layers.3.self_attn", "k_norm"),
    ],
)
def test_missing_module_names_family_and_piece(family, path, name):
    model = tiny_model(family)
    delattr(model.get_submodule(path), name)
    with pytest.raises(ValueError, match=f"{family}: .* has no {name}"):
        harts.forward(model, harts.build_forest(FOREST))


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
def test_mamba_refuses_an_activation_other_than_silu(family):
    """The stock PyTorch path applies hidden_act after the conv, the fused kernel silu: no reference."""
    model = tiny_model(family, hidden_act="gelu")
    with pytest.raises(ValueError, match=f"{family}: hidden_act='gelu' is not supported"):
        harts.forward(model, harts.build_forest(FOREST))


def test_falcon_mamba_norms_are_live():
    """The norms on dt, B and C change the logits (a mixer without them would be seen)."""
    model = tiny_model("falcon_mamba")
    plain = tiny_model("mamba")
    plain.load_state_dict(model.state_dict())
    _exact_and_live(model, plain)


def test_nemotron_h_refuses_sliding_window():
    model = tiny_model("nemotron_h", sliding_window=8)
    with pytest.raises(ValueError, match="nemotron_h: sliding_window=8"):
        harts.forward(model, harts.build_forest(FOREST))


def test_nemotron_h_time_step_floor_is_live():
    """A floor above most softplus(dt) values clamps them, as the stock scan does (exact per trajectory),
    and changes the logits (so the equivalence tests would see a missing clamp)."""
    # the floor: time_step_min on the versions whose mixer clamps with it, time_step_limit on the newer
    floored = tiny_model("nemotron_h", time_step_min=0.8, time_step_limit=(0.8, float("inf")))
    plain = tiny_model("nemotron_h")
    plain.load_state_dict(floored.state_dict())
    trajectories = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 20, 21]]
    with torch.no_grad():
        out = harts.forward(floored, harts.build_forest(trajectories))
        for i, t in enumerate(trajectories):
            ids = torch.tensor([t])
            ref = floored(input_ids=ids).logits[0]
            assert (out.trajectory_logits(i) - ref).abs().max() <= 1e-4
            assert (plain(input_ids=ids).logits[0] - ref).abs().max() > 1e-3


def _exact_and_live(variant, base, trajectories=((5, 6, 7, 8, 9, 10, 11, 12, 13, 14), (5, 6, 7, 20, 21))):
    """``variant`` runs exactly per trajectory, and differs from ``base`` (the same weights without
    the option; a module only one of them has keeps its initial weights), so the option is really
    exercised."""
    base.load_state_dict(variant.state_dict(), strict=False)
    with torch.no_grad():
        out = harts.forward(variant, harts.build_forest([list(t) for t in trajectories]))
        for i, t in enumerate(trajectories):
            ids = torch.tensor([t])
            ref = variant(input_ids=ids).logits[0]
            assert (out.trajectory_logits(i) - ref).abs().max() <= 1e-4
            assert (base(input_ids=ids).logits[0] - ref).abs().max() > 1e-3


def test_granitemoehybrid_without_position_embedding():
    """``position_embedding_type`` other than rope: attention layers without RoPE, as the stock model."""
    nope = tiny_model("granitemoehybrid", position_embedding_type=None)
    _exact_and_live(nope, tiny_model("granitemoehybrid"))


def test_olmo_hybrid_without_position_embedding():
    """No ``rope_theta`` (the released checkpoints): no rotary module, attention without RoPE (NoPE)."""
    nope = tiny_model("olmo_hybrid", rope_parameters={"rope_type": "default", "rope_theta": None})
    assert nope.model.rotary_emb is None
    _exact_and_live(nope, tiny_model("olmo_hybrid"))


def test_olmo_hybrid_beta_in_zero_to_one():
    """``linear_allow_neg_eigval=False``: beta = sigmoid(b), not doubled."""
    _exact_and_live(tiny_model("olmo_hybrid", linear_allow_neg_eigval=False), tiny_model("olmo_hybrid"))


def test_olmo_hybrid_refuses_value_heads_not_a_multiple_of_key_heads():
    config = adapter_for_type("olmo_hybrid").tiny_config("olmo_hybrid", linear_num_value_heads=3)
    with pytest.raises(ValueError, match="olmo_hybrid: linear_num_value_heads=3 is not a multiple"):
        adapter_for_type("olmo_hybrid").check_config(config)


@pytest.mark.parametrize("option", ["use_sandwich_norm", "use_attention_gate"])
def test_lfm3_without_sandwich_norms_or_attention_gate(option):
    """Without the sandwich norms (stock identities) or the per-head attention gate: exact and live."""
    _exact_and_live(tiny_model("lfm3", **{option: False}), tiny_model("lfm3"))


def test_falcon_h1_without_mamba_rms_norm():
    """``mamba_rms_norm=False``: the scan output gated by silu(z) without a norm, as the stock mixer."""
    _exact_and_live(tiny_model("falcon_h1", mamba_rms_norm=False), tiny_model("falcon_h1"))


def test_falcon_h1_norm_before_gate():
    """``mamba_norm_before_gate=True``: the module's gated RMSNorm gates after normalising."""
    _exact_and_live(tiny_model("falcon_h1", mamba_norm_before_gate=True), tiny_model("falcon_h1"))


@pytest.mark.parametrize(
    ("family", "option"),
    [("granitemoehybrid", "logits_scaling=2.0"), ("falcon_h1", "lm_head_multiplier=0.5")],
)
def test_head_factor_with_a_biased_head_is_refused(family, option):
    """The logits factor is folded into the head's input, exact only for a head without bias."""
    model = tiny_model(family)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.get_text_config().vocab_size))
    with pytest.raises(ValueError, match=f"{family}: {option} with a biased lm_head"):
        harts.forward(model, harts.build_forest(FOREST))


def test_falcon_h1_refuses_a_hook_on_the_attention():
    """The attention runs beside the Mamba mixer, which stands as the layer's mixer; a hook on the
    attention module's forward would not run, so it is refused like one on any mixer."""
    model = tiny_model("falcon_h1")
    model.model.layers[1].self_attn.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match=r"hook on model.layers.1.self_attn .* would not run"):
        harts.forward(model, harts.build_forest(FOREST))


def test_a_family_whose_stock_code_is_wrong_in_older_transformers_is_refused_there():
    """``min_transformers``: the family is unavailable, and the error says from which version and why."""
    from harts.adapters import FamilyUnavailable
    from harts.adapters.base import FamilyAdapter, register

    class Future(FamilyAdapter):
        model_types = ("llama",)
        min_transformers = {"llama": ("999.0", "its stock scan is wrong before then")}

    model = tiny_model("llama")
    base = harts.adapters.base
    registry, unavailable, adapters = dict(base._REGISTRY), dict(base._UNAVAILABLE), dict(base._ADAPTERS)
    try:
        register(Future())
        assert "llama" not in harts.supported_families()
        for refused in (lambda: adapter_for(model), lambda: adapter_for_type("llama")):
            with pytest.raises(FamilyUnavailable, match=r"llama needs transformers >= 999.0 .*: its stock"):
                refused()
    finally:
        base._REGISTRY.clear(), base._REGISTRY.update(registry)
        base._UNAVAILABLE.clear(), base._UNAVAILABLE.update(unavailable)
        base._ADAPTERS.clear(), base._ADAPTERS.update(adapters)


def test_lfm2_conv_window_crosses_short_nodes():
    """A 3-wide conv over one-token nodes: each window gathers two ancestors (exact per trajectory)."""
    model = tiny_model("lfm2")
    trajectories = [[5, 6, 7, 8], [5, 6, 9], [5, 10, 11], [5]]
    with torch.no_grad():
        out = harts.forward(model, harts.build_forest(trajectories))
        for i, t in enumerate(trajectories):
            ref = model(input_ids=torch.tensor([t])).logits[0]
            assert (out.trajectory_logits(i) - ref).abs().max() <= 1e-4
