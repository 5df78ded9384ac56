"""Router outputs of a model's MoE layers, recorded by forward hooks while a forest runs.

Which module is a family's router comes from its adapter (:mod:`harts.adapters`). The statistics
computed from what is recorded (expert counts, the load-balancing loss) are pure functions in
:mod:`harts.objectives.moe`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from harts.adapters import adapter_for, adapter_for_type, supported_families
from harts.adapters.base import MoEBalancing
from harts.runtime.model_checks import resolve_model

__all__ = ["find_routers", "RouterRecorder"]

Tensor = torch.Tensor

_LAYER = re.compile(r"layers\.(\d+)\.")


def find_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(decoder layer index, router module)`` of every MoE layer the forward runs, in layer order.

    Raises ValueError for a family without known routers, or a model without MoE layers. Routers
    of layers past ``num_hidden_layers`` (multi-token-prediction heads) are left out, since
    ``harts.forward`` does not run them.
    """
    model = resolve_model(model)  # a multimodal model's routers are its language model's
    family = getattr(getattr(model, "config", None), "model_type", None)
    adapter = adapter_for(model)
    if adapter.router_class is None:
        moe = sorted(f for f in supported_families() if adapter_for_type(f).router_class is not None)
        raise ValueError(f"MoE statistics need an MoE family ({', '.join(moe)}), got {family!r}")
    wanted = adapter.router_class
    num_layers = model.config.num_hidden_layers
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ != wanted:
            continue
        match = _LAYER.search(name)
        if match is None:
            raise ValueError(f"router {name!r} is not inside a numbered decoder layer")
        if int(match.group(1)) < num_layers:
            routers.append((int(match.group(1)), module))
    if not routers:
        raise ValueError(f"this {family} model has no MoE layer (no {wanted} module)")
    return sorted(routers, key=lambda r: r[0])


class RouterRecorder:
    """Forward hooks on a model's routers that keep their outputs while the context is open.

    ::

        with RouterRecorder(model) as rec:
            out = harts.forward(model, forest)
        stats = moe_stats(rec, forest)

    ``rec.logits[l]`` [N, E] stays in the autograd graph (the aux loss backpropagates through it
    into the router weights and everything below); ``rec.indices[l]`` [N, k] are the experts the
    router chose, after any bias and group limits. If a layer's router runs several times inside
    the context, its calls are concatenated in call order.
    """

    def __init__(self, model: nn.Module):
        model = resolve_model(model)
        self.family: str = model.config.model_type
        self.balancing: MoEBalancing = adapter_for(model).moe_balancing
        self._routers = find_routers(model)
        self.layers: tuple[int, ...] = tuple(layer for layer, _ in self._routers)
        self.top_k: int = int(self._routers[0][1].top_k)
        self.num_experts: int = int(self._routers[0][1].weight.shape[0])
        self._calls: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self._routers]
        self._handles: list = []

    def _hook(self, slot: int):
        def keep(module, args, output):
            logits, _, indices = output
            self._calls[slot].append((logits, indices.detach()))

        return keep

    def __enter__(self) -> RouterRecorder:
        if self._handles:
            raise RuntimeError("RouterRecorder is already recording")
        self.clear()
        self._handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self._routers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def clear(self) -> None:
        self._calls = [[] for _ in self._routers]

    def _joined(self, part: int) -> list[Tensor]:
        if any(not calls for calls in self._calls):
            raise RuntimeError("no router output recorded: run the forward inside `with RouterRecorder(...)`")
        return [torch.cat([c[part] for c in calls]) for calls in self._calls]

    @property
    def logits(self) -> list[Tensor]:
        """[N, E] router logits per MoE layer (differentiable)."""
        return self._joined(0)

    @property
    def indices(self) -> list[Tensor]:
        """[N, k] chosen experts per MoE layer."""
        return self._joined(1)
