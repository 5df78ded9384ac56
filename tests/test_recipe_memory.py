"""What an FSDP2 rank holds through the RL recipe's passes, measured in bytes on 2 gloo ranks.

`python -m harts.bench.recipe_memory` runs the reference, old-policy and critic passes (forward
only) and the two updates of one step with the policy, the reference and the critic each sharded
by FSDP2, and the three passes again on the same trajectories with the three models whole and
unwrapped (``plain``). The passes compute the same activations either way; what the sharded pass
adds is the units it gathers. Bounds, derived from how FSDP2 gathers a unit (the local shard
copied into an input buffer of 1/N of the unit, gathered into a flat buffer of the whole unit,
copied out into the unit's whole parameters, the flat buffer then freed) and from harts' lock
step with ``fsdp_overlap`` (the running layer whole while the next one is gathered):

- a forward-only pass's peak is at most the plain pass's plus the root unit (embeddings, head and
  final norm: whole for the pass; (2 + 1/N) of it while it is gathered) and (3 + 1/N) decoder
  layer units. A pass that gathered every unit at once would exceed it by the other layers.
- no phase leaves a unit gathered (read from FSDP2's state after each phase);
- after set-up each of the three models holds its shard, about 1/N of its whole bytes.

All are allocation sizes, fixed by the shapes, not by the processor or the thread count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# dim-0 chunks of tensors with fewer rows than ranks are padded: a rank's shards are a little over P / N
SHARD_SLACK = 1.1
RANKS = 2


@pytest.mark.multiprocess
def test_the_recipes_sharded_passes_hold_only_their_shards_and_a_few_units(tmp_path):
    out = tmp_path / "memory.json"
    # 8 layers, so that every unit gathered at once would break the bound by several layers
    command = [sys.executable, "-m", "harts.bench.recipe_memory", "--models", "qwen3:wide",
               "--ranks", str(RANKS), "--variants", "harts", "plain", "--hidden", "256",
               "--intermediate", "768", "--layers", "8", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "64", "--vocab", "1024", "--system-len", "120", "--tasks", "2",
               "--rollouts-per-task", "2", "--turns", "2", "--turn-len", "40", "--budget", "256",
               "--timeout", "300", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert "error" not in result, result
    units = result["unit_bytes"]
    gathered = (2 + 1 / RANKS) * units["root"] + (3 + 1 / RANKS) * units["layer"]
    # every unit whole at once (P, beyond the plain pass) would break the bound by two layers at least
    assert result["param_bytes"] > gathered + 2 * units["layer"]
    for rank in result["ranks"]:
        sharded, plain = rank["variants"]["harts"], rank["variants"]["plain"]
        for phase in ("reference", "old", "values"):
            peak, alone = sharded["phases"][phase]["peak_bytes"], plain["phases"][phase]["peak_bytes"]
            assert peak <= alone + gathered, (rank["rank"], phase, peak, alone, units)
        for phase, figures in sharded["phases"].items():
            assert figures["units_left_gathered"] == [], (rank["rank"], phase, figures)
        for model in ("policy", "reference", "critic"):
            shard, whole = sharded["held"][model], plain["held"][model]
            assert whole / (RANKS * SHARD_SLACK) <= shard <= SHARD_SLACK * whole / RANKS, (model, shard)
