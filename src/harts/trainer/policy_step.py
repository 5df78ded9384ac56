"""One policy update of ``harts train``: forward and backward of a step's rollouts, gradients into
``.grad`` (the optimizer step is the run skeleton's, :meth:`harts.trainer.run.Run.clip_and_step`).

It is :func:`harts.rollout_step`'s own path (:func:`~harts.steps.policy.step_inputs`, then
:func:`harts.forest_step`) with the configured advantage estimate in between, so a run's losses
and weights equal those of a loop written with ``rollout_step``; under torchrun every rank checks
the whole step and an error on any rank stops every rank with the same message before the step's
collectives.
"""

from __future__ import annotations

import torch

from harts.forest import Forest
from harts.objectives.advantages import estimate_advantages
from harts.objectives.corrections import old_logprobs_of
from harts.objectives.losses import PolicyLossConfig, normalizers_for
from harts.objectives.mismatch import mismatch_figures
from harts.objectives.moe import MoEConfig
from harts.objectives.rollout import Rollout
from harts.runtime.backward import StepResult
from harts.runtime.config import RunConfig
from harts.runtime.distributed import all_reduce_sum
from harts.runtime.verify import Verification, VerificationError
from harts.steps.policy import forest_step, step_inputs, verify_step
from harts.trainer.config import TRAIN_ESTIMATORS, ObjectiveConfig
from harts.trainer.processes import Ranks, local_rollouts
from harts.trainer.rollout_stats import advantage_stats
from harts.trainer.run import collective

__all__ = ["train_step"]


def train_step(
    model: torch.nn.Module,
    rollouts: list[Rollout],
    objective: ObjectiveConfig,
    loss: PolicyLossConfig,
    run: RunConfig,
    moe: MoEConfig | None,
    ranks: Ranks | None = None,
    verify: bool = False,
) -> tuple[StepResult, Forest, Verification | None]:
    """Forward and backward of one step, gradients into ``.grad``: :func:`harts.rollout_step`'s own
    path (:func:`~harts.steps.policy.step_inputs`, then :func:`harts.forest_step`) with the advantages
    estimated on the step's rows in between when ``objective.advantage`` names an estimator.

    With ``ranks``, ``model`` is the wrapped model: every rank checks the whole step and
    estimates its advantages (an error on any rank stops every rank with the same message), then
    trains on its own trees, normalisers and gradients summed over the ranks. The forest returned
    is the whole step's.

    ``verify``: before the step, each rank checks its own trees against the stock forward
    (:func:`harts.steps.policy.verify_step`); the ranks agree on the verdict, and a failure on
    any rank raises VerificationError on every rank before any gradient is computed.

    When the loss reads advantages, ``result.metrics`` gains ``advantage_mean`` and
    ``advantage_std`` over the whole step's loss rows (the same on every rank); when the rows hold
    both behaviour and old log-probs, the mismatch figures of the whole step that no sum over its
    parts and ranks can carry (:func:`harts.objectives.mismatch.mismatch_figures`: the largest
    |log rho|, the engine-trainer probability correlation, k3 and |log rho| by quarter of the
    trajectories)."""
    forest, rows, local_forest, local_rows = _agreed(
        ranks, ValueError, _prepare, model, rollouts, objective, loss, ranks
    )
    report = None
    if verify:
        # its collectives broken by a lost rank: a RankFailure, as the step's own
        report = _agreed(ranks, VerificationError, collective, verify_step, model, local_forest, loss, run)
    reduce = None if ranks is None else all_reduce_sum
    normalizers = collective(normalizers_for, local_rows, max_length=objective.max_length, all_reduce=reduce)
    result = collective(
        forest_step, model, local_forest, local_rows, loss, normalizers=normalizers, run=run, moe=moe
    )
    if loss.policy_loss.needs_advantages and rows.has_advantage:  # the whole step's: alike on every rank
        figures = advantage_stats(rows.advantage)
        result.metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in figures.items()})
    if "mismatch_log_rho_abs" in result.metrics and rows.num_rows:  # no sums over parts: the whole step's
        old = old_logprobs_of(rows, None)
        figures = mismatch_figures(rows.rollout_logprob, old, rows.trajectory)
        result.metrics.update({k: torch.tensor(v, dtype=torch.float64) for k, v in figures.items()})
    return result, forest, report


def _agreed(ranks: Ranks | None, error: type[Exception], fn, *args):
    """``fn(*args)``; an ``error`` on any rank is raised on every rank with the first rank's message,
    before the step's collectives (so no rank waits in one that another never enters)."""
    message, out = None, None
    try:
        out = fn(*args)
    except error as exc:
        message = str(exc)
    if ranks is not None:
        message = collective(ranks.agree, message)
    if message is not None:
        raise error(message)
    return out


def _prepare(model, rollouts, objective: ObjectiveConfig, loss: PolicyLossConfig, ranks: Ranks | None):
    """The step's forest and rows (advantages estimated), and this rank's forest and rows."""
    forest, rows = step_inputs(model, rollouts)
    if objective.advantage is not None:
        if rows.has_advantage:
            raise ValueError(
                f"objective.advantage = {objective.advantage!r}, but the rollouts carry "
                f"advantages already: remove one of them"
            )
        rows = estimate_advantages(rows, objective.advantage, forest, **objective.advantage_params)
    elif loss.policy_loss.needs_advantages and not rows.has_advantage:
        raise ValueError(
            f"objective.kind = {loss.kind.value!r} needs advantages and the rollouts carry "
            f"none: set objective.advantage ({', '.join(TRAIN_ESTIMATORS)}) to estimate "
            f"them from rewards"
        )
    if ranks is None:
        return forest, rows, forest, rows
    local, _ = local_rollouts(rollouts, rows, forest, ranks)
    return (forest, rows, *step_inputs(model, local))
