"""GUI-agent forests: a screenshot in every turn, the multimodal step on the tree against flat.

A GUI agent's rollouts of one task share the system prompt, the task's instruction and their first
turns (each turn a screenshot of the screen the agent sees, then its action), and branch at turn
boundaries: at its branch turn a rollout sees the same screen and acts otherwise, and from the next
turn on it sees screens of its own. This benchmark builds such rollouts for a tiny multimodal model
(the processor's row layout, random pixels), runs the training step (SFT) on the tree and on the
flat layout (every trajectory its own root and every screenshot occurrence its own pass through
the vision tower, as a flat trainer's micro-batches run them), at the tree's budget and without
one, and reports the redundancy of tokens and of images, the FLOP-ideal speedup with the vision
tower counted (each distinct image once in the tree, every occurrence in the flat layout), and the
achieved speedup against the faster flat run.

Usage: ``harts bench-gui [--family F] [--tasks 2] [--rollouts 4] [--turns 4] [--grid 8 12]
[--budget N] [--repeats 3] [--size small|tiny] [--threads 0] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

import harts
from harts.bench.cases import small_overrides
from harts.runtime.executor import resolve_model
from harts.runtime.flops import flop_model, forest_flops
from harts.steps.policy import forest_step, step_inputs
from harts.tiny import FAMILIES, VISION_LANGUAGE_FAMILIES, tiny_vision_language_model

__all__ = ["GuiShape", "gui_rollouts", "tower_flops", "measure", "main"]


@dataclass(frozen=True)
class GuiShape:
    """Tasks of ``rollouts_per_task`` rollouts, ``turns`` turns each (a screenshot of ``grid``
    patches, then an action), after a shared system prompt and the task's instruction."""

    tasks: int = 2
    rollouts_per_task: int = 4
    turns: int = 4
    system_tokens: int = 64
    instruction_tokens: int = 24
    action_tokens: int = 16
    grid: tuple[int, int] = (8, 12)
    seed: int = 0


class _Draw:
    """Random text below the model's special tokens, and random screenshots in its row layout."""

    def __init__(self, view, shape: GuiShape):
        vision_language, config = view.vision_language, view.multimodal.config
        self.rng = np.random.default_rng(shape.seed)
        image = vision_language.image_token_id(config)
        special = min(min(vision_language.image_placeholder(config, 1)), image)
        self.top = min(int(view.config.vocab_size), special)
        self.width = vision_language.pixel_row_width(config)
        h, w = shape.grid
        merge = vision_language.merge_size(config)
        self.grid, self.placeholder = [1, h, w], vision_language.image_placeholder(config, h * w // merge**2)

    def text(self, n: int) -> list[int]:
        return self.rng.integers(3, self.top, size=n).tolist()

    def screen(self) -> torch.Tensor:
        h, w = self.grid[1], self.grid[2]
        return torch.from_numpy(self.rng.standard_normal((h * w, self.width)).astype(np.float32))


def gui_rollouts(model, shape: GuiShape) -> list[harts.Rollout]:
    """The rollouts of ``shape`` for the multimodal ``model``: per task a trunk (rollout 0) and
    rollouts that leave it at a random turn (module docstring)."""
    view = resolve_model(model)
    draw = _Draw(view, shape)
    system, rollouts = draw.text(shape.system_tokens), []
    for _ in range(shape.tasks):
        instruction = draw.text(shape.instruction_tokens)
        screens = [draw.screen() for _ in range(shape.turns)]
        actions = [draw.text(shape.action_tokens) for _ in range(shape.turns)]
        for r in range(shape.rollouts_per_task):
            branch = shape.turns if r == 0 else int(draw.rng.integers(0, shape.turns))
            tokens, pixels = system + instruction, []
            for k in range(shape.turns):
                pixels.append(screens[k] if k <= branch else draw.screen())
                tokens += draw.placeholder + (actions[k] if k < branch else draw.text(shape.action_tokens))
            grids = torch.tensor([draw.grid] * shape.turns)
            rollouts.append(harts.Rollout(tokens, pixel_values=torch.cat(pixels), image_grid_thw=grids))
    return rollouts


def tower_flops(model, forest: harts.Forest) -> int:
    """Forward + backward FLOPs of the vision tower over the forest's images (each kept image once:
    the distinct ones of a tree, every occurrence of the flat layout), as ``forest_flops`` counts
    the text model's."""
    view = resolve_model(model)
    grids = forest.images.image_grid_thw.tolist()
    return 3 * sum(view.vision_language.image_flops(view.multimodal, grid) for grid in grids)


def _median_seconds(model, runs: dict[str, tuple], repeats: int) -> dict[str, float]:
    """The median seconds of each run's step (``name: (forest, rows, budget)``), the runs taking
    turns within every repeat, so that a change in the machine's load falls on all of them."""
    config, sums = harts.PolicyLossConfig(kind="sft"), harts.Normalizers(torch.tensor(1.0), torch.tensor(1.0))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (forest, rows, budget) in runs.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            forest_step(model, forest, rows, config, normalizers=sums, budget_tokens=budget)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


# The "small" vision tower beside harts bench's small text widths (harts.bench.cases): matmuls
# rather than Python overheads dominate, as in the text benchmark.
SMALL_VISION = dict(hidden_size=128, intermediate_size=256, num_heads=4)


def measure(
    family: str, shape: GuiShape, budget: int | None = None, repeats: int = 3, size: str = "small"
) -> dict:
    """The tree and flat steps on ``shape``'s rollouts of a ``size`` (``small`` or ``tiny``)
    ``family`` multimodal model."""
    if size not in ("small", "tiny"):
        raise ValueError(f"size must be 'small' or 'tiny', got {size!r}")
    text, vision = (small_overrides(family), SMALL_VISION) if size == "small" else ({}, {})
    model = tiny_vision_language_model(family, seed=shape.seed, vision=vision, **text)
    rollouts = gui_rollouts(model, shape)
    tree, tree_rows = step_inputs(model, rollouts, share_prefixes=True)
    flat, flat_rows = step_inputs(model, rollouts, share_prefixes=False)
    fm = flop_model(resolve_model(model))
    flops = {
        name: forest_flops(fm, f) + tower_flops(model, f) for name, f in (("tree", tree), ("flat", flat))
    }
    runs = {
        "tree": (tree, tree_rows, budget),
        "flat": (flat, flat_rows, budget),
        "flat_whole": (flat, flat_rows, None),
    }
    _median_seconds(model, runs, 1)  # a first step of each: allocations and lazy imports, not timed
    seconds = _median_seconds(model, runs, repeats)
    ideal = flops["flat"] / flops["tree"]
    achieved = min(seconds["flat"], seconds["flat_whole"]) / seconds["tree"]
    return dict(
        family=family,
        size=size,
        shape=dataclasses.asdict(shape),
        budget=budget,
        trajectories=len(rollouts),
        flat_tokens=tree.num_flat_tokens,
        unique_tokens=tree.num_tokens,
        redundancy=tree.redundancy,
        images=flat.images.num_images,
        distinct_images=tree.images.num_images,
        image_redundancy=flat.images.num_images / tree.images.num_images,
        tower_flops_tree=tower_flops(model, tree),
        tower_flops_flat=tower_flops(model, flat),
        flops_tree=flops["tree"],
        flops_flat=flops["flat"],
        ideal_speedup=ideal,
        seconds=seconds,
        achieved_speedup=achieved,
        fraction_of_ideal=achieved / ideal,
        threads=torch.get_num_threads(),
    )


def main(argv: list[str] | None = None) -> dict:
    families = [f for f in VISION_LANGUAGE_FAMILIES if f in FAMILIES]
    parser = argparse.ArgumentParser(prog="harts bench-gui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default=families[0] if families else None, choices=families)
    defaults = GuiShape()
    parser.add_argument("--tasks", type=int, default=defaults.tasks)
    parser.add_argument("--rollouts", type=int, default=defaults.rollouts_per_task)
    parser.add_argument("--turns", type=int, default=defaults.turns)
    parser.add_argument(
        "--grid",
        type=int,
        nargs=2,
        default=list(defaults.grid),
        metavar=("H", "W"),
        help="patches per screenshot (multiples of the merge size)",
    )
    parser.add_argument("--budget", type=int, default=None, help="unique tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--size",
        choices=("small", "tiny"),
        default="small",
        help="harts bench's small widths (default) or harts.tiny's",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    if args.family is None:
        raise ValueError("no multimodal family is available in the installed transformers")
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = GuiShape(
        tasks=args.tasks, rollouts_per_task=args.rollouts, turns=args.turns, grid=tuple(args.grid)
    )
    result = measure(args.family, shape, args.budget, args.repeats, args.size)
    r = result
    print(
        f"{r['family']}: {r['trajectories']} trajectories, {r['flat_tokens']} flat / {r['unique_tokens']} "
        f"unique tokens (R {r['redundancy']:.2f}), {r['images']} screenshots / {r['distinct_images']} "
        f"distinct; FLOP-ideal speedup {r['ideal_speedup']:.2f}x (vision tower counted), achieved "
        f"{r['achieved_speedup']:.2f}x ({r['fraction_of_ideal']:.0%} of ideal)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return result


if __name__ == "__main__":
    main()
