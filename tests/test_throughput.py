"""The throughput figures of every metrics record: three token counts, model FLOP/s, MFU."""

from __future__ import annotations

import harts
from harts.runtime.flops import flop_model, forest_flops
from harts.tiny import tiny_model
from harts.trainer.throughput import PEAK_FLOPS, Throughput, loss_tokens


def _rollouts():
    prompt = [5, 6, 7, 8]
    return [harts.Rollout(prompt + [9, 10], loss_mask=[0, 0, 0, 0, 1, 1]),
            harts.Rollout(prompt + [11, 12, 13], loss_mask=[0, 0, 0, 0, 1, 1, 1]),
            harts.Rollout([1, 2, 3])]  # fmt: skip


def test_three_token_counts_and_their_rates():
    rollouts = _rollouts()
    forest = harts.build_forest([r.tokens for r in rollouts])
    assert loss_tokens(rollouts) == 2 + 3 + 2  # the mask's positions; without one, all but the first
    out = Throughput(tiny_model("qwen3")).record(forest, rollouts, seconds=2.0)
    assert (out["flat_tokens"], out["unique_tokens"], out["loss_tokens"]) == (16, 12, 7)
    assert out["unique_tokens_per_s"] == 6.0 and out["loss_tokens_per_s"] == 3.5
    assert out["redundancy"] == 16 / 12


def test_model_flops_are_the_flop_models_over_executed_and_flat_work():
    model = tiny_model("qwen3")
    rollouts = _rollouts()
    forest = harts.build_forest([r.tokens for r in rollouts])
    flat = harts.build_forest([r.tokens for r in rollouts], share_prefixes=False)
    out = Throughput(model).record(forest, rollouts, seconds=0.5)
    fm = flop_model(model)
    assert out["model_flops"] == forest_flops(fm, forest)
    assert out["model_flops_per_s"] == forest_flops(fm, forest) / 0.5
    assert out["flat_flops_per_s"] == forest_flops(fm, flat) / 0.5
    assert "mfu" not in out  # a CPU has no peak in the table


def test_the_peak_table_is_bf16_over_tf32_over_fp32():
    for name, (low, tf32, fp32) in PEAK_FLOPS.items():
        assert low > tf32 > fp32 > 0, name
