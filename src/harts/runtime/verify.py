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
   shared prefix is longest within ``MAX_PREFIX`` tokens, each kept ``TAIL`` tokens past it (a
   deeper branch brought within ``MAX_PREFIX``: :func:`~harts.runtime.verify_sample.within_prefix`),
   so the sample's forest has a shared prefix and a branch and its cost grows neither with the
   trajectories' length nor with their prompt's; a forest without a branch gives its first
   trajectory.
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
   share of stock's whole-gradient distance as its floor: blunt (stock bf16's error is large and
   mostly shared with harts), so two more checks run in low precision:
5. **(a) the algorithm at fp32**: harts under the call's backend and plan on the truth (the fp32
   copy, or the model with autocast off) against stock fp32, both from a stock fp64 copy, with the
   fp32 bounds: plumbing, masks, hand-offs and plans do not depend on the precision, and a fault
   present in every precision shows at fp32's 1e-3.
6. **(b) the kernels in the call's precision**: each low-precision tree-attention call of the
   sample, recorded, against the same kernel in fp32 on the same inputs, under a deterministic
   bound from the output's and the probabilities' rounding (:mod:`harts.runtime.verify_kernels`).

What it does not check: the call's own loss function (objectives are pure functions of the rows,
tested exactly), MoE statistics, trajectories outside the sample. Cost: the sample's stock
forwards (and backwards) twice, harts once on the sample, and one copy of the model in the truth's
dtype while the check runs; in low precision also harts at fp32, stock in fp64 on an fp64 copy
(one copy held at a time) and two fp32 runs of each recorded attention call.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from harts.forest import Forest
from harts.ops.backends import resolve_backend
from harts.runtime.config import RunConfig
from harts.runtime.distributed import all_reduce_sum
from harts.runtime.readout import ScalarReadout
from harts.runtime.verify_bounds import (
    LOW_PRECISION_FACTOR,
    VerificationError,
    Where,
    check_gradients,
    check_values,
    raise_on_kernels,
)
from harts.runtime.verify_kernels import KernelCalls, check_kernels, recording
from harts.runtime.verify_sample import (
    Sample,
    sample_spans,
    sample_trajectories,
)
from harts.runtime.verify_sharded import (
    agree,
    agreed_kernels,
    sharded_truth,
)
from harts.runtime.verify_stock import (
    RowLoss,
    grads_by_name,
    set_aside,
    trainable,
    truth_model,
)

__all__ = [
    "VerificationError",
    "Verification",
    "sample_trajectories",
    "sample_spans",
    "verify_sample",
    "LOW_PRECISION_FACTOR",
    "entry_point",
    "readout_on",
]

Tensor = torch.Tensor


#: the public function the user called, which an error names (the outermost :func:`entry_point`)
_ENTRY: contextvars.ContextVar[str | None] = contextvars.ContextVar("harts_verify_entry", default=None)


@contextlib.contextmanager
def entry_point(name: str):
    """While the block runs, a failed check names ``name`` (the function the user called), unless
    an enclosing block named another: ``rollout_step`` runs ``forest_step``, and its error says
    ``rollout_step``."""
    token = _ENTRY.set(name) if _ENTRY.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _ENTRY.reset(token)


@dataclass(frozen=True)
class Verification:
    """What a passing check measured: the sample (trajectory indices of the call), its tokens, the
    precision checked, harts' and stock's worst row error against the truth and the bound, the
    worst gradient error as a fraction of its bound (None for a forward-only call), seconds.

    In low precision (bf16 / fp16 parameters or autocast) also: harts' algorithm at fp32 (its
    worst row error against the fp64 truth, the bound, its worst gradient error as a fraction of
    its bound) and the attention kernels in the call's precision against themselves in fp32
    (their error as a fraction of its bound, the same error in units of roundoff of the output's
    norm, the calls compared: :mod:`harts.runtime.verify_kernels`); None where not measured."""

    trajectories: tuple[int, ...]
    tokens: int
    precision: str
    value_error: float
    stock_value_error: float | None  # None: not measured (fp32: harts met the bounds of an exact stock)
    value_bound: float
    gradient_ratio: float | None
    seconds: float
    algorithm_value_error: float | None = None
    algorithm_value_bound: float | None = None
    algorithm_gradient_ratio: float | None = None
    kernel_ratio: float | None = None
    kernel_error_u: float | None = None
    kernel_calls: int | None = None

    def metrics(self) -> dict[str, Tensor]:
        """The figures as a result's metrics (0-dim fp64 tensors, names ``verify_*``), those measured."""
        names = (
            "value_error",
            "stock_value_error",
            "value_bound",
            "gradient_ratio",
            "seconds",
            "algorithm_value_error",
            "algorithm_value_bound",
            "algorithm_gradient_ratio",
            "kernel_ratio",
            "kernel_error_u",
        )
        figures = {n: getattr(self, n) for n in names}
        return {
            f"verify_{n}": torch.tensor(float(v), dtype=torch.float64)
            for n, v in figures.items()
            if v is not None
        }


def verify_sample(
    model: nn.Module,
    forest: Forest,
    *,
    run: RunConfig,
    harts_rows: Callable[[nn.Module | None, Forest, Tensor, Tensor, RowLoss | None, RunConfig], Tensor],
    readout=None,
    temperature: float = 1.0,
    gradients: bool = True,
    separable: bool = True,
    what: str = "the call",
) -> Verification:
    """Check ``model`` (the module harts runs, whose ``forward`` is stock) on a sample of
    ``forest`` (module docstring); raise :class:`VerificationError` when harts is off.

    ``harts_rows(on, sub_forest, predictor, target, loss, run)``: harts' row values on the sample's
    forest under ``run`` (the call's settings, unverified, with the sample's budget: the call's,
    and at most half the sample's tokens when the call has one, so that a cut and a hand-over
    run), on the call's model when ``on`` is None, else on ``on`` (a copy of it one precision up)
    with ``readout`` moved onto the copy; with ``loss`` (``gradients``), a training pass that
    accumulates that loss's gradients into ``.grad``. ``separable``: the call's loss is a sum of
    per-row terms (the sample's loss takes the same form, so the same path runs). ``what``: the
    entry point named in an error, unless the user called another (:func:`entry_point`)."""
    began = time.perf_counter()
    what = _ENTRY.get() or what
    sample = Sample.of(
        model, forest, run, isinstance(readout, ScalarReadout), temperature, gradients, separable
    )

    def on_sample(on: nn.Module | None, backend: str) -> tuple[Tensor, dict | None]:
        """harts on the sample (on ``on``, or the call's model), its gradients set aside."""
        named = trainable(model if on is None else on)
        with set_aside([p for _, p in named]):
            out = harts_rows(
                on,
                sample.sub,
                sample.predictor,
                sample.target,
                sample.loss,
                dataclasses.replace(sample.run, backend=backend),
            )
            grads = grads_by_name(named) if gradients else None
            if grads is not None and sample.sharded:  # the sum of every rank's pass of the same sample
                grads = {n: g / dist.get_world_size() for n, g in grads.items()}
            return out.detach().double().cpu(), grads

    kernels = KernelCalls()
    recorder = recording(resolve_backend(run.backend, _device(model))[0]) if sample.low else None
    with recorder if recorder is not None else contextlib.nullcontext() as rec:
        harts_values = on_sample(None, rec[0] if rec is not None else run.backend)
        kernels = rec[1] if rec is not None else kernels
    # fp32 on one process: stock at the call's precision only where its error sets a bound
    at_call = functools.partial(sample.stock, model, sample.autocast)
    at_call_values = at_call if not (sample.low or sample.sharded) else at_call()
    copy_of = sharded_truth if sample.sharded else truth_model
    truth = model if (sample.autocast or sample.label == "fp64") else copy_of(model, sample.truth_dtype)
    with set_aside([p for _, p in trainable(model)]):  # the copy's forward leaves the model's gradients
        true_values = sample.stock(truth, False)
    algorithm = None
    if sample.low:  # (a) harts' algorithm at fp32, on the truth, against the stock forward in fp64
        with torch.autocast(_device(model).type, enabled=False):
            fp32 = on_sample(None if truth is model else truth, run.backend)
        del truth  # one copy held at a time: the fp64 one is made after
        _collect(sample.sharded)
        fp64 = _stock_fp64(model, sample)
        algorithm = functools.partial(_algorithm_at_fp32, fp32, true_values, fp64, sample, what)
    else:
        del truth
        _collect(sample.sharded)
    figures: dict[str, float] = {}
    outcome = _verdict(sample, harts_values, true_values, at_call_values, kernels, what, figures, algorithm)
    seconds = time.perf_counter() - began
    return Verification(
        tuple(sample.chosen), int(sample.sub.num_flat_tokens), sample.label, *outcome, seconds, **figures
    )


def _verdict(
    sample: Sample, harts, truth, at_call, kernels: KernelCalls, what: str, figures: dict, algorithm=None
):
    """(value error, stock's value error or None, value bound, gradient ratio or None): in low
    precision the check of the ``algorithm`` at fp32 and the kernels' (into ``figures``), then the
    comparison against the truth; on FSDP2 ranks the verdict agreed, so every rank stops or none
    (the kernels' figures agreed first, every rank calling each collective whatever its own)."""
    kernel = check_kernels(kernels)
    if sample.sharded:  # each rank recorded its own calls: the worst rank's figures on every rank
        kernel = agreed_kernels(kernel)
    failed, outcome = None, None
    try:
        if algorithm is not None:  # (a) the algorithm at fp32: a fault in every precision shows here
            figures.update(algorithm())
        if kernel is not None:  # (b) the kernels in the call's precision, the finer diagnosis first
            raise_on_kernels(kernel, sample.label, sample.chosen, what)
            figures.update(
                kernel_ratio=kernel.ratio, kernel_error_u=kernel.relative_u, kernel_calls=kernel.calls
            )
        reduce = all_reduce_sum if sample.sharded else None  # each rank holds its shards of the gradients
        about = (sample.chosen, what, reduce)
        error, bound, stock_error, ratio = _against_truth(
            harts, truth, at_call, sample.label, sample.where, sample.kind, about
        )
        outcome = (error, stock_error, bound, ratio)
    except VerificationError as exc:
        failed = str(exc)
        if not sample.sharded:
            raise
    if sample.sharded and (failed := agree(failed)) is not None:  # every rank stops, or none
        raise VerificationError(failed)
    return outcome


def _against_truth(harts, truth, stock, label: str, where: Where, kind: str, about: tuple):
    """(value error, value bound, stock's value error or None, gradient ratio or None) of harts'
    ``(values, gradients)`` against the truth's; ``about``: (the sample's trajectories, the entry
    point, the gradient figures' reduction). ``stock``: the stock forward's at the call's precision,
    or (fp32) the function that runs it, called only when harts misses the bounds an exact stock
    sets: each fp32 bound grows with stock's error, so passing those passes the real ones, and
    the verdict is the one the stock pass would give, with one stock pass instead of two."""
    chosen, what, reduce = about
    if callable(stock):
        try:
            error, bound, _, ratio = _against_truth(harts, truth, truth, label, where, kind, about)
            return error, bound, None, ratio
        except VerificationError:
            stock = stock()
    error, bound, stock_error = check_values(harts[0], stock[0], truth[0], label, where, kind, what)
    ratio = None
    if harts[1] is not None:
        ratio = check_gradients(harts[1], stock[1], truth[1], label, chosen, what, reduce)
    return error, bound, stock_error, ratio


def _algorithm_at_fp32(fp32, stock, fp64, sample: Sample, what: str) -> dict:
    """The fp32 check (fp32 bounds) of harts at fp32 on a copy of a low-precision model:
    ``fp32``, ``stock`` (stock fp32) and ``fp64`` are (row values, gradients or None); on FSDP2
    ranks each holds its shards of the gradients, their figures summed over the ranks."""
    what = f"{what} (its algorithm, at fp32 on a copy of the model)"
    error, bound, _ = check_values(fp32[0], stock[0], fp64[0], "fp32", sample.where, sample.kind, what)
    figures = {"algorithm_value_error": error, "algorithm_value_bound": bound}
    if fp32[1] is not None:
        reduce = all_reduce_sum if sample.sharded else None
        figures["algorithm_gradient_ratio"] = check_gradients(
            fp32[1], stock[1], fp64[1], "fp32", sample.chosen, what, reduce
        )
    return figures


def _stock_fp64(model, sample: Sample) -> tuple[Tensor, dict | None]:
    """The stock forward (and backward) of the sample on a copy of ``model`` in fp64 (a shard copy
    on FSDP2 ranks), the copy dropped after: the truth of the fp32 check of a low-precision call."""
    fp64 = (sharded_truth if sample.sharded else truth_model)(model, torch.float64)
    with set_aside([p for _, p in trainable(model)]):
        out = sample.stock(fp64, False)
    del fp64
    _collect(sample.sharded)
    return out


def _collect(sharded: bool) -> None:
    """Free a dropped shard copy now: FSDP2's hooks and states hold its modules in reference
    cycles, which only the cycle collector frees (a plain copy goes with its last reference)."""
    if sharded:
        gc.collect()


def readout_on(readout, model: nn.Module, on: nn.Module | None):
    """``readout`` reading ``on`` (a copy of ``model``) where it read ``model``: its head (a
    module of the model) swapped for the copy's module of the same name."""
    head = getattr(readout, "head", None)
    if on is None or head is None:
        return readout
    name = next((n for n, m in model.named_modules() if m is head), None)
    if name is None:
        raise ValueError("RunConfig(verify=True): the readout's head is not a module of the model it reads")
    moved = copy.copy(readout)
    moved.head = on.get_submodule(name)
    return moved


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
