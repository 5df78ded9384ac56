"""A whole tiny model's tree forward under ``use_backend("fla")`` equals the torch backend's.

The torch backend's forward equals the stock per-trajectory forward (tests/test_equivalence.py), so
this closes the loop on a CPU: every linear-attention call of the executor (GDN in qwen3_next, KDA
in bailing_hybrid) runs fla's kernels and every full-attention layer the FlexAttention mask. Forward
only: FlexAttention has no CPU backward (the delta rule's gradients are checked op by op in
test_fla_delta_rule.py; the model's gradients wait for a GPU, tests/test_gpu_backend.py).
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.ops.backends import use_backend
from harts.tiny import tiny_model
from tests_kernels.device import DEVICE

LOGIT_ATOL = 1e-4  # the suite's fp32 logit bound (measured about 3e-6 here)
TRAJECTORIES = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 12, 13], [5, 6, 14, 15, 16, 17, 18, 19], [20, 21, 22]]


@pytest.mark.parametrize("family", ["qwen3_next", "bailing_hybrid"])
def test_tree_forward_matches_torch_backend(family):
    model = tiny_model(family, seed=7).to(DEVICE)
    forest = harts.build_forest(TRAJECTORIES)
    with torch.no_grad():
        ref = harts.forward(model, forest)
        with use_backend("fla"):
            out = harts.forward(model, forest)
    for i in range(forest.num_trajectories):
        assert (out.trajectory_logits(i) - ref.trajectory_logits(i)).abs().max().item() <= LOGIT_ATOL
