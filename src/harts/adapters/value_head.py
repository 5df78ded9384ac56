"""A value model for families transformers ships without a ``*ForTokenClassification`` class.

verl builds its critic as ``AutoModelForTokenClassification`` with ``num_labels=1``: the family's
backbone and ``score = nn.Linear(hidden, 1)`` over its final hidden states, the value of every
position. Some families (``bailing_hybrid``) have no such class in transformers. :class:`ValueHead`
is that model built from a ``*ForCausalLM``: its backbone (the same module, not a copy) and a
scalar linear head; the causal LM's ``lm_head`` is left out. Its ``forward`` is the stock
backbone's forward followed by the head, so it is its own per-trajectory reference, exactly as a
token classifier is, and harts runs it over a forest like one (``.model`` and ``.score``).
"""

from __future__ import annotations

import torch
from torch import nn

from harts.adapters.base import adapter_for

__all__ = ["ValueHead"]


class ValueHead(nn.Module):
    """``causal_lm``'s backbone with ``score = nn.Linear(hidden_size, 1, bias=bias)``.

    ``forward(input_ids, **kwargs)`` -> [B, L, 1]: ``score(backbone(input_ids).last_hidden_state)``,
    the value of each position's state (as ``*ForTokenClassification.logits`` with one label).
    The head is initialised as ``nn.Linear`` is (zeroed with ``zero_init=True``), in the backbone's
    dtype and device; save and load the whole critic with ``state_dict`` / ``load_state_dict``.
    The backbone's parameters are shared with ``causal_lm`` (train a copy for a separate critic).
    Refused: a family whose harts adapter folds a logit multiplier into the final norm (a score
    head over the backbone would read scaled states).
    """

    def __init__(self, causal_lm: nn.Module, bias: bool = True, zero_init: bool = False):
        super().__init__()
        adapter = adapter_for(causal_lm)
        self.config = causal_lm.config
        self.model = adapter.backbone(causal_lm)
        weight = next(self.model.parameters())
        self.score = nn.Linear(
            self.config.hidden_size, 1, bias=bias, dtype=weight.dtype, device=weight.device
        )
        if zero_init:
            with torch.no_grad():
                self.score.weight.zero_()
                if bias:
                    self.score.bias.zero_()
        self.train(causal_lm.training)
        adapter_for(self)  # refuses a family harts cannot read a score head from

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.score(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
