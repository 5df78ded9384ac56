"""Objectives: rollouts -> loss rows -> per-row losses -> one scalar per micro-batch.

``rollout``: the input dataclass and its checks. ``rows``: one row per (trajectory, predicted
position) over a forest. ``losses``: SFT, PPO/DAPO/dual clip, GSPO, KL, entropy, aggregation by
global normalisers, and their registry ``POLICY_LOSSES`` (what each kind reads and allows).
``corrections``: importance corrections for the engine-trainer gap (token and sequence TIS/MIS,
geometric rejection), their registry ``CORRECTIONS``, and the mismatch metrics.
``advantages``: GRPO, Dr. GRPO, RLOO, tree, first-error-step and GAE estimators, and their
registry ``ADVANTAGE_ESTIMATORS``. ``values``: the critic's clipped value loss and explained variance.
``moe``: router statistics weighted by multiplicity (aux loss, expert counts). Everything here is
a pure function of tensors, rows and forests: nothing calls a model (that is
:func:`harts.rollout_step`'s job). Formulas and sources: ``docs/objectives.md``.
"""

from harts.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    EstimatorEntry,
    advantages_to_rollouts,
    dr_grpo_advantages,
    estimate_advantages,
    gae_advantages,
    grpo_advantages,
    pitfall_advantages,
    rloo_advantages,
    tree_advantages,
    tree_node_values,
    with_advantages,
)
from harts.objectives.corrections import CORRECTIONS, Correction, CorrectionEntry, correction_weights
from harts.objectives.losses import (
    POLICY_LOSSES,
    Aggregation,
    KLEstimator,
    LossKind,
    Normalizers,
    PolicyLossConfig,
    PolicyLossEntry,
    aggregate,
    compute_loss,
    entropy_bonus,
    gspo_loss,
    kl_penalty,
    normalizers_for,
    ppo_clip_loss,
    sft_loss,
)
from harts.objectives.moe import (
    MoEConfig,
    MoEStats,
    aux_loss_from_sums,
    bias_update,
    expert_counts,
    load_balancing_loss,
    routing_sums,
)
from harts.objectives.rollout import (
    BatchRollouts,
    CheckedRollout,
    Rollout,
    rollouts_from_batch,
    validate_rollouts,
)
from harts.objectives.rows import LossRows, build_loss_rows, unique_predictors
from harts.objectives.values import ValueLossConfig, clipped_value_loss, explained_variance, value_loss

__all__ = [
    "Rollout",
    "CheckedRollout",
    "validate_rollouts",
    "BatchRollouts",
    "rollouts_from_batch",
    "LossRows",
    "build_loss_rows",
    "unique_predictors",
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
    "Correction",
    "CORRECTIONS",
    "CorrectionEntry",
    "correction_weights",
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "tree_node_values",
    "tree_advantages",
    "pitfall_advantages",
    "gae_advantages",
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "EstimatorEntry",
    "estimate_advantages",
    "with_advantages",
    "advantages_to_rollouts",
    "MoEConfig",
    "MoEStats",
    "load_balancing_loss",
    "routing_sums",
    "aux_loss_from_sums",
    "expert_counts",
    "bias_update",
    "ValueLossConfig",
    "value_loss",
    "clipped_value_loss",
    "explained_variance",
]
