"""The low-precision half of ``RunConfig(verify=True)``: are the call's attention kernels right in
this precision?

Why a check of its own: in bf16 a whole-model comparison is blunt. Stock bf16's log-probs sit
about 4e-2 (RMS) from the fp32 truth on the tiny models, most of it rounding that harts shares
with stock (the same hidden states, rounded at the same points); a kernel whose output is off by
1-5% moves harts' log-probs by less than that, sometimes towards the truth. Whether harts'
*algorithm* is right on the set-up (plumbing, masks, hand-offs, plans) does not depend on the
precision: :mod:`harts.runtime.verify` answers it at fp32, where a 1e-3 fault stands far above the
rounding. What is left is whether the kernels, which alone compute differently in bf16, are right
in bf16; this module answers that op by op, where a kernel's rounding is a few units in the last
place and a 1% fault is several.

How: while harts runs the sample in the call's precision, each tree-attention call of the call's
backend is recorded (its inputs and its output, :func:`recording`). Afterwards each is run again
by the same kernel on the same inputs upcast to fp32 (exactly representable: no input changes),
with autocast off; the fp32 kernel is the one the fp32 check has just found right. Over all the
sample's calls in low precision, with ``o`` the recorded output, ``r`` the fp32 one and ``E``
the same kernel's fp32 output on ``|v|`` (``E_i = sum_j p_ij |v_j|``, the softmax weights being
non-negative):

    ||o - r|| <= u (||r|| + ||E||) + m 2^-24 ||E||

(Frobenius norms over every call; ``u`` the unit roundoff of the output's dtype, 2^-8 bf16 and
2^-11 fp16; ``m`` the most keys a query of the sample sees.) Why it holds for a right kernel: a
low-precision attention kernel keeps its scores and softmax in fp32 (FlashAttention's contract;
SDPA's), rounds the probabilities to the input precision for the product with ``v`` (an error of
at most ``u p_ij`` each: ``u E_i`` in ``o_i``), accumulates in fp32 (at most ``m 2^-24 E_i``) and
rounds the output once (``u |r_i|``); the norm of a sum of these per-element bounds is at most
the sum of their norms. The bound is deterministic (no count seen on any machine, any thread
count or instruction set), and concentrates nothing away: a kernel that scales its output by
``1 + e`` is ``e ||r||`` from the truth, caught once ``e > u (1 + ||E|| / ||r||)``; on the tiny
models ``||E|| / ||r||`` is 1.5-4, so a 2% fault is caught, a 1% fault (found at fp32 when it is
there in every precision) only where attention is sharp. Measured, the exact kernels sit at
0.45-0.56 u ||r|| (docs/verification.md).

What it does not check: the kernels' backward in low precision (the fp32 check covers their
gradients in every precision; the whole-model bounds of :mod:`harts.runtime.verify` catch gross
faults in bf16), the recurrences' kernels (ditto), and kernels that round their scores to the low
precision (the bound assumes fp32 scores).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from harts.ops.backends import Backend, temporary_backend, use_backend

__all__ = ["KernelCalls", "recording", "check_kernels", "FP32_UNIT_ROUNDOFF"]

Tensor = torch.Tensor

FP32_UNIT_ROUNDOFF = 2.0**-24
_LOW = (torch.bfloat16, torch.float16)


@dataclass
class KernelCalls:
    """The low-precision tree-attention calls of the sample's pass: (the kernel, args, kwargs,
    output), inputs and output detached."""

    kernel: object = None
    calls: list = field(default_factory=list)


@contextlib.contextmanager
def recording(backend_name: str):
    """A backend named after ``backend_name`` whose attention is that backend's, recording each
    call in low precision into the yielded :class:`KernelCalls` (its outputs are the kernel's own:
    the pass computes the same bits)."""
    with use_backend(backend_name) as base:
        pass
    record = KernelCalls(kernel=base.attention)

    def attention(q, k, v, *args, **kwargs):
        out = base.attention(q, k, v, *args, **kwargs)
        if q.dtype in _LOW:
            record.calls.append(((q.detach(), k.detach(), v.detach(), *args), kwargs, out.detach()))
        return out

    # the same name as the call's backend, so that the sample's plans are those it would make
    backend = Backend(base.name, base.recurrences, attention)
    with temporary_backend(f"{backend_name}+verify-record", backend) as name:
        yield name, record


def _up(value):
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.detach().float()
    return value


@dataclass(frozen=True)
class KernelFigures:
    """The sample's low-precision attention calls against the same kernel in fp32: ``error`` =
    ||o - r||, ``bound`` (module docstring), ``relative`` = ||o - r|| / ||r||, in units of u."""

    calls: int
    error: float
    bound: float
    relative_u: float

    @property
    def ratio(self) -> float:
        return self.error / self.bound if self.bound > 0 else 0.0


def check_kernels(record: KernelCalls) -> KernelFigures | None:
    """The figures of :func:`recording`'s calls (None when no call ran in low precision)."""
    if not record.calls:
        return None
    error2 = ref2 = abs2 = 0.0
    u, keys = 0.0, 1
    device = record.calls[0][2].device
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for args, kwargs, out in record.calls:
            up_args, up_kwargs = [_up(a) for a in args], {n: _up(a) for n, a in kwargs.items()}
            ref = record.kernel(*up_args, **up_kwargs)
            up_args[2] = up_args[2].abs()
            spread = record.kernel(*up_args, **up_kwargs)
            error2 += float((out.float() - ref).double().pow(2).sum())
            ref2 += float(ref.double().pow(2).sum())
            abs2 += float(spread.double().pow(2).sum())
            u = max(u, torch.finfo(out.dtype).eps / 2)
            keys = max(keys, int(args[1].shape[-2]))
    error, ref_norm, spread_norm = math.sqrt(error2), math.sqrt(ref2), math.sqrt(abs2)
    bound = u * (ref_norm + spread_norm) + keys * FP32_UNIT_ROUNDOFF * spread_norm
    relative = error / ref_norm / u if ref_norm > 0 else 0.0
    return KernelFigures(len(record.calls), error, bound, relative)
