"""Data-parallel training with real processes (gloo on CPU): DDP and FSDP2 steps equal one
process's, trees to ranks, checkpoints across world sizes, a dead rank.

Each multi-process case starts ``torch.distributed.run`` (or two plain processes) on this
machine; the single-process reference runs in the test's own process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import harts
from harts.plan.ranks import RankCost, assign_trees
from harts.runtime.distributed import close_process_group
from harts.tiny import FAMILIES, tiny_model
from tests.distributed_worker import VARIANTS, reference, variants_for
from tests.helpers import one_thread, write_config  # noqa: F401 (fixture)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# one step on 2 ranks against 1 process, fp32: gradients are sums in another order
GRAD_RTOL = 1e-5
PARAM_RTOL = 1e-5
# the same against one process whose micro-batch holds every tree: each side's fp32 gradient is
# within the exactness bound (1e-4 relative, tests/reference.py) of the exact one, so within twice
# that of each other
LAYOUT_RTOL = 2e-4
# FSDP2 against DDP on the same ranks: the same local work, the same sums of two terms per element
SAME_WORK_RTOL = 1e-6
STEP_FAMILIES = [f for f in ("bailing_hybrid", "qwen3_next") if f in FAMILIES]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    env.pop("WORLD_SIZE", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", *args]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp(min=1e-30))


def _check_against_one_process(family: str, results: dict) -> None:
    """Each variant's step on the ranks against the same step on one process: loss, gradients
    (the same parameters have one), parameters after AdamW, expert counts."""
    for name, got in results.items():
        variant = VARIANTS[name]
        if variant.baseline is not None:
            want, grad_rtol, param_rtol = results[variant.baseline], SAME_WORK_RTOL, SAME_WORK_RTOL
        else:
            want = reference(family, variant)
            whole = variant.run.budget_tokens is None
            grad_rtol, param_rtol = (LAYOUT_RTOL, LAYOUT_RTOL) if whole else (GRAD_RTOL, PARAM_RTOL)
        assert torch.allclose(got["loss"], want["loss"], rtol=1e-6, atol=0), (name, got["loss"], want["loss"])
        grads = {n: g for n, g in want["grads"].items() if g is not None}
        assert {n for n, g in got["grads"].items() if g is not None} == set(grads), name
        for param, g in grads.items():
            error = _relative(g, got["grads"][param])
            assert error < grad_rtol, (name, param, error)
        for param, p in want["params"].items():
            assert _relative(p, got["params"][param]) < param_rtol, (name, param)
        if "expert_counts" in want:
            assert torch.equal(got["expert_counts"], want["expert_counts"]), name
        if "aux_loss" in want:
            assert torch.allclose(got["aux_loss"], want["aux_loss"], rtol=1e-6, atol=0), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", STEP_FAMILIES)
def test_one_step_on_two_ranks_equals_one_process(family, tmp_path):
    """DDP, and FSDP2 with its units gathered one at a time on every path of the step: cut trees
    whose parts run again or keep their graphs, the three passes, gradient checkpointing,
    recomputed linear attention, MoE statistics, one micro-batch a rank."""
    out = tmp_path / "ranks.pt"
    done = _torchrun(str(HERE / "distributed_worker.py"), "step", family, str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(out, weights_only=True)
    assert set(results) == set(variants_for(family))
    _check_against_one_process(family, results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", [f for f in ("glm5_next", "qwen4_exp") if f in FAMILIES])
def test_sparse_hybrids_on_two_ranks_equal_one_process(family, tmp_path):
    """The sparse-attention hybrids (indexer selections, hyper-connection streams, glm5_next as its
    multimodal model's language model) under DDP and FSDP2, whole and cut, units one at a time."""
    out = tmp_path / "ranks.pt"
    variants = ("ddp", "fsdp", "fsdp-one-unit", "fsdp-held")
    done = _torchrun(str(HERE / "distributed_worker.py"), "step", family, str(out), *variants)
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(out, weights_only=True)
    assert set(results) == set(variants)
    _check_against_one_process(family, results)


@pytest.mark.multiprocess
def test_one_step_on_four_ranks_equals_one_process(tmp_path):
    """Four ranks, five trees: ranks with one tree and ranks with two stand in for each other's
    forwards and backwards."""
    family = STEP_FAMILIES[-1]
    out = tmp_path / "ranks.pt"
    variants = ("fsdp", "fsdp-held", "fsdp-moe-aux")
    done = _torchrun(str(HERE / "distributed_worker.py"), "step", family, str(out), *variants, nproc=4)
    assert done.returncode == 0, done.stderr[-3000:]
    _check_against_one_process(family, torch.load(out, weights_only=True))


@pytest.mark.multiprocess
def test_a_sharded_step_holds_two_layer_units_at_a_time_and_only_shards_after(tmp_path):
    """What an FSDP2 rank holds, counted: during the step two decoder-layer units are whole at a
    time (the running layer's and the next one's, being gathered), on every path, and one without
    prefetching; after it every unit is sharded again and the rank holds its shards of the
    parameters and of the gradients, about 1/N of the whole model each (dim-0 chunks: a tensor
    with fewer rows than ranks is padded)."""
    out = tmp_path / "units.pt"
    names = ["fsdp", "fsdp-held", "fsdp-gspo", "fsdp-checkpointing", "fsdp-one-unit"]
    done = _torchrun(str(HERE / "distributed_worker.py"), "units", STEP_FAMILIES[-1], str(out), *names)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank, held in enumerate(torch.load(out, weights_only=True)):
        for name, figures in held.items():
            assert figures["layers"] >= 3, figures
            whole = 1 if name == "fsdp-one-unit" else 2
            assert figures["most_layer_units_whole"] == whole, (rank, name, figures)
            assert figures["still_whole"] == 0, (rank, name, figures)
            share = figures["whole_bytes"] / 2
            assert 0.9 * share <= figures["param_bytes"] <= 1.1 * share, (rank, name, figures)
            assert figures["grad_bytes"] <= 1.1 * share, (rank, name, figures)


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [2, 3])
def test_muon_on_sharded_matrices_is_muon_on_the_whole_ones(nproc, tmp_path):
    """Each matrix's update is gathered and orthogonalised whole, by torch.optim.Muon's own
    Newton-Schulz function: the same bits as one process on the same gradients (3 ranks: rows
    that do not divide evenly)."""
    out = tmp_path / "muon.pt"
    done = _torchrun(str(HERE / "distributed_worker.py"), "muon", "qwen3", str(out), nproc=nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    for gaps in torch.load(out, weights_only=True):
        assert len(gaps) >= 5 and "odd.weight" in gaps, gaps
        assert all(gap == 0.0 for gap in gaps.values()), gaps


def _skewed_forest():
    """Trees whose token counts and work disagree: 2 long single trajectories (500 tokens, long
    attention paths) and 6 wide trees (a 20-token prompt, 29 branches of 20 tokens: 600 tokens)."""
    g = torch.Generator().manual_seed(0)
    trajectories = [torch.randint(1, 100, (500,), generator=g).tolist() for _ in range(2)]
    for _ in range(6):
        prompt = torch.randint(1, 100, (20,), generator=g).tolist()
        trajectories += [prompt + torch.randint(1, 100, (20,), generator=g).tolist() for _ in range(29)]
    return harts.build_forest(trajectories)


def test_trees_to_ranks_balance_cost_and_keep_trees_whole():
    forest = _skewed_forest()
    cost = RankCost(per_token=1.0, per_key=0.01)
    by_cost = assign_trees(forest, 4, cost)
    by_tokens = assign_trees(forest, 4)
    for plan in (by_cost, by_tokens):
        assert sorted(i for r in plan.trajectories for i in r) == list(range(forest.num_trajectories))
        # the long trajectories (500 tokens, the costliest work) each on a rank of their own
        assert {i for r in plan.trajectories for i in r if i < 2} == {0, 1}
    token_plan_costs = _costs(forest, by_tokens, cost)
    token_imbalance = max(token_plan_costs) / (sum(token_plan_costs) / 4)
    # measured: 1.019 (two wide trees divided at their branches) against 1.242
    assert by_cost.imbalance < 1.05 and token_imbalance > 1.2, (by_cost.imbalance, token_imbalance)
    assert _costs(forest, by_cost, cost) == pytest.approx(by_cost.cost)


def test_one_tree_is_divided_at_its_branches_only_when_ranks_would_idle():
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 100, (50,), generator=g).tolist()
    branches = [torch.randint(1, 100, (30,), generator=g).tolist() for _ in range(6)]
    forest = harts.build_forest([prompt + b for b in branches])
    plan = assign_trees(forest, 2)
    assert plan.divided == 1 and sorted(map(len, plan.trajectories)) == [3, 3]
    assert plan.cost == [50 + 90, 50 + 90]  # each rank recomputes the prompt once
    assert assign_trees(forest, 1).divided == 0
    with pytest.raises(ValueError, match="3 trajectories for 4 ranks"):
        assign_trees(harts.build_forest([[1, 2], [1, 3], [4]]), 4)


def _costs(forest, assignment, cost):
    """Each rank's cost measured on the forest of its own trajectories."""
    out = []
    for trajectories in assignment.trajectories:
        sub = harts.build_forest([forest.trajectory(i).tolist() for i in trajectories])
        out.append(assign_trees(sub, 1, cost).cost[0])
    return out


def test_wrappers_harts_cannot_run_are_refused(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = tiny_model("qwen3", seed=0)
        rollouts = [harts.Rollout([1, 2, 3, 4], loss_mask=[0, 1, 1, 1])]
        plain = harts.rollout_step(model, rollouts, harts.PolicyLossConfig(kind="sft"))
        grads = [p.grad.clone() for p in model.parameters()]
        sharded = tiny_model("qwen3", seed=0)
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        with pytest.raises(ValueError, match="sharded by fully_shard.*rollout_step"):
            harts.forward(sharded, harts.build_forest([[1, 2, 3]]))
        result = harts.rollout_step(sharded, rollouts, harts.PolicyLossConfig(kind="sft"))
        assert torch.equal(result.loss, plain.loss)
        for g, p in zip(grads, sharded.parameters(), strict=True):
            assert torch.equal(g, p.grad.full_tensor())
        head_sharded = tiny_model("qwen3", seed=0)
        fully_shard(head_sharded.model.embed_tokens)
        with pytest.raises(ValueError, match="fully_shard was applied to model.embed_tokens"):
            harts.rollout_step(head_sharded, rollouts, harts.PolicyLossConfig(kind="sft"))
    finally:
        close_process_group(wait=False)


def _train_config(tmp_path: Path, optimizer: str = "adamw", **top) -> Path:
    return write_config(
        tmp_path / "train.toml",
        {"steps": 4, **top},
        objective={"kind": "ppo", "advantage": "grpo"},
        optimizer={"kind": optimizer, "lr": 1e-3},
        checkpoint={"every": 2, "keep_last": 3},
        distributed={"strategy": "fsdp", "timeout_s": 60},
    )


def _params(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(checkpoint / "model.safetensors")


@pytest.mark.multiprocess
def test_save_on_two_ranks_resume_on_one_and_on_two(tmp_path):
    config = _train_config(tmp_path)
    two = tmp_path / "two"
    done = _torchrun("-m", "harts", "train", str(config), "--out", str(two))
    assert done.returncode == 0, done.stderr[-3000:]
    final = two / "checkpoints" / "step-000004"
    assert (final / "state").is_dir() and len(list((final / "state").glob("*.distcp"))) == 2
    for ranks, name in ((1, "one"), (2, "again")):
        resumed = tmp_path / name
        subprocess.run(["cp", "-r", str(two), str(resumed)], check=True)
        subprocess.run(["rm", "-r", str(resumed / "checkpoints" / "step-000004")], check=True)
        args = ["-m", "harts", "train", str(config), "--out", str(resumed), "--resume"]
        done = (_torchrun(*args) if ranks == 2 else
                subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                               timeout=240))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resuming from" in done.stderr and "step-000002" in done.stderr
        got = resumed / "checkpoints" / "step-000004" / "model.safetensors"
        if ranks == 2:  # same world size: bit for bit
            assert got.read_bytes() == (final / "model.safetensors").read_bytes()
        else:  # resharded: the same to rounding
            assert "written by 2 rank(s), this run has 1" in done.stderr
            want, have = _params(final), _params(got.parent)
            assert all(_relative(want[k], have[k]) < PARAM_RTOL for k in want)


@pytest.mark.multiprocess
def test_muon_under_fsdp_trains_and_resumes_bit_for_bit(tmp_path):
    """Muon's momentum buffers are sharded like its matrices and checkpointed with them."""
    config = _train_config(tmp_path, optimizer="muon")
    first = tmp_path / "first"
    done = _torchrun("-m", "harts", "train", str(config), "--out", str(first))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "muon on" in done.stderr, done.stderr[-3000:]
    final = first / "checkpoints" / "step-000004"
    resumed = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(first), str(resumed)], check=True)
    subprocess.run(["rm", "-r", str(resumed / "checkpoints" / "step-000004")], check=True)
    done = _torchrun("-m", "harts", "train", str(config), "--out", str(resumed), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    start, end = _params(first / "checkpoints" / "step-000002"), _params(final)
    assert all(not torch.equal(start[k], end[k]) for k in end if "layers.0.mlp" in k)
    got = resumed / "checkpoints" / "step-000004" / "model.safetensors"
    assert got.read_bytes() == (final / "model.safetensors").read_bytes()


def _two_ranks(commands: list[list[str]]) -> list[subprocess.Popen]:
    """Rank 0 and rank 1 of one process group, each its own command and process session."""
    port = _free_port()
    procs = []
    for rank, command in enumerate(commands):
        env = {**_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(commands)),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))  # fmt: skip
    return procs


@pytest.mark.multiprocess
def test_a_dead_rank_stops_the_others_and_the_run_resumes(tmp_path):
    config = _train_config(tmp_path, steps=12)
    out = tmp_path / "run"
    harts = [sys.executable, "-m", "harts", "train", str(config), "--out", str(out)]
    procs = _two_ranks([harts, harts])
    deadline = time.monotonic() + 180
    while not (out / "checkpoints" / "step-000002").is_dir():
        assert time.monotonic() < deadline and procs[0].poll() is None, "no checkpoint was written"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = procs[0].communicate(timeout=120)
    waited = time.monotonic() - killed_at
    procs[1].communicate()
    assert procs[0].returncode == 3, stderr[-3000:]
    assert "a collective with the other ranks failed" in stderr and "--resume" in stderr
    assert waited < 60  # the timeout bounds it; a closed connection is seen at once
    command = [sys.executable, "-m", "harts", "train", str(config), "--out", str(out), "--resume"]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and (out / "checkpoints" / "step-000012").is_dir()


# a hung rank's peers wait this long in a collective before failing (distributed.timeout_s)
HUNG_TIMEOUT_S = 20


def lose_rank_one(config: Path, out: Path, fault: str, gather: int,
                  timeout: float) -> tuple[str, int, str, float]:  # fmt: skip
    """``harts train`` on two ranks whose rank 1 runs tests/fault_worker.py (``fault`` at its
    ``gather``-th decoder-layer gather): (rank 1's line saying where it stopped, rank 0's exit
    status and stderr, seconds rank 0 took to stop after that line)."""
    harts_args = ["train", str(config), "--out", str(out)]
    faulty = [sys.executable, str(HERE / "fault_worker.py"), fault, str(gather), *harts_args]
    procs = _two_ranks([[sys.executable, "-m", "harts", *harts_args], faulty])
    try:
        line, deadline = "", time.monotonic() + 180
        while "fault_worker:" not in line:  # rank 1 says where it stops before it does
            assert time.monotonic() < deadline and procs[1].poll() in (None, -signal.SIGKILL), "no fault"
            line = procs[1].stderr.readline()
            assert line or procs[1].poll() is None, "rank 1 ended before its fault"
        lost_at = time.monotonic()
        _, stderr = procs[0].communicate(timeout=timeout)
        waited = time.monotonic() - lost_at
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return line, procs[0].returncode, stderr, waited


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault, gather, phase", [("die", 1, "forward"), ("die", 7, "backward"),
                                                  ("hang", 7, "backward")],
                         ids=["dies-first-forward-gather", "dies-backward-gather", "hangs-backward-gather"])
def test_a_rank_lost_inside_a_layer_gather_stops_the_other_within_the_timeout(fault, gather, phase, tmp_path):
    """Rank 1 dies (SIGKILL) or hangs right before its share of a decoder-layer unit's all-gather
    (the 1st: the first layer's forward in step 1; the 7th: one in a part's backward, as the rank
    reports); rank 0, already inside that gather, fails with the run's message within
    distributed.timeout_s: at once for a closed connection, at the timeout for a silent peer."""
    config = _train_config(tmp_path, steps=4)
    text = config.read_text().replace("timeout_s = 60", f"timeout_s = {HUNG_TIMEOUT_S}")
    config.write_text(text)
    assert f"timeout_s = {HUNG_TIMEOUT_S}" in text
    out = tmp_path / "run"
    line, code, stderr, waited = lose_rank_one(config, out, fault, gather, HUNG_TIMEOUT_S + 120)
    assert f"{fault} at layer gather {gather}" in line and f", {phase})" in line, line
    assert code == 3, stderr[-3000:]
    assert "a collective with the other ranks failed" in stderr and "--resume" in stderr, stderr[-3000:]
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("*.tmp*"))
    if fault == "die":  # a closed connection is seen at once, long before the timeout
        assert waited < HUNG_TIMEOUT_S / 2, waited
    else:  # only the timeout ends the wait, and it does
        assert HUNG_TIMEOUT_S * 0.9 < waited < HUNG_TIMEOUT_S + 60, waited


@pytest.mark.multiprocess
def test_bad_data_stops_every_rank_with_one_message(tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = (ROOT / "examples" / "rollouts.jsonl").read_text().splitlines()
    broken = '{"tokens": [1, 2, 99999999], "reward": 1.0}'
    bad.write_text("\n".join([*lines[:8], broken, *lines[8:]]) + "\n")
    config = write_config(tmp_path / "bad.toml", {"steps": 2}, distributed={"timeout_s": 60},
                          data={"path": str(bad), "rollouts_per_step": 9})  # fmt: skip
    done = _torchrun("-m", "harts", "train", str(config), "--out", str(tmp_path / "out"))
    assert done.returncode != 0
    messages = {line.split("]:", 1)[-1].strip() for line in done.stderr.splitlines()
                if "harts train: error:" in line}  # fmt: skip
    assert len(messages) == 1 and "99999999" in messages.pop(), done.stderr[-3000:]
