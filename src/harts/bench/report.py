"""Reporting for ``harts bench``: the Markdown tables, ``results.json``/``.md`` and ``speedup.png``.

The plot needs matplotlib (the ``bench`` extra); it is imported lazily with the Agg backend, and
when it is missing the plot is skipped with a message. Nothing here measures anything.
"""

from __future__ import annotations

import json
from pathlib import Path

from harts.bench.cases import is_flat_variant

__all__ = ["markdown", "write_outputs", "plot"]

_PEERS = ("prefix_grouper", "flash_pref")
# What each memory method of harts.bench.memory measures (results.json keeps the method per figure).
_METHODS = {
    "cpu_tensor_peak": "live tensors",
    "cuda_max_allocated": "live tensors",
    "vmhwm_reset": "resident set",
    "ru_maxrss": "resident set",
}


def _f(x, fmt: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _ms(v: dict) -> str:
    return _f(v.get("time_s") and v["time_s"] * 1e3, ".0f")


def _mib(v: dict, key: str = "peak_mib") -> str:
    return _f(v.get(key), ".1f")


def _ratio(a: dict, b: dict, key: str) -> str:
    x, y = a.get(key), b.get(key)
    return "-" if x is None or not y else f"{x / y:.2f}"


def _best_flat(row: dict) -> str:
    """The fastest flat run's ms and budget ("whole": one micro-batch), the baseline of the row."""
    name = row.get("flat_best", "flat")
    budget = row.get("flat_best_budget")
    return f"{_ms(row['variants'][name])} ({'whole' if budget is None else budget})"


def main_table(results: dict) -> list[str]:
    budgeted = any("flat_whole" in r["variants"] for r in results["rows"])
    whole_head, whole_rule = (" | flat whole", "---:|") if budgeted else ("", "")
    lines = [
        "| family | shape | traj | flat tok | R | ideal | tree vs flat | % of ideal | tree vs stock "
        "| calls/lin tree | calls/lin flat | peak MiB tree | flat | stock | ms tree | flat"
        + whole_head
        + " | flat best (budget) | stock |",
        "|---|---|" + "---:|" * 14 + whole_rule + "---:|---:|",
    ]
    for r in results["rows"]:
        v = r["variants"]
        t, fl, st = v["tree"], v["flat"], v["stock"]
        whole = ""
        if budgeted:
            whole = f" | {_ms(v['flat_whole'])}" if "flat_whole" in v else " | -"
        lines.append(
            f"| {r['family']} | {r['shape']} | {r['trajectories']} | {r['flat_tokens']} "
            f"| {r['redundancy']:.2f} | {r['ideal_speedup']:.2f} | {r['achieved_speedup']:.2f} "
            f"| {100 * r['fraction_of_ideal']:.0f}% | {r['speedup_vs_stock']:.2f} "
            f"| {_f(t.get('linear_calls'), 'd')} | {_f(fl.get('linear_calls'), 'd')} "
            f"| {_mib(t)} | {_mib(fl)} | {_mib(st)} | {_ms(t)} | {_ms(fl)}{whole} | {_best_flat(r)} "
            f"| {_ms(st)} |"
        )
    return lines


def rss_table(results: dict) -> list[str]:
    """The resident-set peaks (CPU) beside the tree/flat ratio of both figures; empty without any."""
    rows = [r for r in results["rows"] if any("rss_peak_mib" in v for v in r["variants"].values())]
    if not rows:
        return []
    lines = [
        "| family | shape | RSS MiB tree | flat | stock | peak tree/flat | RSS tree/flat |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t, fl, st = (r["variants"][n] for n in ("tree", "flat", "stock"))
        lines.append(
            f"| {r['family']} | {r['shape']} | {_mib(t, 'rss_peak_mib')} | {_mib(fl, 'rss_peak_mib')} "
            f"| {_mib(st, 'rss_peak_mib')} | {_ratio(t, fl, 'peak_mib')} | {_ratio(t, fl, 'rss_peak_mib')} |"
        )
    return lines


def peer_table(results: dict) -> list[str]:
    """One line per peer run (or failure); the two support limits are summarised below the table."""
    lines = [
        "| family | shape | system | status | ms | vs stock | harts tree speedup over it "
        "| loss rel. diff vs stock | peak MiB | RSS MiB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    hybrid: set[str] = set()
    deeper: set[str] = set()
    for r in results["rows"]:
        v = r["variants"]
        for name in _PEERS:
            p = v.get(name)
            if p is None:
                continue
            if p["status"] == "ran":
                lines.append(
                    f"| {r['family']} | {r['shape']} | {name} | ran | {_ms(p)} "
                    f"| {v['stock']['time_s'] / p['time_s']:.2f} | {p['time_s'] / v['tree']['time_s']:.2f} "
                    f"| {p['loss_rel_diff_vs_stock']:.1e} | {_mib(p)} | {_mib(p, 'rss_peak_mib')} |"
                )
            elif p["reason"].startswith("full attention only"):
                hybrid.add(r["family"])
            elif p["reason"].startswith("one shared prompt"):
                deeper.add(r["shape"])
            else:
                lines.append(f"| {r['family']} | {r['shape']} | {name} | {p['reason']} | | | | | | |")
    if hybrid or deeper:
        lines.append("")
    if hybrid:
        lines.append(f"Not run on {', '.join(sorted(hybrid))}: both peers support full attention only.")
    if deeper:
        lines.append(
            f"Not run on {', '.join(sorted(deeper))}: both peers take one shared prompt and G "
            "completions only (a depth-1 tree)."
        )
    return lines


def _run(cfg: dict) -> dict:
    return cfg.get("run") or {}


def _budget(cfg: dict):
    """The micro-batch budget of a run (results written before the run config held it: top level)."""
    return _run(cfg).get("budget_tokens", cfg.get("budget_tokens"))


def markdown(results: dict) -> str:
    cfg, mach = results["config"], results["machine"]
    rows = results["rows"]
    worst = max(
        (
            v.get("loss_rel_diff_vs_stock", 0.0)
            for r in rows
            for n, v in r["variants"].items()
            if (n == "tree" or is_flat_variant(n)) and v["status"] == "ran"
        ),
        default=0.0,
    )
    gpu = f" ({mach['gpu']})" if "gpu" in mach else ""
    memory = []
    for key, column in (("memory_method", "peak MiB"), ("rss_memory_method", "RSS MiB")):
        methods = sorted({v.get(key) for r in rows for v in r["variants"].values()} - {None})
        if methods:
            memory.append(f"`{column}` = " + ", ".join(f"{m} ({_METHODS.get(m, '?')})" for m in methods))
    head = [
        "## harts bench" + (" (quick smoke run)" if cfg["quick"] else ""),
        "",
        f"- machine: {mach['processor']}, {mach['cpu_count']} CPUs, torch {mach['torch']}, "
        f"{mach['threads']} threads, device {mach['device']}{gpu}",
        f"- models: {cfg['model_size']} random configs; shapes at scale {cfg['scale']}; "
        f"step `{cfg['step']}`, budget {_budget(cfg) or 'none (whole forest)'}, "
        f"linear plan {_run(cfg).get('linear_plan', 'auto')}"
        f"{', linear calls recomputed' if _run(cfg).get('recompute_linear') else ''}; "
        f"median of {cfg['repeats']} interleaved runs after {max(cfg['warmup'], 1)} warm-up",
        f"- FLOP model: {results['flop_model']}",
        f"- peak memory of one step: {'; '.join(memory) or 'not measured'} (see docs/benchmarks.md)",
        f"- objective check: largest relative loss difference of tree/flat vs stock {worst:.1e}",
        "",
    ]
    rss = rss_table(results)
    rss = ["", "### Resident-set peak", ""] + rss if rss else []
    return "\n".join(head + main_table(results) + rss + ["", "### Peers", ""] + peer_table(results)) + "\n"


def plot(results: dict, path: Path) -> str:
    """Achieved and ideal tree-vs-flat speedup against R, one marker per family."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: skipped speedup.png (pip install matplotlib)"
    markers = "osD^v<>px*"
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    families = list(dict.fromkeys(r["family"] for r in results["rows"]))
    top = 1.0
    for i, fam in enumerate(families):
        rows = [r for r in results["rows"] if r["family"] == fam]
        rs = [r["redundancy"] for r in rows]
        m = markers[i % len(markers)]
        achieved = [r["achieved_speedup"] for r in rows]
        ax.scatter(rs, achieved, marker=m, color=f"C{i}", label=f"{fam} achieved")
        ax.scatter(
            rs,
            [r["ideal_speedup"] for r in rows],
            marker=m,
            facecolors="none",
            edgecolors=f"C{i}",
            label=f"{fam} ideal",
        )
        top = max([top] + rs + [r["ideal_speedup"] for r in rows] + [r["achieved_speedup"] for r in rows])
    ax.plot([1, top], [1, top], color="grey", linewidth=0.8, linestyle="--", label="speedup = R")
    ax.set_xlabel("redundancy R (flat tokens / unique tokens)")
    ax.set_ylabel("tree vs flat speedup (fwd+bwd)")
    ax.set_title("harts: achieved (filled) and FLOP-ideal (hollow) speedup")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def write_outputs(results: dict, out_dir: str | Path) -> list[str]:
    """Write results.json, results.md and speedup.png under ``out_dir``; returns log lines."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results))
    written = [f"wrote {out / name}" for name in ("results.json", "results.md")]
    return written + [plot(results, out / "speedup.png")]
