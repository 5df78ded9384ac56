"""``harts train`` configs: every mistake is one line naming the file and the key; defaults as documented.

No model runs here: parsing, validation, path resolution, the learning-rate schedules and the
command line's handling of a bad config (exit status 2, one line on stderr).
"""

from __future__ import annotations

import inspect
import math

import pytest

import harts
from harts.cli import main as harts_main
from harts.data.rollout_files import iter_rollout_steps
from harts.trainer.config import ScheduleConfig
from harts.trainer.config_files import load_config
from harts.trainer.inputs import count_steps
from harts.trainer.optim import lr_factor
from tests.helpers import EXAMPLE_ROLLOUTS, write_config


def _error(tmp_path, top=None, exc=ValueError, **sections) -> str:
    path = write_config(tmp_path / "run.toml", top, **sections)
    with pytest.raises(exc) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path)) and "\n" not in message
    return message


def test_unknown_key_lists_the_valid_ones(tmp_path):
    message = _error(tmp_path, optimizer={"lerning_rate": 1e-3})
    assert "optimizer.lerning_rate: unknown key in [optimizer]" in message
    assert "valid keys: kind, lr, muon_lr, weight_decay, betas" in message


def test_unknown_top_level_key_and_section(tmp_path):
    assert "stepz: unknown key in the top level; valid keys: seed, steps, epochs" in _error(
        tmp_path, {"stepz": 3}
    )
    path = tmp_path / "run.toml"
    path.write_text(write_config(path).read_text() + "\n[optimiser]\nlr = 1.0\n")
    with pytest.raises(ValueError, match=r"unknown section \[optimiser\]; valid sections: model, data"):
        load_config(path)


@pytest.mark.parametrize(
    "top, sections, expected",
    [
        ({"steps": "three"}, {}, "steps: expected an integer, got 'three' (str)"),
        ({}, {"optimizer": {"lr": True}}, "optimizer.lr: expected a number, got True (bool)"),
        ({}, {"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected a list of 2 numbers"),
        ({}, {"data": {"rollouts_per_step": 0}}, "data.rollouts_per_step: expected a positive integer"),
        ({}, {"optimizer": {"kind": "sgd"}}, "optimizer.kind: expected one of adamw, muon; got 'sgd'"),
        ({}, {"objective": {"kind": "dpo"}}, "objective.kind: expected one of ppo, gspo, sft; got 'dpo'"),
        ({}, {"objective": {"advantage": "vtrace"}}, "objective.advantage: expected one of grpo, dr_grpo"),
        ({}, {"objective": {"advantage": "gae"}}, "objective.advantage: gae needs a critic's values"),
        ({}, {"objective": {"advantage": "grpo", "advantage_params": {"epsilon": 1}}},
         "objective.advantage_params: grpo takes no parameter 'epsilon'; valid: eps"),
        ({}, {"objective": {"advantage": "grpo", "advantage_params": {"eps": "small"}}},
         "objective.advantage_params.eps: expected a number, got 'small' (str)"),
        ({}, {"objective": {"aggregation": "seq-mean-token-sum-norm"}}, "objective.max_length: seq-mean"),
        ({}, {"run": {"linear_plan": "wide"}}, "run.linear_plan: expected one of auto, depth, chain"),
        ({}, {"run": {"backend": "cuda"}}, "run: unknown backend 'cuda'; expected auto or one of"),
        ({}, {"run": {"hold_tokens": "all"}}, "run: hold_tokens must be 'auto' or an int >= 0, got 'all'"),
        ({}, {"run": {"hold_tokens": -1}}, "run: hold_tokens must be 'auto' or an int >= 0, got -1"),
        ({}, {"run": {"hold_tokens": 1.5}}, "run.hold_tokens: expected an integer or a string, got 1.5"),
        ({}, {"run": {"hold_tokens": True}}, "run.hold_tokens: expected an integer or a string, got True"),
        ({}, {"schedule": {"kind": "cosine", "min_lr_ratio": 2.0}}, "schedule.min_lr_ratio: expected a"),
        ({"epochs": 2}, {}, "steps and epochs: give one"),
        ({}, {"model": {"path": "/models/x"}}, "model: give exactly one of path"),
        ({}, {"moe": {"bias_update_speed": 0.001}}, "moe: set moe.enabled = true"),
        ({}, {"optimizer": {"master_weights": "no"}}, "optimizer.master_weights: expected true or false"),
        ({}, {"optimizer": {"master_weights": 0}}, "master_weights: expected true or false, got 0 (int)"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key(tmp_path, top, sections, expected):
    assert expected in _error(tmp_path, top, **sections)


def test_missing_files_and_required_keys(tmp_path):
    message = _error(tmp_path, exc=FileNotFoundError, data={"path": "nowhere.jsonl"})
    assert f"data.path: {tmp_path / 'nowhere.jsonl'}: no such rollout file" in message
    assert "not a local Hugging Face model directory" in _error(
        tmp_path, exc=FileNotFoundError, model={"tiny": None, "path": str(tmp_path)}
    )
    path = tmp_path / "run.toml"
    path.write_text('[model]\ntiny = "llama"\n[data]\npath = "x.jsonl"\n')
    with pytest.raises(ValueError, match=r"data.rollouts_per_step: required key missing in \[data\]"):
        load_config(path)
    path.write_text('[data]\npath = "x.jsonl"\nrollouts_per_step = 2\n')
    with pytest.raises(ValueError, match=r"\[model\]: required section missing"):
        load_config(path)
    with pytest.raises(FileNotFoundError, match="no such config file"):
        load_config(tmp_path / "absent.toml")
    path.write_text("steps = [\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(path)


def test_relative_paths_resolve_against_the_config_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.jsonl").write_text(EXAMPLE_ROLLOUTS.read_text())
    config = load_config(
        write_config(tmp_path / "sub" / "run.toml", {"out": "out"}, data={"path": "r.jsonl"})
    )
    assert config.data.path == tmp_path / "sub" / "r.jsonl"
    assert config.out == tmp_path / "sub" / "out"


def test_defaults_follow_the_library(tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", objective={"kind": "ppo"}))
    assert config.objective.loss_config() == harts.PolicyLossConfig(kind="ppo")
    assert config.run.run_config() == harts.RunConfig()
    assert config.optimizer.kind == "adamw" and config.schedule.kind == "constant"
    assert config.max_grad_norm == 1.0 and config.checkpoint.keep_last == 3
    assert config.optimizer.master_weights is True  # a bf16 / fp16 model trains from fp32 masters


def test_hold_tokens_is_auto_or_a_token_count(tmp_path):
    for value in ("auto", 0, 4096):
        config = load_config(write_config(tmp_path / "run.toml", run={"hold_tokens": value}))
        assert config.run.run_config().hold_tokens == value
    assert harts.RunConfig().hold_tokens == "auto"


def test_master_weights_can_be_turned_off(tmp_path):
    config = load_config(write_config(tmp_path / "run.toml", optimizer={"master_weights": False}))
    assert config.optimizer.master_weights is False


def test_cli_reports_a_bad_config_in_one_line_with_status_2(tmp_path, capsys):
    path = write_config(tmp_path / "run.toml", optimizer={"kind": "adam"})
    with pytest.raises(SystemExit) as info:
        harts_main(["train", str(path), "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"harts train: error: {path}: optimizer.kind: expected one of adamw, muon; got 'adam'"
    assert not (tmp_path / "out").exists()  # nothing written for a refused config


def test_help_names_the_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        harts_main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: harts train CONFIG.toml [--out DIR] [--resume]")
    assert "--resume" in out and "manifest.json" in out and "exit status" in out


def test_schedules():
    total = 10
    cosine = ScheduleConfig(kind="cosine", warmup_steps=2, min_lr_ratio=0.1)
    factors = [lr_factor(k, total, cosine) for k in range(total)]
    assert factors[:3] == [0.5, 1.0, 1.0]  # warm-up reaches 1 at its last step, decay starts after
    assert all(a > b for a, b in zip(factors[2:], factors[3:], strict=False)) and factors[-1] > 0.1
    assert lr_factor(total, total, cosine) == pytest.approx(0.1)  # reached one past the last step
    assert lr_factor(6, total, cosine) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    linear = ScheduleConfig(kind="linear")
    assert [lr_factor(k, 5, linear) for k in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert {lr_factor(k, 7, ScheduleConfig()) for k in range(7)} == {1.0}


def test_steps_per_epoch_keep_groups_whole(tmp_path):
    config = load_config(write_config(tmp_path / "run.toml"))
    steps, rollouts = count_steps(config.data)
    batches = list(iter_rollout_steps(EXAMPLE_ROLLOUTS, 8))
    assert (steps, rollouts) == (len(batches), sum(map(len, batches)))
    assert all(len({r.group_id for r in b}) >= 1 and len(b) >= 8 for b in batches[:-1])


def test_a_tokenizer_resolves_and_a_reader_without_one_is_named(tmp_path):
    """data.tokenizer goes to iter_rollout_steps(tokenizer=...) (a chat run: test_train_run.py); a
    harts whose reader takes none says so in one line instead of failing inside the reader."""
    (tmp_path / "tok").mkdir()
    config = load_config(write_config(tmp_path / "run.toml", data={"tokenizer": "tok"}))
    assert config.data.tokenizer == tmp_path / "tok"
    with pytest.raises(FileNotFoundError, match="data.tokenizer: .*: no such directory"):
        load_config(write_config(tmp_path / "run.toml", data={"tokenizer": "absent"}))
    if "tokenizer" not in inspect.signature(iter_rollout_steps).parameters:
        with pytest.raises(ValueError, match="data.tokenizer: this harts reads token-id rollout files only"):
            count_steps(config.data)
