"""harts inside the RL stacks users already run.

- :mod:`harts.integrations.batch`: the framework-neutral batch API (padded or packed tensors in,
  log-probs, entropies and the loss out in the same layout).
- :mod:`harts.integrations.trl`: ``GRPOTrainer``, TRL's trainer with its log-probs from harts
  (needs ``pip install harts[trl]``; imported on demand).
- :mod:`harts.integrations.verl`: verl's engine contract (the actor's model output and the
  critic's values in verl's layout) and engines for both registered under verl's
  ``EngineRegistry`` (imported on demand; the engines need verl).

Nothing here is needed by ``harts train``; the stacks' own packages are imported only by their
submodule.
"""

from harts.integrations.batch import (
    BatchLogprobs,
    BatchStepResult,
    StdMode,
    batch_logprobs,
    batch_step,
    group_advantages,
)

__all__ = ["BatchLogprobs", "BatchStepResult", "StdMode", "batch_logprobs", "batch_step", "group_advantages"]
