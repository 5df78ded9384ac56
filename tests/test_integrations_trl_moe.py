"""TRL's MoE load-balancing loss (``router_aux_loss_coef``) through harts' drop-in, on one process.

TRL adds ``router_aux_loss_coef * aux_loss / gradient_accumulation_steps`` to its loss, where
``aux_loss`` is the stock forward's Switch loss (transformers' ``load_balancing_loss_func``) over
the padded prompt + completion batch, the attention mask weighting each token. That is a sum over
the batch's tokens, so harts computes it exactly from its forest's routers, each unique token
weighted by its multiplicity. The tests run TRL's loop on a tiny qwen3_moe model as
tests/test_integrations_trl.py does on a dense one (SGD, ``beta > 0``, ``num_iterations=2``),
stock and through harts, unbudgeted (TRL's backward through harts' log-probs and aux loss) and
under a token budget (harts' step, the aux loss's gradient added part by part); the two-process
runs are in tests/test_integrations_trl.py.
"""

from __future__ import annotations

import pytest
import trl
from datasets import Dataset

from harts import RunConfig
from harts.integrations.trl import GRPOTrainer
from harts.tiny import tiny_model
from tests.reference import GRAD_RTOL, grad_relative_errors
from tests.test_integrations_trl import check_logs
from tests.trl_worker import AUX_COEF, PROMPTS, Recorder, config, tokenizer, train


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    tiny_model("qwen3_moe", seed=0).save_pretrained(path)
    return path


def _updates(params: list[dict], step: int) -> dict:
    return {n: params[step][n] - params[step - 1][n] for n in params[0]}


def test_moe_aux_loss_matches_stock_trl(moe_dir, tmp_path):
    """Each step's parameter update (SGD: the learning rate times the gradient) within the fp32
    gradient tolerance of stock TRL's, per tensor, with and without a token budget; TRL's logged
    loss, KL and aux loss equal stock's. Without clipping, so that a wrong weight of the aux term
    moves the parameters differently; the aux term moves the routers' updates far more than the
    tolerance (stock with ``router_aux_loss_coef=0`` for comparison)."""
    args = {"max_grad_norm": 0.0, "router_aux_loss_coef": AUX_COEF}
    stock_trainer, stock_completions, stock = train(trl.GRPOTrainer, moe_dir, tmp_path / "stock", args)
    _, plain_completions, plain = train(
        trl.GRPOTrainer, moe_dir, tmp_path / "plain", {**args, "router_aux_loss_coef": 0.0}
    )
    assert plain_completions == stock_completions  # the first step samples before any update
    routers = [n for n in stock[0] if n.endswith("mlp.gate.weight")]
    assert routers
    without_aux = grad_relative_errors(_updates(plain, 1), _updates(stock, 1))
    assert min(without_aux[n] for n in routers) > 100 * GRAD_RTOL, "the aux term must move the routers"

    for label, run in (("unbudgeted", None), ("budget", RunConfig(budget_tokens=8))):
        trainer, completions, tree = train(GRPOTrainer, moe_dir, tmp_path / label, args, harts_run=run)
        assert trainer.aux_loss_enabled and completions == stock_completions, label
        if run is not None:  # the forest was cut: the aux term's gradient added part by part
            assert trainer._harts_result.num_micro_batches > 4 and trainer._harts_result.num_cuts > 0
        assert len(tree) == len(stock) == 3
        for step in (1, 2):
            errors = grad_relative_errors(_updates(tree, step), _updates(stock, step))
            worst = max(errors, key=errors.get)
            assert errors[worst] <= GRAD_RTOL, f"{label}, step {step}, {worst}: {errors[worst]:.3g}"
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        check_logs([e for e in stock_trainer.state.log_history if "loss" in e], logs, True, label)


def test_moe_aux_loss_refusals(moe_dir, tmp_path):
    """A negative weight (harts' load-balancing term only adds a positive one) and a family that
    balances its experts by router bias, which has no Switch loss to add."""

    def build(model, **overrides):
        return GRPOTrainer(
            model=str(model), reward_funcs=Recorder(), args=config(tmp_path, **overrides),
            processing_class=tokenizer(), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )  # fmt: skip

    with pytest.raises(ValueError, match=r"router_aux_loss_coef=-0.1: .* positive weight"):
        build(moe_dir, router_aux_loss_coef=-0.1)
    bias_dir = tmp_path / "deepseek_v3"
    tiny_model("deepseek_v3", seed=0).save_pretrained(bias_dir)
    # harts refuses it; a transformers whose deepseek_v3 config has no output_router_logits (5.10)
    # makes TRL refuse it first
    refused = "balances experts by router bias|not a Mixture-of-Experts model that returns its router logits"
    with pytest.raises(ValueError, match=refused):
        build(bias_dir, router_aux_loss_coef=0.01)
    assert not build(bias_dir).aux_loss_enabled  # its config declares no coefficient: nothing to add
