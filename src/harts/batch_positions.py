"""Padded and packed token batches: where each trajectory sits in the caller's tensors.

RL stacks hand batches over as a padded ``input_ids`` [B, L] with an ``attention_mask`` (left or
right padding), or packed into one row [T] (or [1, T]) with ``cu_seqlens`` [N + 1] or
``position_ids`` that restart at 0 for each sequence. Their per-token annotations (response mask,
old log-probs, advantages) come in the same layout, and they want per-token results back in it.

:class:`BatchLayout` records, per trajectory, the flat indices of its tokens in the caller's
tensor, so that ``layout.split(x)`` cuts any tensor of the caller's shape into per-trajectory
sequences and ``layout.scatter(values, trajectory, position)`` puts per-(trajectory, position)
values back. Pad tokens never become trajectory tokens.

What this leaves out: batches whose padding is not one contiguous run per row (a mask with holes
is refused), and nested packing (several packed rows: pass them as one packed row, or pad).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BatchLayout", "padded_layout", "packed_layout", "batch_layout", "input_trajectories"]


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """Where each of B trajectories sits in a caller tensor of ``shape``.

    - ``shape``: the caller's token shape, [B, L] (padded) or [T] / [1, T] (packed);
    - ``index``: per trajectory, the flat (row-major) indices of its tokens, in order.
    """

    shape: tuple[int, ...]
    index: tuple[np.ndarray, ...]

    @property
    def num_trajectories(self) -> int:
        return len(self.index)

    def split(self, values, name: str = "values") -> list[np.ndarray | torch.Tensor]:
        """Per-trajectory 1-D slices of ``values``, a tensor or array of the caller's shape."""
        if tuple(values.shape) != tuple(self.shape):
            raise ValueError(f"{name} has shape {tuple(values.shape)}, the tokens have {tuple(self.shape)}")
        flat = values.reshape(-1)
        if isinstance(flat, torch.Tensor):
            return [flat[torch.as_tensor(i, device=flat.device)] for i in self.index]
        return [flat[i] for i in self.index]

    def scatter(self, values: torch.Tensor, trajectory: torch.Tensor, position: torch.Tensor, fill=0.0):
        """A tensor of the caller's shape holding ``values[r]`` at (``trajectory[r]``, ``position[r]``)
        and ``fill`` everywhere else (padding, and positions without a value)."""
        trajectory, position = trajectory.cpu().numpy(), position.cpu().numpy()
        starts = np.concatenate([[0], np.cumsum([i.size for i in self.index])])
        flat_index = np.concatenate(self.index) if self.index else np.empty(0, dtype=np.int64)
        where = torch.as_tensor(flat_index[starts[trajectory] + position], device=values.device)
        out = torch.full((int(np.prod(self.shape)),), fill, dtype=values.dtype, device=values.device)
        return out.index_put((where,), values).reshape(self.shape)


def _as_2d_mask(attention_mask, shape) -> np.ndarray:
    mask = (
        attention_mask.detach().cpu().numpy()
        if isinstance(attention_mask, torch.Tensor)
        else np.asarray(attention_mask)
    )
    if mask.shape != tuple(shape):
        raise ValueError(f"attention_mask has shape {mask.shape}, input_ids {tuple(shape)}")
    if mask.dtype != bool and not np.isin(mask, (0, 1)).all():
        raise ValueError("attention_mask must hold 0/1 or booleans")
    return mask.astype(bool)


def padded_layout(input_ids, attention_mask) -> BatchLayout:
    """The layout of a padded batch: ``input_ids`` [B, L], ``attention_mask`` [B, L] (1 = token).

    Each row's tokens must be one contiguous run (left, right or no padding); a row without any
    token is refused, since a trajectory needs one.
    """
    shape = tuple(input_ids.shape)
    if len(shape) != 2:
        raise ValueError(f"a padded batch is [B, L], got input_ids of shape {shape}")
    mask = _as_2d_mask(attention_mask, shape)
    index = []
    width = shape[1]
    for b in range(shape[0]):
        cols = np.flatnonzero(mask[b])
        if not cols.size:
            raise ValueError(f"trajectory {b}: attention_mask has no token in this row")
        if cols[-1] - cols[0] + 1 != cols.size:
            gap = int(cols[np.flatnonzero(np.diff(cols) > 1)[0]] + 1)
            raise ValueError(
                f"trajectory {b}, position {gap}: padding inside the sequence (attention_mask has a hole); "
                f"each row's tokens must be one contiguous run"
            )
        index.append(b * width + cols)
    return BatchLayout(shape, tuple(index))


def packed_layout(input_ids, cu_seqlens=None, position_ids=None) -> BatchLayout:
    """The layout of a packed batch: ``input_ids`` [T] or [1, T] with ``cu_seqlens`` [N + 1]
    (sequence boundaries, starting at 0 and ending at T) or ``position_ids`` of the same shape
    as ``input_ids`` that restart at 0 at each sequence's first token."""
    shape = tuple(input_ids.shape)
    if len(shape) == 2 and shape[0] != 1 or len(shape) not in (1, 2):
        raise ValueError(f"a packed batch is [T] or [1, T], got input_ids of shape {shape}")
    total = shape[-1]
    if (cu_seqlens is None) == (position_ids is None):
        raise ValueError("a packed batch needs exactly one of cu_seqlens or position_ids")
    if cu_seqlens is not None:
        cu = np.asarray(
            cu_seqlens.cpu() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens, dtype=np.int64
        )
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != total or (np.diff(cu) <= 0).any():
            raise ValueError(
                f"cu_seqlens must rise strictly from 0 to the {total} packed tokens, got {cu.tolist()}"
            )
    else:
        pos = (
            position_ids.detach().cpu().numpy()
            if isinstance(position_ids, torch.Tensor)
            else np.asarray(position_ids)
        )
        if tuple(pos.shape) != shape:
            raise ValueError(f"position_ids has shape {tuple(pos.shape)}, input_ids {shape}")
        pos = pos.reshape(-1).astype(np.int64)
        starts = np.flatnonzero(pos == 0)
        if not starts.size or starts[0] != 0:
            raise ValueError("position_ids must start at 0 (each packed sequence counts from 0)")
        cu = np.concatenate([starts, [total]])
        for s, e in zip(cu[:-1], cu[1:], strict=True):
            if not np.array_equal(pos[s:e], np.arange(e - s)):
                bad = int(s + np.flatnonzero(pos[s:e] != np.arange(e - s))[0])
                raise ValueError(f"position_ids at {bad}: expected {bad - s} (positions count up from 0)")
    return BatchLayout(
        shape, tuple(np.arange(s, e, dtype=np.int64) for s, e in zip(cu[:-1], cu[1:], strict=True))
    )


def batch_layout(input_ids, attention_mask=None, cu_seqlens=None, position_ids=None) -> BatchLayout:
    """The layout of a padded (``attention_mask``) or packed (``cu_seqlens`` or ``position_ids``)
    batch; a 2-D ``input_ids`` with none of them is refused, since its padding cannot be told."""
    if attention_mask is not None:
        if cu_seqlens is not None or position_ids is not None:
            raise ValueError(
                "give attention_mask (a padded batch) or cu_seqlens/position_ids (packed), not both"
            )
        return padded_layout(input_ids, attention_mask)
    if cu_seqlens is not None or position_ids is not None:
        return packed_layout(input_ids, cu_seqlens, position_ids)
    raise ValueError(
        f"a {tuple(input_ids.shape)} tensor of token ids needs its layout: pass attention_mask=... for a "
        f"padded batch (1 = token, 0 = padding), cu_seqlens=... or position_ids=... for a packed one, "
        f"or a list of 1-D sequences"
    )


def input_trajectories(
    trajectories, attention_mask, cu_seqlens, position_ids
) -> tuple[Sequence, BatchLayout | None]:
    """The trajectories as one sequence each, and the batch layout they came from (None for a list).

    A padded or packed batch is split here, so that everything after sees plain trajectories; batch
    position arguments given with a list are refused, since they describe a tensor of input_ids.
    """
    layout = None
    is_array = isinstance(trajectories, (torch.Tensor, np.ndarray))
    if is_array and (
        trajectories.ndim == 2 or any(x is not None for x in (attention_mask, cu_seqlens, position_ids))
    ):
        layout = batch_layout(trajectories, attention_mask, cu_seqlens, position_ids)
        trajectories = layout.split(trajectories, "input_ids")
    elif any(x is not None for x in (attention_mask, cu_seqlens, position_ids)):
        raise TypeError(
            "attention_mask, cu_seqlens and position_ids describe a tensor of input_ids, not a list"
        )
    if isinstance(trajectories, (str, bytes)) or not isinstance(trajectories, Sequence):
        raise TypeError(f"expected a sequence of trajectories, got {type(trajectories).__name__}")
    if len(trajectories) == 0:
        raise ValueError("empty forest: at least one trajectory is needed")
    return trajectories, layout
