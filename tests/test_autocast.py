"""harts under ``torch.autocast`` (fp32 parameters, bf16 or fp16 compute) is no worse than the stock
forward of each trajectory under the same autocast, both measured against the exact fp64 truth.

Under autocast the stock forward runs its linear layers, convolutions and SDPA in the low
precision and keeps norms, softmaxes and linear-attention states in fp32; harts' own ops take the
same policy (``harts.ops.precision``). So harts is a computation of the same rounding class as
the stock one: the same roundings, to the same unit roundoff u (2^-8 for bf16, 2^-11 for fp16),
in a different order (tree attention over gathered keys, fp32 recurrences where the stock CPU
fallback lets autocast round its matmuls, the chunked head). Its error against the truth is then
of the size of the stock's. The bounds, per family and trajectory:

- log-probs: max |harts - truth| <= 2 * max |stock - truth| + 2 ulp(max |log-prob|). The factor 2
  allows harts' rounding order its own sample of the stock's error size; the ulps (the spacing of
  the low dtype at the largest log-prob) allow the extra roundings harts does in a different
  place (the head's target logit, gathered keys);
- logits: the angle to the truth's logits, arccos(cosine), <= 2 * the stock's + 4u: a vector whose
  entries each move by a relative u turns by at most u radians, and harts rounds at most a few
  more times than stock;
- gradients (the SFT sum through ``harts.rollout_step``, cut into micro-batches, so the hand-over
  of keys, conv inputs and states is under autocast too): the relative error of all parameters'
  gradients together <= 2 * the stock's + 4u, by the same argument as the logits.

A failure of the policy shows up far past these: a tensor left in fp32 against a low-precision
one crashes, and one rounded where stock keeps fp32 (a recurrent state, the softmax) costs orders
of magnitude more than u.

MoE layers choose every expert here (``num_experts_per_tok`` = the expert count, every group):
top-k selection is discontinuous, and a token whose k-th and (k+1)-th scores lie within rounding
of each other gets a different expert by chance, in stock as in harts (a measured jump of one
logit by ~1 either way, which says nothing about the arithmetic). With every expert chosen the
router's arithmetic (scores, correction bias, normalisation) still runs and is compared.

The tree, the truth, the two runs and the bounds are in ``tests/precision.py``, which the CUDA
check (tests/test_gpu_precision.py) runs too: this module is its CPU counterpart.

The hybrid families (linear attention, state-space layers, short convolutions) carry a tighter
bound, per set-up (bf16 autocast with fp32 parameters; bf16 parameters): harts' worst log-prob
error and whole-gradient relative error are at most 1.5x the stock's. One model's error is one
sample of rounding noise, and a heavy-tailed one: two computations of the same rounding class,
such as stock and stock with its delta-rule fallback run with autocast off (which, under CPU
autocast, rounds its chunk matmuls to bf16 where harts keeps them in fp32), land 0.5x to 2x apart
on a single tiny model, either way (measured: 0.0424 and 0.0907 on qwen3_next's gradient). So
the bound holds for each error summed over eight tiny models (``tests/precision.py``'s
``SEEDS``), whose sum has about 1/sqrt(8) of a single sample's relative spread; a tensor rounded
where stock keeps it wider still shows there, on every model at once (with per-tap bf16 sums in
the short convolution, qwen3_next's gradient error was 1.6x the stock's).
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.integrations import batch_step
from harts.tiny import FAMILIES, tiny_model
from tests.helpers import one_thread  # noqa: F401  (module-scoped fixture)
from tests.precision import (
    SETUPS,
    SUM,
    TRAJECTORIES,
    errors,
    global_relative_error,
    model_of,
    no_worse_failures,
    stock,
    summed_errors,
    tree,
    truth,
)
from tests.reference import param_grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_autocast_no_worse_than_stock(family, dtype):
    model = model_of(family)
    exact = truth(family)
    theirs, mine = errors(stock(model, dtype), exact), errors(tree(model, dtype), exact)
    failures = no_worse_failures(theirs, mine, exact, dtype)
    assert not failures, "; ".join(failures)


HYBRID_FAMILIES = [f for f in ("bailing_hybrid", "kimi_linear", "qwen3_next", "qwen3_5", "qwen3_5_moe",
                                 "lfm2", "minimax", "nemotron_h", "jamba", "granitemoehybrid", "falcon_h1",
                                 "glm5_next", "qwen4_exp", "mamba2", "bamba", "mamba",
                                 "falcon_mamba", "lfm2_moe", "olmo_hybrid", "lfm3", "lara_mini")
                   if f in FAMILIES]  # fmt: skip


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_within_one_and_a_half_times_stock(family, setup):
    """The hybrid families' bound of the module docstring: each error, summed over the tiny models,
    at most 1.5x the stock's."""
    theirs, mine = summed_errors(family, setup)
    failures = [f"{what} error {mine[what]:.3g} > 1.5 x stock's {theirs[what]:.3g}"
                for what in ("logprob", "grad") if mine[what] > 1.5 * theirs[what]]  # fmt: skip
    assert not failures, f"{family}, {setup}: " + "; ".join(failures)


@pytest.mark.parametrize("family", FAMILIES[:1])
def test_autocast_leaves_fp32_unchanged(family):
    """Leaving autocast returns harts to its exact fp32 path: the same logits, bit for bit, as
    before any autocast call (no dtype or cache carried over)."""
    model = model_of(family)
    forest = harts.build_forest(TRAJECTORIES)
    with torch.no_grad():
        before = harts.forward(model, forest).trajectory_logits(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            harts.forward(model, forest).trajectory_logits(0)
        after = harts.forward(model, forest).trajectory_logits(0)
    assert after.dtype == torch.float32
    assert torch.equal(before, after)


BATCH_FAMILIES = [f for f in ("bailing_hybrid", "qwen3_5", "jamba", "gpt_oss") if f in FAMILIES]


@pytest.mark.parametrize("family", BATCH_FAMILIES)
def test_batch_step_under_autocast_is_the_rollout_step(family):
    """``batch_step`` under autocast on a right-padded batch runs the same forest as ``rollout_step``:
    the same loss and gradients, up to fp32 summation order (1e-5 relative), so the comparison with
    stock above covers it too."""
    model = model_of(family)
    width = max(map(len, TRAJECTORIES))
    ids = torch.zeros(len(TRAJECTORIES), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, t in enumerate(TRAJECTORIES):
        ids[b, : len(t)], mask[b, : len(t)] = torch.tensor(t), 1
    response = mask.bool()
    response[:, 0] = False  # every predicted token, as the SFT sum over whole trajectories
    config = harts.PolicyLossConfig(kind="sft")
    results = []
    for step in ("batch", "rollout"):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if step == "batch":
                batch = {"input_ids": ids, "attention_mask": mask, "response_mask": response}
                result = batch_step(model, batch, config, normalizers=SUM, budget_tokens=7)
            else:
                rollouts = [harts.Rollout(t) for t in TRAJECTORIES]
                result = harts.rollout_step(model, rollouts, config, normalizers=SUM, budget_tokens=7)
        results.append((float(result.loss), param_grads(model)))
    (loss_b, grads_b), (loss_r, grads_r) = results
    assert abs(loss_b - loss_r) <= 1e-5 * abs(loss_r)
    assert global_relative_error(grads_b, {k: g.double() for k, g in grads_r.items()}) <= 1e-5


@pytest.mark.parametrize("family", [f for f in ("qwen3_5", "jamba", "qwen3") if f in FAMILIES])
def test_fp64_model_ignores_autocast(family):
    """Autocast leaves fp64 operands alone, and so do harts' ops: an fp64 model under autocast
    computes exactly what it computes outside it (convolution, recurrence, attention and head)."""
    model = tiny_model(family, seed=7, dtype=torch.float64)
    forest = harts.build_forest(TRAJECTORIES)
    with torch.no_grad():
        plain = harts.forward(model, forest)
        expected = [plain.trajectory_logits(0), plain.trajectory_logprobs(0)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = harts.forward(model, forest)
            got = [out.trajectory_logits(0), out.trajectory_logprobs(0)]
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.float64
        assert torch.equal(a, b)
