"""Peak memory of one benchmark step, each (family, shape, variant) in a fresh child process.

Two figures, both for one step (forward + backward) above what was held before it:

- ``peak_mib``, the tensor peak: the most bytes held by live torch tensors at any moment of the
  step, above those live when it starts. On CUDA it is ``torch.cuda.max_memory_allocated()`` minus
  ``memory_allocated()`` before the step, after ``reset_peak_memory_stats()`` (method
  ``cuda_max_allocated``). torch keeps no such counter for its CPU allocator, so on the CPU the
  step runs under ``torch.profiler.profile(profile_memory=True)``, which records every allocation
  and free of that allocator with its size and time; the maximum of their running sum over the
  step is the same quantity (method ``cpu_tensor_peak``, :func:`tensor_peak_bytes`).
- ``rss_peak_mib`` (CPU only), the resident-set peak: the operating system's peak RSS during the
  step minus the RSS before it (``rss_memory_method``: ``vmhwm_reset`` or ``ru_maxrss``).

The targets use the tensor peak: it is the same quantity on the CPU and on a GPU, and it depends
only on which tensors the step holds at once, not on the C allocator's heap. The RSS peak also
counts memory that glibc's malloc keeps after tensors are freed (fragmentation), which depends on
the order of allocations, not on the algorithm: on bailing_hybrid paper_like at budget 1024, RSS
rose 77 MiB during a no-grad pass while 5 MiB of tensors were alive, and ``malloc_trim(0)`` handed
it all back. It is kept as what the process really took from the machine.

The child (forked from a ``forkserver`` that has imported harts and torch but run nothing) builds
the model and the forest, then on the CPU:

1. runs the step once (warm-up: lazy initialisation and first-call caches are not counted);
2. drops gradients, ``gc.collect()``, glibc's ``malloc_trim(0)``, resets the kernel's peak RSS
   counter (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) and reads ``VmRSS`` as the
   baseline; runs the step; the RSS peak is ``VmHWM - baseline``;
3. drops gradients and runs the step under the profiler (:func:`tensor_peak_bytes`): the tensor
   peak. It comes last because the profiler's own allocations change the heap the RSS figure
   reads (the stock step's RSS peak about doubled on a quick case with the profiled run first).

Memory freed by earlier runs must not stay resident, or the RSS step would reuse it and hide its
peak: the child runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc serves every tensor above
128 KiB by mmap and unmaps it when freed) besides the ``malloc_trim(0)``. Where ``clear_refs``
cannot be written, step 2 runs without the warm-up and reports ``ru_maxrss`` minus the RSS before
the step (method ``ru_maxrss``; it undercounts if building the model peaked higher than the step).
An error in one figure leaves the other; it is reported in ``memory_error`` (tensor peak, or the
whole child) or ``rss_memory_error``.

What each leaves out. The tensor peak: memory not held by torch tensors (Python objects, the
interpreter, oneDNN/BLAS scratch space; on CUDA the caching allocator's reserve), and on the CPU
allocations on threads the profiler does not follow (ATen allocates outputs on the calling thread:
the quick bench cases read the same with 1 and 2 torch threads) and frees of tensors allocated
before profiling began (the model and inputs; a step that frees one reads high by its size;
:func:`tensor_peak_bytes` guards against tensors carried from one step to the next). The RSS peak:
page granularity (figures under about 1 MiB are noise), and the C allocator's retention above.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import multiprocessing as mp
import os
import resource
import sys
from collections.abc import Callable

import torch
from torch.autograd import DeviceType

__all__ = ["measure_peak", "tensor_peak_bytes"]

_MMAP_THRESHOLD = "131072"
# kineto prints a line to stderr at every profiler start and stop; 6 is above its highest level.
_KINETO_LOG_LEVEL = "6"
_MARK = "harts.bench.memory.measured_step"
_CPU_TYPES = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
_CTX = None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _release_free_memory() -> None:
    """glibc ``malloc_trim(0)``: hand freed heap pages back, so the measured step must fault its own."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _maxrss_kib() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak  # bytes on macOS, KiB on Linux


def tensor_peak_bytes(step: Callable[[], object], reset: Callable[[], None] = lambda: None) -> int:
    """Peak bytes of live torch CPU tensors during ``step()``, above those live when it starts.

    The CPU counterpart of ``torch.cuda.max_memory_allocated() - memory_allocated()``, for a step
    that has run before (a warm-up). ``torch.profiler.profile(profile_memory=True)`` records each
    allocation (+bytes) and free (-bytes) of torch's CPU allocator, in time order; the result is
    the maximum of their running sum over the step (0 if it allocates nothing).

    The profiler cannot size a free of a tensor allocated before it started, and leaves it out.
    So after the step, ``reset()`` (e.g. dropping gradients) and ``gc.collect()`` run inside the
    profiler too: if tensors the step allocated are still held then (a cache it refills), the run
    before it may have left tensors that this one freed unseen, and the measurement is repeated
    with one more step profiled before it. Runs in the calling process.
    """
    peak, held = _profiled_peak(step, reset, warm_up=False)
    if held:
        peak, _ = _profiled_peak(step, reset, warm_up=True)
    return peak


def _profiled_peak(step: Callable[[], object], reset: Callable[[], None], warm_up: bool) -> tuple[int, int]:
    """(peak of the running sum of allocator events from the step on, the sum at the end)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if warm_up:
            step()
            reset()
            gc.collect()
        with record_function(_MARK):
            step()
        reset()
        gc.collect()
    events = prof.profiler.kineto_results.events()
    marks = [e.start_ns() for e in events if e.name() == _MARK]
    if not marks:
        raise RuntimeError("the profiler recorded no mark around the measured step")
    # torch's own per-op memory accounting reads the same "[memory]" events (autograd/profiler.py).
    mem = [e for e in events if e.name() == "[memory]" and e.device_type() in _CPU_TYPES]
    mem = sorted((e for e in mem if e.start_ns() >= min(marks)), key=lambda e: e.start_ns())  # stable
    running = list(itertools.accumulate((e.nbytes() for e in mem), initial=0))
    return max(running), running[-1]


def _rss_peak(fn: Callable[[], object], model) -> dict:
    """The RSS figure: ``VmHWM`` after a warm-up and a reset, or ``ru_maxrss`` (module docstring)."""
    if not _reset_peak_rss():
        base = _status_kib("VmRSS") if sys.platform.startswith("linux") else 0
        fn()
        return dict(rss_peak_mib=(_maxrss_kib() - base) / 1024, rss_memory_method="ru_maxrss")
    fn()
    model.zero_grad(set_to_none=True)
    gc.collect()
    _release_free_memory()
    _reset_peak_rss()
    base = _status_kib("VmRSS")
    fn()
    return dict(rss_peak_mib=(_status_kib("VmHWM") - base) / 1024, rss_memory_method="vmhwm_reset")


def _cpu_peaks(fn: Callable[[], object], model) -> dict:
    """Both CPU figures, the RSS peak first: the profiler's own allocations would change the heap
    that the RSS figure reads, so it runs only after that figure is taken."""
    out: dict = dict(peak_mib=None, rss_peak_mib=None)
    try:
        out.update(_rss_peak(fn, model))
    except Exception as exc:  # the other figure may still be measured
        out.update(rss_memory_error=f"{type(exc).__name__}: {exc}")
    try:
        model.zero_grad(set_to_none=True)
        peak = tensor_peak_bytes(fn, lambda: model.zero_grad(set_to_none=True))
        out.update(peak_mib=peak / 2**20, memory_method="cpu_tensor_peak")
    except Exception as exc:
        out.update(memory_error=f"{type(exc).__name__}: {exc}")
    return out


def _probe(cfg, family: str, shape: str, variant: str, conn) -> None:
    try:
        from harts.bench.cases import build_case, variant_fns

        torch.set_num_threads(cfg.threads)
        case = build_case(cfg, family, shape)
        fns, _ = variant_fns(case, cfg)
        fn, model = fns[variant], case.model
        if cfg.device.startswith("cuda"):
            fn()
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            result = dict(peak_mib=peak / 2**20, memory_method="cuda_max_allocated")
        else:
            result = _cpu_peaks(fn, model)
        conn.send(result)
    except Exception as exc:  # reported in the results, never fatal to the whole run
        conn.send(dict(peak_mib=None, memory_error=f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _context():
    global _CTX
    if _CTX is None:
        methods = mp.get_all_start_methods()
        _CTX = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            _CTX.set_forkserver_preload(["harts.bench.cases"])
            # The server is started with this environment, and every child inherits it. A
            # KINETO_LOG_LEVEL the user set is kept.
            env = {
                "MALLOC_MMAP_THRESHOLD_": _MMAP_THRESHOLD,
                "KINETO_LOG_LEVEL": os.environ.get("KINETO_LOG_LEVEL", _KINETO_LOG_LEVEL),
            }
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)
            try:
                from multiprocessing import forkserver

                forkserver.ensure_running()
            finally:
                for name, value in saved.items():
                    if value is None:
                        del os.environ[name]
                    else:
                        os.environ[name] = value
    return _CTX


def measure_peak(cfg, family: str, shape: str, variant: str, timeout_s: float = 1800.0) -> dict:
    """Peak memory (MiB) of one step of ``variant`` on (``family``, ``shape``), in a child process.

    Returns ``peak_mib`` (tensor peak) and ``memory_method``; on the CPU also ``rss_peak_mib`` and
    ``rss_memory_method``; ``memory_error``/``rss_memory_error`` where a figure could not be taken.
    """
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_probe, args=(cfg, family, shape, variant, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            proc.kill()
            return dict(peak_mib=None, memory_error=f"timed out after {timeout_s:.0f} s")
        return parent.recv()
    except EOFError:
        return dict(peak_mib=None, memory_error=f"child exited with code {proc.exitcode}")
    finally:
        proc.join()
