"""The fields of each form of rollout files, and the refusal of a near miss of one.

A field misspelt (``lossmask``, ``advantage``, ``Loss-Mask``) would silently take its default and
train on something else than the user meant, so a name close to one of the form's fields
(:func:`harts.data.chat.resembles`) whose value could be that field's is refused, naming the field.
"""

from __future__ import annotations

from typing import Any

from harts.data.chat import resembles
from harts.data.rollout_images import IMAGE_FIELDS
from harts.data.turns import TURNS_FIELDS

__all__ = ["ROLLOUT_FIELDS", "CHAT_FIELDS", "STEP_ANNOTATIONS", "check_names"]

ROLLOUT_FIELDS = (
    "tokens",
    "loss_mask",
    "rollout_logprobs",
    "ref_logprobs",
    "advantages",
    "reward",
    "group_id",
    "first_error_position",
    "routed_experts",
)
# the chat form's fields; the token form's per-position ones and first_error_position have no place there
CHAT_FIELDS = ("messages", "tools", "advantages", "reward", "group_id")
# the annotations every rollout of a step has, or none has (validate_rollouts refuses a mix)
STEP_ANNOTATIONS = ("rollout_logprobs", "ref_logprobs", "advantages")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# whether a value could be the field's (a near-miss name with a value of another kind is metadata:
# "n_tokens": 57 is a count, not the token ids)
_FITS = {
    "tokens": lambda v: isinstance(v, (list, tuple)),
    "loss_mask": lambda v: isinstance(v, (list, tuple)),
    "rollout_logprobs": lambda v: isinstance(v, (list, tuple)),
    "ref_logprobs": lambda v: isinstance(v, (list, tuple)),
    "advantages": lambda v: isinstance(v, (list, tuple)) or _number(v),
    "reward": _number,
    "group_id": lambda v: True,
    "first_error_position": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "routed_experts": lambda v: isinstance(v, (list, tuple, str)),
    "messages": lambda v: isinstance(v, (list, tuple, str)),
    "tools": lambda v: isinstance(v, (list, tuple, str)),
    "trajectory_id": lambda v: isinstance(v, (str, int)),
    "turn": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "prompt_token_ids": lambda v: isinstance(v, (list, tuple)),
    "completion_token_ids": lambda v: isinstance(v, (list, tuple)),
    "completion_logprobs": lambda v: isinstance(v, (list, tuple)),
    "images": lambda v: isinstance(v, (list, tuple, str)),
    "image_file": lambda v: isinstance(v, str),
}
_FORM_FIELDS = {"tokens": (*ROLLOUT_FIELDS, *IMAGE_FIELDS), "chat": CHAT_FIELDS, "turns": TURNS_FIELDS}


def check_names(where: str, record: dict, form: str, cache: dict) -> None:
    """Refuse a field named like one of the form's fields (absent from the line) with a value that fits it."""
    known = _FORM_FIELDS[form]
    if form == "tokens" and "tokens" not in record:
        known = (*known, "messages")  # a misspelled 'messages' leaves a line without either
    for name, value in record.items():
        if name in known:
            continue
        key = (name, known)
        if key not in cache:
            cache[key] = resembles(name, known)
        field = cache[key]
        if field is not None and field not in record and (value is None or _FITS[field](value)):
            raise ValueError(
                f"{where}, field {name!r}: not a field of the {form} form, but close to {field!r}, which "
                f"this line lacks: rename it {field!r} (or, if it is metadata, to a name not this close to "
                f"a field's)",
            )
