"""One rank of the multi-process tests, started by ``torchrun`` (gloo, CPU): see test_distributed.py.

``python -m torch.distributed.run --nproc_per_node=N tests/distributed_worker.py MODE FAMILY OUT``

- ``step``: for DDP, then FSDP2: the batch of :func:`batch` split by
  :func:`harts.plan.ranks.assign_trees`, one ``harts.rollout_step`` on the wrapped model and one
  AdamW step; rank 0 writes the full gradients, the loss and the parameters after the step to
  ``OUT`` (``torch.save``, a dict by wrapper kind).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import harts
from harts.plan.ranks import assign_trees
from harts.testing import tiny_model

LOSS = harts.PolicyLossConfig(kind="ppo")


def batch(vocab_size: int, seed: int = 0) -> list[harts.Rollout]:
    """Five trees of different sizes (a skewed batch): prompts with 1-4 branching continuations."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for group, (prompt_len, branches) in enumerate([(40, 4), (12, 1), (25, 3), (8, 2), (30, 1)]):
        prompt = rng.integers(1, vocab_size, prompt_len).tolist()
        for _ in range(branches):
            reply = rng.integers(1, vocab_size, int(rng.integers(5, 20))).tolist()
            tokens = prompt + reply
            mask = [0] * len(prompt) + [1] * len(reply)
            old = (-rng.random(len(tokens)) - 0.5).tolist()
            rollouts.append(harts.Rollout(tokens, loss_mask=mask, rollout_logprobs=old,
                                          advantages=float(rng.normal()), group_id=group))  # fmt: skip
    return rollouts


def wrap(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and type(g).__name__ == "DTensor":
            g = g.full_tensor()
        out[name.removeprefix("module.")] = None if g is None else g.detach().clone()
    return out


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        whole = p.full_tensor() if type(p).__name__ == "DTensor" else p
        out[name.removeprefix("module.")] = whole.detach().clone()
    return out


def step(kind: str, family: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model(family, seed=0)
    rollouts = batch(model.config.vocab_size)
    forest = harts.build_forest([r.tokens for r in rollouts])
    mine = [rollouts[i] for i in assign_trees(forest, world).trajectories[rank]]
    wrapped = wrap(model, kind)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    result = harts.rollout_step(wrapped, mine, LOSS, budget_tokens=48)
    grads = full_grads(wrapped)
    optimizer.step()
    return {"loss": result.loss, "grads": grads, "params": full_params(wrapped)}


def main() -> None:
    mode, family, out = sys.argv[1:4]
    assert mode == "step", mode
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        results = {kind: step(kind, family) for kind in ("ddp", "fsdp")}
        if dist.get_rank() == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
