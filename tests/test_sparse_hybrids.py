"""The sparse-attention hybrids, GLM-5 Next (``glm5_next``) and Qwen4-Exp (``qwen4_exp``), over
forests, against the stock forward of each trajectory alone.

The generic family tests (tests/test_equivalence.py and the others parametrised over the families)
hold them to 1e-4 in fp32. Here, what is particular to them:

- exactness to fp64 rounding: harts on an fp64 copy, with the stock fp32 islands lifted (as the fp64
  reference runs), against the stock fp64 forward of each trajectory alone, on a deep forest whose
  paths are several indexer pools long and hold EOS tokens (they cut Qwen4-Exp's n-gram context),
  whole and under budgets that cut inside a pool and inside the n-gram's dilated convolution (so a
  pool's tokens, the indexer's keys, the convolutions' windows and the hyper-connection streams
  cross cuts);
- the indexers select: stock logits with every pool selected differ from the model's, so the
  selection harts reproduces is a real one (a query attends to a strict subset of its path);
- refusals: images, a shared indexer layer without an indexed layer before it.
"""

from __future__ import annotations

import random

import pytest
import torch

import harts
from harts.tiny import FAMILIES, tiny_config, tiny_model
from tests.helpers import run_train, write_config
from tests.reference import exact_linear_kernels, fp64_copy, grad_relative_errors, param_grads

SPARSE = ("glm5_next", "qwen4_exp")
# the knob that makes each family's indexer keep every pool of a path
KEEP_ALL = {"glm5_next": dict(index_topk=4 * 64), "qwen4_exp": dict(indexer_budget=4 * 64)}


def sparse_family(family: str):
    return pytest.param(
        family, marks=pytest.mark.skipif(family not in FAMILIES, reason=f"transformers lacks {family}")
    )


# fp64 rounding over a few thousand operations per value: far below any real fault (a wrong pool,
# a missed stream, a key from a sibling branch move logits by 1e-3 or more on this model)
FP64_ATOL = 1e-9


def deep_forest(seed: int = 3) -> list[list[int]]:
    """Trajectories of 18-41 tokens (pools of 4: up to 10 per path) branching at several depths, two
    EOS tokens (id 1) on shared paths."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(3, 128) for _ in range(n)]  # noqa: E731
    trunk = draw(13)
    trunk[5] = 1
    left, right = trunk + draw(9), trunk[:6] + draw(12)
    left[16] = 1
    return [
        left + draw(10),
        left + draw(19),
        left[:17] + draw(7),
        right + draw(5),
        right + draw(23),
        trunk[:3] + draw(15),
        left + draw(10)[:4],
    ]


def stock_fp64(model64, trajectories):
    """Per trajectory alone: logits, and the gradients of a fixed linear functional of all logits."""
    gen = torch.Generator().manual_seed(11)
    weights = [torch.randn(len(t), 128, generator=gen, dtype=torch.float64) for t in trajectories]
    model64.zero_grad(set_to_none=True)
    logits = []
    with exact_linear_kernels(model64):
        for t, w in zip(trajectories, weights, strict=True):
            out = model64(input_ids=torch.tensor([t])).logits[0]
            (out * w).sum().backward()
            logits.append(out.detach())
    return logits, param_grads(model64), weights


@pytest.fixture(scope="module", params=[sparse_family(f) for f in SPARSE])
def model(request):
    return tiny_model(request.param, seed=5)


def test_fp64_tree_equals_each_trajectory_alone(model):
    trajectories = deep_forest()
    model64 = fp64_copy(model, cache=False)
    ref_logits, ref_grads, weights = stock_fp64(model64, trajectories)
    model64.zero_grad(set_to_none=True)
    with exact_linear_kernels(model64):
        out = harts.forward(model64, harts.build_forest(trajectories))
        loss = sum((out.trajectory_logits(i) * w).sum() for i, w in enumerate(weights))
        loss.backward()
    worst = max((out.trajectory_logits(i).detach() - r).abs().max().item() for i, r in enumerate(ref_logits))
    assert worst <= FP64_ATOL, f"max |logit diff| {worst:.3g}"
    errors = grad_relative_errors(param_grads(model64), ref_grads)
    name = max(errors, key=errors.get)
    assert errors[name] <= FP64_ATOL, f"{name}: {errors[name]:.3g}"


@pytest.mark.parametrize("budget", [None, 5, 7, 13], ids=lambda b: f"budget{b}")
def test_fp64_step_under_budgets_that_cut_pools(model, budget):
    """The SFT sum through rollout_step: loss and every gradient equal the stock fp64 sum."""
    trajectories = deep_forest()
    model64 = fp64_copy(model, cache=False)
    model64.zero_grad(set_to_none=True)
    ref_loss = 0.0
    with exact_linear_kernels(model64):
        for t in trajectories:
            ids = torch.tensor([t])
            logp = (
                torch.log_softmax(model64(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None]).sum()
            )
            (-logp).backward()
            ref_loss -= float(logp.detach())
    ref_grads = param_grads(model64)
    model64.zero_grad(set_to_none=True)
    total = harts.Normalizers(torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    with exact_linear_kernels(model64):
        result = harts.rollout_step(
            model64,
            [harts.Rollout(t) for t in trajectories],
            harts.PolicyLossConfig(kind="sft"),
            normalizers=total,
            budget_tokens=budget,
        )
    if budget is not None:
        assert result.num_micro_batches > 1 and max(result.tokens_per_micro_batch) <= budget
    assert abs(float(result.loss) - ref_loss) <= FP64_ATOL * abs(ref_loss)
    errors = grad_relative_errors(param_grads(model64), ref_grads)
    name = max(errors, key=errors.get)
    assert errors[name] <= FP64_ATOL, f"{name}: {errors[name]:.3g}"


def test_forest_logprobs_under_a_budget(model):
    trajectories = deep_forest()
    rollouts = [harts.Rollout(t) for t in trajectories]
    got = harts.forest_logprobs(model, rollouts, budget_tokens=6).logprobs
    with torch.no_grad():
        for i, t in enumerate(trajectories):
            ids = torch.tensor([t])
            ref = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            assert torch.allclose(got[i][1:], ref, atol=1e-4, rtol=0)


def test_the_indexer_selects_a_strict_subset(model):
    """With every pool selected (a budget beyond the longest path) the logits change: the selection
    harts matches above is sparse, not the whole path."""
    family = model.config.get_text_config().model_type.removesuffix("_text")
    dense = tiny_model(family, seed=5, **KEEP_ALL[family])
    dense.load_state_dict(model.state_dict())
    t = torch.tensor([max(deep_forest(), key=len)])
    with torch.no_grad():
        gap = (model(input_ids=t).logits - dense(input_ids=t).logits).abs().max().item()
    assert gap > 1e-3


def qwen4_exp_multimodal():
    """A tiny ``Qwen4ExpForConditionalGeneration``: the tiny text model beside a one-block tower."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen4_exp import Qwen4ExpConfig

    text = tiny_config("qwen4_exp").to_dict()
    vision = dict(
        depth=1,
        hidden_size=16,
        num_heads=2,
        intermediate_size=32,
        patch_size=2,
        temporal_patch_size=1,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=16,
    )
    torch.manual_seed(5)
    return AutoModelForImageTextToText.from_config(
        Qwen4ExpConfig(text_config=text, vision_config=vision)
    ).eval()


@pytest.mark.skipif("qwen4_exp" not in FAMILIES, reason="transformers lacks qwen4_exp")
def test_qwen4_exp_multimodal_model_runs_as_its_language_model():
    model = qwen4_exp_multimodal()
    trajectories = deep_forest()
    out = harts.forward(model, harts.build_forest(trajectories))
    with torch.no_grad():
        for i, t in enumerate(trajectories):
            stock = model(input_ids=torch.tensor([t])).logits[0]
            assert (out.trajectory_logits(i).detach() - stock).abs().max() <= 1e-4
    rollout = harts.Rollout(
        [3, 4, 5], pixel_values=torch.zeros(4, 12), image_grid_thw=torch.tensor([[1, 2, 2]])
    )
    with pytest.raises(ValueError, match="qwen4_exp: rollouts with images are not supported"):
        harts.image_forest(model, [rollout])


@pytest.mark.skipif("glm5_next" not in FAMILIES, reason="transformers lacks glm5_next")
def test_images_are_refused():
    model = tiny_model("glm5_next")
    rollout = harts.Rollout(
        [3, 4, 5], pixel_values=torch.zeros(4, 12), image_grid_thw=torch.tensor([[1, 2, 2]])
    )
    with pytest.raises(ValueError, match="glm5_next: rollouts with images are not supported"):
        harts.image_forest(model, [rollout])


@pytest.mark.skipif("glm5_next" not in FAMILIES, reason="transformers lacks glm5_next")
def test_a_shared_indexer_layer_needs_an_indexed_layer_before_it():
    with pytest.raises(ValueError, match="layer 1 reuses the previous layer's indexer selection"):
        model = tiny_model(
            "glm5_next",
            layer_types=["linear_attention", "indexed_attention"],
            indexer_types=["full", "shared"],
            mlp_layer_types=["dense", "sparse"],
            num_hidden_layers=2,
        )
        harts.forward(model, harts.build_forest([[3, 4, 5]]))


def test_harts_train_runs_and_its_checkpoint_loads_with_the_family_class(model, tmp_path, capsys):
    """``harts train`` (GRPO-style PPO with the first step verified against the stock forward) on the
    family's tiny model; the final checkpoint loads through the family's auto class, every weight
    found, the run's updates in it."""
    import transformers

    from harts.adapters import adapter_for_type
    from harts.trainer.checkpoint import list_checkpoints

    family = model.config.get_text_config().model_type.removesuffix("_text")
    config = write_config(
        tmp_path / "run.toml",
        {"steps": 2},
        model={"tiny": family},
        objective={"kind": "ppo", "advantage": "grpo"},
        run={"budget_tokens": 96, "verify": "first"},
    )
    assert run_train(config, tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "step 1 verified against the stock forward" in err
    final = list_checkpoints(tmp_path / "out" / "checkpoints")[-1].path
    loader = getattr(transformers, adapter_for_type(family).auto_class)
    assert f"{adapter_for_type(family).auto_class}.from_pretrained loads it" in err
    loaded, info = loader.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    initial = tiny_model(family, seed=0).state_dict()
    changed = [n for n, t in loaded.state_dict().items() if not torch.equal(t, initial[n])]
    assert changed  # the run's updates, not the initial weights


@pytest.mark.parametrize("share", [True, False], ids=["tree", "flat"])
def test_blocks_of_whole_trees_give_the_same_logits(model, share, monkeypatch):
    """Sparse attention runs block by block over whole trees (several trees of a micro-batch, or its
    flat trajectories): with blocks of a few trees the logits still equal each trajectory alone."""
    import harts.plan.layout as layout

    monkeypatch.setattr(layout, "QUERY_BLOCK_TOKENS", 40)
    rng = random.Random(9)
    trajectories = deep_forest() + [[rng.randrange(3, 128) for _ in range(n)] for n in (19, 33, 26)]
    forest = harts.build_forest(trajectories, share_prefixes=share)
    out = harts.forward(model, forest)
    assert len(out.layout.query_blocks()) >= 3
    with torch.no_grad():
        for i, t in enumerate(trajectories):
            stock = model(input_ids=torch.tensor([t])).logits[0]
            assert (out.trajectory_logits(i).detach() - stock).abs().max() <= 1e-4
