"""What an FSDP2 rank holds during harts' step, measured in bytes against the stock FSDP2 step.

`python -m harts.bench.fsdp_memory` runs both on the same rollouts on 2 gloo ranks (the stock step: the
FSDP2 module's own forward and backward per trajectory) and profiles the CPU allocator. The
bound is the one docs/distributed.md states for the tree step: a rank's tensor peak at most
1.25x the stock step's, and what it holds of parameters and gradients after the step its shards
(P / N each), not whole copies. Both figures are allocation sizes, fixed by the shapes the two
steps run, not by the processor or the thread count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PEAK_BOUND = 1.25
# dim-0 chunks of tensors with fewer rows than ranks are padded: a rank's shards are a little
# over P / N
SHARD_SLACK = 1.1


@pytest.mark.multiprocess
def test_a_sharded_tree_step_peaks_within_the_bound_of_the_stock_fsdp_step(tmp_path):
    out = tmp_path / "memory.json"
    # parameters weigh about as much as one micro-batch's activations, as in the wide table
    command = [sys.executable, "-m", "harts.bench.fsdp_memory", "--families", "qwen3",
               "--ranks", "2", "--variants", "stock_fsdp", "harts_fsdp", "--hidden", "384",
               "--intermediate", "1024", "--layers", "4", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "64", "--vocab", "1024", "--system-len", "120", "--tasks", "2",
               "--rollouts-per-task", "2", "--turns", "2", "--turn-len", "40", "--budget", "256",
               "--timeout", "400", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert "error" not in result, result
    whole = result["param_bytes"]
    for rank in result["ranks"]:
        stock, tree = rank["variants"]["stock_fsdp"], rank["variants"]["harts_fsdp"]
        # the address-matched peak: frees on gloo's threads, which the profiler misses, counted
        assert tree["matched_peak_bytes"] <= PEAK_BOUND * stock["matched_peak_bytes"], (rank, stock, tree)
        # parameters and gradients: shards of both, never a whole copy (that would be >= P)
        assert tree["params_grads_bytes"] <= SHARD_SLACK * whole, (rank, tree, whole)
        assert tree["params_grads_bytes"] >= whole / SHARD_SLACK, (rank, tree, whole)
