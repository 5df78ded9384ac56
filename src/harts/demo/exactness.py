"""The demo's first claim: harts' tree step is the stock Hugging Face step of each trajectory alone.

The reference is what a per-trajectory trainer computes: each trajectory alone through the stock
``model(input_ids)`` forward, its logits, and the gradients of its share of the step's loss
(harts' SFT loss on that trajectory's rows under the step's normalisers, as harts aggregates the
step), summed over the trajectories. harts' side is the tree step the demo times
(:func:`harts.rollout_step` under its budget, so cut into parts with hand-overs) for the loss and
the gradients, and :func:`harts.forward` over the whole forest for the logits.

Bounds (fp32), those the tests hold harts to (docs/architecture.md, "References and tolerances"):

- logits: ``max |harts - stock| <= 1e-4``;
- gradients: each parameter's ``||harts - stock|| <= 1e-4 x ||stock||`` (below a norm of 1e-6,
  absolutely, as tests/reference.py does). A gradient that is a sum with heavy cancellation (a
  KDA decay's ``A_log``) can be that far off in any fp32 computation, stock's included; a
  parameter that misses 1e-4 against stock is judged against the stock forward in fp64 instead:
  harts no farther from it than ``max(1e-4, 2 x stock fp32's own distance)``, relative. The fp64
  copy of the model runs only then.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

import harts
from harts.demo.training import SFT
from harts.objectives import compute_loss

LOGIT_ATOL = 1e-4  # fp32 max |logit diff| (docs/architecture.md, "References and tolerances")
GRAD_RTOL = 1e-4  # fp32 gradient relative error (same section)
GRAD_FLOOR = 1e-6  # gradient norms below this are compared absolutely (tests/reference.py)


@dataclass(frozen=True)
class StockComparison:
    """harts' tree step against the stock per-trajectory step: the worst figures and the verdict.

    ``logit_abs``: max |harts - stock| over every logit of every trajectory; ``logit_rel``: the same
    over the largest |stock logit|. ``grad_rel``: the worst parameter's ``||harts - stock|| /
    ||stock||`` (``grad_worst`` names it); ``grad_abs``: the largest |element difference| of any
    gradient. ``by_truth``: the parameters that missed ``GRAD_RTOL`` against stock fp32, each with
    (harts' relative distance to the stock fp64 gradient, its bound)."""

    trajectories: int
    parameters: int
    logit_abs: float
    logit_rel: float
    loss_rel: float
    grad_rel: float
    grad_worst: str
    grad_abs: float
    by_truth: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def logits_pass(self) -> bool:
        return self.logit_abs <= LOGIT_ATOL

    @property
    def gradients_pass(self) -> bool:
        return all(error <= bound for error, bound in self.by_truth.values())

    @property
    def passed(self) -> bool:
        return self.logits_pass and self.gradients_pass

    def report(self) -> list[str]:
        """The lines the demo prints: figures, bounds, PASS or FAIL."""
        verdict = {True: "PASS", False: "FAIL"}
        lines = [
            f"  logits     max |harts - stock| {self.logit_abs:.1e} ({self.logit_rel:.1e} of the largest "
            f"|logit|); bound {LOGIT_ATOL:.0e} absolute: {verdict[self.logits_pass]}",
            f"  loss       relative difference {self.loss_rel:.1e}",
            f"  gradients  worst of {self.parameters} parameters ||harts - stock|| / ||stock|| "
            f"{self.grad_rel:.1e} ({self.grad_worst}), largest element difference {self.grad_abs:.1e}; "
            f"bound {GRAD_RTOL:.0e} relative: {verdict[self.gradients_pass]}",
        ]
        for name, (error, bound) in self.by_truth.items():
            lines.append(
                f"    {name} misses {GRAD_RTOL:.0e} against stock fp32; against stock fp64 harts is "
                f"{error:.1e} off, bound {bound:.1e} (2 x stock fp32's own error): "
                f"{verdict[error <= bound]}"
            )
        lines.append(f"exactness: {verdict[self.passed]}")
        return lines


def relative_errors(got: dict, reference: dict) -> dict[str, float]:
    """``||got - reference|| / max(||reference||, GRAD_FLOOR)`` per parameter."""
    return {
        name: float((got[name] - r).norm()) / max(float(r.norm()), GRAD_FLOOR)
        for name, r in reference.items()
    }


def gradients(model) -> dict[str, torch.Tensor]:
    """Each parameter's gradient by name, fp64 (zeros where none); the model's gradients cleared."""
    out = {
        n: p.grad.detach().double() if p.grad is not None else torch.zeros(p.shape, dtype=torch.float64)
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return out


@contextlib.contextmanager
def quiet_transformers():
    """transformers' notes that its stock kernels fall back to their PyTorch references (the stock
    forward is the reference here, fallbacks included) stay out of the report."""
    from transformers.utils import logging

    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def stock_step(model, rollouts) -> tuple[float, list[torch.Tensor], dict[str, torch.Tensor]]:
    """(loss, logits of each trajectory, gradients): each trajectory alone through the stock forward,
    the SFT loss on its own rows under the whole step's normalisers, backward; summed."""
    alone = [harts.build_loss_rows(harts.build_forest([r.tokens]), [r]) for r in rollouts]
    normalizers = harts.normalizers_for(alone)  # the step's totals, as harts' step aggregates
    model.zero_grad(set_to_none=True)
    total, logits = 0.0, []
    with quiet_transformers():
        for rollout, rows in zip(rollouts, alone, strict=True):
            out = model(input_ids=torch.as_tensor(rollout.tokens)[None]).logits[0]
            logprob = torch.log_softmax(out.to(torch.promote_types(out.dtype, torch.float32)), -1)
            logprob = logprob[rows.position - 1, rows.target]
            loss, _ = compute_loss(logprob, None, rows, SFT, normalizers)
            loss.backward()
            total += float(loss.detach())
            logits.append(out.detach())
    return total, logits, gradients(model)


def fp64_copy(model):
    """The same weights in fp64 (eager MoE experts: the grouped kernel has no fp64 path)."""
    truth = copy.deepcopy(model)
    with contextlib.suppress(ValueError, AttributeError):  # a model without experts
        truth.set_experts_implementation("eager")
    return truth.double()


def judge_by_truth(
    model, rollouts, missed: list[str], tree: dict, stock: dict
) -> dict[str, tuple[float, float]]:
    """For the parameters that missed ``GRAD_RTOL`` against stock fp32: (harts' relative distance to
    the stock fp64 gradient, ``max(GRAD_RTOL, 2 x stock fp32's distance)``)."""
    if not missed:
        return {}
    truth = stock_step(fp64_copy(model), rollouts)[2]
    ours, theirs = relative_errors(tree, truth), relative_errors(stock, truth)
    return {name: (ours[name], max(GRAD_RTOL, 2 * theirs[name])) for name in missed}


def compare_with_stock(model, rollouts, budget: int | None) -> StockComparison:
    """Run harts' tree step and the stock per-trajectory step on ``rollouts``; the figures."""
    model.zero_grad(set_to_none=True)
    tree_loss = float(harts.rollout_step(model, rollouts, SFT, budget_tokens=budget).loss)
    tree_grads = gradients(model)
    stock_loss, stock_logits, stock_grads = stock_step(model, rollouts)
    with torch.no_grad():
        out = harts.forward(model, harts.build_forest([r.tokens for r in rollouts]))
        logit_abs = max(float((out.trajectory_logits(i) - s).abs().max()) for i, s in enumerate(stock_logits))
    largest = max(float(s.abs().max()) for s in stock_logits)
    errors = relative_errors(tree_grads, stock_grads)
    worst = max(errors, key=errors.get)
    missed = [name for name, error in errors.items() if error > GRAD_RTOL]
    return StockComparison(
        trajectories=len(rollouts),
        parameters=len(errors),
        logit_abs=logit_abs,
        logit_rel=logit_abs / largest,
        loss_rel=abs(tree_loss - stock_loss) / abs(stock_loss),
        grad_rel=errors[worst],
        grad_worst=worst,
        grad_abs=max(float((tree_grads[n] - g).abs().max()) for n, g in stock_grads.items()),
        by_truth=judge_by_truth(model, rollouts, missed, tree_grads, stock_grads),
    )
