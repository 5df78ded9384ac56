"""``[lora]``, ``[eval]`` and ``[samples]`` of ``harts train`` under torchrun (gloo, CPU), against
one process; and how an error reads under torchrun.

One config holds the three sections and a ``[reference]`` (for ``eval/kl``): two SFT updates of
LoRA adapters over 12 rollouts, eval and samples after each, a checkpoint after each, the merged
model saved too. The same run on 2 ranks, DDP and FSDP2, ends with one process's adapter, eval
metrics and samples; under FSDP2 (adapter weights sharded, generation in lock step) the run
resumed from its first checkpoint writes the same bytes on 2 ranks, and one process's adapter on one.

Bounds:

- The adapter: a rank runs a sub-forest of the step's, cut into other micro-batches than one
  process cuts: each side's fp32 gradient is within the exactness bound (1e-4 relative,
  tests/reference.py) of the exact one, so within ``LAYOUT_RTOL`` (2e-4) of each other. AdamW
  runs with ``eps`` far above every ``sqrt(v)`` (``|g| < 20``, ``eps = 1e4``), no clipping, no
  weight decay: its update is ``lr / eps`` times the bias-corrected first moment, linear in the
  gradients (as in tests/test_distributed_recipe.py), so each adapter tensor's change over the run
  is off by the gradients' relative error, plus the fp32 rounding of the weights: each of the two
  updates of each of the two runs rounds an element by at most half an ulp (``eps32 |w| / 2``),
  ``2 eps32 ||w||`` in all, relative to the change.
- ``eval/loss`` (``eval/logprob``): a mean of log-probs of one sign, no cancellation: the same
  fp32 terms in other sums, within ``EVAL_RTOL`` (1e-5).
- ``eval/kl``: the mean over the file's loss tokens of ``k3 = e^d - d - 1``, ``d`` the reference's
  log-prob minus the policy's, cancels, so its error is bounded absolutely. A log-prob is a logit
  minus a log-sum-exp, each within ``LOGIT_ATOL`` (1e-4) of exact, so within 4e-4 between two
  layouts, and ``d`` within 8e-4. ``k3`` moves by ``(e^d - 1) dd + e^d dd^2 / 2``; with every
  ``|d| <= 1/2`` (true when ``tokens x KL`` is below ``k3(-1/2) = 0.1065``, which the test checks)
  ``(e^d - 1)^2 <= 3 k3``, so by Cauchy-Schwarz the mean moves by at most
  ``sqrt(3 KL) 8e-4 + e^(1/2) (8e-4)^2 / 2``.
- Samples are greedy: the same tokens as one process's (the weights differ by the bound above, far
  below any gap between the best two logits that decides a token), and the very tokens a plain,
  unsharded model with the run's own final adapter generates (FSDP2 gathers the same bits).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from tests.helpers import one_thread, run_train, write_config, write_small_rollouts  # noqa: F401 (fixture)
from tests.reference import LOGIT_ATOL
from tests.test_distributed import _relative, _torchrun

LAYOUT_RTOL = 2e-4
EVAL_RTOL = 1e-5
ULP = torch.finfo(torch.float32).eps
KL_DD = 8 * LOGIT_ATOL  # a log-prob difference d between two layouts (module docstring)
LINEAR_ADAMW = {"lr": 30.0, "eps": 1e4, "weight_decay": 0.0}  # effectively lr 3e-3, update linear in g
MAX_NEW_TOKENS = 6


def _config(tmp_path: Path, strategy: str) -> Path:
    data = write_small_rollouts(tmp_path / "small.jsonl", groups=4)  # 12 rollouts: two steps of 6
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"tokens": [5, 6, 7]}\n{"tokens": [9, 10, 11, 12, 13]}\n{"tokens": [20]}\n')
    return write_config(
        tmp_path / f"lora-{strategy}.toml",
        {"steps": 2, "max_grad_norm": 0},
        data={"path": str(data), "rollouts_per_step": 6},
        objective={"kind": "sft", "kl_coef": 0.05},
        optimizer=LINEAR_ADAMW,
        lora={"r": 4, "alpha": 8.0, "merge_on_save": True},
        reference={"model": "initial"},
        eval={"file": str(data), "every_steps": 1},
        samples={"prompts": str(prompts), "every_steps": 1, "max_new_tokens": MAX_NEW_TOKENS},
        checkpoint={"every": 1, "keep_last": 10},
        distributed={"strategy": strategy, "timeout_s": 120},
    )


def _final(out: Path) -> Path:
    return out / "checkpoints" / "step-000002"


def _adapter(checkpoint: Path) -> dict:
    return load_file(checkpoint / "adapter_model.safetensors")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _base(config: Path):
    from harts.trainer.config_files import load_config
    from harts.trainer.inputs import load_model

    loaded = load_config(config)
    return load_model(loaded.model, loaded.seed)


def _start(config: Path) -> dict:
    """The adapter the runs start from, as peft names it in the file (fresh adapters, seeded)."""
    from peft import get_peft_model_state_dict

    from harts.trainer.config_files import load_config
    from harts.trainer.inputs import seed_everything
    from harts.trainer.lora import attach_lora

    loaded = load_config(config)
    seed_everything(loaded.seed)
    model, _ = attach_lora(_base(config), loaded.lora)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    config = _config(tmp, "ddp")
    assert run_train(config, tmp / "out") == 0
    return config, tmp / "out"


def _check_adapter(want: dict, got: dict, start: dict) -> None:
    assert set(want) == set(got) == set(start) and all("lora_" in k for k in want)
    moved_b = 0
    for name, w in want.items():
        moved = w.double() - start[name].double()
        if "lora_B" in name:  # B starts at 0: it moves in both updates
            assert moved.norm() > 0, name
            moved_b += 1
        if moved.norm() == 0:
            assert torch.equal(got[name], w), name
            continue
        rounding = 2 * ULP * float(w.double().norm() / moved.norm())
        error = _relative(moved, got[name].double() - start[name].double())
        assert error < LAYOUT_RTOL * (1 + 2e-3) + rounding, (name, error, rounding)
    assert moved_b > 0


def _check_eval(want: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for w, g in zip(want, got, strict=True):
        assert g["eval/tokens"] == w["eval/tokens"]
        for key in ("eval/loss", "eval/logprob"):
            assert abs(g[key] - w[key]) <= EVAL_RTOL * abs(w[key]), (key, w[key], g[key])
        kl = w["eval/kl"]
        assert 0 < kl and w["eval/tokens"] * kl < math.exp(-0.5) + 0.5 - 1  # every |d| <= 1/2
        bound = math.sqrt(3 * kl) * KL_DD + math.exp(0.5) * KL_DD**2 / 2
        assert abs(g["eval/kl"] - kl) <= bound, (w["eval/kl"], g["eval/kl"], bound)


def _greedy(config: Path, checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Completions by a plain (unsharded) peft model holding ``checkpoint``'s adapter."""
    model = PeftModel.from_pretrained(_base(config), checkpoint).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)  # fmt: skip
            out.append(generated[0, len(prompt) :].tolist())
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_eval_and_samples_on_two_ranks_end_where_one_process_does(strategy, one_process, tmp_path):
    one_config, one = one_process
    config, out = _config(tmp_path, strategy), tmp_path / "out"
    done = _torchrun("-m", "harts", "train", str(config), "--out", str(out), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"2 ranks ({strategy}" in done.stderr
    final = _final(out)
    _check_adapter(_adapter(_final(one)), _adapter(final), _start(one_config))
    _check_eval(_lines(one / "metrics.jsonl"), _lines(out / "metrics.jsonl"))
    samples = _lines(out / "samples.jsonl")
    assert samples == _lines(one / "samples.jsonl") and len(samples) == 6  # written once, by rank 0
    last = [s for s in samples if s["step"] == 2]
    assert [s["tokens"] for s in last] == _greedy(config, final, [s["prompt_tokens"] for s in last])
    # the merged model: peft's merge of the run's own adapter, bit for bit
    merge = PeftModel.from_pretrained(_base(config), final).merge_and_unload()
    merge.save_pretrained(tmp_path / "merged", safe_serialization=True)  # the file's names and layout
    merged = load_file(final / "merged" / "model.safetensors")
    want = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(merged) == set(want) and all(torch.equal(merged[k], want[k]) for k in merged)
    if strategy == "ddp":
        return
    assert len(list((final / "state").glob("*.distcp"))) == 2  # each rank its shard of the adapter's state
    resumed = tmp_path / "resumed"
    subprocess.run(["cp", "-r", str(out), str(resumed)], check=True)
    subprocess.run(["rm", "-r", str(_final(resumed))], check=True)
    done = _torchrun("-m", "harts", "train", str(config), "--out", str(resumed), "--resume", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr and "step-000001" in done.stderr
    for name in ("adapter_model.safetensors", "merged/model.safetensors"):
        assert (_final(resumed) / name).read_bytes() == (final / name).read_bytes(), name
    assert _lines(resumed / "samples.jsonl") == samples
    alone = tmp_path / "alone"
    subprocess.run(["cp", "-r", str(out), str(alone)], check=True)
    subprocess.run(["rm", "-r", str(_final(alone))], check=True)
    assert run_train(config, alone, "--resume") == 0
    _check_adapter(_adapter(final), _adapter(_final(alone)), _adapter(out / "checkpoints" / "step-000001"))


_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)  # a rank in torchrun's report


@pytest.mark.multiprocess
def test_an_error_on_two_ranks_is_printed_once_and_every_rank_exits_with_its_status(tmp_path):
    """A config error (met before the ranks join) and a rollout line with a token outside the
    vocabulary (met by every rank checking the file): the message once, by rank 0, on a line of its
    own; torchrun reports both ranks, each with status 2 (none terminated by a signal)."""
    data = write_small_rollouts(tmp_path / "small.jsonl", groups=2)
    lines = data.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*lines[:3], '{"tokens": [1, 2, 99999999], "reward": 1.0}', *lines[3:]]) + "\n")
    cases = {
        "reference: objective.kl_coef is 0": write_config(
            tmp_path / "config.toml", {"steps": 1}, reference={"model": "initial"}
        ),
        "line 4, position 2: token id 99999999": write_config(
            tmp_path / "data.toml", {"steps": 1}, data={"path": str(bad), "rollouts_per_step": 1}
        ),
    }
    for message, config in cases.items():
        done = _torchrun("-m", "harts", "train", str(config), "--out", str(tmp_path / config.stem))
        combined = done.stdout + done.stderr
        printed = [line for line in combined.splitlines() if "harts train: error:" in line]
        assert len(printed) == 1 and message in printed[0], combined[-3000:]
        assert printed[0].startswith("harts train: error:"), printed  # on its own line, no rank prefix
        assert done.returncode != 0
        assert sorted(_EXIT.findall(done.stderr)) == ["2", "2"], done.stderr[-3000:]
