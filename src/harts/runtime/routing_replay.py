"""Routing replay: an MoE router's top-k replaced by the experts the inference engine recorded.

Why: engine and trainer kernels differ in the low bits, and about one router decision in ten flips
between them on a large MoE; an RL update computed on routes the engine never took is off-policy in
a way no importance weight sees. Replaying the recorded routes (R3) makes the trainer run the
experts the engine ran.

How: while a decoder layer runs, its router's ``forward`` runs under a torch function mode that
answers the router's one top-k over ``[tokens, experts]`` with the recorded ids for the recorded
tokens, and the scores it was given at those ids as their values. Everything the router computes
after its choice (gathers of the scores, normalisation, scaling, casts) is then the stock code on
the recorded ids, so gradients reach the router's weights through the chosen experts' scores as
in the stock forward. Rows recorded as -1 keep the router's own choice. A router that chooses
through no such top-k, or through several, is refused instead of run approximately.

:func:`replayed_routing` forces a stock forward the same way (one trajectory, its own routes):
what routing replay means for a plain Hugging Face forward, and the reference of the tests.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from harts.forest import Forest
from harts.runtime.routers import find_routers

__all__ = ["check_routes", "PartRoutes", "replayed_routing", "forced_router"]

Tensor = torch.Tensor


class _ForcedTopK(TorchFunctionMode):
    """Answers the router's top-k over ``[n, num_experts]`` with ``recorded`` [n, k] (-1: choose)."""

    def __init__(self, recorded: Tensor, num_experts: int, top_k: int):
        super().__init__()
        self.recorded, self.num_experts, self.top_k = recorded, num_experts, top_k
        self.replaced = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.topk or func is Tensor.topk:
            scores = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if (
                scores.dim() == 2
                and scores.shape[1] == self.num_experts
                and k == self.top_k
                and dim in (-1, 1)
            ):
                return self._forced(func(*args, **kwargs).indices, scores)
        return func(*args, **kwargs)

    def _forced(self, natural: Tensor, scores: Tensor):
        if scores.shape[0] != self.recorded.shape[0]:
            raise RuntimeError(
                f"the router chose experts for {scores.shape[0]} tokens but {self.recorded.shape[0]} routes "
                f"were given for its call"
            )
        self.replaced += 1
        recorded = self.recorded.to(device=natural.device, dtype=natural.dtype)
        chosen = torch.where(recorded[:, :1] >= 0, recorded, natural)
        return torch.return_types.topk((scores.gather(1, chosen), chosen))


@contextlib.contextmanager
def forced_router(router: nn.Module, recorded: Tensor, where: str):
    """While open, ``router``'s calls choose ``recorded`` [n, k] (its rows of -1: the router's own
    choice). ``where`` names the layer in the error a router that cannot be forced gets."""
    num_experts, top_k = int(router.weight.shape[0]), int(router.top_k)
    had_own = "forward" in router.__dict__
    original = router.forward

    def forward(*args, **kwargs):
        mode = _ForcedTopK(recorded, num_experts, top_k)
        with mode:
            out = original(*args, **kwargs)
        if mode.replaced != 1:
            raise RuntimeError(
                f"routing replay: the router of {where} ({type(router).__name__}) chose its experts through "
                f"{mode.replaced} top-k calls over [tokens, {num_experts}] with k={top_k}, not one, so its "
                f"choice cannot be replaced by the recorded one"
            )
        return out

    router.forward = forward
    try:
        yield
    finally:
        if had_own:
            router.forward = original
        else:
            del router.forward


def _routers_by_layer(model: nn.Module) -> dict[int, nn.Module]:
    return dict(find_routers(model))


def check_routes(model: nn.Module, forest: Forest) -> None:
    """Raise ValueError, before any compute, for recorded routes that do not fit ``model``: naming the
    trajectory, position and decoder layer of the first problem."""
    routes = forest.routed_experts
    if routes is None:
        return
    family = model.config.model_type
    try:
        routers = _routers_by_layer(model)
    except ValueError:
        raise ValueError(
            f"the rollouts carry routed_experts, but this {family} model has no MoE router to replay them on"
        ) from None
    num_layers = model.config.num_hidden_layers
    any_router = next(iter(routers.values()))
    top_k, num_experts = int(any_router.top_k), int(any_router.weight.shape[0])
    if routes.shape[1:] != (num_layers, top_k):
        raise ValueError(
            f"routed_experts are [tokens, {routes.shape[1]}, {routes.shape[2]}] but this {family} model has "
            f"{num_layers} decoder layers and routes each token to top-k={top_k} experts"
        )

    def fail(token: int, layer: int, what: str) -> None:
        trajectory = int(forest.node_trajectory[int(forest.token_node[token])])
        position = int(forest.token_position[token])
        raise ValueError(f"trajectory {trajectory}, position {position}, decoder layer {layer}: {what}")

    recorded = routes >= 0
    for layer in range(num_layers):
        here = routes[:, layer]
        if layer not in routers:
            bad = recorded[:, layer].any(-1).nonzero()
            if bad.numel():
                fail(
                    int(bad[0]), layer, "routed experts recorded for a layer without routed experts (use -1)"
                )
            continue
        partial = recorded[:, layer].any(-1) & ~recorded[:, layer].all(-1)
        if partial.any():
            fail(
                int(partial.nonzero()[0]),
                layer,
                f"only some of the top-{top_k} experts recorded ({here[partial][0].tolist()})",
            )
        too_big = (here >= num_experts).any(-1)
        if too_big.any():
            fail(int(too_big.nonzero()[0]), layer, f"routed expert id out of range for {num_experts} experts")
        ordered = here.sort(-1).values.long()
        twice = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(-1)
        if twice.any():
            fail(int(twice.nonzero()[0]), layer, f"an expert recorded twice ({here[twice][0].tolist()})")


class PartRoutes:
    """The recorded routes of one micro-batch's tokens, and the routers they force, layer by layer."""

    def __init__(self, model: nn.Module, forest: Forest, global_tokens, device):
        self._routers = _routers_by_layer(model)
        index = torch.as_tensor(global_tokens, dtype=torch.long)
        self._routes = forest.routed_experts[index].to(device=device, dtype=torch.long)  # [n, layers, k]

    def around(self, layer: int):
        """The context that forces layer ``layer``'s router while the layer runs (nothing where the
        layer has no router or none of its tokens were recorded)."""
        router = self._routers.get(layer)
        recorded = self._routes[:, layer]
        if router is None or not bool((recorded >= 0).any()):
            return contextlib.nullcontext()
        return forced_router(router, recorded, f"decoder layer {layer}")


@contextlib.contextmanager
def replayed_routing(model: nn.Module, routes: Tensor):
    """While open, a stock forward of ``model`` over one sequence routes each token as ``routes``
    [tokens, layers, k] records (-1 rows: the router's own choice): every MoE layer's router is
    forced for the whole forward. For a forward of that one sequence only (batch of one, no
    padding), which is how the per-trajectory reference runs."""
    routers = _routers_by_layer(model)
    routes = torch.as_tensor(routes).long()
    with contextlib.ExitStack() as stack:
        for layer, router in routers.items():
            stack.enter_context(forced_router(router, routes[:, layer], f"decoder layer {layer}"))
        yield
