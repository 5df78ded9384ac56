"""Per-rank tensor peak of one FSDP2 / DDP training step: harts against the stock FSDP2 step.

    python -m harts.bench.fsdp_memory --families qwen3 bailing_hybrid --ranks 1 2 4 \\
        --out docs/bench/fsdp-memory.json

For each family and rank count N the script starts itself N times under ``torch.distributed.run``
(gloo, CPU, one thread per rank). Every rank takes its share of one agentic forest
(``assign_trees(forest, N).trajectories[rank]``) and measures one step (forward + backward, no
optimizer step) of three variants, each on a freshly built model (same seed), so that no variant's
caches count in another's:

- ``stock_fsdp``: the model sharded with ``fully_shard`` (each decoder layer, then the root) and,
  for each of the rank's trajectories, ``model(input_ids=ids[None], use_cache=False).logits``, a
  masked token-mean cross entropy and ``.backward()``: one forward/backward per trajectory, with
  FSDP2's own hooks (gathers per layer, reduce-scatters after each backward). A rank with fewer
  trajectories than another repeats its last one with weight 0, as FSDP2 needs every rank to
  run as many forwards.
- ``harts_fsdp``: ``harts.rollout_step`` (PPO loss) on the same sharded model.
- ``harts_ddp``: ``harts.rollout_step`` on ``DistributedDataParallel(model)``.
- ``stock_floor`` (asked for by name): a lower bound of ``stock_fsdp``'s peak that needs far less
  memory to measure: the stock step of each of the rank's trajectories alone on the unwrapped
  model (no FSDP2, nothing gathered), each profiled on its own; the largest. The stock FSDP2 step
  runs the same forward and backward per trajectory and holds the gathered units on top, so its
  peak is at least this. Used where profiling the whole stock FSDP2 step does not fit in memory
  (four ranks of the bailing_hybrid step, whose pure-PyTorch KDA issues many small ops).

Method: the step runs once (warm-up: FSDP2's lazy init, first-call caches); then
:func:`harts.bench.memory.tensor_peak_bytes` profiles the CPU allocator during the step (the most
bytes held by live torch tensors at once, above those live when the step starts), with gradients
dropped (``set_to_none``) before and after. Reported per rank, with P = the bytes of the whole
unwrapped model's parameters: that peak; the address-matched peak of one more profiled step
(:func:`address_peak`) and the bytes of frees the profiler missed there; and the bytes of
parameters plus gradients the rank holds after the step (local shards for DTensors).

What the tensor peak leaves out: memory not held by torch tensors (Python objects, BLAS/oneDNN
scratch, gloo's own buffers), allocations on threads the profiler does not follow, and frees of
tensors allocated before profiling (see harts.bench.memory). The parameters and gradients held
before the step (the model, sharded or whole) are in the baseline, not in the peak. With N > 1 it
also reads high by the tensors gloo frees on its worker threads, which the profiler does not see
(``unseen frees``; mostly FSDP2's reduce-scatter, once per trajectory in the stock step): the
address-matched peak corrects for those. CPU figures; a GPU's caching allocator adds its reserve.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta

# the folder harts is imported from: the workers import it from there, whatever their directory
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("stock_fsdp", "harts_fsdp", "harts_ddp", "stock_floor")
MIB = 2**20
# Worker options: harts' budget_tokens; the model's widths (moe_intermediate and experts: bailing_hybrid's
# experts); the agentic forest's shape; torch threads per rank; gloo's timeout (s).
WORKER_OPTIONS = dict(
    budget=1024,
    hidden=512,
    intermediate=1536,
    moe_intermediate=384,
    experts=8,
    layers=8,
    heads=8,
    kv_heads=4,
    head_dim=64,
    vocab=2048,
    system_len=600,
    tasks=2,
    rollouts_per_task=4,
    turns=3,
    turn_len=150,
    threads=1,
    dist_timeout=600.0,
)


def model_overrides(family: str, a: argparse.Namespace) -> dict:
    """The tiny config's fields for ``a``'s widths (``--layers`` wide layers)."""
    common = dict(
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        vocab_size=a.vocab,
    )
    if family != "bailing_hybrid":
        return common
    # Ling 3: KDA linear layers, with an MLA full-attention layer every fourth (and last) layer;
    # MLA has a key and a value per head (transformers' forward needs as many KV heads as heads).
    types = [
        "full_attention" if i % 4 == 3 or i == a.layers - 1 else "linear_attention" for i in range(a.layers)
    ]
    return dict(
        common,
        num_key_value_heads=a.heads,
        moe_intermediate_size=a.moe_intermediate,
        num_experts=a.experts,
        kv_lora_rank=2 * a.head_dim,
        qk_rope_head_dim=a.head_dim // 2,
        qk_nope_head_dim=a.head_dim,
        v_head_dim=a.head_dim,
        layer_types=types,
    )


def local_bytes(t) -> int:
    """Bytes of ``t`` on this rank (a DTensor's local shard; 0 for None)."""
    t = t.to_local() if type(t).__name__ == "DTensor" else t
    return 0 if t is None else t.numel() * t.element_size()


def stock_step(model, rollouts, rounds: int) -> None:
    """One forward/backward per trajectory through the FSDP2 module's own forward."""
    import torch
    import torch.nn.functional as F

    total = max(1, sum(int(sum(r.loss_mask[1:])) for r in rollouts))
    for i in range(rounds):
        r = rollouts[min(i, len(rollouts) - 1)]
        ids = torch.tensor(r.tokens)
        mask = torch.tensor(r.loss_mask[1:], dtype=torch.bool)
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
        token_loss = F.cross_entropy(logits.float(), ids[1:], reduction="none")
        weight = 1.0 if i < len(rollouts) else 0.0  # padding rounds: FSDP2 needs equal forwards
        (token_loss[mask].sum() * (weight / total)).backward()


def stock_floor(model, mine: list) -> dict:
    """The largest tensor peak of one trajectory's stock step on the unwrapped ``model``, each
    trajectory measured on its own (after a warm-up of its own): a lower bound of the stock FSDP2
    step's peak on this rank (module docstring)."""
    import torch.distributed as dist

    from harts.bench.memory import tensor_peak_bytes

    def reset():
        model.zero_grad(set_to_none=True)

    peak = 0
    for r in mine:
        step = lambda r=r: stock_step(model, [r], 1)  # noqa: E731
        step()  # warm-up
        reset()
        peak = max(peak, tensor_peak_bytes(step, reset))
    dist.barrier()
    held = sum(local_bytes(p) for p in model.parameters())
    return dict(peak_bytes=peak, matched_peak_bytes=peak, unseen_free_bytes=0, params_grads_bytes=held)


def address_peak(step, reset) -> tuple[int, int]:
    """(peak, unseen) of one profiled ``step()``, its allocation events matched by address
    (:func:`address_profile`)."""
    found = address_profile(step, reset)
    return found["peak"], found["unseen"]


def address_profile(step, reset) -> dict:
    """``peak``, ``unseen`` and ``end`` of one profiled ``step()`` (``reset()`` after it), its
    allocation events matched by address.

    With gloo, a collective's work object can hold the last reference to a tensor (the clone in
    ``_reduce_scatter_base_``, FSDP2's all-gather buffers) and free it on gloo's worker thread, a
    free the profiler does not record: the running sum of :func:`tensor_peak_bytes` then keeps
    it. Here such a free is known when the address is allocated again while still live; it is
    placed at the end of the outermost op that allocated it, or at that reallocation if earlier.
    ``unseen``: the bytes of those frees. Tensors still live at the end stay live: ``end``, the
    bytes the step allocated that are still held after ``reset()`` (a cache it fills, or what it
    leaves behind).
    """
    import gc
    import math

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        reset()
        gc.collect()
    allocs, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation:
            top = node.parent
            while top is not None and top.parent is not None:
                top = top.parent
            end = math.inf if top is None else top.end_time_ns
            allocs.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size, end))
    live, deltas, unseen = {}, [], 0
    for t, ptr, size, end in sorted(allocs, key=lambda a: a[0]):
        if ptr in live and size > 0:  # its free was not recorded
            held, held_end = live.pop(ptr)
            deltas.append((min(held_end, t), -held))
            unseen += held
        if size > 0:
            live[ptr] = (size, end)
            deltas.append((t, size))
        elif ptr in live:  # a free of a tensor allocated before profiling is left out
            deltas.append((t, -live.pop(ptr)[0]))
    running = peak = 0
    for _, d in sorted(deltas):
        running += d
        peak = max(peak, running)
    return dict(peak=peak, unseen=unseen, end=running)


def measure(variant: str, a: argparse.Namespace, mine: list, rounds: int) -> dict:
    import gc

    import torch
    import torch.distributed as dist

    import harts
    from harts.bench.memory import tensor_peak_bytes
    from harts.tiny import tiny_model

    model = tiny_model(a.family, seed=0, **model_overrides(a.family, a))
    if variant == "stock_floor":
        return stock_floor(model, mine)
    if variant == "harts_ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    loss = harts.PolicyLossConfig(kind="ppo")
    if variant == "stock_fsdp":
        step = lambda: stock_step(wrapped, mine, rounds)  # noqa: E731
    else:
        step = lambda: harts.rollout_step(wrapped, mine, loss, budget_tokens=a.budget)  # noqa: E731

    kept = []

    def reset():
        wrapped.zero_grad(set_to_none=True)
        # tensor_peak_bytes repeats its measurement (one more step profiled first) when tensors the
        # step allocated outlive reset(): each rank's own choice, and a rank running more steps than
        # another would wait forever in its collectives. 4 bytes kept here send every rank that way.
        kept.append(torch.empty(1))

    step()  # warm-up
    held = sum(local_bytes(p) + local_bytes(p.grad) for p in wrapped.parameters())
    wrapped.zero_grad(set_to_none=True)
    gc.collect()
    dist.barrier()
    peak = tensor_peak_bytes(step, reset)
    dist.barrier()
    matched, unseen = address_peak(step, lambda: wrapped.zero_grad(set_to_none=True))
    dist.barrier()
    return dict(
        peak_bytes=peak, matched_peak_bytes=matched, unseen_free_bytes=unseen, params_grads_bytes=held
    )


def worker(a: argparse.Namespace) -> None:
    import gc

    import torch
    import torch.distributed as dist

    import harts
    from harts.data.synthetic import agentic
    from harts.plan.ranks import assign_trees
    from harts.runtime.distributed import close_process_group
    from harts.tiny import tiny_model

    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.dist_timeout))
    finished = False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        probe = tiny_model(a.family, seed=0, **model_overrides(a.family, a))
        whole = sum(p.numel() * p.element_size() for p in probe.parameters())
        vocab = probe.config.get_text_config().vocab_size
        del probe
        tokens = agentic(
            system_len=a.system_len,
            num_tasks=a.tasks,
            rollouts_per_task=a.rollouts_per_task,
            turns=a.turns,
            turn_len=a.turn_len,
            vocab_size=vocab,
            seed=0,
        )
        rollouts = [
            harts.Rollout(
                t, loss_mask=[0] + [1] * (len(t) - 1), advantages=1.0, rollout_logprobs=[-1.0] * len(t)
            )
            for t in tokens
        ]
        forest = harts.build_forest(tokens)
        mine = [rollouts[i] for i in assign_trees(forest, world).trajectories[rank]]
        counts = [None] * world
        dist.all_gather_object(counts, len(mine))
        row = dict(rank=rank, trajectories=len(mine), tokens=sum(len(r.tokens) for r in mine), variants={})
        for v in a.variants:
            row["variants"][v] = measure(v, a, mine, max(counts))
            gc.collect()  # the variant's model, before the next one is built
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            result = dict(
                family=a.family,
                world=world,
                param_bytes=whole,
                budget_tokens=a.budget,
                overrides=model_overrides(a.family, a),
                forest_tokens=forest.num_tokens,
                forest_flat_tokens=forest.num_flat_tokens,
                ranks=rows,
            )
            with open(a.result, "w") as f:
                json.dump(result, f, indent=1)
        finished = True
    finally:
        close_process_group(wait=finished)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    a: argparse.Namespace, family: str, n: int, argv: list[str], module: str = "harts.bench.fsdp_memory"
) -> dict:
    """One ``torch.distributed.run`` of N workers of ``module`` (``--worker``); its rank 0's JSON,
    or an error."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix=f"{module.rsplit('.', 1)[-1]}-{family}-{n}-")
    os.close(fd)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={n}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        module,
        "--worker",
        "--family",
        family,
        "--result",
        path,
        *argv,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        KINETO_LOG_LEVEL="6",
        PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p),
    )
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=a.timeout)
        with open(path) as f:
            text = f.read()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: the session it leads
        proc.communicate()
        return dict(family=family, world=n, error=f"timed out after {a.timeout:.0f} s")
    finally:
        os.unlink(path)
    if proc.returncode != 0 or not text:
        return dict(family=family, world=n, error=f"exit code {proc.returncode}", log=out[-4000:])
    return json.loads(text)


def table(results: list[dict]) -> str:
    """Markdown: per (family, N, variant) the max over ranks of each figure, in MiB and in P."""
    lines = [
        "| family | N | variant | step peak (MiB) | peak / P | address-matched peak (MiB) | matched / P "
        "| unseen frees (MiB) | params+grads per rank (MiB) | params+grads / P | harts_fsdp / stock_fsdp "
        "(peak; matched) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['world']} | error: {r['error']} |" + " |" * 8)
            continue
        whole, ranks = r["param_bytes"], r["ranks"]
        top = {
            v: {k: max(x["variants"][v][k] for x in ranks) for k in ranks[0]["variants"][v]}
            for v in ranks[0]["variants"]
        }
        for v, f in top.items():
            ratio = ""
            if v == "harts_fsdp" and "stock_fsdp" in top and top["stock_fsdp"]["peak_bytes"]:
                s = top["stock_fsdp"]
                ratio = (
                    f"{f['peak_bytes'] / s['peak_bytes']:.2f}; "
                    f"{f['matched_peak_bytes'] / max(1, s['matched_peak_bytes']):.2f}"
                )
            elif v == "harts_fsdp" and "stock_floor" in top and top["stock_floor"]["peak_bytes"]:
                # against a lower bound of the stock step's peak: an upper bound of the ratio
                ratio = f"<= {f['matched_peak_bytes'] / top['stock_floor']['peak_bytes']:.2f} (stock_floor)"
            lines.append(
                f"| {r['family']} | {r['world']} | {v} | {f['peak_bytes'] / MIB:.1f} | "
                f"{f['peak_bytes'] / whole:.2f} | {f['matched_peak_bytes'] / MIB:.1f} | "
                f"{f['matched_peak_bytes'] / whole:.2f} | {f['unseen_free_bytes'] / MIB:.1f} | "
                f"{f['params_grads_bytes'] / MIB:.1f} | {f['params_grads_bytes'] / whole:.2f} | {ratio} |"
            )
    return "\n".join(lines)


def parse_launcher(parser: argparse.ArgumentParser, options: dict) -> argparse.Namespace:
    """``parser``'s arguments plus the workers' ``options`` (passed on to each worker) and the hidden
    ones a worker process is started with (``--worker``, ``--family``, ``--result``)."""
    for name, default in options.items():
        parser.add_argument(
            "--" + name.replace("_", "-"), type=type(default), default=default, help=f"default {default}"
        )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker_argv(a: argparse.Namespace, options: dict) -> list[str]:
    """The arguments a launcher passes on to its workers: ``options``' values and the variants."""
    return [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in options] + ["--variants", *a.variants]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["qwen3", "bailing_hybrid"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--out", help="write every run's per-rank figures here (JSON)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per (family, N) run")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:3]))
    a = parse_launcher(parser, WORKER_OPTIONS)
    if a.worker:
        return worker(a)
    argv = worker_argv(a, WORKER_OPTIONS)
    results = []
    for family in a.families:
        for n in a.ranks:
            r = launch(a, family, n, argv)
            if "error" in r:
                print(f"{family} N={n}: {r['error']}\n{r.get('log', '')}", file=sys.stderr)
            else:
                print(
                    f"{family} N={n}: P = {r['param_bytes'] / MIB:.1f} MiB, forest {r['forest_tokens']} "
                    f"unique / {r['forest_flat_tokens']} flat tokens",
                    flush=True,
                )
            results.append(r)
            if a.out:  # after every run: a later run that fails or is stopped keeps the earlier ones
                with open(a.out, "w") as f:
                    json.dump(results, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
