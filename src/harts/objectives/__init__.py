"""Objectives: rollouts -> loss rows -> per-row losses -> one scalar per micro-batch.

``rollout``: the input dataclass and its checks. ``rows``: one row per (trajectory, predicted
position) over a forest. ``losses``: SFT, PPO/DAPO/dual clip, GSPO, KL, entropy, aggregation by
global normalisers. ``advantages``: GRPO, Dr. GRPO, RLOO, tree and first-error-step estimators.
``model_loss``: the glue that runs a model over a forest into ``compute_loss`` (``forest_loss``,
``rollout_step``). ``moe``: router statistics weighted by multiplicity (aux loss, expert counts).
Formulas and sources: ``docs/objectives.md``.
"""

from harts.objectives.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    advantages_to_rollouts,
    dr_grpo_advantages,
    estimate_advantages,
    grpo_advantages,
    pitfall_advantages,
    rloo_advantages,
    tree_advantages,
    tree_node_values,
    with_advantages,
)
from harts.objectives.losses import (
    POLICY_LOSSES,
    Aggregation,
    KLEstimator,
    LossKind,
    Normalizers,
    PolicyLossConfig,
    aggregate,
    compute_loss,
    entropy_bonus,
    gspo_loss,
    kl_penalty,
    normalizers_for,
    ppo_clip_loss,
    sft_loss,
)
from harts.objectives.model_loss import RolloutStepResult, forest_loss, rollout_step
from harts.objectives.moe import (
    AUX_LOSS_FAMILIES,
    BIAS_BALANCED_FAMILIES,
    ROUTER_CLASSES,
    MoEConfig,
    MoEStats,
    RouterRecorder,
    bias_update,
    expert_counts,
    find_routers,
    load_balancing_loss,
    moe_stats,
)
from harts.objectives.rollout import CheckedRollout, Rollout, validate_rollouts
from harts.objectives.rows import LossRows, build_loss_rows, unique_predictors

__all__ = [
    "Rollout", "CheckedRollout", "validate_rollouts",
    "LossRows", "build_loss_rows", "unique_predictors",
    "Aggregation", "Normalizers", "normalizers_for", "aggregate",
    "sft_loss", "ppo_clip_loss", "gspo_loss", "KLEstimator", "kl_penalty", "entropy_bonus",
    "LossKind", "PolicyLossConfig", "compute_loss", "POLICY_LOSSES",
    "grpo_advantages", "dr_grpo_advantages", "rloo_advantages", "tree_node_values", "tree_advantages",
    "pitfall_advantages", "AdvantageEstimator", "ADVANTAGE_ESTIMATORS", "estimate_advantages",
    "with_advantages", "advantages_to_rollouts",
    "forest_loss", "rollout_step", "RolloutStepResult",
    "MoEConfig", "MoEStats", "RouterRecorder", "moe_stats", "load_balancing_loss", "expert_counts",
    "bias_update", "find_routers", "ROUTER_CLASSES", "AUX_LOSS_FAMILIES", "BIAS_BALANCED_FAMILIES",
]  # fmt: skip
