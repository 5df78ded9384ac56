"""Policy objectives on loss rows, and their aggregation by global normalisers.

Every objective here is a function of per-row tensors ([R]: ``logprob`` from the new policy, with
autograd; ``entropy`` where needed) and of the rows' annotations, returning a per-row loss [R].
:func:`aggregate` turns it into a scalar: a sum over rows divided by counts of the *whole*
optimizer step (:class:`Normalizers`), so the losses of a step's micro-batches (and ranks) add up
to the loss of the unsplit step, and their gradients add up the same way. No ``.item()`` and no
host syncs inside: normalisers are tensors.

Objectives: SFT cross entropy; PPO clip (Schulman et al. 2017) with DAPO's asymmetric clip
(Yu et al. 2025) and dual clip (Ye et al. 2020); GSPO's sequence-level ratio (Zheng et al. 2025);
KL penalties k1/k2/k3 (Schulman 2020); entropy bonus. See ``docs/objectives.md`` for formulas.

What this leaves out: logits and log-probs (``harts.ops.logprobs``), advantages
(``advantages.py``), the critic's value loss (``values.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from harts.objectives.corrections import Correction, check_correction, corrected, old_logprobs_of
from harts.objectives.rows import LossRows, check_row_tensor

__all__ = [
    "Aggregation",
    "Normalizers",
    "normalizers_for",
    "aggregate",
    "sft_loss",
    "ppo_clip_loss",
    "gspo_loss",
    "KLEstimator",
    "kl_penalty",
    "entropy_bonus",
    "LossKind",
    "PolicyLossConfig",
    "compute_loss",
    "POLICY_LOSSES",
    "PolicyLossEntry",
]

Tensor = torch.Tensor


class Aggregation(StrEnum):
    """How per-row losses become one scalar (names as in verl's ``agg_loss``).

    With S the step's sequences that have rows, T their rows, and l the per-row loss:

    - TOKEN_MEAN: sum(l) / T.
    - SEQ_MEAN_TOKEN_SUM: sum(l) / S.
    - SEQ_MEAN_TOKEN_MEAN: sum over sequences of (sum of its l / its rows), / S (GRPO, Shao et al. 2024).
    - SEQ_MEAN_TOKEN_SUM_NORM: sum(l) / (max_length * S): Dr. GRPO's constant normaliser (Liu et al. 2025).
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"

    @property
    def needs_max_length(self) -> bool:
        """Whether this mode divides by Dr. GRPO's constant (``Normalizers.max_length``)."""
        return self is Aggregation.SEQ_MEAN_TOKEN_SUM_NORM


@dataclass(frozen=True)
class Normalizers:
    """Global counts of one optimizer step (all micro-batches, all ranks); 0-dim tensors.

    - ``total_tokens``: sum of row weights (loss-bearing tokens) of the step.
    - ``total_sequences``: trajectories of the step with at least one row; fully masked
      trajectories contribute no loss and are not counted.
    - ``max_length``: Dr. GRPO's constant (the generation budget) for SEQ_MEAN_TOKEN_SUM_NORM;
      keep it fixed through training.
    """

    total_tokens: Tensor
    total_sequences: Tensor
    max_length: float | None = None


def _trajectory_weight(rows: LossRows, dtype: torch.dtype) -> Tensor:
    """[B] sum of row weights of each trajectory."""
    out = torch.zeros(rows.num_trajectories, dtype=dtype, device=rows.device)
    return out.index_add_(0, rows.trajectory, rows.weight.to(dtype))


def normalizers_for(
    rows: LossRows | Sequence[LossRows],
    max_length: float | None = None,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
) -> Normalizers:
    """Normalisers of a step from the rows of ALL its micro-batches (one :class:`LossRows` each).

    Each trajectory's rows must sit in one micro-batch. ``all_reduce``, for data-parallel ranks,
    receives a [2] float64 tensor of this rank's (tokens, sequences) and returns the sum over
    ranks, e.g. ``lambda t: (torch.distributed.all_reduce(t), t)[1]``.
    """
    parts = [rows] if isinstance(rows, LossRows) else list(rows)
    if not parts or not all(isinstance(p, LossRows) for p in parts):
        raise TypeError("normalizers_for expects a LossRows or a non-empty sequence of LossRows")
    if max_length is not None and not max_length > 0:
        raise ValueError(f"max_length must be > 0, got {max_length}")
    counts = torch.zeros(2, dtype=torch.float64, device=parts[0].device)
    for p in parts:
        counts = counts + torch.stack(
            [
                p.weight.to(torch.float64).sum(),
                (_trajectory_weight(p, torch.float64) > 0).sum().to(torch.float64),
            ]
        )
    if all_reduce is not None:
        counts = all_reduce(counts)
    return Normalizers(total_tokens=counts[0], total_sequences=counts[1], max_length=max_length)


def _nonzero(x: Tensor) -> Tensor:
    # A step without rows has a zero sum; divide it by 1, not 0.
    return torch.where(x > 0, x, torch.ones_like(x))


def aggregate(per_row_loss: Tensor, rows: LossRows, mode: Aggregation, normalizers: Normalizers) -> Tensor:
    """Scalar loss of one micro-batch: weighted sum of ``per_row_loss`` [R] over global normalisers."""
    check_row_tensor(per_row_loss, rows, "per_row_loss")
    mode = Aggregation(mode)
    dtype = per_row_loss.dtype
    weighted = per_row_loss * rows.weight.to(dtype)
    sequences = _nonzero(normalizers.total_sequences).to(dtype)
    if mode is Aggregation.TOKEN_MEAN:
        return weighted.sum() / _nonzero(normalizers.total_tokens).to(dtype)
    if mode is Aggregation.SEQ_MEAN_TOKEN_SUM:
        return weighted.sum() / sequences
    if mode is Aggregation.SEQ_MEAN_TOKEN_MEAN:
        # each trajectory's row count over the whole step (kept whole by LossRows.select), so that
        # any subset of rows (a part of a cut tree) gets its exact share
        per_traj = rows.tokens_per_trajectory.to(dtype)[rows.trajectory]
        return (weighted / _nonzero(per_traj)).sum() / sequences
    if normalizers.max_length is None:
        raise ValueError("SEQ_MEAN_TOKEN_SUM_NORM needs Normalizers.max_length (Dr. GRPO's constant)")
    return weighted.sum() / (normalizers.max_length * sequences)


# ---- objectives: per-row losses [R] ------------------------------------------------------------
def sft_loss(logprob: Tensor) -> Tensor:
    """[R] cross entropy of each row's target: ``-logprob``."""
    return -logprob


def _old_logprob(rows: LossRows, old_logprob: Tensor | None, logprob: Tensor, name: str) -> Tensor:
    """The ratio's denominator: ``old_logprob``, else the rows' old log-probs, else the behaviour's."""
    if old_logprob is not None:
        check_row_tensor(old_logprob, rows, "old_logprob")
    old = old_logprobs_of(rows, old_logprob)
    if old is not None:
        return old.to(logprob.dtype)
    if not rows.has_rollout_logprob:
        raise ValueError(
            f"{name} needs the behaviour policy's log-probs: give the rollouts rollout_logprobs (or "
            f"old_logprobs), or pass old_logprob (e.g. logprob.detach() for a fully on-policy step)"
        )
    return rows.rollout_logprob.to(logprob.dtype)


def _advantage(rows: LossRows, dtype: torch.dtype, name: str) -> Tensor:
    if not rows.has_advantage:
        raise ValueError(f"{name} needs advantages: give the rollouts advantages or use estimate_advantages")
    return rows.advantage.to(dtype)


def _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip):
    """PPO's pessimistic surrogate; returns (loss [R], clipped [R] bool, dual-clipped [R] bool)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is None:
        return loss, was_clipped, torch.zeros_like(was_clipped)
    # Dual clip (Ye et al. 2020): for A < 0 bound the loss by -c * A, so a huge ratio on a
    # bad action cannot dominate the batch.
    bound = -adv * dual_clip
    dual = (adv < 0) & (loss > bound)
    return torch.where(dual, bound, loss), was_clipped, dual


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}")


def _ppo(logprob, rows, clip_low, clip_high, dual_clip, old_logprob):
    _check_clip(clip_low, clip_high, dual_clip)
    old = _old_logprob(rows, old_logprob, logprob, "ppo_clip_loss")
    ratio = torch.exp(logprob - old)
    return _clipped_surrogate(
        ratio, _advantage(rows, logprob.dtype, "ppo_clip_loss"), clip_low, clip_high, dual_clip
    )


def ppo_clip_loss(
    logprob: Tensor,
    rows: LossRows,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    old_logprob: Tensor | None = None,
) -> Tensor:
    """[R] PPO clipped surrogate (Schulman et al. 2017), ratio against ``rows.rollout_logprob``.

    ``clip_high > clip_low`` is DAPO's clip-higher (Yu et al. 2025); ``dual_clip`` = c > 1 bounds the
    loss of negative advantages by ``-c * A`` (Ye et al. 2020). ``old_logprob`` [R] replaces the
    rollout log-probs (e.g. recomputed by the trainer).
    """
    return _ppo(logprob, rows, clip_low, clip_high, dual_clip, old_logprob)[0]


def _gspo(logprob, rows, clip_low, clip_high, old_logprob):
    _check_clip(clip_low, clip_high, None)
    old = _old_logprob(rows, old_logprob, logprob, "gspo_loss")
    dtype = logprob.dtype
    w = rows.weight.to(dtype)
    # Segment sums per trajectory [B], then back to rows: no Python loop over rows.
    seq_sum = torch.zeros(rows.num_trajectories, dtype=dtype, device=logprob.device)
    seq_sum = seq_sum.index_add(0, rows.trajectory, (logprob.detach() - old) * w)
    seq_mean = seq_sum / _nonzero(_trajectory_weight(rows, dtype))
    # GSPO-token (Zheng et al. 2025, sec. 4.3): s_t = sg[s] * pi(y_t) / sg[pi(y_t)], whose value is the
    # sequence ratio s = exp(mean log-ratio); with one advantage per sequence its gradient equals
    # sequence-level GSPO's, and it also admits per-token advantages.
    ratio = torch.exp(seq_mean[rows.trajectory] + logprob - logprob.detach())
    return _clipped_surrogate(ratio, _advantage(rows, dtype, "gspo_loss"), clip_low, clip_high, None)


def gspo_loss(
    logprob: Tensor,
    rows: LossRows,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    old_logprob: Tensor | None = None,
) -> Tensor:
    """[R] GSPO (Zheng et al. 2025): PPO's clip on the sequence ratio exp(mean of its rows' log-ratios).

    Each row of a trajectory gets the trajectory's ratio (clipped at sequence level) times its own
    advantage. Defaults are the paper's clip range (3e-4, 4e-4).
    """
    return _gspo(logprob, rows, clip_low, clip_high, old_logprob)[0]


class KLEstimator(StrEnum):
    """Per-sample estimators of KL(pi || pi_ref) from x ~ pi (Schulman 2020), with lr = log(pi_ref / pi)."""

    K1 = "k1"  # -lr: unbiased, high variance, can be negative
    K2 = "k2"  # lr^2 / 2: biased, low variance
    K3 = "k3"  # exp(lr) - lr - 1: unbiased, low variance, >= 0


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, estimator: KLEstimator = KLEstimator.K3) -> Tensor:
    """[R] per-row KL estimate between the policy and the reference (Schulman 2020)."""
    lr = ref_logprob.to(logprob.dtype) - logprob
    estimator = KLEstimator(estimator)
    if estimator is KLEstimator.K1:
        return -lr
    if estimator is KLEstimator.K2:
        return 0.5 * lr * lr
    return torch.expm1(lr) - lr


def entropy_bonus(entropy: Tensor) -> Tensor:
    """[R] loss term ``-entropy``: minimising it raises the policy's entropy."""
    return -entropy


# ---- one config, one entry point ---------------------------------------------------------------
class LossKind(StrEnum):
    PPO = "ppo"  # also GRPO and DAPO: they differ in advantages, clip and aggregation
    GSPO = "gspo"
    SFT = "sft"


@dataclass(frozen=True)
class PolicyLossEntry:
    """One kind of policy loss in :data:`POLICY_LOSSES`: its per-row function and the facts about it
    that the step (:func:`harts.forest_step`), ``harts train`` and ``harts rl`` read instead of
    testing kinds. What every kind shares (the KL term's reference log-probs, the aggregation's
    ``max_length``) is :class:`PolicyLossConfig`'s: ``needs_ref_logprobs``, ``needs_max_length``.

    - ``per_row(logprob [R], rows, config, old_logprob [R] | None) -> (loss [R], {metric: bool [R]})``;
      an entry is called like it.
    - ``needs_advantages``: reads the rows' advantages (the rollouts' ``advantages``, or an estimator's).
    - ``needs_behaviour_logprobs``: its ratio reads the behaviour policy's log-probs (the rollouts'
      ``rollout_logprobs``, or ``old_logprob``).
    - ``separable_rows``: the loss is a sum of per-row terms over the step's normalisers, so the
      losses of any subsets of rows add up and a cut tree runs once; False where a trajectory's rows
      are coupled (GSPO's sequence ratio).
    - ``offline_only``: why it cannot learn from sampled rollouts (online RL, ``harts rl``); None
      where it can.
    - ``clip``: the default (``clip_low``, ``clip_high``); None where it reads no clip range.
    - ``fields``: the :class:`PolicyLossConfig` fields only this kind reads; another kind refuses them.
    """

    per_row: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    needs_advantages: bool
    needs_behaviour_logprobs: bool
    separable_rows: bool = True
    offline_only: str | None = None
    clip: tuple[float, float] | None = None
    fields: tuple[str, ...] = ()

    @property
    def online_rl(self) -> bool:
        return self.offline_only is None

    def __call__(self, logprob: Tensor, rows: LossRows, config: PolicyLossConfig, old_logprob=None):
        return self.per_row(logprob, rows, config, old_logprob)


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss of a run.

    ``clip_low`` / ``clip_high`` None take the kind's defaults (PPO 0.2 / 0.2, GSPO 3e-4 / 4e-4);
    ``dual_clip`` applies to PPO only. ``kl_coef`` scales ``kl_estimator`` against the reference
    log-probs; ``entropy_coef`` scales the entropy bonus. All terms share ``aggregation``.
    ``temperature`` T: the policy is ``softmax(logits / T)``, the distribution an inference engine
    sampling at T drew the rollouts from (verl and TRL divide the logits by the rollout
    temperature the same way); log-probs, ratios, KL and entropy all use it. What the kind reads
    and allows: :attr:`policy_loss`, its :data:`POLICY_LOSSES` entry. ``correction``: an
    importance correction for the gap between the engine that sampled the rollouts and the
    trainer (:data:`harts.objectives.corrections.CORRECTIONS`): each token's policy term times a
    weight of rho = exp(old - behaviour) bounded by ``correction_low`` / ``correction_high``.
    """

    kind: LossKind = LossKind.PPO
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    temperature: float = 1.0
    correction: Correction | None = None
    correction_low: float | None = None
    correction_high: float | None = None

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not (0 < float(self.temperature) < float("inf")):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        for name, enum in (("kind", LossKind), ("kl_estimator", KLEstimator), ("aggregation", Aggregation)):
            object.__setattr__(self, name, enum(getattr(self, name)))
        for name in sorted({f for entry in POLICY_LOSSES.values() for f in entry.fields}):
            if getattr(self, name) is not None and name not in self.policy_loss.fields:
                readers = "/".join(k.upper() for k, entry in POLICY_LOSSES.items() if name in entry.fields)
                raise ValueError(f"{name} applies to {readers} only, not {self.kind}")
        _check_clip(*self.clip(), self.dual_clip)
        if not (self.kl_coef >= 0 and self.entropy_coef >= 0):
            raise ValueError(
                f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, {self.entropy_coef}"
            )
        readers = tuple(k.value for k, entry in POLICY_LOSSES.items() if entry.needs_behaviour_logprobs)
        correction = check_correction(
            self.correction, self.correction_low, self.correction_high, self.kind.value, readers
        )
        object.__setattr__(self, "correction", correction)

    @property
    def policy_loss(self) -> PolicyLossEntry:
        """The kind's :data:`POLICY_LOSSES` entry: its function and what it reads."""
        return POLICY_LOSSES[self.kind]

    @property
    def needs_ref_logprobs(self) -> bool:
        """Whether a step reads the reference's log-probs (the rollouts' ``ref_logprobs``): a KL term."""
        return self.kl_coef > 0

    @property
    def needs_max_length(self) -> bool:
        """Whether the normalisers need Dr. GRPO's constant (``Normalizers.max_length``)."""
        return self.aggregation.needs_max_length

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether a step reads old log-probs apart from the behaviour's: an importance correction."""
        return self.correction is not None

    def clip(self) -> tuple[float, float]:
        """(clip_low, clip_high): the ones given, else the kind's defaults ((0, 0) for a kind without)."""
        low, high = self.policy_loss.clip or (0.0, 0.0)
        return (
            low if self.clip_low is None else self.clip_low,
            high if self.clip_high is None else self.clip_high,
        )


def _ppo_entry(logprob, rows, config, old_logprob):
    loss, clipped, dual = _ppo(logprob, rows, *config.clip(), config.dual_clip, old_logprob)
    stats = {"clip_fraction": clipped}
    if config.dual_clip is not None:
        stats["dual_clip_fraction"] = dual
    return loss, stats


def _gspo_entry(logprob, rows, config, old_logprob):
    loss, clipped, _ = _gspo(logprob, rows, *config.clip(), old_logprob)
    return loss, {"clip_fraction": clipped}


def _sft_entry(logprob, rows, config, old_logprob):
    return sft_loss(logprob), {}


#: kind -> its entry. To add a loss: its per-row function and one entry here (docs/architecture.md).
POLICY_LOSSES: dict[LossKind, PolicyLossEntry] = {
    LossKind.PPO: PolicyLossEntry(
        _ppo_entry,
        needs_advantages=True,
        needs_behaviour_logprobs=True,
        clip=(0.2, 0.2),
        fields=("dual_clip",),
    ),
    LossKind.GSPO: PolicyLossEntry(
        _gspo_entry,
        needs_advantages=True,
        needs_behaviour_logprobs=True,
        separable_rows=False,  # the sequence ratio couples a trajectory's rows
        clip=(3e-4, 4e-4),
    ),
    LossKind.SFT: PolicyLossEntry(
        _sft_entry,
        needs_advantages=False,
        needs_behaviour_logprobs=False,
        offline_only="has nothing to imitate in sampled rollouts",
    ),
}


def compute_loss(
    logprob: Tensor,
    entropy: Tensor | None,
    rows: LossRows,
    config: PolicyLossConfig,
    normalizers: Normalizers,
    old_logprob: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss of one micro-batch and detached metrics.

    ``loss = policy + kl_coef * kl - entropy_coef * entropy``, each term aggregated by
    ``config.aggregation`` over ``normalizers``. ``logprob`` [R] and ``entropy`` [R] (None allowed
    when ``entropy_coef`` is 0) follow ``rows``. Metrics (0-dim, detached): ``loss``,
    ``policy_loss``, ``kl`` and ``entropy`` (when available), and token-mean fractions
    ``clip_fraction`` / ``dual_clip_fraction``; with both behaviour and old log-probs, the token
    means ``mismatch_kl`` and ``mismatch_log_rho_abs``, and a correction's
    ``correction_truncated_fraction`` or ``correction_rejected_fraction``
    (:func:`harts.objectives.corrections.corrected`). Every value is a sum over global
    normalisers, so a step's value is the sum over its micro-batches.
    """
    check_row_tensor(logprob, rows, "logprob")
    if entropy is not None:
        check_row_tensor(entropy, rows, "entropy")
    elif config.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs the per-row entropy, got entropy=None")
    mode = config.aggregation
    per_row, stats = config.policy_loss(logprob, rows, config, old_logprob)
    per_row, mismatch = corrected(per_row, rows, config, old_logprob)
    stats.update(mismatch)
    policy = aggregate(per_row, rows, mode, normalizers)
    loss = policy
    metrics = {"policy_loss": policy.detach()}
    if config.kl_coef > 0:
        if not rows.has_ref_logprob:
            raise ValueError("kl_coef > 0 needs reference log-probs: give the rollouts ref_logprobs")
        kl = aggregate(kl_penalty(logprob, rows.ref_logprob, config.kl_estimator), rows, mode, normalizers)
        loss = loss + config.kl_coef * kl
        metrics["kl"] = kl.detach()
    if config.entropy_coef > 0:
        bonus = aggregate(entropy_bonus(entropy), rows, mode, normalizers)
        loss = loss + config.entropy_coef * bonus
        metrics["entropy"] = -bonus.detach()
    elif entropy is not None:
        metrics["entropy"] = aggregate(entropy.detach(), rows, mode, normalizers)
    for name, flag in stats.items():
        metrics[name] = aggregate(flag.to(logprob.dtype), rows, Aggregation.TOKEN_MEAN, normalizers).detach()
    metrics["loss"] = loss.detach()
    return loss, metrics
