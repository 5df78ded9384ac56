"""``[critic]``: PPO with a learned critic and GAE in ``harts train``, exact, resumable, refused when wrong.

- One update of a real run equals the update written by hand with the Python API from the same
  starting weights, bit for bit: the critic's values (``harts.forward_values``), GAE's advantages
  and returns (``harts.gae_advantages``), the policy's step (``harts.rollout_step``, gradient
  clipping, ``torch.optim.AdamW`` with weight decay on tensors of two or more dimensions), the
  critic's (``harts.value_step``, clipping, its AdamW). The same operations on the same bits
  give the same bits, so the bound is 0; the check can fail (both models move by far more than
  a unit in the last place). For ``qwen3`` the critic is a stock ``Qwen3ForTokenClassification``
  directory; for ``bailing_hybrid`` (no token-classification class in transformers)
  ``"policy"``, checked against ``harts.ValueHead`` built by hand over the starting weights.
- A run killed between the two updates of a step (``[ppo]`` mini-batches) resumes to the bytes of
  an uninterrupted run: policy, critic, optimizer states, metrics.
- Misconfigurations are refused before step 1, in one line naming the key.

Everything runs in fp32 on one thread (``one_thread``), as the checkpoints' bit-identity needs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

import harts
from harts.objectives.advantages import advantages_to_rollouts
from harts.tiny import FAMILIES, tiny_config, tiny_model
from harts.trainer.checkpoint import list_checkpoints
from harts.trainer.config_files import load_config
from harts.trainer.critic import CRITIC_DIR, VALUE_HEAD_ARCHITECTURE, load_critic
from harts.trainer.inputs import own_memory, rollout_steps
from harts.trainer.loop import train
from tests.helpers import (
    ROOT,
    group_spans,
    kill_after,
    one_thread,  # noqa: F401 (autouse: one thread)
    run_train,
    write_config,
    write_small_rollouts,
)

LR, CRITIC_LR, BUDGET, CLIP, SHUFFLE_SEED = 1e-2, 1e-3, 24, 0.5, 8
GAE = {"gamma": 0.99, "lam": 0.9}
# a token classifier, and a family without one (harts.ValueHead)
FORMS = [pytest.param("qwen3", id="token-classifier"), pytest.param("bailing_hybrid", id="value-head")]


def _critic_config():
    """The stock critic of these tests: one label, no classifier dropout."""
    return tiny_config("qwen3", num_labels=1, classifier_dropout=0.0)


def _needs(family):
    if family not in FAMILIES:
        pytest.skip(f"{family}: not in the installed transformers")


def _config(tmp_path, family, top=None, **sections):
    data = write_small_rollouts(tmp_path / "small.jsonl")  # 6 groups of 3: two steps of 3 groups
    tables = dict(
        model={"tiny": family},
        data={"path": str(data), "rollouts_per_step": 9},
        objective={"kind": "ppo", "advantage": "gae", "advantage_params": GAE},
        critic={"model": "policy", "lr": CRITIC_LR, "weight_decay": 0.1, "max_grad_norm": 0.5},
        run={"budget_tokens": BUDGET},
        optimizer={"lr": LR, "weight_decay": 0.1},
        checkpoint={"every": 1, "keep_last": 100},
        logging={"plot": False},
    )
    for name, table in sections.items():  # None drops a section (and a key of None its key)
        tables[name] = None if table is None else {**tables.get(name, {}), **table}
    tables = {name: table for name, table in tables.items() if table is not None}
    return write_config(tmp_path / "run.toml", {"steps": 1, "max_grad_norm": 1.0, **(top or {})}, tables)


def _adamw(model, lr, weight_decay):
    """The optimizer as docs/training.md states it: AdamW, weight decay on tensors of 2+ dimensions."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay, rest = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr), decay + rest


def _step(optimizer, params, max_norm):
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _stock_critic(tmp_path, seed=3):
    """A stock Qwen3ForTokenClassification (one label, no classifier dropout) saved as a directory."""
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(_critic_config())
    with torch.no_grad():
        model.score.bias.fill_(0.2)  # stock starts it at 0: reading it is tested
    model.save_pretrained(tmp_path / "critic0")
    return tmp_path / "critic0"


def _with_gae(critic, rollouts):
    """The step's rollouts with the critic's values and GAE's advantages and returns, by hand."""
    values = harts.forward_values(critic, rollouts, budget_tokens=BUDGET).values
    rollouts = [dataclasses.replace(r, values=v.detach()) for r, v in zip(rollouts, values, strict=True)]
    forest = harts.build_forest([r.tokens for r in rollouts])
    rows = harts.build_loss_rows(forest, rollouts)
    advantages, returns = harts.gae_advantages(rows, **GAE)
    return advantages_to_rollouts(rollouts, rows, advantages, returns)


def _ppo_epoch_order(rollouts, epoch: int) -> list:
    """The step's groups in PPO epoch ``epoch``'s order (one mini-batch), as docs/training.md says."""
    spans = group_spans(rollouts)
    order = np.random.default_rng([SHUFFLE_SEED, 0, 0, epoch]).permutation(len(spans))
    return [rollouts[i] for g in order for i in spans[g]]


@pytest.mark.parametrize("family", FORMS)
def test_updates_equal_the_python_api_by_hand(tmp_path, family):
    """Two PPO epochs over one step (its values and GAE once, before the first): each update's
    policy and critic equal the Python API's by hand, bit for bit; the second update's value
    loss is clipped on some rows (its values moved away from the step's rollout-time ones)."""
    _needs(family)
    stock = family == "qwen3"
    critic_table = {"model": str(_stock_critic(tmp_path))} if stock else {}
    config = _config(tmp_path, family, critic=critic_table,
                     ppo={"epochs": 2, "old_logprobs": "rollout", "shuffle_seed": SHUFFLE_SEED})  # fmt: skip
    out = tmp_path / "out"
    assert run_train(config, out) == 0
    loaded = load_config(config)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    policy = tiny_model(family, seed=0).train()
    if stock:  # the directory as the run loads it: into memory of its own (aligned, as the run's)
        critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic0")
        own_memory(critic)
    else:  # "policy": the starting weights again under a fresh head seeded by the run's seed
        lm = tiny_model(family, seed=0).train()
        torch.manual_seed(0)
        critic = harts.ValueHead(lm)
    critic.train()
    start_policy = {k: v.clone() for k, v in policy.state_dict().items()}
    start_critic = {k: v.clone() for k, v in critic.state_dict().items()}
    step = _with_gae(critic, next(iter(rollout_steps(loaded.data))))
    optimizer, params = _adamw(policy, LR, 0.1)
    critic_optimizer, critic_params = _adamw(critic, CRITIC_LR, 0.1)
    for epoch in range(2):
        rollouts = _ppo_epoch_order(step, epoch)
        result = harts.rollout_step(policy, rollouts, loaded.objective.loss_config(), budget_tokens=BUDGET)
        _step(optimizer, params, 1.0)
        value = harts.value_step(critic, rollouts, harts.ValueLossConfig(clip=CLIP), budget_tokens=BUDGET)
        _step(critic_optimizer, critic_params, 0.5)

        saved = out / "checkpoints" / f"step-{epoch + 1:06d}"
        run_policy = AutoModelForCausalLM.from_pretrained(saved).state_dict()
        run_critic = _stock_load(saved / CRITIC_DIR, stock).state_dict()
        hand_policy, hand_critic = policy.state_dict(), critic.state_dict()
        assert set(run_critic) == set(hand_critic)
        for run, hand in ((run_policy, hand_policy), (run_critic, hand_critic)):
            differ = [k for k in run if not torch.equal(run[k], hand[k])]
            assert not differ, (epoch, differ[:5])
        record = records[epoch]
        assert record["loss"] == float(result.loss)
        for name in ("value_loss", "value_clip_fraction", "value_mean", "explained_variance"):
            assert record[name] == float(value.metrics[name]), name
    # the check can fail: both models moved; the second update clipped some value rows, not all
    for hand, start in ((hand_policy, start_policy), (hand_critic, start_critic)):
        assert all(not torch.equal(hand[k], start[k]) for k in hand if k.endswith("proj.weight"))
    assert records[0]["value_clip_fraction"] == 0 and 0 < records[1]["value_clip_fraction"] < 1

    if not stock:
        assert AutoConfig.from_pretrained(saved / CRITIC_DIR).architectures == [VALUE_HEAD_ARCHITECTURE]


def _stock_load(directory, token_classifier: bool):
    """A checkpoint's critic loaded with no harts code but the ValueHead wrapper (module docstring of
    harts.trainer.critic)."""
    if token_classifier:
        return AutoModelForTokenClassification.from_pretrained(directory)
    critic = harts.ValueHead(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)))
    critic.load_state_dict(load_file(directory / "model.safetensors"))
    return critic


def test_policy_critic_is_the_starting_backbone_under_a_fresh_head(tmp_path):
    """``critic.model = "policy"`` for a family with a token classifier: the stock class, its
    backbone the policy's starting weights, its head stock-initialised from the seed."""
    _needs("qwen3")
    config = load_config(_config(tmp_path, "qwen3", critic={"seed": 7}))
    critic = load_critic(config.critic, config.model, config.seed)
    torch.manual_seed(7)
    hand = AutoModelForTokenClassification.from_config(_critic_config())
    hand.model.load_state_dict(tiny_model("qwen3", seed=0).model.state_dict())
    assert type(critic) is type(hand) and critic.training and critic.config.num_labels == 1
    assert all(torch.equal(v, hand.state_dict()[k]) for k, v in critic.state_dict().items())


@pytest.mark.parametrize("family", FORMS)
def test_a_kill_between_updates_resumes_to_the_same_bytes(tmp_path, family, capsys):
    """SIGKILL after update 1 of step 1 (two mini-batches a step, 4 updates): the resume takes the
    step's critic values (and old log-probs) from the checkpoint and ends with the bytes of an
    uninterrupted run: policy, critic, optimizer and schedule states, metrics."""
    _needs(family)
    config = _config(tmp_path, family, {"steps": 2}, ppo={"mini_batches": 2},
                     schedule={"kind": "cosine", "warmup_steps": 1})  # fmt: skip
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    kill_after(config, killed, "step-000001")
    for c in list_checkpoints(killed / "checkpoints"):  # as if the kill landed right after update 1
        if c.step > 1:
            shutil.rmtree(c.path)
    state = json.loads((killed / "checkpoints" / "step-000001" / "state.json").read_text())["position"]
    assert (state["step"], state["mini_batch"]) == (1, 1)
    saved = torch.load(killed / "checkpoints" / "step-000001" / "trainer_state.pt", weights_only=True)
    assert len(saved["critic_values"]) == 9 and "critic" in saved
    assert run_train(config, killed, "--resume") == 0
    assert "resuming from" in capsys.readouterr().err
    assert run_train(config, straight) == 0
    final = "checkpoints/step-000004"
    for name in ("model.safetensors", f"{CRITIC_DIR}/model.safetensors", f"{CRITIC_DIR}/config.json",
                 "trainer_state.pt"):  # fmt: skip
        assert (killed / final / name).read_bytes() == (straight / final / name).read_bytes(), name
    records = [[json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
               for d in (killed, straight)]  # fmt: skip
    keys = ("loss", "value_loss", "explained_variance", "critic_grad_norm", "critic_lr", "grad_norm")
    assert [[r[k] for k in keys] for r in records[0]] == [[r[k] for k in keys] for r in records[1]]
    assert len(records[0]) == 4
    assert "critic_values" not in torch.load(straight / final / "trainer_state.pt", weights_only=True)


@pytest.mark.parametrize(
    "top, sections, expected",
    [
        ({}, {"critic": None}, "objective.advantage: gae needs a critic's values at every token: add a"),
        ({}, {"objective": {"advantage": None, "advantage_params": None}},
         "critic: objective.advantage is not set; only gae reads the critic's values"),
        ({}, {"objective": {"advantage": "grpo", "advantage_params": None}},
         "critic: objective.advantage is 'grpo', which reads no critic"),
        ({}, {"objective": {"kind": "sft"}}, "critic: objective.kind = 'sft' reads no advantages"),
        ({}, {"critic": {"momentum": 0.9}}, "critic.momentum: unknown key in [critic]; valid keys: model,"),
        ({}, {"critic": {"model": None}}, "critic.model: required key missing in [critic]"),
        ({}, {"critic": {"value_clip": -1.0}}, "critic.value_clip: expected a number >= 0 (0: unclipped)"),
        ({}, {"critic": {"aggregation": "seq-mean-token-sum-norm"}},
         "critic.aggregation: expected one of token-mean, seq-mean-token-sum, seq-mean-token-mean"),
        ({}, {"critic": {"lr": 0.0}}, "critic.lr: expected a positive number, got 0.0"),
        ({}, {"critic": {"dtype": "int8"}}, "critic.dtype: expected one of float32, bfloat16"),
        ({}, {"critic": {"budget_tokens": 0}}, "critic.budget_tokens: expected a positive integer"),
        ({}, {"objective": {"advantage_params": {"whiten": 1}}},
         "objective.advantage_params.whiten: expected true or false, got 1 (int)"),
        ({}, {"objective": {"advantage_params": {"token_rewards": [1.0]}}},
         "objective.advantage_params.token_rewards: a per-token tensor, not set from a config"),
        ({}, {"objective": {"advantage_params": {"tau": 1.0}}},
         "objective.advantage_params: gae takes no parameter 'tau'; valid: gamma, lam, whiten"),
    ],
    ids=["gae-without-critic", "critic-without-estimator", "critic-with-grpo", "critic-with-sft",
         "unknown-key", "no-model", "negative-clip", "dr-grpo-aggregation", "zero-lr", "bad-dtype",
         "zero-budget", "whiten-not-bool", "token-rewards", "unknown-param"],
)  # fmt: skip
def test_misconfigurations_are_refused_before_step_1(tmp_path, capsys, top, sections, expected):
    assert run_train(_config(tmp_path, "qwen3", top, **sections), tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_critic_directories_that_are_refused(tmp_path, capsys):
    """A token classifier with two labels; a missing directory."""
    torch.manual_seed(0)
    two = AutoModelForTokenClassification.from_config(tiny_config("qwen3", num_labels=2))
    two.save_pretrained(tmp_path / "two")
    assert run_train(_config(tmp_path, "qwen3", critic={"model": "two"}), tmp_path / "b") == 2
    assert "Qwen3ForTokenClassification with num_labels = 2; a critic reads one value per position" in (
        capsys.readouterr().err
    )
    assert run_train(_config(tmp_path, "qwen3", critic={"model": "absent"}), tmp_path / "c") == 2
    assert f"critic.model: {tmp_path / 'absent'}: not a local Hugging Face model directory" in (
        capsys.readouterr().err
    )


def test_the_example_runs(tmp_path):
    """examples/ppo_gae.toml: 8 updates of the tiny bailing_hybrid with a ValueHead critic."""
    _needs("bailing_hybrid")
    summary = train(load_config(ROOT / "examples" / "ppo_gae.toml"), tmp_path / "out", log=io.StringIO())
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == len(records) == 8
    assert records[-1]["value_loss"] < records[0]["value_loss"]  # the critic learns
    final = tmp_path / "out" / "checkpoints" / "step-000008" / CRITIC_DIR
    assert AutoConfig.from_pretrained(final).architectures == [VALUE_HEAD_ARCHITECTURE]
