"""A call that checks itself: a sample of its trajectories against the stock forward, on the user's
own model, device and dtype (``RunConfig(verify=True)``).

Why: harts' equivalence tests run tiny models on CPU with harts' own kernels; a user runs their
checkpoint, GPU, dtype and kernel versions, which no test has seen. Before the call computes, the
check below runs on a few of its trajectories and raises :class:`VerificationError` when harts
disagrees with the model's own ``forward`` by more than rounding explains. It passes or fails
before the call touches ``.grad``; a passing check leaves everything as it was (the gradients the
model held, the random state), so the call then computes exactly what it computes unverified.

The check:

1. **The sample** (:func:`sample_trajectories`): two trajectories that part at a branch whose
   shared prefix is longest within ``MAX_PREFIX`` tokens, each kept ``TAIL`` tokens past it, so
   the sample's forest has a shared prefix and a branch and its cost does not grow with the
   trajectories' length; a forest without a branch gives its first trajectory.
2. **harts on the sample's own forest** under the call's kernels and plan, and its budget capped
   at half the sample's tokens when the call has one (a cut and a hand-over always run): the
   row values at every position of each sampled trajectory (its log-probs, or a critic's
   values) and, for a training call, the gradients of a fixed random per-row loss
   ``sum_r a_r * value_r + b_r * entropy_r`` whose form (a sum of per-row terms, or not) follows
   the call's loss, so the same path runs.
3. **Stock**: ``model(input_ids=trajectory)`` for each sampled trajectory alone, the same loss on
   its rows, the gradients summed over the trajectories; and the same on **the truth**, a copy of
   the model one precision up: fp64 for an fp32 model, fp32 for a bf16 / fp16 model or under
   autocast (the same model with autocast off).
4. **Bounds** derived from the dtype. fp32: harts' worst log-prob within ``max(2e-4, 2 x stock's
   worst)`` of the truth (each logit within the 1e-4 exactness bound, the log-sum-exp too); each
   parameter's gradient within ``max(1e-4 x its norm, 2 x stock's distance)`` of the truth, plus
   its share of the whole gradient's 1e-4 (``1e-4 x |g| x sqrt(n_p / n)``: a gradient that
   cancels has the rounding of its terms, which the whole gradient's scale bounds). Lower
   precision: harts no worse than ``LOW_PRECISION_FACTOR`` (2) x stock at the same precision, both
   measured against the truth, per parameter and for the whole gradient, with each parameter's
   share of stock's whole-gradient distance as its floor.

What it does not check: the call's own loss function (objectives are pure functions of the rows,
tested exactly), MoE statistics, trajectories outside the sample. Cost: the sample's stock
forwards (and backwards) twice, harts once on the sample, and one copy of the model in the truth's
dtype while the check runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from harts.forest import Forest, build_forest
from harts.runtime.config import RunConfig
from harts.runtime.readout import ScalarReadout
from harts.runtime.routing_replay import replayed_routing

__all__ = [
    "VerificationError",
    "Verification",
    "sample_trajectories",
    "sample_spans",
    "verify_sample",
    "LOW_PRECISION_FACTOR",
]

Tensor = torch.Tensor

LOGPROB_ATOL = 2e-4  # fp32: a log-prob is a logit minus a log-sum-exp, each within 1e-4 of exact
GRAD_RTOL = 1e-4  # fp32 gradient relative error (the exactness bound)
LOW_PRECISION_FACTOR = 2.0  # bf16 / fp16: harts' distance to the truth at most this times stock's
SAMPLE_SIZE = 2  # the fewest that share a prefix: the check's cost is their stock passes
MAX_PREFIX = 256  # the branch sampled shares at most this many tokens, when the forest has such a branch
TAIL = 32  # tokens kept of each sampled trajectory past its branch
_SEED = 20260


class VerificationError(RuntimeError):
    """harts disagreed with the stock forward on the call's sample by more than its bound; the
    message names the trajectory and position, or the parameter, the figure and the bound."""


@dataclass(frozen=True)
class Verification:
    """What a passing check measured: the sample (trajectory indices of the call), its tokens, the
    precision checked, harts' and stock's worst row error against the truth and the bound, the
    worst gradient error as a fraction of its bound (None for a forward-only call), seconds."""

    trajectories: tuple[int, ...]
    tokens: int
    precision: str
    value_error: float
    stock_value_error: float
    value_bound: float
    gradient_ratio: float | None
    seconds: float


def sample_trajectories(forest: Forest, limit: int = SAMPLE_SIZE) -> list[int]:
    """The sample's trajectories (in the call's order): at the branch node (a node several
    trajectories share, where they part) whose end is deepest within ``MAX_PREFIX`` tokens (else
    the shallowest), the shortest trajectory of each of the ``limit`` groups that part there (a
    child's subtree, or those ending at the node) with the shortest members. A forest without a
    branch gives its first trajectory."""
    return [i for i, _ in sample_spans(forest, limit)]


def sample_spans(forest: Forest, limit: int = SAMPLE_SIZE) -> list[tuple[int, int]]:
    """(trajectory, tokens kept) of the sample (:func:`sample_trajectories`): each truncated
    ``TAIL`` tokens past the branch."""
    parent = forest.node_parent.numpy()
    end_node = forest.trajectory_end_node.numpy()
    subtree_end = forest.node_subtree_end.numpy()
    lengths = forest.trajectory_length.numpy()
    children: dict[int, list[int]] = {}
    for node, p in enumerate(parent.tolist()):
        if p >= 0:
            children.setdefault(p, []).append(node)
    ends_here = np.bincount(end_node, minlength=forest.num_nodes)
    branch = [m for m in range(forest.num_nodes) if len(children.get(m, ())) + (ends_here[m] > 0) >= 2]
    if not branch:
        return [(0, int(lengths[0]))]
    path_end = forest.node_path_start.numpy() + forest.node_length.numpy()
    within = [m for m in branch if path_end[m] <= MAX_PREFIX]
    node = max(within, key=lambda m: path_end[m]) if within else min(branch, key=lambda m: path_end[m])
    groups = [np.flatnonzero(end_node == node)] if ends_here[node] else []
    groups += [np.flatnonzero((end_node >= c) & (end_node < subtree_end[c])) for c in children.get(node, ())]
    shortest = sorted((int(g[np.argmin(lengths[g])]) for g in groups if g.size), key=lambda i: lengths[i])
    keep = int(path_end[node]) + TAIL
    return sorted((i, min(int(lengths[i]), keep)) for i in shortest[:limit])


class _RowLoss:
    """``sum_r a_r * first_r + b_r * second_r``: a fixed random loss of the rows; with
    ``separable`` a sum of per-row terms (``subset`` and ``separable_rows``), as the call's is."""

    def __init__(self, a: Tensor, b: Tensor, separable: bool):
        self.a, self.b = a, b
        if separable:
            self.separable_rows = True
            self.subset = lambda index: _RowLoss(a[index], b[index], True)

    def __call__(self, first: Tensor, second: Tensor) -> Tensor:
        a, b = self.a.to(first.device, first.dtype), self.b.to(second.device, second.dtype)
        return (a * first).sum() + (b * second).sum()


def _rows(forest: Forest) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Every position ``p >= 1`` of every trajectory: (predictor [R], target [R], token paths)."""
    paths = [forest.trajectory_token_indices(i) for i in range(forest.num_trajectories)]
    predictor = torch.cat([path[:-1] for path in paths])
    target = forest.tokens[torch.cat([path[1:] for path in paths])]
    return predictor, target, paths


def _stock_rows(
    model: nn.Module, ids: Tensor, values: bool, temperature: float, autocast: bool = True
) -> tuple[Tensor, Tensor]:
    """The stock forward of one trajectory: (value, entropy) of each position ``p >= 1`` read at
    ``p - 1`` (log-prob of token ``p`` and the entropy; or the critic's value and zeros)."""
    if "forward" in model.__dict__ and not autocast:
        # a wrapper's forward on the instance (accelerate's) may enter autocast itself: the truth
        # runs the class's own forward, at the precision asked for
        out = type(model).forward(model, input_ids=ids[None])
    elif getattr(model, "vision_language", None) is not None:  # a text view: its whole model's forward
        out = model.multimodal(input_ids=ids[None])
    else:
        out = model(input_ids=ids[None])
    logits = out if isinstance(out, Tensor) else out.logits
    if values:
        value = logits[0, :-1, 0].float()
        return value, torch.zeros_like(value)
    logp = torch.log_softmax(logits[0, :-1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, ids[1:, None])[:, 0], entropy


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def _set_aside(params: list[nn.Parameter]):
    """The gradients ``params`` hold, set aside while the block runs (``.grad`` None) and put back
    after it, whatever the block left there: the check never changes what the call accumulates."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, before in zip(params, held, strict=True):
            p.grad = before


def _grads(named: list[tuple[str, nn.Parameter]]) -> dict[str, Tensor]:
    """Each parameter's gradient by name, fp64 on the CPU (zeros where none)."""
    zero = torch.zeros((), dtype=torch.float64)
    return {
        n: p.grad.detach().double().cpu() if p.grad is not None else zero.expand(p.shape) for n, p in named
    }


def _stock(
    model: nn.Module,
    trajectories: list[Tensor],
    loss: _RowLoss | None,
    values: bool,
    temperature: float,
    autocast: bool,
    routes: list[Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor] | None]:
    """Stock row values of the sample (fp64, concatenated) and, with ``loss``, the gradients of
    its loss summed over the trajectories (fp64 by name); ``routes``: each trajectory's recorded
    MoE routes, replayed in its forward."""
    device = next(model.parameters()).device
    named = _trainable(model)
    out, offset, grads = [], 0, None
    grad_mode = torch.enable_grad() if loss is not None else torch.no_grad()
    cast = contextlib.nullcontext() if autocast else torch.autocast(device.type, enabled=False)
    with _set_aside([p for _, p in named]), grad_mode, cast:
        for i, ids in enumerate(trajectories):
            ids = ids.to(device)
            replay = contextlib.nullcontext() if routes is None else replayed_routing(model, routes[i])
            with replay:
                first, second = _stock_rows(model, ids, values, temperature, autocast)
            rows = first.numel()
            if loss is not None:
                _RowLoss(loss.a[offset : offset + rows], loss.b[offset : offset + rows], False)(
                    first, second
                ).backward()
            out.append(first.detach().double().cpu())
            offset += rows
        if loss is not None:
            grads = _grads(named)
    return torch.cat(out), grads


def _truth_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` in ``dtype`` (eager MoE experts where the kernel has no fp64 path)."""
    truth = copy.deepcopy(model)
    for module in truth.modules():
        # a wrapper may have replaced ``forward`` on the instance (accelerate's output casting): the
        # copy keeps a function bound to the original model, which would run instead of the copy
        module.__dict__.pop("forward", None)
    if dtype == torch.float64:  # the outermost transformers model (a ValueHead wraps one)
        owner = next((m for m in truth.modules() if hasattr(m, "set_experts_implementation")), None)
        if owner is not None:
            try:
                owner.set_experts_implementation("eager")
            except (ValueError, AttributeError):  # a model without experts
                pass
    return truth.to(dtype)


def _precision(model: nn.Module) -> tuple[str, torch.dtype, bool]:
    """(label, the truth's dtype, whether the call runs under autocast)."""
    device = next(model.parameters()).device
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    autocast = torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)
    if autocast:
        low = torch.get_autocast_dtype(device.type)
        return f"{str(low).removeprefix('torch.')} autocast", torch.float32, True
    if dtype == torch.float32:
        return "fp32", torch.float64, False
    if dtype == torch.float64:
        return "fp64", torch.float64, False
    return f"{str(dtype).removeprefix('torch.')} parameters", torch.float32, False


def verify_sample(
    model: nn.Module,
    forest: Forest,
    *,
    run: RunConfig,
    harts_rows: Callable[[Forest, Tensor, Tensor, _RowLoss | None, RunConfig], Tensor],
    readout=None,
    temperature: float = 1.0,
    gradients: bool = True,
    separable: bool = True,
    what: str = "the call",
) -> Verification:
    """Check ``model`` (the module harts runs, whose ``forward`` is stock) on a sample of
    ``forest`` (module docstring); raise :class:`VerificationError` when harts is off.

    ``harts_rows(sub_forest, predictor, target, loss, run)``: harts' row values on the sample's
    forest under ``run`` (the call's settings, unverified, with the sample's budget: the call's,
    and at most half the sample's tokens when the call has one, so that a cut and a hand-over
    run); with ``loss`` (``gradients``), a training pass that accumulates that loss's gradients
    into ``.grad``. ``separable``: the call's loss is a sum of
    per-row terms (the sample's loss takes the same form, so the same path runs)."""
    if getattr(getattr(model, "vision_language", None), "runs_images", False):
        raise ValueError(
            "RunConfig(verify=True) runs the stock forward of a sample of token ids, which cannot carry a "
            "multimodal model's images: verify its text model, or leave verify off"
        )
    began = time.perf_counter()
    values = isinstance(readout, ScalarReadout)
    sample = sample_spans(forest)
    chosen = [i for i, _ in sample]
    trajectories = [forest.trajectory(i)[:keep] for i, keep in sample]
    routes = None
    if forest.routed_experts is not None:  # the sample replays its recorded routes, in harts and in stock
        routes = [forest.routed_experts[forest.trajectory_token_indices(i)[:keep]] for i, keep in sample]
    sub = build_forest([t.tolist() for t in trajectories], routed_experts=routes)
    predictor, target, _ = _rows(sub)
    label, truth_dtype, autocast = _precision(model)
    loss = None
    if gradients:
        gen = torch.Generator().manual_seed(_SEED)
        rows, scale = predictor.numel(), 1.0 / max(predictor.numel(), 1)
        a = torch.randn(rows, generator=gen, dtype=torch.float64) * scale
        b = torch.randn(rows, generator=gen, dtype=torch.float64) * (0.0 if values else scale)
        loss = _RowLoss(a, b, separable)
    named = _trainable(model)
    params = [p for _, p in named]
    budget = run.budget_tokens
    if budget is not None:
        budget = max(1, min(budget, sub.num_tokens // 2))
    sample_run = dataclasses.replace(run.unverified, budget_tokens=budget)
    with _set_aside(params):
        harts_values = harts_rows(sub, predictor, target, loss, sample_run).detach().double().cpu()
        harts_grads = _grads(named) if gradients else None
    stock_values, stock_grads = _stock(model, trajectories, loss, values, temperature, autocast, routes)
    truth = (
        model
        if (truth_dtype == torch.float32 and autocast) or label == "fp64"
        else _truth_model(model, truth_dtype)
    )
    with _set_aside(params):  # whatever the copy's forward reaches, the model's gradients stay as they were
        true_values, true_grads = _stock(truth, trajectories, loss, values, temperature, False, routes)
    del truth
    where = _Where(chosen, [t.numel() for t in trajectories])
    kind = "value" if values else "log-prob"
    value_error, value_bound, stock_error = _check_values(
        harts_values, stock_values, true_values, label, where, kind, what
    )
    ratio = None
    if gradients:
        ratio = _check_gradients(harts_grads, stock_grads, true_grads, label, chosen, what)
    return Verification(
        tuple(chosen),
        int(sub.num_flat_tokens),
        label,
        value_error,
        stock_error,
        value_bound,
        ratio,
        time.perf_counter() - began,
    )


class _Where:
    """Row index of the sample -> (the call's trajectory index, position)."""

    def __init__(self, chosen: list[int], lengths: list[int]):
        self.chosen = chosen
        self.starts = np.cumsum([0] + [n - 1 for n in lengths])

    def __call__(self, row: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.starts, row, side="right") - 1)
        return self.chosen[k], int(row - self.starts[k]) + 1


def _check_values(
    harts: Tensor, stock: Tensor, truth: Tensor, label: str, where: _Where, kind: str, what: str
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
            f"{kind} {float(harts[row]):.6g} is {worst:.3g} from the truth ({_truth_name(label)}), stock "
            f"{label}'s worst is {stock_worst:.3g}; bound {bound:.3g}. The call's gradients were not "
            f"computed; this setup (kernels, dtype, device) is not exact here"
        )
    return worst, bound, stock_worst


def _truth_name(label: str) -> str:
    return "the stock forward in fp64" if label in ("fp32", "fp64") else "the stock forward in fp32"


def _check_gradients(
    harts: dict, stock: dict, truth: dict, label: str, chosen: list[int], what: str
) -> float:
    """The worst parameter's error as a fraction of its bound (raises above 1)."""
    total = sum(t.numel() for t in truth.values())
    whole = math.sqrt(sum(float(t.pow(2).sum()) for t in truth.values()))
    stock_whole = math.sqrt(sum(float((stock[n] - t).pow(2).sum()) for n, t in truth.items()))
    harts_whole = math.sqrt(sum(float((harts[n] - t).pow(2).sum()) for n, t in truth.items()))
    low = label not in ("fp32", "fp64")
    worst_ratio, failures = 0.0, []
    if low and harts_whole > max(LOW_PRECISION_FACTOR * stock_whole, GRAD_RTOL * whole):
        bound = max(LOW_PRECISION_FACTOR * stock_whole, GRAD_RTOL * whole) / whole
        failures.append(("the whole gradient", harts_whole / whole, bound))
    for name, t in truth.items():
        share = math.sqrt(t.numel() / total)
        error = float((harts[name] - t).norm())
        stock_error = float((stock[name] - t).norm())
        norm = float(t.norm())
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
            f"harts' gradient is {error:.3g} (relative) from the truth ({_truth_name(label)}); bound "
            f"{bound:.3g}. The call's gradients were not computed; this setup (kernels, dtype, device) is "
            f"not exact here"
        )
    return worst_ratio
