"""harts: exact training of hybrid-attention language models on rollout forests.

Every token shared by several trajectories is computed once in forward and backward, with the
same logits, loss and gradients as training each trajectory on its own.
"""

from harts.adapters.base import supported_families
from harts.executor import TreeOutput, forward
from harts.forest import Forest, build_forest
from harts.objectives import MoEConfig, RouterRecorder, forest_loss, moe_stats, rollout_step
from harts.plan.micro_batches import plan_micro_batches
from harts.step import StepResult, forest_backward, next_token_rows

__all__ = [
    "Forest",
    "MoEConfig",
    "RouterRecorder",
    "StepResult",
    "TreeOutput",
    "build_forest",
    "forest_backward",
    "forest_loss",
    "forward",
    "moe_stats",
    "next_token_rows",
    "plan_micro_batches",
    "rollout_step",
    "supported_families",
]
__version__ = "0.1.0"
