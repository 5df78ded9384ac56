"""One critic step: PPO's clipped value loss over a forest, exact gradients under any budget.

::

    value_step: step_inputs (validate_rollouts -> build_forest -> build_loss_rows)
                -> forest_backward with the critic's ScalarReadout and
                   loss_fn = value_loss(value, rows, config, normalizers)

The critic (a ``*ForTokenClassification`` with ``num_labels=1``, or :class:`harts.ValueHead`) runs
once per unique token; each loss row (trajectory, position) reads the value of its predictor, the
state after token ``p - 1`` (``harts.forward_values``' alignment), so a shared prefix's values are
computed once and each trajectory's own returns and rollout-time values apply to them. The loss is
a sum of per-row terms over the step's normalisers, so :func:`harts.forest_backward` runs every
micro-batch forward and backward once, cut trees too, and any budget gives the gradients of no
budget: the same engine as the policy step, with a different head read.

A critic wrapped in DDP or sharded by FSDP2 trains as the policy does on several ranks: each rank
runs its own rollouts, the normalisers are the whole step's (summed over the ranks), the
gradients are summed (FSDP2: each decoder layer's unit gathered around its forward and backward),
and the loss and metrics returned are the whole step's on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from harts.objectives.losses import Normalizers, normalizers_for
from harts.objectives.rollout import Rollout
from harts.objectives.rows import LossRows
from harts.objectives.values import ValueLossConfig, check_value_rows, explained_variance, value_loss
from harts.runtime.backward import FSDP_VERIFY, forest_backward, verify_training
from harts.runtime.config import RunConfig
from harts.runtime.distributed import DataParallel, data_parallel, data_parallel_step
from harts.runtime.executor import model_device
from harts.runtime.forward_only import forward_only_model
from harts.runtime.readout import ScalarReadout, scalar_head
from harts.runtime.result import StepResult, replace_result
from harts.steps.policy import step_inputs

__all__ = ["value_step"]

Tensor = torch.Tensor


class _ValueLoss:
    """``value_loss`` over ``rows``; ``subset`` the same loss over some rows (a sum of per-row terms
    over fixed normalisers: subsets of any rows add up, so cut trees run once)."""

    separable_rows = True

    def __init__(self, rows: LossRows, config: ValueLossConfig, normalizers: Normalizers):
        self.rows, self.config, self.normalizers = rows, config, normalizers

    def __call__(self, value: Tensor, _unused: Tensor):
        return value_loss(value, self.rows, self.config, self.normalizers)

    def subset(self, index: Tensor) -> _ValueLoss:
        return _ValueLoss(self.rows.select(index), self.config, self.normalizers)


def value_step(
    critic: nn.Module,
    rollouts: Sequence[Rollout],
    config: ValueLossConfig | None = None,
    *,
    budget_tokens: int | None = None,
    share_prefixes: bool = True,
    normalizers: Normalizers | None = None,
    run: RunConfig | None = None,
) -> StepResult:
    """Forward and backward of the critic's value loss over ``rollouts``; gradients into ``.grad``.

    The rollouts need ``returns`` (and ``values``, the rollout-time values, unless
    ``config.clip`` is None) at their loss-bearing positions; both are validated with the other
    annotations before any compute (trajectory and position named). ``normalizers``: the whole
    optimizer step's counts (None: this batch is the step). ``budget_tokens`` / ``run``: the
    micro-batches; ``share_prefixes=False`` runs the flat layout.

    Returns a :class:`~harts.runtime.backward.StepResult`: ``loss``; ``value`` [R], the critic's value
    of each row (also in ``logprob``; ``entropy`` holds zeros); ``rows``; ``metrics``
    (``value_loss``, ``value_clip_fraction``, ``value_mean``, ``explained_variance`` of the new
    values against the returns over the step's rows, ``loss``); and what the plan did.
    """
    config = ValueLossConfig() if config is None else config
    if not isinstance(config, ValueLossConfig):
        raise TypeError(f"expected a ValueLossConfig, got {type(config).__name__}")
    run = RunConfig.resolve(run, budget_tokens)
    model = forward_only_model(critic)  # the module harts runs, whatever the wrapper
    head = scalar_head(model, "value_step")
    forest, rows = step_inputs(model, rollouts, share_prefixes)
    check_value_rows(rows, config)
    dp = data_parallel(critic)
    if normalizers is None:  # the whole step's counts: every rank's rows
        normalizers = normalizers_for(rows, all_reduce=dp.all_reduce_sum if dp is not None else None)
    elif not isinstance(normalizers, Normalizers):
        raise TypeError(f"expected Normalizers (see normalizers_for), got {type(normalizers).__name__}")
    rows = rows.to(model_device(model))
    loss = _ValueLoss(rows, config, normalizers)
    verified = None
    if run.verify:
        if dp is not None and dp.kind == "fsdp":
            raise ValueError(FSDP_VERIFY)
        verified = verify_training(model, forest, run, 1.0, ScalarReadout(head), True, "value_step")
        run = run.unverified
    with data_parallel_step(critic, overlap=run.fsdp_overlap) as (_, dp):
        result = forest_backward(
            model,
            forest,
            rows.predictor,
            rows.target,
            loss,
            run=run,
            readout=ScalarReadout(head),
            sharded=dp.sharded if dp is not None else None,
        )
    value = result.logprob
    if dp is None:
        variance = explained_variance(value, rows.value_target)
    else:
        result = _sum_metrics(result, dp)
        variance = _explained_variance_over_ranks(value, rows.value_target, dp)
    metrics = {**result.metrics, "explained_variance": variance.to(result.loss.dtype)}
    if verified is not None:  # this rank's check's figures, after the sum over ranks
        metrics.update(verified.metrics())
    return replace_result(
        result, rows=rows, value=value, metrics=metrics, batch_layout=getattr(rollouts, "layout", None)
    )


def _sum_metrics(result: StepResult, dp: DataParallel) -> StepResult:
    """The loss and metrics of the whole step on every rank: each rank's are sums over the step's
    normalisers, so they add up."""
    names = sorted(n for n in result.metrics if n != "loss")
    values = torch.stack(
        [result.loss.detach().double().reshape(())] + [result.metrics[n].double().reshape(()) for n in names]
    )
    dp.all_reduce_sum(values)
    loss, metrics = values[0].to(result.loss.dtype), dict(result.metrics)
    for n, v in zip(names, values[1:], strict=True):
        metrics[n] = v.to(metrics[n].dtype)
    if "loss" in metrics:
        metrics["loss"] = loss
    return replace_result(result, loss=loss, metrics=metrics)


def _explained_variance_over_ranks(value: Tensor, target: Tensor, dp: DataParallel) -> Tensor:
    """:func:`explained_variance` over every rank's rows, from their summed moments (fp64)."""
    value, target = value.detach().double(), target.detach().double()
    error = target - value
    moments = torch.stack(
        [
            torch.tensor(float(target.numel()), dtype=torch.float64),
            target.sum(),
            (target * target).sum(),
            error.sum(),
            (error * error).sum(),
        ]
    )
    n, r, rr, e, ee = dp.all_reduce_sum(moments.cpu()).tolist()
    if n == 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    var = rr / n - (r / n) ** 2
    return torch.tensor(1 - (ee / n - (e / n) ** 2) / var if var > 0 else float("nan"), dtype=torch.float64)
