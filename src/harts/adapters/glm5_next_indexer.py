"""GLM-5 Next's indexed attention along tree paths: NoPE MLA whose keys a lightning indexer picks
per query, over pooled groups of the query's own path (DeepSeek Sparse Attention with k-pools; the selection
is :mod:`harts.adapters.pooled_selection`'s).

What the stock layer computes for one trajectory (``Glm5NextTextIndexer``, ``Glm5NextTextAttention``),
with P = ``index_kpool``:

- per token, an indexer key ``k_norm(wk(x))``, a gate score ``x @ compress_gate^T`` and per-head
  weights ``weights_proj(x) / sqrt(H)``; per query, indexer queries ``wq_b(q_resid)``;
- the sequence is cut into pools of P tokens by position (0..P-1, P..2P-1, ...); a complete pool's
  key is the per-channel softmax (gate scores + ``compress_ape``) average of its tokens' keys;
- a query scores the complete pools that end at or before it, ``sum_h w_h relu(q_h . pool / sqrt(d))``,
  keeps the ``index_topk // P`` best, and attends to their tokens and, with
  ``index_kpool_always_select_tail``, to the tokens of its own incomplete pool;
- a layer whose ``indexer_types`` entry is ``shared`` reuses the previous layer's selection.

The indexer runs without gradient in the stock layer (its choice is discrete), so its keys cross
a micro-batch cut as rows without gradient (``TreeOps.path_rows``), and the pools of the context
are rebuilt from them.

The selection and the attention run block by block (a few whole trees of the micro-batch, against
the context and their own tokens: :meth:`~harts.plan.layout.TreeLayout.query_blocks`), as masked
calls over the block's keys: memory O(block tokens x keys they can see) per indexed layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harts.adapters.base import TreeOps
from harts.adapters.pooled_selection import Selection, pool_ends, select_pools

__all__ = ["indexed_mla_attention", "kpool_selection"]

# the key under which an indexed layer leaves its selection to the next layer (``ctx.carry``)
_SELECTION = "glm5_next.selection"


def kpool_selection(indexer, x: torch.Tensor, q_resid: torch.Tensor, ctx: TreeOps) -> Selection:
    """The keys each query attends to (within its path), block by block: ``select(block)`` -> [nb, mb]
    bool over a :class:`~harts.plan.layout.QueryBlock`'s queries and keys.

    ``x`` [1, n, D]: the layer's normed input; ``q_resid`` [1, n, R]: the query's LoRA residual
    ``q_a_layernorm(q_a_proj(x))``, as the stock indexer reads them.
    """
    with torch.no_grad():
        n, heads, width, pool = x.shape[1], indexer.n_heads, indexer.head_dim, indexer.index_kpool
        hidden = x[0]
        query = indexer.wq_b(q_resid[0]).view(n, heads, width).float()
        key = indexer.k_norm(indexer.wk(hidden))  # [n, d]
        gate = F.linear(hidden, indexer.index_kpool_compress_gate)  # [n, d]
        weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * heads**-0.5
        key_rows, gate_rows = ctx.path_rows(torch.cat([key, gate], dim=-1)).split([width, width], dim=-1)
        ape = indexer.index_kpool_compress_ape.float()

    @torch.no_grad()
    def select(block) -> torch.Tensor:
        ends, members = pool_ends(block, pool)  # [E], [E, P]
        keys, gates = key_rows[block.keys][members], gate_rows[block.keys][members]
        probabilities = (gates.float() + ape).softmax(dim=1).to(keys.dtype)
        pooled = (probabilities * keys).sum(dim=1)  # [E, d]
        scores = torch.einsum("nhd,ed->nhe", query[block.start : block.stop], pooled.float())
        index = torch.einsum(
            "nh,nhe->ne", weights[block.start : block.stop], F.relu(scores * indexer.softmax_scale)
        )
        keep = indexer.index_topk // pool
        return select_pools(index, ends, block, pool, keep, indexer.index_kpool_always_select_tail)

    return Selection(select)


def indexed_mla_attention(attn, x: torch.Tensor, ctx: TreeOps) -> torch.Tensor:
    """GLM-5 Next's MLA layer (NoPE, q-LoRA) over the keys its indexer selects along each path, or
    over the previous layer's selection in a ``shared`` layer. x: [1, n, D] -> [1, n, D]."""
    n = x.shape[1]
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    query = attn.q_b_proj(q_resid).view(1, n, -1, attn.qk_head_dim).transpose(1, 2)
    compressed = attn.kv_a_proj_with_mqa(x)
    kv_nope, k_rot = torch.split(compressed, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    kv_nope = attn.kv_a_layernorm(kv_nope).view(1, 1, n, attn.kv_lora_rank)
    key, value = attn.expand_kv(kv_nope, k_rot.view(1, 1, n, attn.qk_rope_head_dim))
    if attn.indexer is not None:
        selection = kpool_selection(attn.indexer, x, q_resid, ctx)
    else:
        selection = ctx.carry.get(_SELECTION)
        if selection is None:  # refused by the adapter's config check; kept as a guard
            raise ValueError(
                f"glm5_next layer {attn.layer_idx}: a shared indexer layer without a previous "
                f"indexed layer's selection"
            )
    ctx.carry[_SELECTION] = selection if attn.next_skip_topk else None
    out = ctx.attend(query, key, value, attn.scaling, select=selection)  # [1, n, H, dv]
    return attn.o_proj(out.reshape(1, n, -1))
