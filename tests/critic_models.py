"""Tiny critics and reward models of the stock classes, and their fp64 per-trajectory truth.

A critic is verl's: ``AutoModelForTokenClassification`` with ``num_labels=1`` (a family's
``*ForTokenClassification``: backbone, eval-mode dropout, ``score = nn.Linear(hidden, 1)`` with
bias); for ``bailing_hybrid``, which transformers ships without one, :class:`harts.ValueHead` over
the stock ``*ForCausalLM``'s backbone. A reward model is ``AutoModelForSequenceClassification``
with ``num_labels=1``. The truth is each trajectory alone through the same model class in fp64,
the linear-attention kernels exact (``tests/reference.py``).
"""

from __future__ import annotations

import copy
import functools

import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

import harts
from harts.tiny import FAMILIES, tiny_config, tiny_model
from tests.reference import exact_linear_kernels

# full attention; Gated DeltaNet + gated attention, MoE; KDA + MLA, MoE (through harts.ValueHead)
CRITIC_FAMILIES = [f for f in ("qwen3", "qwen3_next", "bailing_hybrid") if f in FAMILIES]
REWARD_FAMILIES = [f for f in ("qwen3", "qwen3_next") if f in FAMILIES]


def _perturb_bias(model):
    """A non-zero head bias (stock initialises it to 0), so that reading it is tested."""
    with torch.no_grad():
        if model.score.bias is not None:
            model.score.bias.fill_(0.37)
    return model


@functools.cache
def critic(family: str, seed: int = 5) -> torch.nn.Module:
    """A tiny eval-mode critic of ``family`` (see the module docstring)."""
    if family == "bailing_hybrid":
        lm = tiny_model(family, seed=seed)
        torch.manual_seed(seed + 1)
        return _perturb_bias(harts.ValueHead(lm)).eval()
    torch.manual_seed(seed)
    return _perturb_bias(
        AutoModelForTokenClassification.from_config(tiny_config(family, num_labels=1))
    ).eval()


@functools.cache
def reward_model(family: str, seed: int = 6, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_config(family, num_labels=1, **overrides)
    return AutoModelForSequenceClassification.from_config(config).eval()


def fp64(model):
    """The same weights in fp64, MoE experts on the eager loop (grouped_mm has no fp64 path)."""
    out = copy.deepcopy(model).double()
    for module in out.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
    return out


def stock_outputs(model, trajectories) -> list[torch.Tensor]:
    """[L_i] head outputs at every position of each trajectory alone, in fp64 (truth)."""
    model64 = fp64(model)
    out = []
    with torch.no_grad(), exact_linear_kernels(model64.model):
        for t in trajectories:
            ids = torch.as_tensor(list(t), dtype=torch.long)[None]
            logits = model64(input_ids=ids)
            out.append((logits if isinstance(logits, torch.Tensor) else logits.logits)[0, ..., 0])
    return out
