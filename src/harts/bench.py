"""``harts bench``: tree vs flat vs stock per-trajectory training, on the shapes of design.md section 8.

For each model family (small random configs) and each shape (star, agentic, paper_like, deep,
random) it reports: the redundancy R; the FLOP-ideal speedup (:mod:`harts.bench_flops`); the
achieved speedup of the tree layout over the flat layout, both through the same step function,
kernels and budget; the speedup over stock Hugging Face training of each trajectory on its own;
peak memory of each (live-tensor peak, and on the CPU the resident-set peak too); calls per
linear-attention layer; and, on full-attention families and the one-prefix shape, the peers
PrefixGrouper and flash-pref (:mod:`harts.bench_peers`).

Objective: the SFT sum of every trajectory's next-token log-probs; one *step* = its forward and
backward. The step run on both layouts is one pluggable callable (``STEPS``: by default
:func:`harts.forest_backward` under ``--budget`` tokens per micro-batch; ``forward`` is the plain
whole-forest ``harts.forward`` + log-probs + backward).

Timing: one process, ``torch.set_num_threads`` fixed, every variant warmed up, then the variants
interleaved (tree, flat, stock, peers, tree, flat, ...) ``repeats`` times; medians are reported.
Memory: each (family, shape, variant) runs in a fresh child process; see :mod:`harts.bench_memory`.

What this leaves out: real tokenised data, real model sizes, optimizer steps, distributed runs.
Usage: ``python -m harts.bench [--quick] [--shapes star deep] [--families qwen3] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import harts
from harts.bench_flops import FLOP_MODEL_TEXT, flop_model, forest_flops
from harts.data.synthetic import scaled
from harts.forest import Forest
from harts.models import FAMILIES, tiny_model

__all__ = ["BenchConfig", "StepResult", "STEPS", "SHAPES", "build_case", "run", "main"]

SHAPES = ("star", "agentic", "paper_like", "deep", "random")

# --quick: counts cut down on top of a small length scale, so every shape has a few trajectories.
QUICK_SHAPES: dict[str, dict] = {
    "star": dict(num_completions=4),
    "agentic": dict(num_tasks=1, rollouts_per_task=4, turns=3),
    "paper_like": dict(num_tasks=1, rollouts_per_task=4, turns=3),
    "deep": dict(depth=2, branching=2),
    "random": dict(num_trajectories=8),
}

# "small" widths: a 1K vocabulary and 128-wide hidden states, so matmuls rather than Python
# overheads dominate while the whole sweep still fits a CPU. "tiny" is harts.models' test size.
_SMALL = dict(vocab_size=1024, hidden_size=128, intermediate_size=256)
_SMALL_EXTRA = {
    "bailing_hybrid": dict(moe_intermediate_size=64, head_dim=32, qk_nope_head_dim=32, v_head_dim=32),
    "kimi_linear": dict(moe_intermediate_size=64, linear_head_dim=32),
    "qwen3_next": dict(moe_intermediate_size=64, shared_expert_intermediate_size=64, head_dim=32),
    "qwen3": dict(head_dim=32),
    "llama": dict(),
}


@dataclass
class BenchConfig:
    """One benchmark run. ``quick`` shrinks everything to a smoke run (see :meth:`resolved`)."""

    shapes: tuple[str, ...] = SHAPES
    families: tuple[str, ...] = FAMILIES
    repeats: int = 5
    warmup: int = 1
    scale: float = 0.02  # length factor on synthetic.py's full-size defaults
    threads: int = 0  # 0: keep torch's default; always reported
    model_size: str = "small"  # "small" or "tiny"
    memory: bool = True
    peers: bool = True
    step: str = "forest_backward"  # key of STEPS
    budget_tokens: int | None = None  # micro-batch budget, the same for tree and flat
    device: str = "cpu"
    seed: int = 0
    quick: bool = False
    shape_overrides: dict[str, dict] = field(default_factory=dict)

    def resolved(self) -> BenchConfig:
        """Validate, and apply ``quick``: tiny models, scale 0.01, 1 repeat, cut-down shapes."""
        bad = [s for s in self.shapes if s not in SHAPES] + [f for f in self.families if f not in FAMILIES]
        if bad:
            raise ValueError(f"unknown shapes/families {bad}; shapes: {SHAPES}, families: {FAMILIES}")
        if self.step not in STEPS:
            raise ValueError(f"unknown step {self.step!r}; known: {sorted(STEPS)}")
        if self.model_size not in ("small", "tiny"):
            raise ValueError(f"model_size must be 'small' or 'tiny', got {self.model_size!r}")
        if self.repeats < 1 or self.scale <= 0:
            raise ValueError(f"need repeats >= 1 and scale > 0, got {self.repeats}, {self.scale}")
        cfg = dataclasses.replace(self)
        if cfg.quick:
            cfg.repeats, cfg.model_size, cfg.scale = 1, "tiny", min(cfg.scale, 0.01)
            cfg.shape_overrides = {**QUICK_SHAPES, **cfg.shape_overrides}
        if cfg.threads <= 0:
            cfg.threads = torch.get_num_threads()
        return cfg


# ---- the step: one forward + backward of the objective on a forest -------------------------------
@dataclass
class StepResult:
    """What a step hands back: the loss (a 0-d tensor) and the layouts of its micro-batches."""

    loss: torch.Tensor
    layouts: list = field(default_factory=list)


StepFn = Callable[[nn.Module, Forest, int | None], StepResult]


def sft_forward_step(model: nn.Module, forest: Forest, budget_tokens: int | None = None) -> StepResult:
    """``harts.forward`` on the whole forest, minus the summed next-token log-probs, backward.

    ``budget_tokens`` is ignored: this step runs the forest as one micro-batch.
    """
    out = harts.forward(model, forest)
    loss = -torch.cat(out.all_trajectory_logprobs()).sum()
    loss.backward()
    return StepResult(loss.detach(), [out.layout])


def sft_budget_step(model: nn.Module, forest: Forest, budget_tokens: int | None = None) -> StepResult:
    """:func:`harts.forest_backward` of the same objective under a micro-batch token budget."""
    predictor, target = harts.next_token_rows(forest)
    result = harts.forest_backward(
        model, forest, predictor, target, lambda logprob, entropy: -logprob.sum(), budget_tokens=budget_tokens
    )
    return StepResult(result.loss, result.layouts)


STEPS: dict[str, StepFn] = {"forest_backward": sft_budget_step, "forward": sft_forward_step}


def stock_step(model: nn.Module, trajectories: list[list[int]], device: torch.device) -> torch.Tensor:
    """Stock Hugging Face training, one trajectory at a time: logits, log-softmax, gather, backward."""
    total = torch.zeros((), device=device)
    for ids in trajectories:
        if len(ids) < 2:
            continue  # no next token to predict
        x = torch.tensor(ids, device=device)[None]
        logits = model(input_ids=x, use_cache=False).logits[0, :-1]
        logp = logits.float().log_softmax(-1).gather(-1, x[0, 1:, None]).sum()
        (-logp).backward()
        total = total - logp.detach()
    return total


# ---- cases ---------------------------------------------------------------------------------------
def make_model(family: str, cfg: BenchConfig) -> nn.Module:
    overrides = {} if cfg.model_size == "tiny" else {**_SMALL, **_SMALL_EXTRA[family]}
    return tiny_model(family, seed=cfg.seed, **overrides).to(cfg.device)


def make_trajectories(shape: str, cfg: BenchConfig, vocab_size: int) -> list[list[int]]:
    kwargs = dict(cfg.shape_overrides.get(shape, {}))
    if shape == "random":
        # random_forest's lengths are already tiny; its small vocabulary makes prefixes collide.
        kwargs.setdefault("max_len", max(8, round(2400 * cfg.scale)))
    else:
        kwargs.setdefault("vocab_size", vocab_size)
    return scaled(shape, cfg.scale, seed=cfg.seed, **kwargs)


@dataclass
class Case:
    family: str
    shape: str
    model: nn.Module
    trajectories: list[list[int]]
    tree: Forest
    flat: Forest


def build_case(cfg: BenchConfig, family: str, shape: str) -> Case:
    model = make_model(family, cfg)
    trajectories = make_trajectories(shape, cfg, model.config.vocab_size)
    tree = harts.build_forest(trajectories)
    flat = harts.build_forest(trajectories, share_prefixes=False)
    return Case(family, shape, model, trajectories, tree, flat)


def variant_fns(case: Case, cfg: BenchConfig) -> tuple[dict[str, Callable[[], StepResult]], dict[str, str]]:
    """(runnable variants by name, skipped variants with the reason) for one case."""
    step, device = STEPS[cfg.step], torch.device(cfg.device)
    fns: dict[str, Callable[[], StepResult]] = {
        "tree": lambda: step(case.model, case.tree, cfg.budget_tokens),
        "flat": lambda: step(case.model, case.flat, cfg.budget_tokens),
        "stock": lambda: StepResult(stock_step(case.model, case.trajectories, device)),
    }
    skipped: dict[str, str] = {}
    if cfg.peers:
        from harts import bench_peers  # lazy: the peers are optional packages

        for name, peer in bench_peers.peer_steps(case.model, case.trajectories, case.tree).items():
            if isinstance(peer, str):
                skipped[name] = peer
            else:
                fns[name] = lambda peer=peer: StepResult(peer())
    return fns, skipped


# ---- timing --------------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_variants(
    model: nn.Module,
    fns: dict[str, Callable[[], StepResult]],
    repeats: int,
    warmup: int,
    device: str,
    optional: tuple[str, ...] = (),
) -> tuple[dict[str, list[float]], dict[str, StepResult], dict[str, str]]:
    """Warm every variant up, then run them interleaved ``repeats`` times.

    Returns (seconds per run, last result, failures): a variant named in ``optional`` (a peer)
    that raises during warm-up is dropped with its error; any other error propagates.
    """
    results: dict[str, StepResult] = {}
    failed: dict[str, str] = {}
    for _ in range(max(warmup, 1)):
        for name, fn in list(fns.items()):
            model.zero_grad(set_to_none=True)
            try:
                results[name] = fn()
            except Exception as exc:
                if name not in optional:
                    raise
                failed[name] = f"failed: {type(exc).__name__}: {exc}"
                del fns[name]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            results[name] = fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return times, results, failed


def _plan_stats(result: StepResult, has_linear: bool) -> tuple[int | None, int | None]:
    """(calls per linear-attention layer, padded slots), summed over the step's micro-batches."""
    if not has_linear or not result.layouts:
        return None, None
    plans = [layout.linear_plan for layout in result.layouts]
    return sum(p.num_calls for p in plans), sum(p.padded_tokens for p in plans)


def run_case(cfg: BenchConfig, family: str, shape: str) -> dict:
    """Every measurement of one (family, shape): a JSON-ready row."""
    case = build_case(cfg, family, shape)
    fm = flop_model(case.model)
    flops_tree, flops_flat = forest_flops(fm, case.tree), forest_flops(fm, case.flat)
    fns, skipped = variant_fns(case, cfg)
    peers = tuple(n for n in fns if n not in ("tree", "flat", "stock"))
    times, results, failed = time_variants(case.model, fns, cfg.repeats, cfg.warmup, cfg.device, peers)
    skipped.update(failed)
    stock_loss = float(results["stock"].loss)
    variants: dict[str, dict] = {}
    for name in fns:
        loss = float(results[name].loss)
        calls, padded = _plan_stats(results[name], fm.num_linear_layers > 0)
        variants[name] = dict(
            status="ran",
            time_s=statistics.median(times[name]),
            times_s=times[name],
            loss=loss,
            loss_rel_diff_vs_stock=abs(loss - stock_loss) / max(abs(stock_loss), 1e-30),
            linear_calls=calls,
            linear_padded_slots=padded,
        )
    for name, reason in skipped.items():
        variants[name] = dict(status="skipped", reason=reason)
    if cfg.memory:
        from harts.bench_memory import measure_peak

        for name, v in variants.items():
            if v["status"] == "ran":
                v.update(measure_peak(cfg, family, shape, name))
    t = {name: v.get("time_s") for name, v in variants.items()}
    ideal = flops_flat / flops_tree
    achieved = t["flat"] / t["tree"]
    return dict(
        family=family,
        shape=shape,
        trajectories=case.tree.num_trajectories,
        unique_tokens=case.tree.num_tokens,
        flat_tokens=case.tree.num_flat_tokens,
        max_depth=case.tree.max_depth,
        redundancy=case.tree.redundancy,
        flops_tree=flops_tree,
        flops_flat=flops_flat,
        ideal_speedup=ideal,
        achieved_speedup=achieved,
        fraction_of_ideal=achieved / ideal,
        speedup_vs_stock=t["stock"] / t["tree"],
        flop_model=fm.as_dict(),
        variants=variants,
    )


def machine_info(cfg: BenchConfig) -> dict:
    info = dict(
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        device=cfg.device,
    )
    if cfg.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict:
    """Run every (family, shape) of ``cfg``; returns the JSON-ready results."""
    cfg = cfg.resolved()
    torch.set_num_threads(cfg.threads)
    rows = []
    for family in cfg.families:
        for shape in cfg.shapes:
            start = time.perf_counter()
            rows.append(run_case(cfg, family, shape))
            r = rows[-1]
            log(
                f"{family:>15} {shape:<10} R={r['redundancy']:.2f} ideal={r['ideal_speedup']:.2f} "
                f"tree/flat={r['achieved_speedup']:.2f} tree/stock={r['speedup_vs_stock']:.2f} "
                f"({time.perf_counter() - start:.1f} s)"
            )
    return dict(
        config=dataclasses.asdict(cfg),
        machine=machine_info(cfg),
        flop_model=FLOP_MODEL_TEXT,
        rows=rows,
    )


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, str]:
    p = argparse.ArgumentParser(prog="harts bench", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median reported)")
    p.add_argument("--scale", type=float, default=0.02, help="length factor on the full-size shapes")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--model-size", choices=("small", "tiny"), default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    p.add_argument("--no-peers", action="store_true", help="skip PrefixGrouper and flash-pref")
    p.add_argument("--out", default="bench-out", help="folder for results.json/.md and speedup.png")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny models and shapes, 1 repeat")
    p.add_argument("--budget", type=int, default=None, help="micro-batch token budget (tree and flat)")
    p.add_argument("--step", choices=sorted(STEPS), default="forest_backward")
    a = p.parse_args(argv)
    cfg = BenchConfig(
        shapes=tuple(a.shapes),
        families=tuple(a.families),
        repeats=a.repeats,
        scale=a.scale,
        threads=a.threads,
        model_size=a.model_size,
        device=a.device,
        memory=not a.no_memory,
        peers=not a.no_peers,
        quick=a.quick,
        budget_tokens=a.budget,
        step=a.step,
    )
    return cfg, a.out


def main(argv: list[str] | None = None) -> dict:
    from harts.bench_report import markdown, write_outputs

    cfg, out = parse_args(argv)
    results = run(cfg)
    print(markdown(results))
    for line in write_outputs(results, out):
        print(line)
    return results


if __name__ == "__main__":
    main()
