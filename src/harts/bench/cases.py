"""The benchmark's cases: its config, models, shapes and the steps it times.

A *case* is one (family, shape): a small random model of the family and synthetic trajectories
of the shape, built into a tree forest and a flat one. The variants timed on a case are the step
on the tree, the same step on the flat layout (``share_prefixes=False``: packed sequences through
the same kernels), stock per-trajectory training, and the peers where they apply
(:mod:`harts.bench.peers`).

The flat layout runs as a good flat trainer runs: micro-batches of whole trajectories packed up to
the budget (a trajectory longer than the budget alone in its micro-batch, never cut: verl's and
TRL's token budgets must hold the longest sequence), each run forward and backward once. It runs
at the tree's budget (``flat``), without one (``flat_whole``, one micro-batch) and at each of
``BenchConfig.flat_budgets`` (``flat_<B>``), and the benchmark compares the tree against the
fastest of them: flat at its best budget, the strongest flat baseline. Whatever the tree's budget:
one huge flat micro-batch is slower per FLOP than several cache-sized ones, and a comparison
against it alone would flatter the tree.

Objective: the SFT sum of every trajectory's next-token log-probs (``Normalizers`` of 1, so the
peers' and the stock step's sums compare directly); one *step* = its forward and backward.
``STEPS``: ``forest_step`` (default, :func:`harts.forest_step` under the run config's budget) or
``forward`` (the plain whole-forest :func:`harts.forward` + log-probs + backward).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

import harts
from harts.adapters import adapter_for_type
from harts.data.synthetic import scaled
from harts.forest import Forest
from harts.runtime.config import RunConfig
from harts.runtime.result import step_result
from harts.tiny import FAMILIES, tiny_model

__all__ = [
    "BenchConfig",
    "STEPS",
    "SHAPES",
    "Case",
    "build_case",
    "variant_fns",
    "flat_run",
    "flat_budgets",
    "flat_budget_variants",
    "is_flat_variant",
    "make_trajectories",
]

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
# overheads dominate while the whole sweep still fits a CPU (each adapter's ``small_overrides``
# widen its heads and experts to match). "tiny" is harts.tiny's size.
_SMALL = dict(vocab_size=1024, hidden_size=128, intermediate_size=256)

# The full sweep's families (the KDA, GDN and full-attention ones the benchmark tables report);
# any supported family can be named with --families.
DEFAULT_FAMILIES = tuple(
    f for f in ("bailing_hybrid", "kimi_linear", "qwen3_next", "qwen3", "llama") if f in FAMILIES
)


@dataclass
class BenchConfig:
    """One benchmark run. ``quick`` shrinks everything to a smoke run (see :meth:`resolved`)."""

    shapes: tuple[str, ...] = SHAPES
    families: tuple[str, ...] = DEFAULT_FAMILIES
    repeats: int = 5
    warmup: int = 1
    scale: float = 0.02  # length factor on synthetic.py's full-size defaults
    threads: int = 0  # 0: keep torch's default; always reported
    model_size: str = "small"  # "small" or "tiny"
    memory: bool = True
    peers: bool = True
    step: str = "forest_step"  # key of STEPS
    run: RunConfig = field(default_factory=RunConfig)  # budget and plan knobs, the same for tree and flat
    # more budgets the flat layout runs at (besides the tree's and none): its best one is the baseline
    flat_budgets: tuple[int, ...] = (1024, 4096)
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
        if any(b < 1 for b in self.flat_budgets):
            raise ValueError(f"flat budgets must be positive token counts, got {self.flat_budgets}")
        cfg = dataclasses.replace(self)
        if cfg.quick:
            cfg.repeats, cfg.model_size, cfg.scale = 1, "tiny", min(cfg.scale, 0.01)
            cfg.shape_overrides = {**QUICK_SHAPES, **cfg.shape_overrides}
        if cfg.threads <= 0:
            cfg.threads = torch.get_num_threads()
        return cfg


# ---- the step: one forward + backward of the objective on a forest -------------------------------
SUM = harts.Normalizers(torch.tensor(1.0), torch.tensor(1.0))  # token mean over 1 token: the sum
SFT = harts.PolicyLossConfig(kind="sft")

StepFn = Callable[[nn.Module, Forest, harts.LossRows, RunConfig], harts.StepResult]


def sft_forward_step(
    model: nn.Module, forest: Forest, rows: harts.LossRows, run: RunConfig
) -> harts.StepResult:
    """:func:`harts.forward` on the whole forest, minus the summed next-token log-probs, backward.

    The budget is ignored: this step runs the forest as one micro-batch and keeps its graph.
    """
    out = harts.forward(model, forest, dataclasses.replace(run, budget_tokens=None))
    logprob, entropy = out.logprobs(rows.predictor, rows.target)
    loss = -logprob.sum()
    loss.backward()
    n = out.layout.num_tokens
    return step_result(
        loss.detach(), logprob.detach(), entropy.detach(), layouts=[out.layout], tokens_per_micro_batch=[n]
    )


def sft_step(model: nn.Module, forest: Forest, rows: harts.LossRows, run: RunConfig) -> harts.StepResult:
    """:func:`harts.forest_step` of the same objective under the run config's micro-batch budget."""
    return harts.forest_step(model, forest, rows, SFT, normalizers=SUM, run=run)


STEPS: dict[str, StepFn] = {"forest_step": sft_step, "forward": sft_forward_step}


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
def small_overrides(family: str) -> dict:
    """The tiny config's fields that make ``family``'s "small" bench model (its adapter's widths)."""
    return {**_SMALL, **adapter_for_type(family).small_overrides.get(family, {})}


def make_model(family: str, cfg: BenchConfig) -> nn.Module:
    overrides = {} if cfg.model_size == "tiny" else small_overrides(family)
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
    tree_rows: harts.LossRows
    flat_rows: harts.LossRows


def build_case(cfg: BenchConfig, family: str, shape: str) -> Case:
    model = make_model(family, cfg)
    trajectories = make_trajectories(shape, cfg, model.config.get_text_config().vocab_size)
    tree = harts.build_forest(trajectories)
    flat = harts.build_forest(trajectories, share_prefixes=False)
    rollouts = [harts.Rollout(t) for t in trajectories]
    tree_rows = harts.build_loss_rows(tree, rollouts)
    flat_rows = harts.build_loss_rows(flat, rollouts)
    return Case(family, shape, model, trajectories, tree, flat, tree_rows, flat_rows)


def flat_run(run: RunConfig, flat: Forest) -> RunConfig:
    """The flat layout's run config at the tree's budget: never below the longest trajectory, so
    that no trajectory is cut (a flat trainer's micro-batch holds whole sequences)."""
    if run.budget_tokens is None:
        return run
    longest = int(flat.trajectory_length.max()) if flat.num_trajectories else 0
    return dataclasses.replace(run, budget_tokens=max(run.budget_tokens, longest))


def is_flat_variant(name: str) -> bool:
    """``flat`` (at the tree's budget), ``flat_whole`` (no budget) or ``flat_<B>`` (budget B)."""
    return name == "flat" or name.startswith("flat_")


def flat_budgets(cfg: BenchConfig, flat: Forest) -> dict[str, int | None]:
    """The flat variants of a case by name, each with its budget (None: one micro-batch): the
    tree's budget, no budget and each of ``cfg.flat_budgets`` (:func:`flat_budget_variants`)."""
    return flat_budget_variants(cfg.run.budget_tokens, cfg.flat_budgets, flat)


def effective_flat_budget(budget: int | None, flat: Forest) -> int | None:
    """The budget the flat layout's micro-batches run at: None (one micro-batch) when ``budget``
    holds the whole flat forest, else ``budget`` raised to the longest trajectory (:func:`flat_run`)."""
    if budget is None or budget >= flat.num_tokens:
        return None
    return flat_run(RunConfig(budget_tokens=budget), flat).budget_tokens


def flat_budget_variants(budget: int | None, others: Iterable[int], flat: Forest) -> dict[str, int | None]:
    """``{"flat": budget, "flat_whole": None, "flat_<B>": B for B in others}``, keeping only
    distinct micro-batch plans: a budget that holds the whole flat forest runs it as one
    micro-batch, the same step as no budget, and one below the longest trajectory is raised to it
    (:func:`flat_run`)."""

    budgets: dict[str, int | None] = {"flat": budget}
    seen = {effective_flat_budget(budget, flat)}
    if None not in seen:
        budgets["flat_whole"] = None
        seen.add(None)
    for b in sorted(set(others)):
        if (plan := effective_flat_budget(b, flat)) not in seen:
            budgets[f"flat_{b}"] = b
            seen.add(plan)
    return budgets


def variant_fns(case: Case, cfg: BenchConfig) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """(runnable variants by name, skipped variants with the reason) for one case.

    The tree and flat variants return a :class:`harts.StepResult`; the others their loss tensor.
    The flat variants are those of :func:`flat_budgets`, each under the run config with its budget
    (raised to the longest trajectory where needed, :func:`flat_run`).
    """
    step, device = STEPS[cfg.step], torch.device(cfg.device)
    fns: dict[str, Callable[[], object]] = {
        "tree": lambda: step(case.model, case.tree, case.tree_rows, cfg.run),
    }
    for name, budget in flat_budgets(cfg, case.flat).items():
        run = flat_run(dataclasses.replace(cfg.run, budget_tokens=budget), case.flat)
        fns[name] = functools.partial(step, case.model, case.flat, case.flat_rows, run)
    fns["stock"] = lambda: stock_step(case.model, case.trajectories, device)
    skipped: dict[str, str] = {}
    if cfg.peers:
        from harts.bench import peers  # lazy: the peers are optional packages

        for name, peer in peers.peer_steps(case.model, case.trajectories, case.tree).items():
            if isinstance(peer, str):
                skipped[name] = peer
            else:
                fns[name] = peer
    return fns, skipped
