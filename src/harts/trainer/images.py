"""A ``harts train`` run on rollouts with images: what it loads, and what it refuses before any compute.

When the rollout file's lines carry images (docs/rollout_files.md), the policy is loaded as its
multimodal model (``AutoModelForImageTextToText``: ``Qwen3_5ForConditionalGeneration``, ...), so
the step runs the stock vision tower on the forest's distinct images and trains it with the rest;
the text causal LM that a run without images loads would have no tower to read the images with.
A model that cannot take images is refused before it loads, naming ``[model]``.

Sections whose passes have not been checked exact with images are refused, naming the section,
rather than run approximately or with the images dropped: a reference, a critic, LoRA adapters,
PPO's old log-probs, an eval or samples file, and several processes (torchrun).
``run.verify`` checks the update with its images: the sample's stock forward takes each
trajectory's screenshots, and the vision tower's gradients are compared with the rest
(:mod:`harts.runtime.verify_images`).
"""

from __future__ import annotations

from harts.adapters import adapter_for_type
from harts.tiny import VISION_LANGUAGE_FAMILIES
from harts.trainer.config import ModelConfig, TrainConfig

__all__ = ["IMAGE_MODEL_LOADER", "check_image_run"]

#: the transformers class a run with images loads its policy (and resumes its checkpoints) with
IMAGE_MODEL_LOADER = "AutoModelForImageTextToText"

# (the section's attribute of TrainConfig, its name in the config file)
_UNCHECKED = (
    ("reference", "[reference]"),
    ("critic", "[critic]"),
    ("lora", "[lora]"),
    ("ppo", "[ppo]"),
    ("eval", "[eval]"),
    ("samples", "[samples]"),
)


def check_image_run(config: TrainConfig, where: str, distributed: bool) -> None:
    """Refuse a run on rollouts with images (the first at ``where``) that would not train exactly."""
    _check_model(config.model, where)
    for name, section in _UNCHECKED:
        if getattr(config, name) is not None:
            raise ValueError(
                f"{section}: not with images yet ({where} has some): a run on a multimodal model's "
                f"rollouts trains the policy alone; remove {section}, or train on rollouts without images"
            )
    if distributed:
        raise ValueError(
            f"distributed: a run on rollouts with images ({where}) runs in one process for now; start it "
            f"without torchrun"
        )


def _check_model(model: ModelConfig, where: str) -> None:
    """The model must be a multimodal checkpoint harts runs images on (its vision tower beside the LM)."""
    if model.tiny is not None:
        if model.tiny not in VISION_LANGUAGE_FAMILIES:
            raise ValueError(
                f"model.tiny = {model.tiny!r}: {where} carries images, and {model.tiny} has no vision "
                f"tower; take one of {', '.join(VISION_LANGUAGE_FAMILIES)}"
            )
        return
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(model.path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        raise ValueError(f"model.path: {model.path}: its config.json does not load ({exc})") from None
    kind = getattr(hf, "model_type", None)
    try:
        family = adapter_for_type(kind).vision_language if kind else None
    except ValueError:
        family = None
    if getattr(hf, "vision_config", None) is None or family is None:
        raise ValueError(
            f"model.path: {model.path} ({kind}) is no multimodal model harts runs images on, but {where} "
            f"carries images: give the multimodal checkpoint ({IMAGE_MODEL_LOADER} loads it; "
            f"{', '.join(VISION_LANGUAGE_FAMILIES)}), or rollouts without images"
        )
