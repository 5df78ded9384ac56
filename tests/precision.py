"""Low precision judged against the exact truth, next to stock at the same precision: shared by
test_autocast (CPU autocast), test_gpu_precision (CUDA: fp32, bf16 autocast, bf16 parameters) and
test_integrations_trl_bf16 (the bounds only).

A low-precision harts result is no worse than the stock forward of each trajectory alone at the
same precision, both measured against the fp64 stock forward of the same weights (tests/test_autocast.py
derives the bounds, :func:`no_worse_failures` applies them). :func:`stock` and :func:`tree` run one
small tree of trajectories on any device, under autocast to ``dtype`` or, with ``dtype=None``, in
the model's own dtype (bf16 parameters); :func:`truth` is the fp64 reference of a CPU model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math

import torch

import harts
from harts.tiny import tiny_config, tiny_model
from tests.reference import exact_linear_kernels, fp64_copy, param_grads

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# One small tree: a shared prefix, branches at two depths, an unrelated root.
TRAJECTORIES = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13],
    [5, 6, 7, 8, 20, 21, 22],
    [5, 6, 7, 30, 31],
    [40, 41, 42, 43],
]
SUM = harts.Normalizers(torch.tensor(1.0), torch.tensor(1.0))  # the plain SFT sum


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` at |value|."""
    mantissa = torch.finfo(dtype).eps  # ulp(1)
    return mantissa * 2.0 ** math.floor(math.log2(max(abs(value), torch.finfo(dtype).tiny)))


def angle(a: torch.Tensor, b: torch.Tensor) -> float:
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).clamp(-1, 1)
    return math.acos(cos.item())


def global_relative_error(got: dict, exact: dict) -> float:
    """||got - exact|| / ||exact|| over all parameters' gradients together: the error in the update
    an optimiser applies. Single decay parameters (``A_log``, ``dt_bias``) are sums with heavy
    cancellation whose relative error in low precision is a coin toss of rounding order, for stock
    as for harts; their sizes are in the whole vector's error all the same."""
    diff = sum(((got[k].double() - r.double()) ** 2).sum().item() for k, r in exact.items())
    return math.sqrt(diff) / math.sqrt(sum((r.double() ** 2).sum().item() for r in exact.values()))


def every_expert(family: str) -> dict:
    """Config overrides that make the family's MoE layers choose every expert (test_autocast's
    docstring: top-k choice flips by rounding are discontinuities, not arithmetic)."""
    config = tiny_config(family)
    experts = next((getattr(config, k) for k in ("n_routed_experts", "num_local_experts", "num_experts")
                    if getattr(config, k, None)), None)  # fmt: skip
    if experts is None or not hasattr(config, "num_experts_per_tok"):
        return {}
    overrides = {"num_experts_per_tok": experts}
    if getattr(config, "n_group", None):
        overrides["topk_group"] = config.n_group
    return overrides


@functools.cache
def model_of(family: str, dtype: torch.dtype = torch.float32, seed: int = 7):
    """The family's tiny CPU model (every expert chosen), its parameters in ``dtype`` (otherwise
    than fp32: the fp32 model's weights rounded, every parameter, as a pure low-precision model)."""
    if dtype == torch.float32:
        return tiny_model(family, seed=seed, **every_expert(family))
    return copy.deepcopy(model_of(family, seed=seed)).to(dtype)


def sft_rows(logits: torch.Tensor, trajectory) -> torch.Tensor:
    """Next-token log-probs: the log-softmax in fp32 (fp64 for the truth), as stock losses take it."""
    ids = torch.tensor(trajectory, device=logits.device)
    logits = logits[:-1].to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]


@functools.cache
def truth(family: str, dtype: torch.dtype = torch.float32, seed: int = 7):
    """fp64 logits, next-token log-probs and SFT-sum gradients of ``model_of(family, dtype, seed)``'s
    weights, one stock forward per trajectory."""
    model64 = fp64_copy(model_of(family, dtype, seed))
    model64.zero_grad(set_to_none=True)
    logits, logprobs = [], []
    with exact_linear_kernels(model64):
        for t in TRAJECTORIES:
            out = model64(input_ids=torch.tensor([t])).logits[0]
            lp = sft_rows(out, t)
            (-lp.sum()).backward()
            logits.append(out.detach())
            logprobs.append(lp.detach())
    return logits, logprobs, param_grads(model64)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _on_cpu(grads: dict) -> dict:
    return {k: g.cpu() for k, g in grads.items()}


def stock(model, dtype: torch.dtype | None):
    """The stock forward of each trajectory alone on the model's device, under autocast to
    ``dtype`` (None: none); backward outside it, as trainers do. Values come back on the CPU."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    logits, logprobs = [], []
    for t in TRAJECTORIES:
        with _autocast(device, dtype):
            out = model(input_ids=torch.tensor([t], device=device)).logits[0]
            lp = sft_rows(out, t)  # the loss's log-softmax in fp32 over the low-precision logits
        (-lp.sum()).backward()
        logits.append(out.detach().cpu().double())
        logprobs.append(lp.detach().cpu().double())
    return logits, logprobs, _on_cpu(param_grads(model))


def tree(model, dtype: torch.dtype | None):
    """harts.forward's logits and log-probs (under autocast to ``dtype``; None: none), and the SFT
    sum's gradients through ``rollout_step`` in micro-batches of at most 7 tokens (hand-overs
    between them). Values come back on the CPU."""
    device = next(model.parameters()).device
    forest = harts.build_forest(TRAJECTORIES)
    with torch.no_grad(), _autocast(device, dtype):
        out = harts.forward(model, forest)
        logits = [out.trajectory_logits(i).cpu().double() for i in range(len(TRAJECTORIES))]
        logprobs = [out.trajectory_logprobs(i).cpu().double() for i in range(len(TRAJECTORIES))]
    model.zero_grad(set_to_none=True)
    with _autocast(device, dtype):
        rollouts = [harts.Rollout(t) for t in TRAJECTORIES]
        harts.rollout_step(
            model, rollouts, harts.PolicyLossConfig(kind="sft"), normalizers=SUM, budget_tokens=7
        )
    return logits, logprobs, _on_cpu(param_grads(model))


def errors(got, exact) -> dict:
    """Per trajectory: log-prob max error and logit angle; the whole gradient's relative error."""
    logits, logprobs, grads = got
    return {
        "logprob": [(a - b).abs().max().item() for a, b in zip(logprobs, exact[1], strict=True)],
        "angle": [angle(a, b) for a, b in zip(logits, exact[0], strict=True)],
        "grad": global_relative_error(grads, exact[2]),
    }


def no_worse_failures(theirs: dict, mine: dict, exact, dtype: torch.dtype) -> list[str]:
    """The bounds of test_autocast's docstring, for :func:`errors` of stock (``theirs``) and harts
    (``mine``) at the precision whose unit roundoff is ``dtype``'s; one message per miss."""
    u, failures = UNIT_ROUNDOFF[dtype], []
    for i, lp in enumerate(exact[1]):
        bound = 2 * theirs["logprob"][i] + 2 * ulp(lp.abs().max().item(), dtype)
        if mine["logprob"][i] > bound:
            failures.append(f"trajectory {i}: log-prob error {mine['logprob'][i]:.3g} > {bound:.3g} "
                            f"(stock {theirs['logprob'][i]:.3g})")  # fmt: skip
        bound = 2 * theirs["angle"][i] + 4 * u
        if mine["angle"][i] > bound:
            failures.append(f"trajectory {i}: logit angle {mine['angle'][i]:.3g} > {bound:.3g} "
                            f"(stock {theirs['angle'][i]:.3g})")  # fmt: skip
    bound = 2 * theirs["grad"] + 4 * u
    if mine["grad"] > bound:
        failures.append(f"gradient error {mine['grad']:.3g} > {bound:.3g} (stock {theirs['grad']:.3g})")
    return failures


def summary(errs: dict) -> dict:
    """The figures a report table shows: worst log-prob error, lowest logit cosine, gradient error."""
    return {
        "logprob_max_error": max(errs["logprob"]),
        "logit_cosine_min": min(math.cos(a) for a in errs["angle"]),
        "grad_relative_error": errs["grad"],
    }


#: the set-ups of a low-precision run: (parameter dtype, autocast dtype or None)
SETUPS = {"bf16-autocast": (torch.float32, torch.bfloat16), "bf16-params": (torch.bfloat16, None)}
#: the tiny models (seeds) over which :func:`summed_errors` adds each error
SEEDS = (7, 1, 2, 3, 4, 5, 6, 8)


def summed_errors(family: str, setup: str, seeds=SEEDS) -> tuple[dict, dict]:
    """Stock's and harts' errors in ``setup`` (:data:`SETUPS`), each summed over the family's tiny
    models of ``seeds``: {"logprob": sum of each model's worst log-prob error, "grad": sum of each
    model's whole-gradient relative error} for stock, then for harts (test_autocast's ratio test)."""
    params, autocast = SETUPS[setup]
    theirs, mine = {"logprob": 0.0, "grad": 0.0}, {"logprob": 0.0, "grad": 0.0}
    for seed in seeds:
        model, exact = model_of(family, params, seed), truth(family, params, seed)
        for total, run in ((theirs, stock), (mine, tree)):
            errs = errors(run(model, autocast), exact)
            total["logprob"] += max(errs["logprob"])
            total["grad"] += errs["grad"]
    return theirs, mine
