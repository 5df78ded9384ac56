"""The framework-neutral batch API against the stock HF forward of each sequence alone (fp32).

- ``batch_step`` on left-padded, right-padded and packed batches, with per-token fields over the
  whole sequence or only the response ([B, R], the last R columns), advantages per sequence [B]
  or per token: the loss of each standard aggregation written out as verl's ``agg_loss`` and
  TRL's loss types define it (PPO clip, KL k3, entropy bonus) on stock log-probs, and its
  gradients; log-probs and entropies come back in the batch's layout. A token budget changes
  nothing.
- ``batch_logprobs``: the per-token values with autograd, in the caller's layout; without
  autograd under a token budget.
- ``group_advantages``: sample and population std, as verl/TRL and harts define them.
- Bad input is refused before compute, naming the item.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.integrations import StdMode, batch_logprobs, batch_step, group_advantages
from harts.tiny import tiny_model
from tests.reference import GRAD_RTOL, LOGIT_ATOL, grad_relative_errors, param_grads

PROMPT = [5, 9, 17, 33, 65, 3, 7, 21]
RESPONSES = [[11, 12, 13, 14], [11, 12, 40], [50, 51, 52, 53, 54], [11, 60]]
SEQS = [PROMPT + r for r in RESPONSES] + [[8, 9, 10, 70, 71, 72]]  # a group of 4 and a lone prompt
RESP_LEN = [4, 3, 5, 2, 3]
ADV = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8])
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=4)


def padded(left: bool, width_r: int | None = None):
    """input_ids, attention_mask [B, L] and the response region as a [B, L] bool mask."""
    width = max(map(len, SEQS))
    ids, mask = (
        torch.zeros(len(SEQS), width, dtype=torch.long),
        torch.zeros(len(SEQS), width, dtype=torch.long),
    )
    response = torch.zeros(len(SEQS), width, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(SEQS, RESP_LEN, strict=True)):
        start = width - len(s) if left else 0
        ids[b, start : start + len(s)], mask[b, start : start + len(s)] = torch.tensor(s), 1
        response[b, start + len(s) - n : start + len(s)] = True
    return ids, mask, response


def annotations(shape):
    gen = torch.Generator().manual_seed(0)
    return -torch.rand(shape, generator=gen) * 2, -torch.rand(shape, generator=gen) * 2


def stock_loss(model, response_masks, old, ref, adv, agg, scale, config):
    """The loss on stock per-sequence log-probs, aggregated as verl's agg_loss does (one response
    row per sequence, zero-padded to the longest)."""
    width = max(len(m) for m in response_masks)
    rows = []
    for b, s in enumerate(SEQS):
        logits = model(input_ids=torch.tensor([s])).logits[0, :-1] / TEMPERATURE
        logp = torch.log_softmax(logits, -1)
        lp = logp.gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        n = RESP_LEN[b]
        ratio = torch.exp(lp[-n:] - old[b])
        pg = torch.maximum(-adv[b] * ratio, -adv[b] * ratio.clamp(0.8, 1.2))
        lr = ref[b] - lp[-n:]
        loss = pg + config.kl_coef * (torch.expm1(lr) - lr) - config.entropy_coef * ent[-n:]
        rows.append(torch.nn.functional.pad(loss, (0, width - n)))
    mat = torch.stack(rows)
    mask = torch.stack([torch.nn.functional.pad(m.float(), (0, width - len(m))) for m in response_masks])
    seq = (mat * mask).sum(-1)
    if agg == "token-mean":
        return (mat * mask).sum() / mask.sum()
    if agg == "seq-mean-token-mean":
        return (seq / mask.sum(-1)).mean()
    if agg == "seq-mean-token-sum":
        return seq.mean()
    return seq.mean() / scale


AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


CASES = [("left", agg) for agg in AGGREGATIONS] + [
    ("right", "token-mean"), ("packed", "seq-mean-token-mean"), ("response-only", "seq-mean-token-sum-norm"),
    ("response-only", "token-mean"),
]  # fmt: skip


@pytest.mark.parametrize("layout,agg", CASES)
def test_batch_step_matches_stock_per_sequence(model, layout, agg):
    config = harts.PolicyLossConfig(kind="ppo", kl_coef=0.1, entropy_coef=0.01, aggregation=agg,
                                    temperature=TEMPERATURE)  # fmt: skip
    ids, mask, response = padded(left=layout != "right")
    tool = response.clone()
    tool[1, response[1].nonzero()[1, 0]] = False  # a tool-output token inside response 1: no loss there
    old_full, ref_full = annotations(ids.shape)
    per_seq_masks = [tool[b][response[b]] for b in range(len(SEQS))]
    old = [old_full[b][response[b]] for b in range(len(SEQS))]
    ref = [ref_full[b][response[b]] for b in range(len(SEQS))]
    width_r = max(RESP_LEN)
    if layout == "packed":
        keep = mask.bool()
        batch = {"input_ids": ids[keep], "cu_seqlens": torch.tensor([0] + [len(s) for s in SEQS]).cumsum(0),
                 "response_mask": tool[keep], "old_log_probs": old_full[keep],
                 "ref_log_probs": ref_full[keep],
                 "advantages": ADV}  # fmt: skip
        scale = 7.0
    elif layout == "response-only":  # verl's DataProto: prompts left-padded, responses right-padded
        width_p = max(len(s) - n for s, n in zip(SEQS, RESP_LEN, strict=True))
        ids = torch.zeros(len(SEQS), width_p + width_r, dtype=torch.long)
        mask = torch.zeros_like(ids)
        resp_mask = torch.zeros(len(SEQS), width_r, dtype=torch.bool)
        old_r, ref_r = torch.zeros(len(SEQS), width_r), torch.zeros(len(SEQS), width_r)
        for b, (s, n) in enumerate(zip(SEQS, RESP_LEN, strict=True)):
            p = len(s) - n
            ids[b, width_p - p : width_p + n], mask[b, width_p - p : width_p + n] = torch.tensor(s), 1
            resp_mask[b, :n], old_r[b, :n], ref_r[b, :n] = per_seq_masks[b], old[b], ref[b]
        batch = {"input_ids": ids, "attention_mask": mask, "response_mask": resp_mask, "old_log_probs": old_r,
                 "ref_log_probs": ref_r, "advantages": ADV[:, None].expand(-1, width_r)}  # fmt: skip
        scale = None  # verl's default: the response width
    else:
        batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": tool,
                 "old_per_token_logps": old_full,
                 "ref_per_token_logps": ref_full, "advantages": ADV}  # fmt: skip
        scale = 7.0
    scale_kw = {"loss_scale_factor": scale} if agg.endswith("norm") and scale is not None else {}
    model.zero_grad(set_to_none=True)
    result = batch_step(model, batch, config, budget_tokens=6 if layout == "left" else None, **scale_kw)
    got = param_grads(model)
    model.zero_grad(set_to_none=True)
    ref_value = stock_loss(model, per_seq_masks, old, ref, ADV, agg, scale or float(width_r), config)
    ref_value.backward()
    ref_value = ref_value.detach()
    assert abs(float(result.loss) - float(ref_value)) <= 1e-5 * max(1.0, abs(float(ref_value)))
    errors = grad_relative_errors(got, param_grads(model))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_RTOL, f"{worst}: relative error {errors[worst]:.3g}"
    # log-probs back in the layout the response mask came in, at the response's loss tokens
    mask_given = batch.get("response_mask", batch.get("completion_mask"))
    assert result.logprobs.shape == mask_given.shape
    assert torch.equal(result.logprobs != 0, mask_given.bool())


def test_batch_logprobs_are_stock_values_with_autograd(model):
    ids, mask, response = padded(left=True)
    out = batch_logprobs(model, ids, mask, score_mask=response, temperature=TEMPERATURE)
    flat = sum(map(len, SEQS))
    assert out.forest.num_tokens < flat - 3 * len(PROMPT) + 1, "the group's prompt ran once"
    assert torch.equal(out.mask, response) and out.logprobs.requires_grad
    weight = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    ((out.logprobs + out.entropies) * weight).sum().backward()
    got = param_grads(model)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for b, s in enumerate(SEQS):
        logp = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0, :-1] / TEMPERATURE, -1)
        lp = logp.gather(1, torch.tensor(s[1:])[:, None])[:, 0][-RESP_LEN[b] :]
        ent = -(logp.exp() * logp).sum(-1)[-RESP_LEN[b] :]
        assert (out.logprobs[b][response[b]] - lp).abs().max() <= 1e-5
        assert (out.entropies[b][response[b]] - ent).abs().max() <= 1e-5
        total = total + ((lp + ent) * weight[b][response[b]]).sum()
    total.backward()
    errors = grad_relative_errors(got, param_grads(model))
    assert max(errors.values()) <= GRAD_RTOL


def test_group_advantages_conventions():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 2.0])
    groups = ["a", "a", "a", "a", "b", "c"]
    sample = group_advantages(rewards, groups, StdMode.SAMPLE)
    population = group_advantages(rewards, groups, "population")
    centered = torch.tensor([0.5, -0.5, -0.5, 0.5])
    assert torch.allclose(sample[:4], centered / (centered.std() + 1e-6))  # torch.std: unbiased, as verl/TRL
    assert torch.allclose(population[:4], centered / (centered.std(unbiased=False) + 1e-6))
    assert torch.equal(sample[4:], torch.zeros(2)), "a group of one has advantage 0"
    assert torch.equal(group_advantages(rewards, groups, "none")[:4], centered)
    rows = harts.build_loss_rows(harts.build_forest([[1, 2]] * 4), [harts.Rollout([1, 2], reward=float(r),
                                 group_id=0) for r in rewards[:4]])  # fmt: skip
    from harts.objectives.advantages import grpo_advantages

    assert torch.allclose(grpo_advantages(rows.reward, rows.group), population[:4])
    with pytest.raises(ValueError, match="trajectory 1: reward is nan"):
        group_advantages([0.0, float("nan")], [0, 0])


def test_bad_batches_are_refused_before_compute(model):
    ids, mask, response = padded(left=True)
    calls = []
    handle = model.model.embed_tokens.register_forward_pre_hook(lambda *a: calls.append(1))
    config = harts.PolicyLossConfig(kind="ppo")
    old, _ = annotations(ids.shape)
    good = {"input_ids": ids, "attention_mask": mask, "response_mask": response, "old_log_probs": old,
            "advantages": ADV}  # fmt: skip
    try:
        first = response.clone()
        first[0, (mask[0] > 0).nonzero()[0, 0]] = True
        for batch, error, match in [
            (
                {**good, "response_mask": first},
                ValueError,
                "trajectory 0, position 0: response_mask is set on the first",
            ),
            ({**good, "completion_mask": response}, ValueError, "both 'response_mask' and 'completion_mask'"),
            ({k: v for k, v in good.items() if k != "response_mask"}, ValueError, "needs one of"),
            ({**good, "old_log_probs": old[:, :3, None]}, ValueError, "old_log_probs has shape"),
            ({**good, "advantages": torch.zeros(2, 2)}, ValueError, "advantages has shape"),
            (
                {**good, "old_log_probs": old.abs()},
                ValueError,
                r"trajectory 0, position \d+: rollout_logprobs is",
            ),
            ({**good, "input_ids": ids.masked_fill(ids == 65, 900)}, ValueError, "token id 900 is outside"),
        ]:
            with pytest.raises(error, match=match):
                batch_step(model, batch, config)
        with pytest.raises(ValueError, match="loss_scale_factor applies to seq-mean-token-sum-norm only"):
            batch_step(model, good, config, loss_scale_factor=8)
        with pytest.raises(ValueError, match="score_mask has shape"):
            batch_logprobs(model, ids, mask, score_mask=response[:, :, None])
    finally:
        handle.remove()
    assert calls == [], "no model compute may run before the batch is checked"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_batch_logprobs_under_a_budget_without_autograd(model, family):
    """Under no_grad a token budget cuts the batch's forest as the step would (down to one token
    per micro-batch); the values are the stock ones of each sequence alone, and those of the
    unbudgeted call within the split bound (1e-5, tests/test_split.py)."""
    model = model if family == "qwen3" else tiny_model(family, seed=4)
    ids, mask, response = padded(left=True)
    with torch.no_grad():
        whole = batch_logprobs(model, ids, mask, score_mask=response, temperature=TEMPERATURE)
        for budget in (1, 5):
            out = batch_logprobs(model, ids, mask, score_mask=response, temperature=TEMPERATURE,
                                 run=harts.RunConfig(budget_tokens=budget))  # fmt: skip
            assert torch.equal(out.mask, response) and not out.logprobs.requires_grad
            assert (out.logprobs - whole.logprobs).abs().max() <= 1e-5
            assert (out.entropies - whole.entropies).abs().max() <= 1e-5
            for b, s in enumerate(SEQS):
                logp = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0, :-1] / TEMPERATURE, -1)
                lp = logp.gather(1, torch.tensor(s[1:])[:, None])[:, 0][-RESP_LEN[b] :]
                ent = -(logp.exp() * logp).sum(-1)[-RESP_LEN[b] :]
                assert (out.logprobs[b][response[b]] - lp).abs().max() <= LOGIT_ATOL
                assert (out.entropies[b][response[b]] - ent).abs().max() <= LOGIT_ATOL
    with pytest.raises(ValueError, match=r"torch.no_grad\(\).*forest_logprobs"):
        batch_logprobs(model, ids, mask, run=harts.RunConfig(budget_tokens=5))
