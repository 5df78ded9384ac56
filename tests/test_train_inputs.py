"""``harts train`` checks the whole rollout file before its first step; it resumes on a changed one if asked.

Each run goes through ``harts.cli.main`` (the command's own path) on a copy of the example rollouts
(37 lines, four groups: steps of 8, 12, 9 and 8 rollouts) with one line changed. A bad line, even
the last, must stop the run with exit status 2 and one line naming the file and the line before
anything is computed or written; a misspelled field must be refused naming the field it resembles;
other fields are listed once; a resume on a changed file is refused naming ``--accept-changed-data``,
which continues from the checkpoint's step on the changed file and says what changed.
"""

from __future__ import annotations

import json

import pytest

from harts.tiny import tiny_model
from harts.trainer.checkpoint import list_checkpoints
from harts.trainer.inputs import DataCheck, check_embedding, fingerprint
from tests.helpers import (
    CHAT_TEMPLATE,
    CONVERSATION,
    EXAMPLE_ROLLOUTS,
    one_thread,  # noqa: F401 (autouse: one thread)
    run_train,
    save_tokenizer,
    write_config,
)

LINES = EXAMPLE_ROLLOUTS.read_text().splitlines()
PPO = {"kind": "ppo", "advantage": "grpo"}


def _data(path, change=None, line: int = len(LINES), lines=LINES):
    """The example rollouts with ``change(record)`` applied to line ``line`` (1-based)."""
    out = list(lines)
    if change is not None:
        record = json.loads(out[line - 1])
        change(record)
        out[line - 1] = json.dumps(record)
    path.write_text("\n".join(out) + "\n")
    return path


def _every(change) -> list[str]:
    """The example's lines with ``change(record)`` applied to each."""
    records = [json.loads(x) for x in LINES]
    for record in records:
        change(record)
    return [json.dumps(r) for r in records]


def _refused(tmp_path, capsys, change, objective=None, *, every: bool = False, lines=LINES) -> str:
    """The one error line of a run on ``lines`` with ``change`` on the last line (or on every line);
    nothing was computed or written."""
    data = _data(tmp_path / "r.jsonl", lines=_every(change)) if every else _data(tmp_path / "r.jsonl", change,
                                                                                   lines=lines)  # fmt: skip
    config = write_config(tmp_path / "run.toml", {"steps": 4}, data={"path": str(data)},
                          objective=objective or {"kind": "sft"}, checkpoint={"every": 1})  # fmt: skip
    assert run_train(config, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harts train: error: "), err
    # refused before any step: no checkpoint directory, no metrics
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    return err[0]


def _set(**fields):
    return lambda record: record.update(fields)


def _drop(name):
    return lambda record: record.pop(name)


def _at(name, position, value):
    def change(record):
        record[name][position] = value

    return change


LAST = f"line {len(LINES)}"


BAD_LAST_LINES = {
    "vocabulary": (_at("tokens", 5, 500), None,
                   "position 5: token id 500 is outside the vocabulary (vocab_size=128)"),
    "mask-length": (lambda r: r["loss_mask"].append(1), None,
                    ": loss_mask has 192 values but the trajectory has 191 tokens"),
    "logprobs-length": (lambda r: r["rollout_logprobs"].pop(), PPO, ": rollout_logprobs has 190 values"),
    "inf-reward": (_set(reward=float("inf")), None, ": reward is inf"),
    "nan-advantage": (_set(advantages=[float("nan")] * 191), None,
                      "advantages is nan at a loss-bearing position"),
    "no-reward": (_set(reward=None), PPO,
                  " (step 4), field 'reward': missing: objective.advantage = 'grpo' reads each rollout's"),
    "step-mix": (_drop("rollout_logprobs"), PPO,
                 "r.jsonl, line 30, in the same step, has it: the rollouts of a step carry the same"),
    "group-split": (_set(group_id="task-0"), None,
                    ", field 'group_id': group 'task-0' comes back after other groups"),
}  # fmt: skip


@pytest.mark.parametrize(("change", "objective", "match"), BAD_LAST_LINES.values(), ids=BAD_LAST_LINES.keys())
def test_a_bad_last_line_is_refused_before_step_1(tmp_path, capsys, change, objective, match):
    err = _refused(tmp_path, capsys, change, objective)
    assert f"r.jsonl, {LAST}" in err and match in err, err


WHAT_THE_OBJECTIVE_READS = {
    "gspo-logprobs": (_drop("rollout_logprobs"), {"kind": "gspo", "advantage": "grpo"},
                      "field 'rollout_logprobs': missing: objective.kind = 'gspo' needs the"),
    "advantages-twice": (_set(advantages=1.0), PPO, "field 'advantages': given: objective.advantage = 'grpo' "
                                                    "estimates"),
    "no-advantages": (_set(), {"kind": "ppo"}, "field 'advantages': missing: objective.kind = 'ppo' needs "
                                               "advantages"),
    "kl-ref-logprobs": (_set(), {"kind": "sft", "kl_coef": 0.1}, "field 'ref_logprobs': missing: "
                                                                 "objective.kl_coef = 0.1 needs"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "objective", "match"), WHAT_THE_OBJECTIVE_READS.values(), ids=WHAT_THE_OBJECTIVE_READS.keys()
)
def test_a_file_without_what_the_objective_reads_is_refused(tmp_path, capsys, change, objective, match):
    err = _refused(tmp_path, capsys, change, objective, every=True)
    assert "r.jsonl, line 1 (step 1), " + match in err, err


@pytest.mark.parametrize(
    ("name", "field"),
    [("lossmask", "loss_mask"), ("advantage", "advantages"), ("loss-mask", "loss_mask"),
     ("Loss_Mask", "loss_mask"), ("Reward", "reward"), ("groupid", "group_id")],
)  # fmt: skip
def test_a_misspelled_field_is_refused_naming_the_field(tmp_path, capsys, name, field):
    """The last line's field misspelled: refused, naming the field (which would else take its default)."""
    rename = lambda r: r.update({name: r.pop(field)})  # noqa: E731
    if field == "advantages":  # every line carries advantages, the last one under a wrong name
        err = _refused(tmp_path, capsys, rename, {"kind": "ppo"}, lines=_every(_set(advantages=1.0)))
    else:
        err = _refused(tmp_path, capsys, rename)
    assert (f"r.jsonl, {LAST}, field {name!r}: not a field of the tokens form, but close to {field!r}, which "
            f"this line lacks: rename it {field!r}") in err, err  # fmt: skip


def test_other_fields_are_listed_once_and_kept(tmp_path, capsys):
    """Metadata (``source``) and a near name holding another kind of value (``n_tokens``: a count,
    not token ids) are no error: one line at the start names them and the file, and the run trains."""
    lines = [json.dumps({**json.loads(x), "source": "agent-v2", **({"n_tokens": 191} if i == 36 else {})})
             for i, x in enumerate(LINES)]  # fmt: skip
    data = _data(tmp_path / "r.jsonl", lines=lines)
    config = write_config(tmp_path / "run.toml", {"steps": 1}, data={"path": str(data)})
    assert run_train(config, tmp_path / "out") == 0
    err = capsys.readouterr().err
    listed = [line for line in err.splitlines() if "fields that are not rollout fields" in line]
    assert listed == [
        "harts train: warning: r.jsonl: fields that are not rollout fields, kept as metadata, not trained "
        "on: 'source' (37 lines, first line 1), 'n_tokens' (1 line, first line 37)"
    ]
    assert [c.step for c in list_checkpoints(tmp_path / "out" / "checkpoints")] == [1]


def test_a_chat_file_under_ppo_is_refused_before_step_1(tmp_path, capsys):
    tokenizer = save_tokenizer(tmp_path / "tok", CHAT_TEMPLATE)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION, "reward": 1.0, "group_id": "paris"}) + "\n")
    chat = {"path": str(data), "tokenizer": str(tokenizer), "rollouts_per_step": 1}
    config = write_config(tmp_path / "run.toml", {"steps": 1}, objective=PPO, data=chat)
    assert run_train(config, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "chat.jsonl, line 1 (step 1), field 'rollout_logprobs': missing" in err
    assert "compute them with [ppo] old_logprobs = 'policy', train with objective.kind = 'sft'" in err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_token_id_past_the_loaded_embedding_is_refused():
    model = tiny_model("llama", seed=0)
    rows = model.get_input_embeddings().num_embeddings
    check_embedding(model, DataCheck(1, 1, "tokens", {}, (rows - 1, "r.jsonl, line 1, position 2")))
    match = rf"r.jsonl, line 3, position 1: token id {rows} is outside the model's input embedding \({rows}"
    with pytest.raises(ValueError, match=match):
        check_embedding(model, DataCheck(1, 1, "tokens", {}, (rows, "r.jsonl, line 3, position 1")))


def test_a_resume_on_changed_data_continues_with_the_flag(tmp_path, capsys):
    """3 of 4 steps, then the file loses its last two groups (2 steps per epoch, not 4): refused
    without the flag (naming it, nothing touched); with it, what changed is printed and the run
    continues from step 3 at the start of the next epoch, recording the new file."""
    data = _data(tmp_path / "r.jsonl")
    sections = dict(data={"path": str(data)}, checkpoint={"every": 1, "keep_last": 5})
    config = write_config(tmp_path / "run.toml", {"steps": 3}, **sections)
    out = tmp_path / "out"
    assert run_train(config, out) == 0
    before = fingerprint(data)
    _data(data, lines=LINES[:20])  # task-0 and task-1
    longer = write_config(tmp_path / "run.toml", {"steps": 5}, **sections)
    capsys.readouterr()

    metrics = (out / "metrics.jsonl").read_text()
    assert run_train(longer, out, "--resume") == 2
    err = capsys.readouterr().err
    assert f"{data} changed since step-000003 was written (sha256 {before['sha256']} -> " in err
    assert "37 -> 20 rollouts (lines), 4 -> 2 steps per epoch" in err
    assert "pass --accept-changed-data to continue from step-000003's position on the changed file" in err
    assert (out / "metrics.jsonl").read_text() == metrics
    assert [c.step for c in list_checkpoints(out / "checkpoints")] == [1, 2, 3]

    assert run_train(longer, out, "--accept-changed-data") == 2  # the flag goes with --resume
    assert "--accept-changed-data goes with --resume" in capsys.readouterr().err

    assert run_train(longer, out, "--resume", "--accept-changed-data") == 0
    err = capsys.readouterr().err
    now = fingerprint(data)
    assert (f"r.jsonl changed since step-000003 was written: sha256 {before['sha256']} -> {now['sha256']}, "
            f"{before['size']:,} -> {now['size']:,} bytes, 37 -> 20 rollouts (lines), 4 -> 2 steps per "
            f"epoch; continuing from its position on the changed file") in err  # fmt: skip
    assert "the changed file has 2 steps per epoch: continuing at the start of epoch 1" in err
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"], r["rollouts"]) for r in records[3:]] == [(4, 1, 8), (5, 1, 12)]
    state = json.loads((out / "checkpoints" / "step-000005" / "state.json").read_text())
    assert state["data"]["sha256"] == now["sha256"] and state["data"]["rollouts"] == 20
    assert [state["position"][k] for k in ("step", "epoch", "index")] == [5, 2, 0]
