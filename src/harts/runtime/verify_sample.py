"""The sample a check runs (:mod:`harts.runtime.verify`): which trajectories, cut where, its own
forest, rows and fixed random loss, the precision checked, and how the stock forward runs on it.

Why a sample: the check's cost is its stock passes, each trajectory alone, so it runs on the fewest
trajectories that share a prefix (two), parting at a branch whose shared prefix is longest within
``MAX_PREFIX`` tokens, each kept ``TAIL`` tokens past it, so that a shared prefix and a branch are
always checked and the cost does not grow with the trajectories' length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from harts.forest import Forest, build_forest
from harts.runtime.config import RunConfig
from harts.runtime.verify_bounds import Where
from harts.runtime.verify_images import sample_images, whole_images
from harts.runtime.verify_sharded import broadcast_sample, is_sharded, mixed_precision, refuse_low
from harts.runtime.verify_stock import RowLoss, stock_rows_of_sample

__all__ = [
    "Sample",
    "sample_trajectories",
    "sample_spans",
    "precision_of",
    "SAMPLE_SIZE",
    "MAX_PREFIX",
    "TAIL",
    "within_prefix",
]

Tensor = torch.Tensor

SAMPLE_SIZE = 2  # the fewest that share a prefix: the check's cost is their stock passes
MAX_PREFIX = 256  # the branch sampled shares at most this many tokens, when the forest has such a branch
TAIL = 32  # tokens kept of each sampled trajectory past its branch
_SEED = 20260


def sample_trajectories(forest: Forest, limit: int = SAMPLE_SIZE) -> list[int]:
    """The sample's trajectories (in the call's order): at the branch node (a node several
    trajectories share, where they part) whose end is deepest within ``MAX_PREFIX`` tokens (else
    the shallowest), the shortest trajectory of each of the ``limit`` groups that part there (a
    child's subtree, or those ending at the node) with the shortest members. A forest without a
    branch gives its first trajectory."""
    return [i for i, _ in sample_spans(forest, limit)]


def sample_spans(forest: Forest, limit: int = SAMPLE_SIZE) -> list[tuple[int, int]]:
    """(trajectory, tokens kept) of the sample (:func:`sample_trajectories`): each truncated
    ``TAIL`` tokens past the branch."""
    parent = forest.node_parent.numpy()
    end_node = forest.trajectory_end_node.numpy()
    subtree_end = forest.node_subtree_end.numpy()
    lengths = forest.trajectory_length.numpy()
    children: dict[int, list[int]] = {}
    for node, p in enumerate(parent.tolist()):
        if p >= 0:
            children.setdefault(p, []).append(node)
    ends_here = np.bincount(end_node, minlength=forest.num_nodes)
    branch = [m for m in range(forest.num_nodes) if len(children.get(m, ())) + (ends_here[m] > 0) >= 2]
    if not branch:
        return [(0, int(lengths[0]))]
    path_end = forest.node_path_start.numpy() + forest.node_length.numpy()
    within = [m for m in branch if path_end[m] <= MAX_PREFIX]
    node = max(within, key=lambda m: path_end[m]) if within else min(branch, key=lambda m: path_end[m])
    groups = [np.flatnonzero(end_node == node)] if ends_here[node] else []
    groups += [np.flatnonzero((end_node >= c) & (end_node < subtree_end[c])) for c in children.get(node, ())]
    shortest = sorted((int(g[np.argmin(lengths[g])]) for g in groups if g.size), key=lambda i: lengths[i])
    keep = int(path_end[node]) + TAIL
    return sorted((i, min(int(lengths[i]), keep)) for i in shortest[:limit])


def _rows(forest: Forest) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Every position ``p >= 1`` of every trajectory: (predictor [R], target [R], token paths)."""
    paths = [forest.trajectory_token_indices(i) for i in range(forest.num_trajectories)]
    predictor = torch.cat([path[:-1] for path in paths])
    target = forest.tokens[torch.cat([path[1:] for path in paths])]
    return predictor, target, paths


def precision_of(model: nn.Module) -> tuple[str, torch.dtype, bool]:
    """(label, the truth's dtype, whether the call runs under autocast). FSDP2 fp32 parameters
    under a ``MixedPrecisionPolicy`` computing in bf16 / fp16 are that precision."""
    device = next(model.parameters()).device
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    autocast = torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
    if autocast:
        low = torch.get_autocast_dtype(device.type)
        return f"{str(low).removeprefix('torch.')} autocast", torch.float32, True
    mixed = mixed_precision(model) if is_sharded(model) else None
    if mixed is not None:
        return f"{str(mixed).removeprefix('torch.')} FSDP2 mixed precision", torch.float32, False
    if dtype == torch.float32:
        return "fp32", torch.float64, False
    if dtype == torch.float64:
        return "fp64", torch.float64, False
    return f"{str(dtype).removeprefix('torch.')} parameters", torch.float32, False


def within_prefix(
    trajectories: list[Tensor], routes: list[Tensor] | None
) -> tuple[list[Tensor], list[Tensor] | None, int]:
    """The sample brought within ``MAX_PREFIX`` when its branch lies past it (the forest has no
    branch nearer its roots: a long system prompt shared by every trajectory, say): the first
    ``MAX_PREFIX`` tokens they share, then each one's ``TAIL`` tokens past the branch. The same
    shared prefix, branch and tails the check needs, at a cost that does not grow with the prompt.
    Each is a token sequence the model runs like any other; the check compares harts and stock on
    the sample, whatever its tokens, and a token's recorded routes move with it. Returns them and
    how many places the tails moved (0: the sample as it was)."""
    if len(trajectories) < 2:
        return trajectories, routes, 0
    first, second = trajectories[0], trajectories[1]
    common = min(first.numel(), second.numel())
    differ = (first[:common] != second[:common]).nonzero()
    branch = int(differ[0]) if differ.numel() else common
    if branch <= MAX_PREFIX:
        return trajectories, routes, 0

    def cut(t: Tensor) -> Tensor:
        return torch.cat([t[:MAX_PREFIX], t[branch : branch + TAIL]])

    return (
        [cut(t) for t in trajectories],
        None if routes is None else [cut(r) for r in routes],
        branch - MAX_PREFIX,
    )


@dataclass
class Sample:
    """The check's sample (:func:`sample_spans`, a cut never inside an image; rank 0's on FSDP2
    ranks), its own forest and rows, the fixed random loss, the precision checked, and how the
    stock forward runs on it."""

    chosen: list[int]
    trajectories: list[Tensor]
    routes: list[Tensor] | None  # recorded MoE routes, replayed in harts and in stock
    images: object
    sub: Forest
    predictor: Tensor
    target: Tensor
    loss: RowLoss | None
    run: RunConfig
    label: str
    truth_dtype: torch.dtype
    autocast: bool
    sharded: bool
    values: bool
    temperature: float
    shift: int = 0  # the sample brought within its prefix: its tails' places moved (within_prefix)

    @classmethod
    def of(
        cls,
        model,
        forest: Forest,
        run: RunConfig,
        values: bool,
        temperature: float,
        gradients: bool,
        separable: bool,
    ) -> Sample:
        spans = whole_images(forest, sample_spans(forest))  # a cut never splits an image
        trajectories = [forest.trajectory(i)[:keep] for i, keep in spans]
        routes = None
        if forest.routed_experts is not None:
            routes = [forest.routed_experts[forest.trajectory_token_indices(i)[:keep]] for i, keep in spans]
        label, truth_dtype, autocast = precision_of(model)
        sharded = is_sharded(model)  # FSDP2: every rank runs rank 0's sample in lock step (verify_sharded)
        if sharded:
            refuse_low(model, autocast, gradients)
            spans, trajectories, routes = broadcast_sample(spans, trajectories, routes)
        images, shift = None, 0
        if getattr(forest, "images", None) is not None:  # each trajectory with its own images
            sub, images = sample_images(model, forest, spans, routes)
        else:
            trajectories, routes, shift = within_prefix(trajectories, routes)
            sub = build_forest([t.tolist() for t in trajectories], routed_experts=routes)
        predictor, target, _ = _rows(sub)
        loss = _sample_loss(predictor.numel(), values, separable) if gradients else None
        return cls(
            [i for i, _ in spans],
            trajectories,
            routes,
            images,
            sub,
            predictor,
            target,
            loss,
            _sample_run(run, sub),
            label,
            truth_dtype,
            autocast,
            sharded,
            values,
            temperature,
            shift,
        )

    @property
    def low(self) -> bool:
        return self.label not in ("fp32", "fp64")

    @property
    def where(self) -> Where:
        return Where(self.chosen, [t.numel() for t in self.trajectories], MAX_PREFIX, self.shift)

    @property
    def kind(self) -> str:
        return "value" if self.values else "log-prob"

    def stock(self, on: nn.Module, autocast: bool) -> tuple[Tensor, dict | None]:
        """The stock forward (and backward) of each sampled trajectory alone, on ``on``."""
        return stock_rows_of_sample(
            on,
            self.trajectories,
            self.loss,
            self.values,
            self.temperature,
            autocast,
            self.routes,
            self.images,
        )


def _sample_run(run: RunConfig, sub: Forest) -> RunConfig:
    """The call's settings, unverified, with its budget capped at half the sample's unique tokens
    when it has one (a cut and a hand-over run on the sample)."""
    budget = run.budget_tokens
    if budget is not None:
        budget = max(1, min(budget, sub.num_tokens // 2))
    return dataclasses.replace(run.unverified, budget_tokens=budget)


def _sample_loss(rows: int, values: bool, separable: bool) -> RowLoss:
    """The sample's fixed random loss of its ``rows`` (no entropy term for a critic's values)."""
    gen = torch.Generator().manual_seed(_SEED)
    scale = 1.0 / max(rows, 1)
    a = torch.randn(rows, generator=gen, dtype=torch.float64) * scale
    b = torch.randn(rows, generator=gen, dtype=torch.float64) * (0.0 if values else scale)
    return RowLoss(a, b, separable)
