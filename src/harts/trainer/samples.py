"""Completions of fixed prompts during a run (``[samples]``), by the model's own ``generate``.

What a loss curve cannot show: what the policy now writes. Every ``samples.every_steps``
optimizer updates (and after the last) each prompt of ``samples.prompts`` is completed with
``model.generate`` (transformers' own decoding, the model's own cache; harts' forest is for
training, not for decoding), greedy or sampled, and one JSON line per prompt is appended to
``OUT/samples.jsonl``: ``step``, ``prompt`` (its line number), ``prompt_tokens``, ``tokens``
(the completion) and, with a tokenizer, ``text``.

The prompts file is JSONL, one prompt a line: ``{"tokens": [ids]}``, or ``{"text": "..."}``
with a tokenizer (``samples.tokenizer``, else ``data.tokenizer``). It is read and checked when
the run starts (before the model loads). Sampling draws from a generator seeded by (seed,
step) inside a forked RNG, so the run's own random state, which a resume restores, is not
touched, and a resumed run writes the same samples; ``samples.jsonl`` is trimmed to the
checkpoint's step on resume, as ``metrics.jsonl`` is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from harts.trainer.config import TrainConfig

__all__ = ["Samples"]

SAMPLES = "samples.jsonl"


class Samples:
    """The prompts (checked on construction) and the completions of one step."""

    def __init__(self, config: TrainConfig, vocab_size: int | None):
        section = config.samples
        self.section, self.seed = section, config.seed
        tokenizer_dir = section.tokenizer or config.data.tokenizer
        self.tokenizer = None
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        self.prompts = list(_read_prompts(section.prompts, self.tokenizer, vocab_size))
        if not self.prompts:
            raise ValueError(f"samples.prompts: {section.prompts}: no prompts")

    def due(self, step: int, total: int) -> bool:
        return step % self.section.every_steps == 0 or step == total

    def __call__(self, model: nn.Module, step: int) -> list[dict]:
        """One record per prompt: its completion by ``model.generate`` with the weights of ``step``."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        out = []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
                torch.manual_seed(self.seed * 1_000_003 + step)
                for line, prompt in self.prompts:
                    ids = torch.tensor([prompt], device=device)
                    generated = model.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=not self.section.greedy,
                        max_new_tokens=self.section.max_new_tokens, pad_token_id=0,
                    )  # fmt: skip
                    tokens = generated[0, len(prompt) :].tolist()
                    record = {"step": step, "prompt": line, "prompt_tokens": prompt, "tokens": tokens}
                    if self.tokenizer is not None:
                        record["text"] = self.tokenizer.decode(tokens)
                    out.append(record)
        finally:
            model.train(was_training)
        return out


def _read_prompts(path: Path, tokenizer, vocab_size: int | None):
    """``(line, token ids)`` of each prompt; errors name the file, the line and the field."""
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path.name}, line {number}"
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(record, dict) or set(record) - {"tokens", "text"} or len(record) != 1:
            raise ValueError(f"{where}: expected one field, 'tokens' (a list of ids) or 'text'")
        if "text" in record:
            if tokenizer is None:
                raise ValueError(f"{where}, field 'text': a text prompt needs a tokenizer: set "
                                 f"samples.tokenizer (or data.tokenizer), or give 'tokens'")  # fmt: skip
            if not isinstance(record["text"], str) or not record["text"]:
                raise ValueError(f"{where}, field 'text': expected a non-empty string")
            tokens = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        else:
            tokens = record["tokens"]
            if not isinstance(tokens, list) or not tokens or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
            ):
                raise ValueError(f"{where}, field 'tokens': expected a non-empty list of token ids "
                                 f"(integers >= 0)")  # fmt: skip
        limit = vocab_size if tokenizer is None else min(vocab_size or len(tokenizer), len(tokenizer))
        for position, token in enumerate(tokens):
            if limit is not None and token >= limit:
                raise ValueError(f"{where}, position {position}: token id {token} is outside the vocabulary "
                                 f"(size {limit})")  # fmt: skip
        yield number, tokens
