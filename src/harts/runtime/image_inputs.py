"""What a multimodal forest adds to a part's run: image features in place of image-token
embeddings, and M-RoPE positions.

The stock forward replaces each image token's embedding by its row of the vision tower's output
(``masked_scatter``) and rotates queries and keys at its three-axis M-RoPE position. A part does
the same with the rows and positions the forest holds (:class:`~harts.runtime.image_forest.
ForestImages`): :func:`embed_images` after the embedding, :func:`rope_positions` for the rotary
tables. Everything after the embedding (Gated DeltaNet, short convolutions, gated attention) runs
over image tokens as over text.

The vision tower runs on the forest's distinct images, each once:

- inside :func:`image_features_once` (the training step and the forward-only pass), before the
  parts, over all of them in one call; parts read the rows from a leaf, whose gradient sums every
  part's, and the tower's backward runs once when the step's parts are done. The tower's graph is
  held for the step, as a flat trainer holds it with its micro-batch;
- elsewhere (a single-part :func:`harts.forward`, a direct :func:`harts.forest_backward`), each part
  runs the images its own tokens read, in its own graph: exact too, but a cut inside an image or
  a part run twice runs the image again.

:func:`check_forest_images` refuses, before any compute, a forest whose images would be dropped or
misread: images without a vision tower, a multimodal model's image tokens without images (a
forest built from ids alone), a multimodal model under FSDP2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import nn

from harts.adapters.vision_language import TextView
from harts.forest import Forest
from harts.ops.precision import no_autocast
from harts.plan.layout import TreeLayout
from harts.runtime.image_forest import ForestImages, refuse_sharded

__all__ = ["check_forest_images", "rope_positions", "embed_images", "image_features_once"]

Tensor = torch.Tensor

# id(ForestImages) -> (the images, the leaf holding their features) while a step computes them once
_STEP_FEATURES: ContextVar[dict[int, tuple[ForestImages, Tensor]] | None] = ContextVar(
    "harts_step_image_features", default=None
)


def _images(forest: Forest) -> ForestImages | None:
    return getattr(forest, "images", None)


def check_forest_images(model: nn.Module, forest: Forest) -> None:
    """Refuse, before any compute, a forest and model whose images would not run as in stock."""
    images = _images(forest)
    if not isinstance(model, TextView):
        if images is not None:
            raise ValueError(
                f"the forest holds images, but {type(model).__name__} has no vision tower: run it with the "
                f"multimodal model it was built for"
            )
        return
    vision_language, config = model.vision_language, model.multimodal.config
    if images is not None:
        vision_language.refuse_images(config)
    if vision_language.runs_images:
        refuse_sharded(model.multimodal)
    if images is None:
        special = {vision_language.image_token_id(config): "image token"}
        special.update(vision_language.refused_token_ids(config))
        for token, what in special.items():
            hit = (forest.tokens == token).nonzero()
            if hit.numel():
                t = int(hit[0, 0])
                trajectory = int(forest.node_trajectory[int(forest.token_node[t])])
                raise ValueError(
                    f"trajectory {trajectory}, position {int(forest.token_position[t])}: token {token} is "
                    f"the model's {what}, but the forest holds no images (built from token ids alone): "
                    f"build it with harts.image_forest(model, rollouts) from rollouts with pixel_values"
                )
        return
    if images.token_positions.shape != (3, forest.num_tokens):
        raise ValueError("the forest's images do not belong to its tokens: build it with harts.image_forest")
    width = vision_language.pixel_row_width(config)
    if images.num_images and images.pixel_values.shape[1] != width:
        raise ValueError(
            f"the forest's pixel rows hold {images.pixel_values.shape[1]} values, the model's patches "
            f"{width}: build the forest with the model it runs on"
        )
    meta = next((name for name, p in model.vision_tower.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"vision tower parameter {meta} is on the meta device: load the weights first")


def rope_positions(layout: TreeLayout) -> Tensor:
    """The rotary position ids of the layout's tokens: [1, n] path positions, or [3, 1, n] M-RoPE
    positions (the stock ``position_ids`` layout) for a multimodal forest."""
    images = _images(layout.global_forest)
    if images is None:
        return layout.positions[None]
    index = torch.as_tensor(layout.global_tokens, dtype=torch.long)
    return images.token_positions[:, index][:, None].to(layout.device)


def _tower_features(view: TextView, images: ForestImages, which: Tensor | None) -> Tensor:
    """The tower's rows for the distinct images ``which`` (all of them for None), image after image."""
    device = next(view.vision_tower.parameters()).device
    if which is None:
        pixels, grids = images.pixel_values, images.image_grid_thw
    else:
        pixels, grids = images.images_pixels(which)
    return view.vision_language.image_features(view.multimodal, pixels.to(device), grids.to(device))


def _features(view: TextView, images: ForestImages, rows: Tensor) -> tuple[Tensor, Tensor]:
    """(features, the row of each of ``rows`` in them): the step's, or this part's own images'."""
    held = (_STEP_FEATURES.get() or {}).get(id(images))
    if held is not None:
        return held[1], rows
    image = images.image_of_rows(rows)
    needed, position = torch.unique(image, return_inverse=True)
    counts = images.image_tokens[needed]
    local_start = torch.cumsum(counts, 0) - counts
    return _tower_features(view, images, needed), rows - images.feature_start[image] + local_start[position]


def embed_images(model: nn.Module, layout: TreeLayout, hidden: Tensor) -> Tensor:
    """``hidden`` [1, n, D] (the layout's token embeddings) with every image token's row replaced by
    its image feature, as the stock forward's ``masked_scatter``: the image token's embedding gets
    no gradient there, the feature all of it."""
    images = _images(layout.global_forest)
    if images is None:
        return hidden
    rows = images.token_feature_row[torch.as_tensor(layout.global_tokens, dtype=torch.long)]
    where = (rows >= 0).nonzero()[:, 0]
    if not where.numel():
        return hidden
    features, feature_rows = _features(model, images, rows[where])
    values = features[feature_rows.to(features.device)].to(hidden.device, hidden.dtype)
    batch = torch.zeros_like(where)
    return hidden.index_put((batch.to(hidden.device), where.to(hidden.device)), values)


@contextlib.contextmanager
def image_features_once(model: nn.Module, forest: Forest) -> Iterator[None]:
    """Inside: the forest's distinct images run through the vision tower once, here, and every
    part reads their rows; on a normal exit the tower's backward runs once with the gradient all
    parts sent to those rows (outside autocast, as every part's backward). A no-op for a forest
    without images or a model without a tower."""
    images = _images(forest)
    if images is None or not isinstance(model, TextView) or not images.num_images:
        yield
        return
    grad = torch.is_grad_enabled() and any(p.requires_grad for p in model.vision_tower.parameters())
    with torch.set_grad_enabled(grad):
        features = _tower_features(model, images, None)
    leaf = features.detach().requires_grad_(grad)
    token = _STEP_FEATURES.set({**(_STEP_FEATURES.get() or {}), id(images): (images, leaf)})
    try:
        yield
    finally:
        _STEP_FEATURES.reset(token)
    if grad and leaf.grad is not None:
        with no_autocast(features.device):
            torch.autograd.backward(features, leaf.grad)
