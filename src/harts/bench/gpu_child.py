"""One stage of ``make gpu-check`` in its own process: a module run as ``python -m`` would run it, after
choosing how triton tunes its kernels.

Usage: ``python -X faulthandler -m harts.bench.gpu_child --autotune first -- pytest -q tests_kernels``.

Triton autotunes each of fla's kernels on first use by compiling and timing every configuration of its
list (up to 81 for a delta-rule backward kernel), once per kernel variant and shape key; on a fresh
machine one forward and backward of one Kimi Delta Attention layer spent over 170 s in that before its
first result. ``--autotune first`` keeps each kernel's first configuration that its own pruning
leaves (the results are the same arithmetic, tiled differently; the speed is not the tuned one, and
the check's table says so); ``full`` leaves triton's autotuning as it is. Autotuning is triton's, so the
switch patches :class:`triton.runtime.autotuner.Autotuner` in this process only, never the library
path a training run takes.
"""

from __future__ import annotations

import argparse
import runpy
import sys

__all__ = ["AUTOTUNE_MODES", "first_config_only", "main"]

AUTOTUNE_MODES = ("first", "full")


def first_config_only() -> bool:
    """Make every triton autotuner in this process keep its first pruned configuration.

    Returns False (and changes nothing) where triton is not installed."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    prune = Autotuner.prune_configs
    if getattr(prune, "harts_first_only", False):
        return True

    def first(self, kwargs, *args, **kw):
        return prune(self, kwargs, *args, **kw)[:1]

    first.harts_first_only = True
    Autotuner.prune_configs = first
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m harts.bench.gpu_child", description=__doc__.splitlines()[0])
    p.add_argument("--autotune", choices=AUTOTUNE_MODES, default="first")
    p.add_argument("module", help="the module to run as __main__ (pytest, harts.bench.run)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.autotune == "first":
        first_config_only()
    sys.argv = [a.module, *a.args]
    runpy.run_module(a.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
