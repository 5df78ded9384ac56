"""Importance corrections for the gap between the engine that sampled the rollouts and the trainer.

Three log-probs per loss token: the behaviour policy's (the engine's, ``rollout_logprob``), the
old policy's (the trainer's before the update, ``old_logprob``) and the current one (with
autograd). PPO's ratio is current / old; a correction multiplies each token's policy-loss term
by a weight w, a function of rho = exp(old - behaviour) that carries no gradient:

- ``token-tis``: w = min(rho, hi) (truncated importance sampling);
- ``token-mis``: w = rho where lo <= rho <= hi, else 0 (masked importance sampling);
- ``seq-tis``: w = min(prod rho, hi) on every token of the trajectory;
- ``seq-mis``: w = prod rho where lo <= prod rho <= hi, else 0;
- ``geo-mis``: w = 1 where lo <= exp(mean log rho) <= hi, else 0 (the trajectory is rejected).

Products and means run over the trajectory's loss rows in log space, from
``LossRows.trajectory_log_rho``: the sum over ALL of the trajectory's rows, computed once per
batch from the inputs (old and behaviour log-probs do not depend on the current policy) and
kept whole when a tree is cut into parts. So every weight is a per-row constant of the step and
the loss stays a sum of separable per-row terms; the aggregation's normalisers are unchanged (a
rejected token counts as a zero term). Comparisons with the bounds are made in log space.

Mismatch metrics (token means over the step's loss tokens, sums over global normalisers like
every metric of :func:`harts.objectives.losses.compute_loss`): ``mismatch_kl`` (k3 estimate of
KL(behaviour || old) from the behaviour's samples: rho - 1 - log rho), ``mismatch_log_rho_abs``
(mean |log rho|), and with a correction ``correction_truncated_fraction`` (tis) or
``correction_rejected_fraction`` (mis, geo). Formulas and sources: ``docs/objectives.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch

from harts.objectives.rows import LossRows

__all__ = [
    "Correction",
    "CorrectionEntry",
    "CORRECTIONS",
    "check_correction",
    "correction_weights",
    "corrected",
    "old_logprobs_of",
    "log_rho_of",
]

Tensor = torch.Tensor


class Correction(StrEnum):
    """The importance corrections of :data:`CORRECTIONS` (names as ``[objective] correction`` takes)."""

    TOKEN_TIS = "token-tis"
    TOKEN_MIS = "token-mis"
    SEQ_TIS = "seq-tis"
    SEQ_MIS = "seq-mis"
    GEO_MIS = "geo-mis"


def _token(log_rho: Tensor, rows: LossRows) -> Tensor:
    return log_rho


def _sequence(log_rho: Tensor, rows: LossRows) -> Tensor:
    return rows.trajectory_log_rho.to(log_rho.device)[rows.trajectory]


def _geometric(log_rho: Tensor, rows: LossRows) -> Tensor:
    count = rows.tokens_per_trajectory.to(log_rho.device, torch.float64).clamp(min=1)
    return (rows.trajectory_log_rho.to(log_rho.device) / count)[rows.trajectory]


def _truncate(log_r: Tensor, low: float | None, high: float) -> tuple[Tensor, Tensor]:
    cap = math.log(high)
    return torch.exp(log_r.clamp(max=cap)), log_r > cap


def _reject(log_r: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    cap = math.log(high)
    keep = (log_r >= math.log(low)) & (log_r <= cap)
    return torch.where(keep, torch.exp(log_r.clamp(max=cap)), torch.zeros_like(log_r)), ~keep


def _reject_whole(log_r: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    keep = (log_r >= math.log(low)) & (log_r <= math.log(high))
    return keep.to(log_r.dtype), ~keep


@dataclass(frozen=True)
class CorrectionEntry:
    """One correction of :data:`CORRECTIONS`.

    - ``statistic(log_rho [R], rows) -> log r [R]``: the log of the ratio the weight reads, per row
      (the token's own, its trajectory's product, or its trajectory's geometric mean);
    - ``weight(log r [R], low, high) -> (w [R], dropped [R] bool)``: the weight and the rows it
      truncates or rejects;
    - ``reads_low``: whether it reads ``correction_low`` (the masking ones; truncation reads only
      ``correction_high``);
    - ``dropped``: the metric that counts ``dropped`` rows (``correction_truncated_fraction`` or
      ``correction_rejected_fraction``).
    """

    statistic: Callable[[Tensor, LossRows], Tensor]
    weight: Callable[[Tensor, float | None, float], tuple[Tensor, Tensor]]
    reads_low: bool
    dropped: str


_TRUNCATED, _REJECTED = "correction_truncated_fraction", "correction_rejected_fraction"

#: correction -> its entry. To add one: its name in :class:`Correction` and an entry here.
CORRECTIONS: dict[Correction, CorrectionEntry] = {
    Correction.TOKEN_TIS: CorrectionEntry(_token, _truncate, reads_low=False, dropped=_TRUNCATED),
    Correction.TOKEN_MIS: CorrectionEntry(_token, _reject, reads_low=True, dropped=_REJECTED),
    Correction.SEQ_TIS: CorrectionEntry(_sequence, _truncate, reads_low=False, dropped=_TRUNCATED),
    Correction.SEQ_MIS: CorrectionEntry(_sequence, _reject, reads_low=True, dropped=_REJECTED),
    Correction.GEO_MIS: CorrectionEntry(_geometric, _reject_whole, reads_low=True, dropped=_REJECTED),
}


def _bound(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def check_correction(correction, low, high, kind: str, readers: tuple[str, ...]) -> Correction | None:
    """The correction named by ``correction`` (None: none), its bounds checked; ``kind`` is the loss
    kind, ``readers`` the kinds whose ratio reads old log-probs (whose terms a correction weighs)."""
    if correction is None:
        given = [n for n, v in (("correction_low", low), ("correction_high", high)) if v is not None]
        if given:
            raise ValueError(
                f"{' and '.join(given)} given without a correction: set correction "
                f"({', '.join(c.value for c in Correction)}) or remove "
                f"{'them' if len(given) > 1 else 'it'}"
            )
        return None
    try:
        correction = Correction(correction)
    except ValueError:
        raise ValueError(
            f"correction must be one of {', '.join(c.value for c in Correction)}, got {correction!r}"
        ) from None
    if kind not in readers:
        raise ValueError(
            f"correction {correction.value!r} weighs a ratio against old log-probs, and "
            f"kind {kind!r} reads none: use one that does ({', '.join(readers)})"
        )
    entry = CORRECTIONS[correction]
    if high is None:
        raise ValueError(
            f"correction {correction.value!r} needs correction_high (the upper bound of its ratio), got none"
        )
    _bound("correction_high", high)
    if not entry.reads_low:
        if low is not None:
            raise ValueError(
                f"correction {correction.value!r} truncates at correction_high only; "
                f"correction_low = {low!r} would be ignored: remove it"
            )
        return correction
    if low is None:
        raise ValueError(
            f"correction {correction.value!r} needs correction_low (the lower bound of its ratio), got none"
        )
    _bound("correction_low", low)
    if low > high:
        raise ValueError(f"correction_low must be <= correction_high, got {low!r} > {high!r}")
    return correction


def old_logprobs_of(rows: LossRows, old_logprob: Tensor | None) -> Tensor | None:
    """The old policy's log-probs [R] of the rows: ``old_logprob`` when given, else the rows' own
    (``Rollout.old_logprobs``), else None (the behaviour's then stand in for them in a ratio)."""
    if old_logprob is not None:
        return old_logprob.detach()
    return rows.old_logprob if rows.has_old_logprob else None


def log_rho_of(rows: LossRows, old_logprob: Tensor | None, what: str) -> Tensor:
    """[R] float64 log rho = old - behaviour; refuses rows without either (``what`` names the
    reader in the error)."""
    old = old_logprobs_of(rows, old_logprob)
    if not rows.has_rollout_logprob:
        raise ValueError(
            f"{what} needs the behaviour policy's log-probs (the engine's: the rollouts' "
            f"rollout_logprobs), and the rollouts carry none"
        )
    if old is None:
        raise ValueError(
            f"{what} needs the old policy's log-probs apart from the behaviour's (the "
            f"rollouts' old_logprobs, or old_logprob), and got the behaviour's "
            f"alone"
        )
    return old.to(torch.float64) - rows.rollout_logprob.to(old.device, torch.float64)


def correction_weights(rows: LossRows, config, old_logprob: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(w [R] float64, dropped [R] bool) of ``config.correction`` on ``rows``, no gradient.

    A sequence-level weight reads ``rows.trajectory_log_rho`` (whole trajectories, see
    :meth:`LossRows.with_old_logprob`); rows without it are taken to hold whole trajectories."""
    entry = CORRECTIONS[config.correction]
    log_rho = log_rho_of(rows, old_logprob, f"correction {config.correction.value!r}")
    if entry.statistic is not _token and (old_logprob is not None or rows.trajectory_log_rho is None):
        rows = rows.with_old_logprob(old_logprobs_of(rows, old_logprob))
    return entry.weight(entry.statistic(log_rho, rows), config.correction_low, config.correction_high)


def corrected(
    per_row: Tensor, rows: LossRows, config, old_logprob: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """(``per_row`` [R] times ``config.correction``'s weights, {metric: [R] values}): the policy
    loss's terms corrected, and the per-row values whose token means are the step's mismatch
    metrics. Without a correction the terms come back as they are; without both behaviour and old
    log-probs, the metrics are {}: ``mismatch_kl`` (k3 of KL(behaviour || old): rho - 1 - log rho),
    ``mismatch_log_rho_abs`` (|log rho|) and the correction's dropped rows (a bool [R])."""
    if config.correction is not None:
        weight, dropped = correction_weights(rows, config, old_logprob)
        per_row = per_row * weight.to(per_row.device, per_row.dtype)
    elif not rows.has_rollout_logprob or old_logprobs_of(rows, old_logprob) is None:
        return per_row, {}
    log_rho = log_rho_of(rows, old_logprob, "the mismatch metrics")
    metrics = {"mismatch_kl": torch.expm1(log_rho) - log_rho, "mismatch_log_rho_abs": log_rho.abs()}
    if config.correction is not None:
        metrics[CORRECTIONS[config.correction].dropped] = dropped
    return per_row, metrics
