"""Full-attention and MoE families beyond the parametrised suite: what ``ALL_FAMILIES`` does not show.

- Sliding windows are live: each windowed tiny model differs from the same weights without the
  window on a path longer than it, so the equivalence tests (stock vs tree) check the window.
- MoE: expert counts equal the per-trajectory counts (every family whose adapter declares MoE
  balancing); the load-balancing loss against the stock flat batch is in tests/test_moe_stats.py.
- Refusals before compute: gemma3 attention-logit soft-capping and bidirectional attention; final
  logit soft-capping in a family whose stock head applies none; a module the adapter relies on
  missing from the loaded model (a renamed transformers attribute). gemma3's final logit
  soft-capping, which it runs, is in tests/test_gemma3_softcap.py.

The families themselves (logits, gradients, budgets, cut trees) are in ``harts.tiny.ALL_FAMILIES``,
so the parametrised equivalence and split tests cover them.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.adapters.base import MoEBalancing, adapter_for, registered_adapter, supported_families
from harts.runtime.routers import RouterRecorder
from harts.steps.router_statistics import moe_stats
from harts.tiny import ALL_FAMILIES, tiny_model
from tests.helpers import EDGE_SHAPES, MOE_FORESTS, loop_counts
from tests.reference import cached_model


def _needs(family):
    return pytest.mark.skipif(family not in supported_families(), reason=f"transformers lacks {family}")


WINDOWED = {"qwen2": {"use_sliding_window": False}, "mistral": {"sliding_window": None},
            "olmo3": {"sliding_window": 10**6}, "gemma3_text": {"sliding_window": 10**6},
            "gpt_oss": {"sliding_window": 10**6}}  # fmt: skip


@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_windows_are_live(family):
    """Tree logits equal the windowed stock model's, and differ from the unwindowed one's."""
    if family not in supported_families():
        pytest.skip(f"transformers lacks {family}")
    trajs = EDGE_SHAPES["long-branch-T130"]
    windowed = cached_model(family, seed=7)
    plain = tiny_model(family, seed=7, **WINDOWED[family])
    plain.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        out = harts.forward(windowed, harts.build_forest(trajs))
        for i, t in enumerate(trajs):
            ids = torch.tensor([t])
            tree = out.trajectory_logits(i)
            assert (tree - windowed(input_ids=ids).logits[0]).abs().max() <= 1e-4
            assert (tree - plain(input_ids=ids).logits[0]).abs().max() > 1e-2


MOE = [f for f in ALL_FAMILIES if registered_adapter(f).moe_balancing is not None]


@pytest.mark.parametrize("family", MOE)
def test_expert_counts_equal_each_trajectory_alone(family):
    if family not in supported_families():
        pytest.skip(f"transformers lacks {family}")
    model, trajs = cached_model(family, seed=7), MOE_FORESTS["nested-branches-2roots"]
    forest = harts.build_forest(trajs)
    if adapter_for(model).router_class is None:  # glm4_moe, deepseek_v3 before routers chose experts
        with pytest.raises(ValueError, match="MoE statistics need an MoE family"):
            RouterRecorder(model)
        return
    with torch.no_grad():
        with RouterRecorder(model) as rec:
            harts.forward(model, forest)
        tree = moe_stats(rec, forest)
        alone = [[0] * rec.num_experts for _ in rec.layers]
        for t in trajs:
            with RouterRecorder(model) as one:
                model(input_ids=torch.tensor([t]))
            for layer, row in enumerate(loop_counts(one.indices, [True] * len(t), one.num_experts)):
                alone[layer] = [a + b for a, b in zip(alone[layer], row, strict=True)]
    assert tree.expert_counts.tolist() == alone
    aux = registered_adapter(family).moe_balancing is MoEBalancing.AUX_LOSS
    assert (tree.aux_loss is not None) == aux


TRAJS = [[3, 4, 5, 6], [3, 4, 7]]


def _refused(model, match):
    with pytest.raises(ValueError, match=match):
        harts.forward(model, harts.build_forest(TRAJS))


@_needs("gemma3_text")
def test_gemma3_options_without_a_tree_form_are_refused():
    _refused(tiny_model("gemma3_text", attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0")
    _refused(tiny_model("gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention")


def test_final_logit_softcapping_is_refused_where_the_stock_head_has_none():
    """A config field the family's stock forward ignores would still say the logits are capped."""
    _refused(tiny_model("llama", final_logit_softcapping=30.0), "llama: final_logit_softcapping=30.0")


@pytest.mark.parametrize(("family", "piece"), [("olmo3", "q_norm"), ("gpt_oss", "sinks"),
                                               ("gemma3_text", "pre_feedforward_layernorm")])
def test_missing_module_names_the_family(family, piece):
    """A transformers version that renamed what an adapter reads fails loudly, naming both."""
    if family not in supported_families():
        pytest.skip(f"transformers lacks {family}")
    model = tiny_model(family)
    layer = model.model.layers[0]
    owner = layer if hasattr(layer, piece) else layer.self_attn
    delattr(owner, piece)
    _refused(model, f"{family}: .* has no {piece}")


def test_families_without_windows_still_refuse_them():
    _refused(tiny_model("llama", sliding_window=4, use_sliding_window=True,
                        layer_types=["sliding_attention"] * 3), "sliding-window attention is not supported")
