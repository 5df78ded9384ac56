"""Optimizers of ``harts train`` on every family: who gets which parameter, and one real step.

Muon must get exactly the hidden 2-D matrices (not the embedding, not the head, nothing 1-D or
3-D); AdamW the rest, with weight decay only on tensors of two or more dimensions; a frozen
router must stay bit-identical through a step while everything else moves.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.runtime.routers import find_routers
from harts.testing import FAMILIES, tiny_model
from harts.trainer.config import OptimizerConfig, ScheduleConfig
from harts.trainer.optim import build_optimizers, freeze_routers
from tests.helpers import one_thread  # noqa: F401 (autouse: one thread)

ROLLOUTS = [harts.Rollout([5, 6, 7, 8, 9, 10, 11, 12]), harts.Rollout([5, 6, 7, 8, 20, 21, 22])]
SFT = harts.PolicyLossConfig(kind="sft")


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
    assert _step(model, adamw) == set(names.values())  # every parameter trains (every module runs)

    model = tiny_model(family, seed=0).train()
    muon, split = build_optimizers(model, OptimizerConfig(kind="muon", lr=1e-3), ScheduleConfig(), 1)
    on_muon = {n for n, _ in split.muon}
    hidden_matrices = {n for n, p in model.named_parameters() if p.ndim == 2} - edge
    assert on_muon == hidden_matrices and on_muon  # exactly the hidden 2-D matrices
    assert edge <= {n for n, _ in split.decay}  # embedding and head go to AdamW
    assert all(p.ndim != 2 for n, p in split.decay + split.no_decay if n not in edge)
    opt_params = {id(p) for p in muon.optimizers["muon"].param_groups[0]["params"]}
    assert opt_params == {id(p) for _, p in split.muon}
    assert _step(model, muon) == set(names.values())
    assert {"lr", "lr_muon"} == set(muon.lrs())


MOE = [f for f in FAMILIES if f in ("bailing_hybrid", "kimi_linear", "qwen3_next")]


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
    dense = [f for f in FAMILIES if f not in MOE][0]
    with pytest.raises(ValueError, match="optimizer.freeze_router: MoE statistics need an MoE family"):
        freeze_routers(tiny_model(dense, seed=0))
