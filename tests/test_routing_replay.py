"""Routing replay: the MoE routers choose the experts an inference engine recorded.

The reference is the stock forward of each trajectory alone with every router's top-k forced to
that trajectory's recorded ids (:func:`harts.replayed_routing`), in fp64; harts runs the forest of
all trajectories, cut into micro-batches, with the routes carried per unique token. Trajectories
whose prefix ids agree but whose recorded routes differ must not share those tokens, and the
tests build such a pair on purpose (a route that differs deep in the shared prefix).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import harts
from harts import MoEConfig, Rollout, RouterRecorder, replayed_routing
from harts.adapters import adapter_for_type
from harts.runtime.backward import next_token_rows
from harts.runtime.routers import find_routers
from harts.tiny import FAMILIES
from tests.reference import (
    GRAD_RTOL,
    LOGIT_ATOL,
    cached_model,
    exact_linear_kernels,
    fp64_copy,
    grad_relative_errors,
    gradient_failures,
    param_grads,
    stock_logits,
)

REPLAY_FAMILIES = [f for f in ("qwen3_moe", "qwen3_next", "bailing_hybrid") if f in FAMILIES]
# every MoE family of the installed transformers: each replayed under a budget that cuts
MOE_FAMILIES = [f for f in FAMILIES if adapter_for_type(f).router_class is not None]


def _model(family: str):
    return cached_model(family, seed=7)


def _trajectories(vocab: int) -> list[list[int]]:
    """A shared prompt, branches, a duplicate prefix whose routes will differ, and a lone root."""
    g = np.random.default_rng(3)
    prompt = g.integers(0, vocab, 9).tolist()
    return [
        prompt + [1, 2, 3, 4],
        prompt + [1, 2, 5],
        prompt + [1, 2, 3, 4],  # same ids as the first: its routes differ at position 6
        prompt[:5] + [7, 8, 9],
        g.integers(0, vocab, 6).tolist(),
    ]


def _routes(model, trajectories) -> list[torch.Tensor | None]:
    """Random distinct experts per MoE layer and token (-1 on layers without routed experts); the
    first three trajectories agree wherever their ids do, except the third at position 6; the last
    trajectory is not recorded (None)."""
    recorder = RouterRecorder(model)
    layers, k, experts = (
        model.config.get_text_config().num_hidden_layers,
        recorder.top_k,
        recorder.num_experts,
    )
    g = torch.Generator().manual_seed(11)

    def draw(n: int) -> torch.Tensor:
        routes = torch.full((n, layers, k), -1, dtype=torch.int32)
        for layer in recorder.layers:
            routes[:, layer] = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)]).int()
        return routes

    routes = [draw(len(t)) for t in trajectories]
    routes[1][:11] = routes[0][:11]
    routes[2] = routes[0].clone()
    first_moe = recorder.layers[0]
    routes[2][6, first_moe] = routes[2][6, first_moe].roll(1)  # the same experts, another order
    routes[3][:5] = routes[0][:5]
    routes[4] = None
    return routes


class RowLoss:
    """Random weights on every row's log-prob and entropy: a sum of per-row terms."""

    separable_rows = True

    def __init__(self, num_rows, rows=None):
        self.w = torch.randn(2, num_rows, generator=torch.Generator().manual_seed(5))
        self.rows = torch.arange(num_rows) if rows is None else rows

    def __call__(self, logprob, entropy):
        w = self.w[:, self.rows].to(logprob.dtype)
        return (logprob * w[0]).sum() + 0.1 * (entropy * w[1]).sum()

    def subset(self, rows):
        out = RowLoss.__new__(RowLoss)
        out.w, out.rows = self.w, self.rows[rows.cpu()]
        return out


def _replayed_rows(model, trajectories, routes, loss_fn, exact: bool):
    """(logprob [R], gradients) of ``loss_fn`` over every trajectory's next-token rows, each
    trajectory through the stock forward alone with its routes replayed (fp64 truth, or the
    literal fp32 model)."""
    target = fp64_copy(model) if exact else model
    target.zero_grad(set_to_none=True)
    logprobs, entropies = [], []
    with exact_linear_kernels(target) if exact else torch.enable_grad():
        for trajectory, recorded in zip(trajectories, routes, strict=True):
            ids = torch.as_tensor(trajectory)
            forced = replayed_routing(target, recorded) if recorded is not None else torch.enable_grad()
            with forced:
                logp = torch.log_softmax(stock_logits(target, trajectory)[:-1], -1)
            logprobs.append(logp.gather(1, ids[1:, None])[:, 0])
            entropies.append(-(logp.exp() * logp).sum(-1))
        logprob = torch.cat(logprobs)
        loss_fn(logprob, torch.cat(entropies)).backward()
    return logprob.detach(), param_grads(target)


def test_routes_are_part_of_a_tokens_identity():
    trajectories = [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 8], [5, 6, 7, 8]]
    routes = [torch.zeros(4, 2, 1, dtype=torch.int32) for _ in trajectories]
    routes[1][3] = 1  # differs only where the ids differ: shares three tokens with the first
    routes[2][1] = 1  # same ids as the first, other route at position 1: shares one token
    routes[3] = None  # not recorded: -1 rows, a branch of its own from the root
    forest = harts.build_forest(trajectories, routed_experts=routes)
    assert forest.num_tokens == 4 + 1 + 3 + 4
    assert forest.routed_experts.shape == (forest.num_tokens, 2, 1)
    for i, recorded in enumerate(routes):
        index = forest.trajectory_token_indices(i)
        assert torch.equal(forest.tokens[index], torch.tensor(trajectories[i]))
        expected = torch.full((4, 2, 1), -1, dtype=torch.int32) if recorded is None else recorded
        assert torch.equal(forest.routed_experts[index], expected)
    same = harts.build_forest(trajectories[:1] * 2, routed_experts=[routes[0], routes[0].clone()])
    assert same.num_tokens == 4 and same.num_nodes == 1
    plain = harts.build_forest(trajectories)
    assert plain.routed_experts is None and plain.num_tokens == 5


@pytest.mark.parametrize(
    "family,budget", [(f, None) for f in REPLAY_FAMILIES] + [(f, 7) for f in MOE_FAMILIES]
)
def test_replayed_forest_equals_stock_with_forced_top_k(family, budget):
    """Row log-probs within LOGIT_ATOL and gradients (routers included) within GRAD_RTOL of the fp64
    stock forward of each trajectory alone with its top-k forced to its recorded ids (or twice the
    literal fp32 stock run's own error, :func:`gradient_failures`)."""
    model = _model(family)
    text = model.config.get_text_config()
    trajectories = _trajectories(text.vocab_size)
    routes = _routes(model, trajectories)
    forest = harts.build_forest(trajectories, routed_experts=routes)
    assert forest.num_tokens == sum(map(len, trajectories)) - 11 - 6 - 5  # the third parts at position 6
    predictor, target = next_token_rows(forest)
    loss = RowLoss(predictor.numel())
    exact_logp, exact = _replayed_rows(model, trajectories, routes, loss, exact=True)
    model.zero_grad(set_to_none=True)
    result = harts.forest_backward(model, forest, predictor, target, loss, budget_tokens=budget)
    if budget is not None:
        assert result.num_micro_batches > 2 and result.num_cuts >= 1
    assert (result.logprob.double() - exact_logp).abs().max() <= LOGIT_ATOL
    got = param_grads(model)
    names = {id(p): n for n, p in model.named_parameters()}
    router = names[id(find_routers(model)[-1][1].weight)]  # a router's gradient, through the gate weights
    assert got[router].abs().sum() > 0
    assert grad_relative_errors({router: got[router]}, {router: exact[router]})[router] <= GRAD_RTOL
    if max(grad_relative_errors(got, exact).values()) > GRAD_RTOL:
        _, stock32 = _replayed_rows(model, trajectories, routes, loss, exact=False)
        assert not gradient_failures(got, exact, stock32)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # the routes matter: the natural routing gives other log-probs
        plain = harts.build_forest(trajectories)
        natural, _ = harts.forward(model, plain).logprobs(*next_token_rows(plain))
    assert (natural.double() - exact_logp).abs().max() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("family", REPLAY_FAMILIES)
def test_replaying_the_routers_own_choice_changes_no_bit(family):
    """Routes recorded from the trainer's own routers, replayed: the same log-probs, bit for bit, as
    the routers choosing; the step's expert counts are those routes' counts."""
    model = _model(family)
    trajectories = _trajectories(model.config.get_text_config().vocab_size)[:2]
    layers = model.config.get_text_config().num_hidden_layers
    with torch.no_grad():
        forest = harts.build_forest(trajectories)
        with RouterRecorder(model) as recorder:
            own = harts.forward(model, forest)
        k = recorder.top_k
        table = torch.full((forest.num_tokens, layers, k), -1, dtype=torch.int32)
        for layer, chosen in zip(recorder.layers, recorder.indices, strict=True):
            table[:, layer] = chosen.int()
        routes = [table[forest.trajectory_token_indices(i)] for i in range(len(trajectories))]
        # the same forest (its tokens in the same order) with the routes: the same bits
        replayed = harts.forward(model, dataclasses.replace(forest, routed_experts=table))
        predictor, target = next_token_rows(forest)
        assert torch.equal(own.logprobs(predictor, target)[0], replayed.logprobs(predictor, target)[0])
        # the forest built from the routes may order its tokens otherwise: the same values
        rebuilt = harts.build_forest(trajectories, routed_experts=routes)
        assert torch.equal(rebuilt.routed_experts[rebuilt.trajectory_token_indices(0)], routes[0])
        again = harts.forward(model, rebuilt).logprobs(*next_token_rows(rebuilt))[0]
        assert (again - own.logprobs(predictor, target)[0]).abs().max() <= LOGIT_ATOL
    rollouts = [
        Rollout(t, routed_experts=r, advantages=1.0, rollout_logprobs=[-1.0] * len(t))
        for t, r in zip(trajectories, routes, strict=True)
    ]
    result = harts.rollout_step(model, rollouts, harts.PolicyLossConfig(), moe=MoEConfig(), budget_tokens=5)
    model.zero_grad(set_to_none=True)
    counts = torch.zeros_like(result.moe.expert_counts)
    for r in routes:
        for row, layer in enumerate(result.moe.layers):
            counts[row] += torch.bincount(r[:, layer].reshape(-1).long(), minlength=counts.shape[1])
    assert torch.equal(result.moe.expert_counts, counts)


def test_forest_logprobs_and_rollout_step_read_the_rollouts_routes():
    model = _model(REPLAY_FAMILIES[0])
    trajectories = _trajectories(model.config.vocab_size)
    routes = _routes(model, trajectories)
    rollouts = [Rollout(t, routed_experts=r) for t, r in zip(trajectories, routes, strict=True)]
    exact_logp, _ = _replayed_rows(model, trajectories, routes, lambda lp, en: lp.sum(), exact=True)
    got = harts.forest_logprobs(model, rollouts, budget_tokens=6)
    rows = torch.cat([lp[1:] for lp in got.logprobs])
    assert (rows.double() - exact_logp).abs().max() <= LOGIT_ATOL


def _bad(model, trajectory, routes) -> str:
    with pytest.raises(ValueError) as error:
        harts.forest_logprobs(model, [Rollout(trajectory, routed_experts=routes)])
    return str(error.value)


def test_routes_that_do_not_fit_the_model_are_refused_before_compute():
    model = _model("qwen3_moe")
    layers = model.config.num_hidden_layers
    recorder = RouterRecorder(model)
    k, experts, moe_layer = recorder.top_k, recorder.num_experts, recorder.layers[0]
    dense_layer = next(layer for layer in range(layers) if layer not in recorder.layers)
    ids = [3, 4, 5, 6]
    good = torch.full((4, layers, k), -1, dtype=torch.int32)
    good[:, moe_layer] = torch.arange(k)
    wrong_layers = torch.zeros(4, layers + 1, k, dtype=torch.int32)
    assert "decoder layers" in _bad(model, ids, wrong_layers)
    out_of_range = good.clone()
    out_of_range[2, moe_layer, 0] = experts
    message = _bad(model, ids, out_of_range)
    assert "trajectory 0, position 2, decoder layer" in message and "out of range" in message
    twice = good.clone()
    twice[1, moe_layer] = 0
    assert "position 1" in _bad(model, ids, twice) and "twice" in _bad(model, ids, twice)
    partial = good.clone()
    partial[3, moe_layer, 1] = -1
    assert "only some" in _bad(model, ids, partial)
    on_dense = good.clone()
    on_dense[0, dense_layer] = torch.arange(k)
    assert f"decoder layer {dense_layer}" in _bad(model, ids, on_dense)
    with pytest.raises(ValueError, match="trajectory 0: routed_experts must be"):
        harts.forest_logprobs(model, [Rollout(ids, routed_experts=good[:3])])
    with pytest.raises(ValueError, match="position 0: routed expert id -2"):
        harts.forest_logprobs(model, [Rollout(ids, routed_experts=good - 1)])
    with pytest.raises(ValueError, match="trajectory 1: routed_experts is"):
        harts.build_forest([ids, ids], routed_experts=[good, good[:, :, :1]])
    dense = _model("qwen3")
    with pytest.raises(ValueError, match="no MoE router"):
        harts.forest_logprobs(dense, [Rollout(ids, routed_experts=torch.zeros(4, 2, 1, dtype=torch.long))])


@pytest.mark.parametrize("family", [f for f in REPLAY_FAMILIES if f != "bailing_hybrid"])
def test_the_balancing_loss_counts_the_replayed_experts(family):
    """The Switch loss ``E * sum_e f_e P_e`` with ``f`` the share of the *recorded* routes, ``P`` the
    routers' mean probabilities; under a budget that cuts, as without one."""
    model = _model(family)
    text = model.config.get_text_config()
    trajectories = _trajectories(text.vocab_size)
    routes = _routes(model, trajectories)[:4]
    trajectories = trajectories[:4]
    forest = harts.build_forest(trajectories, routed_experts=routes)
    with torch.no_grad(), RouterRecorder(model) as recorder:
        harts.forward(model, forest)
    weight = forest.token_multiplicity.double()
    experts, k = recorder.num_experts, recorder.top_k
    routed = torch.zeros(experts, dtype=torch.float64)
    probs = torch.zeros(experts, dtype=torch.float64)
    for layer, logits in zip(recorder.layers, recorder.logits, strict=True):
        chosen = forest.routed_experts[:, layer].long()
        routed += torch.zeros(experts, dtype=torch.float64).index_add(
            0, chosen.reshape(-1), weight.repeat_interleave(k)
        )
        probs += (torch.softmax(logits.double(), -1) * weight[:, None]).sum(0)
    tokens = weight.sum() * len(recorder.layers)
    expected = experts * ((routed / tokens) * (probs / tokens)).sum()
    rollouts = [
        Rollout(t, routed_experts=r, advantages=1.0, rollout_logprobs=[-1.0] * len(t))
        for t, r in zip(trajectories, routes, strict=True)
    ]
    for budget in (None, 6):
        result = harts.rollout_step(
            model, rollouts, harts.PolicyLossConfig(), moe=MoEConfig(), budget_tokens=budget
        )
        model.zero_grad(set_to_none=True)
        assert abs(float(result.moe.aux_loss) - float(expected)) <= 1e-5 * float(expected)


@pytest.mark.parametrize("family", REPLAY_FAMILIES[:1] + REPLAY_FAMILIES[2:])
def test_verification_replays_the_samples_routes(family):
    """``RunConfig(verify=True)`` compares harts and stock on a sample with its recorded routes
    replayed in both (stock choosing its own experts would be ~1 off in log-prob, a failure)."""
    model = _model(family)
    trajectories = _trajectories(model.config.get_text_config().vocab_size)
    routes = _routes(model, trajectories)
    rollouts = [
        Rollout(t, routed_experts=r, advantages=1.0, rollout_logprobs=[-1.0] * len(t))
        for t, r in zip(trajectories, routes, strict=True)
    ]
    config = harts.PolicyLossConfig()
    model.zero_grad(set_to_none=True)
    verified = harts.rollout_step(model, rollouts, config, budget_tokens=8, run=harts.RunConfig(verify=True))
    grads = param_grads(model)
    model.zero_grad(set_to_none=True)
    plain = harts.rollout_step(model, rollouts, config, budget_tokens=8)
    assert torch.equal(verified.loss, plain.loss)
    assert all(torch.equal(grads[name], value) for name, value in param_grads(model).items())
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("mix", [None, 0])
def test_distinct_routes_are_found_exactly_even_when_hashes_collide(mix, monkeypatch):
    """Rows grouped by hash, then checked in full: with every hash equal (a multiplier of 0), the
    fallback still tells the rows apart."""
    import numpy as np

    from harts import forest_routes

    if mix is not None:
        monkeypatch.setattr(forest_routes, "_MIX", np.uint64(mix))
    flat = np.array([[1, 2, 3], [3, 2, 1], [1, 2, 3], [-1, -1, -1], [3, 2, 1]], dtype=np.int32)
    first, number = forest_routes._distinct_rows(flat)
    assert np.array_equal(flat[first][number], flat)
    assert len(first) == 3 and number[0] == number[2] and number[1] == number[4] and number[0] != number[1]
