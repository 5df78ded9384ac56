"""Smoke test of the benchmark harness (harts.bench) and its FLOP model; no timed assertions."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import harts
from harts.bench.cases import BenchConfig, build_case, flat_budgets, make_trajectories, variant_fns
from harts.bench.memory import measure_peak, tensor_peak_bytes
from harts.bench.report import markdown, write_outputs
from harts.bench.run import parse_args, run, run_case
from harts.data.synthetic import scaled
from harts.plan.linear import plan_linear
from harts.runtime.flops import flop_model, forest_flops, ideal_speedup
from harts.tiny import tiny_model

ROW_FIELDS = {
    "family",
    "shape",
    "trajectories",
    "unique_tokens",
    "flat_tokens",
    "redundancy",
    "flops_tree",
    "flops_flat",
    "ideal_speedup",
    "achieved_speedup",
    "fraction_of_ideal",
    "speedup_vs_stock",
    "variants",
}


def test_harness_smoke(tmp_path):
    # One thread: OpenMP barriers on a shared, oversubscribed CPU can slow a step 30-fold.
    cfg = BenchConfig(
        families=("llama", "qwen3_next"), shapes=("star", "random"), quick=True, memory=False, threads=1
    )
    results = run(cfg, log=lambda _: None)
    json.loads(json.dumps(results))  # JSON-ready
    assert {"config", "machine", "flop_model", "rows"} <= set(results)
    assert results["machine"]["threads"] >= 1
    assert len(results["rows"]) == 4
    resolved = cfg.resolved()
    for row in results["rows"]:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
        vocab = tiny_model(row["family"]).config.vocab_size
        forest = harts.build_forest(make_trajectories(row["shape"], resolved, vocab))
        assert row["redundancy"] == forest.redundancy
        assert row["ideal_speedup"] >= 1.0
        for name in ("tree", "flat", "stock"):
            v = row["variants"][name]
            assert v["status"] == "ran" and v["time_s"] > 0
            assert v["loss_rel_diff_vs_stock"] < 1e-5, (row["family"], row["shape"], name)
        linear = row["flop_model"]["num_linear_layers"] > 0
        assert (row["variants"]["tree"]["linear_calls"] is not None) == linear
        if linear:  # the flat layout's plan: one dependency level, split only by segment length
            trajs = make_trajectories(row["shape"], resolved, vocab)
            flat_plan = plan_linear(harts.build_forest(trajs, share_prefixes=False))
            assert all(node < 0 for call in flat_plan.calls for node in call.init_node)
            assert row["variants"]["flat"]["linear_calls"] == flat_plan.num_calls
    assert "| family | shape |" in markdown(results)
    write_outputs(results, tmp_path)
    assert (tmp_path / "results.json").exists() and (tmp_path / "results.md").exists()


def test_flat_baseline_under_a_budget_never_cuts_a_trajectory():
    """Under a budget below the longest trajectory, the flat layout packs whole trajectories (the
    longest alone) and also runs without a budget; the tree is compared with the faster of the two."""
    cfg = BenchConfig(
        families=("llama",), shapes=("agentic",), quick=True, memory=False, peers=False, threads=1,
        run=harts.RunConfig(budget_tokens=16),
    ).resolved()  # fmt: skip
    case = build_case(cfg, "llama", "agentic")
    assert int(case.flat.trajectory_length.max()) > 16
    fns, _ = variant_fns(case, cfg)
    assert {"tree", "flat", "flat_whole"} <= set(fns)
    flat = fns["flat"]()
    assert flat.num_cuts == 0 and flat.part_forwards == flat.num_micro_batches > 1
    assert fns["flat_whole"]().num_micro_batches == 1
    assert fns["tree"]().num_cuts > 0
    row = run_case(cfg, "llama", "agentic")
    flats = [n for n in row["variants"] if n.startswith("flat")]
    assert {"flat", "flat_whole"} <= set(flats)
    best = min(flats, key=lambda n: row["variants"][n]["time_s"])
    assert row["flat_best"] == best
    assert row["achieved_speedup"] == row["variants"][best]["time_s"] / row["variants"]["tree"]["time_s"]


def test_flat_baseline_is_timed_at_every_distinct_budget():
    """The flat layout also runs at ``flat_budgets``; budgets that give the same micro-batches as
    another flat variant (the tree's budget, or one holding the whole flat forest) run once."""
    base = dict(families=("llama",), shapes=("agentic",), quick=True, memory=False, peers=False, threads=1)
    cfg = BenchConfig(**base, run=harts.RunConfig(budget_tokens=16), flat_budgets=(16, 160, 10**9)).resolved()
    case = build_case(cfg, "llama", "agentic")
    longest = int(case.flat.trajectory_length.max())
    assert 16 < longest < 160 < case.flat.num_tokens
    assert flat_budgets(cfg, case.flat) == {"flat": 16, "flat_whole": None, "flat_160": 160}
    fns, _ = variant_fns(case, cfg)
    assert [n for n in fns if n.startswith("flat")] == ["flat", "flat_whole", "flat_160"]
    at_160 = fns["flat_160"]()
    assert at_160.num_cuts == 0 and 1 < at_160.num_micro_batches < fns["flat"]().num_micro_batches
    assert max(at_160.tokens_per_micro_batch) <= 160
    unbudgeted = BenchConfig(**base, flat_budgets=(160,)).resolved()
    assert flat_budgets(unbudgeted, case.flat) == {"flat": None, "flat_160": 160}
    row = run_case(unbudgeted, "llama", "agentic")
    assert row["flat_best"] in ("flat", "flat_160")
    assert row["flat_best_budget"] == {"flat": None, "flat_160": 160}[row["flat_best"]]
    assert "| flat best (budget) |" in markdown({**run(unbudgeted, log=lambda _: None)})
    with pytest.raises(ValueError, match="flat budgets"):
        BenchConfig(flat_budgets=(0,)).resolved()


@pytest.mark.parametrize("family", ["bailing_hybrid", "qwen3_next", "llama"])
@pytest.mark.parametrize("shape", ["star", "agentic", "deep", "random"])
def test_flop_ratio_without_attention_is_redundancy(family, shape):
    """Dense and linear-attention FLOPs are per token, so flat / tree is R exactly."""
    fm = flop_model(tiny_model(family))
    kwargs = {} if shape == "random" else {"vocab_size": 128}
    trajectories = scaled(shape, 0.01, **kwargs)
    tree = harts.build_forest(trajectories)
    flat = harts.build_forest(trajectories, share_prefixes=False)
    no_attention = dataclasses.replace(fm, attention_per_key=0)
    assert forest_flops(no_attention, flat) / forest_flops(no_attention, tree) == tree.redundancy
    assert ideal_speedup(fm, tree, flat) >= 1.0
    if fm.num_full_layers:
        assert fm.attention_per_key > 0
    if fm.num_linear_layers:
        assert fm.linear_state_per_token > 0


MIB = 2**20


def _bytes(mib: float) -> torch.Tensor:
    return torch.empty(int(mib * MIB), dtype=torch.uint8)


def test_hold_tokens_option_takes_auto_or_a_count(capsys):
    assert parse_args([])[0].run.hold_tokens == "auto" == harts.RunConfig().hold_tokens
    assert parse_args(["--hold-tokens", "auto"])[0].run.hold_tokens == "auto"
    assert parse_args(["--hold-tokens", "0", "--budget", "64"])[0].run.hold_limit == 0
    assert parse_args(["--hold-tokens", "4096"])[0].run.hold_tokens == 4096
    for bad in ("-1", "all", "1.5"):
        with pytest.raises(SystemExit):
            parse_args(["--hold-tokens", bad])
        assert "--hold-tokens: expected auto or an integer >= 0" in capsys.readouterr().err


def test_tensor_peak_counts_live_tensors():
    """The CPU tensor peak (harts.bench.memory) against steps whose live bytes are known."""
    held_cache: dict = {}

    def overlapping():  # 24 MiB held while 16 MiB are allocated: 40 MiB at once
        a = _bytes(24)
        b = _bytes(16)
        del a, b

    def sequential():  # 24 MiB freed before 16 MiB are allocated: 24 MiB at once
        a = _bytes(24)
        del a
        b = _bytes(16)
        del b

    def refills_cache():  # frees the previous call's 16 MiB, then allocates 16 MiB: nothing above the start
        held_cache["t"] = None
        held_cache["t"] = _bytes(16)

    def small():
        return torch.ones(10) + 1

    tolerance = 0.05 * MIB
    for step, expected in ((overlapping, 40), (sequential, 24), (refills_cache, 0), (small, 0)):
        step()  # warm-up, as in the benchmark's child
        peak = tensor_peak_bytes(step)
        assert abs(peak - expected * MIB) < tolerance, (step.__name__, peak / MIB, expected)


def test_tensor_peak_counts_autograd_memory():
    """Forward + backward of (x @ w).sum() with 4 MiB matrices: the peak is in the backward, where
    x, the expanded output gradient made contiguous and w's gradient are alive at once (12 MiB)."""
    w = torch.randn(1024, 1024, requires_grad=True)

    def step():
        x = torch.randn(1024, 1024)
        (x @ w).sum().backward()

    def reset():
        w.grad = None

    step()
    reset()
    peak = tensor_peak_bytes(step, reset)
    assert abs(peak - 12 * MIB) < 0.05 * MIB, peak / MIB


def test_measure_peak_child_reports_both_figures():
    cfg = BenchConfig(families=("llama",), shapes=("star",), quick=True, threads=1, peers=False).resolved()
    m = measure_peak(cfg, "llama", "star", "flat")
    assert "memory_error" not in m and "rss_memory_error" not in m, m
    assert m["memory_method"] == "cpu_tensor_peak" and m["rss_memory_method"] in ("vmhwm_reset", "ru_maxrss")
    assert 0 < m["peak_mib"] < 64 and m["rss_peak_mib"] is not None, m


def test_ideal_share_compares_the_tree_with_the_fastest_flat_step():
    """One row per budget; the baseline is the fastest of flat at B, 4B and whole."""
    from harts.bench import ideal_share

    rows = ideal_share.measure("qwen3", "star", (256, 4096), repeats=1, model_size="tiny")
    assert [r["budget"] for r in rows] == [256, 4096]
    for r in rows:
        assert r["flat_best"] in {"flat 350", "flat 1024", "flat 4096", "flat whole"}  # 350: the longest
        assert r["speedup"] == r["flat_best_ms"] / r["tree_ms"] and r["share"] == r["speedup"] / r["ideal"]
        assert 1 < r["ideal"] <= r["redundancy"]  # attention makes the ideal lower than R, never higher
    # the star's flat forest (8480 tokens) fits 16384: at 4096 "4B" is the same step as "whole"
    assert rows[1]["flat_best"] in {"flat 4096", "flat whole"}


def test_ideal_share_across_processes_takes_each_rows_median_and_range():
    """Rows of three processes: per budget the median share and times, the share range, the flat
    variant most processes found fastest; the budgets stay apart."""
    from harts.bench.ideal_share import across_processes

    def row(budget, tree, flat, variant):
        return dict(shape="star", redundancy=5.0, budget=budget, tree_ms=tree, flat_best_ms=flat,
                    flat_best=variant, speedup=flat / tree, ideal=5.0, share=flat / tree / 5.0)  # fmt: skip

    runs = [[row(1024, 300, 1200, "flat whole"), row(4096, 200, 1200, "flat whole")],
            [row(1024, 400, 1100, "flat 4096"), row(4096, 250, 1100, "flat 4096")],
            [row(1024, 280, 1000, "flat 4096"), row(4096, 210, 1000, "flat 4096")]]  # fmt: skip
    low, high = across_processes(runs)
    assert (low["budget"], high["budget"]) == (1024, 4096) and low["processes"] == 3
    assert low["tree_ms"] == 300 and low["flat_best_ms"] == 1100 and low["flat_best"] == "flat 4096"
    shares = sorted(r[0]["share"] for r in runs)
    assert (low["share_low"], low["share"], low["share_high"]) == tuple(shares)
    assert high["share"] == sorted(r[1]["share"] for r in runs)[1]
