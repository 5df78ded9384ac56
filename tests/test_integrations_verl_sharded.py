"""verl's FSDP2 actor and critic with their parameters sharded over 2 gloo processes:
``HartsFSDPEngine`` against verl's own ``FSDPEngineWithLMHead``, and ``HartsFSDPCriticEngine``
against its ``FSDPEngineWithValueHead``, on the same micro-batches (``tests/verl_worker.py``).

Both engines are built by verl from the same checkpoint and configuration (``strategy: fsdp2``,
``reshard_after_forward`` as verl sets it, fp32); each rank trains on its own batch (two prompts
of three responses, lengths differing by rank), through verl's ``forward_backward_batch`` with
its ``ppo_loss``: token-mean with verl's dynamic micro-batches, seq-mean-token-mean with fixed
ones, and seq-mean-token-sum-norm with a harts token budget that cuts every micro-batch's tree
(verl's loss, not separable by rows, then takes harts' three passes). The critic runs verl's
``value_loss`` (clipped at ``cliprange_value`` around the batch's rollout-time values, both
branches taken) the same ways: token-mean with dynamic micro-batches, seq-mean-token-sum-norm
with fixed ones under the budget that cuts every tree.

Tolerances, in fp32 (unit roundoff u = 2^-24 ~ 6e-8):

- log-probs and entropies: both are fp32 evaluations of the same function in different orders
  (verl's packed eager attention and projections, harts' forest). The project holds fp32 log-probs
  to 1e-5 absolute against the stock forward (``tests/test_integrations_verl.py``); at
  |log p| <= ~10 that is ~17 u relative, room for the few roundings each reduction adds. The
  critic's values (|v| <= ~2 here, one linear head over the same hidden states) to the same bound.
- gradients (``full_tensor`` of the sharded ``.grad``): 1e-5 relative, as the project's
  multi-rank tests hold 2 ranks against one process (``tests/test_distributed.py``): each side's
  gradient is the same sum of the two ranks' fp32 gradients, verl's averaged by FSDP2
  (``ReduceOp.AVG``) and harts' summed of losses scaled by 1 / 2, an exact power of two.
- losses and metrics: 1e-5 relative to max(1, |value|), as the single-process verl tests; the
  optimizer step (verl's clipping and AdamW): gradient norm and parameters 1e-5 relative.

Each rank's batch differs, so a gradient missing a rank's share, or scaled by the rank count
once too often, is off by far more than these bounds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="verl runs in .venv-verl (make test-verl)")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOGPROB_ATOL = 1e-5
GRAD_RTOL = 1e-5
VALUE_RTOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's results of one 2-process run of ``tests/verl_worker.py``."""
    tmp = tmp_path_factory.mktemp("verl_sharded")
    out = tmp / "ranks.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               f"--master_port={_free_port()}", str(HERE / "verl_worker.py"), str(tmp / "model"),
               str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _variants(role: str = "actor") -> list[str]:
    from tests.verl_worker import CRITIC_VARIANTS, VARIANTS

    return [name for name, *_ in (CRITIC_VARIANTS if role == "critic" else VARIANTS)]


def _relative(want: torch.Tensor, got: torch.Tensor) -> float:
    return float((want - got).norm() / want.norm().clamp(min=1e-30))


def _close(want: float, got: float) -> bool:
    return abs(want - got) <= VALUE_RTOL * max(1.0, abs(want))


@pytest.mark.multiprocess
def test_both_engines_shard_the_parameters_as_verl_sets_them(ranks):
    """verl's engine gives an untied embedding and head units of their own; the harts engine keeps
    them in the model's unit (harts gathers it for the whole step) and shards every decoder layer
    as verl does; every matrix is sharded over the two ranks."""
    for rank in ranks:
        layers = ["model.layers.0", "model.layers.1", "model.layers.2"]
        assert rank["units"]["stock"] == ["", "model.embed_tokens", *layers, "lm_head"]
        assert rank["units"]["harts"] == ["", *layers]
        assert rank["reshard_after_forward"] is True and rank["sharded"]
        # the critic's score head is in verl's model unit already
        assert rank["critic_units"]["stock"] == ["", "model.embed_tokens", *layers]
        assert rank["critic_units"]["harts"] == ["", *layers]


@pytest.mark.multiprocess
def test_log_probs_match_verls_engine(ranks):
    """Training forward and forward-only (``infer_batch``) log-probs and entropies, predictor-indexed
    as verl's engine returns them; each sequence's last slot (never read by verl) holds 0."""
    for r, rank in enumerate(ranks):
        for name in _variants():
            stock, harts = rank[name]["stock"], rank[name]["harts"]
            assert torch.equal(stock["offsets"], harts["offsets"]), (r, name)
            last = stock["offsets"][1:] - 1
            keep = torch.ones(int(stock["offsets"][-1]), dtype=torch.bool)
            keep[last] = False
            for key in ("log_probs", "entropy", "infer_log_probs", "infer_entropy"):
                gap = float((stock[key][keep] - harts[key][keep]).abs().max())
                assert gap <= LOGPROB_ATOL, (r, name, key, gap)
                assert torch.all(harts[key][last] == 0), (r, name, key)


@pytest.mark.multiprocess
def test_critic_values_match_verls_engine(ranks):
    """Training forward and forward-only (``infer_batch``, verl's ``compute_values``) values,
    token-indexed as verl's critic engine returns them: every position, each sequence's last too."""
    for r, rank in enumerate(ranks):
        for name in _variants("critic"):
            stock, harts = rank[name]["stock"], rank[name]["harts"]
            assert torch.equal(stock["offsets"], harts["offsets"]), (r, name)
            for key in ("values", "infer_values"):
                assert stock[key].shape == harts[key].shape == (int(stock["offsets"][-1]),), (r, name, key)
                gap = float((stock[key] - harts[key]).abs().max())
                assert gap <= LOGPROB_ATOL, (r, name, key, gap)


@pytest.mark.multiprocess
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_gradients_losses_and_metrics_match_verls_engine(ranks, role):
    """Every parameter's full gradient, each micro-batch's loss and metrics (the critic's include
    its clip fraction, which must show both branches of the clipped loss taken)."""
    for r, rank in enumerate(ranks):
        for name in _variants(role):
            stock, harts = rank[name]["stock"], rank[name]["harts"]
            assert set(stock["grads"]) == set(harts["grads"]), (r, name)
            errors = {p: _relative(g, harts["grads"][p]) for p, g in stock["grads"].items()}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= GRAD_RTOL, (r, name, worst, errors[worst])
            assert len(stock["loss"]) == len(harts["loss"]) >= 2, (r, name)  # micro-batches
            assert all(_close(a, b) for a, b in zip(stock["loss"], harts["loss"], strict=True)), (r, name)
            assert set(stock["metrics"]) == set(harts["metrics"]), (r, name)
            for metric, values in stock["metrics"].items():
                got = harts["metrics"][metric]
                assert len(values) == len(got) and all(map(_close, values, got)), (r, name, metric)
    # the two ranks trained on different batches: their losses differ, their gradients are one
    first, second = (rank[_variants(role)[0]]["harts"] for rank in ranks)
    assert first["loss"] != second["loss"]
    assert all(torch.equal(g, second["grads"][p]) for p, g in first["grads"].items())
    if role == "critic":
        fractions = [
            rank[n]["harts"]["metrics"]["critic/vf_clipfrac"] for rank in ranks for n in _variants(role)
        ]
        assert any(0 < f < 1 for run in fractions for f in run), fractions


@pytest.mark.multiprocess
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_budget_cut_every_tree_and_the_optimizer_step_matches(ranks, role):
    name = _variants(role)[-1]
    for r, rank in enumerate(ranks):
        assert all(c > 0 for c in rank[name]["cuts"]), (r, rank[name]["cuts"])
        stock, harts = rank[name]["stock"], rank[name]["harts"]
        assert _relative(torch.tensor(stock["grad_norm"]), torch.tensor(harts["grad_norm"])) <= VALUE_RTOL
        errors = {p: _relative(v, harts["params"][p]) for p, v in stock["params"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= VALUE_RTOL, (r, worst, errors[worst])


@pytest.mark.multiprocess
def test_what_the_sharded_engine_cannot_run_exactly_is_refused(ranks):
    expected = {
        "fsdp1": "strategy 'fsdp': harts runs verl's FSDP2 engine",
        "ulysses": "ulysses_sequence_parallel_size=2: harts keeps each sequence on one rank",
        "hsdp": "fsdp_size=1 of 2 ranks (hybrid sharding",
        "fp16": "mixed_precision.param_dtype fp16",
        "critic-fsdp1": "strategy 'fsdp': harts runs verl's FSDP2 engine",
    }
    for rank in ranks:
        for case, start in expected.items():
            assert rank["refusals"][case].startswith(start), (case, rank["refusals"][case])
