"""``harts train`` with ``[lora]``: peft adapters train, the base stays frozen, resume is exact.

A LoRA run must equal the loop written by hand on a stock peft model (``get_peft_model`` on the
same base, ``harts.rollout_step`` and AdamW over the adapter) bit for bit: the same losses, the
same gradient norms, the same adapter; the checkpoint's adapter must load with stock
``PeftModel.from_pretrained``; the merged model must hold the base's own bits wherever no adapter
sits; a run killed with SIGKILL must resume to byte-identical adapter files.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import harts
from harts.cli import main as harts_main
from harts.tiny import tiny_model
from harts.trainer.checkpoint import list_checkpoints
from harts.trainer.inputs import seed_everything
from tests.helpers import (
    EXAMPLE_ROLLOUTS,
    FAMILY,
    kill_after,
    one_thread,  # noqa: F401 (autouse: one thread)
    run_train,
    write_config,
)

LORA = {"r": 4, "alpha": 8.0, "merge_on_save": True}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """3 SFT steps of LoRA on every linear layer, AdamW, no clipping, no weight decay."""
    tmp = tmp_path_factory.mktemp("lora")
    config = write_config(tmp / "run.toml", {"max_grad_norm": 0.0},
                          optimizer={"lr": 1e-2, "weight_decay": 0.0}, checkpoint={"every": 3},
                          lora=LORA)  # fmt: skip
    assert run_train(config, tmp / "out") == 0
    return config, tmp / "out"


def _hand_made():
    """The run's starting point built with stock peft: the same base, adapters drawn after it."""
    seed_everything(0)
    base = tiny_model(FAMILY, seed=0).train()
    config = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(base, config)


def test_a_lora_run_equals_stock_peft_trained_by_hand(lora_run):
    _, out = lora_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    model = _hand_made()
    base_before = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(
        "lora_" in n for n, p in model.named_parameters() if p.requires_grad
    ), "only adapter weights train"
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)
    for record, batch in zip(records, harts.iter_rollout_steps(EXAMPLE_ROLLOUTS, 8), strict=False):
        result = harts.rollout_step(model, batch, harts.PolicyLossConfig(kind="sft"))
        norm = torch.nn.utils.clip_grad_norm_(trainable, float("inf"))  # the run's own norm, unclipped
        optimizer.step()
        optimizer.zero_grad()
        assert record["loss"] == float(result.loss)
        assert record["grad_norm"] == float(norm)

    final = out / "checkpoints" / "step-000003"
    saved = load_file(final / "adapter_model.safetensors")
    mine = get_peft_model_state_dict(model)
    assert saved.keys() == mine.keys() and all("lora_" in k for k in saved)
    assert all(torch.equal(saved[k], mine[k]) for k in saved)
    # the base weights did not move, and only the adapter's state was checkpointed
    after = model.get_base_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())

    # stock peft loads the adapter onto a fresh base and computes what the trained model computes
    loaded = PeftModel.from_pretrained(tiny_model(FAMILY, seed=0), final).train()
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    # the merged model: stock loading; the base's bits wherever no adapter sits
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").state_dict()
    targeted = {k.split(".lora_")[0].removeprefix("base_model.model.") for k in mine}
    for name, value in base_before.items():
        plain = name.replace(".base_layer", "")
        if plain.rsplit(".", 1)[0] in targeted:
            assert not torch.equal(merged[plain], value), plain  # the adapter was merged in
        else:
            assert torch.equal(merged[plain], value), plain


def test_lora_resume_after_sigkill_is_bit_identical(tmp_path, capsys):
    config = write_config(tmp_path / "run.toml", {"steps": 6},
                          objective={"kind": "ppo", "advantage": "grpo"}, optimizer={"lr": 1e-2},
                          schedule={"kind": "cosine", "warmup_steps": 2},
                          checkpoint={"every": 1, "keep_last": 2},
                          lora={**LORA, "target_modules": ["q_proj", "v_proj", "o_proj"]})  # fmt: skip
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    kill_after(config, killed, "step-000002")
    done = [c.step for c in list_checkpoints(killed / "checkpoints")]
    assert done and done[-1] < 6
    harts_main(["train", str(config), "--out", str(killed), "--resume"])
    assert f"(step {done[-1]})" in capsys.readouterr().err
    harts_main(["train", str(config), "--out", str(straight)])
    a, b = killed / "checkpoints" / "step-000006", straight / "checkpoints" / "step-000006"
    for name in ("adapter_model.safetensors", "adapter_config.json", "merged/model.safetensors",
                 "trainer_state.pt"):  # fmt: skip
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    losses = [[json.loads(x)["loss"] for x in (o / "metrics.jsonl").read_text().splitlines()]
              for o in (killed, straight)]  # fmt: skip
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_a_resume_on_another_base_is_refused(lora_run, tmp_path, capsys):
    config, out = lora_run
    other = write_config(tmp_path / "run.toml", {"max_grad_norm": 0.0, "steps": 4},
                         optimizer={"lr": 1e-2, "weight_decay": 0.0}, checkpoint={"every": 3},
                         model={"seed": 1}, lora=LORA)  # fmt: skip
    shutil.copytree(out, tmp_path / "out")
    assert run_train(other, tmp_path / "out", "--resume") == 2
    err = capsys.readouterr().err
    assert "lora: the base model's weights (sha256" in err and "restore the [model]" in err


@pytest.mark.parametrize(
    "lora, message",
    [
        ({"dropout": 0.1}, "lora.dropout: 0.1 is refused: a dropout mask over the forest is shared"),
        ({"target_modules": ["no_such_proj"]}, "lora.target_modules: "),
        ({"r": 0}, "lora.r: expected a positive integer, got 0"),
        ({"target_modules": "q_proj"}, "lora.target_modules: expected a list, got 'q_proj' (str)"),
    ],
)
def test_lora_setups_harts_cannot_run_are_refused(tmp_path, capsys, lora, message):
    config = write_config(tmp_path / "run.toml", lora={**LORA, **lora})
    assert run_train(config, tmp_path / "out") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "checkpoints").exists()
