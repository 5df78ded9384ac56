"""The ``fla`` backend's tree attention (FlexAttention block mask) against the dense-mask reference.

On a CPU, FlexAttention runs forward only (torch refuses its backward there), so these check the
forward, eager (which applies the mask function) and compiled once (which reads the block mask's
tables), with GQA, a value width unlike the key width and context keys from an earlier part; the
gradient check waits for a GPU (tests/test_gpu_backend.py). A CPU call that wants a gradient is
refused before any compute.
"""

from __future__ import annotations

import pytest
import torch

import harts
from harts.ops.fla_backend import flex_tree_attention, tree_block_mask
from harts.ops.tree_attention import masked_tree_attention
from harts.plan.attention import plan_reference_mask, plan_tree_attention
from tests_kernels.device import DEVICE

OUT_ATOL = 1e-5  # fp32 FlexAttention vs the fp64 dense-mask SDPA (measured about 2e-7)
SCALE = 0.3


def _seq(start, n):
    return list(range(start, start + n))


FORESTS = {
    "one-token-nodes-D4": [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 7, 8], [1, 7, 9, 10], [11]],
    "star-P150-G3": [_seq(1, 150) + _seq(1000 * g, 20 + 70 * g) for g in range(1, 4)],
}


def _plan_args(forest, cut):
    """Nodes from ``cut`` on are queried; keys are all tokens (rows before ``cut`` are context)."""
    starts, lengths = forest.node_start.tolist(), forest.node_length.tolist()
    keys = []
    for p in forest.node_parent.tolist():
        own = torch.arange(starts[p], starts[p] + lengths[p]) if p >= 0 else None
        keys.append(torch.empty(0, dtype=torch.long) if p < 0 else torch.cat([keys[p], own]))
    ext = starts[cut]
    return dict(node_query_start=forest.node_start[cut:] - ext, node_length=forest.node_length[cut:],
                node_key_start=forest.node_start[cut:], node_ancestor_keys=keys[cut:],
                num_queries=forest.num_tokens - ext, num_keys=forest.num_tokens)


def _case(name, cut, heads=(4, 2), dk=16, dv=8, budget=None):
    forest = harts.build_forest(FORESTS[name])
    args = _plan_args(forest, cut)
    gen = torch.Generator().manual_seed(0)
    h, hkv = heads
    n, m = args["num_queries"], args["num_keys"]
    q, k, v = (torch.randn(*s, generator=gen) for s in ((h, n, dk), (hkv, m, dk), (hkv, m, dv)))
    plan = plan_tree_attention(**args, max_group_tokens=budget)
    ref = masked_tree_attention(q.double(), k.double(), v.double(), plan_reference_mask(**args), SCALE)
    return plan, (q, k, v), ref


CASES = {"one-token-nodes-D4": ("one-token-nodes-D4", 0, None),
         "one-token-nodes-D4-context": ("one-token-nodes-D4", 2, None),
         "star-P150-G3-context-blocks": ("star-P150-G3", 1, 4096)}


@pytest.mark.parametrize("name,cut,budget", list(CASES.values()), ids=list(CASES))
def test_eager_forward_matches_dense_mask(name, cut, budget):
    plan, (q, k, v), ref = _case(name, cut, budget=budget)
    with torch.no_grad():
        out = flex_tree_attention(*(x.to(DEVICE) for x in (q, k, v)), plan, SCALE).cpu()
    assert out.shape == ref.shape
    assert (out.double() - ref).abs().max() <= OUT_ATOL


def test_compiled_forward_reads_block_tables():
    """The compiled kernel skips blocks the tables mark empty: a wrong table would drop keys."""
    from torch.nn.attention.flex_attention import flex_attention

    plan, (q, k, v), ref = _case("star-P150-G3", 1, heads=(2, 1), dk=16, dv=16, budget=4096)
    q, k, v = (x.to(DEVICE) for x in (q, k, v))
    mask = tree_block_mask(plan, DEVICE)
    assert mask.sparsity() > 0  # some blocks are skipped, so the tables matter
    with torch.no_grad():
        out = torch.compile(flex_attention)(q[None], k[None], v[None], block_mask=mask, scale=SCALE,
                                            enable_gqa=True)[0].transpose(0, 1).cpu()
    assert (out.double() - ref).abs().max() <= OUT_ATOL


def test_cpu_gradient_is_refused():
    plan, (q, k, v), _ = _case("one-token-nodes-D4", 0)
    with pytest.raises(ValueError, match="CUDA only"):
        flex_tree_attention(q.requires_grad_(), k, v, plan, SCALE)
