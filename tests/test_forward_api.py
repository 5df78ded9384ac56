"""The public forward: errors before compute, unsupported models, log-probs, output shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

import harts
from harts.tiny import FAMILIES, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(FAMILIES[0], seed=3)  # the newest hybrid family the installed transformers has


def _count_embedding_calls(model):
    calls = []
    handle = model.model.embed_tokens.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls, handle


def test_token_outside_vocabulary_names_trajectory_and_position(model):
    forest = harts.build_forest([[5, 6, 7], [5, 6, 200, 8]])
    calls, handle = _count_embedding_calls(model)
    with pytest.raises(ValueError, match=r"trajectory 1, position 2: token id 200 .*vocab_size=128"):
        harts.forward(model, forest)
    handle.remove()
    assert calls == [], "no model compute may run before the input is validated"


def test_unsupported_family_lists_supported():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    listed = ".*".join(harts.supported_families())
    with pytest.raises(ValueError, match=f"unsupported model family 'gpt2'.*{listed}"):
        harts.forward(gpt2, harts.build_forest([[1, 2]]))


def test_backbone_without_head_is_refused(model):
    with pytest.raises(ValueError, match="causal LM"):
        harts.forward(model.model, harts.build_forest([[1, 2]]))


def test_forest_type_checked(model):
    with pytest.raises(TypeError, match="harts Forest"):
        harts.forward(model, [[1, 2, 3]])


def test_supported_families():
    assert {"qwen3_next", "qwen3", "llama"} <= set(harts.supported_families())
    assert set(FAMILIES) == set(harts.supported_families())


def test_output_shapes_and_logprob_rows(model):
    trajs = [[4, 5, 6, 7], [4, 5, 9], [4, 5, 6, 7]]
    forest = harts.build_forest(trajs)
    with torch.no_grad():
        out = harts.forward(model, forest)
        assert out.hidden_states.shape == (forest.num_tokens, model.config.hidden_size)
        assert out.trajectory_logits(1).shape == (3, model.config.get_text_config().vocab_size)
        assert out.trajectory_logprobs(0).shape == (3,)
        # the branch token (5) predicts 6 in one child and 9 in the other: one predictor, two rows
        idx0, idx1 = forest.trajectory_token_indices(0), forest.trajectory_token_indices(1)
        assert idx0[1] == idx1[1]
        lp, ent = out.logprobs(torch.stack([idx0[1], idx1[1]]), torch.tensor([6, 9]))
        full = torch.log_softmax(out.trajectory_logits(0)[1], -1)
        assert torch.allclose(lp, full[[6, 9]], atol=1e-5)
        assert torch.allclose(ent, -(full.exp() * full).sum().expand(2), atol=1e-5)


def test_flat_layout_matches_tree(model):
    trajs = [[4, 5, 6, 7, 8], [4, 5, 6, 9], [4, 5, 10, 11, 12, 13]]
    with torch.no_grad():
        tree = harts.forward(model, harts.build_forest(trajs))
        flat = harts.forward(model, harts.build_forest(trajs, share_prefixes=False))
        assert flat.hidden_states.shape[0] == sum(map(len, trajs))
        for i in range(len(trajs)):
            assert (tree.trajectory_logits(i) - flat.trajectory_logits(i)).abs().max() <= 1e-5


@pytest.mark.parametrize("mode", ["depth", "chain", "packed", "auto"])
def test_run_config_plans_change_calls_not_results(model, mode):
    trajs = [[4, 5, 6, 7, 8], [4, 5, 6, 9], [4, 5, 10, 11, 12, 13], [4, 5, 6, 7, 20, 21]]
    forest = harts.build_forest(trajs)
    run = harts.RunConfig(linear_plan=mode, chunk_rows=2)
    with torch.no_grad():
        ref = harts.forward(model, forest)
        out = harts.forward(model, forest, run)
        assert out.layout.linear_plan.mode.value == mode or mode == "auto"
        for i in range(len(trajs)):
            assert (out.trajectory_logits(i) - ref.trajectory_logits(i)).abs().max() <= 1e-5
        got, want = torch.cat(out.all_trajectory_logprobs()), torch.cat(ref.all_trajectory_logprobs())
        assert torch.allclose(got, want, atol=1e-5)


def test_hold_tokens_auto_follows_the_budget():
    """auto (the default) bounds held graphs by the budget, wherever the budget comes from; an int
    is the bound itself."""
    assert harts.RunConfig().hold_tokens == "auto" and harts.RunConfig().hold_limit == 0
    assert harts.RunConfig(budget_tokens=512).hold_limit == 512
    assert harts.RunConfig.resolve(harts.RunConfig(), budget_tokens=256).hold_limit == 256
    assert dataclasses.replace(harts.RunConfig(budget_tokens=64), budget_tokens=128).hold_limit == 128
    assert harts.RunConfig(budget_tokens=512, hold_tokens=0).hold_limit == 0
    assert harts.RunConfig(budget_tokens=512, hold_tokens=2048).hold_limit == 2048
    assert harts.RunConfig(hold_tokens=2048).hold_limit == 2048


def test_run_config_refuses_bad_settings(model):
    for kwargs, match in [
        (dict(budget_tokens=0), "budget_tokens"),
        (dict(budget_tokens=2.5), "budget_tokens"),
        (dict(context_weight=1.5), "context_weight"),
        (dict(linear_plan="fastest"), "unknown linear_plan"),
        (dict(chunk_rows=0), "chunk_rows"),
        (dict(hold_tokens=-1), "hold_tokens must be 'auto' or an int >= 0, got -1"),
        (dict(hold_tokens=None), "hold_tokens must be 'auto' or an int >= 0, got None"),
        (dict(hold_tokens=True), "hold_tokens must be 'auto' or an int >= 0, got True"),
        (dict(hold_tokens="all"), "hold_tokens must be 'auto' or an int >= 0, got 'all'"),
        (dict(hold_tokens="AUTO"), "hold_tokens must be 'auto' or an int >= 0, got 'AUTO'"),
        (dict(hold_tokens=64.0), "hold_tokens must be 'auto' or an int >= 0, got 64.0"),
    ]:
        with pytest.raises(ValueError, match=match):
            harts.RunConfig(**kwargs)
    with pytest.raises(TypeError, match="LinearCostModel"):
        harts.RunConfig(cost_model={"call_cost": 1.0})
    with pytest.raises(ValueError, match="forest_backward or harts.rollout_step"):
        harts.forward(model, harts.build_forest([[1, 2]]), harts.RunConfig(budget_tokens=4))
    with pytest.raises(TypeError, match="RunConfig"):
        harts.forward(model, harts.build_forest([[1, 2]]), {"budget_tokens": 4})


def test_public_api_exports_what_its_functions_take_and_return():
    for name in ("Rollout", "PolicyLossConfig", "Normalizers", "LossRows", "RunConfig", "StepResult",
                 "MoEConfig", "MoEStats", "MicroBatchPlan", "Part", "TreeOutput", "PlanMode"):  # fmt: skip
        assert name in harts.__all__ and hasattr(harts, name), name
    assert not [n for n in harts.__all__ if not hasattr(harts, n)]
