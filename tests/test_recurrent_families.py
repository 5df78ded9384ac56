"""What the recurrent families refuse, and their load-time checks (their exactness is in
test_equivalence / test_split, parametrised over every family).

- qwen3_5: the text causal LM runs under its config type (``qwen3_5_text``), which is
  not a family name of its own; the multimodal wrapper's config is refused.
- minimax: ``sliding_window`` and ``router_jitter_noise`` are refused before any compute.
- every family: a model lacking a module its mixer reads (a renamed attribute) fails naming the
  family and the missing piece.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.adapters import adapter_for, adapter_for_type
from harts.testing import tiny_model

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
    ],
)
def test_missing_module_names_family_and_piece(family, path, name):
    model = tiny_model(family)
    delattr(model.get_submodule(path), name)
    with pytest.raises(ValueError, match=f"{family}: .* has no {name}"):
        harts.forward(model, harts.build_forest(FOREST))


def test_lfm2_conv_window_crosses_short_nodes():
    """A 3-wide conv over one-token nodes: each window gathers two ancestors (exact per trajectory)."""
    model = tiny_model("lfm2")
    trajectories = [[5, 6, 7, 8], [5, 6, 9], [5, 10, 11], [5]]
    with torch.no_grad():
        out = harts.forward(model, harts.build_forest(trajectories))
        for i, t in enumerate(trajectories):
            ref = model(input_ids=torch.tensor([t])).logits[0]
            assert (out.trajectory_logits(i) - ref).abs().max() <= 1e-4
