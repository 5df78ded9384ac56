"""The recorded MoE routes of a rollout file checked against the model that will replay them.

The reader checks each line's routes on their own (:mod:`harts.forest_routes`); what depends on
the model (its decoder layers, top-k and experts) is known only once it is loaded, and is checked
here then, before any compute, naming the line, as the vocabulary is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harts.runtime.model_checks import resolve_model
from harts.runtime.routers import RouterRecorder

__all__ = ["RoutesSeen", "check_routes_fit"]


@dataclass(frozen=True)
class RoutesSeen:
    """The shape of the file's recorded routes (``[decoder layers, top-k]``, the same on every line)
    and its largest expert id, each with where it is."""

    shape: tuple[int, int]
    first: str
    top: int
    top_where: str

    @staticmethod
    def add(seen: RoutesSeen | None, where: str, routes: np.ndarray) -> RoutesSeen:
        shape, top = tuple(routes.shape[1:]), int(routes.max(initial=-1))
        if seen is None:
            return RoutesSeen(shape, where, top, where)
        if shape != seen.shape:
            raise ValueError(
                f"{where}, field 'routed_experts': [tokens, {shape[0]}, {shape[1]}], but {seen.first} "
                f"records [tokens, {seen.shape[0]}, {seen.shape[1]}]"
            )
        return seen if top <= seen.top else RoutesSeen(seen.shape, seen.first, top, where)


def check_routes_fit(model: torch.nn.Module, seen: RoutesSeen | None) -> None:
    """Refuse, naming the line, recorded routes the loaded model cannot replay: a model without
    MoE layers, another number of decoder layers or top-k, an expert id past its experts.
    ``seen``: what the checking pass over the file found (``DataCheck.routes``)."""
    if seen is None:
        return
    base = resolve_model(model)
    try:
        recorder = RouterRecorder(base)
    except ValueError:
        raise ValueError(
            f"{seen.first}, field 'routed_experts': the model ({base.config.model_type}) has no MoE router "
            f"to replay routes on"
        ) from None
    layers = base.config.num_hidden_layers
    if seen.shape != (layers, recorder.top_k):
        raise ValueError(
            f"{seen.first}, field 'routed_experts': [tokens, {seen.shape[0]}, {seen.shape[1]}], but the "
            f"model has {layers} decoder layers and routes each token to top-k={recorder.top_k} experts"
        )
    if seen.top >= recorder.num_experts:
        raise ValueError(
            f"{seen.top_where}, field 'routed_experts': expert id {seen.top}, but the model's MoE layers "
            f"have {recorder.num_experts} experts"
        )
