"""``RunConfig(verify=True)``: a call checks a sample of its trajectories against the stock forward.

What must hold: an exact step passes on every family and computes the same bits as without the
check (loss, metrics, the gradients it adds to what ``.grad`` held); kernels registered through
``harts.ops.backends`` that are off by 1e-3, in forward (and so in backward) or in backward only,
are caught on hybrid and full-attention families, with an error naming the trajectory and
position or the parameter, and the call's gradients are left out of ``.grad``; forward-only
passes (log-probs, a critic's values) and the critic's step verify too.

The faults scale one op's output (tree attention, the delta rule) by 1 + 1e-3 in forward or its
gradient in backward: a log-prob then moves by about 1e-3 x its logits' spread (measured
1.7e-3 - 2.9e-3 on the tiny models, against the bound 2e-4) and the gradients of the layers
feeding the op by about 1e-3 relative (measured 1.7e-3 - 3.0e-3, against bounds near 1.1e-4).

In bf16 (parameters or autocast) the bar is the issue's: tree attention's output x1.01 and its
query's gradient x1.05 in every precision (caught by the check of the algorithm at fp32), x1.02 and x1.05
only when its inputs are bf16 (caught by the kernel check against itself in fp32), on
bailing_hybrid and qwen3; the exact kernels pass with the same bits.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import harts
from harts.ops.backends import Backend, register_backend
from harts.ops.recurrence import DELTA_RULE
from harts.ops.tree_attention import tree_attention
from harts.runtime.verify import sample_trajectories
from harts.runtime.verify_sample import MAX_PREFIX, TAIL, within_prefix
from harts.tiny import FAMILIES, tiny_model
from tests.distributed_worker import batch
from tests.helpers import one_thread  # noqa: F401 (fixture)

LOSS = harts.PolicyLossConfig(kind="ppo")
FAULT = 1e-3
HYBRID = [f for f in ("qwen3_next", "bailing_hybrid") if f in FAMILIES]
FULL = ["qwen3", "llama"]


class _Scale(torch.autograd.Function):
    """``x * forward`` with the gradient scaled by ``backward``."""

    @staticmethod
    def forward(ctx, x, forward, backward):
        ctx.backward = backward
        return x * forward

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.backward, None, None


def _faulty(forward: float, backward: float):
    def attention(*args, **kwargs):
        return _Scale.apply(tree_attention(*args, **kwargs), forward, backward)

    def delta_rule(*args, **kwargs):
        out = DELTA_RULE.chunked(*args, **kwargs)
        return (_Scale.apply(out[0], forward, backward), *out[1:])

    return lambda: Backend("faulty", {DELTA_RULE.name: delta_rule}, attention)


register_backend("test-off-in-forward", _faulty(1 + FAULT, 1 + FAULT))
register_backend("test-off-in-backward", _faulty(1.0, 1 + FAULT))


def _attention_off(forward: float, query_grad: float, low_only: bool):
    """Tree attention's output scaled by ``forward`` (its gradient with it), and the query's
    gradient by ``query_grad``; with ``low_only``, only when its inputs are bf16 / fp16 (a kernel
    right in fp32, wrong in bf16)."""

    def attention(q, *args, **kwargs):
        if low_only and q.dtype not in (torch.bfloat16, torch.float16):
            return tree_attention(q, *args, **kwargs)
        out = tree_attention(_Scale.apply(q, 1.0, query_grad), *args, **kwargs)
        return _Scale.apply(out, forward, forward)

    return lambda: Backend("faulty-attention", {}, attention)


# the bar: output x1.01 and the query's gradient x1.05 in every precision, output x1.02
# and x1.05 only when the inputs are bf16
LOW_FAULTS = {
    "out-1.01": _attention_off(1.01, 1.0, False),
    "dq-1.05": _attention_off(1.0, 1.05, False),
    "bf16-out-1.02": _attention_off(1.02, 1.0, True),
    "bf16-out-1.05": _attention_off(1.05, 1.0, True),
}
for _name, _factory in LOW_FAULTS.items():
    register_backend(f"test-{_name}", _factory)
# the delta rule's plain chunked op is the one a backend replaces (the tree plans run their own)
RUN = harts.RunConfig(budget_tokens=32, linear_plan="depth")


def _grads(model) -> dict:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _step(model, rollouts, **run):
    return harts.rollout_step(model, rollouts, LOSS, run=harts.RunConfig(**{**RUN.__dict__, **run}))


def test_the_sample_is_the_deepest_shared_prefix():
    forest = harts.build_forest([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7], [9]])
    assert sample_trajectories(forest) == [1, 2]
    assert sample_trajectories(forest, limit=3) == [1, 2, 3]
    assert sample_trajectories(harts.build_forest([[1], [2]])) == [0]


def test_a_branch_past_the_prefix_limit_is_brought_within_it():
    """Two trajectories parting after a 600-token prompt: the sample is the prompt's first
    MAX_PREFIX tokens and each one's TAIL tokens past the branch (its cost does not grow with the
    prompt), passes on exact kernels, and a fault names positions of the call's trajectories."""
    model = tiny_model("qwen3")
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (600,), generator=g).tolist()
    rollouts = [
        harts.Rollout(
            prompt + torch.randint(0, vocab, (40,), generator=g).tolist(),
            advantages=1.0,
            rollout_logprobs=[-1.0] * 640,
        )
        for _ in range(2)
    ]
    trajectories = [torch.as_tensor(r.tokens) for r in rollouts]
    cut, _, shift = within_prefix(trajectories, None)
    assert shift == 600 - MAX_PREFIX and [t.numel() for t in cut] == [MAX_PREFIX + TAIL] * 2
    assert all(
        torch.equal(c[MAX_PREFIX:], t[600 : 600 + TAIL]) for c, t in zip(cut, trajectories, strict=True)
    )
    result = _step(model, rollouts, verify=True)
    model.zero_grad(set_to_none=True)
    assert result.metrics["verify_value_error"] <= result.metrics["verify_value_bound"]
    with pytest.raises(harts.VerificationError, match=r"trajectory [01], position (\d+)") as error:
        _step(model, rollouts, verify=True, backend="test-off-in-forward")
    model.zero_grad(set_to_none=True)
    position = int(re.search(r"position (\d+)", str(error.value)).group(1))
    assert position < MAX_PREFIX or 600 <= position < 600 + TAIL  # a place of the call's trajectory


@pytest.mark.parametrize("family", FAMILIES)
def test_an_exact_step_passes_and_computes_the_same_bits(family):
    model = tiny_model(family)
    # two trees, the first cut under the budget
    rollouts = batch(model.config.get_text_config().vocab_size)[:6]
    held = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = held[n].clone()  # gradients accumulated before the call are kept as they are
    plain = _step(model, rollouts)
    want = _grads(model)
    for n, p in model.named_parameters():
        p.grad = held[n].clone()
    checked = _step(model, rollouts, verify=True)
    got = _grads(model)
    assert torch.equal(plain.loss, checked.loss)
    # the step's own metrics are its bits; the check adds its figures (verify_*) beside them
    assert set(checked.metrics) == set(plain.metrics) | {
        k for k in checked.metrics if k.startswith("verify_")
    }
    assert {"verify_value_error", "verify_value_bound", "verify_gradient_ratio"} <= set(checked.metrics)
    assert float(checked.metrics["verify_value_error"]) <= float(checked.metrics["verify_value_bound"])
    assert all(torch.equal(plain.metrics[k], checked.metrics[k]) for k in plain.metrics)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("family", HYBRID + FULL)
@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_a_faulty_kernel_is_caught_and_leaves_no_gradient(family, fault):
    model = tiny_model(family)
    rollouts = batch(model.config.get_text_config().vocab_size)[:6]
    named = {"forward": r"trajectory \d+, position \d+: harts' log-prob", "backward": r"parameter model\."}
    expected = named[fault]
    with pytest.raises(harts.VerificationError, match=expected) as info:
        _step(model, rollouts, verify=True, backend=f"test-off-in-{fault}")
    assert "bound" in str(info.value) and "(fp32)" in str(info.value)
    assert all(p.grad is None for p in model.parameters())
    _step(model, rollouts, backend=f"test-off-in-{fault}")  # unverified, the same call runs
    assert any(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("family", HYBRID[:1] + FULL[:1])
def test_forward_only_passes_verify(family):
    model = tiny_model(family)
    rollouts = batch(model.config.get_text_config().vocab_size)[:6]
    plain = harts.forest_logprobs(model, rollouts, run=RUN)
    checked = harts.forest_logprobs(model, rollouts, run=harts.RunConfig(**{**RUN.__dict__, "verify": True}))
    assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, checked.logprobs, strict=True))
    faulty = harts.RunConfig(**{**RUN.__dict__, "verify": True, "backend": "test-off-in-forward"})
    with pytest.raises(harts.VerificationError, match="log-prob"):
        harts.forest_logprobs(model, rollouts, run=faulty)


def test_a_critic_verifies_its_values_and_its_step():
    lm = tiny_model(HYBRID[0])
    critic = harts.ValueHead(lm)
    rollouts = batch(lm.config.vocab_size)[:6]
    run = harts.RunConfig(**{**RUN.__dict__, "verify": True})
    values = harts.forward_values(critic, rollouts, run=run).values
    assert all(
        torch.equal(a, b)
        for a, b in zip(values, harts.forward_values(critic, rollouts, run=RUN).values, strict=True)
    )
    with_returns = [
        r.__class__(**{**r.__dict__, "returns": torch.ones(len(r.tokens)), "values": v})
        for r, v in zip(rollouts, values, strict=True)
    ]
    plain = harts.value_step(critic, with_returns, run=RUN)
    want = _grads(critic)
    checked = harts.value_step(critic, with_returns, run=run)
    assert torch.equal(plain.loss, checked.loss)
    got = _grads(critic)
    assert all(torch.equal(want[k], got[k]) for k in want)
    faulty = harts.RunConfig(**{**RUN.__dict__, "verify": True, "backend": "test-off-in-backward"})
    with pytest.raises(harts.VerificationError, match="parameter"):
        harts.value_step(critic, with_returns, run=faulty)


def test_harts_train_verifies_its_first_update_and_stops_on_a_failed_check(tmp_path, capsys):
    """`[run] verify` defaults to "first": update 1 is checked, and a faulty kernel stops the run
    with exit status 4 and one line, before any optimizer step or checkpoint."""
    from tests.helpers import run_train, write_config

    family = HYBRID[0]
    config = write_config(
        tmp_path / "run.toml",
        {"steps": 2},
        model={"tiny": family},
        run={"budget_tokens": 32, "linear_plan": "depth"},
    )
    assert run_train(config, tmp_path / "ok") == 0
    err = capsys.readouterr().err
    assert err.count("verified against the stock forward (fp32") == 1, err[-2000:]
    assert "step 1 verified" in err
    records = (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()
    assert '"verify_gradient_ratio"' in records[0] and '"verify_gradient_ratio"' not in records[1]
    faulty = write_config(
        tmp_path / "faulty.toml",
        {"steps": 2},
        model={"tiny": family},
        run={"budget_tokens": 32, "linear_plan": "depth", "backend": "test-off-in-backward"},
    )
    assert run_train(faulty, tmp_path / "bad") == 4
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "verification of forest_step failed" in lines[0] and "parameter" in lines[0]
    written = tmp_path / "bad" / "checkpoints"
    assert not written.exists() or not list(written.iterdir())
    never = write_config(
        tmp_path / "never.toml",
        {"steps": 1},
        model={"tiny": family},
        run={
            "budget_tokens": 32,
            "linear_plan": "depth",
            "backend": "test-off-in-backward",
            "verify": "never",
        },
    )
    assert run_train(never, tmp_path / "never") == 0  # unverified, the faulty kernel trains


def _low(model, precision: str):
    """The model and the context of a call in ``precision``: bf16 parameters, or bf16 autocast."""
    if precision == "bf16":
        return model.to(torch.bfloat16), contextlib.nullcontext()
    return model, torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("family", ["bailing_hybrid", "qwen3"])
@pytest.mark.parametrize("precision", ["bf16", "autocast"])
def test_low_precision_passes_exact_kernels_with_the_same_bits(family, precision):
    """An exact call in bf16 passes both halves of the check (the algorithm at fp32, the kernels in
    bf16) and computes the bits it computes unverified; the figures land in its metrics."""
    model, context = _low(tiny_model(family), precision)
    rollouts = batch(model.config.get_text_config().vocab_size)[:6]
    with context:
        plain = _step(model, rollouts)
        want = _grads(model)
        checked = _step(model, rollouts, verify=True)
        got = _grads(model)
    assert torch.equal(plain.loss, checked.loss)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    m = checked.metrics
    assert float(m["verify_algorithm_value_error"]) <= float(m["verify_algorithm_value_bound"])
    assert float(m["verify_algorithm_gradient_ratio"]) <= 1.0
    assert 0.0 < float(m["verify_kernel_ratio"]) <= 1.0


@pytest.mark.parametrize("family", ["bailing_hybrid", "qwen3"])
@pytest.mark.parametrize("precision", ["bf16", "autocast"])
@pytest.mark.parametrize("fault", list(LOW_FAULTS))
def test_low_precision_catches_a_faulty_attention(family, precision, fault):
    """Each fault of the bar is a verification failure in bf16: those in every precision at fp32
    (the algorithm's half), those in bf16 alone by the kernel's half; no gradient is left."""
    model, context = _low(tiny_model(family), precision)
    rollouts = batch(model.config.get_text_config().vocab_size)[:6]
    expected = (
        "its algorithm, at fp32" if not fault.startswith("bf16") else "tree attention's kernel in bfloat16"
    )
    with context, pytest.raises(harts.VerificationError, match=expected) as info:
        _step(model, rollouts, verify=True, backend=f"test-{fault}")
    assert str(info.value).startswith("verification of rollout_step ")  # the function called
    assert all(p.grad is None for p in model.parameters())


def test_an_error_names_the_function_called():
    model = tiny_model(FULL[0])
    rollouts = batch(model.config.vocab_size)[:6]
    faulty = harts.RunConfig(**{**RUN.__dict__, "verify": True, "backend": "test-off-in-forward"})
    with pytest.raises(harts.VerificationError, match="^verification of rollout_step failed"):
        harts.rollout_step(model, rollouts, LOSS, run=faulty)
    with pytest.raises(harts.VerificationError, match="^verification of forest_logprobs failed"):
        harts.forest_logprobs(model, rollouts, run=faulty)
