"""LoRA runs of ``harts train`` (``[lora]``): peft adapters train, the base weights stay frozen.

harts runs a peft ``PeftModel`` exactly as stock peft does (its adapter layers are the modules
harts calls: ``tests/test_model_setups.py``), so a LoRA run is the ordinary run on the wrapped
model; what changes is what a checkpoint holds and where a resume reads from:

- a checkpoint holds the adapter in peft's own format (``save_pretrained``: ``adapter_config.json``
  and ``adapter_model.safetensors``, which ``PeftModel.from_pretrained(base, dir)`` loads), the
  adapter's optimizer state in ``state/`` (frozen base weights are left out of it), and with
  ``merge_on_save`` the merged model in ``merged/`` (``AutoModelForCausalLM.from_pretrained``
  loads it);
- a resume loads the base again from its source (``[model]``), and refuses to go on when its
  weights' sha256 differs from the one the run recorded, since the adapter was trained on those;
- the adapters start with B = 0 (peft's default), so the starting policy equals the base model
  bit for bit (the adapter adds exact zeros), and ``[reference] model = "initial"`` (a frozen
  copy of the base) is the starting policy, as in a full fine-tune.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from harts.trainer.inputs import quiet_transformers
from harts.trainer.ppo import weights_sha256
from harts.trainer.sections import LoRASection

__all__ = ["attach_lora", "save_adapter", "MERGED"]

MERGED = "merged"  # a checkpoint's merged model, with lora.merge_on_save


def _peft():
    try:
        import peft
    except ImportError:
        raise ValueError("lora: peft is not installed: pip install 'harts[lora]' (or peft)") from None
    return peft


def attach_lora(
    model: nn.Module, lora: LoRASection, recorded: str | None = None, checkpoint: str = ""
) -> tuple[nn.Module, str]:
    """``model`` (the base, frozen) wrapped with fresh LoRA adapters, and the base weights' sha256.

    ``recorded``: the base sha256 a checkpoint recorded (a resume); a different base is refused.
    """
    peft = _peft()
    sha256 = weights_sha256(model)
    if recorded is not None and recorded != sha256:
        raise ValueError(
            f"lora: the base model's weights (sha256 {sha256}) are not those {checkpoint}'s adapter was "
            f"trained on (sha256 {recorded}): restore the [model] the run started with"
        )
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=lora.targets, bias="none"
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:  # no module matches target_modules, or one of an unsupported kind
        raise ValueError(f"lora.target_modules: {exc}") from None
    return wrapped, sha256


def save_adapter(model: nn.Module, directory: Path, lora: LoRASection, state: dict | None = None) -> None:
    """The adapter in peft's format into ``directory``; with ``merge_on_save``, the merged model
    into ``directory/merged`` (merged on a copy: merging in place and unmerging after would not
    give back the same bits).

    ``state``: the whole model's state, when ``model`` is sharded by FSDP2 (its parameters are
    each rank's shards; :func:`~harts.trainer.processes.full_model_state` gathers them): the
    adapter is written from it, and the merged model is merged on an unsharded copy that holds
    it, with the bits a copy of the unsharded model would have."""
    with quiet_transformers():
        model.save_pretrained(directory, safe_serialization=True, state_dict=state)
        if lora.merge_on_save:
            plain = copy.deepcopy(model) if state is None else _unsharded_copy(model, state)
            plain.merge_and_unload().save_pretrained(directory / MERGED, safe_serialization=True)


def _unsharded_copy(model: nn.Module, state: dict) -> nn.Module:
    """A plain peft model of ``model``'s architecture and adapter config holding ``state``."""
    from transformers import AutoModelForCausalLM

    base = model.get_base_model()
    fresh = AutoModelForCausalLM.from_config(base.config, torch_dtype=base.dtype)
    plain = _peft().get_peft_model(fresh, copy.deepcopy(model.peft_config["default"]))
    plain.load_state_dict(state, strict=True)
    return plain
