"""Rollout files: JSONL and Parquet read as the same rollouts, bad lines named, steps keep groups."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import harts
from harts.data.rollout_files import iter_rollout_steps, iter_rollouts, read_rollouts
from harts.tiny import tiny_model

RECORDS = [
    {"tokens": [3, 4, 5, 6], "loss_mask": [0, 0, 1, 1], "rollout_logprobs": [0.0, -1.0, -0.5, -0.25],
     "advantages": 1.5, "reward": 1.0, "group_id": "task-a", "source": "agent-v2"},
    {"tokens": [3, 4, 7], "loss_mask": [0, 1, 1], "rollout_logprobs": [0.0, -2.0, -0.1],
     "advantages": [0.0, -1.0, -1.0], "reward": 0.0, "group_id": "task-a", "first_error_position": 2},
    {"tokens": [9, 8], "loss_mask": None, "rollout_logprobs": [0.0, -0.3], "advantages": 0.5,
     "reward": 0.5, "group_id": "task-b"},
]  # fmt: skip


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def test_jsonl_and_parquet_give_the_same_rollouts(tmp_path):
    a = read_rollouts(_jsonl(tmp_path / "r.jsonl", RECORDS))
    # a Parquet column has one type: advantages as lists there (JSONL lines may mix)
    # (and every key in every row: pyarrow takes the columns from the first row)
    keys = {k for r in RECORDS for k in r}
    as_lists = [{**dict.fromkeys(keys), **r,
                 "advantages": list(np.broadcast_to(r["advantages"], len(r["tokens"])).astype(float))}
                for r in RECORDS]  # fmt: skip
    b = read_rollouts(_parquet(tmp_path / "r.parquet", as_lists))
    assert len(a) == len(b) == 3
    for x, y, rec in zip(a, b, RECORDS, strict=True):
        for r in (x, y):
            assert list(r.tokens) == rec["tokens"] and r.group_id == rec["group_id"]
            assert r.reward == rec["reward"] and r.first_error_position == rec.get("first_error_position")
            assert np.allclose(np.broadcast_to(r.advantages, len(rec["tokens"])),
                               np.broadcast_to(rec["advantages"], len(rec["tokens"])))  # fmt: skip
    first = next(iter_rollouts(tmp_path / "r.jsonl"))
    assert first.metadata == {"source": "agent-v2"} and first.where.endswith("line 1")
    # the rollouts train as they are
    model = tiny_model("llama", seed=0)
    result = harts.rollout_step(model, a, harts.PolicyLossConfig(kind="ppo"))
    assert np.isfinite(float(result.loss))


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"tokens": [1, 2], "loss_mask": [0, 1, 1]}', r"line 2: loss_mask has 3 values"),
        ('{"loss_mask": [0, 1]}', r"line 2, field 'tokens': missing"),
        ('{"tokens": [1, 2], "reward": NaN}', r"line 2, field 'reward': NaN"),
        ('{"tokens": [1, -2]}', r"line 2, position 1: negative token id -2"),
        ('{"tokens": [1, 2], "advantages": "high"}', r"line 2, field 'advantages': expected a list or a"),
        ('{"tokens": [1, 2], "rollout_logprobs": [0.0, 0.5], "loss_mask": [0, 1]}', r"line 2, position 1: "
         r"rollout_logprobs is 0.5"),
        ('{"tokens": [1, 2]', r"line 2: not valid JSON"),
        ("[1, 2]", r"line 2: expected a JSON object"),
    ],
    ids=["mask-length", "no-tokens", "nan-reward", "negative-id", "advantage-type", "logprob-above-0", "json",
         "not-object"],
)  # fmt: skip
def test_bad_lines_name_file_line_and_field(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"tokens": [1, 2, 3]}) + "\n" + line + "\n")
    with pytest.raises((ValueError, TypeError), match=match):
        read_rollouts(path)


def test_bad_parquet_rows_and_files(tmp_path):
    rows = [{"tokens": [1, 2], "reward": 1.0}, {"tokens": [], "reward": 0.0}]
    path = _parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError, match=r"bad.parquet, row 1: empty trajectory"):
        read_rollouts(path)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        read_rollouts(tmp_path / "broken.parquet")
    with pytest.raises(ValueError, match="unknown rollout file type '.csv'"):
        read_rollouts(_jsonl(tmp_path / "r.csv", RECORDS))
    with pytest.raises(FileNotFoundError, match="no such rollout file"):
        read_rollouts(tmp_path / "missing.jsonl")


def test_steps_keep_groups_whole(tmp_path):
    records = [{"tokens": [1, g, i], "group_id": f"g{g}"} for g in range(4) for i in range(g + 1)]
    records.append({"tokens": [7, 7]})  # no group: a group of its own
    steps = list(iter_rollout_steps(_jsonl(tmp_path / "r.jsonl", records), rollouts_per_step=3))
    groups = [[r.group_id for r in step] for step in steps]
    assert groups == [["g0", "g1", "g1"], ["g2", "g2", "g2"], ["g3"] * 4, [None]]
    shuffled = records[:2] + records[3:4] + records[2:3]  # g1 comes back after g2
    with pytest.raises(ValueError, match=r"line 4, field 'group_id': group 'g1' comes back"):
        list(iter_rollout_steps(_jsonl(tmp_path / "s.jsonl", shuffled), rollouts_per_step=2))
    with pytest.raises(ValueError, match="rollouts_per_step"):
        list(iter_rollout_steps(tmp_path / "r.jsonl", 0))


NEAR_MISSES = [
    ("lossmask", [0, 1, 1], "loss_mask"), ("advantage", 1.5, "advantages"),
    ("loss-mask", [0, 1, 1], "loss_mask"), ("LOSS_MASK", [0, 1, 1], "loss_mask"),
    ("rewards", 1.0, "reward"), ("group", "g", "group_id"),
    ("ref_logprob", [0.0, -1.0, -1.0], "ref_logprobs"), ("first_error_pos", 1, "first_error_position"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value", "field"), NEAR_MISSES)
def test_a_misspelled_field_is_refused_naming_the_field(tmp_path, name, value, field):
    path = _jsonl(tmp_path / "r.jsonl", [{"tokens": [1, 2, 3]}, {"tokens": [1, 2, 3], name: value}])
    message = (f"r.jsonl, line 2, field '{name}': not a field of the tokens form, but close to '{field}', "
               f"which this line lacks: rename it '{field}'")  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        read_rollouts(path)
    tokens = _jsonl(tmp_path / "t.jsonl", [{"Tokens": [1, 2]}])  # named before "tokens missing"
    with pytest.raises(ValueError, match="field 'Tokens': not a field of the tokens form, but close to 'tok"):
        read_rollouts(tokens)


def test_metadata_near_a_field_name_but_not_of_its_kind_is_kept(tmp_path):
    """A near name whose value cannot be the field's, or beside the field itself, is metadata."""
    record = {"tokens": [1, 2, 3], "n_tokens": 3, "rewards": {"format": 1.0}, "source": "v2",
              "loss_mask": [0, 1, 1], "lossmask": [0, 0, 1]}  # fmt: skip
    (item,) = iter_rollouts(_jsonl(tmp_path / "r.jsonl", [record]))
    assert item.metadata == {"n_tokens": 3, "rewards": {"format": 1.0}, "source": "v2", "lossmask": [0, 0, 1]}
    assert list(item.rollout.loss_mask) == [0, 1, 1]


def test_a_step_mixing_annotations_is_refused(tmp_path):
    """validate_rollouts would refuse the step; the reader names the two lines before it is built."""
    records = [{"tokens": [1, 2], "rollout_logprobs": [0.0, -1.0], "group_id": "a"}, {"tokens": [1, 3]}]
    path = _jsonl(tmp_path / "r.jsonl", records)
    with pytest.raises(ValueError, match=r"line 2, field 'rollout_logprobs': missing, but .*r.jsonl, line 1, "
                                         r"in the same step, has it"):  # fmt: skip
        list(iter_rollout_steps(path, rollouts_per_step=2))
    assert [len(s) for s in iter_rollout_steps(path, 1)] == [1, 1]  # across steps: fine


def test_token_ids_are_checked_against_a_given_vocab_size(tmp_path):
    path = _jsonl(tmp_path / "r.jsonl", [{"tokens": [1, 2]}, {"tokens": [4, 5]}])
    with pytest.raises(ValueError, match=r"line 2, position 1: token id 5 is outside the vocabulary"):
        list(iter_rollouts(path, vocab_size=5))
    assert len(list(iter_rollouts(path, vocab_size=6))) == 2
