"""The sample of ``RunConfig(verify=True)`` (:mod:`harts.runtime.verify`) on a multimodal forest:
each sampled trajectory with its own images, as the stock forward takes them.

A multimodal forest (:func:`harts.image_forest`) holds each distinct image once and, for every
image token, the row of the images' features it reads (:class:`~harts.runtime.image_forest.
ForestImages`). A sampled trajectory is cut ``TAIL`` tokens past its branch; the cut moves to the
end of an image it would split (the stock forward takes whole images only). Its images are the
runs of image tokens it keeps, one per occurrence (a screenshot seen twice is passed twice, as the
processor writes it), with their pixel rows and grids taken from the forest. Then:

- **harts** runs the sample's own forest built from those trajectories and images by
  :func:`harts.image_forest` (positions from the stock ``get_rope_index``, features from the stock
  tower), the same construction as the call's forest;
- **stock** runs the whole multimodal model on each trajectory with its images
  (``VisionLanguage.stock_inputs``: ``pixel_values``, ``image_grid_thw`` and what the family's
  forward reads beside them), at fp64 on the truth's fp64 copy with the pixel rows upcast
  (exactly: every fp32 value is an fp64 value);
- the gradients compared are the whole multimodal model's, the vision tower's included
  (:func:`trainable`): harts' tower runs in its parts, stock's in its forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from harts.adapters.vision_language import TextView
from harts.forest import Forest
from harts.runtime.image_forest import image_forest

__all__ = ["SampleImages", "whole_images", "sample_images", "trainable", "stock_kwargs"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class SampleImages:
    """One sampled trajectory's images: pixel rows [P, W] and grids [n, 3], one per occurrence."""

    pixel_values: Tensor
    image_grid_thw: Tensor


@dataclass(frozen=True)
class _Trajectory:
    """A sampled trajectory as :func:`harts.image_forest` reads a rollout."""

    tokens: Tensor
    pixel_values: Tensor | None = None
    image_grid_thw: Tensor | None = None
    routed_experts: Tensor | None = None


def _feature_rows(forest: Forest, trajectory: int) -> Tensor:
    return forest.images.token_feature_row[forest.trajectory_token_indices(trajectory)]


def whole_images(forest: Forest, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` (trajectory, tokens kept) with each cut moved to the end of an image it splits."""
    if getattr(forest, "images", None) is None:
        return spans
    starts = forest.images.feature_start
    out = []
    for i, keep in spans:
        rows = _feature_rows(forest, i)
        while keep < rows.numel() and rows[keep] >= 0 and not bool((starts == rows[keep]).any()):
            keep += 1  # inside an image: its next token is no image's first
        out.append((i, keep))
    return out


def _occurrences(forest: Forest, trajectory: int, keep: int) -> SampleImages:
    images = forest.images
    rows = _feature_rows(forest, trajectory)[:keep]
    firsts = rows[(rows >= 0) & torch.isin(rows, images.feature_start)]
    which = images.image_of_rows(firsts)
    if not which.numel():
        return SampleImages(images.pixel_values[:0], images.image_grid_thw[:0])
    pixels, grids = images.images_pixels(which)
    return SampleImages(pixels, grids)


def sample_images(
    model: nn.Module, forest: Forest, spans: list[tuple[int, int]], routes
) -> tuple[Forest, list[SampleImages]]:
    """The sample's forest with its images (built as the call's, :func:`harts.image_forest`) and
    each sampled trajectory's images for the stock forward."""
    own = [_occurrences(forest, i, keep) for i, keep in spans]
    rollouts = []
    for k, ((i, keep), images) in enumerate(zip(spans, own, strict=True)):
        extra = {"routed_experts": routes[k]} if routes is not None else {}
        if images.image_grid_thw.numel():
            extra.update(pixel_values=images.pixel_values, image_grid_thw=images.image_grid_thw)
        rollouts.append(_Trajectory(forest.trajectory(i)[:keep], **extra))
    return image_forest(model, rollouts), own


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters the check compares: a multimodal model's whole (its vision tower's too, which
    a :class:`TextView` holds beside it), else the model's own."""
    whole = model.multimodal if isinstance(model, TextView) else model
    return [(n, p) for n, p in whole.named_parameters() if p.requires_grad]


def stock_kwargs(model: nn.Module, ids: Tensor, images: SampleImages | None) -> dict:
    """The stock forward's inputs for one trajectory ``ids`` [L] of the sample with its images; the
    pixel rows in fp64 for an fp64 model (the truth)."""
    if images is None or not images.image_grid_thw.numel():
        return {"input_ids": ids[None]}
    view = model if isinstance(model, TextView) else None
    if view is None:
        raise ValueError("RunConfig(verify=True): a forest with images on a model without a vision tower")
    device = ids.device
    pixels = images.pixel_values.to(device)
    dtype = next(view.vision_tower.parameters()).dtype
    if dtype == torch.float64 and pixels.is_floating_point():
        pixels = pixels.double()
    return view.vision_language.stock_inputs(
        view.multimodal.config, ids[None], pixels, images.image_grid_thw.to(device)
    )
