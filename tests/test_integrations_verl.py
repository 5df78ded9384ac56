"""verl's engine contract, computed by harts, against the stock HF forward of each sequence alone.

In every environment: ``harts.integrations.verl.model_output`` on verl's no-padding layout (a
jagged nested ``input_ids``, the temperature and entropy flags) gives verl's predictor-indexed
log-probs and entropies (fp32, within 1e-5 of the stock forward), and the gradients of a loss of
them match the stock per-sequence forward's.

The critic's side likewise: ``harts.integrations.verl.value_output`` gives verl's token-indexed
values (every position: the head at the state after that token) of a tiny
``*ForTokenClassification`` with ``num_labels=1``, within 1e-5 of the stock forward of each
sequence alone, and the gradients of a loss of them match.

Where verl is installed (``make test-verl``, ``.venv-verl``): verl's own ``ppo_loss`` (its
registered vanilla policy loss, ``agg_loss`` with the standard modes, the entropy term) run on
harts' model output and on the stock one give the same loss and gradients, and so does verl's
own ``value_loss`` (clipped, each aggregation) on harts' values; ``register_engine`` makes the
harts engine verl's actor engine for the fsdp/fsdp2 strategies, ``register_critic_engine`` the
critic's (``value_model``), and ``unregister_engine`` restores verl's. The engines against verl's
own, sharded over 2 processes: ``tests/test_integrations_verl_sharded.py``.
"""

from __future__ import annotations

import pytest
import torch

from harts.integrations.verl import (
    model_output,
    register_critic_engine,
    register_engine,
    unregister_engine,
    value_output,
)
from harts.runtime.config import RunConfig
from harts.tiny import tiny_model
from tests.critic_models import critic as tiny_critic
from tests.helpers import prompt_response_batch
from tests.reference import GRAD_RTOL, grad_relative_errors, param_grads

PROMPT = [5, 9, 17, 33, 65, 3, 7]
RESPONSES = [[11, 12, 13], [11, 12, 40, 41, 42], [50, 51], [11, 60, 61, 62]]
SEQUENCES = [PROMPT + r for r in RESPONSES] + [[8, 9, 10] + [70, 71, 72]]
TEMPERATURE = 0.7


def jagged(rows: list[list[int]] | list[torch.Tensor], dtype=torch.long) -> torch.Tensor:
    values = torch.cat([torch.as_tensor(r, dtype=dtype) for r in rows])
    offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def stock_output(model, sequences, temperature):
    """verl's eager engine output, one stock forward per sequence: log-probs and entropies of
    ``logits / T`` at each position for the next token (the rolled input), the last position
    reading the next sequence's first token as verl's roll over the packed row does."""
    flat = torch.tensor([t for s in sequences for t in s])
    rolled = torch.roll(flat, -1)
    lps, ents, start = [], [], 0
    for s in sequences:
        logits = model(input_ids=torch.tensor([s])).logits[0] / temperature
        logp = torch.log_softmax(logits, -1)
        lps.append(logp.gather(1, rolled[start : start + len(s), None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
        start += len(s)
    return torch.cat(lps), torch.cat(ents)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=2)


def test_model_output_is_verls_layout_with_stock_values(model):
    data = {"input_ids": jagged(SEQUENCES), "temperature": TEMPERATURE, "calculate_entropy": True}
    out = model_output(model, data)
    assert (
        out["log_probs"].is_nested
        and out["log_probs"].offsets().tolist() == data["input_ids"].offsets().tolist()
    )
    lp, ent = out["log_probs"].values(), out["entropy"].values()
    ref_lp, ref_ent = stock_output(model, SEQUENCES, TEMPERATURE)
    last = data["input_ids"].offsets()[1:] - 1  # no next token of the sequence's own: 0, never read by verl
    keep = torch.ones_like(lp, dtype=torch.bool)
    keep[last] = False
    assert torch.all(lp[last] == 0) and torch.all(ent[last] == 0)
    assert (lp[keep] - ref_lp.detach()[keep]).abs().max() <= 1e-5
    assert (ent[keep] - ref_ent.detach()[keep]).abs().max() <= 1e-5
    assert "entropy" not in model_output(model, {"input_ids": data["input_ids"]})


def test_gradients_of_a_loss_of_the_output_match_stock(model):
    gen = torch.Generator().manual_seed(0)
    ids = jagged(SEQUENCES)
    weight = torch.randn(ids.values().shape, generator=gen)
    weight[ids.offsets()[1:] - 1] = 0  # the slots verl never reads
    model.zero_grad(set_to_none=True)
    out = model_output(model, {"input_ids": ids, "temperature": TEMPERATURE, "calculate_entropy": True})
    ((out["log_probs"].values() + 0.1 * out["entropy"].values()) * weight).sum().backward()
    got = param_grads(model)
    model.zero_grad(set_to_none=True)
    lp, ent = stock_output(model, SEQUENCES, TEMPERATURE)
    ((lp + 0.1 * ent) * weight).sum().backward()
    errors = grad_relative_errors(got, param_grads(model))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{worst}: relative error {errors[worst]:.3g}"


def test_what_harts_cannot_honour_is_refused(model):
    ids = jagged(SEQUENCES)
    with pytest.raises(TypeError, match="jagged nested tensor"):
        model_output(model, {"input_ids": torch.tensor([SEQUENCES[0]])})
    with pytest.raises(ValueError, match="sequence 2: temperature 0.5 differs"):
        model_output(model, {"input_ids": ids, "temperature": torch.tensor([0.7, 0.7, 0.5, 0.7, 0.7])})
    with pytest.raises(ValueError, match="use_fused_kernels=True"):
        model_output(model, {"input_ids": ids, "use_fused_kernels": True})
    shifted = jagged([list(range(1, len(s) + 1)) for s in SEQUENCES])
    with pytest.raises(ValueError, match="position_ids at packed index 0 is 1, not 0"):
        model_output(model, {"input_ids": ids, "position_ids": shifted})
    bad = jagged([PROMPT + [500]])
    with pytest.raises(ValueError, match="trajectory 0, position 7: token id 500"):
        model_output(model, {"input_ids": bad})


# ---- the critic's values ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def critic():
    return tiny_critic("qwen3")


def stock_values(critic, sequences) -> torch.Tensor:
    """verl's critic output, one stock forward per sequence: the head at every position, packed."""
    return torch.cat([critic(input_ids=torch.tensor([s])).logits[0, :, 0] for s in sequences])


def test_value_output_is_verls_layout_with_stock_values(critic):
    ids = jagged(SEQUENCES)
    out = value_output(critic, {"input_ids": ids, "temperature": TEMPERATURE, "calculate_entropy": True})
    assert set(out) == {"values"} and out["values"].offsets().tolist() == ids.offsets().tolist()
    with torch.no_grad():
        ref = stock_values(critic, SEQUENCES)
    assert (out["values"].values() - ref).abs().max() <= 1e-5
    with torch.no_grad():  # under a budget (the critic's compute_values), part by part
        cut = value_output(critic, {"input_ids": ids}, run=RunConfig(budget_tokens=8))
    assert (cut["values"].values() - ref).abs().max() <= 1e-5


def test_gradients_of_a_loss_of_the_values_match_stock(critic):
    ids = jagged(SEQUENCES)
    weight = torch.randn(ids.values().shape, generator=torch.Generator().manual_seed(0))
    critic.zero_grad(set_to_none=True)
    (value_output(critic, {"input_ids": ids})["values"].values() ** 2 * weight).sum().backward()
    got = param_grads(critic)
    critic.zero_grad(set_to_none=True)
    (stock_values(critic, SEQUENCES) ** 2 * weight).sum().backward()
    errors = grad_relative_errors(got, param_grads(critic))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{worst}: relative error {errors[worst]:.3g}"


def test_what_the_critic_cannot_honour_is_refused(critic, model):
    ids = jagged(SEQUENCES)
    with pytest.raises(ValueError, match="the harts critic engine needs a model with a linear score head"):
        value_output(model, {"input_ids": ids})
    with pytest.raises(ValueError, match="position_ids at packed index 0 is 1, not 0"):
        value_output(
            critic,
            {"input_ids": ids, "position_ids": jagged([list(range(1, len(s) + 1)) for s in SEQUENCES])},
        )
    with pytest.raises(ValueError, match="value_output with a token budget runs without autograd"):
        value_output(critic, {"input_ids": ids}, run=RunConfig(budget_tokens=8))


# ---- with verl itself --------------------------------------------------------------------------------
def _verl_batch(agg):
    """A micro-batch as verl's actor hands ``ppo_loss`` one: its left-right padded batch (prompts
    left-padded, responses right-padded, response-aligned annotations [B, R]) turned into the
    engine's no-padding layout by verl's own ``left_right_2_no_padding``, with the global batch
    counts ``forward_backward_batch`` assigns."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.padding import left_right_2_no_padding

    gen = torch.Generator().manual_seed(1)
    prompts = [s[: len(PROMPT)] if i < len(RESPONSES) else s[:3] for i, s in enumerate(SEQUENCES)]
    responses = [s[len(p) :] for p, s in zip(prompts, SEQUENCES, strict=True)]
    batch, width_r = len(SEQUENCES), max(map(len, responses))
    fields = prompt_response_batch(prompts, responses)
    loss_mask = fields["response_mask"]
    loss_mask[1, 2] = 0  # a tool-output token inside a response
    data = TensorDict(
        {
            **fields,
            "old_log_probs": -torch.rand(batch, width_r, generator=gen) * 3,
            "advantages": torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8])[:, None].expand(batch, width_r).clone(),
        },
        batch_size=[batch],
    )  # fmt: skip
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, temperature=TEMPERATURE, calculate_entropy=True, dp_size=1,
                         batch_num_tokens=int(loss_mask.sum()), global_batch_size=batch)  # fmt: skip
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, loss_agg_mode=agg,
                         entropy_coeff=0.01)  # fmt: skip
    return data, config


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_verls_own_ppo_loss_on_harts_output_matches_stock(model, agg):
    pytest.importorskip("verl", reason="verl runs in .venv-verl (make test-verl)")
    from verl.workers.utils.losses import ppo_loss

    data, config = _verl_batch(agg)
    model.zero_grad(set_to_none=True)
    loss, _ = ppo_loss(config, model_output(model, data), data)
    loss.backward()
    got = param_grads(model)
    model.zero_grad(set_to_none=True)
    lp, ent = stock_output(model, SEQUENCES, TEMPERATURE)
    offsets = data["input_ids"].offsets()
    stock = {"log_probs": torch.nested.nested_tensor_from_jagged(lp, offsets),
             "entropy": torch.nested.nested_tensor_from_jagged(ent, offsets)}  # fmt: skip
    ref, _ = ppo_loss(config, stock, data)
    ref.backward()
    assert abs(float(loss) - float(ref)) <= 1e-5 * max(1.0, abs(float(ref))), (float(loss), float(ref))
    errors = grad_relative_errors(got, param_grads(model))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{worst}: relative error {errors[worst]:.3g}"


def test_engine_is_registered_in_verls_registry():
    pytest.importorskip("verl", reason="verl runs in .venv-verl (make test-verl)")
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    stock = EngineRegistry._engines["language_model"]["fsdp2"]["cuda"]
    engine = register_engine()
    try:
        assert register_engine() is engine
        assert issubclass(engine, FSDPEngineWithLMHead)
        assert engine.forward_step is not FSDPEngineWithLMHead.forward_step
        for backend in ("fsdp", "fsdp2"):
            assert EngineRegistry._engines["language_model"][backend]["cuda"] is engine
            assert EngineRegistry._engines["language_model"][backend]["cpu"] is engine
        assert EngineRegistry._engines["value_model"]["fsdp2"]["cuda"] is FSDPEngineWithValueHead
    finally:
        unregister_engine()
    assert EngineRegistry._engines["language_model"]["fsdp2"]["cuda"] is stock
    assert "cpu" not in EngineRegistry._engines["language_model"]["fsdp2"]


def _verl_critic_batch(critic, agg):
    """A critic micro-batch as verl's ``update_critic`` hands ``value_loss`` one: the actor's batch
    with the rollout-time ``values`` and the ``returns`` (response-aligned [B, R]), both the
    critic's own values plus noise (std twice ``cliprange_value`` and 0.3), so that the clipped
    term is the larger at some positions and not at others (both branches of verl's loss)."""
    from verl.workers.config import CriticConfig
    from verl.workers.utils.padding import no_padding_2_padding

    data, _ = _verl_batch(agg)
    with torch.no_grad():
        current = torch.nested.nested_tensor_from_jagged(
            stock_values(critic, SEQUENCES), data["input_ids"].offsets()
        )
        current = no_padding_2_padding(current, data)
    gen = torch.Generator().manual_seed(2)
    data["values"] = current + torch.randn(current.shape, generator=gen) * 0.4
    data["returns"] = current + torch.randn(current.shape, generator=gen) * 0.3
    config = CriticConfig(strategy="fsdp2", ppo_micro_batch_size_per_gpu=1, cliprange_value=0.2,
                          loss_agg_mode=agg, loss_scale_factor=16)  # fmt: skip
    return data, config


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_verls_own_value_loss_on_harts_values_matches_stock(critic, agg):
    pytest.importorskip("verl", reason="verl runs in .venv-verl (make test-verl)")
    from verl.workers.utils.losses import value_loss

    data, config = _verl_critic_batch(critic, agg)
    critic.zero_grad(set_to_none=True)
    loss, metrics = value_loss(config, value_output(critic, data), data)
    loss.backward()
    got = param_grads(critic)
    critic.zero_grad(set_to_none=True)
    stock = torch.nested.nested_tensor_from_jagged(
        stock_values(critic, SEQUENCES), data["input_ids"].offsets()
    )
    ref, ref_metrics = value_loss(config, {"values": stock}, data)
    ref.backward()
    assert 0 < metrics["critic/vf_clipfrac"] < 1  # both branches of the clipped loss
    assert metrics["critic/vf_clipfrac"] == ref_metrics["critic/vf_clipfrac"]
    assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref)), (float(loss), float(ref))
    errors = grad_relative_errors(got, param_grads(critic))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]:.3g}"


def test_critic_engine_is_registered_in_verls_registry():
    pytest.importorskip("verl", reason="verl runs in .venv-verl (make test-verl)")
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    engine = register_critic_engine()
    try:
        assert register_critic_engine() is engine
        assert issubclass(engine, FSDPEngineWithValueHead)
        assert engine.forward_backward_batch is not FSDPEngineWithValueHead.forward_backward_batch
        for backend in ("fsdp", "fsdp2"):
            assert EngineRegistry._engines["value_model"][backend]["cuda"] is engine
            assert EngineRegistry._engines["value_model"][backend]["cpu"] is engine
        assert EngineRegistry._engines["language_model"]["fsdp2"]["cuda"] is FSDPEngineWithLMHead
        actor = register_engine()
        assert EngineRegistry._engines["language_model"]["fsdp2"]["cuda"] is actor
    finally:
        unregister_engine()
    assert EngineRegistry._engines["value_model"]["fsdp2"]["cuda"] is FSDPEngineWithValueHead
    assert EngineRegistry._engines["language_model"]["fsdp2"]["cuda"] is FSDPEngineWithLMHead
    assert "cpu" not in EngineRegistry._engines["value_model"]["fsdp2"]
