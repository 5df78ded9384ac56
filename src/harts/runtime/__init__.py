"""Running a model over a forest: the executor, the micro-batch hand-over, the budgeted step."""

from harts.runtime.backward import PartObserver, StepResult, forest_backward, next_token_rows
from harts.runtime.config import RunConfig
from harts.runtime.critic import ForestScores, ForestValues, forward_values, score
from harts.runtime.executor import TreeOutput, forward
from harts.runtime.forward_only import ForestLogprobs, RowLogprobs, forest_logprobs, forest_row_logprobs
from harts.runtime.image_forest import ForestImages, image_forest
from harts.runtime.routers import RouterRecorder, find_routers
from harts.runtime.routing_replay import replayed_routing
from harts.runtime.verify import Verification, VerificationError

__all__ = [
    "RunConfig",
    "TreeOutput",
    "forward",
    "RouterRecorder",
    "find_routers",
    "replayed_routing",
    "PartObserver",
    "StepResult",
    "forest_backward",
    "next_token_rows",
    "forest_logprobs",
    "forest_row_logprobs",
    "ForestLogprobs",
    "RowLogprobs",
    "forward_values",
    "ForestValues",
    "score",
    "ForestScores",
    "VerificationError",
    "Verification",
    "image_forest",
    "ForestImages",
]
