"""``RunConfig(verify=True)`` on two FSDP2 ranks (run by tests/test_verify_sharded.py under torchrun).

    python -m torch.distributed.run --nproc_per_node=2 tests/verify_worker.py FAMILY OUT [SHAPE]

SHAPE: ``fp32`` (default), ``mixed`` (fp32 shards under ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, as verl's engines shard) or ``bf16`` (bf16 shards). Each rank: its share of
a step on the sharded tiny model, unverified, then verified (the same bits must come out), then
verified under a faulty tree-attention kernel (a VerificationError on every rank, no gradient
left): off by 1e-3 in its query's gradient (fp32), its output x1.05 when its inputs are bf16
(the low shapes). Rank 0 saves every rank's report.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import harts
from harts.ops.backends import register_backend
from harts.runtime.distributed import close_process_group
from harts.tiny import tiny_model
from tests.distributed_worker import LOSS, batch, wrap
from tests.test_verify import FAULT, _attention_off

register_backend("test-attention-off-in-backward", _attention_off(1.0, 1 + FAULT, False))
RUN = harts.RunConfig(budget_tokens=48)


def _local_grads(model) -> dict:
    out = {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


#: the faulty backends each shape is checked against (tests/test_verify.py registers the low ones):
#: in the low shapes one in every precision (caught by the algorithm at fp32) and one in bf16 alone
FAULTY = {
    "fp32": ["test-attention-off-in-backward"],
    "mixed": ["test-out-1.01", "test-bf16-out-1.05"],
    "bf16": ["test-out-1.01", "test-bf16-out-1.05"],
}


def _sharded(family: str, shape: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny_model(family)
    if shape == "bf16":
        model = model.to(torch.bfloat16)
    if shape != "mixed":
        return wrap(model, "fsdp")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def report(family: str, shape: str) -> dict:
    torch.manual_seed(0)
    model = _sharded(family, shape)
    rollouts = batch(model.config.vocab_size)[dist.get_rank() :: dist.get_world_size()]

    def step(**run):
        return harts.rollout_step(model, rollouts, LOSS, run=harts.RunConfig(**{**RUN.__dict__, **run}))

    began = time.perf_counter()
    plain = step()
    plain_seconds = time.perf_counter() - began
    want = _local_grads(model)
    began = time.perf_counter()
    checked = step(verify=True)
    checked_seconds = time.perf_counter() - began
    got = _local_grads(model)
    same = torch.equal(plain.loss, checked.loss) and want.keys() == got.keys()
    same = same and all(torch.equal(want[n], got[n]) for n in want)
    figures = {k: float(v) for k, v in checked.metrics.items() if k.startswith("verify_")}
    caught, untouched = {}, True
    for backend in FAULTY[shape]:
        try:
            step(verify=True, backend=backend)
            caught[backend] = None
        except harts.VerificationError as exc:
            caught[backend] = str(exc)
        untouched = untouched and all(p.grad is None for p in model.parameters())
    try:  # what the sharded check does not run is refused, before the step computes
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step(verify=True)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    untouched = untouched and all(p.grad is None for p in model.parameters())
    seconds = {"plain_seconds": plain_seconds, "checked_seconds": checked_seconds}
    return {"same_bits": same, "refused": refused, "figures": figures, "caught": caught,
            "untouched": untouched, **seconds}  # fmt: skip


def main() -> None:
    family, out, *shape = sys.argv[1:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, report(family, shape[0] if shape else "fp32"))
        if dist.get_rank() == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        close_process_group(wait=False)


if __name__ == "__main__":
    main()
