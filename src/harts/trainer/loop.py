"""The training loop of ``harts train``: one optimizer step per group of rollouts from the file.

Each step: the next ``rollouts_per_step`` rollouts (whole groups) -> the forest and loss rows
(what :func:`harts.rollout_step` builds) -> advantages from the configured estimator, when the
rollouts carry rewards instead -> :func:`harts.forest_step` (forward and backward, every shared
token once) -> the gradients cast into the fp32 master weights (a bf16 or fp16 model) ->
gradient clipping -> optimizer step (of the masters, rounded back into the model) -> MoE bias
update (when asked) -> schedule step -> ``zero_grad``. The forward and backward of an update is
:func:`harts.trainer.policy_step.train_step`'s. With ``[reference]`` the step's reference
log-probs are computed first; with ``[ppo]`` its advantages and old log-probs are, and the step
of rollouts runs ``ppo.epochs`` x ``ppo.mini_batches`` such updates over mini-batches of whole
groups (:mod:`harts.trainer.ppo`); ``Position.step`` and the checkpoints count updates. With
``[critic]`` the critic's values and GAE's advantages and returns come first, and each policy
update is followed by the critic's (:mod:`harts.trainer.critic`).
Checkpoints every ``checkpoint.every`` steps and at the end (:mod:`harts.trainer.checkpoint`);
metrics of every step in ``OUT/metrics.jsonl``. What every run does alike (set-up, resume, save,
clip-and-step, metrics, progress, plot) is the run skeleton's (:class:`harts.trainer.run.Run`);
this module adds the rollout file, the reference and old log-prob passes, the critic, eval,
samples, LoRA and torchrun's ranks.

Resume is exact: the model, optimizer and scheduler states, the random states and the data
position are restored from the newest verified checkpoint, so the resumed run does the same
computations on the same data as an uninterrupted one and ends with bit-identical weights, on the
same machine with the same ``threads`` (floating-point reductions depend on the thread count).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch

from harts.adapters import adapter_for
from harts.adapters.base import MoEBalancing
from harts.forest import Forest
from harts.objectives.moe import MoEConfig
from harts.objectives.rollout import Rollout
from harts.runtime.backward import StepResult
from harts.runtime.routers import find_routers
from harts.runtime.verify import Verification
from harts.runtime.verify_sharded import low_precision_refusal
from harts.steps.router_statistics import resolve_aux_coef
from harts.trainer.announcements import Announcements
from harts.trainer.checkpoint import Checkpoint
from harts.trainer.config import ObjectiveConfig, TrainConfig
from harts.trainer.critic import CRITIC_DIR, Critic
from harts.trainer.evaluation import Evaluation
from harts.trainer.images import check_image_run
from harts.trainer.inputs import (
    Position,
    check_data,
    check_embedding,
    data_stream,
    fingerprint,
    load_model,
    model_vocab_size,
    rng_state,
    seed_everything,
    set_rng_state,
)
from harts.trainer.logging_backends import check_backends
from harts.trainer.lora import attach_lora, save_adapter
from harts.trainer.optim import freeze_routers
from harts.trainer.policy_step import train_step
from harts.trainer.ppo import StepUpdates, load_reference, shard_reference, weights_sha256
from harts.trainer.processes import (
    full_model_state,
    rank_cost,
    save_state,
    start_ranks,
    wrap_model,
)
from harts.trainer.progress import MetricsLog
from harts.trainer.resume_notes import run_versions
from harts.trainer.rollout_stats import rollout_stats
from harts.trainer.routes_check import check_routes_fit
from harts.trainer.run import Run, TrainingDiverged, update_metrics
from harts.trainer.samples import SAMPLES, Samples
from harts.trainer.throughput import Throughput

__all__ = ["train", "TrainingDiverged"]


def _record(
    step: int,
    epoch: int,
    result: StepResult,
    forest: Forest,
    grad_norm: float,
    lrs: dict,
    seconds: float,
    rollouts: list[Rollout],
    throughput: Throughput,
) -> dict:
    record = {"step": step, "epoch": epoch, **update_metrics(result, grad_norm, lrs)}
    record.update(
        rollouts=len(rollouts),
        micro_batches=result.num_micro_batches,
        recomputed_parts=len(result.recomputed_parts),
        seconds=seconds,
        **throughput.record(forest, rollouts, seconds),
        **rollout_stats(rollouts),
    )
    return record


class _Train(Announcements, Run):
    """One ``train`` call on the run skeleton: the rollout file, the reference and old log-prob
    passes (``[reference]``, ``[ppo]``), the critic (``[critic]``), eval and samples, LoRA, MoE
    balancing, torchrun's ranks."""

    command = "harts train"

    def __init__(self, config: TrainConfig, out: Path, log: TextIO, accept_changed_data: bool = False):
        d = config.distributed
        ranks = start_ranks(d.strategy, d.balance, d.timeout_s, config.model.device)
        super().__init__(config, out, log, ranks)
        self.accept_changed_data, self.data_changed = accept_changed_data, False
        self.current: StepUpdates | None = None  # the step of rollouts whose updates are running
        self.updated = False  # an update ran in this session (the first is verified by default)

    @property
    def step(self) -> int:
        return self.position.step

    def run(self, resume: bool) -> dict:
        start = self.setup(resume)
        step = self.position.step
        if start is not None and step == self.total:
            self.say(f"nothing to do: {start.path} is the final step")
            return {"steps": step, "checkpoint": str(start.path), "resumed_from": step}
        return self.loop(start)

    def setup(self, resume: bool) -> Checkpoint | None:
        start, state = self._check_inputs(resume)
        self._make_model(start, state)
        self._make_reference(start, state)
        frozen = self._place_model()
        split = self.build_optimizers(self.total)
        self._make_critic(start)
        self._make_step_configs()
        self._restore(start, state)
        self._describe(start, split, frozen)
        return start

    def _check_inputs(self, resume: bool) -> tuple[Checkpoint | None, dict | None]:
        """Everything checked that can be before a model is built: the whole rollout file (against
        the model's vocabulary and the objective's fields), the checkpoint resumed from, the logging
        backends' packages, the eval and sample files, what torchrun's ranks cannot run."""
        config = self.config
        self.data_check = check_data(
            config.data,
            config.objective,
            model_vocab_size(config.model),
            reference=config.reference is not None,
            ppo=config.ppo,
        )
        if self.data_check.images is not None:  # the multimodal model, and only what runs exactly with images
            check_image_run(config, self.data_check.images[1], distributed=self.ranks is not None)
        self.steps_per_epoch = self.data_check.steps
        # optimizer updates: ppo.epochs x ppo.mini_batches per step of rollouts
        self.total = (config.steps or (config.epochs or 1) * self.steps_per_epoch) * config.updates_per_step
        self.data_print = {
            **fingerprint(config.data.path),
            "rollouts": self.data_check.rollouts,
            "steps_per_epoch": self.steps_per_epoch,
        }
        start, state = self.resume_point(resume)
        if state is not None:
            self._check_resume(start, state)
        check_backends(config.logging.writers)  # a missing package refused before the model loads
        self.evaluation = Evaluation(config, model_vocab_size(config.model)) if config.eval else None
        self.samples = Samples(config, model_vocab_size(config.model)) if config.samples else None
        self.verifying = config.run.verify != "never"
        return start, state

    def _make_model(self, start: Checkpoint | None, state: dict | None) -> None:
        """The policy: ``[model]`` (or the checkpoint's weights), with its LoRA adapters under ``[lora]``."""
        config = self.config
        seed_everything(config.seed)
        # a LoRA run's checkpoints hold the adapter: its base comes from [model] again
        from_checkpoint = start.path if start and config.lora is None else None
        images = self.data_check.images is not None  # then the multimodal model, its vision tower trained
        self.model = load_model(config.model, config.seed, from_checkpoint, images=images)
        check_embedding(self.model, self.data_check)
        check_routes_fit(self.model, self.data_check.routes)
        self.base_sha256 = None
        if config.lora is not None:
            recorded = (state or {}).get("lora", {}).get("base_sha256") if state is not None else None
            self.model, self.base_sha256 = attach_lora(
                self.model, config.lora, recorded, start.path.name if start else ""
            )

    def _make_reference(self, start: Checkpoint | None, state: dict | None) -> None:
        """The KL term's reference (``[reference]``): loaded, fingerprinted whole, then sharded as the
        policy is; on a resume its weights must be those the run started with."""
        config = self.config
        self.reference, self.reference_sha256 = None, None
        if config.reference is None:
            return
        self.reference = load_reference(config.reference, config.model, config.seed)
        self.reference_sha256 = weights_sha256(self.reference)  # of the whole weights, before sharding
        self.reference = shard_reference(self.reference, self.ranks)
        recorded = (state or {}).get("reference", {}).get("sha256")
        if state is not None and recorded != self.reference_sha256:
            raise ValueError(
                f"reference.model = {config.reference.model!r}: its weights (sha256 "
                f"{self.reference_sha256}) "
                f"are not those {start.path.name} was trained against (sha256 {recorded}): the KL term "
                f"would change; restore the reference the run started with"
            )

    def _place_model(self) -> list[str]:
        """The policy as the step runs it: routers frozen (``optimizer.freeze_router``; the frozen
        ones returned), wrapped by DDP or sharded by FSDP2 under torchrun."""
        frozen = freeze_routers(self.model) if self.config.optimizer.freeze_router else []
        self.wrapped = self.model
        self.throughput = Throughput(self.model, self.ranks.world_size if self.ranks is not None else 1)
        if self.ranks is not None:  # DDP wraps the model; FSDP2 shards it in place
            self.ranks = dataclasses.replace(self.ranks, cost=rank_cost(self.model))  # before sharding
            self.wrapped = wrap_model(self.model, self.ranks)
            reason = self._sharded_verify_refusal() if self.ranks.strategy == "fsdp" else None
            if self.verifying and reason is not None:  # what the sharded check does not run
                self.verifying = False
                self.say(f"run.verify: not here: {reason}")
        return frozen

    def _sharded_verify_refusal(self) -> str | None:
        """Why the sharded check cannot run on this FSDP2 run, or None: its precision
        (:func:`~harts.runtime.verify_sharded.low_precision_refusal`), or LoRA, whose peft wrapper
        runs the stock forward with plain adapter weights beside the sharded ones."""
        if self.config.lora is not None:
            return (
                "under FSDP2 the check does not run a LoRA (peft) model's stock forward; verify with "
                'strategy = "ddp" or on one process'
            )
        return low_precision_refusal(self.model)

    def _make_critic(self, start: Checkpoint | None) -> None:
        """The value model beside the policy (``[critic]``), from the checkpoint on a resume."""
        config = self.config
        self.critic = None
        if config.critic is None:
            return
        saved = start.path / CRITIC_DIR if start is not None else None
        if saved is not None and not saved.is_dir():
            raise ValueError(
                f"critic: {start.path.name} holds no critic (the run started without "
                f"[critic]): resume with the config the run started with"
            )
        self.critic = Critic(config, self.total, saved, self.ranks)

    def _make_step_configs(self) -> None:
        """What every update runs under: the loss, the RunConfig, the MoE statistics and balancing."""
        config = self.config
        self.loss_config = config.objective.loss_config()
        self.run_config = config.run.run_config()
        self.moe = None
        if not config.moe.enabled:
            return
        self.moe = MoEConfig(aux_loss_coef=config.moe.aux_loss_coef)
        try:
            resolve_aux_coef(self.moe, self.model)
        except ValueError as exc:
            raise ValueError(f"moe: {exc}") from None
        if config.moe.bias_update_speed:
            if adapter_for(self.model).moe_balancing is not MoEBalancing.BIAS:
                raise ValueError(
                    f"moe.bias_update_speed: {self.model.config.model_type} balances its "
                    f"experts with an auxiliary loss, not a router bias"
                )
            adapter = adapter_for(self.model)
            self.router_biases = [
                adapter.balancing_bias(self.model, layer, router)
                for layer, router in find_routers(self.model)
            ]

    def _restore(self, start: Checkpoint | None, state: dict | None) -> None:
        """The position, optimizers, random states and, between two updates of a step of rollouts, its
        saved old log-probs and critic values from the checkpoint (a fresh run: the start)."""
        self.position = Position()
        self.saved_old, self.saved_values = None, None
        if start is None:
            return
        trainer = self.restore_optimizers(start)
        set_rng_state(trainer["rng"])
        self.position = Position(**state["position"])
        self.saved_old = trainer.get("old_logprobs") if self.position.within_step else None
        if self.critic is not None:
            self.critic.load_state_dict(trainer.get("critic"), start.path)
            self.saved_values = trainer.get("critic_values") if self.position.within_step else None
        if self.data_changed and self.position.within_step:
            self.say(
                f"{start.path.name} is between two updates of a step of rollouts: on the changed "
                f"file that step starts over from its first update"
            )
            self.position.ppo_epoch = self.position.mini_batch = 0
            self.saved_old = self.saved_values = None
        if self.data_changed and self.position.fit(self.steps_per_epoch):
            self.say(
                f"the changed file has {self.steps_per_epoch} steps per epoch: continuing at the "
                f"start of epoch {self.position.epoch}"
            )

    def prepare(self, rollouts: list[Rollout]) -> StepUpdates:
        """The step of rollouts at the run's position, ready for its updates (reference and old
        log-probs, advantages); between two of its updates (a resume) with the saved old log-probs."""
        saved, self.saved_old = self.saved_old, None
        values, self.saved_values = self.saved_values, None
        with self.numbered():
            return StepUpdates(
                self.config,
                self.wrapped,
                self.reference,
                self.run_config,
                rollouts,
                saved,
                self.critic,
                values,
                self.ranks,
            )

    def update(
        self, rollouts: list[Rollout], objective: ObjectiveConfig
    ) -> tuple[StepResult, Forest, float, dict, Verification | None]:
        verify = self.verifying and self.config.run.verifies(self.step + 1, not self.updated)
        with self.numbered():
            result, forest, report = train_step(
                self.wrapped,
                rollouts,
                objective,
                self.loss_config,
                self.run_config,
                self.moe,
                self.ranks,
                verify,
            )
        self.updated = True
        if report is not None:
            whose = "the step" if not self.ranks else "this rank's trees"
            if self.ranks and self.ranks.strategy == "fsdp":  # every rank checks rank 0's sample
                whose = "rank 0's trees"
            low = ""
            if report.kernel_ratio is not None:  # low precision: the algorithm at fp32, the kernels
                low = (
                    f"; at fp32 gradients at {report.algorithm_gradient_ratio:.2g} of their bounds, "
                    f"attention kernels at {report.kernel_ratio:.2g} of theirs"
                )
            self.say(
                f"step {self.step + 1} verified against the stock forward ({report.precision}, "
                f"trajectories {list(report.trajectories)} of {whose}, "
                f"{report.tokens} tokens): worst log-prob {report.value_error:.2g} from the truth "
                f"(bound {report.value_bound:.2g}), gradients at {report.gradient_ratio:.2g} of their "
                f"bounds{low}; {report.seconds:.2f} s"
            )
        grad_norm, lrs = self.clip_and_step(result)
        return result, forest, grad_norm, lrs, report

    def updates(self) -> Iterator[dict]:
        position = self.position
        samples = MetricsLog(self.out / SAMPLES, position.step) if self.main and self.samples else None
        stream = data_stream(self.config.data, position.epoch, position.index)
        try:
            while position.step < self.total:
                yield from self._updates_of(*next(stream), samples)
        finally:
            if samples is not None:
                samples.close()

    def _updates_of(
        self, epoch: int, index: int, rollouts: list[Rollout], samples: MetricsLog | None
    ) -> Iterator[dict]:
        """The updates of one step of rollouts (``ppo.epochs`` x ``ppo.mini_batches`` with ``[ppo]``,
        else one), from the run's position in it, each with its eval and samples when due."""
        config, position = self.config, self.position
        self.current = step = self.prepare(rollouts)
        passes = step.seconds
        self.session += passes
        for update in step.updates(config.seed, epoch, index, (position.ppo_epoch, position.mini_batch)):
            if position.step == self.total:
                return
            began = time.perf_counter()
            result, forest, grad_norm, lrs, verified = self.update(update.rollouts, step.objective)
            seconds = time.perf_counter() - began
            if verified is not None:  # the step's own time; the check's is its own figure
                seconds -= verified.seconds
                self.session += verified.seconds
            critic = None
            if self.critic is not None:
                with self.numbered():
                    critic = self.critic.update(update.rollouts, position.step + 1)
                self.session += critic["critic_seconds"]
            self.session += seconds
            position.advance(
                len(update.rollouts),
                forest.num_tokens,
                forest.num_flat_tokens,
                seconds,
                self.steps_per_epoch,
                config.ppo,
            )
            record = _record(
                position.step,
                epoch,
                result,
                forest,
                grad_norm,
                lrs,
                seconds,
                update.rollouts,
                self.throughput,
            )
            if config.ppo is not None:
                record.update(ppo_epoch=update.ppo_epoch, mini_batch=update.mini_batch)
            if verified is not None:
                record.update(
                    verify_seconds=verified.seconds,
                    verify_logprob_error=verified.value_error,
                    verify_logprob_bound=verified.value_bound,
                    verify_gradient_ratio=verified.gradient_ratio,
                )
            if critic is not None:
                record.update(critic)
            if config.ppo is not None or config.reference is not None or critic is not None:
                record["passes_seconds"] = passes  # before the step's first update, once
                passes = 0.0
            if self.evaluation is not None and self.evaluation.due(position.step, self.total):
                record.update(self.evaluation(self.wrapped, self.reference, self.ranks))
            if self.samples is not None and self.samples.due(position.step, self.total):
                # every rank calls it: rank 0 alone generates under DDP, every rank under FSDP2
                for line in self.samples(self.model, position.step, self.ranks):
                    if samples is not None:
                        samples.write(line)
            yield record

    def checkpoint_state(self) -> dict:
        state = {
            "position": self.position.to_dict(),
            "total_steps": self.total,
            "threads": torch.get_num_threads(),
            "data": {"path": str(self.config.data.path), **self.data_print},
            "versions": run_versions(),
        }
        if self.reference_sha256 is not None:
            state["reference"] = {"model": self.config.reference.model, "sha256": self.reference_sha256}
        if self.base_sha256 is not None:
            state["lora"] = {"base_sha256": self.base_sha256}
        if self.ranks is not None:
            state["world_size"] = self.ranks.world_size
        return state

    def write_weights(self, directory: Path) -> None:
        save_state(directory, self.wrapped, self.optim)  # every rank: its shard of the state
        if self.critic is not None:
            self.critic.save(directory)
        whole = full_model_state(self.wrapped, self.ranks)
        if not self.main:
            return
        if self.config.lora is not None:
            save_adapter(self.model, directory, self.config.lora, whole)
        else:
            self.write_model(directory, whole)

    def trainer_state(self) -> dict:
        trainer = {
            "schedulers": self.optim.scheduler_state(),
            "rng": rng_state(),
            "params": self.param_names,
            "master_weights": self.optim.masters is not None,
        }
        if self.position.within_step and self.current is not None and self.current.old is not None:
            trainer["old_logprobs"] = self.current.old  # the weights that computed them are gone
        if self.critic is not None:
            trainer["critic"] = self.critic.state_dict()
            if self.position.within_step and self.current is not None:
                trainer["critic_values"] = self.current.values  # as the old log-probs
        return trainer


def train(
    config: TrainConfig,
    out: str | Path,
    resume: bool = False,
    log: TextIO | None = None,
    accept_changed_data: bool = False,
) -> dict:
    """Run ``config`` into ``out`` (``resume``: from its newest checkpoint); returns a summary.

    Progress goes to ``log`` (default: stderr). ``accept_changed_data``: a resume on a rollout file
    other than the checkpoint's continues from the checkpoint's position, saying what changed.

    Raises ValueError for bad input (before any step when it can be seen then), CheckpointError
    for a checkpoint that fails verification, :class:`TrainingDiverged` for a non-finite step;
    a KeyboardInterrupt leaves the last complete checkpoint as it is and propagates.
    """
    return _Train.execute(config, out, resume, log, accept_changed_data=accept_changed_data)
