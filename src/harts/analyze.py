"""``harts analyze FILE``: how much a rollout file shares, and what a step on it would run.

Reads a rollout file (JSONL or Parquet, :mod:`harts.data.rollout_files`), merges it into a
forest and reports: trajectories, unique and flat tokens, the redundancy R, roots, nodes, depth
and branching; for a model (a built-in tiny family, or a local Hugging Face directory, whose
modules are built on the meta device: no weights are read) the FLOP-ideal speedup of the tree over
the flat layout and the linear-attention calls per layer of the plan, whole and under a token
budget. ``--html`` writes a self-contained page with an icicle picture of the forest: one box
per node, as wide as its tokens (path positions left to right) and as tall as the trajectories
through it, darker where more trajectories share it.

With ``--model`` and a file that holds the engine's log-probs (``rollout_logprobs``, or the turns
form's ``completion_logprobs``), the model (its weights loaded: a local directory, or a tiny
family's seeded initialisation) scores every loss token of the file, forward only and under
``--budget``, with its recorded MoE routes replayed where the file has them, and the report gains
the engine-trainer mismatch: ``mismatch_kl`` (k3 of KL(engine || trainer)), ``mismatch_log_rho_abs``
(mean |log rho|) and the figures of :func:`harts.objectives.mismatch.mismatch_figures`, at the
sampling ``--temperature``. Nothing is trained.

What this leaves out: the chat form of rollout files, and timing (``harts bench`` measures).
"""

from __future__ import annotations

import argparse
import html
import json
from pathlib import Path

import numpy as np
import torch

from harts.adapters.base import registered_adapter
from harts.data.rollout_files import read_rollouts
from harts.forest import Forest, build_forest
from harts.forest_routes import routes_of
from harts.objectives.mismatch import mismatch_figures
from harts.plan.layout import TreeLayout
from harts.plan.micro_batches import plan_micro_batches
from harts.runtime.flops import flop_model, forest_flops
from harts.tiny import ALL_FAMILIES, FAMILIES, tiny_config

__all__ = ["forest_stats", "plan_stats", "forest_svg", "main"]


def forest_stats(forest: Forest) -> dict:
    """Counts that say how much the forest shares."""
    parent = forest.node_parent.numpy()
    children = np.bincount(parent[parent >= 0], minlength=forest.num_nodes)
    branching = children[children > 1]
    return dict(
        trajectories=forest.num_trajectories,
        unique_tokens=forest.num_tokens,
        flat_tokens=forest.num_flat_tokens,
        redundancy=forest.redundancy,
        roots=int((parent < 0).sum()),
        nodes=forest.num_nodes,
        max_depth=forest.max_depth,
        branch_nodes=int(branching.size),
        mean_branching=float(branching.mean()) if branching.size else 0.0,
        max_branching=int(children.max()) if forest.num_nodes else 0,
    )


def _meta_model(model: str):
    """A model of ``model`` (a family name or a local directory) on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model in ALL_FAMILIES:
        config = tiny_config(model)  # FamilyUnavailable when the installed transformers lacks it
    elif Path(model).is_dir():
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    else:
        families = ", ".join(FAMILIES)
        raise ValueError(f"--model {model!r} is neither a family ({families}) nor a local directory")
    adapter = registered_adapter(config.model_type)
    with torch.device("meta"):
        if adapter is not None:
            return adapter.model_from_config(config)
        return AutoModelForCausalLM.from_config(config)


def plan_stats(forest: Forest, trajectories, model: str, budget: int | None) -> dict:
    """The FLOP-ideal speedup for ``model`` and the linear-attention calls per layer of the plan."""
    meta = _meta_model(model)
    fm = flop_model(meta)
    flat = build_forest(trajectories, share_prefixes=False)
    out = dict(model=model, ideal_speedup=forest_flops(fm, flat) / forest_flops(fm, forest))
    if fm.num_linear_layers:
        for name, b in (("whole", None), ("budget", budget)):
            if name == "budget" and b is None:
                continue
            plan = plan_micro_batches(forest, b)
            single = plan.num_micro_batches == 1
            layouts = [TreeLayout(plan.forest, "cpu", None if single else p) for p in plan.parts]
            out[f"linear_calls_{name}"] = sum(lay.linear_plan.num_calls for lay in layouts)
            out[f"micro_batches_{name}"] = plan.num_micro_batches
    return out


def forest_svg(forest: Forest, width: int = 960, row_height: int = 6) -> str:
    """An icicle picture of the forest as an SVG string (one ``<rect>`` per node)."""
    parent = forest.node_parent.numpy()
    ends = forest.trajectory_end_node.numpy()
    # rows: trajectories in the pre-order of their end nodes, so every subtree's rows are contiguous
    order = np.argsort(ends, kind="stable")
    row_of = np.empty_like(order)
    row_of[order] = np.arange(order.size)
    first = np.full(forest.num_nodes, order.size, dtype=np.int64)
    last = np.full(forest.num_nodes, -1, dtype=np.int64)
    for t, node in enumerate(ends.tolist()):
        n = node
        while n >= 0 and not (first[n] <= row_of[t] <= last[n]):
            first[n], last[n] = min(first[n], row_of[t]), max(last[n], row_of[t])
            n = parent[n]
    start = forest.node_path_start.numpy()
    length = forest.node_length.numpy()
    mult = forest.node_multiplicity.numpy()
    scale = width / max(int((start + length).max()), 1)
    height = max(order.size, 1) * row_height
    boxes = []
    for n in range(forest.num_nodes):
        shade = int(235 - 175 * (mult[n] - 1) / max(int(mult.max()) - 1, 1))
        x, w = start[n] * scale, max(length[n] * scale, 0.5)
        y, h = first[n] * row_height, (last[n] - first[n] + 1) * row_height
        tip = (
            f"node {n}: {length[n]} tokens at positions {start[n]}..{start[n] + length[n] - 1}, "
            f"{mult[n]} trajectories"
        )
        boxes.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{h}" fill="rgb({shade},{shade},255)" '
            f'stroke="white" stroke-width="0.5"><title>{html.escape(tip)}</title></rect>'
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">' + "".join(boxes) + "</svg>"
    )


def _page(path: Path, stats: dict, svg: str) -> str:
    cells = ((html.escape(k), html.escape(str(v))) for k, v in stats.items())
    rows = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in cells)
    title = html.escape(path.name)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>harts analyze {title}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 12px}</style></head><body>"
        f"<h1>{html.escape(path.name)}</h1><table>{rows}</table>"
        "<p>One box per node: width = its tokens (path positions left to right), height = the "
        "trajectories through it; darker = shared by more trajectories.</p>"
        f"{svg}</body></html>"
    )


def mismatch_stats(rollouts, model: str, budget: int | None, temperature: float = 1.0) -> dict:
    """The engine-trainer mismatch of ``rollouts`` (which carry the engine's log-probs) under
    ``model`` (a tiny family or a local directory, loaded with its weights): module docstring."""
    from harts.runtime.forward_only import forest_logprobs
    from harts.trainer.config import ModelConfig
    from harts.trainer.inputs import load_model

    spec = ModelConfig(tiny=model, seed=0) if model in ALL_FAMILIES else ModelConfig(path=Path(model))
    loaded = load_model(spec, seed=0).eval()
    with torch.no_grad():
        scored = forest_logprobs(
            loaded, rollouts, budget_tokens=budget, temperature=temperature, loss_positions_only=True
        )
    engine, trainer, trajectory = [], [], []
    for i, (r, old) in enumerate(zip(rollouts, scored.logprobs, strict=True)):
        mask = (
            np.ones(len(r.tokens), dtype=bool) if r.loss_mask is None else np.asarray(r.loss_mask, dtype=bool)
        )
        mask[0] = False
        where = torch.from_numpy(np.flatnonzero(mask))
        engine.append(torch.as_tensor(np.asarray(r.rollout_logprobs, dtype=np.float64))[where])
        trainer.append(old.double()[where])
        trajectory.append(torch.full((where.numel(),), i))
    b, o = torch.cat(engine), torch.cat(trainer)
    log_rho = o - b
    stats = {
        "mismatch_tokens": int(b.numel()),
        "mismatch_kl": float((torch.expm1(log_rho) - log_rho).mean()),
        "mismatch_log_rho_abs": float(log_rho.abs().mean()),
    }
    stats.update(mismatch_figures(b, o, torch.cat(trajectory)))
    return stats


def analyze(
    path: str | Path,
    model: str | None = None,
    budget: int | None = None,
    tokenizer=None,
    temperature: float = 1.0,
) -> tuple[dict, Forest]:
    """The figures of a rollout file (``tokenizer``: for a file in chat form) and its forest; with
    ``model`` and the engine's log-probs in the file, the engine-trainer mismatch too."""
    rollouts = read_rollouts(path, tokenizer=tokenizer)
    trajectories = [r.tokens for r in rollouts]
    forest = build_forest(trajectories, routed_experts=routes_of(rollouts))
    stats = forest_stats(forest)
    if model is not None:
        stats.update(plan_stats(forest, trajectories, model, budget))
        if all(r.rollout_logprobs is not None for r in rollouts):
            stats.update(mismatch_stats(rollouts, model, budget, temperature))
    return stats, forest


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="harts analyze", description=__doc__.splitlines()[0])
    p.add_argument("file", help="rollout file (.jsonl or .parquet)")
    p.add_argument("--model", help=f"a tiny family ({', '.join(FAMILIES)}) or a local model directory")
    p.add_argument("--budget", type=int, default=None, help="unique tokens per micro-batch for the plan")
    p.add_argument("--tokenizer", help="local tokenizer directory, for a file in chat form (messages)")
    p.add_argument("--html", help="write a self-contained page with a picture of the forest")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the engine's sampling temperature, for the mismatch of its log-probs",
    )
    a = p.parse_args(argv)
    stats, forest = analyze(a.file, a.model, a.budget, a.tokenizer, a.temperature)
    if a.json:
        print(json.dumps(stats))
    else:
        for key, value in stats.items():
            print(f"{key:>20}: {value:.3f}" if isinstance(value, float) else f"{key:>20}: {value}")
    if a.html:
        Path(a.html).write_text(_page(Path(a.file), stats, forest_svg(forest)))
        print(f"wrote {a.html}")
    return stats


if __name__ == "__main__":
    main()
