"""Low-precision judgement shared by the autocast tests: unit roundoffs, ulps, the angle between
logit vectors and the relative error of a whole gradient (or update) vector.

A low-precision harts result is judged against an exact (fp64, or fp32 where the low precision's
error is 2^16 times larger) truth next to the stock result at the same precision: harts' error may
be at most twice stock's plus a few roundings of the low dtype (tests/test_autocast.py says why).
Used by test_autocast, test_gpu_precision and test_integrations_trl_bf16.
"""

from __future__ import annotations

import math

import torch

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


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
