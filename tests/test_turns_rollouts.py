# ruff: noqa: E501  (records and the engines' JSON are kept one per line)
"""The turns form: one record per engine request, stitched into the trajectories of the token form.

A file of multi-turn trajectories, each turn's record holding the whole context the engine saw,
shuffled within each group, must read as the same rollouts (tokens, masks, log-probs, rewards) as
the token-form file of those trajectories, and train with ``harts train``. A context that drifted
is split into exact pieces or refused, never merged. Bad records are refused naming the file, the
line, the trajectory and the field. The converters read the JSON vLLM and SGLang answer with.
"""

from __future__ import annotations

import json
import random
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import harts
from harts.data.rollout_files import ContextDriftWarning, iter_rollouts, read_rollouts
from harts.data.turns import turn_from_sglang, turn_from_vllm, turns_from_chat
from tests.helpers import (
    CHAT_TEMPLATE,
    CONVERSATION,
    one_thread,  # noqa: F401 (autouse: one thread)
    run_train,
    save_tokenizer,
    write_config,
)

VOCAB = 100  # below the tiny models' vocabulary


def _trajectories(seed: int = 0, groups: int = 3, per_group: int = 3):
    """(turn records, token-form records) of multi-turn trajectories: each turn's prompt is the
    context so far plus a tool result; completions carry log-probs; the reward is on the last turn."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(6)]
    turns, tokens_form = [], []
    for g in range(groups):
        task = system + [rng.randrange(VOCAB) for _ in range(4)]
        for t in range(per_group):
            tid = f"g{g}-t{t}"
            context, mask, lps, records = list(task), [0] * len(task), [0.0] * len(task), []
            for k in range(rng.randint(1, 3)):
                if k:  # a tool result and the next header
                    tool = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
                    context, mask, lps = context + tool, mask + [0] * len(tool), lps + [0.0] * len(tool)
                completion = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 5))]
                logprobs = [-round(rng.random() * 3, 3) for _ in completion]
                records.append({"trajectory_id": tid, "turn": k, "prompt_token_ids": list(context),
                                "completion_token_ids": completion, "completion_logprobs": logprobs,
                                "group_id": f"g{g}", "agent": "v1"})  # fmt: skip
                context, mask, lps = context + completion, mask + [1] * len(completion), lps + logprobs
            reward = float(rng.randint(0, 1))
            records[-1]["reward"] = reward
            turns.append(records)
            tokens_form.append({"tokens": context, "loss_mask": mask, "rollout_logprobs": lps, "reward": reward,
                                "group_id": f"g{g}"})  # fmt: skip
    # records of a group in any order (trajectories interleaved, turns out of order), groups consecutive
    lines = []
    for g in range(groups):
        group = [r for records in turns[g * per_group:(g + 1) * per_group] for r in records]
        rng.shuffle(group)
        lines += group
    return lines, tokens_form


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert list(x.tokens) == list(y.tokens)
        assert list(map(int, x.loss_mask)) == list(map(int, y.loss_mask))
        assert np.allclose(x.rollout_logprobs, y.rollout_logprobs)
        assert (x.reward, x.group_id) == (y.reward, y.group_id)


def _by_tokens(rollouts):
    return sorted(rollouts, key=lambda r: (r.group_id, list(r.tokens)))


def test_shuffled_turns_read_as_the_token_form(tmp_path):
    lines, tokens_form = _trajectories()
    expected = read_rollouts(_jsonl(tmp_path / "tokens.jsonl", tokens_form))
    got = read_rollouts(_jsonl(tmp_path / "turns.jsonl", lines))
    _same(_by_tokens(got), _by_tokens(expected))
    # the same from Parquet (every column in every row)
    keys = {k for r in lines for k in r}
    pq.write_table(pa.Table.from_pylist([{**dict.fromkeys(keys), **r} for r in lines]), tmp_path / "t.parquet")
    _same(_by_tokens(read_rollouts(tmp_path / "t.parquet")), _by_tokens(expected))
    # groups stay whole and in file order in steps; metadata is kept
    steps = list(harts.iter_rollout_steps(tmp_path / "turns.jsonl", 4))
    assert [[r.group_id for r in s] for s in steps] == [["g0"] * 3 + ["g1"] * 3, ["g2"] * 3]
    item = next(iter_rollouts(tmp_path / "turns.jsonl"))
    assert item.form == "turns" and item.metadata == {"agent": "v1"} and "trajectory 'g0-t" in item.where


def test_a_turns_file_trains(tmp_path, capsys):
    lines, _ = _trajectories()
    data = _jsonl(tmp_path / "turns.jsonl", lines)
    config = write_config(tmp_path / "run.toml", {"steps": 2}, data={"path": str(data), "rollouts_per_step": 3},
                          objective={"kind": "ppo", "advantage": "grpo"})  # fmt: skip
    assert run_train(config, tmp_path / "out") == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "checkpoints").is_dir()


def _drifted(tmp_path):
    """Trajectory t0 whose turn-2 prompt rewrites a token of turn 0's prompt (a re-rendered history)."""
    records = [
        {"trajectory_id": "t0", "turn": 0, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
         "completion_logprobs": [-0.1, -0.2], "group_id": "a"},
        {"trajectory_id": "t0", "turn": 1, "prompt_token_ids": [1, 2, 3, 4, 5, 6], "completion_token_ids": [7],
         "completion_logprobs": [-0.3], "group_id": "a"},
        {"trajectory_id": "t0", "turn": 2, "prompt_token_ids": [1, 9, 3, 4, 5, 6, 7, 8],
         "completion_token_ids": [10], "completion_logprobs": [-0.4], "group_id": "a", "reward": 1.0},
        {"trajectory_id": "t1", "turn": 0, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [11],
         "completion_logprobs": [-0.5], "group_id": "a", "reward": 0.0},
    ]  # fmt: skip
    return _jsonl(tmp_path / "drift.jsonl", records)


def test_a_drifted_context_is_split_into_exact_pieces(tmp_path):
    path = _drifted(tmp_path)
    with pytest.warns(ContextDriftWarning, match=r"1 trajectory split .* first at .*drift.jsonl, line 3, "
                                                 r"trajectory 't0', turn 2"):  # fmt: skip
        rollouts = read_rollouts(path)
    assert [list(r.tokens) for r in rollouts] == [[1, 2, 3, 4, 5, 6, 7], [1, 9, 3, 4, 5, 6, 7, 8, 10], [1, 2, 3, 11]]
    assert [list(r.loss_mask) for r in rollouts[:2]] == [[0, 0, 0, 1, 1, 0, 1], [0] * 8 + [1]]
    assert list(rollouts[0].rollout_logprobs) == [0, 0, 0, -0.1, -0.2, 0, -0.3]
    assert [(r.reward, r.group_id) for r in rollouts] == [(1.0, "a"), (1.0, "a"), (0.0, "a")]
    # the pieces share their first token in the forest, and nothing is merged across the drift
    assert harts.build_forest([r.tokens for r in rollouts]).num_tokens == 7 + 8 + 1
    with pytest.raises(ValueError, match=r"drift.jsonl, line 3, trajectory 't0', turn 2, field 'prompt_token_ids': "
                                         r"the context drifted.*differ from position 1"):  # fmt: skip
        read_rollouts(path, split_drift=False)


def test_train_says_the_split_once_or_refuses_it(tmp_path, capsys):
    path = _drifted(tmp_path)
    config = write_config(tmp_path / "run.toml", {"steps": 1}, data={"path": str(path), "rollouts_per_step": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextDriftWarning)  # the reader's warning is not issued in a run
        assert run_train(config, tmp_path / "out") == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "split where the context drifted" in line]
    assert len(said) == 1 and "first at " in said[0] and "line 3, trajectory 't0', turn 2" in said[0], said
    refuse = write_config(tmp_path / "no.toml", {"steps": 1}, data={"path": str(path), "rollouts_per_step": 3,
                                                                     "split_drift": False})  # fmt: skip
    assert run_train(refuse, tmp_path / "out2") == 2
    err = capsys.readouterr().err
    assert "drift.jsonl, line 3, trajectory 't0', turn 2, field 'prompt_token_ids': the context drifted" in err


GOOD = {"trajectory_id": "t0", "turn": 0, "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4],
        "completion_logprobs": [-0.1, -0.2], "group_id": "a", "reward": 1.0}  # fmt: skip


def _second(**change):
    record = {**GOOD, "turn": 1, "prompt_token_ids": [1, 2, 3, 4, 5], "reward": None, **change}
    return {k: v for k, v in record.items() if v != "DROP"}


@pytest.mark.parametrize(
    ("first", "second", "match"),
    [
        (GOOD, _second(turn="DROP"), r"line 2, trajectory 't0', field 'turn': missing"),
        (GOOD, {**_second(prompt_token_ids="DROP"), "prompt_tokens_ids": [1, 2, 3]},
         r"line 2, field 'prompt_tokens_ids': not a field of the turns form, but close to 'prompt_token_ids'"),
        (GOOD, _second(completion_token_ids=[6], completion_logprobs=[-0.1, -0.2]),
         r"line 2, trajectory 't0', field 'completion_logprobs': 2 log-probs for 1 completion tokens"),
        (GOOD, _second(turn=2), r"line 2, trajectory 't0', field 'turn': turn 1 missing"),
        (GOOD, _second(turn=0), r"line 2, trajectory 't0', field 'turn': turn 0 repeated \(.*line 1 has it"),
        ({**GOOD, "reward": None}, _second(), r"line 2, trajectory 't0', field 'reward': on no turn"),
        (GOOD, _second(reward=0.5), r"line 2, trajectory 't0', field 'reward': also given on .*line 1"),
        (GOOD, _second(completion_token_ids=[6, 500]),
         r"line 2, trajectory 't0', field 'completion_token_ids', position 1: token id 500 is outside the "
         r"vocabulary \(vocab_size=100\)"),
        (GOOD, _second(completion_logprobs="DROP"),
         r"line 2, trajectory 't0', field 'completion_logprobs': missing on turn 1"),
        (GOOD, {**_second(), "group_id": "b"}, r"line 2, trajectory 't0', field 'trajectory_id': .*another group"),
    ],
    ids=["no-turn", "misspelled", "logprob-count", "turn-missing", "turn-repeated", "no-reward",
         "two-rewards", "vocab", "logprobs-on-some", "two-groups"],
)  # fmt: skip
def test_bad_records_name_file_line_trajectory_and_field(tmp_path, first, second, match):
    ok = _jsonl(tmp_path / "ok.jsonl", [GOOD | {"reward": None}, _second(reward=1.0)])
    assert len(list(iter_rollouts(ok, vocab_size=VOCAB))) == 1  # the pair the cases change reads
    path = _jsonl(tmp_path / "bad.jsonl", [first, {k: v for k, v in second.items() if v is not None}])
    with pytest.raises((ValueError, TypeError), match=match):
        list(iter_rollouts(path, vocab_size=VOCAB))


# JSON as vLLM's OpenAI-compatible server answers /v1/completions with logprobs=0 and
# return_token_ids=true (choice carries prompt_token_ids and token_ids), or with
# return_tokens_as_token_ids=true (logprobs.tokens as "token_id:<id>")
VLLM = """{"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
 "choices": [{"index": 0, "text": "ab", "finish_reason": "stop", "stop_reason": null,
   "logprobs": {"text_offset": [0, 1], "token_logprobs": [-0.25, -1.5], "tokens": ["token_id:7", "token_id:9"],
                "top_logprobs": [{"token_id:7": -0.25}, {"token_id:9": -1.5}]},
   "prompt_logprobs": null, "prompt_token_ids": [1, 2, 3], "token_ids": [7, 9]}],
 "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}}"""
# JSON as SGLang answers /generate with input_ids, return_logprob=true and logprob_start_len=0
SGLANG = """{"text": "ab", "output_ids": [7, 9],
 "meta_info": {"id": "x", "finish_reason": {"type": "stop", "matched": 9}, "prompt_tokens": 3,
   "completion_tokens": 2, "cached_tokens": 0,
   "input_token_logprobs": [[null, 1, null], [-2.0, 2, null], [-1.0, 3, null]],
   "output_token_logprobs": [[-0.25, 7, null], [-1.5, 9, null]]}}"""


def test_converters_read_the_engines_json(tmp_path):
    expected = {"trajectory_id": "t", "turn": 0, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [7, 9],
                "completion_logprobs": [-0.25, -1.5], "group_id": "g", "reward": 1.0}  # fmt: skip
    vllm = json.loads(VLLM)
    assert turn_from_vllm(vllm, "t", 0, group_id="g", reward=1.0) == expected
    for key in ("prompt_token_ids", "token_ids"):
        del vllm["choices"][0][key]  # return_tokens_as_token_ids alone: the request's prompt ids are given
    assert turn_from_vllm(vllm, "t", 0, prompt_token_ids=[1, 2, 3], group_id="g", reward=1.0) == expected
    with pytest.raises(ValueError, match="prompt_token_ids"):
        turn_from_vllm(vllm, "t", 0)
    vllm["choices"][0]["logprobs"]["tokens"] = ["a", "b"]
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        turn_from_vllm(vllm, "t", 0, prompt_token_ids=[1, 2, 3])
    sglang = json.loads(SGLANG)
    assert turn_from_sglang(sglang, "t", 0, group_id="g", reward=1.0) == expected
    assert turn_from_sglang(sglang, "t", 0, prompt_token_ids=[1, 2, 3], group_id="g", reward=1.0) == expected
    del sglang["meta_info"]["input_token_logprobs"][0]
    with pytest.raises(ValueError, match="logprob_start_len"):
        turn_from_sglang(sglang, "t", 0)
    # an agent loop's two turns, written and read back
    second = turn_from_sglang(json.loads(SGLANG.replace("[null, 1, null], [-2.0, 2, null], [-1.0, 3, null]",
                                                        "[null, 1, null], [-2.0, 2, null], [-1.0, 3, null], "
                                                        "[-1.0, 7, null], [-1.0, 9, null], [-1.0, 4, null]")
                                         .replace('"prompt_tokens": 3', '"prompt_tokens": 6')),
                              "t", 1, group_id="g", reward=1.0)  # fmt: skip
    first = turn_from_vllm(json.loads(VLLM), "t", 0, group_id="g")
    (r,) = read_rollouts(_jsonl(tmp_path / "t.jsonl", [second, first]))
    assert list(r.tokens) == [1, 2, 3, 7, 9, 4, 7, 9] and list(r.loss_mask) == [0, 0, 0, 1, 1, 0, 1, 1]


def test_chat_conversations_as_turns(tmp_path):
    tok_dir = save_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    records = turns_from_chat(CONVERSATION, str(tok_dir), "c0", group_id="g", reward=1.0)
    assert len(records) == sum(m["role"] == "assistant" for m in CONVERSATION)
    (turned,) = read_rollouts(_jsonl(tmp_path / "turns.jsonl", records[::-1]))
    (chat,) = read_rollouts(_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]), tokenizer=str(tok_dir))
    n = len(turned.tokens)
    assert list(turned.tokens) == list(chat.tokens[:n]) and not any(chat.loss_mask[n:])
    assert list(map(int, turned.loss_mask)) == list(map(int, chat.loss_mask[:n]))
