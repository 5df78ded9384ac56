"""Images of token-form rollout files: pixel rows in a safetensors file, referenced by key per line.

A line of a multimodal model's rollouts names its images in order (``"images": [{"key": ...,
"grid": [t, h, w]}, ...]``); their pixel rows, as the model's processor gives them (``t * h * w``
rows of ``channels * temporal_patch * patch * patch`` values), sit under those keys in a
safetensors file: ``<name>.images.safetensors`` beside ``<name>.jsonl`` / ``<name>.parquet``, or
the file a line names in ``image_file`` (relative to the rollout file's folder). The rollout gets
the rows of its images concatenated in order as ``pixel_values`` and their grids as
``image_grid_thw``, what :func:`harts.image_forest` reads.

Why by reference: a screenshot is tens of thousands of floats, and the rollouts of one task share
their first screenshots; a key names each image once, the tensor file holds it once, and a pass
over the rollout file reads it once (:class:`ImageStore` keeps what it has read for the pass).
Every reference is checked as its line is read (the tensor file exists, it holds the key, the
tensor is 2-D, finite, one dtype in the file's images, and has the grid's ``t * h * w`` rows), and a
bad one raises ValueError naming the file, the line and the image (from 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

__all__ = ["IMAGE_FIELDS", "ImageStore", "default_image_file"]

#: the token form's image fields: the line's images, in order, and (optionally) the tensor file holding them
IMAGE_FIELDS = ("images", "image_file")


def default_image_file(path: Path) -> Path:
    """``<name>.images.safetensors`` beside the rollout file ``<name>.jsonl`` (or ``.parquet``)."""
    return path.with_name(f"{path.stem}.images.safetensors")


class ImageStore:
    """The tensor files of one pass over a rollout file, each opened once, each image read once.

    ``pixels`` of a line gives its ``(pixel_values, image_grid_thw)``; an image that several lines
    name is the same tensor for all of them.
    """

    def __init__(self, path: Path):
        self.path = path
        self.files: dict[Path, Any] = {}  # tensor file -> its open safetensors handle
        self.read: dict[tuple[Path, str], torch.Tensor] = {}  # (tensor file, key) -> the image's rows
        self.dtype: tuple[torch.dtype, str] | None = None  # the first image's dtype, and where it is

    def pixels(self, where: str, record: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The line's images as ``(pixel_values, image_grid_thw)``, or None when it has none."""
        images = record.get("images")
        if images is None:
            if record.get("image_file") is not None:
                raise ValueError(f"{where}, field 'image_file': given, but the line has no 'images'")
            return None
        if isinstance(images, str):  # a Parquet string column of JSON text
            try:
                images = json.loads(images)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}, field 'images': not valid JSON ({exc.msg})") from None
        if not isinstance(images, (list, tuple)) or not images:
            raise ValueError(
                f"{where}, field 'images': expected a non-empty list of "
                f'{{"key": ..., "grid": [t, h, w]}}, got {images!r:.80}'
            )
        file = self._file(where, record.get("image_file"))
        rows, grids = [], []
        for i, image in enumerate(images):
            at = f"{where}, field 'images', image {i}"
            key, grid = self._reference(at, image)
            rows.append(self._rows(at, file, key, grid))
            grids.append(grid)
        pixel_values = rows[0] if len(rows) == 1 else torch.cat(rows)
        return pixel_values, torch.tensor(grids, dtype=torch.long)

    def _file(self, where: str, named: Any) -> Path:
        if named is None:
            return default_image_file(self.path)
        if not isinstance(named, str) or not named:
            raise ValueError(f"{where}, field 'image_file': expected a path, got {named!r}")
        return self.path.parent / named

    @staticmethod
    def _reference(at: str, image: Any) -> tuple[str, list[int]]:
        if not isinstance(image, dict) or set(image) != {"key", "grid"}:
            raise ValueError(f'{at}: expected {{"key": ..., "grid": [t, h, w]}}, got {image!r:.80}')
        key, grid = image["key"], image["grid"]
        if not isinstance(key, str) or not key:
            raise ValueError(f"{at}: 'key' must be a non-empty string, got {key!r}")
        if (
            not isinstance(grid, (list, tuple))
            or len(grid) != 3
            or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in grid)
        ):
            raise ValueError(
                f"{at} (key {key!r}): 'grid' must be [t, h, w], three positive ints, got {grid!r}"
            )
        return key, list(grid)

    def _rows(self, at: str, file: Path, key: str, grid: list[int]) -> torch.Tensor:
        at = f"{at} (key {key!r})"
        rows = self.read.get((file, key))
        if rows is None:
            rows = self._load(at, file, key)
            self.read[(file, key)] = rows
        if rows.shape[0] != math.prod(grid):
            raise ValueError(
                f"{at}: grid {grid} needs t * h * w = {math.prod(grid)} pixel rows, but "
                f"{file.name} holds {rows.shape[0]} under this key"
            )
        return rows

    def _load(self, at: str, file: Path, key: str) -> torch.Tensor:
        handle = self.files.get(file)
        if handle is None:
            if not file.is_file():
                raise ValueError(
                    f"{at}: no tensor file {file} (a line's images are read from "
                    f"<name>.images.safetensors beside the rollout file, or from its "
                    f"'image_file')"
                )
            from safetensors import safe_open

            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise ValueError(f"{at}: {file} is not a readable safetensors file ({exc})") from None
            self.files[file] = handle
        if key not in handle.keys():
            raise ValueError(f"{at}: {file.name} holds no tensor {key!r}")
        rows = handle.get_tensor(key)
        if rows.ndim != 2 or not rows.is_floating_point():
            raise ValueError(
                f"{at}: the pixel rows must be a 2-D float tensor [t * h * w, values per row], "
                f"got {tuple(rows.shape)} {rows.dtype}"
            )
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(f"{at}: the pixel rows hold NaN or inf")
        if self.dtype is None:
            self.dtype = (rows.dtype, at)
        elif rows.dtype != self.dtype[0]:
            raise ValueError(
                f"{at}: dtype {rows.dtype}, but {self.dtype[1]} is {self.dtype[0]}: "
                f"the images of a file share one dtype"
            )
        return rows
