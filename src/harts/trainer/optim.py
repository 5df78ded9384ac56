"""The optimizers and learning-rate schedules of a run.

- ``adamw``: ``torch.optim.AdamW`` on every trainable parameter; weight decay on tensors of two
  or more dimensions (matrices, embeddings, convolution kernels, fused experts), none on vectors
  and scalars (norms, biases, gates such as ``A_log``), the usual split.
- ``muon``: ``torch.optim.Muon`` on the hidden 2-D weight matrices (its orthogonalised update is
  defined for matrices only), AdamW on the embeddings, the output head, norms, biases and every
  parameter that is not 2-D (fused 3-D expert weights, convolution kernels). The embedding and
  head are left to AdamW because their rows are per-token vectors, not a linear map's matrix.
  Under FSDP2 the matrices are sharded: :class:`harts.trainer.sharded_muon.ShardedMuon` gathers
  each one's update for the Newton-Schulz step and keeps its own rows, the same update as on one
  process.
- ``freeze_router``: the MoE routers' weights (found as the family's adapter names them,
  :func:`harts.runtime.routers.find_routers`) stop training: ``requires_grad`` off, in no group.
- master weights: a ``bfloat16`` or ``float16`` model is a compute copy. The optimizers step
  fp32 master copies of its trainable parameters (:class:`MasterWeights`), with fp32 state; the
  gradients are cast to fp32 into the masters before clipping, so the clip and the reported norm
  are fp32 too; after each step the model's weights are the masters rounded to the model's dtype
  (``copy_``, round to nearest even). An update smaller than half a unit in the last place of
  a bf16 weight (at lr 1e-5: of any weight of magnitude 2^-8 or more) would be lost in the
  weight itself; in the master it accumulates until it shows. ``optimizer.master_weights =
  false`` steps the low-precision weights in place instead. Under FSDP2 each master is a DTensor
  with its parameter's placements (the same shard), so the masters cost every rank 4 bytes per
  parameter of its shard.

Schedules are ``torch.optim.lr_scheduler.LambdaLR`` over a plain function of the step, so the
factor of step k is computed afresh from k (nothing accumulates in floating point) and a resumed
run gets the same learning rates as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from harts.runtime.routers import find_routers
from harts.trainer.config import OptimizerConfig, ScheduleConfig

__all__ = [
    "ParameterSplit",
    "split_parameters",
    "freeze_routers",
    "Optimizers",
    "build_optimizers",
    "lr_factor",
    "MasterWeights",
    "LOW_PRECISION",
]

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class ParameterSplit:
    """Which trainable parameter goes to which optimizer group, by name."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # AdamW, with weight decay
    no_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # AdamW, without

    def describe(self) -> str:
        def count(group):
            return f"{len(group)} tensors ({sum(p.numel() for _, p in group) / 1e6:.2f}M)"

        adamw = self.decay + self.no_decay
        return (
            f"muon on {count(self.muon)}, adamw on {count(adamw)}"
            if self.muon
            else f"adamw on {count(adamw)}"
        )


def freeze_routers(model: nn.Module) -> list[str]:
    """Stop training the MoE routers' weights; returns the frozen parameters' names."""
    try:
        routers = find_routers(model)
    except ValueError as exc:
        raise ValueError(f"optimizer.freeze_router: {exc}") from None
    ids = {id(p) for _, router in routers for p in router.parameters()}
    names = [name for name, p in model.named_parameters() if id(p) in ids]
    for _, router in routers:
        for p in router.parameters():
            p.requires_grad_(False)
    return names


def split_parameters(model: nn.Module, kind: str) -> ParameterSplit:
    """The groups of ``kind`` (``adamw`` or ``muon``) over the trainable parameters, in model order."""
    edge = set()
    # a bare module (harts.ValueHead, a critic) has neither: muon is not offered for it
    for get in (getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)):
        module = get() if get is not None else None
        if module is not None:
            edge |= {id(p) for p in module.parameters()}
    split = ParameterSplit()
    for name, p in model.named_parameters():  # tied weights appear once
        if not p.requires_grad:
            continue
        if kind == "muon" and p.ndim == 2 and id(p) not in edge:
            split.muon.append((name, p))
        elif p.ndim >= 2:
            split.decay.append((name, p))
        else:
            split.no_decay.append((name, p))
    return split


def lr_factor(step: int, total: int, schedule: ScheduleConfig) -> float:
    """The learning-rate factor of 0-based step ``step`` of ``total``.

    Warm-up rises linearly to 1 at step ``warmup_steps - 1`` (its first step already moves);
    then ``constant`` stays at 1, ``linear`` and ``cosine`` fall towards ``min_lr_ratio``, which
    they would reach at step ``total``, one past the last (so no step runs at a rate of 0).
    """
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if schedule.kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    low = schedule.min_lr_ratio
    if schedule.kind == "linear":
        return 1.0 - (1.0 - low) * progress
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


class MasterWeights:
    """fp32 masters of a low-precision model's trainable parameters, and the way back to the model.

    ``module`` holds the masters under the model's own parameter names (a bare module tree, no
    forward), so ``torch.distributed.checkpoint``'s state-dict helpers name the optimizer state
    of a master as they would name its parameter's. A parameter that is fp32 already (a model of
    mixed dtypes) is its own master: the two share storage, and the refresh copies it onto itself.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        self.module = nn.Module()
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self.by_name: dict[str, nn.Parameter] = {}
        for name, p in named:
            master = nn.Parameter(p.detach().to(torch.float32))  # a DTensor keeps its placements
            _register(self.module, name, master)
            self.pairs.append((p, master))
            self.by_name[name] = master

    def master(self, name: str) -> nn.Parameter:
        return self.by_name[name]

    def take_gradients(self) -> None:
        """Each parameter's gradient, cast to fp32, into its master; the low-precision one freed.
        A second call finds none left and changes nothing."""
        for p, master in self.pairs:
            if p.grad is not None:
                master.grad = p.grad.detach().to(torch.float32)
                p.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The model's weights from the masters, rounded to the model's dtype (nearest even)."""
        for p, master in self.pairs:
            p.copy_(master)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: m.detach() for name, m in self.by_name.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.by_name):
            differ = sorted(set(state) ^ set(self.by_name))[:3]
            raise ValueError(
                f"the checkpoint's master weights do not fit this run's parameters (they "
                f"differ in {', '.join(differ)}); resume with the model the run started "
                f"with"
            )
        for name, master in self.by_name.items():
            master.copy_(state[name])
        self.refresh()


def _register(root: nn.Module, name: str, param: nn.Parameter) -> None:
    """``param`` at the dotted ``name`` under ``root``, creating empty modules on the way."""
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    module.register_parameter(leaf, param)


class Optimizers:
    """AdamW (and Muon) with their schedulers, stepped together; one state dict for checkpoints.

    With ``masters`` the optimizers step the fp32 masters: :meth:`take_gradients` moves the
    model's gradients into them (call it before clipping, so the clip acts on the fp32 ones;
    :meth:`step` takes any left), :meth:`step` rounds the stepped masters back into the model.
    """

    def __init__(
        self,
        optimizers: dict[str, torch.optim.Optimizer],
        factor: Callable[[int], float],
        masters: MasterWeights | None = None,
    ):
        self.optimizers = optimizers
        self.masters = masters
        self.schedulers = {
            name: torch.optim.lr_scheduler.LambdaLR(opt, factor) for name, opt in optimizers.items()
        }

    def parameters(self) -> list[nn.Parameter]:
        """The tensors the optimizers step (the masters, when there are): clip their gradients."""
        return [p for opt in self.optimizers.values() for g in opt.param_groups for p in g["params"]]

    def take_gradients(self) -> list[nn.Parameter]:
        """The gradients where the optimizers read them (cast to fp32 into the masters, when there
        are); returns :meth:`parameters`, whose gradients the clip and the norm read."""
        if self.masters is not None:
            self.masters.take_gradients()
        return self.parameters()

    def step(self) -> None:
        if self.masters is not None:
            self.masters.take_gradients()  # those not taken yet (an unclipped step)
        for opt in self.optimizers.values():
            opt.step()
        if self.masters is not None:
            self.masters.refresh()
        for sched in self.schedulers.values():
            sched.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        if self.masters is not None:
            for p, _ in self.masters.pairs:
                p.grad = None

    def lrs(self) -> dict[str, float]:
        """The learning rate the next step uses: ``lr`` (AdamW), ``lr_muon``."""
        out = {}
        for name, opt in self.optimizers.items():
            out["lr" if name == "adamw" else f"lr_{name}"] = float(opt.param_groups[0]["lr"])
        return out

    def state_dict(self) -> dict:
        state = {
            "optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()},
            "schedulers": {name: s.state_dict() for name, s in self.schedulers.items()},
        }
        if self.masters is not None:
            state["masters"] = self.masters.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if set(state["optimizers"]) != set(self.optimizers):
            raise ValueError(
                f"the checkpoint's optimizers are {sorted(state['optimizers'])}, the config's "
                f"{sorted(self.optimizers)}: resume with the optimizer.kind the run started with"
            )
        self.check_masters("masters" in state)
        for name, opt in self.optimizers.items():
            try:
                opt.load_state_dict(state["optimizers"][name])
            except ValueError as exc:  # torch: "... doesn't match the size of optimizer's group"
                raise ValueError(
                    f"the checkpoint's {name} state does not fit this run's parameters ({exc}); resume with "
                    f"the model, optimizer.kind and optimizer.freeze_router the run started with"
                ) from None
            self.schedulers[name].load_state_dict(state["schedulers"][name])
        if self.masters is not None:
            self.masters.load_state_dict(state["masters"])
        self.own_memory()

    def check_masters(self, saved: bool) -> None:
        """Refuse a checkpoint whose optimizers stepped master weights when this run's do not, or
        the reverse: the optimizer state of one is not that of the other."""
        if saved != (self.masters is not None):
            had, has = ("fp32 master weights", "none") if saved else ("none", "fp32 master weights")
            raise ValueError(
                f"the checkpoint's optimizers stepped {had}, this run's would step {has}: "
                f"resume with the model.dtype and optimizer.master_weights the run "
                f"started with"
            )

    def scheduler_state(self) -> dict:
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_scheduler_state(self, state: dict) -> None:
        if set(state) != set(self.schedulers):
            raise ValueError(
                f"the checkpoint's optimizers are {sorted(state)}, the config's "
                f"{sorted(self.schedulers)}: resume with the optimizer.kind the run "
                f"started with"
            )
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state[name])

    def own_memory(self) -> None:
        """Optimizer state in fresh, aligned memory (see :func:`harts.trainer.inputs.own_memory`)."""
        for opt in self.optimizers.values():
            for slot in opt.state.values():
                for key, value in slot.items():
                    if torch.is_tensor(value):
                        slot[key] = value.clone()


def build_optimizers(
    model: nn.Module, config: OptimizerConfig, schedule: ScheduleConfig, total_steps: int
) -> tuple[Optimizers, ParameterSplit]:
    """The run's optimizers over ``model``'s trainable parameters (freeze routers first); over
    their fp32 masters when the model is bf16 or fp16 and ``config.master_weights`` is on."""
    split = split_parameters(model, config.kind)
    named = split.muon + split.decay + split.no_decay
    if not named:
        raise ValueError("the model has no trainable parameter")
    masters = None
    if config.master_weights and any(p.dtype in LOW_PRECISION for _, p in named):
        masters = MasterWeights(named)

    def stepped(group):  # what the optimizer steps for each (name, parameter) of a group
        return [p if masters is None else masters.master(n) for n, p in group]

    adamw_groups = [
        {"params": stepped(group), "weight_decay": decay}
        for group, decay in ((split.decay, config.weight_decay), (split.no_decay, 0.0))
        if group
    ]
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if adamw_groups:
        optimizers["adamw"] = torch.optim.AdamW(
            adamw_groups, lr=config.lr, betas=config.betas, eps=config.eps
        )
    if split.muon:
        muon = getattr(torch.optim, "Muon", None)
        if muon is None:
            raise ImportError(
                f"optimizer.kind = 'muon' needs torch.optim.Muon (torch 2.9 or later); "
                f"installed: torch {torch.__version__}"
            )
        params = stepped(split.muon)
        if any(type(p).__name__ == "DTensor" for p in params):  # FSDP2: whole-matrix updates of shards
            from harts.trainer.sharded_muon import ShardedMuon as muon
        optimizers["muon"] = muon(
            params,
            lr=config.muon_lr if config.muon_lr is not None else config.lr,
            weight_decay=config.weight_decay,
            momentum=config.momentum,
            adjust_lr_fn=config.adjust_lr,
        )

    def factor(step: int) -> float:  # a plain function: LambdaLR keeps it out of its state dict
        return lr_factor(step, total_steps, schedule)

    return Optimizers(optimizers, factor, masters), split
