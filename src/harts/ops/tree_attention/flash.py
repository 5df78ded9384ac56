"""CPU flash attention's fused kernels, which every form of tree attention calls directly where they
serve, and the widened inputs they need.

Called directly, the fused forward returns each call's logsumexp, so backward saves no gathered rows
(:mod:`~harts.ops.tree_attention.grouped`, Backward) and shared prefixes merge by it
(:mod:`~harts.ops.tree_attention.prefixes`). They run only on the CPU, and only with equal key and
value head sizes and a 4-D mask, so the narrower of keys and values is zero-padded
(:func:`widen`). Other devices take the recompute path (autograd through SDPA), and so does the CPU
when :data:`_FUSED_CPU` is False.
"""

from __future__ import annotations

import torch

__all__ = ["flash_forward", "flash_backward", "fused_cpu_float", "runs_fused", "widen"]

# CPU groups run the fused flash kernels directly, so backward needs only each group's logsumexp;
# False sends every group down the recompute path that other devices take (the tests use it).
_FUSED_CPU = True
_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def fused_cpu_float(q: torch.Tensor) -> bool:
    """Whether the fused CPU kernels serve ``q``'s device and dtype in the forms that need them
    exact (float32 or float64): the dense call and the shared prefixes' merge."""
    return _FUSED_CPU and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def runs_fused(qg, kg, vg, mask, scaling: float) -> bool:
    """Whether SDPA would run this call by CPU flash attention: then its fused kernels serve."""
    return (
        _FUSED_CPU
        and qg.device.type == "cpu"
        and torch._fused_sdp_choice(qg, kg, vg, mask, 0.0, False, scale=scaling) == _FLASH
    )


def widen(x: torch.Tensor, width: int, channel: float | None = None) -> torch.Tensor:
    """[..., D] -> [..., width] with zero columns; ``channel``, when given, fills column D."""
    parts = [x] if channel is None else [x, x.new_full((*x.shape[:-1], 1), channel)]
    fill = width - x.shape[-1] - len(parts) + 1
    if fill:
        parts.append(x.new_zeros(*x.shape[:-1], fill))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else x
