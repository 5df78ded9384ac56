"""``make demo``'s claims at tiny size: the exactness part reports PASS against stock Hugging Face
and would report FAIL (and stop the demo with status 1), and a speedup above the FLOP-ideal is
reported as a weak baseline with no figure."""

from __future__ import annotations

import dataclasses

import pytest

import harts
import harts.demo
from harts.demo import QUICK, demo_model, demo_trajectories
from harts.demo.exactness import GRAD_RTOL, StockComparison, compare_with_stock, judge_by_truth, stock_step
from harts.demo.speed import speedup_verdict

TINY = dataclasses.replace(QUICK, system_len=24, turns=1, turn_len=16, budget=32)


@pytest.fixture(scope="module")
def tiny_case():
    return demo_model(seed=0), [harts.Rollout(t) for t in demo_trajectories(TINY, seed=0)]


def test_exactness_against_stock_passes(tiny_case):
    model, rollouts = tiny_case
    comparison = compare_with_stock(model, rollouts, TINY.budget)
    report = comparison.report()
    assert comparison.passed, "\n".join(report)
    assert report[-1] == "exactness: PASS"
    assert comparison.trajectories == len(rollouts) and comparison.parameters > 0
    assert comparison.logit_abs > 0  # a figure was measured, not a comparison of a thing with itself


def test_a_difference_beyond_the_bound_fails():
    passing = StockComparison(trajectories=2, parameters=3, logit_abs=1e-6, logit_rel=1e-7, loss_rel=1e-8,
                              grad_rel=2e-5, grad_worst="w", grad_abs=1e-7)  # fmt: skip
    assert passing.passed and passing.report()[-1] == "exactness: PASS"
    logits_off = dataclasses.replace(passing, logit_abs=1e-3)
    assert not logits_off.passed and logits_off.report()[-1] == "exactness: FAIL"
    gradient_off = dataclasses.replace(passing, grad_rel=1e-3, by_truth={"w": (1e-3, 2e-4)})
    assert not gradient_off.passed and "FAIL" in gradient_off.report()[2]


def test_a_gradient_off_the_fp64_stock_one_fails(tiny_case):
    """A parameter that misses the bound against stock fp32 is judged against stock fp64: a
    gradient 1e-3 off fails it, stock fp32's own passes it."""
    model, rollouts = tiny_case
    stock = stock_step(model, rollouts)[2]
    name = next(n for n, g in stock.items() if g.norm() > 0)
    off = dict(stock, **{name: stock[name] * (1 + 1e-3)})
    (error, bound), = judge_by_truth(model, rollouts, [name], off, stock).values()  # fmt: skip
    assert error > bound >= GRAD_RTOL
    (error, bound), = judge_by_truth(model, rollouts, [name], stock, stock).values()  # fmt: skip
    assert error <= bound


def test_the_demo_stops_with_status_1_on_fail(monkeypatch, capsys):
    failing = StockComparison(trajectories=2, parameters=3, logit_abs=1e-3, logit_rel=1e-4, loss_rel=1e-8,
                              grad_rel=2e-5, grad_worst="w", grad_abs=1e-7)  # fmt: skip
    monkeypatch.setattr(harts.demo, "compare_with_stock", lambda *args: failing)
    with pytest.raises(SystemExit) as exit_:
        harts.demo.main(["--system-len", "24", "--turns", "1", "--turn-len", "16", "--budget", "32"])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "exactness: FAIL" in out and "2. speed" not in out


def test_a_speedup_above_the_ideal_is_a_weak_baseline():
    over = speedup_verdict(6.36, 4.17)
    assert over.startswith("warning:") and "noisy or weak" in over
    assert "6.36" not in over  # no headline figure from a measurement that cannot be right
    under = speedup_verdict(3.39, 4.97)
    assert "3.39x" in under and "4.97x" in under and "warning" not in under
