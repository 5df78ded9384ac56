"""What the chunked ops share over packed chunks (:mod:`harts.plan.packed_chunks`): chunks that
hold the tokens of several nodes, each token entering from its own entry state.

The masked WY form: with anc the in-chunk ancestor mask, G_t the path sum of log-gates from t's
entry (inclusive), D[t, i] = exp(G_t - G_i) for i an ancestor-or-self of t (per key channel, or
one per head), the chunk is exact as

    o_t = (q_t e^{G_t})^T S0_e(t) + sum_{i in anc(t) + t} D[t, i] (q_t . k_i) u_i
    S_p = diag(e^{G_p}) S0_e(p) + sum_{i in anc(p) + p} (k_i D[p, i])^T u_i      (any token's state)

with u = v for gated linear attention, and for the delta rule u = W - Kc S0_e, where W and Kc solve
(I + beta A) [W, Kc] = [beta v, beta e^G k], A[t, i] = D[t, i] (k_t . k_i) on strict ancestors.
The solve couples only a token and its in-chunk ancestors, which share its entry, so one solve
per chunk serves every entry. Each emitted state is then S_p = T_p S0_e(p) + D_p, chained by
:class:`~harts.ops.chunked.scan.TreeStateScan` over the emit DAG's levels; the reads of the entry
states run once per group (tokens of a chunk sharing an entry).

Decays (:class:`Decays`) never overflow: with one gate per head they are formed pairwise, exp of
a masked difference of path sums (fp64, so that a large early decay costs no precision in a later
difference); with a gate per key channel they factor about each chunk's midpoint path sum when
the chunk's sums stay within a spread of :data:`FACTOR_SPAN` (the usual case: matmuls), and are
formed pairwise otherwise ([C, C, K] per chunk and head, C times the inputs' memory).
"""

from __future__ import annotations

import torch

from harts.ops.chunked.gate import head_gate
from harts.ops.chunked.scan import TreeStateScan
from harts.ops.chunked.scores import FACTOR_SPAN
from harts.plan.packed_chunks import PackedChunkPlan

__all__ = ["FACTOR_SPAN", "Decays", "PackedChunks"]


class PackedChunks:
    """The N unique tokens of ``plan`` as [H, M, C, .] chunks and the packed form's pieces."""

    def __init__(self, plan: PackedChunkPlan):
        self.plan = plan
        anc = plan.ancestors
        eye = torch.eye(plan.chunk_size, dtype=torch.bool, device=anc.device)
        self.strict = anc  # [M, C, C]
        self.inclusive = anc | eye

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H, ...] per unique token -> [H, M, C, ...] per chunk slot, fp32 (padded slots zero)."""
        p = self.plan
        pad = p.num_chunks * p.chunk_size - x.shape[0]
        x = torch.cat([x.float(), x.new_zeros(pad, *x.shape[1:], dtype=torch.float32)], 0)
        x = x.reshape(p.num_chunks, p.chunk_size, *x.shape[1:])
        return x.movedim(2, 0)

    def outputs(self, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[H, M, C, V] -> [N, H, V] in ``dtype``."""
        return o.movedim(0, 2).reshape(-1, o.shape[0], o.shape[-1])[: self.plan.num_tokens].to(dtype)

    def decays(self, g: torch.Tensor, k: torch.Tensor) -> Decays:
        """The in-chunk decays of ``g`` [N, H] / [N, H, 1] / [N, H, K] (``k`` [N, H, K] tells a gate
        per head from one per key channel)."""
        per_head = head_gate(g, k)
        gate = self.cut(per_head if per_head is not None else g).double()
        inc = self.inclusive.double()
        if per_head is not None:
            G = (inc @ gate[..., None])[..., 0]  # [H, M, C] path sums from the entry
            diff = G[..., :, None] - G[..., None, :]
            D = torch.exp(diff.masked_fill(~self.inclusive, -torch.inf)).float()
            return Decays(self, torch.exp(G).float()[..., None], pairs=D)
        G = inc @ gate  # [H, M, C, K]
        span = G.amax(-2) - G.amin(-2)  # [H, M, K]: every G of a chunk lies within span of its midpoint
        if float(span.detach().max()) <= FACTOR_SPAN:
            mid = (G.amax(-2, keepdim=True) + G.amin(-2, keepdim=True)) / 2
            return Decays(
                self, torch.exp(G).float(), rows=torch.exp(G - mid).float(), cols=torch.exp(mid - G).float()
            )
        # G_t - G_i in fp32 from G = hi + lo: hi_t - hi_i is rounded once, relative to the difference
        # itself, and lo carries what fp32 cannot hold of a long path sum.
        hi = G.float()
        lo = (G - hi.double()).float()
        diff = (hi[..., :, None, :] - hi[..., None, :, :]) + (lo[..., :, None, :] - lo[..., None, :, :])
        return Decays(
            self,
            torch.exp(G).float(),
            pairs=torch.exp(diff.masked_fill(~self.inclusive[..., None], -torch.inf)),
        )

    def scan(self, trans: torch.Tensor, drive: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
        """The states buffer [R + P, H, K, V]: the roots' initial states, then every emitted state,
        from the emits' maps trans [H, P, K, K] (or diagonal [H, P, K]) and drive [H, P, K, V]."""
        p = self.plan
        _, ends = TreeStateScan.apply(
            trans.transpose(0, 1), drive.transpose(0, 1), initial.float(), p.emit_source, p.levels
        )
        return torch.cat([initial.float(), ends], 0)

    def reads(self, states: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        """[H, M, C, V] for each x [H, M, C, K]: x_t^T S0_e(t), each token against its entry state,
        one product per group (a chunk's tokens that share an entry)."""
        p = self.plan
        s0 = states[p.group_source].transpose(0, 1)  # [H, G, K, V]
        x = torch.cat(xs, -2)[:, p.group_chunk]  # [H, G, n C, K]
        if p.num_groups != p.num_chunks:  # some chunk has several entries: each group its own rows
            mine = p.slot_group[p.group_chunk] == torch.arange(p.num_groups, device=x.device)[:, None]
            x = x * mine.repeat(1, len(xs))[..., None].to(x.dtype)
            y = x @ s0
            out = y.new_zeros(y.shape[0], p.num_chunks, *y.shape[2:]).index_add(1, p.group_chunk, y)
        else:
            out = x @ s0
        return list(out.split(p.chunk_size, -2))


class Decays:
    """D[t, i] = exp(G_t - G_i) on ancestor-or-self pairs of each chunk, in one of three forms:

    - ``pairs`` [H, M, C, C]: one gate per head (a scalar per pair, formed directly);
    - ``rows``, ``cols`` [H, M, C, K]: a gate per key channel whose path sums stay within
      :data:`FACTOR_SPAN` in every chunk: e^{G_t - mid} and e^{mid - G_i}, so scores are matmuls;
    - ``pairs`` [H, M, C, C, K]: a gate per key channel with a wider spread (strong decays): formed
      pairwise as D[t, i] k_i once, read by every score and emitted state (C times the inputs).

    ``gamma`` = e^{G} [H, M, C, 1 or K]: the decay from each token's entry.
    """

    def __init__(self, chunks: PackedChunks, gamma, pairs=None, rows=None, cols=None):
        self.chunks, self.gamma, self.pairs, self.rows, self.cols = chunks, gamma, pairs, rows, cols

    def scores(self, a: torch.Tensor, k: torch.Tensor, strict: bool = False) -> torch.Tensor:
        """[H, M, C, C]: sum_c a_t[c] k_i[c] D[t, i(, c)] over ancestor-or-self pairs (strict
        ancestors only if ``strict``), zero elsewhere."""
        mask = self.chunks.strict if strict else self.chunks.inclusive
        if self.rows is not None:
            return ((a * self.rows) @ (k * self.cols).transpose(-1, -2)) * mask
        if self.pairs.dim() == a.dim():
            return (a @ k.transpose(-1, -2)) * self.pairs * mask
        return (self.pairs * k[..., None, :, :] @ a[..., None])[..., 0] * mask

    def emit_pieces(self, k: torch.Tensor):
        """For each emitted token p: (k_i D[p, i] over its chunk [H, P, C, K], e^{G_p} [H, P, K],
        its chunk [P])."""
        p = self.chunks.plan
        chunk = torch.div(p.emit_token, p.chunk_size, rounding_mode="floor")
        slot = p.emit_token - chunk * p.chunk_size
        if self.rows is not None:
            row = self.cols[:, chunk] * self.rows[:, chunk, slot, None]
            row = row * self.chunks.inclusive[chunk, slot, :, None]
        elif self.pairs.dim() == k.dim():
            row = self.pairs[:, chunk, slot][..., None]
        else:
            row = self.pairs[:, chunk, slot]
        kd = k[:, chunk] * row
        return kd, self.gamma[:, chunk, slot].expand(*kd.shape[:2], kd.shape[-1]), chunk
