"""What ``harts train`` tells its user: the lines that describe a run as it starts, where a
resume stands, an interruption, and the summary at its end. A part of the training loop
(:class:`harts.trainer.loop._Train` takes these methods), kept apart because it reads the run's
state and computes nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harts.adapters.base import registered_adapter
from harts.trainer.checkpoint import Checkpoint, list_checkpoints
from harts.trainer.critic import CRITIC_DIR
from harts.trainer.images import IMAGE_MODEL_LOADER
from harts.trainer.inputs import data_change
from harts.trainer.optim import ParameterSplit
from harts.trainer.resume_notes import resume_differences

__all__ = ["Announcements"]


class Announcements:
    """The messages of a training run (mixed into the loop's run class, whose state they read)."""

    def _describe(self, start: Checkpoint | None, split: ParameterSplit, frozen: list[str]) -> None:
        """The run's lines before its first update: ranks, model, data, reference, PPO, critic."""
        config = self.config
        if self.ranks is not None:
            self.say(
                f"{self.ranks.world_size} ranks ({self.ranks.strategy}, trees balanced by "
                f"{self.ranks.balance}, {torch.distributed.get_backend()})"
            )
        self.describe_model(split, frozen)
        steps = (
            f"{self.total // config.updates_per_step} steps, {self.total} optimizer updates"
            if config.ppo is not None
            else f"{self.total} steps"
        )
        self.say(
            f"data {config.data.path.name}: {self.data_check.rollouts} rollouts, {self.steps_per_epoch} "
            f"steps per epoch; {steps}; out {self.out}"
        )
        if config.reference is not None:
            ref = config.reference
            what = "the initial weights (a frozen copy)" if ref.initial else ref.model
            self.say(
                f"reference {what}: {ref.dtype or config.model.dtype}, "
                f"{ref.device or config.model.device}, eval, no grad; its log-probs computed before "
                f"each step's updates"
            )
        if config.ppo is not None:
            ppo = config.ppo
            old = (
                "computed with the weights before each step"
                if ppo.old_logprobs == "policy"
                else "from the file"
            )
            self.say(
                f"ppo: {ppo.epochs} epoch{'s' if ppo.epochs > 1 else ''} x {ppo.mini_batches} "
                f"mini-batch{'es' if ppo.mini_batches > 1 else ''} of whole groups per step: "
                f"{ppo.updates} optimizer updates per step; old log-probs {old}"
            )
        if self.critic is not None:
            source = (
                "the policy's starting weights, a fresh head"
                if config.critic.from_policy
                else config.critic.model
            )
            self.say(self.critic.describe(f"from {start.path.name}" if start else source))
        if (fields := self.data_check.extra_fields_line(config.data.path)) is not None:
            self.say(f"warning: {fields}")

    def _check_resume(self, start: Checkpoint, state: dict) -> None:
        change = data_change(
            state["data"], self.data_print, start.path.name, self.config.data.path, self.accept_changed_data
        )
        if change is not None:
            self.data_changed = True
            self.say(
                f"{change}; continuing from its position on the changed file (not the run an "
                f"uninterrupted one would give)"
            )
        if state["position"]["step"] > self.total:
            raise ValueError(f"{start.path.name} is past the run's {self.total} steps: raise steps or epochs")
        world = self.ranks.world_size if self.ranks is not None else 1
        for line in resume_differences(start, state, self.config, world):
            self.say(line)
        self.say(f"resuming from {start.path} (step {state['position']['step']})")

    def interrupted(self, terminated: bool = False) -> None:
        """One line: where the run stopped and the checkpoint to resume from. Stopped by SIGTERM
        under torchrun (another rank failed, or the job was stopped), every rank says it, naming
        itself, since rank 0 may be the one that failed."""
        done = list_checkpoints(self.root)  # published whole or not at all: the newest is complete
        where = f"the last complete checkpoint is {done[-1].path}" if done else "no checkpoint was written"
        how = "stopped by SIGTERM" if terminated else "interrupted"
        line = f"{how} at step {self.position.step}; {where} (continue with --resume)"
        if not (terminated and self.ranks is not None):
            self.say(line)
            return
        rank = f"rank {self.ranks.rank} of {self.ranks.world_size}"
        why = "under torchrun the ranks are stopped when one fails: its error, if any, is above"
        print(f"{self.command}: {rank}: {line}; {why}", file=self.log, flush=True)

    def finish(self, last: Path | None, first: int) -> dict:
        config, position, session = self.config, self.position, self.session
        redundancy = position.flat_tokens / max(position.unique_tokens, 1)
        unit = "optimizer updates" if config.ppo is not None else "steps"
        family = registered_adapter(self.model.config.model_type)
        loader = (
            IMAGE_MODEL_LOADER
            if self.data_check.images is not None
            else (family.auto_class if family is not None else "AutoModelForCausalLM")
        )
        loads = (
            f"{loader}.from_pretrained loads it"
            if config.lora is None
            else "the LoRA adapter: PeftModel.from_pretrained(base, dir) loads it"
        )
        if self.critic is not None:
            loads += f"; its critic in {CRITIC_DIR}/"
        self.say(
            f"done: {position.step} {unit}, {session:.1f} s; {position.unique_tokens:,} unique tokens "
            f"computed for {position.flat_tokens:,} flat ({redundancy:.2f}x); final model {last} "
            f"({loads})"
        )
        return {
            "steps": position.step,
            "checkpoint": str(last),
            "resumed_from": first,
            "seconds": session,
            "unique_tokens": position.unique_tokens,
            "flat_tokens": position.flat_tokens,
        }
