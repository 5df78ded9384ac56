"""Honest throughput of a step: flat, unique and loss-bearing tokens, model FLOP/s and MFU.

A tree step computes fewer tokens than it trains on, so one "tokens per second" misleads either
way. Every metrics record of ``harts train`` and ``harts rl`` holds three counts and their rates:

- ``flat_tokens``: the trajectories' own tokens, as a per-trajectory trainer computes them (the
  logical work);
- ``unique_tokens``: the tokens harts computes, each shared prefix once (the executed work);
- ``loss_tokens``: the positions a loss reads (each trajectory's loss-mask positions but the first
  token, which nothing predicts): the training signal;

and ``redundancy`` (flat / unique). ``model_flops_per_s`` is the FLOP model of
:mod:`harts.runtime.flops` (dense weights per token, linear-attention state updates per token,
attention per attended key; forward + backward = 3 x forward) over the tokens harts executed, per
second of the step on all ranks together; ``flat_flops_per_s`` the same over the flat layout's
work (what the same step does for the trainer per second). On a CUDA device whose peak is in
:data:`PEAK_FLOPS`, ``mfu`` is ``model_flops_per_s`` over the peak of the ranks' devices at the
step's precision (bf16 / fp16, or fp32 with TF32 matmuls when allowed, else plain fp32).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from harts.forest import Forest
from harts.runtime.executor import resolve_model
from harts.runtime.flops import flop_model

__all__ = ["Throughput", "PEAK_FLOPS", "loss_tokens"]

#: dense peak FLOP/s per device by name fragment: (bf16/fp16, tf32, fp32), vendors' datasheets
PEAK_FLOPS: dict[str, tuple[float, float, float]] = {
    "H200": (989e12, 494e12, 67e12),
    "H100 PCIe": (756e12, 378e12, 51e12),
    "H100": (989e12, 494e12, 67e12),
    "A100": (312e12, 156e12, 19.5e12),
    "L40S": (362e12, 183e12, 91.6e12),
    "B200": (2250e12, 1100e12, 80e12),
}


def loss_tokens(rollouts) -> int:
    """Positions a loss reads: each rollout's loss-mask positions but its first token."""
    total = 0
    for r in rollouts:
        mask = getattr(r, "loss_mask", None)
        if mask is None:
            total += max(len(r.tokens) - 1, 0)
        else:
            total += int(np.asarray(torch.as_tensor(mask).cpu(), dtype=bool)[1:].sum())
    return total


def _peak(model: nn.Module) -> float | None:
    param = next(model.parameters())
    if param.device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(param.device)
    row = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    if row is None:
        return None
    if param.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled("cuda"):
        return row[0]
    return row[1] if torch.backends.cuda.matmul.allow_tf32 else row[2]


class Throughput:
    """The FLOP model of ``model`` (read once, before sharding) and its device's peak."""

    def __init__(self, model: nn.Module, world_size: int = 1):
        try:
            self.flops = flop_model(resolve_model(model))
        except (ValueError, AttributeError, TypeError):  # a layer type the model does not cost
            self.flops = None
        self.peak = _peak(model)
        self.world_size = world_size

    def record(self, forest: Forest, rollouts, seconds: float) -> dict:
        """The counts, rates and (where known) FLOP/s and MFU of one step of ``rollouts`` on ``forest``."""
        loss = loss_tokens(rollouts)
        out = {
            "flat_tokens": forest.num_flat_tokens,
            "unique_tokens": forest.num_tokens,
            "loss_tokens": loss,
            "redundancy": forest.redundancy,
            "flat_tokens_per_s": forest.num_flat_tokens / seconds,
            "unique_tokens_per_s": forest.num_tokens / seconds,
            "loss_tokens_per_s": loss / seconds,
        }
        if self.flops is not None:
            fm = self.flops
            keys = int((forest.token_position + 1).sum())
            lengths = forest.trajectory_length.to(torch.float64)
            flat_keys = float((lengths * (lengths + 1) / 2).sum())
            executed = 3 * (fm.per_token * forest.num_tokens + fm.attention_per_key * keys)
            flat = 3 * (fm.per_token * forest.num_flat_tokens + fm.attention_per_key * flat_keys)
            out.update(
                model_flops=executed, model_flops_per_s=executed / seconds, flat_flops_per_s=flat / seconds
            )
            if self.peak is not None:
                out["mfu"] = executed / seconds / (self.peak * self.world_size)
        return out
