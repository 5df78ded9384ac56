"""Packed chunks (chunks that hold the tokens of several nodes) against the fp64 per-token reference
on every trajectory alone: outputs, every node's final state, and the gradients of every input and
of the roots' initial states under a random linear functional of outputs and states, for every
recurrence (a gate per key channel, and one per head where it takes one). Tolerances as
tests/test_ops_recurrence.py (fp32 against fp64): max abs 1e-5 on values, relative 1e-5 on
gradients.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import harts
from harts.ops.chunked.packed import PackedChunks
from harts.plan.linear import plan_linear
from harts.plan.packed_chunks import PackedChunkPlan, packed_chunk_plan
from tests.helpers import PLAN_SHAPES
from tests.recurrence_checks import RECURRENCES, check_against_reference, gates

ATOL = 1e-5
GRAD_RTOL = 1e-5


def twigs(seed: int = 3, trajectories: int = 48) -> list[list[int]]:
    """A bushy forest of 1-3 token nodes: branching inside every chunk, many node edges in each."""
    rng = random.Random(seed)
    out = []
    for i in range(trajectories):
        base = out[rng.randrange(len(out))] if out else [1]
        cut = rng.randrange(1, len(base) + 1)
        out.append(base[:cut] + [rng.randrange(2, 50) for _ in range(rng.randrange(1, 4))] + [50 + i])
    return out


FORESTS = {
    "twigs": twigs(),
    "roots-3": PLAN_SHAPES["roots-3"],
    "caterpillar-D8": PLAN_SHAPES["caterpillar-D8"],
    "star-P9-G5": PLAN_SHAPES["star-P9-G5"],
    "chunk-boundaries-T200": PLAN_SHAPES["chunk-boundaries-T200"],  # node edges on chunk edges
}
KINDS = {f"{r.name}-per-{gate}": (r, gate) for r in RECURRENCES for gate in gates(r)}


@pytest.mark.parametrize("chunk", [4, 16, 64])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(FORESTS))
def test_packed_equals_each_trajectory_alone(name, kind, chunk):
    torch.manual_seed(0)
    forest = harts.build_forest(FORESTS[name])
    check_against_reference(forest, packed_chunk_plan(forest, chunk), *KINDS[kind])


@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_strong_decay_does_not_overflow(kind):
    """Path sums far below -88 inside a chunk: every decay is formed pairwise, never as e^G e^-G."""
    torch.manual_seed(1)
    forest = harts.build_forest(FORESTS["twigs"])
    check_against_reference(forest, packed_chunk_plan(forest, 64), *KINDS[kind], strength=40.0)


def test_per_key_decays_factor_only_within_their_span():
    """The forms the tests above run through: factored for moderate gates, pairwise past the span."""
    forest = harts.build_forest(FORESTS["twigs"])
    x = PackedChunks(packed_chunk_plan(forest, 16))
    k = torch.randn(forest.num_tokens, 2, 8)
    assert x.decays(-torch.rand(forest.num_tokens, 2, 8), k).rows is not None
    strong = x.decays(-torch.rand(forest.num_tokens, 2, 8) * 40, k)
    assert strong.rows is None and strong.pairs.shape[-1] == 8
    assert x.decays(-torch.rand(forest.num_tokens, 2) * 40, k).pairs.dim() == 4  # one per head: pairwise


def test_packed_plan_shape():
    """Only the last chunk is padded; every token enters from an earlier emit or a root; the emit
    levels respect their sources; a chunk's groups partition its slots."""
    forest = harts.build_forest(FORESTS["twigs"])
    plan = plan_linear(forest, "packed")
    assert isinstance(plan, PackedChunkPlan) and plan.mode.value == "packed" and plan.num_calls == 1
    n, c, r = forest.num_tokens, plan.chunk_size, len(plan.root_nodes)
    assert plan.padded_tokens == plan.num_chunks * c - n < c
    level_of = np.empty(plan.num_emits, dtype=np.int64)
    for d, lv in enumerate(plan.levels):
        level_of[lv.numpy()] = d
    src = plan.emit_source.numpy()
    inner = src >= r
    assert (level_of[src[inner] - r] < level_of[inner]).all()
    assert (plan.emit_token[torch.as_tensor(src[inner] - r)] < plan.emit_token[inner]).all()
    chunk_of_slot = torch.arange(plan.num_chunks)[:, None].expand(-1, c)
    assert torch.equal(plan.group_chunk[plan.slot_group], chunk_of_slot)
    assert not plan.ancestors.triu().any()
    for small in (packed_chunk_plan(forest, 4), packed_chunk_plan(forest, 64)):
        assert small.num_chunks == -(-n // small.chunk_size)
    with pytest.raises(ValueError, match="power of two"):
        packed_chunk_plan(forest, 12)
