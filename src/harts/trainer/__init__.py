"""``harts train``: a training run from a TOML config, on top of :func:`harts.rollout_step`'s step.

The layer above ``steps`` and ``data``: it owns what a run needs beyond one step (config,
optimizers and schedules, the loop, checkpoints that survive a kill, progress and metrics).

- ``config``: the TOML file as typed, validated dataclasses (``load_config``); ``toml_sections``: the
  reading, type checking and errors under it (shared with ``harts rl``);
- ``optim``: AdamW, or Muon on hidden matrices and AdamW on the rest; router freezing; schedules;
- ``inputs``: the model, the data stream and position, the random states;
- ``checkpoint``: atomic checkpoint directories with a manifest, verified before loading;
- ``progress``: the progress line, ``metrics.jsonl``, the plot; ``logging_backends``: TensorBoard, wandb;
- ``lora``: LoRA adapters (peft); ``sections``: the config sections only ``harts train`` has (``[moe]``,
  ``[distributed]``, ``[reference]``, ``[ppo]``, ``[lora]``, ``[eval]``, ``[samples]``, ``[critic]``);
- ``ppo``: the reference and old log-prob passes, PPO's mini-batches; ``critic``: the value model
  beside the policy (its values, GAE, its update, its checkpoint form);
- ``run``: the run skeleton ``harts train`` and ``harts rl`` share (set-up, resume, save, clip-and-step,
  metrics, progress, plot);
- ``loop``: ``train(config, out, resume)``; ``command``: the ``harts train`` command line.

Guide and config reference: ``docs/training.md``.
"""

from harts.trainer.config import TrainConfig
from harts.trainer.config_files import load_config
from harts.trainer.loop import train

__all__ = ["TrainConfig", "load_config", "train"]
