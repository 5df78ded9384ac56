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

Under torchrun: with DDP every rank holds the whole model, so rank 0 generates alone (with the
plain module) and the others go on to the next step, where they wait for it. With FSDP2 no rank
holds the whole model, so every rank runs ``model.generate`` on every prompt with
``synced_gpus=True`` (transformers keeps every rank stepping until all are done, as under
ZeRO-3) and FSDP2's own hooks gather each decoder layer's unit for its forward; the root unit
(embeddings, head) is gathered for the whole call and every unit is resharded after it, as
harts' own step expects to find them. Every rank computes the same tokens (the same weights, the
same prompts, the same seeded generator); rank 0 writes them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from harts.trainer.config import TrainConfig
from harts.trainer.processes import Ranks

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

    def __call__(self, model: nn.Module, step: int, ranks: Ranks | None = None) -> list[dict]:
        """One record per prompt: its completion by ``model.generate`` with the weights of ``step``.

        With ``ranks`` every rank calls it: under DDP (``model`` the plain module) rank 0
        generates and the others return no records at once; under FSDP2 (``model`` the sharded
        one) every rank generates in lock step and returns the same records."""
        if ranks is not None and ranks.strategy == "ddp" and not ranks.main:
            return []
        sharded = ranks is not None and ranks.strategy == "fsdp"
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        out = []
        try:
            with (
                torch.no_grad(),
                torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]),
                _gathered(model, device) if sharded else contextlib.nullcontext(),
            ):
                torch.manual_seed(self.seed * 1_000_003 + step)
                for line, prompt in self.prompts:
                    ids = torch.tensor([prompt], device=device)
                    generated = model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        do_sample=not self.section.greedy,
                        max_new_tokens=self.section.max_new_tokens,
                        pad_token_id=0,
                        **({"synced_gpus": True} if sharded else {}),
                    )
                    tokens = generated[0, len(prompt) :].tolist()
                    record = {"step": step, "prompt": line, "prompt_tokens": prompt, "tokens": tokens}
                    if self.tokenizer is not None:
                        record["text"] = self.tokenizer.decode(tokens)
                    out.append(record)
        finally:
            model.train(was_training)
        return out


@contextlib.contextmanager
def _gathered(model: nn.Module, device: torch.device):
    """An FSDP2 model ready for ``generate`` on every rank, and every unit resharded after.

    FSDP2 finds its root unit at the first forward through it: one forward of the model (a
    single token) runs first, so the root found is the model, also when ``generate`` goes
    around the model's own forward (a peft model generates through its base model), which would
    otherwise make the first decoder layer to run its own root. The root unit is then gathered
    for the whole call (a root's parameters are not resharded after its forward; a peft model's
    root forward is not called at all); decoder layers gather and reshard themselves in their
    forward hooks. After the call every unit is resharded: harts' step gathers units itself,
    from sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
        model.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()


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
                raise ValueError(
                    f"{where}, field 'text': a text prompt needs a tokenizer: set "
                    f"samples.tokenizer (or data.tokenizer), or give 'tokens'"
                )
            if not isinstance(record["text"], str) or not record["text"]:
                raise ValueError(f"{where}, field 'text': expected a non-empty string")
            tokens = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
        else:
            tokens = record["tokens"]
            if (
                not isinstance(tokens, list)
                or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
            ):
                raise ValueError(
                    f"{where}, field 'tokens': expected a non-empty list of token ids (integers >= 0)"
                )
        limit = vocab_size if tokenizer is None else min(vocab_size or len(tokenizer), len(tokenizer))
        for position, token in enumerate(tokens):
            if limit is not None and token >= limit:
                raise ValueError(
                    f"{where}, position {position}: token id {token} is outside the vocabulary (size {limit})"
                )
        yield number, tokens
