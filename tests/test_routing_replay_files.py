"""Recorded MoE routes read from rollout files (token and turns forms, the engine converters) and
replayed by ``harts train``; bad routes refused naming the file and line."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from harts.data.rollout_files import read_rollouts
from harts.data.turns import turn_from_sglang, turn_from_vllm
from harts.tiny import tiny_config
from tests.helpers import run_train, write_config, write_small_rollouts

FAMILY = "qwen3_moe"


def _shape() -> tuple[int, int, int, list[int]]:
    """(decoder layers, top-k, experts, MoE layers) of the tiny model."""
    config = tiny_config(FAMILY)
    moe = [layer for layer in range(config.num_hidden_layers) if layer not in config.mlp_only_layers]
    return config.num_hidden_layers, config.num_experts_per_tok, config.num_experts, moe


def _routes(rng: np.random.Generator, length: int) -> np.ndarray:
    layers, k, experts, moe = _shape()
    routes = np.full((length, layers, k), -1, dtype=np.int32)
    for layer in moe:
        routes[:, layer] = [rng.permutation(experts)[:k] for _ in range(length)]
    return routes


def _write(path, lines) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_the_token_form_reads_routes_and_names_the_line_of_a_bad_one(tmp_path):
    rng = np.random.default_rng(0)
    routes = _routes(rng, 4)
    _write(
        tmp_path / "ok.jsonl",
        [{"tokens": [1, 2, 3, 4], "routed_experts": routes.tolist()}, {"tokens": [1, 2]}],
    )
    first, second = read_rollouts(tmp_path / "ok.jsonl")
    assert np.array_equal(np.asarray(first.routed_experts), routes) and second.routed_experts is None
    _write(
        tmp_path / "bad.jsonl",
        [{"tokens": [1, 2]}, {"tokens": [1, 2, 3, 4], "routed_experts": routes[:3].tolist()}],
    )
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: routed_experts must be \[tokens=4"):
        read_rollouts(tmp_path / "bad.jsonl")


def test_the_turns_form_keeps_each_tokens_first_recorded_route(tmp_path):
    """Turn 1 re-runs turn 0's tokens (other rows, say, a new prefill): each token keeps the row of the
    turn that first ran it; turn 0's last sampled token, never run in turn 0, takes turn 1's row."""
    rng = np.random.default_rng(1)
    turn0 = _routes(rng, 6)  # prompt 4 + completion 2, the last row left out by the engine
    turn1 = _routes(rng, 10)  # prompt 8 (turn 0's 6 + 2 tool tokens) + completion 2
    lines = [
        {
            "trajectory_id": "a",
            "turn": 0,
            "prompt_token_ids": [1, 2, 3, 4],
            "completion_token_ids": [5, 6],
            "routed_experts": turn0[:5].tolist(),
        },
        {
            "trajectory_id": "a",
            "turn": 1,
            "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "completion_token_ids": [9, 10],
            "routed_experts": turn1.tolist(),
            "reward": 1.0,
        },
    ]
    _write(tmp_path / "turns.jsonl", lines)
    (rollout,) = read_rollouts(tmp_path / "turns.jsonl")
    expected = np.concatenate([turn0[:5], turn1[5:]])
    assert np.array_equal(np.asarray(rollout.routed_experts), expected)
    del lines[1]["routed_experts"]
    _write(tmp_path / "mixed.jsonl", lines)
    with pytest.raises(ValueError, match="field 'routed_experts': missing on turn 1"):
        read_rollouts(tmp_path / "mixed.jsonl")


def test_the_converters_read_the_engines_routes():
    rng = np.random.default_rng(2)
    layers, k, _, _ = _shape()
    routes = _routes(rng, 5)  # 3 prompt + 3 completion tokens, the last never run
    encoded = base64.b64encode(routes.astype("<i4").tobytes()).decode()
    response = {
        "output_ids": [7, 8, 9],
        "meta_info": {
            "output_token_logprobs": [[-0.5, 7, ""], [-0.1, 8, ""], [-1.0, 9, ""]],
            "routed_experts": encoded,
        },
    }
    record = turn_from_sglang(response, "t", 0, prompt_token_ids=[1, 2, 3], layers_top_k=(layers, k))
    assert np.array_equal(np.asarray(record["routed_experts"]), routes)
    with pytest.raises(ValueError, match="pass layers_top_k"):
        turn_from_sglang(response, "t", 0, prompt_token_ids=[1, 2, 3])
    choice = {
        "prompt_token_ids": [1, 2, 3],
        "token_ids": [7, 8, 9],
        "routed_experts": routes.tolist(),
        "logprobs": {"token_logprobs": [-0.5, -0.1, -1.0]},
    }
    record = turn_from_vllm({"choices": [choice]}, "t", 0)
    assert np.array_equal(np.asarray(record["routed_experts"]), routes)


def _prefix_routes(tokens: list[int]) -> np.ndarray:
    """Routes that depend on each token's prefix only, as an engine's prefix cache keeps them: equal
    prefixes of two lines get equal routes and still share their tokens."""
    rows = [_routes(np.random.default_rng([3, *tokens[: p + 1]]), 1)[0] for p in range(len(tokens))]
    return np.stack(rows)


def _with_routes(source, target, top_k_shift: int = 0) -> None:
    lines = [json.loads(line) for line in source.read_text().splitlines()]
    for line in lines:
        routes = _prefix_routes(line["tokens"])
        if top_k_shift:
            routes = routes[:, :, : routes.shape[2] - top_k_shift]
        line["routed_experts"] = routes.tolist()
    _write(target, lines)


def _losses(path) -> list[float]:
    return [json.loads(x)["loss"] for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_harts_train_replays_the_files_routes(tmp_path, capsys):
    plain = write_small_rollouts(tmp_path / "plain.jsonl")
    _with_routes(plain, tmp_path / "routed.jsonl")
    runs = {}
    for name in ("plain", "routed"):
        tables = dict(
            model={"tiny": FAMILY},
            data={"path": str(tmp_path / f"{name}.jsonl"), "rollouts_per_step": 9},
            objective={"kind": "ppo", "advantage": "grpo"},
            run={"budget_tokens": 24},
            logging={"plot": False},
        )
        config = write_config(tmp_path / f"{name}.toml", {"steps": 1}, tables)
        assert run_train(config, tmp_path / name) == 0
        runs[name] = _losses(tmp_path / name)
        output = capsys.readouterr()
        assert "verified against the stock forward" in output.out + output.err  # with the routes replayed
        assert "shared 1.00x" not in output.out + output.err  # equal prefixes, equal routes: shared
    assert runs["plain"] != runs["routed"]  # the routers chose the recorded experts, not their own
    _with_routes(plain, tmp_path / "narrow.jsonl", top_k_shift=1)
    tables = dict(
        model={"tiny": FAMILY},
        data={"path": str(tmp_path / "narrow.jsonl"), "rollouts_per_step": 9},
        objective={"kind": "ppo", "advantage": "grpo"},
        logging={"plot": False},
    )
    config = write_config(tmp_path / "narrow.toml", {"steps": 1}, tables)
    assert run_train(config, tmp_path / "narrow") != 0
    expected = (
        "narrow.jsonl, line 1, field 'routed_experts': [tokens, 3, 1], but the model has 3 decoder layers"
    )
    assert expected in capsys.readouterr().err


@pytest.mark.multiprocess
def test_harts_train_on_two_ranks_replays_routes_as_one_process(tmp_path):
    """The routed file's step on 2 DDP ranks (each rank's forest built with its rollouts' routes)
    against one process: the same loss and gradient norm, bounded as test_distributed_recipe bounds
    two layouts of one step (2e-4 for the loss, a sum of terms of both signs; 1e-5 for the norm)."""
    from tests.test_distributed import _torchrun

    _with_routes(write_small_rollouts(tmp_path / "plain.jsonl", groups=4), tmp_path / "routed.jsonl")
    records = {}
    for name, strategy in (("one", None), ("two", "ddp")):
        tables = dict(
            model={"tiny": FAMILY},
            data={"path": str(tmp_path / "routed.jsonl"), "rollouts_per_step": 12},
            objective={"kind": "ppo", "advantage": "grpo"},
            run={"budget_tokens": 24},
            logging={"plot": False},
        )
        if strategy is not None:
            tables["distributed"] = {"strategy": strategy, "timeout_s": 120}
        config = write_config(tmp_path / f"{name}.toml", {"steps": 1, "max_grad_norm": 0}, tables)
        if strategy is None:
            assert run_train(config, tmp_path / name) == 0
        else:
            done = _torchrun("-m", "harts", "train", str(config), "--out", str(tmp_path / name), timeout=240)
            assert done.returncode == 0, done.stderr[-3000:]
        records[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    one, two = records["one"], records["two"]
    assert abs(one["loss"] - two["loss"]) <= 2e-4 * abs(one["loss"])
    assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5 * one["grad_norm"]
