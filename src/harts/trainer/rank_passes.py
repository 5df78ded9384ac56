"""The forward-only passes of ``harts train`` over torchrun's ranks: each rank scores its own trees.

A step of rollouts needs, before its updates, per-token values of the whole step: the reference's
log-probs (``[reference]``), the old policy's (``[ppo]``) and the critic's values (``[critic]``).
On several ranks each rank computes them for the trees :func:`~harts.plan.ranks.assign_trees`
gives it (the assignment of the step's forest that the step itself uses, by the model's FLOP
weights), under the pass's budget, with the model's FSDP2 units gathered one layer at a time
(:func:`harts.forest_logprobs` on a sharded model), and then the ranks exchange them once
(:func:`gather_by_rollout`): a later stage reads any rollout (an advantage estimator reads whole
groups, PPO's mini-batches are divided over the ranks again), and a checkpoint between two updates
saves the whole step's, which a run on any number of ranks resumes from.

Each value equals one process's within fp32 rounding: a rank's forest is a sub-forest of the
step's, so only the micro-batch cuts differ (split invariance, ``docs/architecture.md``).

Eval (``[eval]``) divides its file the same way; a file with fewer rollouts than ranks leaves
some ranks without any (they take part in the other ranks' gathers under FSDP2, compute nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from harts.forest import build_forest
from harts.forest_routes import routes_of
from harts.objectives.rollout import Rollout
from harts.plan.ranks import assign_trees
from harts.runtime.config import RunConfig
from harts.runtime.forward_only import stand_in_forward_only
from harts.trainer.processes import Ranks
from harts.trainer.run import collective

__all__ = ["rank_share", "gather_by_rollout", "over_ranks"]

Tensor = torch.Tensor


def rank_share(rollouts: Sequence[Rollout], ranks: Ranks) -> list[int]:
    """The indices of the rollouts this rank runs: its whole trees by the step's assignment; with
    fewer rollouts than ranks, rollout ``i`` on rank ``i`` (the others get none)."""
    if len(rollouts) < ranks.world_size:
        return [ranks.rank] if ranks.rank < len(rollouts) else []
    forest = build_forest([r.tokens for r in rollouts], routed_experts=routes_of(rollouts))
    assignment = assign_trees(forest, ranks.world_size, ranks.cost if ranks.balance == "cost" else None)
    return list(assignment.trajectories[ranks.rank])


def gather_by_rollout(
    ranks: Ranks, mine: list[int], values: list[Tensor], count: int, error: str | None = None
) -> list[Tensor]:
    """Every rank's ``values`` (one tensor per rollout of ``mine``), on the CPU, in rollout order:
    one exchange over the ranks. ``error``: this rank's pass failed with it; every rank then raises
    ValueError with the first error any rank reports."""
    found: list[tuple | None] = [None] * ranks.world_size
    dist.all_gather_object(found, (list(mine), [v.detach().cpu() for v in values], error))
    errors = [e for _, _, e in found if e is not None]
    if errors:
        raise ValueError(errors[0])
    out: list[Tensor | None] = [None] * count
    for indices, tensors, _ in found:
        for i, t in zip(indices, tensors, strict=True):
            out[i] = t
    missing = [i for i, t in enumerate(out) if t is None]
    if missing:  # an assignment that differs between ranks: never silently half-filled
        raise RuntimeError(f"no rank computed rollouts {missing[:5]} of the step's {count}")
    return out  # type: ignore[return-value]


def over_ranks(
    ranks: Ranks | None,
    model: nn.Module,
    run: RunConfig,
    rollouts: Sequence[Rollout],
    compute: Callable[[list[Rollout]], list[Tensor]],
) -> list[Tensor]:
    """``compute(rollouts)`` (a forward-only pass of ``model``, one tensor per rollout), each rank
    on its share (:func:`rank_share`), gathered: every rank returns the values of all rollouts.

    A ValueError on one rank (checked before its pass computes) stops every rank with its
    message: the failing rank still takes part in the others' gathers. A rank that dies or hangs
    makes the others fail within ``distributed.timeout_s`` with :class:`RankFailure`'s message."""
    rollouts = list(rollouts)
    if ranks is None:
        return compute(rollouts)
    mine = rank_share(rollouts, ranks)
    values: list[Tensor] = []
    error = None
    try:
        if mine:
            values = collective(compute, [rollouts[i] for i in mine])
        else:
            collective(stand_in_forward_only, model, run)
    except ValueError as exc:
        error, values = str(exc), []
        collective(stand_in_forward_only, model, run)
    return collective(gather_by_rollout, ranks, mine, values, len(rollouts), error)
