"""The whole RL recipe of ``harts train`` under torchrun (gloo, CPU), against one process.

One config holds every section that runs a forward-only pass or a second model: ``[reference]``
(the KL term's log-probs), ``[ppo]`` (old log-probs computed by the trainer, 2 epochs x 2
mini-batches of whole groups) and ``[critic]`` (its values, GAE, its updates), under a token
budget that cuts trees. The same run on 2 and 4 ranks, DDP and FSDP2, ends with the policy and
the critic of one process, and resumes bit for bit from a checkpoint written between two
updates of a step.

Bounds: a rank runs a sub-forest of the step's, cut into other micro-batches than one process
cuts the whole forest: each side's fp32 gradient is within the exactness bound (1e-4 relative,
tests/reference.py) of the exact one, so within ``LAYOUT_RTOL`` (2e-4) of each other, as
test_distributed.py bounds two layouts. A norm of a whole gradient and a loss of positive terms
(the value loss) do not cancel: they are held to ``GRAD_RTOL`` (1e-5), the same sums in another
order. To read the gradients off the weights, AdamW runs with ``eps`` far above every ``sqrt(v)``
(``|g| < 20``, ``eps = 1e4``): its update is then ``lr / eps`` times the bias-corrected first
moment, a positive combination of the updates' gradients, with no clipping and no weight decay,
so each tensor's change over the run (four updates) is off by the gradients' relative error
(times ``1 + 2e-3``, the ``sqrt(v) / eps`` left in the update). Same world size, same threads: a
resumed run's files are the same bytes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import one_thread, run_train, write_config, write_small_rollouts  # noqa: F401 (fixture)
from tests.test_distributed import _relative, _torchrun

GRAD_RTOL = 1e-5
LAYOUT_RTOL = 2e-4
FAMILY = "qwen3_next"  # Gated DeltaNet + gated attention, MoE: a hybrid in every transformers harts takes
CRITIC = "critic"
# AdamW whose update is linear in the gradients (module docstring): effectively lr 1e-3, momentum 0.9
LINEAR_ADAMW = {"lr": 10.0, "eps": 1e4, "weight_decay": 0.0}


def _config(tmp_path: Path, strategy: str, every: int = 2) -> Path:
    data = write_small_rollouts(tmp_path / "small.jsonl", groups=4)  # 12 rollouts: one step
    return write_config(
        tmp_path / f"recipe-{strategy}.toml",
        {"steps": 1, "max_grad_norm": 0},
        {
            "model": {"tiny": FAMILY},
            "data": {"path": str(data), "rollouts_per_step": 12},
            "objective": {"kind": "ppo", "advantage": "gae", "advantage_params": {"gamma": 0.99, "lam": 0.9},
                          "kl_coef": 0.05},  # fmt: skip
            "reference": {"model": "initial"},
            "ppo": {"epochs": 2, "mini_batches": 2},
            "critic": {"model": "policy", **LINEAR_ADAMW, "max_grad_norm": 0},
            "run": {"budget_tokens": 24},
            "optimizer": LINEAR_ADAMW,
            "checkpoint": {"every": every, "keep_last": 10},
            "distributed": {"strategy": strategy, "timeout_s": 120},
            "logging": {"plot": False},
        },
    )


def _final(out: Path) -> Path:
    return sorted((out / "checkpoints").glob("step-*"))[-1]


def _weights(checkpoint: Path) -> tuple[dict, dict]:
    return load_file(checkpoint / "model.safetensors"), load_file(checkpoint / CRITIC / "model.safetensors")


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _close(want: dict, got: dict, start: dict, what: str) -> None:
    """Each tensor's change over the run against one process's (module docstring)."""
    assert set(want) == set(got), what
    for name, w in want.items():
        moved = w.double() - start[name].double()
        error = _relative(moved, got[name].double() - start[name].double())
        assert error < LAYOUT_RTOL, (what, name, error)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The recipe on one process (its output directory), shared by the cases."""
    tmp = tmp_path_factory.mktemp("one")
    out = tmp / "out"
    assert run_train(_config(tmp, "ddp"), out) == 0
    return out


def _check_against(one: Path, out: Path) -> None:
    checkpoints = sorted((one / "checkpoints").glob("step-*"))
    policy, critic = _weights(checkpoints[-1])
    got_policy, got_critic = _weights(_final(out))
    start_policy, start_critic = _initial(one)
    assert all(not torch.equal(start_policy[k], policy[k]) for k in policy if "layers.0.mlp" in k)
    _close(policy, got_policy, start_policy, "policy")
    _close(critic, got_critic, start_critic, "critic")
    want, got = _records(one), _records(out)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for w, g in zip(want, got, strict=True):
        assert (w["ppo_epoch"], w["mini_batch"]) == (g["ppo_epoch"], g["mini_batch"])
        for key, rtol in (("loss", LAYOUT_RTOL), ("grad_norm", GRAD_RTOL), ("value_loss", GRAD_RTOL),
                          ("critic_grad_norm", GRAD_RTOL)):  # fmt: skip
            assert abs(w[key] - g[key]) <= rtol * abs(w[key]), (g["step"], key, w[key], g[key])


def _initial(one: Path) -> tuple[dict, dict]:
    """The starting weights of the policy and the critic, as the runs load them, in the files'
    layout (``save_pretrained`` may store a fused tensor as several)."""
    from harts.trainer.config_files import load_config
    from harts.trainer.critic import load_critic, save_critic
    from harts.trainer.inputs import load_model

    config = load_config(one.parent / "recipe-ddp.toml")
    start = one.parent / "start"
    if not start.is_dir():
        load_model(config.model, config.seed).save_pretrained(start, safe_serialization=True)
        save_critic(load_critic(config.critic, config.model, config.seed), start / CRITIC)
    return _weights(start)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy,nproc", [("ddp", 2), ("fsdp", 2), ("fsdp", 4)],
                         ids=["ddp-2", "fsdp-2", "fsdp-4"])  # fmt: skip
def test_reference_ppo_and_critic_on_ranks_end_where_one_process_does(strategy, nproc, one_process, tmp_path):
    out = tmp_path / "out"
    done = _torchrun("-m", "harts", "train", str(_config(tmp_path, strategy)), "--out", str(out), nproc=nproc,
                     timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{nproc} ranks ({strategy}" in done.stderr
    _check_against(one_process, out)
    if strategy == "fsdp":  # each rank wrote its shard of the policy's and the critic's state
        final = _final(out)
        assert len(list((final / "state").glob("*.distcp"))) == nproc
        assert len(list((final / CRITIC / "state").glob("*.distcp"))) == nproc


@pytest.mark.multiprocess
def test_a_run_on_ranks_resumes_between_two_updates_bit_for_bit(tmp_path):
    """Checkpoints after every update; the run resumed on 2 ranks from the one after update 1 (old
    log-probs and critic values of the step saved there) writes the same bytes; resumed on one
    process (the policy's and the critic's state resharded), the same weights to rounding."""
    config = _config(tmp_path, "fsdp", every=1)
    first = tmp_path / "first"
    done = _torchrun("-m", "harts", "train", str(config), "--out", str(first), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(first), str(resumed)], check=True)
    for name in ("step-000002", "step-000003", "step-000004"):
        subprocess.run(["rm", "-r", str(resumed / "checkpoints" / name)], check=True)
    state = torch.load(resumed / "checkpoints" / "step-000001" / "trainer_state.pt", weights_only=True)
    assert len(state["old_logprobs"]) == len(state["critic_values"]) == 12
    done = _torchrun("-m", "harts", "train", str(config), "--out", str(resumed), "--resume", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "step-000001" in done.stderr
    for name in ("model.safetensors", f"{CRITIC}/model.safetensors"):
        want = (first / "checkpoints" / "step-000004" / name).read_bytes()
        assert (resumed / "checkpoints" / "step-000004" / name).read_bytes() == want, name
    # on one process from the same checkpoint: the policy's and the critic's state resharded
    alone = tmp_path / "alone"
    subprocess.run(["cp", "-r", str(resumed), str(alone)], check=True)
    for name in ("step-000002", "step-000003", "step-000004"):
        subprocess.run(["rm", "-r", str(alone / "checkpoints" / name)], check=True)
    assert run_train(config, alone, "--resume") == 0
    checkpoints = first / "checkpoints"
    start, want = _weights(checkpoints / "step-000001"), _weights(checkpoints / "step-000004")
    got = _weights(alone / "checkpoints" / "step-000004")
    for i, what in enumerate(("policy", "critic")):
        _close(want[i], got[i], start[i], what)


@pytest.mark.multiprocess
def test_a_rank_that_dies_in_the_reference_pass_stops_the_other(tmp_path):
    """Rank 1 dies (SIGKILL) at its first decoder-layer gather, which under FSDP2 is in the
    reference's forward-only pass, before any update; rank 0, inside that pass's gathers, fails
    with the run's message (exit status 3) long before distributed.timeout_s."""
    from tests.test_distributed import lose_rank_one

    config = _config(tmp_path, "fsdp")
    line, code, stderr, waited = lose_rank_one(config, tmp_path / "run", "die", 1, 240)
    assert "layer gather 1" in line and "forward" in line, line
    assert code == 3, stderr[-3000:]
    assert "a collective with the other ranks failed" in stderr, stderr[-3000:]
    assert "step 1/" not in stderr  # it stopped in the passes, before the first update
    assert waited < 60, waited  # a closed connection is seen at once (timeout_s is 120)
