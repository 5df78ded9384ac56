"""The trainer's own log-prob passes and PPO's several updates per step of rollouts.

A PPO or GRPO step reads three log-probs per token: the policy's (with autograd, the update),
the old policy's (the ratio's denominator) and the reference's (the KL term). A rollout file
need not carry the last two: ``[reference]`` and ``[ppo]`` make the trainer compute them with
:func:`harts.forest_logprobs`, forward only, under the run's token budget, every shared prefix
once, aligned one value per token as a :class:`harts.Rollout`'s ``ref_logprobs`` and
``old_logprobs``. The loss then reads them as it reads a file's (nothing else changes); the
file's ``rollout_logprobs`` stay the behaviour policy's (the engine's), which an importance
correction (``objective.correction``) weighs against the old ones.

Why each piece is as it is:

- the reference is a separate model in eval mode without gradients (``"initial"``: the run's
  starting weights, loaded by the same function as the policy, so they are the same bits). A
  resume loads it again from its source, and refuses to go on when its weights' sha256 differs
  from the one the run recorded (the source changed), since the KL term would then differ;
- the old log-probs of a step are computed once, with the weights before its first update, and
  kept for all its updates; a checkpoint written between two updates of one step saves them,
  since the weights that computed them are gone by then;
- advantages are estimated once per step of rollouts on all of it (an estimator may read every
  group: ``tree`` mixes the rewards of groups that share a node) and handed to the mini-batches
  per token (:func:`harts.objectives.advantages.advantages_to_rollouts`); with ``[critic]``,
  GAE's from the critic's values of the step, computed once before its first update
  (:mod:`harts.trainer.critic`), which a checkpoint between two updates saves as it saves the
  old log-probs;
- on several ranks (torchrun) each rank runs these passes on its own trees of the step (the
  reference sharded like the policy under FSDP2, a whole frozen copy under DDP) and the ranks
  exchange the results once (:mod:`harts.trainer.rank_passes`), so every rank holds the whole
  step's values: the estimate and the mini-batches read them as on one process, and each
  mini-batch's trees are then divided over the ranks by the step;
- mini-batches hold whole groups, shuffled by a generator seeded from (seed, the step's place in
  the file, the PPO epoch) only, so an update's mini-batch is the same in a resumed run without
  any random state to restore.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from harts.objectives.advantages import advantages_to_rollouts, estimate_advantages
from harts.objectives.rollout import Rollout
from harts.runtime.config import RunConfig
from harts.runtime.forward_only import forest_logprobs
from harts.steps.policy import step_inputs
from harts.trainer.config import ModelConfig, ObjectiveConfig, PPOSection, ReferenceSection, TrainConfig
from harts.trainer.critic import Critic, with_gae
from harts.trainer.inputs import group_spans, load_model
from harts.trainer.processes import Ranks, fsdp_shard
from harts.trainer.rank_passes import over_ranks

__all__ = [
    "load_reference",
    "shard_reference",
    "weights_sha256",
    "with_logprobs",
    "with_advantages",
    "mini_batches",
    "Update",
    "StepUpdates",
]


def load_reference(reference: ReferenceSection, model: ModelConfig, seed: int) -> nn.Module:
    """The frozen reference: the run's starting weights (``"initial"``) or a local directory, in
    ``reference.dtype`` on ``reference.device`` (default: the policy's), eval mode, no gradients."""
    config = dataclasses.replace(
        model,
        dtype=reference.dtype or model.dtype,
        device=reference.device or model.device,
        gradient_checkpointing=False,
    )
    if not reference.initial:
        config = dataclasses.replace(config, path=Path(reference.model), tiny=None, seed=None)
    with torch.random.fork_rng(devices=[]):  # a tiny model's init seeds torch: leave the run's RNG alone
        ref = load_model(config, seed)
    ref.eval().requires_grad_(False)
    return ref


def shard_reference(reference: nn.Module, ranks: Ranks | None) -> nn.Module:
    """The reference as the policy is held on ``ranks``: under FSDP2 sharded the same way (each
    decoder layer, then the model: a rank keeps about 1/N of it, its passes gather one layer at a
    time); under DDP (or one process) the whole frozen copy (no gradients to synchronise)."""
    return fsdp_shard(reference) if ranks is not None and ranks.strategy == "fsdp" else reference


def weights_sha256(model: nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes): what a resume compares
    to know the reference it loaded is the one the run started with."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def with_logprobs(
    model: nn.Module,
    rollouts: list[Rollout],
    field: str,
    run: RunConfig,
    temperature: float,
    ranks: Ranks | None = None,
) -> list[Rollout]:
    """Copies of ``rollouts`` whose ``field`` (``ref_logprobs`` or ``old_logprobs``) holds
    ``model``'s log-probs at their loss positions (0 elsewhere), forward only, under ``run``'s
    budget, at the objective's sampling temperature; with ``ranks``, each rank scores its own
    trees and every rank gets all (:func:`~harts.trainer.rank_passes.over_ranks`)."""

    def compute(share: list[Rollout]) -> list[torch.Tensor]:
        out = forest_logprobs(model, share, run=run, temperature=temperature, loss_positions_only=True)
        return [lp.cpu() for lp in out.logprobs]

    logprobs = over_ranks(ranks, model, run, rollouts, compute)
    return [dataclasses.replace(r, **{field: lp}) for r, lp in zip(rollouts, logprobs, strict=True)]


def with_advantages(model: nn.Module, rollouts: list[Rollout], objective: ObjectiveConfig) -> list[Rollout]:
    """Copies of ``rollouts`` with the advantages ``objective.advantage`` estimates over all of them."""
    forest, rows = step_inputs(model, rollouts)
    if rows.has_advantage:
        raise ValueError(
            f"objective.advantage = {objective.advantage!r}, but the rollouts carry advantages "
            f"already: remove one of them"
        )
    rows = estimate_advantages(rows, objective.advantage, forest, **objective.advantage_params)
    return advantages_to_rollouts(rollouts, rows, rows.advantage)


def mini_batches(
    rollouts: list[Rollout], count: int, seed: int, epoch: int, index: int, ppo_epoch: int
) -> list[list[Rollout]]:
    """``count`` mini-batches of whole groups: the step's groups (file ``epoch``, step ``index``)
    permuted by a generator seeded from (``seed``, ``epoch``, ``index``, ``ppo_epoch``) alone, then
    cut into ``count`` runs of consecutive groups whose numbers differ by at most one."""
    spans = group_spans(rollouts)
    if count > len(spans):
        raise ValueError(f"ppo.mini_batches = {count}, but the step has {len(spans)} groups")
    order = np.random.default_rng([seed, epoch, index, ppo_epoch]).permutation(len(spans))
    return [[rollouts[i] for g in part for i in spans[g]] for part in np.array_split(order, count)]


def _check_behaviour(rollouts: list[Rollout], correction: str) -> None:
    """Every rollout carries the engine's log-probs, which ``correction`` weighs the old ones against."""
    for i, r in enumerate(rollouts):
        if r.rollout_logprobs is None:
            raise ValueError(
                f"objective.correction = {correction!r} needs the sampler's log-probs "
                f"(rollout_logprobs) on every line, and rollout {i} of the step has "
                f"none"
            )


@dataclass
class Update:
    """One optimizer update of a step of rollouts: its place (PPO epoch, mini-batch) and rollouts."""

    ppo_epoch: int
    mini_batch: int
    rollouts: list[Rollout]


class StepUpdates:
    """A step of rollouts made ready for its updates: reference log-probs, the critic's values and
    GAE, advantages and old log-probs computed (the old log-probs and values taken from
    ``saved_old`` and ``saved_values`` when resuming between updates), then :meth:`updates` from
    PPO epoch ``start[0]``, mini-batch ``start[1]`` on."""

    def __init__(
        self,
        config: TrainConfig,
        policy: nn.Module,
        reference: nn.Module | None,
        run: RunConfig,
        rollouts: list[Rollout],
        saved_old: list[torch.Tensor] | None = None,
        critic: Critic | None = None,
        saved_values: list[torch.Tensor] | None = None,
        ranks: Ranks | None = None,
    ):
        began = time.perf_counter()
        temperature = config.objective.temperature
        self.ppo: PPOSection | None = config.ppo
        self.objective = config.objective
        self.old: list[torch.Tensor] | None = None  # what a checkpoint between updates saves
        self.values: list[torch.Tensor] | None = None  # the critic's, saved there too
        if reference is not None:
            rollouts = with_logprobs(reference, rollouts, "ref_logprobs", run, temperature, ranks)
        if critic is not None:
            self.values = critic.values(rollouts, ranks) if saved_values is None else saved_values
            rollouts = with_gae(policy, rollouts, self.values, config.objective)
            self.objective = dataclasses.replace(config.objective, advantage=None, advantage_params={})
        if self.ppo is not None:
            if self.objective.advantage is not None:
                rollouts = with_advantages(policy, rollouts, config.objective)
                self.objective = dataclasses.replace(config.objective, advantage=None, advantage_params={})
            loss = config.objective.loss_config()
            if self.ppo.old_logprobs == "policy" and loss.policy_loss.needs_behaviour_logprobs:
                if loss.needs_old_logprobs:  # before the pass: a correction weighs them against these
                    _check_behaviour(rollouts, loss.correction.value)
                if saved_old is None:
                    rollouts = with_logprobs(policy, rollouts, "old_logprobs", run, temperature, ranks)
                else:
                    if len(saved_old) != len(rollouts):
                        raise ValueError(
                            f"the checkpoint's old log-probs are for {len(saved_old)} rollouts, "
                            f"the step has {len(rollouts)}"
                        )
                    rollouts = [
                        dataclasses.replace(r, old_logprobs=lp)
                        for r, lp in zip(rollouts, saved_old, strict=True)
                    ]
                self.old = [r.old_logprobs for r in rollouts]
        self.rollouts = rollouts
        self.seconds = time.perf_counter() - began  # the forward-only passes and the estimate

    def updates(self, seed: int, epoch: int, index: int, start: tuple[int, int] = (0, 0)) -> Iterator[Update]:
        """The step's updates in order from ``start``; the whole step once without ``[ppo]``."""
        if self.ppo is None:
            yield Update(0, 0, self.rollouts)
            return
        seed = self.ppo.shuffle_seed if self.ppo.shuffle_seed is not None else seed
        for e in range(start[0], self.ppo.epochs):
            parts = mini_batches(self.rollouts, self.ppo.mini_batches, seed, epoch, index, e)
            for m in range(start[1] if e == start[0] else 0, self.ppo.mini_batches):
                yield Update(e, m, parts[m])
