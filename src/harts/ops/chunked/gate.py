"""A recurrence's decay gate, per key channel or one per head.

The chunked ops take the log-decay g per key channel ([..., H, K]: KDA, Mamba). A layer whose gate
is one value per head (Gated DeltaNet, Mamba-2, lightning attention) may pass it as [..., H] or
[..., H, 1]: the plain kernels expand it over K themselves (a view, so the gradient sums over K
inside autograd), and a device kernel that has a per-head form (fla's ``chunk_gated_delta_rule``)
takes it as it is, where a gate given per key channel needs the per-channel kernel however equal
its channels happen to be (their gradients are K free values).
"""

from __future__ import annotations

import torch

__all__ = ["gate_per_key", "head_gate"]


def gate_per_key(g: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """g as [..., H, K] like ``k``: unchanged when given per key channel, else its per-head value
    expanded over K (a view)."""
    if g.dim() == k.dim() - 1:
        g = g.unsqueeze(-1)
    return g.expand_as(k) if g.shape[-1] == 1 else g


def head_gate(g: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """g as one value per head [...] when given so ([..., H] or [..., H, 1] for ``k`` [..., H, K]);
    None for a gate per key channel."""
    if g.dim() == k.dim() - 1:
        return g
    return g[..., 0] if g.shape[-1] == 1 else None
