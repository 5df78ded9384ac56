"""The critic of ``harts train`` (``[critic]``): a value model trained beside the policy, for GAE.

Per step of rollouts (:class:`harts.trainer.ppo.StepUpdates`): the critic's value of every
position, forward only, under its budget (:func:`harts.forward_values`: the rollout-time values,
``Rollout.values``), then GAE's advantages and returns over the whole step
(:func:`harts.gae_advantages`, whitened over the step's rows, ``objective.advantage_params``
its ``gamma``, ``lam``, ``whiten``). Per optimizer update (the step, or each ``[ppo]``
mini-batch): the policy's update as without a critic, then the critic's
(:meth:`Critic.update`): :func:`harts.value_step` on the same rollouts (verl's clipped value loss
against the returns, anchored at the rollout-time values), its gradients clipped, its AdamW and
schedule stepped.

Why each piece is as it is:

- the values are computed once per step of rollouts, by the critic before the step's updates,
  and kept for all of them (verl computes them before its updates too); a checkpoint written
  between two updates of a step saves them, as it saves the old log-probs, since the weights
  that computed them are gone;
- ``"policy"`` loads the policy's starting weights again (the code that loads the policy, so the
  same bits) and puts a fresh scalar head on them, initialised from its own seed inside a forked
  RNG (the run's random state is left alone); the critic never shares a tensor with the policy;
- the head: where transformers has the family's ``*ForTokenClassification``, the critic is one
  (``num_labels = 1``, classifier dropout 0, as verl builds its critic), and a checkpoint's
  ``critic/`` is its ``save_pretrained`` directory, which stock
  ``AutoModelForTokenClassification.from_pretrained`` loads; elsewhere (``bailing_hybrid``, ...)
  it is :class:`harts.ValueHead` over the causal LM's backbone, and ``critic/`` holds the causal
  LM's ``config.json`` (``architectures = ["harts.ValueHead"]``) and ``model.safetensors`` (its
  state dict, ``model.*`` and ``score.*``), which ``safetensors.torch.load_model(
  harts.ValueHead(AutoModelForCausalLM.from_config(config)), path)`` loads;
- the critic trains in train mode like the policy (dropout 0: the model checks refuse an active
  one);
- on several ranks (torchrun) it is held as the policy is (DDP, or FSDP2 with each decoder layer
  its own unit): its values are computed by each rank for its own trees and exchanged once
  (:mod:`harts.trainer.rank_passes`), and each update runs ``value_step`` on the rank's trees of
  the update (the policy's assignment) with the whole update's normalisers, its gradients summed
  over the ranks;
- its optimizer state is saved with ``torch.distributed.checkpoint`` in ``critic/state`` (each rank
  its shard under FSDP2), so a run on any number of ranks resumes from it, one process included;
  its schedule in ``trainer_state.pt``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from pathlib import Path

import torch
from torch import nn

from harts.adapters import adapter_for
from harts.adapters.value_head import ValueHead
from harts.objectives.advantages import advantages_to_rollouts, gae_advantages
from harts.objectives.rollout import Rollout
from harts.objectives.values import ValueLossConfig
from harts.runtime.critic import forward_values
from harts.steps.policy import step_inputs
from harts.steps.value import value_step
from harts.trainer.config import ModelConfig, ObjectiveConfig, OptimizerConfig, TrainConfig
from harts.trainer.inputs import load_model, loading_options, own_memory, quiet_transformers
from harts.trainer.optim import build_optimizers
from harts.trainer.processes import Ranks, full_model_state, load_state, plain_class, save_state, wrap_model
from harts.trainer.rank_passes import over_ranks, rank_share
from harts.trainer.run import TrainingDiverged, clip_gradients, collective
from harts.trainer.sections import CriticSection

__all__ = [
    "Critic",
    "load_critic",
    "save_critic",
    "fresh_head",
    "with_gae",
    "CRITIC_DIR",
    "VALUE_HEAD_ARCHITECTURE",
]

#: a checkpoint's critic directory
CRITIC_DIR = "critic"
#: ``architectures`` of a :class:`harts.ValueHead` critic's ``config.json``
VALUE_HEAD_ARCHITECTURE = "harts.ValueHead"
_WEIGHTS = "model.safetensors"


@contextlib.contextmanager
def _quiet():
    """transformers' load warnings (a causal LM's unused ``lm_head``, the fresh ``score``) off."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with quiet_transformers():
            yield
    finally:
        hf_logging.set_verbosity(level)


def _token_classifier_exists(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    return config.model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES


def _as_critic_config(config):
    """A copy of ``config`` for a token-classifier critic: one label, classifier dropout 0 (verl's)."""
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


def _extra(dtype: torch.dtype) -> dict:
    # grouped_mm (the default experts kernel) has no fp64 path (as in harts.trainer.inputs.load_model)
    return {"experts_implementation": "eager"} if dtype == torch.float64 else {}


def fresh_head(lm: nn.Module, dtype: torch.dtype, seed: int) -> nn.Module:
    """``lm``'s backbone under a fresh scalar head: the family's token classifier, else a ValueHead."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)
    if not _token_classifier_exists(lm.config):
        return ValueHead(lm)
    config = _as_critic_config(lm.config)
    critic = AutoModelForTokenClassification.from_config(config, dtype=dtype, **_extra(dtype))
    getattr(critic, critic.base_model_prefix).load_state_dict(adapter_for(lm).backbone(lm).state_dict())
    return critic


def _from_causal_lm(path: Path, config, dtype: torch.dtype, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if _token_classifier_exists(config):  # stock: the backbone loaded, the score head initialised
        torch.manual_seed(seed)
        return AutoModelForTokenClassification.from_pretrained(
            path, config=_as_critic_config(config), dtype=dtype, **loading_options(dtype)
        )
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **loading_options(dtype))
    return fresh_head(lm, dtype, seed)


def _from_directory(path: Path, dtype: torch.dtype, seed: int) -> nn.Module:
    """A critic from ``path``: a harts ValueHead critic, a token classifier, or a causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        raise ValueError(f"critic.model: {path}: its config.json does not load ({exc})") from None
    architecture = (getattr(config, "architectures", None) or ["(none)"])[0]
    if architecture == VALUE_HEAD_ARCHITECTURE:
        from safetensors.torch import load_model as load_weights

        critic = ValueHead(AutoModelForCausalLM.from_config(config, dtype=dtype, **_extra(dtype)))
        load_weights(critic, path / _WEIGHTS, strict=True)
        return critic
    if architecture.endswith("ForTokenClassification"):
        if config.num_labels != 1:
            raise ValueError(
                f"critic.model: {path}: {architecture} with num_labels = {config.num_labels}; a "
                f"critic reads one value per position (num_labels = 1)"
            )
        return AutoModelForTokenClassification.from_pretrained(
            path, config=_as_critic_config(config), dtype=dtype, **loading_options(dtype)
        )
    if architecture.endswith("ForCausalLM"):
        return _from_causal_lm(path, config, dtype, seed)
    raise ValueError(
        f"critic.model: {path}: its architecture is {architecture}; expected a "
        f"*ForTokenClassification with num_labels = 1, a causal LM (*ForCausalLM: its backbone "
        f"gets a fresh value head) or the critic/ of a harts train checkpoint"
    )


def load_critic(
    section: CriticSection, policy: ModelConfig, seed: int, checkpoint: Path | None = None
) -> nn.Module:
    """The critic ``section`` names (``checkpoint``: a checkpoint's ``critic/`` instead), in
    ``section.dtype`` on ``section.device`` (default: the policy's), in train mode, its tensors in
    memory of their own (a resume computes the bits of the run that saved it)."""
    name = section.dtype or policy.dtype
    dtype = getattr(torch, name)
    head_seed = seed if section.seed is None else section.seed
    with torch.random.fork_rng(devices=[]), _quiet():  # the run's RNG is left alone
        if checkpoint is not None:
            critic = _from_directory(checkpoint, dtype, head_seed)
        elif section.from_policy and policy.path is not None:
            critic = _from_directory(policy.path, dtype, head_seed)
        elif section.from_policy:
            base = dataclasses.replace(policy, dtype=name, device="cpu", gradient_checkpointing=False)
            critic = fresh_head(load_model(base, seed), dtype, head_seed)
        else:
            critic = _from_directory(Path(section.model), dtype, head_seed)
    critic.to(section.device or policy.device)
    own_memory(critic)
    return critic.train()


def save_critic(critic: nn.Module, directory: Path, whole: dict | None = None) -> None:
    """``critic`` into ``directory`` (module docstring: what loads it); ``whole``: its state
    gathered from the ranks (an FSDP2-sharded critic), else read from the module."""
    if isinstance(critic, ValueHead):
        from safetensors.torch import save_file, save_model

        directory.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(critic.config)
        config.architectures = [VALUE_HEAD_ARCHITECTURE]
        config.save_pretrained(directory)
        if whole is None:
            save_model(critic, str(directory / _WEIGHTS), metadata={"format": "pt"})
        else:
            tensors = {k: v.detach().contiguous() for k, v in whole.items()}
            save_file(tensors, str(directory / _WEIGHTS), metadata={"format": "pt"})
        return
    with quiet_transformers(), plain_class(critic):
        critic.save_pretrained(directory, safe_serialization=True, state_dict=whole)


def with_gae(
    policy: nn.Module, rollouts: list[Rollout], values: list[torch.Tensor], objective: ObjectiveConfig
) -> list[Rollout]:
    """Copies of ``rollouts`` with the rollout-time ``values`` and GAE's advantages and returns over
    all of them (``objective.advantage_params``: ``gamma``, ``lam``, ``whiten``)."""
    if len(values) != len(rollouts):
        raise ValueError(f"the critic's values are for {len(values)} rollouts, the step has {len(rollouts)}")
    rollouts = [dataclasses.replace(r, values=v) for r, v in zip(rollouts, values, strict=True)]
    _, rows = step_inputs(policy, rollouts)
    if rows.has_advantage:
        raise ValueError(
            f"objective.advantage = {objective.advantage!r}, but the rollouts carry advantages "
            f"already: remove one of them"
        )
    advantages, returns = gae_advantages(rows, **objective.advantage_params)
    return advantages_to_rollouts(rollouts, rows, advantages, returns)


class Critic:
    """The run's critic: its model, optimizer and schedule (over the run's ``total`` updates),
    value loss and micro-batches; its values of a step and its update on an update's rollouts."""

    def __init__(
        self, config: TrainConfig, total: int, checkpoint: Path | None = None, ranks: Ranks | None = None
    ):
        section = self.section = config.critic
        self.ranks = ranks
        self.model = load_critic(section, config.model, config.seed, checkpoint)
        # DDP wraps it; FSDP2 shards it in place (the optimizer then steps the shards)
        self.wrapped = wrap_model(self.model, ranks) if ranks is not None else self.model
        optimizer = OptimizerConfig(
            kind="adamw",
            lr=section.lr,
            weight_decay=section.weight_decay,
            betas=section.betas,
            eps=section.eps,
            master_weights=config.optimizer.master_weights,
        )
        self.optim, self.split = build_optimizers(self.model, optimizer, config.schedule, total)
        self.param_names = [n for n, _ in self.split.decay + self.split.no_decay]
        self.loss = ValueLossConfig(clip=section.value_clip or None, aggregation=section.aggregation)
        run = config.run.run_config()
        self.run = dataclasses.replace(run, budget_tokens=section.budget_tokens or run.budget_tokens)
        clip = section.max_grad_norm if section.max_grad_norm is not None else config.max_grad_norm
        self.max_grad_norm = clip or math.inf

    def describe(self, source: str) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        dtype = next(self.model.parameters()).dtype
        clip = "unclipped" if self.loss.clip is None else f"clip {self.loss.clip:g}"
        return (
            f"critic {type(self.model).__name__} ({source}; {params / 1e6:.2f}M parameters, "
            f"{str(dtype).removeprefix('torch.')}, {next(self.model.parameters()).device}); "
            f"{self.split.describe()}, lr {self.section.lr:g}; value loss {clip}, "
            f"{self.loss.aggregation.value}; its values computed before each step's updates, its "
            f"update after each policy update"
        )

    def values(self, rollouts: list[Rollout], ranks: Ranks | None = None) -> list[torch.Tensor]:
        """The critic's value of every position of each rollout (``harts.forward_values``), on the
        CPU; with ``ranks``, each rank's trees computed there and exchanged once."""

        def compute(share: list[Rollout]) -> list[torch.Tensor]:
            return [v.detach().cpu() for v in forward_values(self.wrapped, share, run=self.run).values]

        return over_ranks(ranks, self.wrapped, self.run, rollouts, compute)

    def update(self, rollouts: list[Rollout], step: int) -> dict:
        """``value_step`` on ``rollouts`` (their returns and rollout-time values; on several ranks
        this rank's trees of them, the normalisers and gradients the whole update's), clipping,
        the optimizer and schedule step; the metrics of update ``step``."""
        began = time.perf_counter()
        if self.ranks is not None:
            rollouts = [rollouts[i] for i in rank_share(rollouts, self.ranks)]
        result = collective(value_step, self.wrapped, rollouts, self.loss, run=self.run)
        grad_norm = collective(clip_gradients, self.optim.take_gradients(), self.max_grad_norm)
        loss = float(result.loss)
        if not (math.isfinite(grad_norm) and math.isfinite(loss)):
            raise TrainingDiverged(
                f"step {step}: the critic's value loss {loss}, gradient norm "
                f"{grad_norm}: not finite; stopped before its update (the last "
                f"checkpoint is kept)"
            )
        lr = self.optim.lrs()["lr"]
        self.optim.step()
        self.optim.zero_grad()
        metrics = {
            name: float(result.metrics[name])
            for name in ("value_loss", "value_clip_fraction", "value_mean", "explained_variance")
        }
        return {
            **metrics,
            "critic_grad_norm": grad_norm,
            "critic_lr": lr,
            "critic_seconds": time.perf_counter() - began,
        }

    def save(self, directory: Path) -> None:
        """The critic into a checkpoint's ``directory/critic``: its optimizer state (and master
        weights) in ``critic/state`` by every rank, the model by the main one."""
        save_state(directory / CRITIC_DIR, self.wrapped, self.optim)
        whole = full_model_state(self.wrapped, self.ranks)
        if self.ranks is None or self.ranks.main:
            save_critic(self.model, directory / CRITIC_DIR, whole)

    def state_dict(self) -> dict:
        """What ``trainer_state.pt`` keeps of the critic: its schedule, whether it steps master
        weights, and the parameters it trains, by name (the optimizer state is in ``critic/state``)."""
        return {
            "schedulers": self.optim.scheduler_state(),
            "params": self.param_names,
            "master_weights": self.optim.masters is not None,
        }

    def load_state_dict(self, state: dict | None, checkpoint: Path) -> None:
        """Restore what :meth:`save` and :meth:`state_dict` wrote into ``checkpoint``, resharded to
        this run's ranks (a checkpoint that kept the optimizer in ``state["optimizers"]`` too)."""
        name = checkpoint.name
        if state is None:
            raise ValueError(
                f"critic: {name} holds no critic state: resume with the config the run started with"
            )
        if state["params"] != self.param_names:
            differ = sorted(set(state["params"]) ^ set(self.param_names))[:3]
            raise ValueError(
                f"critic: {name}'s critic optimizer trained other parameters (they differ "
                f"in {', '.join(differ) or 'order'})"
            )
        try:
            if "optimizers" in state:
                self.optim.load_state_dict(state["optimizers"])
                return
            self.optim.check_masters(state.get("master_weights", False))
            load_state(checkpoint / CRITIC_DIR, self.wrapped, self.optim)
            self.optim.own_memory()
            self.optim.load_scheduler_state(state["schedulers"])
        except ValueError as exc:
            raise ValueError(f"critic: {exc}") from None
