"""TRL's GRPO loop under bf16 mixed precision (``GRPOConfig(bf16=True)``: fp32 parameters, the
forward under accelerate's CPU autocast), stock and through harts' drop-in, each judged against
stock TRL's fp32 run of the same batches.

bf16 changes the rounding, so harts cannot equal stock to fp32 precision; it must be a computation
of the same rounding class, no farther from the truth than stock is (tests/precision.py and
tests/test_autocast.py give the bounds and why): per log-prob pass, max |harts - truth| <=
2 max |stock - truth| + 2 ulp_bf16(max |log-prob|); per optimizer step, the relative error of the
whole parameter update (SGD: the learning rate times the gradient) <= 2 x stock's + 4u, u = 2^-8.
The fp32 truth's own error is about 2^-16 of bf16's, far inside the 4u.

The three runs must score the same completions, but sampling under bf16 and fp32 can differ; so
TRL's ``rollout_func`` hands every run the same seeded completions (TRL's generation is not what
is tested here; tests/test_integrations_trl.py runs it). A hook on an MLP projection of the policy
and of the reference model records the dtype its output had in every forward: bf16 in both bf16
runs shows that harts' forward ran under the autocast, not in fp32 (which would be closer to the
truth and pass the bounds). The learning rate is small enough that no ratio reaches the clipping
range (checked from TRL's logs): a clip decided on either side of 1 +- epsilon by rounding is a
discontinuity, not arithmetic.
"""

from __future__ import annotations

import random

import pytest
import torch
import trl
from datasets import Dataset  # a TRL dependency

from harts import RunConfig
from harts.integrations.trl import GRPOTrainer
from harts.tiny import tiny_model
from tests.precision import UNIT_ROUNDOFF, global_relative_error, ulp
from tests.trl_worker import PROMPTS, Recorder, Snapshots, config, tokenizer

BF16 = torch.bfloat16
U = UNIT_ROUNDOFF[BF16]
# no gradient clipping (a wrong scale must show); ratios stay far inside 1 +- 0.2 at this rate
BASE = {"learning_rate": 0.001, "max_grad_norm": 0.0}
VARIANTS = {  # TRL's config overrides and harts' token budget
    "plain": ({}, None),  # TRL's loss backpropagates through harts' log-probs
    "budget": ({"loss_type": "bnpo", "entropy_coef": 0.01}, 8),  # harts' step, TRL's loss on its rows
}


def rollout(prompts, trainer):
    """The same completions for every run: 1-6 tokens per (repeated) prompt, seeded by the batch."""
    tok = tokenizer()
    rng = random.Random(",".join(prompts))
    completions = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 6))] for _ in prompts]
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


class Recording:
    """Records every log-prob pass TRL asks for (the old, reference and policy passes) and the dtype
    of one MLP projection's output in every forward of the policy and the reference model."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **k):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *a, **k
        )
        mask = attention_mask[:, -logits_to_keep:].bool()
        self.passes.append((logps.dtype, logps.detach()[mask].double()))
        return logps, entropies, aux


def _hook_dtypes(model, seen: list) -> None:
    proj = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.down_proj"))
    proj.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))


class StockRun(Recording, trl.GRPOTrainer):
    pass


class HartsRun(Recording, GRPOTrainer):
    pass


def run(trainer_class, model_dir, out_dir, bf16: bool, overrides: dict, **kwargs):
    """(trainer, log-prob passes, parameter snapshots, projection dtypes seen) of one seeded run."""
    snaps = Snapshots()
    trainer = trainer_class(
        model=str(model_dir), reward_funcs=Recorder(), processing_class=tokenizer(), callbacks=[snaps],
        args=config(out_dir, bf16=bf16, **BASE, **overrides), rollout_func=rollout,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), **kwargs,
    )  # fmt: skip
    trainer.passes, seen = [], []
    for model in (trainer.model, trainer.ref_model):
        _hook_dtypes(model, seen)
    torch.manual_seed(0)
    trainer.train()
    return trainer, trainer.passes, snaps.params, seen


def updates(params: list[dict]) -> list[dict]:
    return [{n: b[n] - a[n] for n in a} for a, b in zip(params[:-1], params[1:], strict=True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    tiny_model("qwen3", seed=0).save_pretrained(path)
    return path


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_grpo_no_worse_than_stock_trl(variant, model_dir, tmp_path):
    overrides, budget = VARIANTS[variant]
    truth = run(StockRun, model_dir, tmp_path / "fp32", False, overrides)
    stock = run(StockRun, model_dir, tmp_path / "stock", True, overrides)
    harts_run = RunConfig(budget_tokens=budget)
    # the dtypes seen are the step's: the first step's check against the stock forward (its own
    # fp32 truth run) is off here; tests/test_verify.py and harts.bench.verify_families cover it
    tree = run(HartsRun, model_dir, tmp_path / "harts", True, overrides, harts_run=harts_run,
               harts_verify=False)
    trainer = tree[0]
    assert trainer.accelerator.mixed_precision == "bf16" and trainer.accelerator.native_amp
    assert trainer._harts_redundancy > 1.3, "the groups' prompts ran once"
    if budget is not None:
        assert trainer._harts_result.num_micro_batches > 4 and trainer._harts_result.num_cuts > 0
    # the bf16 runs' forwards ran under autocast (the projection's output is bf16), the truth's not
    assert stock[3] and set(stock[3]) == {BF16}
    assert tree[3] and set(tree[3]) == {BF16}, set(tree[3])
    assert truth[3] and set(truth[3]) == {torch.float32}
    # no ratio was clipped in any run (module docstring)
    for t in (truth[0], stock[0], tree[0]):
        assert all(log.get("clip_ratio/region_mean", 0) == 0 for log in t.state.log_history)

    # every log-prob pass: the old and reference passes at generation, the policy's at each step
    passes = list(zip(truth[1], stock[1], tree[1], strict=True))
    assert len(passes) == 4
    for i, ((_, exact), (dtype_s, lp_s), (dtype_h, lp_h)) in enumerate(passes):
        assert dtype_s == dtype_h == torch.float32
        theirs, mine = (lp_s - exact).abs().max().item(), (lp_h - exact).abs().max().item()
        bound = 2 * theirs + 2 * ulp(exact.abs().max().item(), BF16)
        assert mine <= bound, f"pass {i}: log-prob error {mine:.3g} > {bound:.3g} (stock {theirs:.3g})"

    # every optimizer step's update (SGD: lr x gradient)
    steps = list(zip(updates(truth[2]), updates(tree[2]), updates(stock[2]), strict=True))
    assert len(steps) == 2
    for k, (exact, ours, theirs) in enumerate(steps):
        assert max(u.abs().max() for u in exact.values()) > 1e-4, "the step moved the parameters"
        mine, stock_error = global_relative_error(ours, exact), global_relative_error(theirs, exact)
        bound = 2 * stock_error + 4 * U
        assert mine <= bound, f"step {k + 1}: update error {mine:.3g} > {bound:.3g} (stock {stock_error:.3g})"
