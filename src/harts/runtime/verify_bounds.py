"""The bounds of ``RunConfig(verify=True)`` (:mod:`harts.runtime.verify`) and the errors that name
what broke them: kept apart from the sampling and the passes so that each module stays one
subject, the arithmetic here (the figures, their bounds, why they hold) and the running there.

Row values: harts' worst row error against the truth within ``max(LOGPROB_ATOL, 2 x stock's
worst)`` in fp32 (``LOW_PRECISION_FACTOR`` x in bf16 / fp16). Gradients: per parameter and for the
whole gradient (:func:`check_gradients`). The low-precision kernels' bound is derived in
:mod:`harts.runtime.verify_kernels`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from harts.runtime.verify_kernels import KernelFigures

__all__ = [
    "VerificationError",
    "Where",
    "check_values",
    "check_gradients",
    "raise_on_kernels",
    "LOGPROB_ATOL",
    "GRAD_RTOL",
    "LOW_PRECISION_FACTOR",
]

LOGPROB_ATOL = 2e-4  # fp32: a log-prob is a logit minus a log-sum-exp, each within 1e-4 of exact
GRAD_RTOL = 1e-4  # fp32 gradient relative error (the exactness bound)
LOW_PRECISION_FACTOR = 2.0  # bf16 / fp16: harts' distance to the truth at most this times stock's


class VerificationError(RuntimeError):
    """harts disagreed with the stock forward on the call's sample by more than its bound; the
    message names the trajectory and position, or the parameter, the figure and the bound."""


def raise_on_kernels(kernel: KernelFigures, label: str, chosen: list[int], what: str) -> None:
    if kernel.error <= kernel.bound:
        return
    raise VerificationError(
        f"verification of {what} failed ({label}) on trajectories {chosen}: tree attention's kernel in "
        f"{label.split()[0]} is {kernel.error:.3g} from itself in fp32 on the same inputs over the "
        f"sample's {kernel.calls} calls ({kernel.relative_u:.2f} units of roundoff of its output's norm); "
        f"bound {kernel.bound:.3g} (its output's and probabilities' rounding). The call's gradients were "
        f"not computed; this kernel is not exact in this precision"
    )


class Where:
    """Row index of the sample -> (the call's trajectory index, position); ``shift``: a sample
    brought within its prefix (:func:`harts.runtime.verify_sample.within_prefix`) has its positions
    from ``after`` on that many places earlier than the call's trajectory."""

    def __init__(self, chosen: list[int], lengths: list[int], after: int = 0, shift: int = 0):
        self.chosen, self.after, self.shift = chosen, after, shift
        self.starts = np.cumsum([0] + [n - 1 for n in lengths])

    def __call__(self, row: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.starts, row, side="right") - 1)
        position = int(row - self.starts[k]) + 1
        return self.chosen[k], position + (self.shift if self.shift and position >= self.after else 0)


def check_values(
    harts: Tensor, stock: Tensor, truth: Tensor, label: str, where: Where, kind: str, what: str
) -> tuple[float, float, float]:
    harts_error, stock_error = (harts - truth).abs(), (stock - truth).abs()
    worst, stock_worst = float(harts_error.max()), float(stock_error.max())
    if label in ("fp32", "fp64"):
        bound = max(LOGPROB_ATOL, 2.0 * stock_worst)
    else:  # never stricter than fp32's bound (a stock that computes in fp32 here has no error)
        bound = max(LOGPROB_ATOL, LOW_PRECISION_FACTOR * stock_worst)
    if not worst <= bound:
        row = int(harts_error.argmax())
        trajectory, position = where(row)
        raise VerificationError(
            f"verification of {what} failed ({label}): trajectory {trajectory}, position {position}: harts' "
            f"{kind} {float(harts[row]):.6g} is {worst:.3g} from the truth ({truth_name(label)}), stock "
            f"{label}'s worst is {stock_worst:.3g}; bound {bound:.3g}. The call's gradients were not "
            f"computed; this setup (kernels, dtype, device) is not exact here"
        )
    return worst, bound, stock_worst


def truth_name(label: str) -> str:
    return "the stock forward in fp64" if label in ("fp32", "fp64") else "the stock forward in fp32"


def check_gradients(
    harts: dict, stock: dict, truth: dict, label: str, chosen: list[int], what: str, reduce=None
) -> float:
    """The worst parameter's error as a fraction of its bound (raises above 1). ``reduce``: sums a
    tensor over the ranks in place, where each rank holds its shard of every gradient (FSDP2):
    the figures below are sums of squares over a parameter's elements, so the shards' sums add
    up to the whole parameter's and every rank reaches the same verdict."""
    names = list(truth)
    figures = torch.tensor(
        [
            [
                float(t.numel()),
                float(t.pow(2).sum()),
                float((harts[n] - t).pow(2).sum()),
                float((stock[n] - t).pow(2).sum()),
            ]
            for n, t in truth.items()
        ],
        dtype=torch.float64,
    ).reshape(len(names), 4)
    if reduce is not None:
        reduce(figures)
    numel, norm2, error2, stock2 = figures.unbind(1)
    total = float(numel.sum())
    whole = math.sqrt(float(norm2.sum()))
    stock_whole = math.sqrt(float(stock2.sum()))
    harts_whole = math.sqrt(float(error2.sum()))
    low = label not in ("fp32", "fp64")
    worst_ratio, failures = 0.0, []
    if low and harts_whole > max(LOW_PRECISION_FACTOR * stock_whole, GRAD_RTOL * whole):
        bound = max(LOW_PRECISION_FACTOR * stock_whole, GRAD_RTOL * whole) / whole
        failures.append(("the whole gradient", harts_whole / whole, bound))
    for k, name in enumerate(names):
        share = math.sqrt(float(numel[k]) / total)
        error, stock_error, norm = (math.sqrt(float(x[k])) for x in (error2, stock2, norm2))
        if low:  # never stricter than fp32's bound
            bound = max(
                LOW_PRECISION_FACTOR * stock_error + stock_whole * share,
                GRAD_RTOL * norm + GRAD_RTOL * whole * share,
            )
        else:
            bound = max(GRAD_RTOL * norm, 2.0 * stock_error) + GRAD_RTOL * whole * share
        if bound == 0.0:
            bound = torch.finfo(torch.float32).tiny
        worst_ratio = max(worst_ratio, error / bound)
        if error > bound:
            failures.append((name, error / max(norm, 1e-30), bound / max(norm, 1e-30)))
    if failures:
        failures.sort(key=lambda f: f[1] / f[2], reverse=True)
        name, error, bound = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise VerificationError(
            f"verification of {what} failed ({label}) on trajectories {chosen}: parameter {name}{more}: "
            f"harts' gradient is {error:.3g} (relative) from the truth ({truth_name(label)}); bound "
            f"{bound:.3g}. The call's gradients were not computed; this setup (kernels, dtype, device) is "
            f"not exact here"
        )
    return worst_ratio
