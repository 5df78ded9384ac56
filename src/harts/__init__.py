"""harts: exact training of hybrid-attention language models on rollout forests.

Every token shared by several trajectories is computed once in forward and backward, with the
same logits, loss and gradients as training each trajectory on its own.

The usual entry point is :func:`rollout_step` (one optimizer step's forward and backward over a
batch of :class:`Rollout`); :func:`forest_step` takes a forest and its loss rows;
:func:`forest_backward` any loss of row log-probs; :func:`forward` the hidden states and logits.
"""

from harts.adapters import supported_families
from harts.adapters.value_head import ValueHead
from harts.batch_positions import BatchLayout
from harts.data.rollout_files import iter_rollout_steps, read_rollouts
from harts.data.turns import turn_from_sglang, turn_from_vllm, turns_from_chat
from harts.forest import Forest, build_forest
from harts.objectives import (
    ADVANTAGE_ESTIMATORS,
    CORRECTIONS,
    POLICY_LOSSES,
    AdvantageEstimator,
    Aggregation,
    Correction,
    KLEstimator,
    LossKind,
    LossRows,
    MoEConfig,
    MoEStats,
    Normalizers,
    PolicyLossConfig,
    Rollout,
    ValueLossConfig,
    build_loss_rows,
    estimate_advantages,
    gae_advantages,
    normalizers_for,
    rollouts_from_batch,
    with_advantages,
)
from harts.plan.linear_cost import LinearCostModel, PlanMode
from harts.plan.micro_batches import MicroBatchPlan, Part, plan_micro_batches
from harts.runtime import (
    ForestLogprobs,
    ForestScores,
    ForestValues,
    PartObserver,
    RouterRecorder,
    RunConfig,
    StepResult,
    TreeOutput,
    VerificationError,
    forest_backward,
    forest_logprobs,
    forward,
    forward_values,
    image_forest,
    next_token_rows,
    replayed_routing,
    score,
)
from harts.steps import forest_step, moe_stats, rollout_step, value_step

__all__ = [
    # forests and plans
    "Forest",
    "build_forest",
    "BatchLayout",
    "rollouts_from_batch",
    "read_rollouts",
    "iter_rollout_steps",
    "image_forest",
    "turn_from_vllm",
    "turn_from_sglang",
    "turns_from_chat",
    "plan_micro_batches",
    "MicroBatchPlan",
    "Part",
    # running a model
    "RunConfig",
    "PlanMode",
    "LinearCostModel",
    "forward",
    "TreeOutput",
    "supported_families",
    "VerificationError",
    "forest_logprobs",
    "ForestLogprobs",
    # critics and reward models
    "forward_values",
    "ForestValues",
    "score",
    "ForestScores",
    "ValueHead",
    "value_step",
    "ValueLossConfig",
    "gae_advantages",
    # one step
    "rollout_step",
    "forest_step",
    "forest_backward",
    "next_token_rows",
    "StepResult",
    "PartObserver",
    # objectives
    "Rollout",
    "LossRows",
    "build_loss_rows",
    "PolicyLossConfig",
    "LossKind",
    "Aggregation",
    "KLEstimator",
    "Normalizers",
    "normalizers_for",
    "estimate_advantages",
    "with_advantages",
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "Correction",
    "CORRECTIONS",
    # MoE
    "MoEConfig",
    "MoEStats",
    "RouterRecorder",
    "replayed_routing",
    "moe_stats",
]
__version__ = "0.1.0"
