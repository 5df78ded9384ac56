"""Per-rank memory of the whole RL recipe under FSDP2: set-up, and the peak of each phase of a step.

    python -m harts.bench.recipe_memory --models qwen3_next:tiny qwen3:wide --ranks 1 2 4 \\
        --out docs/bench/recipe-memory.json

A model is ``family:tiny`` (``harts.tiny.tiny_model(family)`` as it is) or ``family:wide`` (the
widths of :mod:`harts.bench.fsdp_memory`: 8 layers of width 512 by default). For each model and
rank count N the script starts itself N times under ``torch.distributed.run`` (gloo, CPU, one
thread per rank). Every rank holds what ``harts train`` holds with ``strategy = "fsdp"``,
``[reference]``, ``[ppo]`` and ``[critic]``, each sharded with ``fully_shard`` on every decoder
layer and then the model (:func:`harts.trainer.processes.fsdp_shard`):

- the policy, with AdamW's state (both moments; built by one step on zero gradients, weight decay
  0, so the weights do not move);
- the frozen reference (the policy's weights, no gradients, no optimizer);
- the critic, the policy's backbone under a fresh scalar head as the trainer builds it from the
  policy (the family's ``*ForTokenClassification``, else :class:`harts.ValueHead`), with AdamW's
  state.

Each rank takes its share of one agentic forest (``assign_trees(forest, N).trajectories[rank]``,
the same rollouts on every N) and runs the phases of one recipe step, in the trainer's order:

=============== ========================================== ===============================================
phase           harts                                      stock FSDP2 (per trajectory, FSDP2's own hooks)
=============== ========================================== ===============================================
``reference``   ``forest_logprobs(reference, ...)``        ``torch.no_grad()``: ``reference(input_ids)``,
                                                           log-softmax, the tokens' log-probs
``old``         ``forest_logprobs(policy, ...)``           the same on the policy
``values``      ``forward_values(critic, ...)``            ``torch.no_grad()``: ``critic(input_ids)``
``policy``      ``rollout_step(policy, ...)`` (PPO, KL)    ``policy(input_ids)``, cross entropy, backward
``critic``      ``value_step(critic, ...)`` (clipped)      ``critic(input_ids)``, squared error, backward
=============== ========================================== ===============================================

``plain`` (asked for by name): harts' three forward-only passes on the same share with the
three models whole and unwrapped (no FSDP2, no optimizers): what the sharded passes cost beyond
the pass itself is their peak minus this one (the gathered units).

harts runs under ``RunConfig(budget_tokens=--budget)`` (the trainer's default otherwise:
``hold_tokens = "auto"``, ``fsdp_overlap``), the forward-only passes on their own share. A stock
rank with fewer trajectories than another repeats its last one (weight 0 in an update): FSDP2's
gathers need every rank to run as many forwards. The two variants are measured each on a freshly
built set-up (same seeds), so no variant's caches count in the other's; no optimizer step runs.

Method: the whole step runs once (warm-up: FSDP2's lazy init, first-call caches); then each phase
runs once more under the profiler, gradients dropped (``set_to_none``) after it, and its peak is
:func:`harts.bench.fsdp_memory.address_peak`: the most bytes held by live torch tensors at once
above those live when the phase starts, allocation events matched by address (gloo frees some
tensors on its worker threads, which the profiler does not record); ``left_bytes``, what the
phase allocated that is still held after it (it can read high by a buffer gloo freed unseen whose
address was not reused), and ``units_left_gathered``, the FSDP2 units whose parameters are still
whole after the phase (read from FSDP2's state, not from the profiler). "Held after set-up" is the
bytes of every tensor of the three models and the two optimizers on the rank (local shards):
what the phases' peaks stand on. P is the bytes of the whole unwrapped policy's parameters.

What the figures leave out: as :mod:`harts.bench.fsdp_memory` (memory not held by torch tensors,
allocations on threads the profiler does not follow). CPU figures; a GPU's caching allocator adds
its reserve.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta

from harts.bench.fsdp_memory import (
    MIB,
    WORKER_OPTIONS,
    address_profile,
    launch,
    local_bytes,
    model_overrides,
    parse_launcher,
    stock_step,
    worker_argv,
)

PHASES = ("reference", "old", "values", "policy", "critic")
MODELS = ("policy", "reference", "critic")
FORWARD_ONLY = PHASES[:3]
VARIANTS = ("stock", "harts", "plain")
# fsdp_memory's widths and forest, with the trainer's default hold_tokens
OPTIONS = dict(WORKER_OPTIONS, hold_tokens="auto", kl_coef=0.05, value_clip=0.2)


def parse_model(spec: str) -> tuple[str, str]:
    family, _, shape = spec.partition(":")
    if shape not in ("tiny", "wide"):
        raise ValueError(f"{spec!r}: expected FAMILY:tiny or FAMILY:wide")
    return family, shape


def build_policy(spec: str, a: argparse.Namespace):
    """The unwrapped policy of ``spec`` (seed 0): the tiny model, or fsdp_memory's widths."""
    from harts.tiny import tiny_model

    family, shape = parse_model(spec)
    return tiny_model(family, seed=0, **(model_overrides(family, a) if shape == "wide" else {}))


def _adamw(model):
    """AdamW over ``model``'s parameters with its state built (one step on zero gradients, weight
    decay 0: the weights do not move)."""
    import torch

    optim = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return optim


def set_up(spec: str, a: argparse.Namespace, shard: bool = True) -> dict:
    """Policy, reference and critic sharded as ``harts train`` holds them, the policy's and the
    critic's AdamW states built; ``shard=False``: the three whole, without optimizers."""
    import torch

    from harts.trainer.critic import fresh_head
    from harts.trainer.processes import fsdp_shard

    wrap = fsdp_shard if shard else (lambda m: m)
    policy = wrap(build_policy(spec, a).train())
    reference = wrap(build_policy(spec, a).eval().requires_grad_(False))
    critic = wrap(fresh_head(build_policy(spec, a), torch.float32, 1).train())
    if not shard:
        return dict(policy=policy, reference=reference, critic=critic)
    return dict(
        policy=policy,
        reference=reference,
        critic=critic,
        policy_optim=_adamw(policy),
        critic_optim=_adamw(critic),
    )


def unit_bytes(model) -> dict:
    """Bytes of the whole model's FSDP2 units: its largest decoder layer, and the root (the rest)."""
    from harts.adapters import adapter_for

    layers = [
        sum(p.numel() * p.element_size() for p in layer.parameters())
        for layer in adapter_for(model).backbone(model).layers
    ]
    return dict(
        layer=max(layers), root=sum(p.numel() * p.element_size() for p in model.parameters()) - sum(layers)
    )


def gathered_units(s: dict) -> list[str]:
    """The FSDP2 units of the set-up's models whose parameters are whole now (``policy:3``: the
    policy's fourth unit in module order)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for name in MODELS:
        units = [m for m in s[name].modules() if isinstance(m, FSDPModule)]
        out += [
            f"{name}:{i}" for i, m in enumerate(units) if m._get_fsdp_state()._fsdp_param_group.is_unsharded
        ]
    return out


def held_bytes(s: dict) -> dict:
    """Bytes of the set-up's tensors on this rank, by part."""
    import torch

    def states(optim):
        return sum(local_bytes(v) for st in optim.state.values() for v in st.values() if torch.is_tensor(v))

    out = {name: sum(local_bytes(p) for p in s[name].parameters()) for name in MODELS}
    if "policy_optim" in s:
        out.update(policy_optimizer=states(s["policy_optim"]), critic_optimizer=states(s["critic_optim"]))
    out["total"] = sum(out.values())
    return out


def _scores(out):
    return getattr(out, "logits", out)  # a token classifier's output, or a ValueHead's tensor


def stock_logprobs(model, mine: list, rounds: int) -> None:
    """Per trajectory under ``torch.no_grad()``: the FSDP2 model's forward and the log-probs of
    its loss tokens (what the trainer's pass keeps)."""
    import torch

    kept = []
    with torch.no_grad():
        for i in range(rounds):
            r = mine[min(i, len(mine) - 1)]
            ids = torch.tensor(r.tokens)
            mask = torch.tensor(r.loss_mask[1:], dtype=torch.bool)
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])[:, 0]
            kept.append(lp[mask])


def stock_values(critic, mine: list, rounds: int) -> None:
    """Per trajectory under ``torch.no_grad()``: the FSDP2 critic's value of every position."""
    import torch

    kept = []
    with torch.no_grad():
        for i in range(rounds):
            ids = torch.tensor(mine[min(i, len(mine) - 1)].tokens)
            kept.append(_scores(critic(input_ids=ids[None], use_cache=False))[0, :, 0])


def stock_value_step(critic, mine: list, rounds: int) -> None:
    """Per trajectory: the FSDP2 critic's forward, a squared error against the returns at the loss
    tokens (a token mean over the rank's), backward."""
    import torch

    total = max(1, sum(int(sum(r.loss_mask[1:])) for r in mine))
    for i in range(rounds):
        r = mine[min(i, len(mine) - 1)]
        ids = torch.tensor(r.tokens)
        mask = torch.tensor(r.loss_mask[1:], dtype=torch.bool)
        values = _scores(critic(input_ids=ids[None], use_cache=False))[0, :-1, 0]
        target = torch.tensor(r.returns[1:], dtype=values.dtype)
        weight = 1.0 if i < len(mine) else 0.0
        ((values - target)[mask].square().sum() * (0.5 * weight / total)).backward()


def phase_steps(variant: str, s: dict, mine: list, rounds: int, a: argparse.Namespace) -> dict:
    """Each phase of one recipe step, as a callable."""
    import harts

    if variant == "stock":
        return dict(
            reference=lambda: stock_logprobs(s["reference"], mine, rounds),
            old=lambda: stock_logprobs(s["policy"], mine, rounds),
            values=lambda: stock_values(s["critic"], mine, rounds),
            policy=lambda: stock_step(s["policy"], mine, rounds),
            critic=lambda: stock_value_step(s["critic"], mine, rounds),
        )
    hold = a.hold_tokens if a.hold_tokens == "auto" else int(a.hold_tokens)
    run = harts.RunConfig(budget_tokens=a.budget, hold_tokens=hold)
    loss = harts.PolicyLossConfig(kind="ppo", kl_coef=a.kl_coef)
    value_loss = harts.ValueLossConfig(clip=a.value_clip)
    return dict(
        reference=lambda: harts.forest_logprobs(s["reference"], mine, run=run, loss_positions_only=True),
        old=lambda: harts.forest_logprobs(s["policy"], mine, run=run, loss_positions_only=True),
        values=lambda: harts.forward_values(s["critic"], mine, run=run),
        policy=lambda: harts.rollout_step(s["policy"], mine, loss, run=run),
        critic=lambda: harts.value_step(s["critic"], mine, value_loss, run=run),
    )


def measure(variant: str, spec: str, a: argparse.Namespace, mine: list, rounds: int) -> dict:
    import gc

    import torch.distributed as dist

    s = set_up(spec, a, shard=variant != "plain")
    held = held_bytes(s)
    steps = phase_steps(variant, s, mine, rounds, a)
    phase_names = PHASES if variant != "plain" else FORWARD_ONLY

    def reset():
        s["policy"].zero_grad(set_to_none=True)
        s["critic"].zero_grad(set_to_none=True)

    for name in phase_names:  # warm-up: the whole step once
        steps[name]()
        reset()
    gc.collect()
    phases = {}
    for name in phase_names:
        dist.barrier()
        found = address_profile(lambda name=name: steps[name](), reset)
        phases[name] = dict(
            peak_bytes=found["peak"],
            unseen_free_bytes=found["unseen"],
            left_bytes=found["end"],
            units_left_gathered=gathered_units(s),
        )
    dist.barrier()
    return dict(held=held, phases=phases)


def rollouts_of(vocab: int, a: argparse.Namespace) -> list:
    """The agentic forest's rollouts, every annotation the recipe's phases read present (their
    values do not change what memory the phases take)."""
    import harts
    from harts.data.synthetic import agentic

    tokens = agentic(
        system_len=a.system_len,
        num_tasks=a.tasks,
        rollouts_per_task=a.rollouts_per_task,
        turns=a.turns,
        turn_len=a.turn_len,
        vocab_size=vocab,
        seed=0,
    )
    return [
        harts.Rollout(
            t,
            loss_mask=[0] + [1] * (len(t) - 1),
            advantages=1.0,
            rollout_logprobs=[-1.0] * len(t),
            ref_logprobs=[-1.1] * len(t),
            returns=[0.5] * len(t),
            values=[0.4] * len(t),
        )
        for t in tokens
    ]


def worker(a: argparse.Namespace) -> None:
    import gc

    import torch
    import torch.distributed as dist

    import harts
    from harts.plan.ranks import assign_trees
    from harts.runtime.distributed import close_process_group

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.dist_timeout))
    finished = False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        probe = build_policy(a.family, a)
        whole = sum(p.numel() * p.element_size() for p in probe.parameters())
        vocab = probe.config.get_text_config().vocab_size
        units = unit_bytes(probe)
        del probe
        rollouts = rollouts_of(vocab, a)
        forest = harts.build_forest([r.tokens for r in rollouts])
        mine = [rollouts[i] for i in assign_trees(forest, world).trajectories[rank]]
        if not mine:
            raise RuntimeError(f"rank {rank} has no trajectories: use a larger forest for {world} ranks")
        counts = [None] * world
        dist.all_gather_object(counts, len(mine))
        row = dict(rank=rank, trajectories=len(mine), tokens=sum(len(r.tokens) for r in mine), variants={})
        for v in a.variants:
            row["variants"][v] = measure(v, a.family, a, mine, max(counts))
            gc.collect()  # the variant's models, before the next ones are built
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            family, shape = parse_model(a.family)
            result = dict(
                model=a.family,
                world=world,
                param_bytes=whole,
                unit_bytes=units,
                budget_tokens=a.budget,
                hold_tokens=a.hold_tokens,
                overrides=model_overrides(family, a) if shape == "wide" else {},
                forest_tokens=forest.num_tokens,
                forest_flat_tokens=forest.num_flat_tokens,
                trajectories=len(rollouts),
                ranks=rows,
            )
            with open(a.result, "w") as f:
                json.dump(result, f, indent=1)
        finished = True
    finally:
        close_process_group(wait=finished)


def _top(r: dict) -> dict:
    """The max over ranks of each figure: {variant: {"held": ..., phase: peak_bytes}}."""
    ranks = r["ranks"]
    out = {}
    for v in ranks[0]["variants"]:
        f = {"held": max(x["variants"][v]["held"]["total"] for x in ranks)}
        for p in ranks[0]["variants"][v]["phases"]:
            f[p] = max(x["variants"][v]["phases"][p]["peak_bytes"] for x in ranks)
        out[v] = f
    return out


def table(results: list[dict]) -> str:
    """Markdown: per (model, N), held after set-up and each phase's peak (max over ranks), stock
    and harts, in MiB and in P, and harts / stock."""
    lines = [
        "| model | N | held after set-up | phase | stock FSDP2 peak | harts peak | harts / stock |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['world']} | error: {r['error']} | | | | |")
            continue
        whole, top = r["param_bytes"], _top(r)

        def cell(b, whole=whole):
            return f"{b / MIB:,.1f} MiB ({b / whole:.2f} P)"

        held = top.get("harts", top.get("stock"))["held"]
        for i, p in enumerate(PHASES):
            stock, tree = top.get("stock", {}).get(p), top.get("harts", {}).get(p)
            ratio = f"{tree / stock:.2f}" if stock and tree is not None else ""
            first = f"| {r['model']} | {r['world']} | {cell(held)} |" if i == 0 else "| | | |"
            lines.append(
                f"{first} {p} | {cell(stock) if stock is not None else ''} | "
                f"{cell(tree) if tree is not None else ''} | {ratio} |"
            )
    return "\n".join(lines)


def table_by_ranks(results: list[dict]) -> str:
    """Markdown, one model's runs (both variants measured): a row per figure (held after set-up,
    each phase's peak: max over ranks), a column per N: stock and harts in MiB, harts in P, and
    harts / stock."""
    runs = sorted((r for r in results if "error" not in r), key=lambda r: r["world"])
    whole = runs[0]["param_bytes"]
    head = " | ".join(f"N = {r['world']}: stock / harts (MiB), harts in P, harts / stock" for r in runs)
    lines = [f"| P = {whole / MIB:.2f} MiB | {head} |", "|---|" + "---|" * len(runs)]
    tops = [_top(r) for r in runs]
    for row in ("held", *PHASES):
        cells = []
        for top in tops:
            stock, tree = top.get("stock", {}).get(row), top.get("harts", {}).get(row)
            if row == "held":
                cells.append(f"{tree / MIB:,.1f} ({tree / whole:.2f} P)")
                continue
            cells.append(f"{stock / MIB:,.1f} / {tree / MIB:,.1f}, {tree / whole:.2f} P, {tree / stock:.2f}")
        name = "held after set-up" if row == "held" else f"{row} peak"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = []
    for top in tops:  # what the rank holds at its highest: set-up plus the largest phase peak
        stock, tree = (top[v]["held"] + max(top[v][p] for p in PHASES) for v in ("stock", "harts"))
        cells.append(f"{stock / MIB:,.1f} / {tree / MIB:,.1f}, {tree / whole:.2f} P, {tree / stock:.2f}")
    lines.append("| held + largest peak | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3_next:tiny", "qwen3:wide"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--out", help="write every run's per-rank figures here (JSON)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per (model, N) run")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:2]))
    a = parse_launcher(parser, OPTIONS)
    if a.worker:
        return worker(a)
    for spec in a.models:
        parse_model(spec)
    argv = worker_argv(a, OPTIONS)
    results = []
    for spec in a.models:
        for n in a.ranks:
            r = launch(a, spec, n, argv, module="harts.bench.recipe_memory")
            if "error" in r:
                r["model"] = r.pop("family")
                print(f"{spec} N={n}: {r['error']}\n{r.get('log', '')}", file=sys.stderr)
            else:
                print(
                    f"{spec} N={n}: P = {r['param_bytes'] / MIB:.1f} MiB, forest {r['forest_tokens']} "
                    f"unique / {r['forest_flat_tokens']} flat tokens",
                    flush=True,
                )
            results.append(r)
            if a.out:  # after every run: a later run that fails or is stopped keeps the earlier ones
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=1)
    print(table(results))
    for spec in a.models if {"stock", "harts"} <= set(a.variants) else []:
        mine = [r for r in results if r.get("model") == spec]
        if any("error" not in r for r in mine):
            print(f"\n{spec}\n" + table_by_ranks(mine))


if __name__ == "__main__":
    main()
