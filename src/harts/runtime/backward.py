"""Forward and backward of a whole forest under a micro-batch token budget.

``forest_backward(model, forest, predictor, target, loss_fn, budget_tokens)`` accumulates into
``.grad`` exactly the gradients of ``loss_fn(logprob [R], entropy [R])``, the loss of rows given
by a predicting unique token and a target id, whatever the budget. It is the lower layer of
:func:`harts.rollout_step` and the entry point for custom losses.

Without a budget (or when the forest fits) it is one forward, the loss, one backward. With a
budget the forest is cut into micro-batches (:mod:`harts.plan.micro_batches`), and how they run
depends on what the loss says of itself:

- **Per-row losses** (``loss_fn.subset(rows)`` and ``loss_fn.separable_rows``: a sum of per-row
  terms over normalisers fixed before the step, as every objective of :func:`harts.rollout_step`
  but GSPO is): every part runs forward and backward once, on its own rows, as a flat trainer runs
  its micro-batches. A micro-batch of whole trees runs its backward right after its forward. A cut
  tree is walked depth first over its parts: a part that later parts read keeps its graph while
  they run, and runs its backward once they have all sent back the gradients of what it handed
  them. Held graphs are those of the chain of parts above the running one; where holding one
  would exceed ``RunConfig.hold_limit`` (by default ``budget_tokens``: the step's graphs stay
  within two micro-batches' tokens; ``hold_tokens=0``: within one, holding none), that part runs
  without autograd first and again in backward (``StepResult.part_forwards`` counts the forwards,
  ``StepResult.recomputed_parts`` names the parts that ran twice).
- **Per-trajectory losses** (``subset`` only: valid for whole trajectories' rows, e.g. GSPO's
  sequence ratio): micro-batches of whole trees run once as above; the parts of cut trees take
  the three passes below.
- **Any other loss** (or an observer that needs the whole step's statistics first): every part
  takes the three passes:

  1. forward of every part in order, without autograd, keeping what each part hands on (per
     layer: keys/values and conv inputs of the tokens later parts read, final states of their
     parents) and the row log-probs and entropies; the last part runs with autograd;
  2. the loss on detached row log-probs, differentiated once: d loss / d logprob and d entropy;
  3. parts in reverse order: recompute the part's forward with autograd (all but the last), the
     handed-over inputs as leaves, and run backward with the row gradients and the gradients
     that later parts sent back to this part's exports injected.

In every order, the gradients of a part's handed-over leaves go back to the parts that produced
them (:class:`~harts.runtime.handoff.HandoffBanks`), and recomputation is exact: the same ops on
the same inputs.

What runs when is decided before any compute, from the parts' sizes and readers alone: the step's
:class:`~harts.plan.schedule.Schedule` (:mod:`harts.plan.schedule`, where the walks above are
written), a list of typed events that :func:`run_schedule` runs one by one on the
:class:`~harts.runtime.step_parts.StepParts` of the step.

A :class:`PartObserver` sees every part's forward and may add a loss term to a part's backward:
this is how the MoE load-balancing loss, a product of two means over the whole step, gets its
exact gradient part by part (:mod:`harts.steps.router_statistics`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from harts.forest import Forest
from harts.plan.schedule import (
    Backward,
    DropLayout,
    Forward,
    HandOver,
    LossForm,
    Recompute,
    Release,
    RowGradients,
    Schedule,
)
from harts.runtime.config import RunConfig
from harts.runtime.executor import check_inputs, resolve_model, run_backend
from harts.runtime.readout import Readout, readout_for
from harts.runtime.result import StepResult, step_result
from harts.runtime.sharded import ShardedStep
from harts.runtime.step_parts import PartObserver, PartRun, RowGrads, StepParts, check_rows
from harts.runtime.verify import Verification, entry_point, readout_on, verify_sample
from harts.runtime.verify_sharded import is_sharded

__all__ = [
    "StepResult",
    "PartObserver",
    "forest_backward",
    "next_token_rows",
    "run_schedule",
    "loss_form",
    "check_rows",
]

Tensor = torch.Tensor
LossFn = Callable[[Tensor, Tensor], "Tensor | tuple[Tensor, dict[str, Tensor]]"]


def next_token_rows(forest: Forest) -> tuple[Tensor, Tensor]:
    """(predictor [R], target [R]) for every next-token prediction of every trajectory."""
    indices = [forest.trajectory_token_indices(i) for i in range(forest.num_trajectories)]
    predictor = torch.cat([idx[:-1] for idx in indices])
    return predictor, forest.tokens[torch.cat([idx[1:] for idx in indices])]


def run_schedule(parts: StepParts, schedule: Schedule) -> None:
    """Run ``schedule``'s events on ``parts``, one by one: the whole of a step's compute.

    ``graphs`` holds the runs waiting for their backward (a forward with autograd, a recompute);
    the run of a forward is otherwise kept only until its hand-over, so nothing of a part outlives
    the events that read it while the next part runs.
    """
    graphs: dict[int, PartRun] = {}
    handing: PartRun | None = None  # the part run forward just now, for its hand-over
    row_grads: RowGrads = (None, None)
    for event in schedule:
        if not isinstance(event, HandOver):
            handing = None
        match event:
            case Forward(part=p, grad=grad):
                parts.note_held(graphs)
                handing = parts.forward(p, grad=grad, first=True)
                if grad:
                    graphs[p] = handing
            case HandOver(part=p):
                parts.hand_over(p, handing)
            case Recompute(part=p):
                parts.note_held(graphs)
                graphs[p] = parts.forward(p, grad=True, first=False)
            case RowGradients(parts=order):
                row_grads = parts.row_gradients(order)
            case Backward(part=p, own_rows=True):
                parts.own_backward(p, graphs.pop(p))
            case Backward(part=p, own_rows=False):
                parts.row_backward(p, graphs.pop(p), row_grads)
            case Release(part=p):
                parts.banks.release(p)
            case DropLayout(part=p):
                parts.drop_layout(p)


def loss_form(loss_fn, observer: PartObserver) -> LossForm:
    """What ``loss_fn`` says of itself (:class:`~harts.plan.schedule.LossForm`): per row with
    ``subset`` and ``separable_rows``, per trajectory with ``subset`` alone, else whole, and whole
    whenever the observer needs the whole step's statistics first."""
    if not hasattr(loss_fn, "subset") or observer.needs_step_statistics:
        return LossForm.WHOLE
    return LossForm.PER_ROW if getattr(loss_fn, "separable_rows", False) else LossForm.PER_TRAJECTORY


#: why ``RunConfig(verify=True)`` is refused on an FSDP2-sharded critic
FSDP_VERIFY = (
    "RunConfig(verify=True) on an FSDP2-sharded critic is not supported (the sharded check "
    "runs a causal LM's log-probs): verify the critic on one process or under DDP"
)


def verify_training(
    model: nn.Module, forest: Forest, run: RunConfig, temperature: float, readout, separable: bool, what: str
) -> Verification:
    """``run.verify``'s check of a training call (:func:`harts.runtime.verify.verify_sample`): harts'
    pass on the sample is :func:`forest_backward` under ``run`` unverified, with ``readout``."""

    def harts_rows(on, sub: Forest, predictor: Tensor, target: Tensor, loss, sample_run: RunConfig) -> Tensor:
        # an FSDP2 model: harts' own sharded step, in lock step with the other ranks (verify_sharded)
        with _step_of(model if on is None else on, sample_run) as (module, sharded):
            return forest_backward(
                module,
                sub,
                predictor,
                target,
                loss,
                run=sample_run,
                temperature=temperature,
                readout=readout_on(readout, model, on),
                sharded=sharded,
            ).logprob

    return verify_sample(
        model,
        forest,
        run=run,
        harts_rows=harts_rows,
        readout=readout,
        temperature=temperature,
        gradients=True,
        separable=separable,
        what=what,
    )


@contextlib.contextmanager
def _step_of(model: nn.Module, run: RunConfig):
    """``(module, sharded)``: an FSDP2 model's sharded step (its gradients summed over the ranks on
    leaving), else the model itself."""
    if not is_sharded(model):
        yield model, None
        return
    from harts.runtime.distributed import data_parallel_step

    with data_parallel_step(model, overlap=run.fsdp_overlap) as (module, dp):
        yield module, dp.sharded


def forest_backward(
    model: nn.Module,
    forest: Forest,
    predictor: Tensor,
    target: Tensor,
    loss_fn: LossFn,
    budget_tokens: int | None = None,
    *,
    run: RunConfig | None = None,
    observer: PartObserver | None = None,
    temperature: float = 1.0,
    sharded: ShardedStep | None = None,
    readout: Readout | None = None,
) -> StepResult:
    """Accumulate into ``.grad`` the gradients of ``loss_fn(logprob, entropy)`` over rows.

    ``predictor`` [R]: unique-token index (in ``forest``) of each row's predicting position;
    ``target`` [R]: the token id it predicts. ``loss_fn`` returns a 0-dim loss, or
    ``(loss, metrics)``. If it has ``subset(rows [r]) -> loss_fn`` over those rows alone (a sum
    over trajectories, each of its own rows, so that the losses of whole trajectories' rows add
    up), micro-batches of whole trees run forward and backward once; if it also sets
    ``separable_rows = True`` (a sum of per-row terms: subsets of any rows add up), so do the parts
    of cut trees (module docstring). ``budget_tokens`` (or
    ``run.budget_tokens``) cuts the forest into micro-batches; ``run`` holds the other execution
    knobs (:class:`~harts.runtime.config.RunConfig`).
    ``temperature`` T: rows' log-probs and entropies are those of ``softmax(logits / T)``, the
    distribution a sampler at T drew from. ``sharded``: the FSDP2 step of
    :func:`harts.runtime.distributed.data_parallel_step` (units gathered layer by layer; the
    model is that step's). ``readout``: what the rows read from their predictor's final hidden
    state (:mod:`harts.runtime.readout`; default: the log-prob of the target and the entropy
    under ``model.lm_head``; :class:`~harts.runtime.readout.ScalarReadout` gives a critic's
    values, passed to ``loss_fn`` in place of the log-probs). Every check runs before any
    compute. Returns the loss, the row log-probs and entropies (or the readout's two
    quantities), and what the plan did.
    """
    start = time.perf_counter()
    run = RunConfig.resolve(run, budget_tokens)
    observer = observer or PartObserver()
    model = resolve_model(model)
    check_inputs(model, forest)
    readout = readout_for(model, readout, temperature)
    predictor, target = check_rows(forest, predictor, target, readout)
    form = loss_form(loss_fn, observer)
    verified = None
    if run.verify:
        if sharded is not None:
            raise ValueError(FSDP_VERIFY)
        with entry_point("forest_backward"):
            verified = verify_training(
                model, forest, run, temperature, readout, form is LossForm.PER_ROW, "forest_backward"
            )
        run = run.unverified
    with run_backend(run, model):
        parts = StepParts(model, forest, predictor, target, loss_fn, run, observer, readout, sharded)
        schedule = parts.schedule(form)
        run_schedule(parts, schedule)
    layouts = parts.layouts
    timings = {
        "plan": parts.clock.seconds["plan"] + sum(lay.build_seconds for lay in layouts),
        "handoff": parts.clock.seconds["handoff"],
        "total": time.perf_counter() - start,
    }
    return step_result(
        parts.loss.detach(),
        parts.logp,
        parts.ent,
        layouts=layouts,
        tokens_per_micro_batch=parts.sizes,
        timings=timings,
        metrics={**parts.metrics, **(verified.metrics() if verified else {})},
        num_cuts=parts.plan.num_cuts,
        part_forwards=parts.forwards,
        recomputed_parts=tuple(sorted(parts.recomputed)),
        peak_held_tokens=parts.peak_held_tokens,
        schedule=schedule,
    )
