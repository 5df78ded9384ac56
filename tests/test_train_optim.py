"""Optimizers of ``harts train`` on every family: who gets which parameter, and one real step.

Muon must get exactly the hidden 2-D matrices (not the embedding, not the head, nothing 1-D or
3-D); AdamW the rest, with weight decay only on tensors of two or more dimensions; a frozen
router must stay bit-identical through a step while everything else moves.
"""

from __future__ import annotations

import io

import pytest
import torch

import harts
from harts.adapters import adapter_for_type
from harts.runtime.routers import find_routers
from harts.tiny import FAMILIES, tiny_model
from harts.trainer.config import OptimizerConfig, ScheduleConfig
from harts.trainer.optim import build_optimizers, freeze_routers
from tests.helpers import one_thread  # noqa: F401 (autouse: one thread)

ROLLOUTS = [harts.Rollout([5, 6, 7, 8, 9, 10, 11, 12]), harts.Rollout([5, 6, 7, 8, 20, 21, 22])]
SFT = harts.PolicyLossConfig(kind="sft")


def _stock_trained(model) -> set[str]:
    """The parameters the stock forward of the rollouts gives a gradient: all of a text model's; not
    a multimodal model's vision tower on text, nor a module the stock forward runs without autograd
    (a sparse-attention indexer, whose choice is discrete)."""
    for rollout in ROLLOUTS:
        model(input_ids=torch.tensor([rollout.tokens])).logits.sum().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return trained


def _step(model, optim):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    harts.rollout_step(model, ROLLOUTS, SFT)
    optim.step()
    optim.zero_grad()
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


@pytest.mark.parametrize("family", FAMILIES)
def test_adamw_and_muon_split_and_step(family):
    model = tiny_model(family, seed=0).train()
    names = {id(p): n for n, p in model.named_parameters()}
    edge = {names[id(model.get_input_embeddings().weight)], names[id(model.get_output_embeddings().weight)]}

    adamw, split = build_optimizers(model, OptimizerConfig(kind="adamw", lr=1e-3), ScheduleConfig(), 1)
    assert list(adamw.optimizers) == ["adamw"] and not split.muon
    assert {n for n, _ in split.decay} == {n for n, p in model.named_parameters() if p.ndim >= 2}
    assert {n for n, _ in split.no_decay} == {n for n, p in model.named_parameters() if p.ndim < 2}
    assert [g["weight_decay"] for g in adamw.optimizers["adamw"].param_groups] == [0.01, 0.0]
    assert _step(model, adamw) == _stock_trained(model)  # every parameter stock trains, trains

    model = tiny_model(family, seed=0).train()
    muon, split = build_optimizers(model, OptimizerConfig(kind="muon", lr=1e-3), ScheduleConfig(), 1)
    on_muon = {n for n, _ in split.muon}
    hidden_matrices = {n for n, p in model.named_parameters() if p.ndim == 2} - edge
    assert on_muon == hidden_matrices and on_muon  # exactly the hidden 2-D matrices
    assert edge <= {n for n, _ in split.decay}  # embedding and head go to AdamW
    assert all(p.ndim != 2 for n, p in split.decay + split.no_decay if n not in edge)
    opt_params = {id(p) for p in muon.optimizers["muon"].param_groups[0]["params"]}
    assert opt_params == {id(p) for _, p in split.muon}
    assert _step(model, muon) == _stock_trained(model)
    assert {"lr", "lr_muon"} == set(muon.lrs())


# every family whose router the installed transformers exposes as a module
MOE = [f for f in FAMILIES if adapter_for_type(f).router_class is not None]


@pytest.mark.parametrize("family", MOE)
def test_freeze_router_keeps_router_weights_fixed(family):
    model = tiny_model(family, seed=0).train()
    frozen = freeze_routers(model)
    routers = {id(p) for _, r in find_routers(model) for p in r.parameters()}
    assert frozen and len(frozen) == len(routers)
    optim, split = build_optimizers(model, OptimizerConfig(kind="muon", lr=1e-3), ScheduleConfig(), 1)
    grouped = {id(p) for p in optim.parameters()}
    assert not grouped & routers
    moved = _step(model, optim)
    assert not moved & set(frozen) and moved  # the routers stay, the rest trains


def test_freeze_router_on_a_dense_family_is_refused():
    dense = [f for f in FAMILIES if adapter_for_type(f).moe_balancing is None][0]
    with pytest.raises(ValueError, match="optimizer.freeze_router: MoE statistics need an MoE family"):
        freeze_routers(tiny_model(dense, seed=0))


# ---- fp32 master weights of a bf16 model ----------------------------------------------------------
# lr 1e-6: an AdamW update is at most about lr (step 1: lr * |g| / (|g| + eps), plus lr * wd * |w|),
# below half a bf16 ulp of every weight of magnitude 2^-9 or more (half an ulp: 2^-18 there).
SMALL_LR = 1e-6
BF16 = torch.bfloat16


def _bf16_model():
    return tiny_model("llama", seed=0, dtype=BF16).train()


def _half_ulp_bf16(w: torch.Tensor) -> torch.Tensor:
    """Half a bf16 unit in the last place of each (nonzero) ``w``: bf16 keeps 8 significant bits,
    so for ``w = m 2^e`` with ``m`` in [0.5, 1) the ulp is ``2^(e - 8)``."""
    _, exponent = torch.frexp(w.float())
    return torch.ldexp(torch.ones_like(w, dtype=torch.float32), exponent - 9)


def _reference_adamw(model, config: OptimizerConfig):
    """A plain fp32 AdamW over fp32 copies of ``model``'s (bf16-rounded) weights, decay split as
    harts splits it: the arithmetic the masters must reproduce bit for bit."""
    params = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    groups = [
        {"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
    ]
    return params, torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def test_bf16_masters_are_an_fp32_adamw_run_on_the_bf16_gradients():
    model = _bf16_model()
    config = OptimizerConfig(kind="adamw", lr=SMALL_LR)
    optim, _ = build_optimizers(model, config, ScheduleConfig(), 3)
    masters = optim.masters.by_name
    assert {id(p) for p in optim.parameters()} == {id(m) for m in masters.values()}
    assert all(m.dtype == torch.float32 for m in masters.values())
    reference, ref_optim = _reference_adamw(model, config)
    named = dict(model.named_parameters())
    for _ in range(3):
        harts.rollout_step(model, ROLLOUTS, SFT)
        grads = {n: p.grad.float() for n, p in named.items()}  # bf16 gradients, exactly in fp32
        before = {n: m.detach().clone() for n, m in masters.items()}
        clipped = optim.take_gradients()
        assert all(p.grad is None for p in named.values())  # moved, not copied
        assert all(torch.equal(m.grad, grads[n]) for n, m in masters.items()) and clipped
        optim.take_gradients()  # again (as step does): nothing left to take, nothing lost
        assert all(torch.equal(m.grad, grads[n]) for n, m in masters.items())
        optim.step()
        optim.zero_grad()
        for n, p in reference.items():
            p.grad = grads[n]
        ref_optim.step()
        ref_optim.zero_grad()
        for n, m in masters.items():
            assert torch.equal(m, reference[n]), n  # the same fp32 arithmetic, bit for bit
            assert torch.equal(named[n], m.to(BF16)), n  # the model: the masters rounded
            assert not torch.equal(m, before[n]), n  # every master moves on every step
    state = optim.optimizers["adamw"].state
    assert all(v.dtype == torch.float32 for s in state.values() for v in s.values() if v.ndim)


def test_pure_bf16_loses_the_updates_below_half_an_ulp():
    kept, lost = _bf16_model(), _bf16_model()
    with_masters, _ = build_optimizers(kept, OptimizerConfig(lr=SMALL_LR), ScheduleConfig(), 1)
    pure, _ = build_optimizers(lost, OptimizerConfig(lr=SMALL_LR, master_weights=False), ScheduleConfig(), 1)
    assert pure.masters is None
    start = {n: p.detach().clone() for n, p in kept.named_parameters()}
    grads = {}
    for model, optim in ((kept, with_masters), (lost, pure)):
        harts.rollout_step(model, ROLLOUTS, SFT)
        grads = {n: p.grad.float() for n, p in model.named_parameters()}  # the same for both models
        optim.take_gradients()
        optim.step()
        optim.zero_grad()
    masters = with_masters.masters.by_name
    small = 0
    for n, p in lost.named_parameters():
        w = start[n]
        # step 1 moves a weight by lr |g| / (|g| + eps) + lr wd |w| <= lr (1 + wd |w|) in exact
        # arithmetic; bf16's rounding of the moments, the square root, the sum and the quotient (5
        # roundings of relative 2^-9) keeps it below 2 lr: a weight whose half ulp exceeds 2 lr
        # cannot move in bf16
        below = (w != 0) & (_half_ulp_bf16(w) > 2 * SMALL_LR)
        assert torch.equal(p[below], w[below]), n  # pure bf16: the update is lost
        # with |g| >= eps the master moves by at least lr / 2, above half an fp32 ulp of any
        # |w| < 1 (at most 2^-25): the master keeps the update
        kept_here = below & (grads[n].abs() >= with_masters.optimizers["adamw"].defaults["eps"])
        kept_here &= w.abs() < 1
        moved = masters[n].detach() != w.float()
        assert bool(moved[kept_here].all()), n
        small += int(kept_here.sum())
    assert small > 0


def test_optimizer_state_with_masters_round_trips_exactly():
    """``harts rl`` checkpoints the optimizers with ``state_dict``: the masters must come back."""
    model = _bf16_model()
    config = OptimizerConfig(kind="muon", lr=1e-5)
    optim, _ = build_optimizers(model, config, ScheduleConfig(), 4)
    for _ in range(2):
        harts.rollout_step(model, ROLLOUTS, SFT)
        optim.take_gradients()
        optim.step()
        optim.zero_grad()
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    resumed = _bf16_model()
    resumed.load_state_dict(state["model"])
    resumed_optim, _ = build_optimizers(resumed, config, ScheduleConfig(), 4)
    resumed_optim.load_state_dict(state["optim"])
    masters = optim.masters.by_name
    assert any(not torch.equal(m.to(BF16).float(), m) for m in masters.values())  # more than the bf16 weights
    for m, o in ((model, optim), (resumed, resumed_optim)):
        harts.rollout_step(m, ROLLOUTS, SFT)
        o.take_gradients()
        o.step()
        o.zero_grad()
    for n, m in resumed_optim.masters.by_name.items():
        assert torch.equal(m, masters[n]), n
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))
    pure, _ = build_optimizers(_bf16_model(), OptimizerConfig(kind="muon", master_weights=False),
                               ScheduleConfig(), 4)  # fmt: skip
    with pytest.raises(ValueError, match="optimizer.master_weights"):
        pure.load_state_dict(state["optim"])
