"""MoE statistics of a forest equal those of the flat batch.

The flat batch is every trajectory right-padded into one stock batch with its attention mask.
The forest runs each unique token once and weights it by its multiplicity; the flat side runs
the stock model and reads the same router outputs through the same hooks (and, for the aux
loss, the stock ``output_router_logits=True`` path with the stock ``load_balancing_loss_func``).

- Expert counts (every family whose router reports its choice): exactly equal integers, also
  equal to counting, in plain loops, the experts of each trajectory run alone.
- Aux loss (the families trained with the Switch loss): value within 1e-5 relative of the stock
  one; gradient with respect to every parameter (router weights included) within 1e-4 relative of
  the stock fp64 gradient.
- The one step (``rollout_step``) under token budgets down to 1: the same counts (exact), aux
  loss, loss and gradients as without a budget.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts import LossKind, MoEConfig, PolicyLossConfig, Rollout, RouterRecorder, moe_stats, rollout_step
from harts.adapters import adapter_for_type, supported_families
from harts.adapters.base import MoEBalancing
from harts.objectives import bias_update, load_balancing_loss
from harts.runtime.routers import find_routers
from harts.tiny import FAMILIES, tiny_model
from tests.helpers import MOE_FORESTS, loop_counts
from tests.reference import (
    GRAD_RTOL,
    cached_model,
    exact_linear_kernels,
    fp64_copy,
    grad_relative_errors,
    param_grads,
)

# every family whose router reports its choice in the installed transformers, and those of them
# trained with the Switch aux loss
MOE_FAMILIES = [f for f in FAMILIES if adapter_for_type(f).router_class is not None]
AUX_FAMILIES = [f for f in MOE_FAMILIES if adapter_for_type(f).moe_balancing is MoEBalancing.AUX_LOSS]
AUX_RTOL = 1e-5


def model_of(family: str):
    return cached_model(family, seed=7)


def padded_batch(trajectories) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], attention_mask [B, T]): right padding with the pad token."""
    width = max(len(t) for t in trajectories)
    ids = torch.zeros(len(trajectories), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(trajectories):
        ids[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t)] = 1
    return ids, mask


@pytest.mark.parametrize("shape", list(MOE_FORESTS))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_counts_equal_flat_batch(family, shape):
    model, trajs = model_of(family), MOE_FORESTS[shape]
    forest = harts.build_forest(trajs)
    assert forest.num_tokens < forest.num_flat_tokens and int(forest.token_multiplicity.max()) >= 3
    with torch.no_grad():
        with RouterRecorder(model) as rec:
            harts.forward(model, forest)
        tree = moe_stats(rec, forest)

        ids, mask = padded_batch(trajs)
        with RouterRecorder(model) as flat_rec:
            model(input_ids=ids, attention_mask=mask)
        flat = moe_stats(flat_rec, mask.reshape(-1))
        keep = mask.reshape(-1).bool().tolist()
        flat_loop = loop_counts(flat_rec.indices, keep, flat_rec.num_experts)

        alone = [[0] * rec.num_experts for _ in rec.layers]  # each trajectory alone, no padding
        for t in trajs:
            with RouterRecorder(model) as one:
                model(input_ids=torch.tensor([t]))
            for layer, row in enumerate(loop_counts(one.indices, [True] * len(t), one.num_experts)):
                alone[layer] = [a + b for a, b in zip(alone[layer], row, strict=True)]

        with RouterRecorder(model) as flat_forest_rec:
            flat_forest = harts.build_forest(trajs, share_prefixes=False)
            harts.forward(model, flat_forest)
        flat_layout = moe_stats(flat_forest_rec, flat_forest)

    assert tree.expert_counts.dtype == torch.int64
    assert tree.expert_counts.tolist() == flat_loop == alone
    assert torch.equal(tree.expert_counts, flat.expert_counts)
    assert torch.equal(tree.expert_counts, flat_layout.expert_counts)
    top_k = model.config.get_text_config().num_experts_per_tok
    assert int(tree.tokens) == forest.num_flat_tokens == int(flat.tokens)
    assert tree.expert_counts.sum(1).tolist() == [top_k * forest.num_flat_tokens] * len(rec.layers)
    assert (tree.aux_loss is not None) == (family in AUX_FAMILIES)


# aux-loss families: qwen3_next on every forest, the others on one
AUX_CASES = [("qwen3_next", shape) for shape in MOE_FORESTS] + [
    (family, "star-dups-P8-G6") for family in AUX_FAMILIES if family != "qwen3_next"
]


@pytest.mark.parametrize(("family", "shape"), AUX_CASES)
def test_aux_loss_and_gradient_equal_stock_flat_batch(family, shape):
    if family not in supported_families():
        pytest.skip(f"transformers lacks {family}")
    model, trajs = model_of(family), MOE_FORESTS[shape]
    forest = harts.build_forest(trajs)
    ids, mask = padded_batch(trajs)

    model.zero_grad(set_to_none=True)
    with RouterRecorder(model) as rec:
        harts.forward(model, forest)
    aux = moe_stats(rec, forest).aux_loss
    aux.backward()
    got = param_grads(model)

    with torch.no_grad():  # the stock fp32 path, as a trainer would call it
        stock32 = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    model64 = fp64_copy(model)
    model64.zero_grad(set_to_none=True)
    with exact_linear_kernels(model64):
        out64 = model64(input_ids=ids, attention_mask=mask, output_router_logits=True)
    out64.aux_loss.backward()
    ref = param_grads(model64)
    # The recorded flat logits through harts' own function: the same number, so the formula is the stock one.
    with torch.no_grad():
        ours_on_flat = load_balancing_loss(list(out64.router_logits), mask.reshape(-1), rec.top_k)

    stock = {"stock fp32": stock32, "stock fp64": out64.aux_loss.detach(), "ours on flat": ours_on_flat}
    for name, value in stock.items():
        err = abs(float(aux.detach()) - float(value)) / abs(float(value))
        assert err <= AUX_RTOL, f"aux loss vs {name}: relative error {err:.2e}"
    errors = grad_relative_errors(got, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"gradient of {worst}: relative error {errors[worst]:.2e}"
    router_params = {id(p) for _, router in find_routers(model64) for p in router.parameters()}
    routers = [n for n, p in model64.named_parameters() if id(p) in router_params and p.dim() == 2]
    assert routers and all(ref[n].norm() > 1e-4 for n in routers)


def _rollouts(trajs):
    return [Rollout(t, rollout_logprobs=[-1.0] * len(t), advantages=0.5) for t in trajs]


def test_rollout_step_adds_the_aux_loss():
    model, trajs = model_of("qwen3_next"), MOE_FORESTS["star-dups-P8-G6"]
    config = PolicyLossConfig(kind=LossKind.PPO)
    plain = rollout_step(model, _rollouts(trajs), config)
    with_aux = rollout_step(model, _rollouts(trajs), config, moe=MoEConfig(aux_loss_coef=0.01))
    default = rollout_step(model, _rollouts(trajs), config, moe=MoEConfig())
    model.zero_grad(set_to_none=True)
    assert plain.moe is None and "moe_aux_loss" not in plain.metrics
    aux = with_aux.moe.aux_loss
    assert torch.allclose(with_aux.loss, plain.loss + 0.01 * aux, rtol=1e-6, atol=0)
    assert with_aux.metrics["moe_aux_loss"] == aux and with_aux.metrics["loss"] == with_aux.loss
    coef = model.config.get_text_config().router_aux_loss_coef
    assert coef > 0 and torch.allclose(default.loss, plain.loss + coef * aux, rtol=1e-6, atol=0)
    assert int(with_aux.moe.tokens) == sum(len(t) for t in trajs)


def test_moe_options_refused_before_compute():
    calls = []
    for family, moe, match in [
        ("llama", MoEConfig(), "need an MoE family"),
        ("bailing_hybrid", MoEConfig(aux_loss_coef=0.01), "bias_update"),
    ]:
        model = model_of(family) if family != "llama" else tiny_model("llama", seed=0)
        handle = model.model.embed_tokens.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            with pytest.raises(ValueError, match=match):
                rollout_step(model, _rollouts([[3, 4, 5]]), PolicyLossConfig(), moe=moe)
        finally:
            handle.remove()
    assert calls == []
    with pytest.raises(ValueError, match=">= 0"):
        MoEConfig(aux_loss_coef=-1.0)


MOE_BUDGETS = [1, 6]


@pytest.mark.parametrize("budget", MOE_BUDGETS, ids=[f"budget{b}" for b in MOE_BUDGETS])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_budgeted_step_keeps_moe_statistics_and_aux_gradient(family, budget):
    """Counts per part add up to the whole step's; the aux loss, split into each part's share of
    P against the step's f, gives the same value and gradients as one pass."""
    model, trajs = model_of(family), MOE_FORESTS["nested-branches-2roots"]
    config = PolicyLossConfig(kind=LossKind.PPO)
    moe = MoEConfig(aux_loss_coef=0.05 if family in AUX_FAMILIES else None)
    runs = []
    for b in (None, budget):
        model.zero_grad(set_to_none=True)
        result = rollout_step(model, _rollouts(trajs), config, budget_tokens=b, moe=moe)
        runs.append((result, param_grads(model)))
    (whole, whole_grads), (cut, cut_grads) = runs
    assert cut.num_micro_batches > 2 and cut.num_cuts >= 1
    assert torch.equal(cut.moe.expert_counts, whole.moe.expert_counts)
    assert int(cut.moe.tokens) == int(whole.moe.tokens) == sum(len(t) for t in trajs)
    assert cut.moe.layers == whole.moe.layers
    if family in AUX_FAMILIES:
        aux = float(whole.moe.aux_loss)
        assert abs(float(cut.moe.aux_loss) - aux) <= AUX_RTOL * aux
        assert float(cut.metrics["moe_aux_loss"]) == float(cut.moe.aux_loss)
    else:
        assert cut.moe.aux_loss is None and whole.moe.aux_loss is None
    assert abs(float(cut.loss) - float(whole.loss)) <= 1e-6 * max(1.0, abs(float(whole.loss)))
    errors = grad_relative_errors(cut_grads, whole_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"gradient of {worst}: relative error {errors[worst]:.2e}"


def test_budgeted_aux_gradient_reaches_the_routers():
    """The aux term's own gradient (no policy loss: zero advantages) matches, and is not zero."""
    model, trajs = model_of("qwen3_next"), MOE_FORESTS["star-dups-P8-G6"]
    rollouts = [Rollout(t, rollout_logprobs=[-1.0] * len(t), advantages=0.0) for t in trajs]
    grads = []
    for b in (None, 3):
        model.zero_grad(set_to_none=True)
        rollout_step(model, rollouts, PolicyLossConfig(), budget_tokens=b, moe=MoEConfig(aux_loss_coef=1.0))
        grads.append(param_grads(model))
    routers = [n for n in grads[0] if n.endswith("mlp.gate.weight")]
    assert routers and all(grads[0][n].norm() > 1e-6 for n in routers)
    errors = grad_relative_errors(grads[1], grads[0])
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


def test_recorder_refuses_mismatched_weights():
    model = model_of("kimi_linear")
    forest = harts.build_forest([[3, 4, 5], [3, 4, 6]])
    with torch.no_grad(), RouterRecorder(model) as rec:
        harts.forward(model, forest)
        harts.forward(model, forest)  # two forwards in one recording: 2N rows per layer
    with pytest.raises(ValueError, match="recorded 8 tokens but weight has 4"):
        moe_stats(rec, forest)
    with pytest.raises(RuntimeError, match="no router output"):
        moe_stats(RouterRecorder(model), forest)


def test_bias_update_is_deepseek_v3_sign_rule():
    counts = torch.tensor([[10, 2, 6, 6], [0, 0, 0, 12]])
    delta = bias_update(counts, speed=0.001)
    # layer means 6 and 3: overloaded experts go down, underloaded up, exactly-average ones stay
    expected = torch.tensor([[-0.001, 0.001, 0.0, 0.0], [0.001, 0.001, 0.001, -0.001]])
    assert torch.allclose(delta, expected, rtol=0, atol=1e-9)
