"""One step on N ranks against one process, the same global batch: what data parallelism buys.

    python -m harts.bench.distributed_step                                # one process
    torchrun --nproc_per_node=2 -m harts.bench.distributed_step           # 2 ranks (DDP)
    torchrun --nproc_per_node=2 -m harts.bench.distributed_step --fsdp    # 2 ranks: DDP and FSDP2

The batch is one agentic forest (a 600-token system prompt shared by every rollout, 8 tasks of
4 rollouts over 3 turns): one tree, so on several ranks it is divided at its branch points and
each rank recomputes the system prompt. Each process runs ``--threads`` threads (1 by default:
2 ranks on a 2-core machine against one process on one core of it). Prints the unique and flat
tokens, the max/mean rank cost of the assignment and, per variant, the fastest and the median of
``--repeats`` steps (after one warm-up), timed between barriers. With ``--fsdp`` the ranks run
DDP, FSDP2 with its collectives overlapping compute (``RunConfig.fsdp_overlap``, the default)
and FSDP2 without (one unit gathered at a time, each sum waited for), one step of each in turn,
on the same rollouts.

What this leaves out: the optimizer step, and GPUs (CPU figures, gloo).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import harts
from harts.data import synthetic
from harts.plan.ranks import assign_trees
from harts.runtime.distributed import close_process_group
from harts.tiny import tiny_model
from harts.trainer.processes import rank_cost


def shard(family: str) -> torch.nn.Module:
    """The same model (same seed), each decoder layer an FSDP2 unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(family, seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="bailing_hybrid")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--fsdp", action="store_true", help="also FSDP2, with and without overlap, alternating with DDP"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    model = tiny_model(args.family, seed=0)
    tokens = synthetic.agentic(
        system_len=600,
        num_tasks=8,
        rollouts_per_task=4,
        turns=3,
        turn_len=150,
        vocab_size=model.config.get_text_config().vocab_size,
        seed=0,
    )
    rollouts = [
        harts.Rollout(t, loss_mask=[0] + [1] * (len(t) - 1), advantages=1.0, rollout_logprobs=[-1.0] * len(t))
        for t in tokens
    ]
    forest = harts.build_forest(tokens)
    plan = assign_trees(forest, world, rank_cost(model))
    mine = [rollouts[i] for i in plan.trajectories[dist.get_rank() if world > 1 else 0]]
    variants = (
        {"one process": (model, None)}
        if world == 1
        else {
            "DDP": (torch.nn.parallel.DistributedDataParallel(model), None),
            "FSDP2, overlapped": (shard(args.family), True),
            "FSDP2, not overlapped": (shard(args.family), False),
        }
    )
    if world > 1 and not args.fsdp:
        variants = {"DDP": variants["DDP"]}
    loss = harts.PolicyLossConfig(kind="ppo")
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats + 1):  # the variants alternate, so a slow spell hits each alike
        for name, (wrapped, overlap) in variants.items():
            run = harts.RunConfig(budget_tokens=args.budget, fsdp_overlap=overlap is not False)
            if world > 1:
                dist.barrier()
            began = time.perf_counter()
            harts.rollout_step(wrapped, mine, loss, run=run)
            if world > 1:
                dist.barrier()
            times[name].append(time.perf_counter() - began)
            wrapped.zero_grad()
    if world == 1 or dist.get_rank() == 0:
        print(
            f"{world} rank(s): {forest.num_tokens} unique / {forest.num_flat_tokens} flat tokens, max/mean "
            f"rank cost {plan.imbalance:.3f} ({plan.divided} tree(s) divided)"
        )
        for name, t in times.items():
            print(f"  {name}: fastest step {min(t[1:]):.3f} s, median {sorted(t[1:])[len(t[1:]) // 2]:.3f} s")
    close_process_group(wait=True)


if __name__ == "__main__":
    main()
