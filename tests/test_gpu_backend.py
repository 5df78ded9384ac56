"""The ``fla`` backend on a CUDA device: a tiny model's tree forward and backward equal the stock
per-trajectory fp64 reference, within the suite's bounds.

Skipped without CUDA (and without the ``gpu`` extra); on a GPU machine run it from the venv that has
the extra (docs/gpu.md). fla's triton kernels default to TF32 for fp32 matmuls (about 1e-3
relative); the test asks triton for IEEE fp32 so the fp32 bounds apply. Its CPU counterparts:
tests_kernels/ (``make test-kernels``), and here, where the extra is missing, the refusal to
select the backend, naming the extra.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import harts
from harts.ops.backends import available_backends, current_backend, use_backend
from tests.reference import (
    GRAD_RTOL,
    LOGIT_ATOL,
    cached_model,
    functional_weights,
    grad_relative_errors,
    param_grads,
    reference_grads,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TRAJECTORIES = {
    "star-P20-G3": [list(range(3, 23)) + [30 + g] * (2 + 3 * g) for g in range(3)],
    "chunk-edges-63-64-65": [list(range(3, 66)), list(range(3, 67)), list(range(3, 66)) + [9, 9],
                             list(range(3, 40)) + list(range(70, 100))],
}


@pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="the gpu extra is installed here")
def test_fla_backend_without_the_extra_is_refused_before_any_compute():
    assert "fla" in available_backends()
    with pytest.raises(ImportError, match=r"harts\[gpu\]"):
        with use_backend("fla"):
            pass
    assert current_backend().name == "torch"


def test_fla_backend_names_its_kernels_by_recurrence():
    """The backend's kernels are keyed by the contract's recurrence names (readable without the extra)."""
    from harts.ops.fla_backend import RECURRENCES, fla_delta_rule
    from harts.ops.recurrence import DELTA_RULE

    assert RECURRENCES == {DELTA_RULE.name: fla_delta_rule}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_next", "bailing_hybrid"])
@pytest.mark.parametrize("name", list(TRAJECTORIES))
def test_fla_backend_tree_step_matches_stock(family, name):
    pytest.importorskip("fla", reason="the fla backend needs the gpu extra")
    import triton

    triton.knobs.language.fp32_default = "ieee"  # fla's tl.dot would run fp32 inputs as TF32
    trajectories = TRAJECTORIES[name]
    model = cached_model(family, seed=7)
    weights = functional_weights(trajectories, model.config.get_text_config().vocab_size)
    ref_logits, ref_grads = reference_grads(model, trajectories, weights)

    cuda = copy.deepcopy(model).cuda()
    cuda.zero_grad(set_to_none=True)
    forest = harts.build_forest(trajectories)
    with use_backend("fla"):
        out = harts.forward(cuda, forest)
        loss = sum((out.trajectory_logits(i) * w.cuda()).sum() for i, w in enumerate(weights))
        loss.backward()
    worst = max((out.trajectory_logits(i).detach().cpu().double() - ref).abs().max().item()
                for i, ref in enumerate(ref_logits))
    assert worst <= LOGIT_ATOL, f"max |logit diff| {worst:.3g}"
    errors = grad_relative_errors({k: v.cpu() for k, v in param_grads(cuda).items()}, ref_grads)
    bad = max(errors, key=errors.get)
    assert errors[bad] <= GRAD_RTOL, f"gradient of {bad}: relative error {errors[bad]:.3g}"
