"""One training step: forward and backward of any objective over a forest, under a token budget.

::

    rollout_step: step_inputs (validate_rollouts -> build_forest -> build_loss_rows) -> forest_step
    forest_step:  checks (before any compute) -> forest_backward with
                  loss_fn = compute_loss(logprob, entropy, rows, config, normalizers)
                  (+ MoE statistics and the load-balancing loss, part by part, when asked)

Gradients accumulate into ``.grad``; the result holds the detached loss, the metrics, the MoE
statistics and what the plan did (:class:`~harts.runtime.backward.StepResult`). Every budget gives
the loss, metrics, MoE statistics and gradients of no budget. ``share_prefixes=False`` runs the
flat layout (each trajectory its own root) through the same code: the baseline.

Every check that can fail (annotations the objective needs, Dr. GRPO's constant, rows that do
not belong to the forest, MoE options the model cannot honour, token ids outside the vocabulary)
runs before the model does.

What this leaves out: advantage estimation (give the rollouts advantages, or rows from
``estimate_advantages``) and the optimizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import nn

from harts.adapters.base import MoEBalancing
from harts.forest import Forest, build_forest
from harts.forest_routes import routes_of
from harts.objectives.corrections import log_rho_of
from harts.objectives.losses import (
    Normalizers,
    PolicyLossConfig,
    compute_loss,
    normalizers_for,
)
from harts.objectives.moe import MoEConfig
from harts.objectives.rollout import Rollout, validate_rollouts
from harts.objectives.rows import LossRows, build_loss_rows
from harts.runtime.backward import forest_backward, verify_training
from harts.runtime.config import RunConfig
from harts.runtime.distributed import DataParallel, data_parallel, data_parallel_step, unwrap_data_parallel
from harts.runtime.executor import model_device, resolve_model
from harts.runtime.image_forest import has_images, image_forest
from harts.runtime.image_inputs import image_features_once
from harts.runtime.model_checks import sharded_step
from harts.runtime.result import StepResult, replace_result
from harts.runtime.routers import RouterRecorder
from harts.runtime.verify import Verification, entry_point
from harts.steps.router_statistics import MoEObserver, resolve_aux_coef

__all__ = ["rollout_step", "forest_step", "step_inputs", "verify_step"]

Tensor = torch.Tensor


def _check_inputs(
    forest: Forest, rows: LossRows, config: PolicyLossConfig, normalizers: Normalizers, old_logprob
) -> None:
    """What compute_loss would refuse after the forward, refused before it."""
    if not isinstance(forest, Forest):
        raise TypeError(f"expected a harts Forest (see harts.build_forest), got {type(forest).__name__}")
    if not isinstance(rows, LossRows):
        raise TypeError(f"expected LossRows (see build_loss_rows), got {type(rows).__name__}")
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"expected a PolicyLossConfig, got {type(config).__name__}")
    if not isinstance(normalizers, Normalizers):
        raise TypeError(f"expected Normalizers (see normalizers_for), got {type(normalizers).__name__}")
    if rows.num_trajectories != forest.num_trajectories:
        raise ValueError(
            f"the rows have {rows.num_trajectories} trajectories but the forest has {forest.num_trajectories}"
        )
    if rows.num_rows:
        index = rows.target_index.cpu()
        if int(index.max()) >= forest.num_tokens or not torch.equal(forest.tokens[index], rows.target.cpu()):
            raise ValueError("the rows were not built on this forest (build_loss_rows(forest, rollouts))")
    if old_logprob is not None and tuple(old_logprob.shape) != (rows.num_rows,):
        raise ValueError(
            f"old_logprob must have shape [R] = ({rows.num_rows},), got {tuple(old_logprob.shape)}"
        )
    loss = config.policy_loss
    if loss.needs_advantages and not rows.has_advantage:
        raise ValueError(
            f"{config.kind} needs advantages: give the rollouts advantages or use estimate_advantages"
        )
    if (
        loss.needs_behaviour_logprobs
        and old_logprob is None
        and not rows.has_rollout_logprob
        and not rows.has_old_logprob
    ):
        raise ValueError(
            f"{config.kind} needs the behaviour policy's log-probs: give the rollouts rollout_logprobs "
            f"or pass old_logprob"
        )
    if config.correction is not None:  # refuses rows without behaviour or old log-probs
        log_rho_of(rows, old_logprob, f"correction {config.correction.value!r}")
    if config.needs_ref_logprobs and not rows.has_ref_logprob:
        raise ValueError("kl_coef > 0 needs reference log-probs: give the rollouts ref_logprobs")
    if config.needs_max_length and normalizers.max_length is None:
        raise ValueError(
            "seq-mean-token-sum-norm needs Dr. GRPO's constant: pass normalizers_for(rows, max_length=...)"
        )


def forest_step(
    model: nn.Module,
    forest: Forest,
    rows: LossRows,
    config: PolicyLossConfig,
    *,
    normalizers: Normalizers | None = None,
    budget_tokens: int | None = None,
    run: RunConfig | None = None,
    moe: MoEConfig | None = None,
    old_logprob: Tensor | None = None,
    temperature: float | None = None,
) -> StepResult:
    """Forward and backward of ``config``'s loss over ``rows`` of ``forest``; gradients into ``.grad``.

    ``rows`` must be ``build_loss_rows(forest, rollouts)`` (possibly with advantages from
    ``estimate_advantages``). ``normalizers`` are the counts of the whole optimizer step
    (``normalizers_for`` over all its batches), so the losses of a step's batches add up to the
    step's loss; None means this batch is the whole step. ``old_logprob`` [R]: the old policy's
    log-probs (PPO's ratio denominator), in place of the rollouts' ``old_logprobs`` or, without
    those, their ``rollout_logprobs`` (the behaviour's, which an importance correction reads
    apart: ``config.correction``). ``budget_tokens`` (or ``run.budget_tokens``) bounds the
    unique tokens per micro-batch. ``moe``: record the routers, return :class:`MoEStats` in the
    result and add the load-balancing loss (see :class:`MoEConfig`). ``temperature`` (or
    ``config.temperature``): the sampling temperature of the rollouts.
    """
    run = RunConfig.resolve(run, budget_tokens)
    config = _with_temperature(config, temperature)
    sharded_check = None
    if run.verify and (dp := data_parallel(model)) is not None and dp.kind == "fsdp":
        # every rank checks in lock step, before the sharded step gathers its units (verify_sharded)
        with entry_point("forest_step"):
            sharded_check = _verify(_checked_module(model), forest, config, run)
        run = run.unverified
    with data_parallel_step(model, overlap=run.fsdp_overlap) as (module, dp), entry_point("forest_step"):
        result, observer, verified = _local_step(
            module, dp, forest, rows, config, normalizers, run, moe, old_logprob
        )
    verified = verified or sharded_check
    if dp is not None:
        result = _sum_results(result, dp, observer)
    if verified is not None:  # this rank's check's figures, after the sum over ranks
        result = replace_result(result, metrics={**result.metrics, **verified.metrics()})
    return result


def _local_step(model, dp: DataParallel | None, forest, rows, config, normalizers, run, moe, old_logprob):
    """This rank's share of the step (the whole step on one process)."""
    model = resolve_model(model)
    if normalizers is None and isinstance(rows, LossRows):
        # the whole step's counts: every rank's rows
        normalizers = normalizers_for(rows, all_reduce=dp.all_reduce_sum if dp is not None else None)
    _check_inputs(forest, rows, config, normalizers, old_logprob)  # the model's own: forest_backward's
    aux_coef = resolve_aux_coef(moe, model) if moe is not None else 0.0
    device = model_device(model)
    if rows.device != device:
        rows = rows.to(device)
    if old_logprob is not None:
        # the old log-probs join the rows, with each trajectory's log-ratio to the behaviour's
        # summed over all of its rows here, once, before a cut tree's parts read their share
        rows = rows.with_old_logprob(old_logprob.to(device))

    loss_fn = _PolicyLoss(rows, config, normalizers)
    verified = None
    if run.verify:  # before the routers are recorded: the check's forwards are not the step's
        verified = _verify(model, forest, config, run)
        run = run.unverified

    recorder = RouterRecorder(model) if moe is not None else None
    observer = (
        MoEObserver(recorder, aux_coef, _agreement(dp, recorder, aux_coef)) if recorder is not None else None
    )
    with recorder if recorder is not None else nullcontext(), image_features_once(model, forest):
        result = forest_backward(
            model,
            forest,
            rows.predictor,
            rows.target,
            loss_fn,
            run=run,
            observer=observer,
            temperature=config.temperature,
            sharded=dp.sharded if dp is not None else None,
        )
    if observer is None:
        return replace_result(result, rows=rows), observer, verified
    stats = observer.stats()
    loss, metrics = result.loss, dict(result.metrics)
    if stats.aux_loss is not None:
        metrics["moe_aux_loss"] = stats.aux_loss.detach()
        if aux_coef > 0:
            loss = loss + aux_coef * stats.aux_loss.detach().to(loss.dtype)
            metrics["loss"] = loss
    return replace_result(result, rows=rows, moe=stats, loss=loss, metrics=metrics), observer, verified


def verify_step(
    model: nn.Module, forest: Forest, config: PolicyLossConfig, run: RunConfig | None = None
) -> Verification:
    """``RunConfig(verify=True)``'s check of :func:`forest_step` on ``forest`` alone, computing
    nothing of the step (what ``harts train`` runs on every rank before a verified update, so the
    ranks agree on the verdict before the step's collectives). Raises VerificationError."""
    run = RunConfig.resolve(run)
    return _verify(_checked_module(unwrap_data_parallel(model)), forest, config, run)


def _checked_module(model: nn.Module) -> nn.Module:
    """The causal LM the check runs; an FSDP2 model as it is (the check runs its own forward and
    harts' sharded step on it, every rank in lock step: :mod:`harts.runtime.verify_sharded`)."""
    with sharded_step(model):
        return resolve_model(model)


def _verify(model: nn.Module, forest: Forest, config: PolicyLossConfig, run: RunConfig) -> Verification:
    separable = config.policy_loss.separable_rows  # the step's loss form (_PolicyLoss)
    return verify_training(model, forest, run, config.temperature, None, separable, "forest_step")


def _agreement(dp: DataParallel | None, recorder: RouterRecorder, aux_coef: float):
    """How the aux loss's routing fractions become the whole step's on several ranks: one sum of
    ``E + 1`` numbers, in the sharded step's lock step under FSDP2 (no other collective runs
    inside a DDP step's parts)."""
    if dp is None or aux_coef == 0 or recorder.balancing is not MoEBalancing.AUX_LOSS:
        return None
    if dp.sharded is None:
        return dp.all_reduce_sum
    dp.sharded.expect_agreement(recorder.num_experts + 1, torch.float64)
    return dp.sharded.agree_sum


def _sum_results(result: StepResult, dp: DataParallel, observer: MoEObserver | None) -> StepResult:
    """Loss, metrics and expert counts of the whole step on every rank: each rank's are its share
    of sums over the step's normalisers, so they add up."""
    names = sorted(result.metrics)
    values = torch.stack(
        [result.loss.detach().float().reshape(())] + [result.metrics[n].float().reshape(()) for n in names]
    )
    dp.all_reduce_sum(values)
    loss, metrics, moe = values[0].to(result.loss.dtype), dict(result.metrics), result.moe
    for n, v in zip(names, values[1:], strict=True):
        metrics[n] = v
    if "loss" in metrics:
        metrics["loss"] = loss
    if moe is not None:
        dp.all_reduce_sum(moe.expert_counts)
        dp.all_reduce_sum(moe.tokens)
        if moe.aux_loss is not None:
            whole = observer.whole_step_aux_loss(dp.all_reduce_sum)
            moe = dataclasses.replace(moe, aux_loss=whole)
            if "moe_aux_loss" in metrics:  # the summed shares are the step's only when agreed
                metrics["moe_aux_loss"] = whole
    return replace_result(result, loss=loss, metrics=metrics, moe=moe)


def step_inputs(
    model: nn.Module, rollouts: Sequence[Rollout], share_prefixes: bool = True
) -> tuple[Forest, LossRows]:
    """The forest and loss rows of a batch of rollouts, checked (against the model's vocabulary
    too) before anything is built: what :func:`rollout_step` runs :func:`forest_step` on, for a
    caller that changes the rows in between (advantages estimated on the step, say)."""
    base = resolve_model(model) if data_parallel(model) is None else unwrap_data_parallel(model)
    text_config = getattr(base.config, "text_config", None) or base.config  # a multimodal model's text LM
    checked = validate_rollouts(rollouts, vocab_size=text_config.vocab_size)
    if has_images(rollouts):  # prefixes shared where ids and images agree, M-RoPE positions
        forest = image_forest(base, rollouts, share_prefixes)
    else:
        forest = build_forest(
            [c.tokens for c in checked], share_prefixes=share_prefixes, routed_experts=routes_of(rollouts)
        )
    return forest, build_loss_rows(forest, rollouts)


def rollout_step(
    model: nn.Module,
    rollouts: Sequence[Rollout],
    config: PolicyLossConfig,
    *,
    budget_tokens: int | None = None,
    share_prefixes: bool = True,
    normalizers: Normalizers | None = None,
    run: RunConfig | None = None,
    moe: MoEConfig | None = None,
    temperature: float | None = None,
) -> StepResult:
    """One training step on a batch of rollouts: forward and backward, gradients into ``.grad``.

    Validates the rollouts (against the model's vocabulary), the config's needs and the MoE
    options before any compute, builds the forest (``share_prefixes=False`` gives the flat
    layout) and the rows, and runs :func:`forest_step`. ``normalizers`` None means this batch is
    the whole step (Dr. GRPO's aggregation then needs explicit normalisers with ``max_length``).
    ``budget_tokens`` bounds the unique tokens per micro-batch; ``temperature`` (or
    ``config.temperature``) is the rollouts' sampling temperature; ``run`` holds the other execution
    knobs (:class:`~harts.runtime.config.RunConfig`). Returns a
    :class:`~harts.runtime.backward.StepResult`: the detached loss, metrics, MoE statistics
    (``moe=MoEConfig()``), row log-probs and the plan.
    """
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"expected a PolicyLossConfig, got {type(config).__name__}")
    run = RunConfig.resolve(run, budget_tokens)
    config = _with_temperature(config, temperature)
    forest, rows = step_inputs(model, rollouts, share_prefixes)
    with entry_point("rollout_step"):  # a failed check names the function the user called
        result = forest_step(model, forest, rows, config, normalizers=normalizers, run=run, moe=moe)
    return replace_result(result, batch_layout=getattr(rollouts, "layout", None))


class _PolicyLoss:
    """``compute_loss`` over ``rows``; ``subset`` gives the same loss over some of them. Every
    objective is a sum over trajectories of each one's own rows over the step's normalisers, so the
    losses (and metrics) of subsets holding whole trajectories add up to the loss over all rows;
    a kind whose entry says ``separable_rows`` (every one but GSPO, whose sequence ratio couples a
    trajectory's rows) is even a sum of per-row terms: subsets of any rows add up, so cut trees
    run once."""

    def __init__(self, rows: LossRows, config, normalizers):
        self.rows, self.config, self.normalizers = rows, config, normalizers
        self.separable_rows = config.policy_loss.separable_rows

    def __call__(self, logprob, entropy):
        return compute_loss(logprob, entropy, self.rows, self.config, self.normalizers)

    def subset(self, index: Tensor) -> _PolicyLoss:
        # per-trajectory sums (row counts, log-ratios) stay whole: select keeps them
        return _PolicyLoss(self.rows.select(index), self.config, self.normalizers)


def _with_temperature(config: PolicyLossConfig, temperature: float | None) -> PolicyLossConfig:
    """``config`` with ``temperature`` applied; a temperature given both ways must agree."""
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"expected a PolicyLossConfig, got {type(config).__name__}")
    if temperature is None or float(temperature) == config.temperature:
        return config
    if config.temperature != 1.0:
        raise ValueError(
            f"temperature={temperature} disagrees with config.temperature={config.temperature}: give one"
        )
    return dataclasses.replace(config, temperature=float(temperature))
