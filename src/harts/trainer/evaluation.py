"""Held-out rollouts scored during a run (``[eval]``), forward only, every shared prefix once.

Every ``eval.every_steps`` optimizer updates (and after the last) the model's log-probs of the
eval file's rollouts are computed with :func:`harts.forest_logprobs` (no autograd, under
``eval.budget_tokens``, at the objective's temperature, at the loss positions only) and
reduced over every loss token of the file:

- ``eval/loss``: the mean negative log-prob (SFT's token-mean loss; it needs no advantages or
  sampler log-probs, so any held-out file of the tokens or chat form scores);
- ``eval/logprob``: the mean log-prob (``-eval/loss``, the number RL write-ups quote);
- ``eval/kl``: with ``[reference]``, the mean of ``objective.kl_estimator`` between the model's
  and the reference's log-probs;
- ``eval/tokens``, ``eval/seconds``.

Why these and not the objective's loss: a PPO loss on held-out data needs advantages and old
log-probs that a held-out file does not have; the log-prob is what the policy puts on the
held-out behaviour. The file is read and checked when the run starts (before the model loads),
so a bad line stops the run with its line named before any step. On several ranks each rank
scores its own trees of the file (:mod:`harts.trainer.rank_passes`). The reduction runs in fp64
over the fp32 log-probs, so the figures differ from the exact ones by the log-probs' own error.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from harts.data.rollout_files import iter_rollouts
from harts.objectives.losses import kl_penalty
from harts.objectives.rollout import Rollout
from harts.runtime.config import RunConfig
from harts.runtime.forward_only import forest_logprobs
from harts.trainer.config import TrainConfig
from harts.trainer.processes import Ranks
from harts.trainer.rank_passes import over_ranks

__all__ = ["Evaluation"]


class Evaluation:
    """The eval file's rollouts (checked on construction) and the pass that scores a model."""

    def __init__(self, config: TrainConfig, vocab_size: int | None):
        section = config.eval
        self.every = section.every_steps
        tokenizer = config.data.tokenizer
        self.rollouts: list[Rollout] = [r.rollout for r in iter_rollouts(section.file, tokenizer, vocab_size)]
        if not self.rollouts:
            raise ValueError(f"eval.file: {section.file}: no rollouts")
        self.masks = [_loss_mask(r) for r in self.rollouts]
        self.tokens = int(sum(int(m.sum()) for m in self.masks))
        if self.tokens == 0:
            raise ValueError(f"eval.file: {section.file}: no rollout has a loss position to score")
        run = config.run.run_config()
        budget = section.budget_tokens or run.budget_tokens
        self.run: RunConfig = dataclasses.replace(run, budget_tokens=budget)
        self.temperature = config.objective.temperature
        self.estimator = config.objective.kl_estimator

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total

    def _logprobs(self, model: nn.Module, ranks: Ranks | None) -> torch.Tensor:
        def compute(share: list[Rollout]) -> list[torch.Tensor]:
            out = forest_logprobs(
                model, share, run=self.run, temperature=self.temperature, loss_positions_only=True
            )
            return [lp.detach().cpu() for lp in out.logprobs]

        logprobs = over_ranks(ranks, model, self.run, self.rollouts, compute)
        scored = zip(logprobs, self.masks, strict=True)
        return torch.cat([lp.double()[m] for lp, m in scored])

    def __call__(
        self, model: nn.Module, reference: nn.Module | None = None, ranks: Ranks | None = None
    ) -> dict:
        """``eval/*`` metrics of ``model`` (and the KL to ``reference``) on the eval file; with
        ``ranks`` (every rank calls it), each rank scores its own trees of the file and the
        log-probs are exchanged once, so every rank reduces the whole file's, as one process does."""
        began = time.perf_counter()
        logprobs = self._logprobs(model, ranks)
        mean = float(logprobs.mean())
        record = {"eval/loss": -mean, "eval/logprob": mean, "eval/tokens": self.tokens}
        if reference is not None:
            ref = self._logprobs(reference, ranks)
            record["eval/kl"] = float(kl_penalty(logprobs, ref, self.estimator).mean())
        record["eval/seconds"] = time.perf_counter() - began
        return record


def _loss_mask(rollout: Rollout) -> torch.Tensor:
    """The positions scored: the loss mask, or every position but the first (no mask: plain text)."""
    n = len(rollout.tokens)
    if rollout.loss_mask is None:
        mask = torch.ones(n, dtype=torch.bool)
        mask[0] = False
        return mask
    return torch.as_tensor(rollout.loss_mask, dtype=torch.bool)
