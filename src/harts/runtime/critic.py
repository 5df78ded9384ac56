"""Critics and reward models on forests, forward only: values per position, scores per trajectory.

A PPO critic is a backbone with a scalar head read at every position (verl:
``AutoModelForTokenClassification`` with ``num_labels=1``); a reward model is the same backbone
with the head read at each sequence's last token (``*ForSequenceClassification``). Both read
final hidden states, so on a forest each unique token is computed once and the head is read at
the rows' positions: the forward-only pass of :mod:`harts.runtime.forward_only` with a
:class:`~harts.runtime.readout.ScalarReadout` instead of the log-prob readout (same micro-batches
under ``budget_tokens``, same cuts and hand-over, no graph).

Alignment (:func:`forward_values`): the value of position ``p`` is the head at the state after
token ``p - 1``, ``values[p] = V(h_{p-1})``, as verl reads its critic
(``values[:, -response_length - 1 : -1]``): the value of the state *before* token ``p`` is
generated, laid out like ``Rollout.rollout_logprobs`` (position ``p`` is read from ``p - 1``).
Position 0 has none and holds ``fill``. The state after the last token (the value after the
episode) is not read.

Scores (:func:`score`): stock ``*ForSequenceClassification`` reads each sequence at its rightmost
token that is not ``pad_token_id`` (position 0 when every token is), or at its last token when
the config has no pad token; :func:`score` reads each trajectory where stock reads it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from harts.forest import Forest
from harts.runtime.config import RunConfig
from harts.runtime.forward_only import (
    PositionScatter,
    RowLogprobs,
    forest_and_masks,
    forest_row_readout,
    forward_only_model,
    position_rows,
)
from harts.runtime.readout import ScalarReadout, scalar_head
from harts.runtime.verify import entry_point

__all__ = ["ForestValues", "ForestScores", "forward_values", "score", "score_positions"]

Tensor = torch.Tensor


@dataclass(eq=False)
class ForestValues:
    """What :func:`forward_values` returns.

    - ``values``: per trajectory [L_i]: ``values[i][p] = V(h_{p-1})``, position 0 ``fill``; ready
      for ``Rollout(..., values=...)``.
    - ``forest``: the forest that ran; ``rows``: the row values (in ``rows.logprob``) and what the
      plan did (micro-batches, cuts, timings).
    """

    values: list[Tensor]
    forest: Forest
    rows: RowLogprobs


@dataclass(eq=False)
class ForestScores:
    """What :func:`score` returns: ``scores`` [B] (one per trajectory), ``positions`` [B] (where
    each trajectory was read), the ``forest`` and the ``rows`` of the pass."""

    scores: Tensor
    positions: list[int]
    forest: Forest
    rows: RowLogprobs


def _head(model: nn.Module, what: str) -> nn.Module:
    return scalar_head(forward_only_model(model), what)


def forward_values(
    critic: nn.Module,
    inputs,
    *,
    run: RunConfig | None = None,
    budget_tokens: int | None = None,
    share_prefixes: bool = True,
    fill: float = 0.0,
) -> ForestValues:
    """Per-trajectory per-position values of ``critic``, forward only, under a token budget.

    ``critic``: a supported family's ``*ForTokenClassification`` with ``num_labels=1`` (or
    :class:`harts.ValueHead`). ``inputs``: a Forest, rollouts or token sequences, merged by common
    prefix (``share_prefixes=False``: the flat layout). ``run`` / ``budget_tokens``: the
    micro-batches, as for :func:`harts.forest_logprobs`. Alignment: module docstring. Every check
    runs before any compute.
    """
    head = _head(critic, "forward_values")
    forest, _ = forest_and_masks(inputs, share_prefixes)
    lengths = forest.trajectory_length.tolist()
    positions = [np.arange(1, n) for n in lengths]
    predictor, target = position_rows(forest, positions)
    with entry_point("forward_values"):  # a failed check names the function the user called
        rows = forest_row_readout(
            critic,
            forest,
            predictor,
            torch.zeros_like(target),
            ScalarReadout(head),
            run=run,
            budget_tokens=budget_tokens,
        )
    return ForestValues(
        PositionScatter(lengths, positions, rows.logprob.device)(rows.logprob, fill), forest, rows
    )


def score_positions(forest: Forest, pad_token_id: int | None) -> list[int]:
    """Where stock ``*ForSequenceClassification`` reads each trajectory alone: its rightmost token
    that is not ``pad_token_id`` (0 if all are), its last token without a pad token."""
    out = []
    for i in range(forest.num_trajectories):
        tokens = forest.tokens[forest.trajectory_token_indices(i)].numpy()
        if pad_token_id is None:
            out.append(tokens.size - 1)
        else:
            kept = np.flatnonzero(tokens != pad_token_id)
            out.append(int(kept[-1]) if kept.size else 0)
    return out


def score(
    reward_model: nn.Module,
    inputs,
    *,
    run: RunConfig | None = None,
    budget_tokens: int | None = None,
    share_prefixes: bool = True,
) -> ForestScores:
    """One score per trajectory from ``reward_model`` (a ``*ForSequenceClassification`` with
    ``num_labels=1``), forward only, shared prefixes computed once, under a token budget.

    Each trajectory is read where stock reads it alone (module docstring), so ``scores[i]`` equals
    ``reward_model(input_ids=[trajectory i]).logits[0, 0]``. ``inputs``, ``run``,
    ``budget_tokens``, ``share_prefixes``: as for :func:`forward_values`.
    """
    head = _head(reward_model, "score")
    forest, _ = forest_and_masks(inputs, share_prefixes)
    config = forward_only_model(reward_model).config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = score_positions(forest, getattr(text_config, "pad_token_id", None))
    predictor = torch.stack([forest.trajectory_token_indices(i)[q] for i, q in enumerate(positions)])
    rows = forest_row_readout(
        reward_model,
        forest,
        predictor,
        torch.zeros_like(predictor),
        ScalarReadout(head),
        run=run,
        budget_tokens=budget_tokens,
    )
    return ForestScores(rows.logprob, positions, forest, rows)
