"""One rank of the multi-process tests, started by ``torchrun`` (gloo, CPU): see test_distributed.py.

``torchrun --nproc_per_node=N tests/distributed_worker.py step FAMILY OUT [VARIANT]...``

- ``step``: for each variant (default: every one of :data:`VARIANTS`), the batch of :func:`batch`
  split by :func:`harts.plan.ranks.assign_trees`, one ``harts.rollout_step`` on the wrapped model
  and one AdamW step; rank 0 writes the full gradients, the loss and the parameters after the
  step to ``OUT`` (``torch.save``, a dict by variant). :func:`reference` is the same step on one
  process.
- ``units``: for each variant named, one FSDP2 step counting the decoder-layer units whole at
  once and the bytes each rank holds after it (:func:`units_held`); a list by rank.
- ``muon``: two Muon steps on FSDP2-sharded matrices (:func:`muon_gaps`) against
  ``torch.optim.Muon`` on the same whole matrices and gradients; a list by rank.
"""

from __future__ import annotations

import dataclasses
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import harts
from harts.plan.ranks import assign_trees
from harts.runtime.distributed import close_process_group
from harts.runtime.model_checks import resolve_model
from harts.tiny import tiny_model

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


def wrap(model: torch.nn.Module, kind: str, offload: bool = False) -> torch.nn.Module:
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    # pinned memory needs an accelerator; on CPU ranks the policy runs with it off
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    causal_lm = resolve_model(causal_lm)  # a multimodal model's text causal LM: its decoder layers
    for layer in causal_lm.model.layers:
        fully_shard(layer, **policy)
    return fully_shard(model, **policy)


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


@dataclasses.dataclass(frozen=True)
class Variant:
    """A wrapper and a path through the step: every path a sharded step must hold on."""

    kind: str  # "ddp" or "fsdp"
    # cut trees, every part later parts read runs again (no graph held)
    run: harts.RunConfig = harts.RunConfig(budget_tokens=48, hold_tokens=0)
    loss: harts.PolicyLossConfig = LOSS
    checkpointing: bool = False
    moe: bool = False
    aux_loss_coef: float = 0.0  # the MoE load-balancing loss (families that balance by it)
    offload: bool = False  # FSDP2's CPUOffloadPolicy
    lora: bool = False  # a peft LoRA model (random A and B), only the adapters trained
    # compared with this variant's run on the same ranks (the same work on each rank) instead of
    # with one process
    baseline: str | None = None


VARIANTS = {
    "ddp": Variant("ddp"),
    "fsdp": Variant("fsdp"),
    # no overlap: one layer unit whole at a time, each sum done before compute goes on; the same
    # work, the same sums
    "fsdp-one-unit": Variant("fsdp", run=harts.RunConfig(budget_tokens=48, hold_tokens=0,
                                                         fsdp_overlap=False), baseline="fsdp"),  # fmt: skip
    # every part that later parts read keeps its graph: spines' backwards after their readers'
    "fsdp-held": Variant("fsdp", run=harts.RunConfig(budget_tokens=48, hold_tokens=10**9)),
    # GSPO's sequence ratio: cut trees take the three passes (all forwards, then backwards)
    "fsdp-gspo": Variant("fsdp", loss=harts.PolicyLossConfig(kind="gspo", clip_low=0.05, clip_high=0.08)),
    "fsdp-checkpointing": Variant("fsdp", checkpointing=True),
    "fsdp-recompute-linear": Variant("fsdp", run=harts.RunConfig(budget_tokens=48, hold_tokens=0,
                                                                 recompute_linear=True)),
    "fsdp-moe-stats": Variant("fsdp", moe=True),
    "fsdp-offload": Variant("fsdp", offload=True),
    "ddp-lora": Variant("ddp", lora=True),
    "fsdp-lora": Variant("fsdp", lora=True),
    # the load-balancing loss: routing fractions of the whole step, summed over the ranks
    "ddp-moe-aux": Variant("ddp", moe=True, aux_loss_coef=0.5),
    "fsdp-moe-aux": Variant("fsdp", moe=True, aux_loss_coef=0.5),
    "fsdp-moe-aux-whole": Variant("fsdp", run=harts.RunConfig(), moe=True, aux_loss_coef=0.5),
    # no budget: one micro-batch a rank, whose forest (and so its linear-attention plan) differs
    # from one process's single micro-batch of the whole batch
    "ddp-whole": Variant("ddp", run=harts.RunConfig()),
    "fsdp-whole": Variant("fsdp", run=harts.RunConfig(), baseline="ddp-whole"),
}


def variants_for(family: str) -> list[str]:
    """The variants a family runs: the load-balancing loss only where the family balances by it."""
    from harts.adapters import adapter_for
    from harts.adapters.base import MoEBalancing

    balancing = adapter_for(tiny_model(family, seed=0)).moe_balancing
    return [n for n, v in VARIANTS.items() if v.aux_loss_coef == 0 or balancing is MoEBalancing.AUX_LOSS]


def model_for(family: str, variant: Variant) -> torch.nn.Module:
    model = tiny_model(family, seed=0)
    if variant.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if variant.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)  # random A and B (peft's default B = 0 would give A no gradient)
        config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(model, config)
    return model


def one_step(model, rollouts, variant: Variant) -> dict:
    """One step of ``variant`` on ``model`` (wrapped or not) and one AdamW step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    moe = harts.MoEConfig(aux_loss_coef=variant.aux_loss_coef) if variant.moe else None
    result = harts.rollout_step(model, rollouts, variant.loss, run=variant.run, moe=moe)
    grads = full_grads(model)
    optimizer.step()
    out = {"loss": result.loss, "grads": grads, "params": full_params(model)}
    if result.moe is not None:
        out["expert_counts"] = result.moe.expert_counts.clone()
        if result.moe.aux_loss is not None:
            out["aux_loss"] = result.moe.aux_loss.detach().clone()
    return out


def reference(family: str, variant: Variant) -> dict:
    """The variant's step on one process over the whole batch."""
    model = model_for(family, variant)
    return one_step(model, batch(model.config.get_text_config().vocab_size), variant)


def step(family: str, variant: Variant) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_for(family, variant)
    rollouts = batch(model.config.get_text_config().vocab_size)
    forest = harts.build_forest([r.tokens for r in rollouts])
    mine = [rollouts[i] for i in assign_trees(forest, world).trajectories[rank]]
    return one_step(wrap(model, variant.kind, variant.offload), mine, variant)


def units_held(family: str, variant: Variant) -> dict:
    """One FSDP2 step of ``variant`` counting whole units: the most decoder-layer units unsharded at
    once, whether the outer units stayed whole, and what the rank holds after the step (bytes of
    local parameter shards and gradients, and of any gradient left on an unsharded parameter)."""
    from torch.distributed.fsdp import FSDPModule

    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_for(family, variant)
    rollouts = batch(model.config.get_text_config().vocab_size)
    forest = harts.build_forest([r.tokens for r in rollouts])
    mine = [rollouts[i] for i in assign_trees(forest, world).trajectories[rank]]
    wrapped = wrap(model, "fsdp")
    layers = list(wrapped.model.layers)
    whole: set[int] = set()
    most = [0]
    unshard, reshard = FSDPModule.unshard, FSDPModule.reshard

    def counting_unshard(self, async_op=False):
        if any(self is layer for layer in layers):
            whole.add(id(self))
            most[0] = max(most[0], len(whole))
        return unshard(self, async_op=async_op)

    def counting_reshard(self):
        whole.discard(id(self))
        return reshard(self)

    FSDPModule.unshard, FSDPModule.reshard = counting_unshard, counting_reshard
    try:
        harts.rollout_step(wrapped, mine, variant.loss, run=variant.run)
    finally:
        FSDPModule.unshard, FSDPModule.reshard = unshard, reshard

    def local_bytes(t):
        t = t.to_local() if type(t).__name__ == "DTensor" else t
        return t.numel() * t.element_size()

    params = list(wrapped.parameters())
    return {
        "most_layer_units_whole": most[0], "layers": len(layers), "still_whole": len(whole),
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "whole_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }  # fmt: skip


def muon_gaps(family: str) -> dict[str, float]:
    """Largest parameter difference, per matrix, between :class:`ShardedMuon` on the sharded model
    and ``torch.optim.Muon`` on a whole copy, after two steps on the same gradients (drawn from one
    seed, so equal on every rank; each rank's shard of them is its rows). The matrices are the
    model's hidden ones and a 7-row linear map, whose rows do not divide evenly over the ranks."""
    from torch.distributed.tensor import distribute_tensor

    from harts.trainer.sharded_muon import ShardedMuon

    def build():
        torch.manual_seed(0)
        odd = torch.nn.Linear(5, 7, bias=False)
        return torch.nn.ModuleDict({"lm": tiny_model(family, seed=0), "odd": odd})

    whole, sharded = build(), build()
    from torch.distributed.fsdp import fully_shard

    for layer in sharded["lm"].model.layers:
        fully_shard(layer)
    fully_shard(sharded["lm"])
    fully_shard(sharded["odd"])
    hidden = (n for n, p in whole.named_parameters() if p.ndim == 2)
    names = [n for n in hidden if "embed" not in n and "lm_head" not in n]
    mine, theirs = dict(sharded.named_parameters()), dict(whole.named_parameters())
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ours = ShardedMuon([mine[n] for n in names], **settings)
    stock = torch.optim.Muon([theirs[n] for n in names], **settings)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        for n in names:
            grad = torch.randn(theirs[n].shape, generator=g)
            theirs[n].grad = grad.clone()
            mesh, placements = mine[n].device_mesh, mine[n].placements
            mine[n].grad = distribute_tensor(grad, mesh, placements, src_data_rank=None)
        ours.step()
        stock.step()
    return {n: float((mine[n].full_tensor() - theirs[n]).abs().max()) for n in names}


def main() -> None:
    mode, family, out, *names = sys.argv[1:]
    assert mode in ("step", "units", "muon"), mode
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        if mode == "step":
            results = {name: step(family, VARIANTS[name]) for name in names or variants_for(family)}
        elif mode == "muon":
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, muon_gaps(family))
        else:
            mine = {name: units_held(family, VARIANTS[name]) for name in names}
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, mine)
        if dist.get_rank() == 0:
            torch.save(results, out)
        dist.barrier()  # no rank closes its gloo connections while a peer may still be reading from them
    finally:
        close_process_group(wait=False)  # the barrier above ran when every rank finished


if __name__ == "__main__":
    main()
