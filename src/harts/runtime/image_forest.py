"""Forests of multimodal rollouts: prefixes shared only where token ids and images agree.

A GUI agent's rollouts carry a screenshot in every turn, and the rollouts of one task share their
first turns, screenshots included. Two trajectories may share a forest node only where their token
ids are equal and, behind every image token, the image is the same (its pixel rows, their dtype
and its grid): identical ids in front of a different screenshot never share.

:func:`image_forest` builds such a forest with the ordinary prefix merge
(:func:`harts.build_forest`) on *keys*: a text token's key is its id, an image token's key stands
for (its image's content digest, its index in the image), numbered above every id. Equal keys mean
equal ids and equal images, so the trie does the rest; the forest then holds the ids again, and
:class:`ForestImages` beside them: each distinct image once (its features are computed once per
step, :mod:`harts.runtime.image_inputs`), the feature row each image token reads, and each unique
token's M-RoPE position. Positions are the stock ``get_rope_index`` of every trajectory alone,
placed on the trajectory's tokens: a position depends only on the tokens and images before it, so
every trajectory through a token gives it the same one, and the build checks that they do.

Every check on the images runs here, before any compute, naming the trajectory (and the image or
position): pixel rows and grid shapes against the model's processor layout, the image-token count
of each image against its grid, videos (refused).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from harts.adapters.vision_language import TextView, VisionLanguage
from harts.forest import Forest, as_token_array, build_forest
from harts.forest_routes import routes_of

__all__ = [
    "ForestImages",
    "image_forest",
    "has_images",
    "TrajectoryImages",
    "trajectory_images",
    "refuse_sharded",
]

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class ForestImages:
    """The images of a multimodal forest (``Forest.images``) and where their rows go.

    Shapes: N unique tokens of the forest, I distinct images, P pixel rows, W values per row.

    - ``token_positions`` [3, N]: each unique token's M-RoPE position (three axes; equal for text);
    - ``token_feature_row`` [N]: the row of the images' features (image after image, each image's
      tokens in order) that replaces the token's embedding, -1 for a text token;
    - ``pixel_values`` [P, W], ``image_grid_thw`` [I, 3]: the distinct images, each once;
    - ``pixel_start`` [I], ``feature_start`` [I], ``image_tokens`` [I]: each image's first pixel
      row, first feature row and token count;
    - ``digests``: each image's content digest (pixel rows, dtype, grid).
    """

    token_positions: Tensor
    token_feature_row: Tensor
    pixel_values: Tensor
    image_grid_thw: Tensor
    pixel_start: Tensor
    feature_start: Tensor
    image_tokens: Tensor
    digests: tuple[str, ...]

    @property
    def num_images(self) -> int:
        return len(self.digests)

    def image_of_rows(self, rows: Tensor) -> Tensor:
        """The image (index into the distinct images) of each feature row."""
        return torch.searchsorted(self.feature_start, rows, right=True) - 1

    def images_pixels(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(pixel rows [p, W], grids [k, 3]) of the distinct ``images`` [k], in that order."""
        starts, counts = self.pixel_start[images], self.image_grid_thw[images].prod(-1)
        rows = torch.cat([torch.arange(int(s), int(s + c)) for s, c in zip(starts, counts, strict=True)])
        return self.pixel_values[rows.to(self.pixel_values.device)], self.image_grid_thw[images]


def has_images(rollouts) -> bool:
    """Whether any of ``rollouts`` (anything with ``tokens``) carries ``pixel_values`` or
    ``image_grid_thw``."""
    return any(
        getattr(r, "pixel_values", None) is not None or getattr(r, "image_grid_thw", None) is not None
        for r in rollouts
    )


@dataclass(frozen=True)
class _Spec:
    """What the model's processor layout says of a trajectory's images."""

    image_token_id: int
    refused: dict[int, str]
    merge: int
    row_width: int

    @classmethod
    def of(cls, vision_language: VisionLanguage, config) -> _Spec:
        return cls(
            vision_language.image_token_id(config),
            vision_language.refused_token_ids(config),
            vision_language.merge_size(config),
            vision_language.pixel_row_width(config),
        )


@dataclass(frozen=True, eq=False)
class TrajectoryImages:
    """One trajectory's tokens and images, checked: ``tokens`` [L] int64, ``pixel_values`` [P, W]
    (None without images), ``grid`` [n, 3] int64, ``tokens_per_image`` [n]."""

    tokens: np.ndarray
    pixel_values: Tensor | None
    grid: np.ndarray
    tokens_per_image: np.ndarray


def _grid(values, index: int, spec: _Spec) -> np.ndarray:
    if isinstance(values, Tensor):
        values = values.detach().cpu().numpy()
    grid = np.asarray(values)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.dtype.kind not in "iu":
        raise ValueError(
            f"trajectory {index}: image_grid_thw must be integers of shape [n_images, 3] (t, h, w each), "
            f"got {grid.dtype} {grid.shape}"
        )
    grid = grid.astype(np.int64)
    bad = np.flatnonzero((grid <= 0).any(1) | (grid[:, 1] % spec.merge != 0) | (grid[:, 2] % spec.merge != 0))
    if bad.size:
        k = int(bad[0])
        raise ValueError(
            f"trajectory {index}, image {k}: grid {grid[k].tolist()} must be positive with h and w multiples "
            f"of the spatial merge size {spec.merge}"
        )
    return grid


def _pixels(values, index: int, grid: np.ndarray, spec: _Spec) -> Tensor:
    pixels = torch.as_tensor(values) if not isinstance(values, Tensor) else values
    rows = int(grid.prod(1).sum())
    if pixels.dim() != 2 or not pixels.dtype.is_floating_point:
        raise ValueError(
            f"trajectory {index}: pixel_values must be a 2-D float tensor (one row per patch, as the "
            f"processor gives them), got {pixels.dtype} of shape {tuple(pixels.shape)}"
        )
    if tuple(pixels.shape) != (rows, spec.row_width):
        raise ValueError(
            f"trajectory {index}: pixel_values has shape {tuple(pixels.shape)}, but its grids hold {rows} "
            f"patches of {spec.row_width} values (channels x temporal patch x patch x patch)"
        )
    if not bool(torch.isfinite(pixels).all()):
        raise ValueError(f"trajectory {index}: pixel_values holds NaN or inf")
    return pixels


def _check_runs(tokens: np.ndarray, index: int, per_image: np.ndarray, spec: _Spec) -> None:
    """Each image's tokens are one run of the image token, as the processor writes them (between
    the vision start and end tokens), and the runs hold the images' token counts in order."""
    is_image = tokens == spec.image_token_id
    if int(is_image.sum()) != int(per_image.sum()):
        raise ValueError(
            f"trajectory {index}: {int(is_image.sum())} image tokens (id {spec.image_token_id}), but its "
            f"{per_image.size} image grids stand for {int(per_image.sum())} "
            f"(t * h * w / {spec.merge}^2 each)"
        )
    edges = np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    lengths = ends - starts
    if lengths.size != per_image.size or not np.array_equal(lengths, per_image):
        k = next(
            (k for k in range(min(lengths.size, per_image.size)) if lengths[k] != per_image[k]),
            min(lengths.size, per_image.size),
        )
        at = int(starts[min(k, starts.size - 1)])
        raise ValueError(
            f"trajectory {index}, image {k}: the run of image tokens at position {at} does not hold the "
            f"image's {int(per_image[min(k, per_image.size - 1)])} tokens (runs: {lengths.tolist()}, "
            f"images: {per_image.tolist()}); each image is one run of its tokens, as the processor writes it"
        )


def trajectory_images(rollout, index: int, spec: _Spec) -> TrajectoryImages:
    """One rollout's tokens and images, checked against the model's layout (module docstring)."""
    tokens = as_token_array(rollout.tokens, index)
    for token, what in spec.refused.items():
        hit = np.flatnonzero(tokens == token)
        if hit.size:
            raise ValueError(f"trajectory {index}, position {int(hit[0])}: token {token} is a {what}")
    pixels, grid_values = getattr(rollout, "pixel_values", None), getattr(rollout, "image_grid_thw", None)
    if (pixels is None) != (grid_values is None):
        given, missing = (
            ("pixel_values", "image_grid_thw") if grid_values is None else ("image_grid_thw", "pixel_values")
        )
        raise ValueError(f"trajectory {index}: {given} without {missing}; give both, as the processor does")
    if pixels is None:
        grid, pixel_tensor = np.zeros((0, 3), dtype=np.int64), None
    else:
        grid = _grid(grid_values, index, spec)
        pixel_tensor = _pixels(pixels, index, grid, spec)
    per_image = grid.prod(1) // (spec.merge * spec.merge)
    _check_runs(tokens, index, per_image, spec)
    return TrajectoryImages(tokens, pixel_tensor, grid, per_image)


def _check_one_dtype(trajectories: list[TrajectoryImages]) -> None:
    """The batch's pixel rows share one dtype (the processor's), so the distinct images stack."""
    dtypes = [(i, t.pixel_values.dtype) for i, t in enumerate(trajectories) if t.pixel_values is not None]
    for i, dtype in dtypes[1:]:
        if dtype != dtypes[0][1]:
            raise ValueError(
                f"trajectory {i}: pixel_values are {dtype}, trajectory {dtypes[0][0]}'s {dtypes[0][1]}: give "
                f"every trajectory's images in one dtype"
            )


def _digest(pixels: Tensor, grid: np.ndarray) -> str:
    """Content digest of one image: its pixel rows' bytes, their dtype, its grid."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(pixels.dtype).encode())
    h.update(np.ascontiguousarray(grid, dtype=np.int64).tobytes())
    h.update(pixels.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Distinct:
    """The distinct images of a batch, numbered in order of first appearance: each image of each
    trajectory gets the number of its digest (with ``dedupe`` False, a number of its own)."""

    def __init__(self, trajectories: list[TrajectoryImages], dedupe: bool):
        self.number: dict[str, int] = {}
        self.pixels: list[Tensor] = []
        self.grids: list[np.ndarray] = []
        self.digests: list[str] = []
        self.of_trajectory: list[np.ndarray] = []
        for t in trajectories:
            numbers, row = [], 0
            for grid in t.grid:
                patches = int(grid.prod())
                pixels = t.pixel_values[row : row + patches]
                row += patches
                digest = _digest(pixels, grid)
                key = digest if dedupe else f"{digest}/{len(self.digests)}"
                if key not in self.number:
                    self.number[key] = len(self.digests)
                    self.pixels.append(pixels)
                    self.grids.append(grid)
                    self.digests.append(digest)
                numbers.append(self.number[key])
            self.of_trajectory.append(np.asarray(numbers, dtype=np.int64))


def _keys(
    t: TrajectoryImages, numbers: np.ndarray, base: int, stride: int, image_token_id: int
) -> np.ndarray:
    """The trajectory's trie keys: ids for text, ``base + image * stride + index`` for image tokens."""
    keys = t.tokens.copy()
    where = np.flatnonzero(t.tokens == image_token_id)
    index = np.arange(where.size) - np.repeat(
        np.cumsum(t.tokens_per_image) - t.tokens_per_image, t.tokens_per_image
    )
    keys[where] = base + np.repeat(numbers, t.tokens_per_image) * stride + index
    return keys


def _positions(view: TextView, forest: Forest, trajectories: list[TrajectoryImages]) -> Tensor:
    """[3, N] each unique token's stock M-RoPE position, checked equal on every trajectory through it."""
    vision_language, model = view.vision_language, view.multimodal
    positions = torch.full((3, forest.num_tokens), -1, dtype=torch.long)
    placed = []
    for i, t in enumerate(trajectories):
        index = forest.trajectory_token_indices(i)
        if t.grid.shape[0]:
            ids = torch.from_numpy(t.tokens)
            own = vision_language.rope_index(model, ids, torch.from_numpy(t.grid)).detach().cpu().long()
        else:  # text alone: the stock positions count the tokens, on all three axes
            own = torch.arange(t.tokens.size).expand(3, -1)
        positions[:, index] = own
        placed.append((index, own))
    for i, (index, own) in enumerate(placed):
        if not torch.equal(positions[:, index], own):
            raise AssertionError(
                f"trajectory {i}: a shared token's M-RoPE position differs between trajectories; the "
                f"prefix merge must see everything a position depends on"
            )
    return positions


def refuse_sharded(model: nn.Module) -> None:
    """A multimodal model sharded by FSDP2 is refused: the vision tower's features feed every
    micro-batch, and the sharded step gathers and reduces the decoder's units only."""
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError(
            "a multimodal model sharded by FSDP2 is not supported (the sharded step gathers the decoder's "
            "units only, not the vision tower's): train it with one process or DDP"
        )


def image_forest(model: nn.Module, rollouts: Sequence, share_prefixes: bool = True) -> Forest:
    """The forest of ``rollouts`` (anything with ``tokens``, ``pixel_values`` and
    ``image_grid_thw``; those without images are text) for the multimodal ``model`` (a
    ``*ForConditionalGeneration`` or its :class:`TextView`), with :class:`ForestImages` in its
    ``images``. Trajectories share a node only where their ids and images agree (module docstring).
    ``share_prefixes=False``: the flat layout, every image occurrence its own (as a flat trainer
    runs them). Raises ValueError before any compute for a model without a vision tower or images
    that do not fit it."""
    view = model if isinstance(model, TextView) else None
    if view is None:
        from harts.runtime.model_checks import resolve_model

        refuse_sharded(model)
        view = resolve_model(model)
    if not isinstance(view, TextView):
        raise ValueError(
            f"the rollouts carry images, but {type(model).__name__} has no vision tower: load the multimodal "
            f"model (e.g. AutoModelForImageTextToText) to train on images"
        )
    view.vision_language.refuse_images(view.multimodal.config)
    if isinstance(rollouts, (str, bytes)) or not isinstance(rollouts, Sequence) or not len(rollouts):
        raise ValueError("image_forest needs a non-empty sequence of rollouts")
    spec = _Spec.of(view.vision_language, view.multimodal.config)
    trajectories = [trajectory_images(r, i, spec) for i, r in enumerate(rollouts)]
    _check_one_dtype(trajectories)
    distinct = _Distinct(trajectories, dedupe=share_prefixes)
    tokens_per_image = np.asarray([int(g.prod()) // spec.merge**2 for g in distinct.grids], dtype=np.int64)
    base = max(max(int(t.tokens.max()) for t in trajectories), spec.image_token_id) + 1
    stride = int(tokens_per_image.max(initial=1))
    keys = [
        _keys(t, n, base, stride, spec.image_token_id)
        for t, n in zip(trajectories, distinct.of_trajectory, strict=True)
    ]
    forest = build_forest(keys, share_prefixes=share_prefixes, routed_experts=routes_of(rollouts))
    is_image = forest.tokens >= base
    offset = (forest.tokens - base).clamp(min=0)
    feature_start = torch.from_numpy(np.cumsum(tokens_per_image) - tokens_per_image)
    image = (offset // stride).clamp(max=max(len(distinct.digests) - 1, 0))
    starts = feature_start[image] if len(distinct.digests) else torch.zeros_like(image)
    feature_row = torch.where(is_image, starts + offset % stride, -1)
    forest = dataclasses.replace(forest, tokens=torch.where(is_image, spec.image_token_id, forest.tokens))
    grids = (
        torch.from_numpy(np.stack(distinct.grids)) if distinct.grids else torch.zeros(0, 3, dtype=torch.long)
    )
    patches = grids.prod(-1)
    images = ForestImages(
        token_positions=_positions(view, forest, trajectories),
        token_feature_row=feature_row,
        pixel_values=torch.cat(distinct.pixels) if distinct.pixels else torch.zeros(0, spec.row_width),
        image_grid_thw=grids,
        pixel_start=torch.cumsum(patches, 0) - patches,
        feature_start=feature_start,
        image_tokens=torch.from_numpy(tokens_per_image),
        digests=tuple(distinct.digests),
    )
    return dataclasses.replace(forest, images=images)
