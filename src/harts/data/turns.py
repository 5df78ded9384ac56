"""The turns form of rollout files: one record per engine request, stitched into exact trajectories.

An agent stack calls its engine once per turn and can log each call as it is made: the whole
context the engine saw (``prompt_token_ids``), what it sampled (``completion_token_ids``) and the
sampler's log-probs (``completion_logprobs``), with the trajectory's id, the turn's number and,
on one turn, the trajectory's reward. :func:`stitch_trajectory` rebuilds the trajectory from its
records: the last turn's prompt followed by its completion, the loss mask true on every turn's
completion tokens and nowhere else, the sampler's log-probs at those positions (0 elsewhere).

That is exact only when each turn's prompt begins with the previous turn's prompt and completion
(the agent appended tool output and a new header, and changed nothing the model had seen). When a
prompt does not (*context drift*: a truncated history, a re-rendered earlier turn, a summarised
tool result), the trajectory is split there into pieces, each exact for what the model saw at its
turns; or, with ``split_drift=False``, refused, naming the line. Nothing is ever merged across a
drift.

The converters turn one engine response into one record: :func:`turn_from_vllm` (vLLM's
OpenAI-compatible ``/v1/completions`` JSON), :func:`turn_from_sglang` (SGLang's ``/generate``
JSON) and :func:`turns_from_chat` (a conversation of the chat form, with a tokenizer).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from harts.data.chat import first_difference
from harts.objectives.rollout import Rollout

__all__ = [
    "TURNS_FIELDS",
    "TurnPiece",
    "stitch_trajectory",
    "check_turn",
    "turn_from_vllm",
    "turn_from_sglang",
    "turns_from_chat",
    "ContextDriftWarning",
]

TURNS_FIELDS = (
    "trajectory_id",
    "turn",
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
    "group_id",
    "reward",
    "routed_experts",
)
#: fields whose presence makes a record one of the turns form
TURNS_MARKERS = ("trajectory_id", "prompt_token_ids", "completion_token_ids")


class ContextDriftWarning(UserWarning):
    """Trajectories of a turns-form file were split where their context drifted."""


@dataclass(frozen=True)
class TurnPiece:
    """One exact piece of a stitched trajectory (the whole trajectory when its context never drifted)."""

    rollout: Rollout
    where: str  # "file, line N, trajectory 'id'" (N: the line of the piece's last turn)
    metadata: dict
    piece: int  # 0, 1, ... within the trajectory
    pieces: int
    drift: str | None  # where the trajectory was first split ("file, line N, trajectory 'id', turn k")


def _at(where: str, trajectory: Any) -> str:
    return f"{where}, trajectory {trajectory!r}"


def _ids(at: str, name: str, value: Any, vocab_size: int | None, *, empty: bool) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{at}, field {name!r}: expected a list of token ids, got {type(value).__name__}")
    if not value and not empty:
        raise ValueError(f"{at}, field {name!r}: empty (the engine saw at least one token)")
    for position, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(
                f"{at}, field {name!r}, position {position}: token id {token!r} is not an integer"
            )
    if value:
        array = np.asarray(value, dtype=np.int64)
        if (low := int(array.min())) < 0:
            raise ValueError(f"{at}, field {name!r}, position {int(array.argmin())}: negative token id {low}")
        if vocab_size is not None and (high := int(array.max())) >= vocab_size:
            raise ValueError(
                f"{at}, field {name!r}, position {int(array.argmax())}: token id {high} is outside "
                f"the vocabulary (vocab_size={vocab_size})"
            )
    return list(value)


def check_turn(
    where: str, record: dict, vocab_size: int | None = None
) -> tuple[Any, int, list, list, list | None, np.ndarray | None]:
    """One record's fields checked: (trajectory_id, turn, prompt ids, completion ids, log-probs or
    None, recorded routes [prompt + completion, layers, k] or None)."""
    trajectory = record.get("trajectory_id")
    if trajectory is None:
        raise ValueError(
            f"{where}, field 'trajectory_id': missing (every record of the turns form names its trajectory)"
        )
    if isinstance(trajectory, (bool, float, list, dict)):
        raise TypeError(
            f"{where}, field 'trajectory_id': expected a string or an integer, got "
            f"{type(trajectory).__name__}"
        )
    at = _at(where, trajectory)
    for name in ("turn", "prompt_token_ids", "completion_token_ids"):
        if record.get(name) is None:
            raise ValueError(f"{at}, field {name!r}: missing")
    turn = record["turn"]
    if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
        raise ValueError(f"{at}, field 'turn': expected an integer >= 0, got {turn!r}")
    prompt = _ids(at, "prompt_token_ids", record["prompt_token_ids"], vocab_size, empty=False)
    completion = _ids(at, "completion_token_ids", record["completion_token_ids"], vocab_size, empty=True)
    logprobs = record.get("completion_logprobs")
    if logprobs is not None:
        if not isinstance(logprobs, (list, tuple)):
            raise TypeError(
                f"{at}, field 'completion_logprobs': expected a list, got {type(logprobs).__name__}"
            )
        if len(logprobs) != len(completion):
            raise ValueError(
                f"{at}, field 'completion_logprobs': {len(logprobs)} log-probs for "
                f"{len(completion)} completion tokens (one per completion token)"
            )
        for position, value in enumerate(logprobs):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value > 0
            ):
                raise ValueError(
                    f"{at}, field 'completion_logprobs', position {position}: {value!r} is not a "
                    f"finite log-probability <= 0"
                )
        logprobs = [float(v) for v in logprobs]
    reward = record.get("reward")
    if reward is not None and (
        isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward)
    ):
        raise ValueError(f"{at}, field 'reward': expected a finite number, got {reward!r}")
    routes = _turn_routes(at, record.get("routed_experts"), len(prompt) + len(completion))
    return trajectory, turn, prompt, completion, logprobs, routes


def _turn_routes(at: str, value: Any, length: int) -> np.ndarray | None:
    """A turn's recorded MoE routes as int32 [prompt + completion, layers, k]: the engine ran every
    token of its request but the last sampled one, whose row may be left out (then -1)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{at}, field 'routed_experts': expected a list, got {type(value).__name__}")
    routes = np.asarray(value)
    if routes.ndim != 3 or routes.dtype.kind not in "iu" or routes.shape[0] not in (length, length - 1):
        raise ValueError(
            f"{at}, field 'routed_experts': expected [tokens, decoder layers, top-k] integers for the "
            f"{length} prompt and completion tokens (or all but the last), got shape {routes.shape}"
        )
    if routes.size and int(routes.min()) < -1:
        position = int(np.argwhere(routes < -1)[0, 0])
        raise ValueError(f"{at}, field 'routed_experts', position {position}: expert id {int(routes.min())}")
    missing = np.full((length - routes.shape[0], *routes.shape[1:]), -1, dtype=np.int32)
    return np.concatenate([routes.astype(np.int32), missing])


def _check_turn_numbers(trajectory: Any, ordered: list[tuple[str, dict, tuple]]) -> None:
    """Refuse turns not numbered 0, 1, ... (one missing or repeated): the stitch follows that order."""
    for i, (where, _, checked) in enumerate(ordered):
        if checked[1] != i:
            at = _at(where, trajectory)
            if i and checked[1] == ordered[i - 1][2][1]:
                raise ValueError(
                    f"{at}, field 'turn': turn {checked[1]} repeated ({ordered[i - 1][0]} has it too)"
                )
            raise ValueError(
                f"{at}, field 'turn': turn {i} missing (this record is turn {checked[1]}; "
                f"turns are numbered 0, 1, ... with none left out)"
            )


def _trajectory_reward(trajectory: Any, ordered: list[tuple[str, dict, tuple]]) -> Any:
    """The trajectory's one reward: given on exactly one of its turns, since it scores the whole."""
    rewarded = [(where, record) for where, record, _ in ordered if record.get("reward") is not None]
    if not rewarded:
        raise ValueError(
            f"{_at(ordered[-1][0], trajectory)}, field 'reward': on no turn of the trajectory; "
            f"give it on one turn (normally the last)"
        )
    if len(rewarded) > 1:
        raise ValueError(
            f"{_at(rewarded[1][0], trajectory)}, field 'reward': also given on "
            f"{rewarded[0][0]}; give the trajectory's reward on one turn only"
        )
    return rewarded[0][1]["reward"]


def _has_logprobs(trajectory: Any, ordered: list[tuple[str, dict, tuple]]) -> bool:
    """Whether the turns carry log-probs: on every turn or on none, so a piece's are whole."""
    return _on_every_turn_or_none(trajectory, ordered, 4, "completion_logprobs")


def _on_every_turn_or_none(
    trajectory: Any, ordered: list[tuple[str, dict, tuple]], slot: int, name: str
) -> bool:
    """Whether the turns carry field ``name`` (checked value ``slot``): on every turn or on none, so a
    piece's are whole."""
    given = [t[2][slot] is not None for t in ordered]
    if any(given) and not all(given):
        i = given.index(not given[0])
        state = "given" if given[i] else "missing"
        raise ValueError(
            f"{_at(ordered[i][0], trajectory)}, field {name!r}: {state} on turn {i} "
            f"but not so on turn 0 ({ordered[0][0]}): give them on every turn or on none"
        )
    return given[0]


def _extend_routes(routes: np.ndarray | None, turn: np.ndarray | None) -> np.ndarray | None:
    """A piece's routes after a turn that extends it: each token keeps the row of the first turn that
    ran it (what the engine computed when it sampled what follows), the new tokens take the turn's."""
    if turn is None:
        return None
    if routes is None:
        return turn.copy()
    merged = turn.copy()
    n = routes.shape[0]
    merged[:n] = np.where(routes >= 0, routes, turn[:n])
    return merged


def _stitch_pieces(
    trajectory: Any, ordered: list[tuple[str, dict, tuple]], split_drift: bool
) -> tuple[list[tuple[list, list, list, str, dict]], str | None]:
    """The turns joined into exact pieces (tokens, mask, log-probs, where, metadata), and where the
    context first drifted (None if never).

    A turn whose prompt starts with the piece so far extends it (the new prompt tokens unmasked, the
    completion masked); one that does not starts a new piece, or is refused with ``split_drift=False``.
    """
    pieces: list[tuple[list, list, list, str, dict, np.ndarray | None]] = []
    drift = None
    for i, (where, record, (_, _, prompt, completion, logprobs, routes)) in enumerate(ordered):
        extra = {k: v for k, v in record.items() if k not in TURNS_FIELDS}
        if pieces:
            tokens, mask, lps, _, meta, piece_routes = pieces[-1]
            n = len(tokens)
            if len(prompt) >= n and prompt[:n] == tokens:
                tail = prompt[n:]
                tokens += tail + completion
                mask += [0] * len(tail) + [1] * len(completion)
                lps += [0.0] * len(tail) + (logprobs or [0.0] * len(completion))
                pieces[-1] = (
                    tokens,
                    mask,
                    lps,
                    where,
                    {**meta, **extra},
                    _extend_routes(piece_routes, routes),
                )
                continue
            at = f"{_at(where, trajectory)}, turn {i}"
            if not split_drift:
                diff = first_difference(prompt, tokens)
                raise ValueError(
                    f"{at}, field 'prompt_token_ids': the context drifted: this prompt does not start with "
                    f"turn {i - 1}'s prompt and completion (they differ from position {diff}; {len(prompt)} "
                    f"and {n} tokens), and data.split_drift = false refuses to split the trajectory there"
                )
            drift = drift or at
        pieces.append(
            (
                list(prompt) + completion,
                [0] * len(prompt) + [1] * len(completion),
                [0.0] * len(prompt) + (logprobs or [0.0] * len(completion)),
                where,
                extra,
                _extend_routes(None, routes),
            )
        )
    return pieces, drift


def stitch_trajectory(
    turns: list[tuple[str, dict, tuple]], group: Any, split_drift: bool = True
) -> list[TurnPiece]:
    """A trajectory's pieces from its records ``(where, record, check_turn(...))``, in any order.

    Refuses a turn number missing or repeated, a reward on no turn or on two, log-probs on some
    turns only, and (``split_drift=False``) a context that drifted, each naming a line.
    """
    trajectory = turns[0][2][0]
    ordered = sorted(turns, key=lambda t: t[2][1])
    _check_turn_numbers(trajectory, ordered)
    reward = _trajectory_reward(trajectory, ordered)
    has_lp = _has_logprobs(trajectory, ordered)
    _on_every_turn_or_none(trajectory, ordered, 5, "routed_experts")
    pieces, drift = _stitch_pieces(trajectory, ordered, split_drift)
    out = []
    for k, (tokens, mask, lps, where, meta, routes) in enumerate(pieces):
        rollout = Rollout(
            tokens=tokens,
            loss_mask=mask,
            rollout_logprobs=lps if has_lp else None,
            reward=reward,
            group_id=group,
            routed_experts=routes,
            trajectory_id=trajectory if len(pieces) > 1 else None,
        )
        out.append(TurnPiece(rollout, _at(where, trajectory), meta, k, len(pieces), drift))
    return out


# ---- converters: one engine response -> one record of the turns form ----------------------------


def _record(trajectory_id, turn, prompt, completion, logprobs, group_id, reward, extra, routes=None) -> dict:
    record = {
        "trajectory_id": trajectory_id,
        "turn": turn,
        "prompt_token_ids": [int(t) for t in prompt],
        "completion_token_ids": [int(t) for t in completion],
    }
    if logprobs is not None:
        record["completion_logprobs"] = [float(v) for v in logprobs]
    if group_id is not None:
        record["group_id"] = group_id
    if reward is not None:
        record["reward"] = reward
    if routes is not None:
        record["routed_experts"] = routes
    return {**record, **(extra or {})}


def _engine_routes(value: Any, layers_top_k: tuple[int, int] | None, source: str) -> list | None:
    """An engine's recorded routes as nested lists [tokens][layers][k]: a nested list as it is, or
    base64 of int32 values (SGLang's encoding), which ``layers_top_k`` (the model's decoder layers
    and top-k) shapes."""
    if value is None:
        return None
    if not isinstance(value, str):
        return [[list(map(int, row)) for row in token] for token in value]
    if layers_top_k is None:
        raise ValueError(
            f"{source} is base64 of int32 expert ids: pass layers_top_k=(decoder layers, top-k) of the "
            f"model to shape it"
        )
    flat = np.frombuffer(base64.b64decode(value), dtype="<i4")
    width = layers_top_k[0] * layers_top_k[1]
    if flat.size % width:
        raise ValueError(
            f"{source} holds {flat.size} expert ids, not a whole number of tokens of {layers_top_k}"
        )
    return flat.reshape(-1, *layers_top_k).tolist()


def _token_id(token: str) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise ValueError(
            f"logprobs.tokens holds {token!r}, not 'token_id:<id>': request the completion with "
            f"return_tokens_as_token_ids = true (or return_token_ids = true)"
        )
    return int(token.removeprefix("token_id:"))


def turn_from_vllm(
    response: dict,
    trajectory_id: Any,
    turn: int,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    group_id: Any = None,
    reward: float | None = None,
    choice: int = 0,
    extra: dict | None = None,
    layers_top_k: tuple[int, int] | None = None,
) -> dict:
    """One turns-form record from the JSON of a vLLM ``/v1/completions`` response.

    The request asks for ``logprobs`` (0 is enough: the sampled token's log-prob is always there)
    and for token ids: ``return_token_ids`` (the choice then carries ``prompt_token_ids`` and
    ``token_ids``) or ``return_tokens_as_token_ids`` (``logprobs.tokens`` reads ``"token_id:<id>"``).
    ``prompt_token_ids``: the ids the request sent as its prompt, when the choice does not carry them.
    The choice's ``routed_experts`` (the MoE routes of the request's tokens, nested lists or base64
    int32 shaped by ``layers_top_k``), when the engine returns them, become the record's.
    """
    item = response["choices"][choice]
    prompt = item.get("prompt_token_ids") or prompt_token_ids
    if prompt is None:
        raise ValueError(
            "the response has no prompt_token_ids: request it with return_token_ids = true, or "
            "pass prompt_token_ids= the ids the request sent"
        )
    logprobs = item.get("logprobs")
    completion = item.get("token_ids")
    if completion is None:
        if not logprobs or logprobs.get("tokens") is None:
            raise ValueError(
                "the response has neither token_ids nor logprobs.tokens: request it with "
                "return_token_ids = true or logprobs and return_tokens_as_token_ids = true"
            )
        completion = [_token_id(t) for t in logprobs["tokens"]]
    values = None if not logprobs else logprobs.get("token_logprobs")
    routes = _engine_routes(item.get("routed_experts"), layers_top_k, "the choice's routed_experts")
    return _record(trajectory_id, turn, prompt, completion, values, group_id, reward, extra, routes)


def turn_from_sglang(
    response: dict,
    trajectory_id: Any,
    turn: int,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    group_id: Any = None,
    reward: float | None = None,
    extra: dict | None = None,
    layers_top_k: tuple[int, int] | None = None,
) -> dict:
    """One turns-form record from the JSON of an SGLang ``/generate`` response.

    The request sends ``input_ids`` and asks for ``return_logprob = true``:
    ``meta_info.output_token_logprobs`` then holds ``[logprob, token_id, text]`` per completion
    token. ``prompt_token_ids``: the ``input_ids`` the request sent; without them, the prompt is read
    from ``meta_info.input_token_logprobs`` (requested with ``logprob_start_len = 0``), which must
    cover all ``meta_info.prompt_tokens``. With ``return_routed_experts = true``,
    ``meta_info.routed_experts`` (base64 of int32 ids, [tokens, decoder layers, top-k] for every
    token the request ran: all but the last sampled one) becomes the record's ``routed_experts``;
    ``layers_top_k``: the model's decoder layers and top-k, which shape it.
    """
    meta = response["meta_info"]
    out = meta.get("output_token_logprobs")
    if out is None:
        raise ValueError(
            "the response has no meta_info.output_token_logprobs: request it with return_logprob = true"
        )
    completion = [entry[1] for entry in out]
    if response.get("output_ids") is not None and list(response["output_ids"]) != completion:
        raise ValueError("output_ids and meta_info.output_token_logprobs name different tokens")
    prompt = prompt_token_ids
    if prompt is None:
        given = meta.get("input_token_logprobs")
        if given is None or len(given) != meta.get("prompt_tokens", len(given)):
            raise ValueError(
                "pass prompt_token_ids= the input_ids the request sent (the response's "
                "meta_info.input_token_logprobs does not cover the prompt: request them with "
                "logprob_start_len = 0)"
            )
        prompt = [entry[1] for entry in given]
    routes = _engine_routes(meta.get("routed_experts"), layers_top_k, "meta_info.routed_experts")
    logprobs = [entry[0] for entry in out]
    return _record(trajectory_id, turn, prompt, completion, logprobs, group_id, reward, extra, routes)


def turns_from_chat(
    messages: Any,
    tokenizer: Any,
    trajectory_id: Any,
    *,
    tools: Any = None,
    group_id: Any = None,
    reward: float | None = None,
) -> list[dict]:
    """A conversation of the chat form as turns-form records, one per assistant turn (no log-probs).

    Its tokens and mask come from :func:`harts.data.chat.tokenize_chat`; each run of masked tokens
    is a completion, and its prompt is every token before it. The reward goes on the last turn.
    """
    from harts.data.chat import load_tokenizer, tokenize_chat

    chat = tokenize_chat(messages, load_tokenizer(tokenizer), tools=tools)
    mask = np.asarray(chat.loss_mask, dtype=bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    tokens = list(chat.tokens)
    spans = list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))
    return [
        _record(
            trajectory_id,
            k,
            tokens[:start],
            tokens[start:end],
            None,
            group_id,
            reward if k == len(spans) - 1 else None,
            None,
        )
        for k, (start, end) in enumerate(spans)
    ]
