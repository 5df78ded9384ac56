"""The inputs of a chunked op, in fp32 and cut into chunks: what every chunk layout shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harts.ops.chunked.gate import gate_per_key

__all__ = ["ChunkedInputs", "chunked_inputs"]


@dataclass(frozen=True)
class ChunkedInputs:
    """q (times the scale), k [..., C, K]; v [..., C, V]; g [..., C, K], the log-decay per key
    channel; ``scalars``: per-token, per-head inputs (the delta rule's beta) as [..., C, 1].
    The leading dimensions are the layout's ([B, H, N] for segments, [M, H] for a chunk tree)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    scalars: tuple[torch.Tensor, ...] = ()


def chunked_inputs(
    cut: Callable[[torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scalars: tuple[torch.Tensor, ...],
    scale: float,
) -> ChunkedInputs:
    """fp32 copies of the per-token inputs [..., H, D] cut into chunks by ``cut``; g may be per head
    (:func:`~harts.ops.chunked.gate.gate_per_key`), each scalar [..., H].

    Each input is cut on its own: cut side by side as one tensor, the views that autograd saves
    would keep the whole of it (q's and g's chunks too, which nothing saves) until backward.
    """
    q, k, v, g = (x.float() for x in (q, k, v, g))
    q, k, v, g = (cut(x) for x in (q, k, v, gate_per_key(g, k)))
    return ChunkedInputs(q * scale, k, v, g, tuple(cut(s.float().unsqueeze(-1)) for s in scalars))
