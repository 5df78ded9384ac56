"""Log-probs without autograd under a token budget: the old-policy and reference passes of RL.

A PPO or GRPO step runs the same rollouts through the model three times: the policy with
autograd (:func:`harts.rollout_step`), and the old policy and the reference without it.
:func:`forest_logprobs` is the forward-only pass: the forest is cut into micro-batches exactly as
:func:`harts.forest_backward` cuts it (:func:`harts.plan_micro_batches` under
``run.budget_tokens``: whole trees packed, larger trees cut at node boundaries with keys/values,
conv inputs and states handed over), every part runs once without autograd, and only each row's
log-prob (and entropy) is kept. What a part hands on is dropped once the last part reading it
has run. Peak memory is one micro-batch's activations (no graph) plus the hand-overs still to be
read, whatever the forest's size.

The values come per trajectory in the layout of :class:`harts.Rollout`'s per-token fields
(``rollout_logprobs``, ``ref_logprobs``): one value per token, position ``p`` the log-prob of
token ``p`` given tokens ``< p``, and position 0, which nothing predicts, holding ``fill``
(0.0 by default; pass ``float("nan")`` to mark it). They equal the stock Hugging Face forward of
each trajectory alone within fp32 rounding, and the log-probs of :func:`harts.forward` on the
whole forest: bit for bit when the forest is one micro-batch, and within the split invariance of
the step (``docs/architecture.md``) when it is cut.

:func:`forest_row_logprobs` is the same pass over any rows (a predicting unique token and a
target id each), for callers that choose their rows (:func:`harts.integrations.batch_logprobs`).

It always runs without autograd, under ``torch.no_grad()`` or not, and returns tensors without a
graph: for log-probs to differentiate use :func:`harts.forward` (one micro-batch) or
:func:`harts.forest_backward` (any budget). A DDP wrapper is run through its module (a
forward-only pass has no gradient to synchronise). A model sharded by FSDP2's ``fully_shard`` runs
with its units gathered one decoder layer at a time, as the training step gathers them
(:func:`harts.runtime.distributed.forward_only_step`): the gathers are collectives, so every rank
of the mesh calls the pass at the same time, each on its own trajectories (a rank with none
calls :func:`stand_in_forward_only`), and a rank holds its shards plus a layer or two whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from harts.forest import Forest, build_forest
from harts.forest_routes import routes_of
from harts.ops.logprobs import check_temperature
from harts.plan.schedule import LossForm
from harts.runtime.backward import FSDP_VERIFY, run_schedule
from harts.runtime.config import RunConfig
from harts.runtime.distributed import data_parallel, forward_only_step
from harts.runtime.executor import check_inputs, resolve_model, run_backend
from harts.runtime.image_forest import has_images, image_forest
from harts.runtime.image_inputs import image_features_once
from harts.runtime.model_checks import sharded_step
from harts.runtime.readout import Readout, readout_for
from harts.runtime.step_parts import PartObserver, StepParts, check_rows
from harts.runtime.verify import entry_point, readout_on, verify_sample

__all__ = [
    "RowLogprobs",
    "ForestLogprobs",
    "forest_row_logprobs",
    "forest_row_readout",
    "forest_logprobs",
    "stand_in_forward_only",
]

Tensor = torch.Tensor


@dataclass(eq=False)
class RowLogprobs:
    """Rows' values from a forward-only pass, and what its plan did.

    - ``logprob`` / ``entropy`` [R]: detached, in the head's precision (fp32; fp64 for an fp64
      model), on the model's device, in the order of the rows given.
    - ``num_micro_batches``, ``num_cuts`` (parts reading context from an earlier part),
      ``tokens_per_micro_batch``, ``part_forwards`` (one forward per part: no part runs twice).
    - ``timings``: seconds in ``plan``, ``handoff`` and ``total``, as in
      :class:`harts.StepResult`.
    """

    logprob: Tensor
    entropy: Tensor
    num_micro_batches: int
    num_cuts: int
    tokens_per_micro_batch: list[int]
    part_forwards: int
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class ForestLogprobs:
    """What :func:`forest_logprobs` returns.

    - ``logprobs``: per trajectory, [L_i] (one value per token, as ``Rollout.rollout_logprobs``
      and ``Rollout.ref_logprobs``): position ``p`` holds log pi(token p | tokens < p), position 0
      and any position not scored hold the ``fill`` value.
    - ``entropies``: the same layout (the entropy of the distribution that predicted token
      ``p``), or None when not asked for.
    - ``scored``: per trajectory, [L_i] bool, where a value was computed.
    - ``forest``: the forest that ran; ``rows``: the row values and what the plan did.
    """

    logprobs: list[Tensor]
    entropies: list[Tensor] | None
    scored: list[Tensor]
    forest: Forest
    rows: RowLogprobs

    @property
    def num_micro_batches(self) -> int:
        return self.rows.num_micro_batches


def forward_only_model(model: nn.Module) -> nn.Module:
    """The causal LM (or critic) a forward-only pass runs: DDP's module (no gradient to
    synchronise), an FSDP2 model's own (its units gathered by the pass), compile and peft
    wrappers removed (:func:`~harts.runtime.executor.resolve_model`)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    with sharded_step(model):
        return resolve_model(model)


def stand_in_forward_only(model: nn.Module, run: RunConfig | None = None) -> None:
    """A rank's share of a forward-only pass when it has no trajectories: under FSDP2 it still
    takes part in the other ranks' gathers (nothing computed); nothing to do otherwise."""
    run = RunConfig.resolve(run, None)
    with forward_only_step(model, run.fsdp_overlap):
        pass


def forest_row_logprobs(
    model: nn.Module,
    forest: Forest,
    predictor,
    target,
    *,
    run: RunConfig | None = None,
    budget_tokens: int | None = None,
    temperature: float = 1.0,
) -> RowLogprobs:
    """(log-prob, entropy) of each row without autograd, the forest cut under ``run``'s budget.

    ``predictor`` [R]: the unique-token index (in ``forest``) of each row's predicting position;
    ``target`` [R]: the token id it predicts (as :func:`harts.forest_backward` takes them).
    ``budget_tokens`` (or ``run.budget_tokens``): unique tokens per micro-batch, None for one
    micro-batch. ``temperature`` T: of ``softmax(logits / T)``. Every check runs before any
    compute.
    """
    return forest_row_readout(
        model, forest, predictor, target, None, run=run, budget_tokens=budget_tokens, temperature=temperature
    )


def forest_row_readout(
    model: nn.Module,
    forest: Forest,
    predictor,
    target,
    readout: Readout | None,
    *,
    run: RunConfig | None = None,
    budget_tokens: int | None = None,
    temperature: float = 1.0,
) -> RowLogprobs:
    """:func:`forest_row_logprobs` with any :class:`~harts.runtime.readout.Readout` (None: the
    model's log-probs): a critic's values or a reward model's scores at the rows' predictors come
    from the same forward-only pass, in ``logprob`` (``entropy`` then holds zeros)."""
    start = time.perf_counter()
    run = RunConfig.resolve(run, budget_tokens)
    temperature = check_temperature(temperature)
    wrapped, model = model, forward_only_model(model)
    check_inputs(model, forest)
    readout = readout_for(model, readout, temperature)
    predictor, target = check_rows(forest, predictor, target, readout)
    if run.verify:
        _verify(wrapped, model, forest, run, readout, temperature)
        run = run.unverified
    gathered = forward_only_step(wrapped, run.fsdp_overlap)
    with torch.no_grad(), gathered as (_, sharded), run_backend(run, model):
        parts = StepParts(model, forest, predictor, target, None, run, PartObserver(), readout, sharded)
        with image_features_once(model, forest):
            run_schedule(parts, parts.schedule(LossForm.NONE))
    timings = {
        "plan": parts.clock.seconds["plan"] + parts.layout_seconds,
        "handoff": parts.clock.seconds["handoff"],
        "total": time.perf_counter() - start,
    }
    return RowLogprobs(
        parts.logp, parts.ent, len(parts.sizes), parts.plan.num_cuts, parts.sizes, parts.forwards, timings
    )


def _verify(
    wrapped: nn.Module, model: nn.Module, forest: Forest, run: RunConfig, readout: Readout, temperature: float
) -> None:
    """``run.verify``'s check of a forward-only pass: the sample's values against the stock forward."""
    dp = data_parallel(wrapped)
    if dp is not None and dp.kind == "fsdp":
        raise ValueError(FSDP_VERIFY)

    def harts_rows(on, sub: Forest, predictor: Tensor, target: Tensor, loss, sample_run: RunConfig) -> Tensor:
        return forest_row_readout(
            wrapped if on is None else on,
            sub,
            predictor,
            target,
            readout_on(readout, model, on),
            run=sample_run,
            temperature=temperature,
        ).logprob

    verify_sample(
        model,
        forest,
        run=run,
        harts_rows=harts_rows,
        readout=readout,
        temperature=temperature,
        gradients=False,
        what="a forward-only pass",
    )


def forest_and_masks(
    inputs, share_prefixes: bool, model: nn.Module | None = None
) -> tuple[Forest, list | None]:
    """The forest of ``inputs`` and, for rollouts, their loss masks (None where absent). Rollouts
    with images need the multimodal ``model`` they run on (:func:`harts.image_forest`)."""
    if isinstance(inputs, Forest):
        if not share_prefixes:
            raise ValueError(
                "share_prefixes applies to rollouts or token sequences; a Forest is already built"
            )
        return inputs, None
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"expected a harts Forest, a sequence of harts.Rollout or a sequence of token-id sequences, "
            f"got {type(inputs).__name__}"
        )
    if inputs and all(hasattr(r, "tokens") for r in inputs):  # harts.Rollout and the like
        masks = [getattr(r, "loss_mask", None) for r in inputs]
        if has_images(inputs):
            if model is None:
                raise ValueError("rollouts with images are run by forest_logprobs and the training step only")
            return image_forest(forward_only_model(model), inputs, share_prefixes), masks
        return build_forest(
            [r.tokens for r in inputs], share_prefixes, routed_experts=routes_of(inputs)
        ), masks
    return build_forest(inputs, share_prefixes), None


def _loss_positions(mask, index: int, length: int) -> np.ndarray:
    """Positions ``p >= 1`` where a rollout's loss mask is set (every one for no mask)."""
    if mask is None:
        return np.arange(1, length)
    if isinstance(mask, Tensor):
        mask = mask.detach().cpu().numpy()
    arr = np.asarray(mask)
    if arr.shape != (length,):
        raise ValueError(
            f"trajectory {index}: loss_mask has shape {arr.shape}, but the trajectory has {length} tokens"
        )
    if arr.dtype != bool and not np.isin(arr, (0, 1)).all():
        raise ValueError(f"trajectory {index}: loss_mask must hold 0/1 or booleans")
    return np.flatnonzero(arr.astype(bool)[1:]) + 1


def forest_logprobs(
    model: nn.Module,
    inputs,
    *,
    run: RunConfig | None = None,
    budget_tokens: int | None = None,
    temperature: float = 1.0,
    entropies: bool = False,
    loss_positions_only: bool = False,
    share_prefixes: bool = True,
    fill: float = 0.0,
) -> ForestLogprobs:
    """Per-trajectory log-probs (and entropies) of ``model``, forward only, under a token budget.

    ``inputs``: a :class:`harts.Forest`, a sequence of :class:`harts.Rollout` (anything with
    ``tokens``), or a sequence of token-id sequences; rollouts and sequences are merged by common
    prefix (``share_prefixes=False``: each its own root, the flat layout). ``run`` /
    ``budget_tokens``: the micro-batches, as for :func:`harts.forest_backward` (None: one).
    ``temperature`` T: of ``softmax(logits / T)``, the distribution a sampler at T drew from.
    ``entropies``: also return each position's entropy. ``loss_positions_only``: score only the
    positions of each rollout's ``loss_mask`` (the ones an objective reads; the head then runs
    only there), others holding ``fill``.

    Returns :class:`ForestLogprobs`: ``logprobs[i]`` [L_i] aligned with trajectory ``i``'s tokens,
    position 0 (and every unscored position) ``fill``; ready for ``Rollout(...,
    ref_logprobs=...)`` or ``rollout_logprobs=...``. No autograd, whatever the grad mode
    (module docstring). Every check runs before any compute.
    """
    forest, masks = forest_and_masks(inputs, share_prefixes, model)
    lengths = forest.trajectory_length.tolist()
    if loss_positions_only:
        if masks is None:
            raise ValueError(
                "loss_positions_only needs rollouts (their loss_mask says which positions to score)"
            )
        positions = [_loss_positions(m, i, n) for i, (m, n) in enumerate(zip(masks, lengths, strict=True))]
    else:
        positions = [np.arange(1, n) for n in lengths]
    predictor, target = position_rows(forest, positions)
    with entry_point("forest_logprobs"):  # a failed check names the function the user called
        rows = forest_row_logprobs(
            model, forest, predictor, target, run=run, budget_tokens=budget_tokens, temperature=temperature
        )
    scatter = PositionScatter(lengths, positions, rows.logprob.device)
    return ForestLogprobs(
        scatter(rows.logprob, fill),
        scatter(rows.entropy, fill) if entropies else None,
        scatter.scored(),
        forest,
        rows,
    )


def position_rows(forest: Forest, positions: list[np.ndarray]) -> tuple[Tensor, Tensor]:
    """(predictor [R], target [R]) of the rows at ``positions[i]`` (each ``p >= 1``) of every
    trajectory ``i``: the unique token of position ``p - 1``, which reads position ``p``, and the
    token id at ``p``. A critic's value of position ``p`` is read there too (``V(h_{p-1})``)."""
    paths = [forest.trajectory_token_indices(i) for i in range(forest.num_trajectories)]
    pos = [torch.as_tensor(p, dtype=torch.long) for p in positions]
    predictor = torch.cat([path[p - 1] for path, p in zip(paths, pos, strict=True)])
    target = forest.tokens[torch.cat([path[p] for path, p in zip(paths, pos, strict=True)])]
    return predictor, target


class PositionScatter:
    """Row values (in the order of ``positions``, trajectory by trajectory) back to per-trajectory
    tensors [L_i], ``fill`` where no row was read."""

    def __init__(self, lengths: list[int], positions: list[np.ndarray], device):
        self.lengths, self.device = lengths, device
        offsets = np.concatenate([[0], np.cumsum(lengths)])[:-1].astype(np.int64)
        pairs = zip(offsets, positions, strict=True)
        where = np.concatenate([o + np.asarray(p, dtype=np.int64) for o, p in pairs])
        self.where = torch.as_tensor(where, device=device)

    def __call__(self, values: Tensor, fill: float) -> list[Tensor]:
        out = torch.full((sum(self.lengths),), fill, dtype=values.dtype, device=self.device)
        out[self.where] = values
        return list(torch.split(out, self.lengths))

    def scored(self) -> list[Tensor]:
        """[L_i] bool per trajectory: where a value was read."""
        scored = torch.zeros(sum(self.lengths), dtype=torch.bool)
        scored[self.where.cpu()] = True
        return list(torch.split(scored, self.lengths))
