"""What a pass reads from the final hidden states of its rows: log-probs, or a scalar head's values.

The step (:func:`harts.forest_backward`) and the forward-only pass (:mod:`harts.runtime.forward_only`)
run the backbone over a forest's unique tokens and then read two per-row quantities from the
hidden state of each row's *predictor* (a unique token). Which head reads them is a
:class:`Readout`:

- :class:`LogprobReadout`: a causal LM's ``lm_head``; the row's (log-prob of its target,
  entropy), the softmax once per distinct predictor (``row_logprobs``).
- :class:`ScalarReadout`: a one-output linear ``score`` head (a critic's value head, a reward
  model's score): the row's (value, 0). The target id is not read.

Everything else (micro-batches, cuts and hand-over, recomputation, exact gradients under any
budget) is the same for both, so a critic or a reward model gets every guarantee the policy has
without a second engine. The model a readout belongs to is reached through its adapter like a
causal LM (``model.model`` is the backbone): :func:`scalar_head` says which models carry a score
head harts reads exactly and refuses the rest before compute.
"""

from __future__ import annotations

import torch
from torch import nn

from harts.adapters.base import logit_softcap
from harts.runtime.executor import check_targets, row_logprobs

__all__ = ["Readout", "LogprobReadout", "ScalarReadout", "scalar_head", "readout_for"]

Tensor = torch.Tensor


class Readout:
    """A head read at each row's predicting position: ``(first [r], second [r])`` per row.

    ``head``: the module read (its weight dtype sets the values' precision);
    ``check_targets(target)``: raise before compute for targets the head cannot read.
    """

    head: nn.Module

    @property
    def dtype(self) -> torch.dtype:
        """The values' precision: the head's, at least fp32 (fp64 for an fp64 model)."""
        return torch.promote_types(self.head.weight.dtype, torch.float32)

    def check_targets(self, target: Tensor) -> None:
        pass

    def __call__(
        self, hidden: Tensor, local: Tensor, target: Tensor, chunk_rows: int
    ) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


class LogprobReadout(Readout):
    """(log-prob of the target, entropy) under ``softmax(cap(lm_head(h)) / temperature)``, with
    ``cap`` the stock head's final logit soft-cap (``softcap``; None: none)."""

    def __init__(self, head: nn.Module, temperature: float = 1.0, softcap: float | None = None):
        self.head, self.temperature, self.softcap = head, temperature, softcap

    def check_targets(self, target: Tensor) -> None:
        check_targets(target, self.head)

    def __call__(self, hidden, local, target, chunk_rows):
        return row_logprobs(
            self.head, hidden, local, target, chunk_rows, self.temperature, softcap=self.softcap
        )


class ScalarReadout(Readout):
    """(``score(h)[0]``, 0) per row: the head's one output at the row's predictor.

    The head is called as a module (its bias, hooks and adapters act as in the stock forward),
    once per distinct predictor; rows sharing a predictor read the same value.
    """

    def __init__(self, head: nn.Module):
        self.head = head

    def __call__(self, hidden, local, target, chunk_rows):
        unique, inverse = torch.unique(local, return_inverse=True)
        value = self.head(hidden[unique])[:, 0].to(self.dtype)[inverse]
        return value, torch.zeros_like(value).detach()


def scalar_head(model: nn.Module, what: str) -> nn.Module:
    """The ``score`` head of a critic or reward model, checked: one output, a plain linear layer.

    Accepted: a supported family's ``*ForTokenClassification`` or ``*ForSequenceClassification``
    with ``num_labels=1``, or :class:`harts.ValueHead` (a causal LM's backbone with a scalar
    head). The token classifier's dropout is the identity in eval mode; in train mode a positive
    one is refused by the model checks (harts does not draw dropout masks over a forest).
    """
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{what} needs a model with a linear score head over the backbone's final hidden states "
            f"(a *ForTokenClassification or *ForSequenceClassification with num_labels=1, or "
            f"harts.ValueHead), got {type(model).__name__}"
        )
    if head.out_features != 1:
        raise ValueError(
            f"{what} reads one scalar per position, but {type(model).__name__}.score has "
            f"{head.out_features} outputs (num_labels={head.out_features}); build the model with num_labels=1"
        )
    return head


def readout_for(model: nn.Module, readout: Readout | None, temperature: float = 1.0) -> Readout:
    """``readout``, or the causal LM's log-prob readout of ``model.lm_head`` when None."""
    if readout is not None:
        if not isinstance(readout, Readout):
            raise TypeError(f"expected a harts Readout, got {type(readout).__name__}")
        return readout
    head = getattr(model, "lm_head", None)
    if head is None:
        raise ValueError(
            f"{type(model).__name__} has no lm_head: log-probs need a causal LM (a critic's values come "
            f"from harts.forward_values, a reward model's scores from harts.score)"
        )
    return LogprobReadout(head, temperature, softcap=logit_softcap(model))
