"""Kill a run, resume it, and get the weights of a run that was never interrupted, bit for bit.

A real ``harts train`` process is killed with SIGKILL right after a checkpoint appears (no
handler runs, whatever it was writing stays half-written); ``--resume`` must pick the newest
complete checkpoint, ignore what the kill left (and a partial save planted beside it), and finish
with a ``model.safetensors`` byte-identical to an uninterrupted run's. Ctrl-C (SIGINT) must exit
130 and leave the newest checkpoint complete.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from harts.cli import main as harts_main
from harts.tiny import FAMILIES
from harts.trainer.checkpoint import latest, list_checkpoints
from harts.trainer.config_files import load_config
from harts.trainer.inputs import load_model, quiet_transformers, rollout_steps
from harts.trainer.loop import train
from harts.trainer.optim import build_optimizers
from harts.trainer.policy_step import train_step
from tests.helpers import (
    ROOT,
    kill_after,
    needs_bf16_attention,
    one_thread,  # noqa: F401 (autouse: one thread)
    start_train,
    wait_for,
    write_config,
)
from tests.test_distributed import _free_port

STEPS = 16


def _config(tmp_path):
    """PPO with GRPO advantages, Muon and a cosine schedule: every state a resume must restore."""
    return write_config(tmp_path / "run.toml", {"steps": STEPS}, **SECTIONS)


SECTIONS = dict(
    objective={"kind": "ppo", "advantage": "grpo"},
    optimizer={"kind": "muon", "lr": 1e-3},
    schedule={"kind": "cosine", "warmup_steps": 2},
    checkpoint={"every": 1, "keep_last": 2},
    logging={"every": 4},
)


def test_resume_after_sigkill_is_bit_identical(tmp_path, capsys):
    config = _config(tmp_path)
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    kill_after(config, killed, "step-000002")
    done = [c.step for c in list_checkpoints(killed / "checkpoints")]
    assert done and done[-1] < STEPS  # the kill landed mid-run
    # a save the kill cut short, for a later step than any complete one: never read
    partial = killed / "checkpoints" / f".tmp-step-{STEPS - 1:06d}"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")

    harts_main(["train", str(config), "--out", str(killed), "--resume"])
    newest = killed / "checkpoints" / f"step-{done[-1]:06d}"
    assert f"resuming from {newest} (step {done[-1]})" in capsys.readouterr().err
    harts_main(["train", str(config), "--out", str(straight)])

    final = f"step-{STEPS:06d}"
    a = (killed / "checkpoints" / final / "model.safetensors").read_bytes()
    b = (straight / "checkpoints" / final / "model.safetensors").read_bytes()
    assert a == b
    for name in ("trainer_state.pt", "state.json"):  # optimizer, scheduler, RNG, position too
        sa = (killed / "checkpoints" / final / name).read_bytes()
        sb = (straight / "checkpoints" / final / name).read_bytes()
        assert sa == sb if name != "state.json" else _without_times(sa) == _without_times(sb)
    assert not partial.exists() and not [
        p for p in (killed / "checkpoints").iterdir() if p.name.startswith(".")
    ]
    # the metrics read as one run: every step once, in order, equal to the uninterrupted run's losses
    lines = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in lines] == [r["loss"] for r in reference]


def _without_times(raw: bytes) -> dict:
    state = json.loads(raw)
    state["position"].pop("seconds")
    return state


def test_ctrl_c_exits_130_and_keeps_the_last_checkpoint(tmp_path):
    config = _config(tmp_path)
    out = tmp_path / "out"
    process = start_train(config, out)
    wait_for(process, out / "checkpoints" / "step-000002")
    process.send_signal(signal.SIGINT)
    _, err = process.communicate()
    assert process.returncode == 130, err[-2000:]
    newest = latest(out / "checkpoints")  # verified against its manifest
    assert newest is not None and newest.step < STEPS
    assert f"the last complete checkpoint is {newest.path} (continue with --resume)" in err
    assert "Traceback" not in err
    assert os.path.exists(newest.path / "model.safetensors")


def test_sigterm_exits_143_naming_the_last_checkpoint(tmp_path):
    config = _config(tmp_path)
    out = tmp_path / "out"
    process = start_train(config, out)
    wait_for(process, out / "checkpoints" / "step-000002")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate()
    assert process.returncode == 143, err[-2000:]
    newest = latest(out / "checkpoints")
    assert newest is not None and "stopped by SIGTERM at step" in err
    assert f"the last complete checkpoint is {newest.path} (continue with --resume)" in err
    assert "Traceback" not in err


@pytest.mark.multiprocess
def test_every_rank_torchrun_stops_names_itself_and_the_last_checkpoint(tmp_path):
    """torchrun stops every rank with SIGTERM when one fails (here: when the job is stopped): each
    rank prints one line naming itself and the checkpoint to resume from, and exits 143."""
    config = write_config(
        tmp_path / "run.toml", {"steps": STEPS}, **SECTIONS, distributed={"strategy": "ddp", "timeout_s": 60}
    )
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        "-m",
        "harts",
        "train",
        str(config),
        "--out",
        str(out),
    ]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(process, out / "checkpoints" / "step-000002", timeout=180)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    newest = latest(out / "checkpoints")
    assert newest is not None
    for rank in (0, 1):
        assert f"rank {rank} of 2: stopped by SIGTERM at step" in err, err[-3000:]
    assert f"the last complete checkpoint is {newest.path} (continue with --resume)" in err


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_loaded_from_a_checkpoint_computes_the_same_bits(family, tmp_path):
    """The model a resume loads must give the gradients of the model that wrote the checkpoint,
    bit for bit. Loading leaves tensors at unaligned offsets, where CPU kernels take other
    vectorised paths and reductions change in their low-order bits; the loader re-homes them."""
    config = load_config(
        write_config(tmp_path / "run.toml", {"steps": STEPS}, **SECTIONS, model={"tiny": family})
    )
    steps = list(rollout_steps(config.data))
    model = load_model(config.model, seed=0)
    optim, _ = build_optimizers(model, config.optimizer, config.schedule, 4)
    loss, run = config.objective.loss_config(), config.run.run_config()
    for batch in steps[:3]:  # trained weights, not the initial ones
        train_step(model, batch, config.objective, loss, run, None)
        optim.step()
        optim.zero_grad()
    with quiet_transformers():
        model.save_pretrained(tmp_path / "checkpoint")
    loaded = load_model(config.model, seed=0, checkpoint=tmp_path / "checkpoint")
    assert all(t.data_ptr() % 64 == 0 for t in [*loaded.parameters(), *loaded.buffers()])
    for m in (model, loaded):
        train_step(m, steps[1], config.objective, loss, run, None)
    grads = dict(loaded.named_parameters())
    same = lambda a, b: (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))  # noqa: E731
    assert all(same(p.grad, grads[n].grad) for n, p in model.named_parameters())


def _dcp_state(checkpoint) -> dict:
    """A checkpoint's ``state/`` (torch.distributed.checkpoint) read whole, as one dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint / ".." / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint / "state", target)
    return torch.load(target, weights_only=True)


@needs_bf16_attention
def test_bf16_resume_restores_the_fp32_masters_bit_for_bit(tmp_path, capsys):
    """A bf16 run at a learning rate whose updates mostly fall below half a bf16 ulp: what it has
    learnt lives in the fp32 masters, so a resume that restarted from the bf16 weights would end
    elsewhere. Stopped after 2 of 4 steps (a run of 2 steps, then resumed to 4) it must end with
    the uninterrupted run's bf16 model, masters and optimizer state, bit for bit."""
    sections = dict(
        model={"tiny": "llama", "dtype": "bfloat16"},
        optimizer={"kind": "muon", "lr": 1e-5},
        schedule={"warmup_steps": 2},
        checkpoint={"every": 1, "keep_last": 4},
    )
    short = write_config(tmp_path / "short.toml", {"steps": 2}, **sections)
    whole = write_config(tmp_path / "whole.toml", {"steps": 4}, **sections)
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    harts_main(["train", str(short), "--out", str(stopped)])
    pure = write_config(
        tmp_path / "pure.toml",
        {"steps": 4},
        **{**sections, "optimizer": {**sections["optimizer"], "master_weights": False}},
    )
    with pytest.raises(ValueError, match="resume with the model.dtype and optimizer.master_weights"):
        train(load_config(pure), stopped, resume=True, log=io.StringIO())
    harts_main(["train", str(whole), "--out", str(stopped), "--resume"])
    assert "resuming from" in capsys.readouterr().err
    harts_main(["train", str(whole), "--out", str(straight)])

    final = f"step-{4:06d}"
    a, b = stopped / "checkpoints" / final, straight / "checkpoints" / final
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "trainer_state.pt").read_bytes() == (b / "trainer_state.pt").read_bytes()
    sa, sb = _dcp_state(a), _dcp_state(b)
    assert sa.keys() == sb.keys() == {"model", "masters", "optim"}
    flat_a, flat_b = _tensors(sa), _tensors(sb)
    assert flat_a.keys() == flat_b.keys()
    assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a)
    masters = sa["masters"]
    assert all(m.dtype == torch.float32 for m in masters.values())
    assert all(v.dtype == torch.float32 for k, v in flat_a.items() if k.startswith("optim.state."))
    with safe_open(a / "model.safetensors", "pt") as f:  # written in the dtype asked
        saved = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    assert all(torch.equal(sa["model"][k], m.to(torch.bfloat16)) for k, m in masters.items())
    # the masters hold more than their bf16 rounding: a restart from the bf16 weights would differ
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in masters.values())


def _tensors(tree, prefix="") -> dict:
    if torch.is_tensor(tree):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {
            k: v for key, sub in tree.items() for k, v in _tensors(sub, f"{prefix}.{key}".lstrip(".")).items()
        }
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _tensors(sub, f"{prefix}.{i}").items()}
    return {}
