"""``harts analyze``: the figures of a rollout file's forest, the plan for a model, the picture."""

from __future__ import annotations

import json
import re

from harts.analyze import forest_svg, main
from harts.cli import main as cli
from harts.data.synthetic import agentic
from harts.forest import build_forest
from harts.tiny import FAMILIES


def _file(tmp_path):
    trajectories = agentic(system_len=60, num_tasks=2, rollouts_per_task=3, turns=2, turn_len=20,
                           vocab_size=120)  # fmt: skip
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps({"tokens": t, "reward": 1.0}) + "\n" for t in trajectories))
    return path, trajectories


def test_figures_match_the_forest_and_the_plan(tmp_path, capsys):
    path, trajectories = _file(tmp_path)
    forest = build_forest(trajectories)
    stats = main([str(path), "--model", FAMILIES[0], "--budget", "64", "--json"])  # a hybrid family
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert printed == stats
    assert stats["trajectories"] == len(trajectories) and stats["unique_tokens"] == forest.num_tokens
    assert stats["flat_tokens"] == sum(map(len, trajectories))
    assert abs(stats["redundancy"] - forest.redundancy) < 1e-12
    assert stats["nodes"] == forest.num_nodes and stats["max_branching"] >= 2
    assert 1.0 < stats["ideal_speedup"] and stats["micro_batches_budget"] > 1
    assert stats["linear_calls_budget"] >= stats["linear_calls_whole"] >= 1


def test_picture_has_one_box_per_node(tmp_path):
    path, trajectories = _file(tmp_path)
    forest = build_forest(trajectories)
    svg = forest_svg(forest)
    assert svg.count("<rect") == forest.num_nodes
    heights = [float(h) for h in re.findall(r'height="([0-9.]+)" fill', svg)]
    assert max(heights) == 6 * len(trajectories)  # the root box spans every trajectory of its tree
    out = tmp_path / "forest.html"
    cli(["analyze", str(path), "--html", str(out)])
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "redundancy" in page


def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys):
    import pytest

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\n{"tokens": [1, -3]}\n')
    with pytest.raises(SystemExit) as exit_info:
        cli(["analyze", str(bad)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "harts analyze: error:" in err and "line 2, position 1" in err
    with pytest.raises(ValueError, match="negative token id"):
        cli(["--debug", "analyze", str(bad)])
    good, _ = _file(tmp_path)
    with pytest.raises(ValueError, match="neither a family .* nor a local directory"):
        main([str(good), "--model", "no-such-model"])  # never a download
