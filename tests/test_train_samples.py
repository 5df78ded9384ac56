"""``[samples]``: completions of fixed prompts by the model's own ``generate`` during a run.

Greedy completions written at the last step must be the argmax continuation of the final
checkpoint's stock forward, token by token (no tolerance: an argmax, and the fp32 logits of
``generate`` and of the stock forward are the same computation on the same weights up to
rounding, which would only matter at a near-tie: the test's margins are checked to be wide).
Bad prompts stop the run before the model loads, naming the line.
"""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from tests.helpers import one_thread, run_train, write_config  # noqa: F401 (autouse: one thread)

PROMPTS = [[5, 17, 33, 9], [70, 3]]


def test_greedy_samples_are_the_stock_argmax_continuation(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    samples = {"prompts": str(prompts), "every_steps": 2, "max_new_tokens": 6}
    config = write_config(tmp_path / "run.toml", {"steps": 2}, optimizer={"lr": 1e-2}, samples=samples)
    assert run_train(config, tmp_path / "out") == 0
    lines = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    places = [(r["step"], r["prompt"], r["prompt_tokens"]) for r in lines]
    assert places == [(2, 1, PROMPTS[0]), (2, 2, PROMPTS[1])]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoints" / "step-000002").eval()
    for record in lines:
        ids = list(record["prompt_tokens"])
        with torch.no_grad():
            for _ in range(6):
                logits = model(torch.tensor([ids])).logits[0, -1]
                top = torch.topk(logits, 2).values
                assert top[0] - top[1] > 1e-3  # no near-tie for rounding to flip
                ids.append(int(logits.argmax()))
        assert record["tokens"] == ids[len(record["prompt_tokens"]) :]


def test_a_text_prompt_without_a_tokenizer_is_refused(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"tokens": [5, 6]}\n{"text": "hello"}\n')
    config = write_config(tmp_path / "run.toml", samples={"prompts": str(prompts)})
    assert run_train(config, tmp_path / "out") == 2
    assert "prompts.jsonl, line 2, field 'text': a text prompt needs a tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
