"""``harts train`` runs: what it writes, that it equals a hand-written loop, what it refuses.

A short run through ``harts.cli.main`` must leave one metrics line per step and checkpoints that
stock ``AutoModelForCausalLM.from_pretrained`` loads with the weights of the same steps written
by hand (``rollout_step`` + AdamW), bit for bit. Damaged checkpoints are refused naming the file,
before anything loads.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import harts
from harts.adapters import adapter_for_type
from harts.tiny import FAMILIES, tiny_model
from harts.trainer.checkpoint import MANIFEST, list_checkpoints
from harts.trainer.config_files import load_config
from harts.trainer.loop import train
from harts.trainer.progress import write_plot
from tests.helpers import (
    CHAT_TEMPLATE,
    CONVERSATION,
    EXAMPLE_ROLLOUTS,
    FAMILY,
    ROOT,
    one_thread,  # noqa: F401 (autouse: one thread)
    run_train,
    save_tokenizer,
    write_config,
)


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """3 SFT steps with AdamW, no clipping and no weight decay, checkpoints at steps 2 and 3."""
    tmp = tmp_path_factory.mktemp("short")
    config = write_config(
        tmp / "run.toml",
        {"max_grad_norm": 0.0},
        optimizer={"lr": 1e-3, "weight_decay": 0.0},
        checkpoint={"every": 2, "keep_last": 2},
    )
    assert run_train(config, tmp / "out") == 0
    return config, tmp / "out"


def test_a_run_equals_the_loop_written_by_hand(short_run):
    config, out = short_run
    records = _metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "entropy", "grad_norm", "lr", "unique_tokens", "flat_tokens", "redundancy", "seconds",
                "unique_tokens_per_s", "flat_tokens_per_s", "micro_batches", "recomputed_parts"):  # fmt: skip
        assert all(isinstance(r[key], float | int) for r in records), key
    assert [p.path.name for p in list_checkpoints(out / "checkpoints")] == ["step-000002", "step-000003"]

    model = tiny_model(FAMILY, seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for record, batch in zip(records, harts.iter_rollout_steps(EXAMPLE_ROLLOUTS, 8), strict=False):
        result = harts.rollout_step(model, batch, harts.PolicyLossConfig(kind="sft"))
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        optimizer.step()
        optimizer.zero_grad()
        assert record["loss"] == float(result.loss)
        assert record["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
        assert record["flat_tokens"] == sum(len(r.tokens) for r in batch) > record["unique_tokens"]

    final = out / "checkpoints" / "step-000003"
    loaded = AutoModelForCausalLM.from_pretrained(final)  # stock loading, nothing of harts
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    state = json.loads((final / "state.json").read_text())
    assert state["position"]["step"] == 3 and state["position"]["rollouts"] == sum(
        r["rollouts"] for r in records
    )
    assert json.loads((final / MANIFEST).read_text())["step"] == 3


def test_the_run_names_the_kernels_it_chose(tmp_path, capsys):
    config = write_config(tmp_path / "run.toml", {"steps": 1}, run={"backend": "torch"})
    assert run_train(config, tmp_path / "out") == 0
    assert "kernels: torch backend (configured)" in capsys.readouterr().err


def test_a_second_run_into_the_same_directory_is_refused(short_run, capsys):
    config, out = short_run
    assert run_train(config, out) == 2
    assert "already holds checkpoints (step-000003): pass --resume" in capsys.readouterr().err
    assert train(load_config(config), out, resume=True)["steps"] == 3  # complete: nothing to do


def _resume_error(short_run, tmp_path, capsys, damage) -> str:
    config, out = short_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    damage(copy / "checkpoints" / "step-000003")
    before = (copy / "metrics.jsonl").read_text()
    assert run_train(config, copy, "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert (copy / "metrics.jsonl").read_text() == before  # refused before anything was touched
    return err[0]


def test_a_truncated_checkpoint_is_refused(short_run, tmp_path, capsys):
    def truncate(d):
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])

    err = _resume_error(short_run, tmp_path, capsys, truncate)
    assert "step-000003 is incomplete or corrupt: model.safetensors has" in err and "(truncated?)" in err
    assert err.endswith("delete it to resume from step-000002")


def test_a_corrupted_or_unfinished_checkpoint_is_refused(short_run, tmp_path, capsys):
    def flip(d):
        data = bytearray((d / "trainer_state.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (d / "trainer_state.pt").write_bytes(bytes(data))

    assert "trainer_state.pt does not match its sha256" in _resume_error(short_run, tmp_path, capsys, flip)
    shutil.rmtree(tmp_path / "out")
    err = _resume_error(short_run, tmp_path, capsys, lambda d: (d / MANIFEST).unlink())
    assert "no manifest.json (it is written last, so the save never finished)" in err


def test_changed_data_is_refused_on_resume(short_run, tmp_path, capsys):
    config, out = short_run
    data = tmp_path / "r.jsonl"
    data.write_text(EXAMPLE_ROLLOUTS.read_text().replace('"reward":1.0', '"reward":0.5', 1))
    changed = write_config(
        tmp_path / "run.toml", {"max_grad_norm": 0.0, "steps": 4}, data={"path": str(data)}
    )
    shutil.copytree(out, tmp_path / "out")
    assert run_train(changed, tmp_path / "out", "--resume") == 2
    err = capsys.readouterr().err
    assert "changed since step-000003 was written (sha256 " in err and "37 -> 37 rollouts (lines)" in err
    assert "pass --accept-changed-data to continue from step-000003's position on the changed file" in err


def test_a_resume_with_other_parameter_groups_is_refused(short_run, tmp_path, capsys):
    _, out = short_run
    shutil.copytree(out, tmp_path / "out")
    config = write_config(
        tmp_path / "run.toml", {"max_grad_norm": 0.0, "steps": 4},
        optimizer={"lr": 1e-3, "weight_decay": 0.0, "freeze_router": True},
        checkpoint={"every": 2, "keep_last": 2},
    )  # fmt: skip
    assert run_train(config, tmp_path / "out", "--resume") == 2
    err = capsys.readouterr().err
    assert "warning: the config differs from step-000003's in optimizer.freeze_router, steps" in err
    assert "the checkpoint's adamw state does not fit this run's parameters" in err


def test_a_diverging_run_stops_with_status_1(tmp_path, capsys):
    config = write_config(
        tmp_path / "run.toml", {"steps": 4, "max_grad_norm": 0.0},
        optimizer={"lr": 1e30}, checkpoint={"every": 1}, model={"tiny": FAMILIES[-1]},
    )  # fmt: skip
    assert run_train(config, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert "not finite; stopped before the update" in err
    checkpoints = list_checkpoints(tmp_path / "out" / "checkpoints")
    assert checkpoints and all(
        torch.isfinite(t).all() for t in load_file(checkpoints[-1].path / "model.safetensors").values()
    )


BALANCED = [next(f for f in FAMILIES if f in ("bailing_hybrid", "kimi_linear", "qwen3_next"))]
# the bias on the MoE block, not the router (where the installed transformers' router reports its choice)
BALANCED += [f for f in ("lfm2_moe",) if f in FAMILIES and adapter_for_type(f).router_class is not None]


@pytest.mark.parametrize("family", BALANCED)
def test_moe_statistics_and_bias_balancing(tmp_path, family):
    """A bias-balanced family moves its score-correction biases after each step; an aux-loss one
    reports its load-balancing loss."""
    bias = family != "qwen3_next"
    moe = {"enabled": True, **({"bias_update_speed": 0.01} if bias else {})}
    config = write_config(tmp_path / "run.toml", {"steps": 2}, model={"tiny": family}, moe=moe)
    train(load_config(config), tmp_path / "out")
    record = _metrics(tmp_path / "out")[-1]
    assert record["moe_max_load"] >= 1.0
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoints" / "step-000002")
    initial = tiny_model(family, seed=0)
    if bias:
        buffers = [
            n for n, _ in initial.named_buffers() if n.endswith(("e_score_correction_bias", "expert_bias"))
        ]
        moved = [n for n in buffers if not torch.equal(initial.get_buffer(n), final.get_buffer(n))]
        assert buffers and moved == buffers
        # two steps of +-0.01 (or 0 for an expert exactly at the mean)
        assert all((initial.get_buffer(n) - final.get_buffer(n)).abs().max() <= 0.02 + 1e-6 for n in buffers)
    else:
        assert record["moe_aux_loss"] > 0


def test_the_example_config_runs(tmp_path):
    config = load_config(ROOT / "examples" / "train.toml")  # FamilyUnavailable (a skip) on older transformers
    summary = train(config, tmp_path / "out")
    records = _metrics(tmp_path / "out")
    lrs = [r["lr"] for r in records]
    assert summary["steps"] == len(records) == 12 and lrs[1] == max(lrs) > lrs[-1] > 0  # warm-up, cosine
    assert summary["flat_tokens"] > 3 * summary["unique_tokens"]
    assert {"lr_muon", "clip_fraction"} <= records[0].keys()
    assert [c.path.name for c in list_checkpoints(tmp_path / "out" / "checkpoints")] == [
        "step-000008",
        "step-000012",
    ]


def test_a_chat_file_trains_through_its_tokenizer(tmp_path):
    """data.tokenizer reaches the reader: conversations are tokenised with the chat template."""
    tokenizer = save_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    other = CONVERSATION[:-1] + [{"role": "assistant", "content": "Sunny, 18C."}]
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": m, "group_id": "paris"}) + "\n" for m in (CONVERSATION, other))
    )
    chat = {"path": str(data), "tokenizer": str(tokenizer), "rollouts_per_step": 2}
    config = write_config(tmp_path / "run.toml", {"steps": 1}, model={"tiny": FAMILIES[-1]}, data=chat)
    train(load_config(config), tmp_path / "out")
    (record,) = _metrics(tmp_path / "out")
    rollouts = harts.read_rollouts(data, tokenizer=tokenizer)
    assert record["flat_tokens"] == sum(len(r.tokens) for r in rollouts) > record["unique_tokens"]


def test_a_plot_or_one_line_saying_why_not(short_run, tmp_path):
    _, out = short_run
    png = tmp_path / "metrics.png"
    message = write_plot(out / "metrics.jsonl", png)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert message == "no plot: matplotlib is not installed (pip install matplotlib)" and not png.exists()
        return
    assert message == f"plot: {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
