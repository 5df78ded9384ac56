"""``[ppo] epochs, mini_batches``: several optimizer updates per step of rollouts, exact and resumable.

A real run's weights after every update must equal the update written by hand from the weights
before it: each trajectory alone through the stock forward (fp64, exact kernels), GRPO
advantages over the whole step, PPO's clipped token-mean loss over the mini-batch (its own
normaliser), mini-batches of whole groups drawn as ``harts.trainer.ppo`` documents. A run killed
between two updates of one step resumes to the bytes of an uninterrupted run. Misconfigurations
are refused before step 1.

The bound, per parameter tensor and update, from the arithmetic: AdamW with ``betas = (0, 0)``
and ``eps = 1`` updates ``theta -= lr * g / (|g| + 1)``, which moves by at most ``lr`` per unit of
gradient error (its derivative is ``lr / (|g| + 1)^2``); harts' fp32 gradient is within
``GRAD_RTOL`` of the exact one, relative to its norm (docs/architecture.md, "References and
tolerances"; GRPO's fp32 advantages move it by a few units of 2^-24, far below); the stored fp32
weight is the fp32 rounding of ``theta + u`` (2^-24 relative), ``u`` itself computed in a few
fp32 operations (say 6 roundings of 2^-24). So
``|theta_run - theta_hand| <= lr * GRAD_RTOL * max(|g|, GRAD_FLOOR) + 2^-24 (|theta| + 6 |u|)``.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from harts.tiny import tiny_model
from harts.trainer.checkpoint import list_checkpoints
from harts.trainer.config_files import load_config
from harts.trainer.inputs import rollout_steps
from harts.trainer.ppo import mini_batches
from tests.helpers import (
    CHAT_TEMPLATE,
    CONVERSATION,
    FAMILY,
    group_spans,
    kill_after,
    one_thread,  # noqa: F401 (autouse: one thread)
    run_train,
    save_tokenizer,
    write_config,
    write_small_rollouts,
)
from tests.reference import (
    GRAD_FLOOR,
    GRAD_RTOL,
    LOGIT_ATOL,
    exact_linear_kernels,
    fp64_copy,
    stock_logits,
    stock_row_loss_grads,
)

U32 = 2.0**-24
LR = 1e-2
CLIP = 0.2


def _config(tmp_path, top=None, **sections):
    data = write_small_rollouts(tmp_path / "small.jsonl")  # 6 groups of 3: two steps of 3 groups
    tables = dict(
        model={"tiny": FAMILY},
        data={"path": str(data), "rollouts_per_step": 9},
        objective={"kind": "ppo", "advantage": "grpo"},
        ppo={"epochs": 2, "mini_batches": 2},
        run={"budget_tokens": 24},
        optimizer={"lr": LR, "weight_decay": 0.0, "betas": [0.0, 0.0], "eps": 1.0},
        checkpoint={"every": 1, "keep_last": 100},
        logging={"plot": False},
    )
    for name, table in sections.items():
        tables[name] = {**tables.get(name, {}), **table}
    return write_config(tmp_path / "run.toml", {"steps": 2, "max_grad_norm": 0.0, **(top or {})}, tables)


def _grpo(rollouts, spans) -> list[float]:
    adv = [0.0] * len(rollouts)
    for span in spans:
        r = np.array([rollouts[i].reward for i in span], dtype=np.float64)
        for i, a in zip(span, (r - r.mean()) / (r.std() + 1e-6), strict=True):
            adv[i] = float(a)
    return adv


def _ppo_loss(rollouts, adv):
    """PPO's clipped loss, token-mean over the mini-batch's loss positions, on stock rows."""
    mask = torch.cat([torch.as_tensor(r.loss_mask[1:], dtype=torch.bool) for r in rollouts])
    old = torch.cat([torch.as_tensor(r.rollout_logprobs[1:], dtype=torch.float64) for r in rollouts])
    pairs = zip(rollouts, adv, strict=True)
    a = torch.cat([torch.full((len(r.tokens) - 1,), x, dtype=torch.float64) for r, x in pairs])

    def loss(logprob, entropy):
        ratio = torch.exp(logprob - old)
        per_row = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a)
        return per_row[mask].sum() / mask.sum()

    return loss


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_mini_batches_hold_whole_groups_and_reshuffle_by_epoch(tmp_path):
    config = load_config(_config(tmp_path, data={"rollouts_per_step": 18}))
    rollouts = next(iter(rollout_steps(config.data)))  # 6 groups
    seen = []
    for e in range(3):
        parts = mini_batches(rollouts, 4, seed=0, epoch=0, index=0, ppo_epoch=e)
        assert sorted(id(r) for p in parts for r in p) == sorted(id(r) for r in rollouts)  # each once
        assert [len({r.group_id for r in p}) for p in parts] in ([2, 2, 1, 1],)  # sizes differ by <= 1
        for p in parts:  # a group lies whole in one mini-batch
            for g in {r.group_id for r in p}:
                assert sum(r.group_id == g for r in p) == sum(r.group_id == g for r in rollouts)
        assert parts == mini_batches(rollouts, 4, seed=0, epoch=0, index=0, ppo_epoch=e)  # a function
        seen.append([[r.group_id for r in p] for p in parts])
    assert seen[0] != seen[1] or seen[1] != seen[2]  # the epochs draw other orders


def test_updates_equal_the_updates_written_by_hand(tmp_path):
    """Every update of a run (2 steps x 2 epochs x 2 mini-batches, the file's old log-probs)
    equals, within the bound of the module docstring, the update by hand from the same weights."""
    # shuffle seed 8: each step's two epochs draw other mini-batches (seed 0 draws the same ones)
    config = _config(tmp_path, ppo={"old_logprobs": "rollout", "shuffle_seed": 8})
    out = tmp_path / "out"
    assert run_train(config, out) == 0
    loaded = load_config(config)
    checkpoints = [c.path for c in list_checkpoints(out / "checkpoints")]
    assert [c.name for c in checkpoints] == [f"step-{k:06d}" for k in range(1, 9)]
    models = [tiny_model(FAMILY, seed=0)] + [_load(c) for c in checkpoints]
    k, worst, moved = 0, 0.0, []
    for index, batch in enumerate(rollout_steps(loaded.data)):
        spans = group_spans(batch)
        adv = _grpo(batch, spans)
        for e in range(2):
            order = np.random.default_rng([loaded.ppo.shuffle_seed, 0, index, e]).permutation(len(spans))
            for part in np.array_split(order, 2):
                chosen = [i for g in part for i in spans[g]]
                rollouts = [batch[i] for i in chosen]
                before, after = dict(models[k].named_parameters()), dict(models[k + 1].named_parameters())
                loss_fn = _ppo_loss(rollouts, [adv[i] for i in chosen])
                _, _, grads = stock_row_loss_grads(models[k], [r.tokens for r in rollouts], loss_fn)
                for name, g in grads.items():
                    update = -LR * g / (g.abs() + 1.0)
                    hand = before[name].detach().double() + update
                    run = after[name].detach().double()
                    bound = LR * GRAD_RTOL * max(g.norm().item(), GRAD_FLOOR) + U32 * (
                        run.norm().item() + 6 * update.norm().item())
                    error = (run - hand).norm().item()
                    assert error <= bound, (k, name, error, bound)
                    worst = max(worst, error / bound)
                    moved.append(update.norm().item() / bound)
                k += 1
    assert k == 8
    # the check can fail: an update moves each weight tensor far more than the bound allows
    assert np.median(moved) > 100


def test_a_kill_between_updates_resumes_to_the_same_bytes(tmp_path, capsys):
    """SIGKILL after update 2 of step 1 (of 4); the resume restores the old log-probs of the step
    (computed by the weights before its first update, which the checkpoint saves) and the
    mini-batch position, and ends with the bytes of an uninterrupted run."""
    config = _config(tmp_path, {"steps": 4}, objective={"kl_coef": 0.1}, reference={"model": "initial"},
                     optimizer={"betas": [0.9, 0.999], "eps": 1e-8}, checkpoint={"every": 2})  # fmt: skip
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    kill_after(config, killed, "step-000002")
    for c in list_checkpoints(killed / "checkpoints"):  # as if the kill landed right after update 2
        if c.step > 2:
            shutil.rmtree(c.path)
    state = json.loads((killed / "checkpoints" / "step-000002" / "state.json").read_text())["position"]
    assert (state["step"], state["index"], state["ppo_epoch"], state["mini_batch"]) == (2, 0, 1, 0)
    assert run_train(config, killed, "--resume") == 0
    assert "resuming from" in capsys.readouterr().err
    assert run_train(config, straight) == 0
    final = "checkpoints/step-000016"
    for name in ("model.safetensors", "trainer_state.pt"):
        assert (killed / final / name).read_bytes() == (straight / final / name).read_bytes(), name
    losses = [[json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (killed, straight)]  # fmt: skip
    assert losses[0] == losses[1] and len(losses[0]) == 16

    # the old log-probs a mid-step checkpoint saves are those of the weights before the step:
    # step 2's (updates 5-8) from update 4's weights, each trajectory alone within 2 LOGIT_ATOL
    saved = torch.load(straight / "checkpoints" / "step-000006" / "trainer_state.pt", weights_only=True)
    rollouts = list(rollout_steps(load_config(config).data))[1]
    model64 = fp64_copy(_load(straight / "checkpoints" / "step-000004"), cache=False)
    with torch.no_grad(), exact_linear_kernels(model64):
        for r, old in zip(rollouts, saved["old_logprobs"], strict=True):
            ids = torch.as_tensor(r.tokens)
            logp = torch.log_softmax(stock_logits(model64, r.tokens)[:-1], -1).gather(1, ids[1:, None])[:, 0]
            mask = torch.as_tensor(r.loss_mask[1:], dtype=torch.bool)
            assert (old[1:].double() - logp)[mask].abs().max() <= 2 * LOGIT_ATOL
            assert torch.all(old[1:][~mask] == 0)
    assert "old_logprobs" not in torch.load(straight / final / "trainer_state.pt", weights_only=True)


@pytest.mark.parametrize(
    "top, sections, expected",
    [
        ({}, {"ppo": {"mini_batches": 4}}, "(step 1): ppo.mini_batches = 4, but this step has 3 groups"),
        ({}, {"ppo": {"epochs": 0}}, "ppo.epochs: expected a positive integer, got 0"),
        ({}, {"objective": {"kl_coef": 0.1}, "reference": {"model": "no-such-model"}},
         "no-such-model: not a local Hugging Face model directory (no config.json)"),
        ({}, {"objective": {"kl_coef": 0.1}},
         "'ref_logprobs': missing: objective.kl_coef = 0.1 needs reference log-probs (or a [reference]"),
        ({}, {"reference": {"model": "initial"}}, "reference: objective.kl_coef is 0"),
    ],
    ids=["mini-batches-past-the-groups", "no-epoch", "reference-dir-missing", "kl-without-reference",
         "reference-without-kl"],
)  # fmt: skip
def test_misconfigurations_are_refused_before_step_1(tmp_path, capsys, top, sections, expected):
    config = _config(tmp_path, top, **sections)
    assert run_train(config, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_file_with_reference_logprobs_and_a_reference_is_refused(tmp_path, capsys):
    config = _config(tmp_path, objective={"kl_coef": 0.1}, reference={"model": "initial"})
    data = tmp_path / "small.jsonl"
    lines = [json.loads(x) for x in data.read_text().splitlines()]
    for line in lines:
        line["ref_logprobs"] = line["rollout_logprobs"]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert run_train(config, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "line 1 (step 1), field 'ref_logprobs': given: [reference] computes the reference log-probs" in err


def test_a_chat_file_trains_with_grpo_on_computed_old_logprobs(tmp_path):
    """A chat file has no log-probs of its own: [ppo] computes the old ones, so PPO/GRPO trains."""
    tokenizer = save_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    wrong = [*CONVERSATION[:-1], {"role": "assistant", "content": "It snows."}]
    data = tmp_path / "chat.jsonl"
    group = ((CONVERSATION, 1.0), (wrong, 0.0), (CONVERSATION, 1.0))
    lines = [{"messages": m, "reward": r, "group_id": "paris"} for m, r in group]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    chat = {"path": str(data), "tokenizer": str(tokenizer), "rollouts_per_step": 3}
    config = _config(tmp_path, {"steps": 1}, data=chat, ppo={"mini_batches": 1})
    assert run_train(config, tmp_path / "out") == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["ppo_epoch"], r["mini_batch"]) for r in records] == [(0, 0), (1, 0)]
    assert all(np.isfinite(r["loss"]) and "clip_fraction" in r for r in records)
