"""Models as users hold them: unwrap what harts can run exactly, refuse the rest before compute.

harts runs a model's *parts* (embedding, norms, MLP/MoE blocks, projections, head) over a forest,
never the forward of the whole model, of a decoder layer or of an attention module. So:

- wrappers whose forward only delegates are unwrapped: ``torch.compile`` (``OptimizedModule``)
  and peft's ``PeftModel`` with weight adapters such as LoRA (the adapter layers are the modules
  harts calls, so they take part as in stock peft);
- data-parallel models are run by :func:`harts.rollout_step` and :func:`harts.forest_step`, which
  synchronise the gradients themselves (:mod:`harts.runtime.distributed`); elsewhere (a bare
  forward or ``forest_backward``) a DDP wrapper or a sharded FSDP2 model is refused, since its
  synchronisation lives in the forward harts does not call;
- setups that would be silently skipped are refused with one line naming what and where:
  peft prompt learning (virtual tokens added in the forward), hooks on modules whose forward
  harts does not call, a short convolution that is not a plain ``nn.Conv1d`` (its weight is read
  directly), active dropout in train mode (attention dropout over a forest is not implemented),
  parameters on the meta device.

Hooks on the modules harts does call (embedding, norms, MLP, projections, head) run as in stock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from harts.adapters import adapter_for
from harts.adapters.base import registered_adapter
from harts.adapters.vision_language import text_view

__all__ = ["resolve_model", "check_model", "hooked", "sharded_step"]

_DDP_NAMES = ("DistributedDataParallel", "FullyShardedDataParallel")
_IN_SHARDED_STEP: set[int] = set()  # FSDP2 models a data-parallel step is running, unit by unit


@contextlib.contextmanager
def sharded_step(model: nn.Module) -> Iterator[None]:
    """While a data-parallel step gathers ``model``'s FSDP2 units itself, harts runs it."""
    _IN_SHARDED_STEP.add(id(model))
    try:
        yield
    finally:
        _IN_SHARDED_STEP.discard(id(model))


def _distributed_wrapper(module: nn.Module) -> str | None:
    """The data-parallel wrapper harts cannot run here; an FSDP2 model that a data-parallel step
    is running (its units gathered layer by layer, :mod:`harts.runtime.sharded`) is runnable for
    the step's duration."""
    for cls in type(module).__mro__:
        if cls.__name__ in _DDP_NAMES:
            return cls.__name__
        if cls.__name__ == "FSDPModule":
            if id(module) in _IN_SHARDED_STEP:
                return None
            sharded = any(type(p).__name__ == "DTensor" for p in module.parameters())
            return "FSDPModule (sharded by fully_shard)" if sharded else None
    return None


def resolve_model(model: nn.Module) -> nn.Module:
    """The causal LM that harts runs: ``model`` with compile and peft wrappers removed, a multimodal
    model as its text causal LM beside its vision tower.

    Raises ValueError (TypeError for a non-module) for a wrapper harts cannot run exactly.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module causal LM, got {type(model).__name__}")
    for _ in range(8):  # wrappers can nest: compile(PeftModel(...))
        wrapper = _distributed_wrapper(model)
        if wrapper is not None:
            raise ValueError(
                f"the model is wrapped in {wrapper}: harts runs the model's parts over a forest, not the "
                f"wrapper's forward, so the wrapper's gradient synchronisation or parameter gathering would "
                f"not run here; harts.rollout_step and harts.forest_step take data-parallel models (DDP, "
                f"FSDP2) and synchronise the gradients themselves"
            )
        if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod  # torch.compile: the same parameters, run eagerly part by part
            continue
        if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            config = getattr(model, "active_peft_config", None)
            if config is not None and getattr(config, "is_prompt_learning", False):
                raise ValueError(
                    f"peft {type(config).__name__} adds virtual tokens in the PeftModel's forward, "
                    f"which harts "
                    f"does not call; weight adapters (LoRA and the like) are supported"
                )
            model = model.get_base_model()
            continue
        return _text_causal_lm(model)
    return _text_causal_lm(model)


def _text_causal_lm(model: nn.Module) -> nn.Module:
    """A multimodal model's text causal LM beside its vision tower (:class:`~harts.adapters.
    vision_language.TextView`), which harts runs; any other model as it is."""
    adapter = registered_adapter(getattr(getattr(model, "config", None), "model_type", None))
    view = text_view(model, adapter.vision_language) if adapter is not None else None
    return view if view is not None else model


# Hooks that do nothing outside the stock forward that installed them: transformers' output
# capturing (``output_router_logits``, ``output_hidden_states``) leaves one on every layer it has
# captured from, inactive unless a stock forward is collecting.
# FSDP2's own hooks gather parameters and reduce gradients around a module's forward: a
# data-parallel step does that work itself (harts.runtime.distributed), and a sharded model is
# refused outside one (resolve_model).
_INERT_HOOK_MODULES = (
    "transformers.utils.output_capturing",
    "torch.distributed.fsdp._fully_shard._fsdp_state",
)


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` carries a hook that would act when it runs (inert ones left out)."""
    hooks = [
        *module._forward_hooks.values(),
        *module._forward_pre_hooks.values(),
        *module._backward_hooks.values(),
        *getattr(module, "_backward_pre_hooks", {}).values(),
    ]
    return any(getattr(h, "__module__", None) not in _INERT_HOOK_MODULES for h in hooks)


def _dropout(model: nn.Module) -> str | None:
    """What would apply dropout in train mode, or None."""
    config = model.config
    for name in dir(config):
        if (name.endswith("dropout") or name.endswith("pdrop")) and not name.startswith("_"):
            value = getattr(config, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return f"config.{name}={value}"
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0 and module.training:
            return f"{name} (p={module.p})"
    return None


def check_model(model: nn.Module) -> None:
    """Refuse, before any compute, a model setup that harts would not run exactly."""
    adapter = adapter_for(model)
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"parameter {meta} is on the meta device: materialise and load the weights before training "
            f"(e.g. from_pretrained, or to_empty(device=...) then load_state_dict)"
        )
    if model.training:
        active = _dropout(model)
        if active is not None:
            raise ValueError(
                f"dropout is active in train mode ({active}): harts does not apply dropout over a forest "
                f"(attention dropout has no tree form, and a shared token would need one mask per "
                f"trajectory); set the dropout to 0 or call model.eval()"
            )
    names = {id(module): name for name, module in model.named_modules()}  # one walk, not one per layer
    backbone = adapter.backbone(model)
    not_called = [model, backbone]
    for i, layer in enumerate(backbone.layers[: model.config.num_hidden_layers]):
        layer_type = adapter.layer_type(model, i)
        mixer_module, _ = adapter.mixer(layer, layer_type)
        not_called += [layer, mixer_module, *adapter.uncalled_modules(layer, layer_type)]
        conv = getattr(mixer_module, "conv1d", None)
        if conv is not None and (type(conv) is not nn.Conv1d or hooked(conv)):
            raise ValueError(
                f"{names[id(conv)]} is a {type(conv).__name__}"
                f"{' with hooks' if hooked(conv) else ''}: "
                f"harts reads the short convolution's weight directly, so an adapter or hook on it would "
                f"be skipped; leave the convolution out of the adapter's target modules"
            )
    for module in not_called:
        if hooked(module):
            raise ValueError(
                f"a hook on {names[id(module)] or 'the model'} ({type(module).__name__}) would not "
                f"run: harts runs this module's parts over the forest, not its forward; register the "
                f"hook on a submodule harts calls (embedding, norms, mlp, projections, lm_head) or remove it"
            )
