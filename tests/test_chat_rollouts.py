"""Chat rollout files: conversations through a local tokenizer's chat template, masked on assistant turns.

The tokenizer is built by ``tests.helpers.save_tokenizer`` (character level, ChatML special tokens,
a template with tool calls), saved to a temporary directory and loaded from it: nothing is downloaded.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import harts
from harts.data.chat import check_messages, tokenize_chat
from harts.data.rollout_files import iter_rollout_steps, iter_rollouts, read_rollouts
from harts.tiny import tiny_model
from tests.helpers import CHAT_TEMPLATE, CONVERSATION, WEATHER_CALL, save_tokenizer

# drops the reasoning of every assistant turn but the last, as some reasoning models' templates do
DROPS_REASONING = CHAT_TEMPLATE.replace(
    "{% if m.content %}{{ m.content }}{% endif %}",
    "{% if loop.last %}{{ m.content }}{% else %}{{ m.content.split('</think>')[-1] }}{% endif %}",
)
# consecutive tool results in one user block (as some tool-calling templates do): the rendering that
# ends after the first of two results closes the block, the one after the second does not
TOOL_BLOCK = CHAT_TEMPLATE.replace(
    "{% else %}",
    "{% elif m.role == 'tool' %}"
    "{% if messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user\n{% endif %}"
    "<tool_response>{{ m.content }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}{% else %}",
)
# generation markers around the assistant's content only (its end-of-turn token left out)
MARKED = CHAT_TEMPLATE.replace(
    "{% if m.content %}{{ m.content }}{% endif %}",
    "{% generation %}{% if m.content %}{{ m.content }}{% endif %}{% endgeneration %}",
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ASSISTANT_TURNS = [
    'Checking.<tool_call>get_weather({"city": "Paris"})</tool_call><|im_end|>',
    "18C and sunny.<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"), CHAT_TEMPLATE)


def _jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def _runs(mask) -> list[tuple[int, int]]:
    """[start, end) of each run of true values."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, dtype=int), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def _turns(tok, rollout) -> list[str]:
    return [tok.decode(list(rollout.tokens[a:b])) for a, b in _runs(rollout.loss_mask)]


def test_mask_covers_exactly_the_assistant_turns(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    record = {"messages": CONVERSATION, "tools": [WEATHER], "reward": 1.0, "group_id": "paris",
              "advantages": 0.5, "agent": "v3"}  # fmt: skip
    path = _jsonl(tmp_path / "chat.jsonl", [record])
    (item,) = list(iter_rollouts(path, tokenizer=tokenizer_dir))
    r = item.rollout
    # the whole conversation as the template renders it, tools block included
    text = tok.decode(list(r.tokens))
    assert text == tok.apply_chat_template(CONVERSATION, tools=[WEATHER], tokenize=False)
    assert text.startswith("<|im_start|>system\nTools: get_weather<|im_end|>\n")
    # the mask: each assistant turn's content, tool call and end-of-turn token; no header, no newline after
    assert _turns(tok, r) == ASSISTANT_TURNS
    assert item.form == "chat" and item.mask_from == "progressive"
    assert r.reward == 1.0 and r.group_id == "paris" and r.advantages == 0.5
    assert item.metadata == {"agent": "v3"} and item.where.endswith("chat.jsonl, line 1")
    # a loaded tokenizer gives the same rollout as its directory
    (same,) = read_rollouts(path, tokenizer=tok)
    assert np.array_equal(same.tokens, r.tokens) and np.array_equal(same.loss_mask, r.loss_mask)
    # the rollouts train: an SFT step on the assistant tokens of a tiny model
    result = harts.rollout_step(tiny_model("llama", seed=0), [r, same], harts.PolicyLossConfig(kind="sft"))
    assert np.isfinite(float(result.loss)) and float(result.loss) > 0


def test_conversations_sharing_a_prefix_share_tokens(tmp_path, tokenizer_dir):
    a = CONVERSATION
    b = CONVERSATION[:-1] + [{"role": "assistant", "content": "Sunny, 18C."}]  # branches at the last turn
    path = _jsonl(tmp_path / "group.jsonl", [{"messages": m, "reward": w, "group_id": "paris"}
                                             for m, w in ((a, 1.0), (b, 0.0))])  # fmt: skip
    ra, rb = read_rollouts(path, tokenizer=str(tokenizer_dir))
    prompt = tokenize_chat(CONVERSATION[:-1] + [{"role": "assistant", "content": ""}], tokenizer_dir)
    header = int(np.flatnonzero(prompt.loss_mask)[0])  # tokens up to and including the last turn's header
    common = 0
    while ra.tokens[common] == rb.tokens[common]:
        common += 1
    assert common >= header and np.array_equal(ra.tokens[:header], prompt.tokens[:header])
    forest = harts.build_forest([ra.tokens, rb.tokens])
    assert forest.num_tokens == len(ra.tokens) + len(rb.tokens) - common
    assert forest.num_tokens < len(ra.tokens) + len(rb.tokens)
    # one group, kept whole in one step
    steps = list(iter_rollout_steps(path, rollouts_per_step=1, tokenizer=tokenizer_dir))
    assert [[x.reward for x in s] for s in steps] == [[1.0, 0.0]]


def test_a_chat_line_needs_a_tokenizer(tmp_path, tokenizer_dir):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    needs = r"chat.jsonl, line 1, field 'messages': the chat form needs a tokenizer"
    with pytest.raises(ValueError, match=needs):
        read_rollouts(path)
    with pytest.raises(FileNotFoundError, match="no such tokenizer directory"):
        read_rollouts(path, tokenizer=tmp_path / "missing")
    with pytest.raises(TypeError, match="tokenizer must be a local directory or a loaded"):
        read_rollouts(path, tokenizer=42)
    # the token form keeps working without one; with one, its ids must lie in the vocabulary
    tokens = _jsonl(tmp_path / "tokens.jsonl", [{"tokens": [1, 2, 3]}, {"tokens": [1, 500]}])
    assert len(list(iter_rollouts(tokens))) == 2
    with pytest.raises(ValueError, match=r"line 2, position 1: token id 500 is outside the vocabulary"):
        read_rollouts(tokens, tokenizer=tokenizer_dir)


GOOD = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"messages": [{"content": "hi"}] + GOOD}, r"field 'messages', message 0: 'role' missing"),
        ({"messages": GOOD[:1] + [{"role": "robot", "content": "x"}]},
         r"field 'messages', message 1: unknown role 'robot'"),
        ({"messages": [GOOD[0], {"role": "assistant", "content": 7}]},
         r"field 'messages', message 1: 'content' must be a string, got int"),
        ({"messages": GOOD + [{"role": "tool", "content": ["18C"]}]},
         r"field 'messages', message 2: 'content' must be a string, got list"),
        ({"messages": [{"role": "user"}] + GOOD[1:]}, r"field 'messages', message 0: 'content' missing"),
        ({"messages": [{**GOOD[0], "tool_calls": []}, GOOD[1]]},
         r"field 'messages', message 0: 'tool_calls' on a user message"),
        ({"messages": {"role": "user"}}, r"field 'messages': expected a list of messages, got dict"),
        ({"messages": "[{"}, r"field 'messages': a string but not valid JSON"),
        ({"messages": GOOD[:1]}, r"field 'messages': no assistant message"),
        ({"messages": GOOD[1:] + GOOD}, r"field 'messages', message 0: the conversation opens with an"),
        ({"messages": GOOD, "advantages": [0.0, 1.0]}, r"field 'advantages': the chat form takes one number"),
        ({"messages": GOOD, "loss_mask": [0, 1]}, r"field 'loss_mask': not part of the chat form"),
        ({"messages": GOOD, "tokens": [1, 2]}, r"fields 'tokens' and 'messages': a line has one or the"),
        ({"messages": GOOD, "reward": float("nan")}, r"field 'reward': NaN"),
        ({"tokens": [1, 2, 3]}, r"field 'tokens': this line is in the tokens form but .*line 1 is in the"),
        ({"messages": GOOD, "advantage": 0.5},
         r"field 'advantage': not a field of the chat form, but close to 'advantages', which this line "
         r"lacks: rename it 'advantages'"),
        ({"messages": GOOD, "Reward": 1.0}, r"field 'Reward': not a field of the chat form, but close to 'r"),
        ({"messages": GOOD, "tool": [{"type": "function"}]}, r"field 'tool': not a field of the chat form"),
        ({"messages": [GOOD[0], {"role": "assistant", "contnet": "hello"}]},
         r"field 'messages', message 1: key 'contnet' is close to 'content', which the message lacks"),
        ({"messages": [GOOD[0], {"role": "assistant", "content": None, "tool_call": [{"type": "function"}]}]},
         r"field 'messages', message 1: key 'tool_call' is close to 'tool_calls'"),
        ({"messages": [{"Role": "user", "content": "hi"}, GOOD[1]]},
         r"field 'messages', message 0: key 'Role' is close to 'role'"),
    ],
    ids=["no-role", "unknown-role", "content-int", "tool-content-list", "no-content", "user-tool-calls",
         "not-a-list", "bad-json", "no-assistant", "assistant-first", "advantage-list", "loss-mask",
         "both-forms", "nan-reward", "mixed-forms", "near-advantages", "near-reward", "near-tools",
         "near-content", "near-tool-calls", "near-role"],
)  # fmt: skip
def test_bad_chat_lines_name_file_line_and_field(tmp_path, tokenizer_dir, record, match):
    path = _jsonl(tmp_path / "bad.jsonl", [{"messages": GOOD}, json.dumps(record, allow_nan=True)])
    assert len(read_rollouts(_jsonl(tmp_path / "good.jsonl", [{"messages": GOOD}]), tokenizer_dir)) == 1
    with pytest.raises((ValueError, TypeError), match=r"bad.jsonl, line 2, " + match):
        read_rollouts(path, tokenizer=tokenizer_dir)


def test_other_chat_fields_and_message_keys_are_kept(tmp_path, tokenizer_dir):
    """Metadata beside the chat fields, and message keys other than role, content and tool_calls
    (tool_call_id, name, a near name holding another kind of value), pass as they are."""
    messages = [GOOD[0], {**GOOD[1], "name": "bot", "tool_call_id": "c1", "contents": 3}]
    path = _jsonl(tmp_path / "r.jsonl", [{"messages": messages, "agent": "v3", "rewards": {"format": 1}}])
    (item,) = iter_rollouts(path, tokenizer=tokenizer_dir)
    assert item.metadata == {"agent": "v3", "rewards": {"format": 1}}


def test_consecutive_tool_results_in_one_block(tmp_path):
    """Only what the model saw must be prefix-stable: the prompt before each assistant turn and the
    conversation through it, not the rendering between two tool results."""
    tok_dir = save_tokenizer(tmp_path / "block", TOOL_BLOCK)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = CONVERSATION[:2] + [
        {"role": "assistant", "tool_calls": [WEATHER_CALL, call]},  # no content: tool calls only
        {"role": "tool", "content": "18C"},
        {"role": "tool", "content": "9C"},
        {"role": "assistant", "content": "Paris is warmer."},
    ]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert not tok.apply_chat_template(messages[:5], tokenize=False).startswith(
        tok.apply_chat_template(messages[:4], tokenize=False)
    )  # the block is not prefix-stable message by message
    chat = tokenize_chat(messages, tok)
    text = tok.decode(chat.tokens.tolist())
    block = "<|im_start|>user\n<tool_response>18C</tool_response><tool_response>9C</tool_response><|im_end|>"
    assert block in text
    turns = [tok.decode(chat.tokens[a:b].tolist()) for a, b in _runs(chat.loss_mask)]
    assert turns == [
        '<tool_call>get_weather({"city": "Paris"})</tool_call><tool_call>get_weather({"city": "Oslo"})'
        "</tool_call><|im_end|>",
        "Paris is warmer.<|im_end|>",
    ]


def test_a_template_that_is_not_prefix_stable_is_refused(tmp_path):
    tok_dir = save_tokenizer(tmp_path / "drops", DROPS_REASONING)
    one_turn = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"}]
    ok = tokenize_chat(one_turn, tok_dir)  # a single turn is stable: the reasoning is trained on
    assert ok.mask_from == "progressive" and ok.loss_mask.sum() == len("<think>add</think>4") + 1
    two_turns = one_turn + [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    path = _jsonl(tmp_path / "r.jsonl", [{"messages": two_turns}])
    with pytest.raises(ValueError, match=r"r.jsonl, line 1, field 'messages', message 2: the chat template "
                                         r"is not prefix-stable"):  # fmt: skip
        read_rollouts(path, tokenizer=tok_dir)


def test_a_tokenizer_merging_across_the_turn_boundary_is_refused(tmp_path):
    # "\nHe" is one token: the prompt ends in "\n", the reply's tokens start with "\nHe"
    tok_dir = save_tokenizer(tmp_path / "merges", CHAT_TEMPLATE, extra_tokens=["\nHe"])
    assert len(tokenize_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                             tok_dir).tokens) > 0  # fmt: skip
    with pytest.raises(ValueError, match=r"message 1: the renderings are prefixes as text but not as tokens"):
        tokenize_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}], tok_dir)


def test_generation_markers_give_the_mask_when_the_template_has_them(tmp_path):
    tok_dir = save_tokenizer(tmp_path / "marked", MARKED)
    chat = tokenize_chat(CONVERSATION, tok_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    assert chat.mask_from == "generation markers"
    # the markers enclose the content only: no tool call text, no end-of-turn token
    turns = [tok.decode(chat.tokens[a:b].tolist()) for a, b in _runs(chat.loss_mask)]
    assert turns == ["Checking.", "18C and sunny."]
    # markers that reach into the header are refused
    header_marked = CHAT_TEMPLATE.replace(
        "<|im_start|>assistant\n{% if m.content %}{{ m.content }}{% endif %}",
        "{% generation %}<|im_start|>assistant\n{% if m.content %}{{ m.content }}{% endif %}"
        "{% endgeneration %}",
    )  # fmt: skip
    bad = save_tokenizer(tmp_path / "bad", header_marked)
    with pytest.raises(ValueError, match=r"generation markers cover token \d+, outside every assistant turn"):
        tokenize_chat(CONVERSATION, bad)


def test_parquet_chat_rows_read_as_the_jsonl_lines(tmp_path, tokenizer_dir):
    other = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    records = [{"messages": CONVERSATION, "reward": 1.0, "group_id": "a"},
               {"messages": other, "reward": 0.0, "group_id": "b"}]  # fmt: skip
    from_jsonl = read_rollouts(_jsonl(tmp_path / "r.jsonl", records), tokenizer=tokenizer_dir)
    # messages as nested columns (pyarrow fills the keys a message lacks with nulls, dropped on reading)
    # and as JSON text (which keeps every message exactly as written)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "nested.parquet")
    as_text = [{**r, "messages": json.dumps(r["messages"])} for r in records]
    pq.write_table(pa.Table.from_pylist(as_text), tmp_path / "text.parquet")
    for name in ("nested.parquet", "text.parquet"):
        rows = read_rollouts(tmp_path / name, tokenizer=tokenizer_dir)
        assert len(rows) == 2
        for x, y in zip(rows, from_jsonl, strict=True):
            assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.loss_mask, y.loss_mask)
            assert (x.reward, x.group_id) == (y.reward, y.group_id)
    # the nulls are dropped before the template sees them (its "'tool_calls' in m" would see a null)
    assert check_messages([{"role": "user", "content": "Hi", "tool_calls": None}]) == [other[0]]
    bad = [{"messages": [{"role": "user", "content": "hi"}, {"role": "critic", "content": "no"}]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad.parquet, row 0, field 'messages', message 1: unknown role"):
        read_rollouts(tmp_path / "bad.parquet", tokenizer=tokenizer_dir)


def test_analyze_reads_a_chat_file_with_its_tokenizer(tmp_path, tokenizer_dir, capsys):
    from harts.cli import main

    b = CONVERSATION[:-1] + [{"role": "assistant", "content": "Sunny, 18C."}]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m, "group_id": "paris"} for m in (CONVERSATION, b)])
    main(["analyze", str(path), "--tokenizer", str(tokenizer_dir), "--json"])
    stats = json.loads(capsys.readouterr().out)
    ra, rb = read_rollouts(path, tokenizer=tokenizer_dir)
    assert stats["trajectories"] == 2
    assert stats["unique_tokens"] == harts.build_forest([ra.tokens, rb.tokens]).num_tokens
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", str(path)])
    assert exit_info.value.code == 2 and "tokenizer" in capsys.readouterr().err
