"""Muon on FSDP2-sharded matrices: the same update as ``torch.optim.Muon`` on the whole matrix.

Muon's update orthogonalises a matrix (Newton-Schulz iterations on ``M M^T``), which no shard
can compute from its own rows. FSDP2 leaves each parameter a DTensor sharded along dim 0, so
:class:`ShardedMuon` does, per matrix and one matrix at a time:

1. the momentum buffer and Nesterov blend on the local shard (elementwise: no communication);
2. an all-gather of the blended update (``full_tensor``), the whole matrix on every rank;
3. ``torch.optim.Muon``'s own Newton-Schulz function on it (the same function, so the same
   bits as one process given the same update) and its shape-adjusted learning rate, from the
   whole matrix's shape;
4. weight decay and the update on the local shard only (the rows this rank keeps).

Cost: one all-gather of each Muon matrix per step (the size of the parameters, as FSDP2's own
forward gather), one matrix whole at a time, and every rank runs each Newton-Schulz iteration
(replicated: ``5 x 3`` matmuls of the matrix per step, small against a step's forward and
backward). Momentum buffers stay sharded DTensors, so checkpoints (``torch.distributed.
checkpoint``'s optimizer state dict) hold them as they hold AdamW's moments.

Plain (unsharded) parameters in the same groups take ``torch.optim.Muon``'s path unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["ShardedMuon"]


def _muon_functions():
    """``torch.optim.Muon``'s Newton-Schulz and learning-rate adjustment: the very functions its
    step calls, so a sharded step computes what one process computes."""
    try:
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
    except ImportError as err:  # pragma: no cover - depends on the torch release
        raise ImportError(
            f"Muon on FSDP2-sharded parameters needs torch.optim.Muon's Newton-Schulz function "
            f"(torch.optim._muon, torch 2.9 or later); installed: torch {torch.__version__}"
        ) from err
    return _zeropower_via_newtonschulz, _adjust_lr


def _check_sharding(p: DTensor) -> None:
    if any(not (isinstance(pl, Shard) and pl.dim == 0) and not pl.is_replicate() for pl in p.placements):
        raise ValueError(
            f"Muon on a DTensor needs its matrix sharded along dim 0 (FSDP2's placement) or replicated; "
            f"got placements {p.placements}"
        )


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose update of a DTensor parameter is that of the whole matrix.

    Same arguments and state (``momentum_buffer`` per parameter) as ``torch.optim.Muon``."""

    @torch.no_grad()
    def step(self, closure=None):
        if not any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        newton_schulz, adjust_lr = _muon_functions()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, group, newton_schulz, adjust_lr)
        return loss

    def _update(self, p, group, newton_schulz, adjust_lr) -> None:
        grad = p.grad
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        sharded = isinstance(update, DTensor)
        if sharded:
            _check_sharding(p)
            whole = update.full_tensor()
        else:
            whole = update
        ortho = newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if sharded:
            # every rank holds the same whole result: keep this rank's rows, no communication
            ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
        lr, weight_decay = group["lr"], group["weight_decay"]
        adjusted_lr = adjust_lr(lr, group["adjust_lr_fn"], p.shape)  # the whole matrix's shape
        p.mul_(1 - lr * weight_decay)
        p.add_(ortho, alpha=-adjusted_lr)
