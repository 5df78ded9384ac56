"""``RunConfig(verify=True)`` on a multimodal model with images: the sample's trajectories run the
stock ``*ForConditionalGeneration`` forward with their own screenshots, and the vision tower's
gradients are compared with the rest.

What must hold: an exact step passes and computes the same bits as without the check (loss,
gradients, the tower's included); the sample carries its images whole (a cut inside an image
moves to its end); a tree-attention kernel off by 1e-3 (registered in tests/test_verify.py) is
caught with no gradient left, in forward (a log-prob) and in backward (a parameter); ``harts
train`` on a rollout file with screenshots verifies its first update and stops on that fault.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.ops.backends import register_backend
from harts.runtime.image_forest import image_forest
from harts.runtime.model_checks import resolve_model
from harts.runtime.verify import sample_spans
from harts.runtime.verify_images import sample_images, whole_images
from harts.tiny import FAMILIES
from tests.helpers import one_thread  # noqa: F401 (fixture)
from tests.test_multimodal import IMAGE, gui_rollouts, vlm
from tests.test_verify import FAULT, _attention_off, _grads

pytestmark = pytest.mark.skipif("qwen3_5" not in FAMILIES, reason="qwen3_5 not installed")
LOSS = harts.PolicyLossConfig(kind="sft")
# tree attention alone off by 1e-3: its output (and so its gradients), or its query's gradient
register_backend("test-attention-off-in-forward", _attention_off(1 + FAULT, 1.0, False))
register_backend("test-attention-off-in-backward", _attention_off(1.0, 1 + FAULT, False))


def _run(**changes) -> harts.RunConfig:
    return harts.RunConfig(**{"budget_tokens": 32, **changes})


def test_the_sample_keeps_its_images_whole():
    model = vlm("qwen3_5")
    forest = image_forest(model, gui_rollouts())
    spans = sample_spans(forest)
    # a cut one token into the first image moves to the end of its 6 image tokens
    start = int((forest.trajectory(spans[0][0]) == IMAGE).nonzero()[0])
    moved = whole_images(forest, [(spans[0][0], start + 1)])
    assert moved == [(spans[0][0], start + 6)]
    sub, images = sample_images(resolve_model(model), forest, whole_images(forest, spans), None)
    assert sub.images is not None and all(i.image_grid_thw.shape[0] >= 1 for i in images)
    for k, own in enumerate(images):
        tokens = int((sub.trajectory(k) == IMAGE).sum())
        assert tokens == int(own.image_grid_thw.prod(-1).sum()) // 4  # 2 x 2 patches per token


def test_an_exact_step_with_images_passes_with_the_same_bits():
    model, rollouts = vlm("qwen3_5"), gui_rollouts()
    model.zero_grad(set_to_none=True)
    plain = harts.rollout_step(model, rollouts, LOSS, run=_run())
    want = _grads(model)
    checked = harts.rollout_step(model, rollouts, LOSS, run=_run(verify=True))
    got = _grads(model)
    assert torch.equal(plain.loss, checked.loss)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any(k.startswith("model.visual.") for k in got)  # the tower trains, and was checked
    m = checked.metrics
    assert float(m["verify_value_error"]) <= float(m["verify_value_bound"])
    assert 0.0 < float(m["verify_gradient_ratio"]) <= 1.0


@pytest.mark.parametrize(("backend", "names"), [
    ("test-attention-off-in-forward", r"trajectory \d+, position \d+: harts' log-prob"),
    ("test-attention-off-in-backward", r"parameter model\."),
])  # fmt: skip
def test_a_faulty_attention_with_images_is_caught(backend, names):
    model, rollouts = vlm("qwen3_5"), gui_rollouts()
    model.zero_grad(set_to_none=True)
    with pytest.raises(harts.VerificationError, match=names):
        harts.rollout_step(model, rollouts, LOSS, run=_run(verify=True, backend=backend))
    assert all(p.grad is None for p in model.parameters())


def test_harts_train_on_rollouts_with_images_verifies_its_first_update(tmp_path, capsys):
    """`[run] verify = "first"` on a rollout file with screenshots: update 1 is checked with its
    images; an attention kernel off by 1e-3 stops the run (status 4) before any optimizer step."""
    from tests.helpers import run_train
    from tests.test_rollout_images import image_run_config

    model = {"tiny": "qwen3_5"}
    assert run_train(image_run_config(tmp_path, model), tmp_path / "ok") == 0
    err = capsys.readouterr().err
    assert err.count("verified against the stock forward (fp32") == 1, err[-2000:]
    records = (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()
    assert '"verify_gradient_ratio"' in records[0] and '"verify_gradient_ratio"' not in records[1]
    faulty = image_run_config(tmp_path, model, run={"backend": "test-attention-off-in-backward"})
    assert run_train(faulty, tmp_path / "bad") == 4
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "verification of forest_step failed" in lines[0], lines
    written = tmp_path / "bad" / "checkpoints"
    assert not written.exists() or not list(written.iterdir())
