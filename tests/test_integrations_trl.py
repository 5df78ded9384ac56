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

The budgeted step and the two-process runs (DDP over gloo, the model wrapped by accelerate as
``accelerate launch`` wraps it) turn gradient clipping off, so that a gradient off by a factor
(a missed mean over the ranks, a normaliser of the wrong process) moves the parameters by a
different amount instead of being clipped to the same norm. The two processes also run a tiny MoE
model with TRL's load-balancing loss (``router_aux_loss_coef``); the one-process MoE runs are in
tests/test_integrations_trl_moe.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trl  # the dev extra installs it: a missing TRL fails here, it is never skipped
from datasets import Dataset  # a TRL dependency
from transformers import GPT2Config, GPT2LMHeadModel

from harts import RunConfig
from harts.integrations.trl import GRPOTrainer
from harts.tiny import tiny_model
from tests.reference import GRAD_FLOOR, GRAD_RTOL, LOGIT_ATOL, grad_relative_errors
from tests.trl_worker import PROMPTS, VARIANTS, Recorder, config, tokenizer, train

# TRL's aux loss from harts' routers against the stock forward's: a sum of fp32 products over the
# tokens and experts, within 1e-5 relative (tests/test_moe_stats.py)
AUX_RTOL = 1e-5

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    tiny_model("qwen3", seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    tiny_model("qwen3_moe", seed=0).save_pretrained(path)
    return path


def parameter_gaps(tree: list[dict], stock: list[dict]) -> dict[str, float]:
    """Per parameter, the largest over the steps of ``||tree_k - stock_k||`` over its bound.

    Each SGD update is the learning rate times the gradient, and each of harts' gradients is
    within ``GRAD_RTOL`` (relative, fp32) of stock's: the parameters after step k differ by at
    most ``GRAD_RTOL`` times the sum of the norms of stock's updates up to k (each step's error
    adds to the last's). A ratio above 1 fails.
    """
    worst = {n: 0.0 for n in stock[0]}
    moved = {n: 0.0 for n in stock[0]}
    for k in range(1, len(stock)):
        for n in stock[0]:
            moved[n] += float((stock[k][n] - stock[k - 1][n]).norm())
            gap = float((tree[k][n] - stock[k][n]).norm())
            worst[n] = max(worst[n], gap / (GRAD_RTOL * max(moved[n], GRAD_FLOOR)))
    return worst


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


def test_budgeted_step_matches_stock_trl(model_dir, tmp_path):
    """A token budget that cuts every group's tree into parts: TRL's loss ("bnpo", with the KL
    term and the entropy bonus) runs once on every row's value, each part's backward seeded with
    its gradient; the parameters follow stock TRL's step by step, and TRL logs the same metrics."""
    args = {"loss_type": "bnpo", "entropy_coef": 0.01, "max_grad_norm": 0.0}
    stock_trainer, stock_completions, stock = train(trl.GRPOTrainer, model_dir, tmp_path / "stock", args)
    trainer, harts_completions, tree = train(
        GRPOTrainer, model_dir, tmp_path / "harts", args, harts_run=RunConfig(budget_tokens=8)
    )
    assert stock_completions and harts_completions == stock_completions, "both runs must sample the same"
    assert trainer._harts_result.num_micro_batches > 4 and trainer._harts_result.num_cuts > 0
    assert len(tree) == len(stock) == 3
    assert max(float((stock[2][n] - stock[0][n]).abs().max()) for n in stock[0]) > 1e-3, "nothing moved"
    gaps = parameter_gaps(tree, stock)
    worst = max(gaps, key=gaps.get)
    assert gaps[worst] <= 1, f"{worst}: {gaps[worst]:.3g} of the bound"
    # TRL's metrics, logged by TRL from the values harts supplied: a log-softmax is off by at most
    # twice its logits' error, and so are the means of the loss, KL and entropy; the gradient norm
    # is within the gradients' bound
    logs = [(a, b) for a, b in zip(stock_trainer.state.log_history, trainer.state.log_history, strict=True)
            if "kl" in a]  # fmt: skip
    assert len(logs) == 2
    for want, got in logs:
        assert set(got) == set(want)
        for name in ("loss", "kl", "entropy"):
            assert abs(got[name] - want[name]) <= 2 * LOGIT_ATOL, (name, got[name], want[name])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= GRAD_RTOL * want["grad_norm"]


def _env(home: Path) -> dict:
    """The launch's environment: one thread a process, harts from this checkout, and an empty
    Hugging Face home, so that no accelerate config of the machine changes the launch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}",
           "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_match_stock_trl(model_dir, moe_dir, tmp_path):
    """Two real processes under ``accelerate launch`` (gloo), accelerate's MULTI_CPU with the
    model wrapped in DDP: harts' drop-in runs the wrapped module and sums the gradients over the
    ranks itself, and the parameters and TRL's logged losses equal stock TRL's under the same
    launch and seed: "dapo" (normalised by every process's completion tokens) over two accumulated
    micro-batches, and "grpo" under a budget; each on the dense model and on the MoE one with
    TRL's load-balancing loss (each process's own, as stock DDP averages it). Every run has
    ``beta > 0`` (the reference model's pass, the KL term) and ``num_iterations=2`` (the old
    log-probs' pass; the second step reuses the first's completions, its ratios away from 1)."""
    # accelerate's --cpu starts one process unless given an MPI hostfile; --multi_gpu starts them
    # with torch.distributed.run, and TRL's use_cpu=True makes them MULTI_CPU ranks over gloo
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2",
               "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no",
               f"--main_process_port={_free_port()}", str(HERE / "trl_worker.py"), str(model_dir),
               str(moe_dir), str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=_env(tmp_path / "hf"), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for name, (_, budget, moe) in VARIANTS.items():
        for rank, results in enumerate(ranks):
            stock, tree = results[f"{name}/stock"], results[f"{name}/harts"]
            assert stock["wrapper"] == tree["wrapper"] == "DistributedDataParallel", (name, rank)
            assert stock["num_processes"] == tree["num_processes"] == 2
            assert stock["completions"] and tree["completions"] == stock["completions"], (name, rank)
            assert tree["micro_batches"] > (1 if budget else 0), (name, rank)
            assert len(tree["params"]) == len(stock["params"]) == 3
            gaps = parameter_gaps(tree["params"], stock["params"])
            worst = max(gaps, key=gaps.get)
            assert gaps[worst] <= 1, f"{name}, rank {rank}, {worst}: {gaps[worst]:.3g} of the bound"
            check_logs(stock["logs"], tree["logs"], moe, f"{name}, rank {rank}")
        # each rank sampled its own completions, and DDP kept the ranks' parameters equal
        assert ranks[0][f"{name}/stock"]["completions"] != ranks[1][f"{name}/stock"]["completions"]
        for n, p in ranks[0][f"{name}/harts"]["params"][-1].items():
            assert torch.equal(p, ranks[1][f"{name}/harts"]["params"][-1][n]), (name, n)
    for results in ranks:  # a gradient compression hook harts' own sum would skip: refused
        assert "the DDP model has a communication hook" in results["comm_hook"], results["comm_hook"]


def check_logs(stock: list[dict], tree: list[dict], aux: bool, where: str) -> None:
    """TRL's logs of the two steps, stock's and harts': the same keys; the loss and KL within twice
    the logits' error (a log-softmax is off by at most twice its logits' error, and so are the
    means of its terms); the aux loss (MoE runs) within its own relative bound. The second step's
    KL is above 0 (the policy left the reference model)."""
    assert len(stock) == len(tree) == 2, where
    for want, got in zip(stock, tree, strict=True):
        assert set(got) == set(want), (where, set(got) ^ set(want))
        for name in ("loss", "kl"):
            assert abs(got[name] - want[name]) <= 2 * LOGIT_ATOL, (where, name, got[name], want[name])
        assert ("aux_loss" in want) == aux, where
        if aux:
            assert want["aux_loss"] > 0, where
            assert abs(got["aux_loss"] - want["aux_loss"]) <= AUX_RTOL * want["aux_loss"], where
    assert stock[1]["kl"] > 1e-3, where


def test_unsupported_setups_are_refused(model_dir, tmp_path):
    gpt2_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=128)).save_pretrained(gpt2_dir)
    with pytest.raises(ValueError, match="harts does not run model family 'gpt2'"):
        train(GRPOTrainer, gpt2_dir, tmp_path)
    # bf16 runs (tests/test_integrations_trl_bf16.py); fp16, and a head TRL would run outside autocast, not
    refused = {
        "mixed precision 'fp16'": {"bf16": False, "fp16": True},
        "cast_lm_head_to_fp32=True under bf16": {"bf16": True, "cast_lm_head_to_fp32": True},
    }
    for match, precision in refused.items():
        with pytest.raises(ValueError, match=match):
            GRPOTrainer(
                model=str(model_dir), reward_funcs=Recorder(), args=config(tmp_path, **precision),
                processing_class=tokenizer(), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            )  # fmt: skip


def test_the_first_step_verifies_itself_and_can_be_told_not_to(model_dir, tmp_path):
    """``harts_verify`` (on by default): the first training step checks a sample of its batch
    against the stock forward; a tree-attention kernel off by 1e-3 in backward only is caught
    before any update, and with ``harts_verify=False`` the same run trains."""
    from harts import VerificationError
    from harts.ops.backends import register_backend
    from tests.test_verify import _faulty

    register_backend("trl-off-in-backward", _faulty(1.0, 1.001))
    faulty = RunConfig(backend="trl-off-in-backward")
    with pytest.raises(VerificationError, match=r"TRL's GRPOTrainer step failed \(fp32\).*parameter"):
        train(GRPOTrainer, model_dir, tmp_path / "checked", harts_run=faulty)
    _, _, params = train(GRPOTrainer, model_dir, tmp_path / "unchecked", harts_run=faulty, harts_verify=False)
    assert len(params) == 3  # two optimizer steps ran
