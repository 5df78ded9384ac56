"""Peak memory of one benchmark step, each (family, shape, variant) in a fresh child process.

torch's CPU allocations are invisible to tracemalloc and torch keeps no CPU peak statistics, so on
the CPU the benchmark reads the operating system's resident-set peak:

1. a child process (forked from a ``forkserver`` that has imported harts and torch but run
   nothing) builds the model and the forest and runs the variant's step once (warm-up: lazy
   initialisation and first-call caches are not counted);
2. gradients are dropped, ``gc.collect()``, and the kernel's peak RSS counter is reset
   (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0); the resident size ``VmRSS`` is the baseline;
3. the step runs once more; ``peak = VmHWM - baseline`` is the memory the step itself needed
   above the resident model, inputs and interpreter (activations, autograd graph, gradients).

Memory freed by the warm-up must not stay resident, or the measured step would reuse it and hide
its peak: the child runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc serves every tensor above
128 KiB by mmap and unmaps it when freed) and calls glibc's ``malloc_trim(0)`` before the reset
(freed heap pages go back to the system too). Where ``clear_refs`` cannot be written the child
skips the warm-up and reports ``ru_maxrss`` minus the RSS before the step (method
``ru_maxrss``), which can undercount if building the model peaked higher than the step.

On CUDA the child reports ``torch.cuda.max_memory_allocated()`` minus the allocation before the
step, after ``reset_peak_memory_stats()`` (method ``cuda_max_allocated``).

What this leaves out: memory held by the allocator's caches but not by tensors (on CUDA), and
page-granularity noise (a few hundred KiB) on the CPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import multiprocessing as mp
import os
import resource
import sys

import torch

__all__ = ["measure_peak"]

_MMAP_THRESHOLD = "131072"
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


def _probe(cfg_fields: dict, family: str, shape: str, variant: str, conn) -> None:
    try:
        from harts.bench import BenchConfig, build_case, variant_fns

        cfg = BenchConfig(**cfg_fields)
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
            peak, method = torch.cuda.max_memory_allocated() - base, "cuda_max_allocated"
        elif _reset_peak_rss():
            fn()
            model.zero_grad(set_to_none=True)
            gc.collect()
            _release_free_memory()
            _reset_peak_rss()
            base = _status_kib("VmRSS")
            fn()
            peak, method = (_status_kib("VmHWM") - base) * 1024, "vmhwm_reset"
        else:
            base = _status_kib("VmRSS") if sys.platform.startswith("linux") else 0
            fn()
            peak, method = (_maxrss_kib() - base) * 1024, "ru_maxrss"
        conn.send(dict(peak_mib=peak / 2**20, memory_method=method))
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
            _CTX.set_forkserver_preload(["harts.bench"])
            # The server is started with this environment, and every child inherits it.
            old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
            os.environ["MALLOC_MMAP_THRESHOLD_"] = _MMAP_THRESHOLD
            try:
                from multiprocessing import forkserver

                forkserver.ensure_running()
            finally:
                if old is None:
                    del os.environ["MALLOC_MMAP_THRESHOLD_"]
                else:
                    os.environ["MALLOC_MMAP_THRESHOLD_"] = old
    return _CTX


def measure_peak(cfg, family: str, shape: str, variant: str, timeout_s: float = 1800.0) -> dict:
    """Peak memory (MiB) of one step of ``variant`` on (``family``, ``shape``), in a child process."""
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_probe, args=(dataclasses.asdict(cfg), family, shape, variant, child))
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
