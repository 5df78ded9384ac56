"""Chat rollouts: conversations tokenised with a local tokenizer's chat template, masked on assistant turns.

A conversation is a list of messages ``{"role", "content"}`` with the roles ``system``, ``user``,
``assistant`` and ``tool``; an assistant message may carry ``tool_calls`` (then its ``content``
may be null or absent), a ``tool`` message carries a tool's result. Messages are handed to the
template as they are (keys whose value is None dropped), so ``tool_calls`` take the shape the
template expects. :func:`tokenize_chat` turns one into token ids and a loss mask that is true
exactly on the assistant turns' tokens.

The mask comes from **progressive rendering**, which needs nothing from the template: render the
messages before each assistant message with the generation prompt (what the model answered), the
messages through it, and so on to the whole conversation; each rendering of this chain must be a
prefix of the next, as text and as token ids (*prefix stability*; renderings the model never saw,
between two tool results say, need not be). An assistant turn's tokens are then the rendering
through the assistant message less the rendering before it with the generation prompt (so the
role header is not in the mask), cut after its last
special token (the end-of-turn token): what the template writes after that, a newline between
turns, is the next prompt's, not the model's. A template that is not prefix-stable (one that
rewrites earlier turns once a later message comes, such as dropping earlier reasoning), or a
tokenizer that merges tokens across a turn boundary, is refused, naming the message: the tokens
the model saw at that turn are not those of the whole conversation, and no mask would be right.

A template with ``{% generation %}`` markers, read by a fast tokenizer, gives the mask from its
markers instead (``apply_chat_template(..., return_assistant_tokens_mask=True)``): the template's
author says what the model generates. Prefix stability is still required, and the marked tokens
must lie inside the assistant turns.

What this leaves out: chat template keyword arguments (``enable_thinking`` and the like), content
given as a list of parts (images, audio), and the sampler's own token ids and log-probs (the text
is re-tokenised: for exact log-prob ratios keep the token form).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ROLES",
    "ChatTokens",
    "load_tokenizer",
    "check_messages",
    "tokenize_chat",
    "resembles",
    "first_difference",
]

ROLES = ("system", "user", "assistant", "tool")
# the message keys harts reads; a key this close to one of them (and holding its kind of value) is
# taken for a misspelling, since the template would ignore it and the message lose its content
MESSAGE_KEYS = {"role": str, "content": str, "tool_calls": (list, tuple)}
# keys templates read that are near one of MESSAGE_KEYS but no misspelling of it
_PASSED_KEYS = {"tool_call_id", "name", "reasoning_content", "thinking"}

# a name this close to a known one (difflib's ratio of the names lowercased without _ - . and spaces)
# is taken for a misspelling of it, by the chat form's message keys and the rollout files' fields
NEAR_MISS_CUTOFF = 0.8


def resembles(name: str, known) -> str | None:
    """The name in ``known`` that ``name`` is a near miss of (case, ``_``/``-``, a letter or two), or None."""

    def normalised(text: str) -> str:
        return re.sub(r"[\s_.\-]", "", text.lower())

    by_norm = {normalised(k): k for k in known}
    match = difflib.get_close_matches(normalised(name), list(by_norm), n=1, cutoff=NEAR_MISS_CUTOFF)
    return by_norm[match[0]] if match else None


_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_tokenizer(tokenizer: Any) -> Any:
    """A loaded tokenizer: ``tokenizer`` itself, or the one in the local directory it names.

    Only a local directory is read (``local_files_only=True``): harts never downloads one.
    """
    if isinstance(tokenizer, (str, Path)):
        path = Path(tokenizer)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path}: no such tokenizer directory (a local directory saved by save_pretrained; "
                f"nothing is downloaded)"
            )
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
            raise ValueError(f"{path}: not a loadable tokenizer directory ({exc})") from None
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise TypeError(
            f"tokenizer must be a local directory or a loaded Hugging Face tokenizer, "
            f"got {type(tokenizer).__name__}"
        )
    return tokenizer


@dataclass(frozen=True)
class ChatTokens:
    """One tokenised conversation: ``tokens`` [L] (int64), ``loss_mask`` [L] (bool, true exactly on
    the assistant turns' tokens), and ``mask_from``: ``"progressive"`` or ``"generation markers"``."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    mask_from: str


def _json_field(where: str, name: str, value: Any) -> Any:
    """A field given as JSON text (a Parquet string column) parsed; anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}, field {name!r}: a string but not valid JSON ({exc.msg})") from None
    return value


def check_messages(messages: Any, where: str = "conversation") -> list[dict]:
    """Check a conversation's messages; return them with the keys whose value is None dropped.

    ``messages`` may be a list or its JSON text. Raises ValueError (TypeError for wrong kinds)
    naming ``where``, the field ``'messages'`` and the message index.
    """
    messages = _json_field(where, "messages", messages)
    if not isinstance(messages, (list, tuple)):
        kind = type(messages).__name__
        raise TypeError(f"{where}, field 'messages': expected a list of messages, got {kind}")
    if not messages:
        raise ValueError(f"{where}, field 'messages': empty conversation")
    checked = []
    for i, message in enumerate(messages):
        at = f"{where}, field 'messages', message {i}"
        if not isinstance(message, dict):
            kind = type(message).__name__
            raise TypeError(f"{at}: expected an object with 'role' and 'content', got {kind}")
        message = {k: v for k, v in message.items() if v is not None}
        _check_keys(at, message)
        role = message.get("role")
        if role is None:
            raise ValueError(f"{at}: 'role' missing")
        if role not in ROLES:
            raise ValueError(f"{at}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ValueError(f"{at}: 'tool_calls' on a {role} message; only an assistant calls tools")
            if not isinstance(calls, (list, tuple)) or not all(isinstance(c, dict) for c in calls):
                raise TypeError(f"{at}: 'tool_calls' must be a list of objects")
        content = message.get("content")
        if content is None:
            if not calls:
                raise ValueError(f"{at}: 'content' missing (only an assistant calling tools may omit it)")
        elif not isinstance(content, str):
            raise TypeError(f"{at}: 'content' must be a string, got {type(content).__name__}")
        checked.append(message)
    return checked


def _check_keys(at: str, message: dict) -> None:
    """Refuse a key named like role, content or tool_calls (which the message lacks) with such a value."""
    for key, value in message.items():
        if key in MESSAGE_KEYS or key in _PASSED_KEYS:
            continue
        near = resembles(key, MESSAGE_KEYS)
        if near is not None and near not in message and isinstance(value, MESSAGE_KEYS[near]):
            raise ValueError(
                f"{at}: key {key!r} is close to {near!r}, which the message lacks: rename it {near!r} (other "
                f"keys go to the template as they are, and it would not read this one)"
            )


def _check_tools(where: str, tools: Any) -> list[dict] | None:
    tools = _json_field(where, "tools", tools)
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise TypeError(f"{where}, field 'tools': expected a list of tool schemas (objects)")
    return list(tools)


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return ids


def first_difference(a: Sequence, b: Sequence) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one prefixes the other)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _assistant_turns(at: str, messages: list[dict]) -> list[int]:
    """Indices of the assistant messages: the turns the loss mask covers, each after a prompt."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        raise ValueError(f"{at}: no assistant message, so nothing to train on")
    if assistants[0] == 0:
        raise ValueError(
            f"{at}, message 0: the conversation opens with an assistant turn, which has no prompt"
        )
    return assistants


def _render(at: str, tokenizer, messages: list[dict], tools, k: int, prompt: bool) -> str:
    """The text of the first ``k`` messages (with the generation prompt when ``prompt``); a template
    error names message ``k - 1``, the one that was added last."""
    try:
        text = tokenizer.apply_chat_template(
            messages[:k], tools=tools, tokenize=False, add_generation_prompt=prompt
        )
    except Exception as exc:  # a template's raise_exception, a jinja error
        why = f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{at}, message {k - 1}: the chat template failed ({why})") from None
    if not isinstance(text, str):
        kind = type(text).__name__
        raise TypeError(f"{at}: apply_chat_template(tokenize=False) returned {kind}, not text")
    return text


def _rendering_chain(render, assistants: list[int], n: int) -> list[tuple[int, bool, str]]:
    """The chain of what the model saw and wrote, as (last message index, generation prompt, text).

    The prompt before each assistant message (with the generation prompt), the conversation through
    it, ..., the whole conversation of ``n`` messages: each must be a prefix of the next.
    """
    chain: list[tuple[int, bool, str]] = []
    for a in assistants:
        chain += [(a - 1, True, render(a, True)), (a, False, render(a + 1, False))]
    if assistants[-1] != n - 1:
        chain.append((n - 1, False, render(n, False)))
    return chain


def _check_text_prefixes(at: str, render, chain: list[tuple[int, bool, str]]) -> None:
    """Refuse a chain whose renderings are not each a prefix of the next, naming the message to blame.

    Renderings between two links (after a tool result that another follows, say) are never seen by
    the model and need not be prefixes; they are read only to find the first message that breaks it.
    """
    for j in range(1, len(chain)):
        (k0, _, before), (k1, prompt, after) = chain[j - 1], chain[j]
        if after.startswith(before):
            continue
        if not prompt and k1 == k0 + 1 and chain[j - 1][1]:  # an assistant message after its prompt
            raise ValueError(
                f"{at}, message {k1}: the chat template is not prefix-stable: the assistant message does "
                f"not render as the generation prompt followed by the reply (they differ from character "
                f"{first_difference(before, after)}), so its tokens cannot be told"
            )
        for k in range(k0 + 1, k1 + 1 if prompt else k1):  # the first message whose rendering breaks it
            text = render(k + 1, False)
            if not text.startswith(before):
                raise ValueError(
                    f"{at}, message {k}: the chat template is not prefix-stable: adding this message "
                    f"changes how the earlier ones render (from character {first_difference(before, text)}; "
                    f"e.g. a template that drops earlier reasoning), so the tokens the model saw at each "
                    f"turn are not those of the whole conversation"
                )
        k = k1 + 1 if prompt else k1
        raise ValueError(
            f"{at}, message {k}: the chat template is not prefix-stable: the conversation before this "
            f"message renders differently once it{' (its generation prompt)' if prompt else ''} is added "
            f"(from character {first_difference(before, after)})"
        )


def _tokenize_chain(at: str, tokenizer, chain: list[tuple[int, bool, str]]) -> list:
    """Token ids of each rendering of the chain, refused unless each is a prefix of the next as ids
    too: a tokenizer that merges across a turn boundary gave the model other tokens than these."""
    try:
        ids = tokenizer([text for _, _, text in chain], add_special_tokens=False)["input_ids"]
    except Exception as exc:
        raise ValueError(f"{at}: the tokenizer failed on the rendered conversation ({exc})") from None
    for j in range(1, len(chain)):
        shorter, longer = ids[j - 1], ids[j]
        if list(longer[: len(shorter)]) != list(shorter):
            k = chain[j][0] + 1 if chain[j][1] else chain[j][0]
            raise ValueError(
                f"{at}, message {k}: the renderings are prefixes as text but not as tokens: the tokenizer "
                f"merges across the turn boundary (token {first_difference(shorter, longer)} differs), so "
                f"the tokens the model saw at that turn are not those of the whole conversation"
            )
    return ids


def _marker_mask(at: str, tokenizer, messages, tools, tokens: np.ndarray, turns) -> np.ndarray:
    """The loss mask the template's generation markers give, refused where it differs in tokens from
    the progressive rendering or covers a token outside every assistant turn."""
    length = tokens.size
    mask = np.zeros(length, dtype=bool)
    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except Exception as exc:
        raise ValueError(f"{at}: the chat template's generation markers failed ({exc})") from None
    if list(out["input_ids"]) != tokens.tolist():
        raise ValueError(f"{at}: the rendering with generation markers differs from the one without")
    mask[:] = np.asarray(out["assistant_masks"], dtype=bool)
    inside = np.zeros(length, dtype=bool)
    for start, end in turns:
        inside[start:end] = True
    if (mask & ~inside).any():
        pos = int(np.argmax(mask & ~inside))
        raise ValueError(
            f"{at}: the chat template's generation markers cover token {pos}, outside every assistant "
            f"turn (a header or another role's message)"
        )
    return mask


def _progressive_mask(tokenizer, tokens: np.ndarray, turns) -> np.ndarray:
    """The loss mask on each assistant turn's tokens, cut after its last special token."""
    mask = np.zeros(tokens.size, dtype=bool)
    special = _special_ids(tokenizer)
    for start, end in turns:
        last = [p for p in range(start, end) if int(tokens[p]) in special]
        if last:  # the end-of-turn token; what follows is the template's separator, not the model's
            end = last[-1] + 1
        mask[start:end] = True
    return mask


def tokenize_chat(
    messages: Any, tokenizer: Any, *, tools: Any = None, where: str = "conversation"
) -> ChatTokens:
    """Token ids and the assistant-turn loss mask of one conversation (see the module docstring).

    ``tokenizer``: a local tokenizer directory or a loaded tokenizer with a chat template.
    ``tools``: tool schemas handed to the template (``apply_chat_template(tools=...)``).
    Errors name ``where`` (a file and line when reading a file), the field and the message.
    """
    tokenizer = load_tokenizer(tokenizer)
    messages = check_messages(messages, where)
    tools = _check_tools(where, tools)
    at = f"{where}, field 'messages'"
    assistants = _assistant_turns(at, messages)
    try:
        template = tokenizer.get_chat_template(None, tools)
    except Exception as exc:
        raise ValueError(f"{at}: the tokenizer has no usable chat template ({exc})") from None

    def render(k: int, prompt: bool) -> str:
        return _render(at, tokenizer, messages, tools, k, prompt)

    chain = _rendering_chain(render, assistants, len(messages))
    _check_text_prefixes(at, render, chain)
    ids = _tokenize_chain(at, tokenizer, chain)
    tokens = np.asarray(ids[-1], dtype=np.int64)
    # [start, end) of each assistant turn's tokens, header excluded
    turns = [(len(ids[2 * j]), len(ids[2 * j + 1])) for j in range(len(assistants))]
    if _GENERATION_MARKER.search(template) and getattr(tokenizer, "is_fast", False):
        return ChatTokens(
            tokens, _marker_mask(at, tokenizer, messages, tools, tokens, turns), "generation markers"
        )
    return ChatTokens(tokens, _progressive_mask(tokenizer, tokens, turns), "progressive")
