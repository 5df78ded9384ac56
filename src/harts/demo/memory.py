"""The tensor peak of one step in each layout.

Both layouts run at the same stated budget (the tree's): a peak is a function of the budget, and
the flat layout's fastest budget is chosen by timing, whose noise would move its peak from run to
run. The tree's default keeps the graphs of parts that later parts read (up to twice the budget in
all), so its step peaks above one part; ``hold_tokens=0`` runs those parts forward again instead.
The flat layout packs whole trajectories up to the budget (a longer one alone in its micro-batch).
"""

from __future__ import annotations

import contextlib
import os
import sys

import harts
from harts.bench.memory import tensor_peak_bytes
from harts.demo.training import SFT


@contextlib.contextmanager
def native_stderr_to_devnull():
    """Send file descriptor 2 to /dev/null: the profiler's C++ code writes lines about its own
    bookkeeping there (kineto's start and stop, CPUAllocator's note that a block allocated before
    profiling began was freed), which would land in the middle of the report. Python errors are
    raised, and printed, after it is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_mib(model, step) -> float:
    """Tensor peak of one step (forward and backward), in MiB."""
    with native_stderr_to_devnull():
        return tensor_peak_bytes(step, lambda: model.zero_grad(set_to_none=True)) / 2**20


def report_memory(model, rollouts, budget: int, tree_step, flat_step) -> None:
    """Print the tensor peak of the tree step (its default, and with ``hold_tokens=0``) and of the
    flat one (``flat_step``: the flat layout at the same ``budget``)."""
    no_hold = harts.RunConfig(budget_tokens=budget, hold_tokens=0)

    def tree_no_hold():
        return harts.rollout_step(model, rollouts, SFT, run=no_hold)

    steps = {"tree": tree_step, "tree_no_hold": tree_no_hold, "flat": flat_step}
    peaks = {name: peak_mib(model, step) for name, step in steps.items()}
    print(
        f"tensor peak of one step at budget {budget}: tree {peaks['tree']:.1f} MiB (default: keeps the "
        f"graphs later parts read), {peaks['tree_no_hold']:.1f} MiB with RunConfig(hold_tokens=0) (runs "
        f"those parts forward again); flat {peaks['flat']:.1f} MiB (whole trajectories packed up to it)"
    )
