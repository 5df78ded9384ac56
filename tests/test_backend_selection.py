"""Which kernels a run uses: ``RunConfig.backend`` against the ``use_backend`` context and the device.

A counting backend (plain PyTorch kernels behind a call counter, registered under its own name)
shows which backend each entry point ran, without a GPU: ``harts.forward``, ``forest_backward``
(through ``rollout_step``) and the forward-only passes all honour the configured name; ``auto``
keeps an enclosing context; a call recomputed in backward reuses the kernel its forward chose,
even when backward runs outside every context.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.ops import backends
from harts.ops.backends import Backend, register_backend, resolve_backend, use_backend
from harts.ops.delta_rule import chunked_gated_delta_rule
from harts.ops.recurrence import DELTA_RULE
from harts.ops.tree_attention import tree_attention
from harts.tiny import tiny_model

TRAJECTORIES = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 12, 13], [5, 6, 14, 15, 16, 17, 18, 19]]


class Counter:
    def __init__(self):
        self.attention = self.delta_rule = 0

    def backend(self) -> Backend:
        def attention(*args, **kwargs):
            self.attention += 1
            return tree_attention(*args, **kwargs)

        def delta_rule(*args, **kwargs):
            self.delta_rule += 1
            return chunked_gated_delta_rule(*args, **kwargs)

        return Backend("counting", {DELTA_RULE.name: delta_rule}, attention)


@pytest.fixture
def counter():
    counter = Counter()
    register_backend("counting", counter.backend)
    yield counter
    backends._REGISTRY.pop("counting", None)
    backends._CACHE.pop("counting", None)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_next", seed=3)  # GDN (the delta rule) and gated attention


def test_run_config_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'cuda'; expected auto or one of"):
        harts.RunConfig(backend="cuda")


def test_auto_picks_by_device_and_extra(monkeypatch):
    assert resolve_backend("auto", torch.device("cpu"))[0] == "torch"
    monkeypatch.setattr(backends, "gpu_extra_installed", lambda: False)
    name, why = resolve_backend("auto", torch.device("cuda", 0))
    assert name == "torch" and "harts[gpu]" in why
    monkeypatch.setattr(backends, "gpu_extra_installed", lambda: True)
    assert resolve_backend("auto", torch.device("cuda", 0))[0] == "fla"
    assert resolve_backend("auto", torch.device("cpu"))[0] == "torch"
    with use_backend("torch"):
        assert resolve_backend("auto", torch.device("cuda", 0))[0] == "torch"  # the context wins
    assert resolve_backend("torch", torch.device("cuda", 0)) == ("torch", "configured")


def test_forward_runs_the_configured_backend(model, counter):
    forest = harts.build_forest(TRAJECTORIES)
    with torch.no_grad():
        # a plan of calls on both (auto leaves the chunk tree out under a backend other than torch)
        ref = harts.forward(model, forest, harts.RunConfig(linear_plan="chain"))
        assert counter.attention == counter.delta_rule == 0
        out = harts.forward(model, forest, harts.RunConfig(backend="counting", linear_plan="chain"))
    assert counter.attention > 0 and counter.delta_rule > 0
    assert torch.equal(out.hidden_states, ref.hidden_states)  # the same kernels behind the counter


def test_auto_keeps_the_enclosing_context_and_a_named_backend_overrides_it(model, counter):
    forest = harts.build_forest(TRAJECTORIES)
    with torch.no_grad(), use_backend("counting"):
        harts.forward(model, forest)
        seen = counter.attention
        assert seen > 0
        harts.forward(model, forest, harts.RunConfig(backend="torch"))
        assert counter.attention == seen


def test_step_and_forward_only_passes_run_the_configured_backend(model, counter):
    rollouts = [harts.Rollout(tokens=t, advantages=1.0) for t in TRAJECTORIES]
    config = harts.PolicyLossConfig(kind="sft")
    run = harts.RunConfig(backend="counting", budget_tokens=8)
    harts.rollout_step(model, rollouts, config, run=run)
    model.zero_grad(set_to_none=True)
    after_step = counter.attention
    assert after_step > 0 and counter.delta_rule > 0
    harts.forest_logprobs(model, rollouts, run=run)
    assert counter.attention > after_step


def test_a_recomputed_call_reuses_its_forward_kernel_outside_every_context(model, counter):
    forest = harts.build_forest(TRAJECTORIES)
    out = harts.forward(model, forest, harts.RunConfig(backend="counting", recompute_linear=True))
    forward_calls = counter.delta_rule
    assert forward_calls > 0
    out.hidden_states.square().sum().backward()  # outside any context: the recomputation runs in here
    model.zero_grad(set_to_none=True)
    assert counter.delta_rule == 2 * forward_calls
