"""Sparse attention over pooled groups of each query's path: the selection GLM-5 Next's k-pool
indexer and Qwen4-Exp's QSA indexer share.

Both cut a trajectory into pools of P consecutive tokens by position (0..P-1, P..2P-1, ...), score
the complete pools that end at or before a query, let the query attend to the tokens of its best
pools and to those of its own incomplete pool. Along a tree, a pool is the P path tokens ending at
a token whose path position is P - 1 modulo P (a *pool end*): it is formed once, at that token, and
a query's candidates are the pool ends on its own path, never a sibling branch's.

Ties (scores that are exactly equal, as relu sums of zero are): Qwen4-Exp's stock indexer runs
``topk`` over each query's complete blocks in order, and so does harts, so a tie is broken the same
way. GLM-5 Next's runs it over every pool of the trajectory, those after the query at the dtype's
minimum, so a tie at the k-th place may be broken otherwise (the stock choice then depends on the
trajectory's length, which a token shared by several trajectories does not have).
"""

from __future__ import annotations

import torch

__all__ = ["pool_ends", "select_pools", "Selection"]


def pool_ends(block, pool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ends [E] the block's key indices that complete a pool, members [E, P] each pool's key indices
    in path order), for a :class:`~harts.plan.layout.QueryBlock`."""
    ends = (block.key_positions % pool == pool - 1).nonzero()[:, 0]
    return ends, block.key_predecessors(pool)[ends]


def select_pools(
    index: torch.Tensor, ends: torch.Tensor, block, pool: int, keep: int, tail: bool
) -> torch.Tensor:
    """[nb, mb] bool: the block's keys each of its queries attends to.

    ``index`` [nb, E]: each query's score of each pool end (any value where the pool is not on the
    query's path); ``keep``: the most pools a query keeps; ``tail``: the query also attends to the
    tokens of its own incomplete pool.

    A query's candidates are laid out as the stock indexer lays out a trajectory's complete pools,
    in path order, one row per number of complete pools, so that ``topk`` sees the same vector.
    """
    n = index.shape[0]
    positions, sees, own = block.key_positions, block.path_mask, block.query_positions
    groups = int(positions.max()) // pool + 1 if positions.numel() else 0
    group = positions[ends] // pool  # [E]
    on_path = sees[:, ends]  # a pool is a query's candidate where it ends on its path: one per group
    column = torch.full((n, groups + 1), -1, dtype=torch.long, device=index.device)
    every = torch.arange(ends.numel(), device=index.device).expand(n, -1)
    column.scatter_(1, torch.where(on_path, group[None], groups), every)
    by_group = index.gather(1, column[:, :groups].clamp(min=0)) if ends.numel() else index
    complete = (own + 1) // pool  # the query's complete pools: groups 0 .. complete - 1
    chosen = torch.zeros(n, groups, dtype=torch.bool, device=index.device)
    for count in torch.unique(complete).tolist() if ends.numel() else []:
        k = min(keep, count)
        if k:
            rows = (complete == count).nonzero()[:, 0]
            best = by_group[rows, :count].topk(k, dim=-1).indices
            chosen[rows[:, None], best] = True
    row_group = (positions // pool)[None].expand(n, -1)
    selected = chosen.gather(1, row_group) & sees
    if tail:
        incomplete = ((own + 1) % pool != 0)[:, None] & (row_group == (own // pool)[:, None])
        selected |= incomplete & sees
    return selected


class Selection:
    """``select(block)`` with each block's mask kept: a layer's selection, which a later layer of the
    same micro-batch may reuse (GLM-5 Next's shared indexer layers)."""

    def __init__(self, select):
        self.select, self.masks = select, {}

    def __call__(self, block) -> torch.Tensor:
        if block.start not in self.masks:
            self.masks[block.start] = self.select(block)
        return self.masks[block.start]
