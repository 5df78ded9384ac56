"""TRL's own GRPO loop, once stock and once with harts' GRPOTrainer, on a tiny model and an
in-memory dataset (CPU, fp32): the same completions sampled, and after every optimizer step the
same parameters.

Both runs start from one saved model and one seed, so TRL samples the same completions as long
as the models agree; the test records the completions each run's reward function sees and
checks they are equal before comparing parameters. Plain SGD makes each parameter update the
learning rate times the gradient, so the per-tensor relative error of the updates is the
gradients' (Adam would normalise away the scale and amplify the noise of near-zero gradients).
Two iterations per generation (``num_iterations=2``) put the old log-probs (a no-grad pass) and
ratios away from 1 on the second step; ``beta > 0`` the reference model's pass and the KL term.
"""

from __future__ import annotations

import pytest
import torch
import trl  # the dev extra installs it: a missing TRL fails here, it is never skipped
from datasets import Dataset  # a TRL dependency
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback

from harts.integrations.trl import GRPOTrainer
from harts.testing import tiny_model
from tests.reference import GRAD_RTOL, grad_relative_errors

PROMPTS = ["t10 t11 t12 t13 t14 t15 t16", "t20 t21 t22", "t30 t31 t32 t33", "t40 t41"]


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' 128 ids ("t0" .. "t127"): nothing to download."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


class Recorder:
    """A reward function (share of even token ids) that records the completions it scores."""

    __name__ = "even_tokens"

    def __init__(self):
        self.completions: list[list[list[int]]] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.completions.append([list(c) for c in completion_ids])
        return [sum(t % 2 == 0 for t in c) / max(1, len(c)) for c in completion_ids]


class Snapshots(TrainerCallback):
    def __init__(self):
        self.params: list[dict[str, torch.Tensor]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


def config(tmp_path, **overrides):
    args = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=5, max_steps=2, num_iterations=2, learning_rate=0.5, optim="sgd",
        beta=0.04, bf16=False, report_to="none", use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
        logging_steps=1, model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    args.update(overrides)
    return trl.GRPOConfig(**args)


def train(trainer_class, model_dir, tmp_path, **kwargs):
    reward, snaps = Recorder(), Snapshots()
    trainer = trainer_class(
        model=str(model_dir), reward_funcs=reward, args=config(tmp_path), processing_class=tokenizer(),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=[snaps], **kwargs,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.train()
    return trainer, reward.completions, snaps.params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    tiny_model("qwen3", seed=0).save_pretrained(path)
    return path


def test_grpo_loop_matches_stock_trl_step_by_step(model_dir, tmp_path):
    _, stock_completions, stock = train(trl.GRPOTrainer, model_dir, tmp_path)
    trainer, harts_completions, tree = train(GRPOTrainer, model_dir, tmp_path)
    assert stock_completions and harts_completions == stock_completions, "both runs must sample the same"
    assert len(tree) == len(stock) == 3  # the start and two optimizer steps
    # the 4 generations of a prompt share it: the batch ran as a forest with fewer unique tokens
    assert trainer._harts_redundancy > 1.3, trainer._harts_redundancy
    for step in (1, 2):
        stock_update = {n: stock[step][n] - stock[step - 1][n] for n in stock[0]}
        tree_update = {n: tree[step][n] - tree[step - 1][n] for n in stock[0]}
        assert max(u.abs().max() for u in stock_update.values()) > 1e-3, "the step moved the parameters"
        errors = grad_relative_errors(tree_update, stock_update)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= GRAD_RTOL, f"step {step}, {worst}: relative error {errors[worst]:.3g}"


def test_unsupported_setups_are_refused(model_dir, tmp_path):
    gpt2_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=128)).save_pretrained(gpt2_dir)
    with pytest.raises(ValueError, match="harts does not run model family 'gpt2'"):
        train(GRPOTrainer, gpt2_dir, tmp_path)
    with pytest.raises(ValueError, match="mixed precision 'bf16'"):
        GRPOTrainer(
            model=str(model_dir), reward_funcs=Recorder(), args=config(tmp_path, bf16=True),
            processing_class=tokenizer(), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )  # fmt: skip
    from harts import RunConfig

    with pytest.raises(ValueError, match="budget_tokens is not supported under TRL"):
        train(GRPOTrainer, model_dir, tmp_path, harts_run=RunConfig(budget_tokens=8))
