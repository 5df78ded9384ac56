"""The prologue and epilogue of a chunked op over a batch of right-padded segments.

A call hands B segments [B, T, H, .], right-padded to the longest, with per-segment fp32 initial
states [B, H, K, V] and true lengths [B]. :class:`SegmentChunks` makes every padded step an
identity (all inputs zero there: g = 0 keeps the state, k = v = beta = 0 add nothing), cuts the
tokens into N chunks of C (the last one zero-padded, identity steps again), runs the chunk-to-chunk
scan, puts the outputs back as [B, T, H, V] (zero past each length) and replays the states after
given token counts from the chunk-start states.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from harts.ops.chunked.inputs import ChunkedInputs, chunked_inputs
from harts.ops.chunked.scan import StateScan
from harts.ops.chunked.scores import exclusive_suffix_sum

__all__ = ["SegmentChunks"]


class SegmentChunks:
    """B segments of at most T tokens and H heads (from ``k`` [B, T, H, K]) in N chunks of C."""

    def __init__(self, k: torch.Tensor, lengths: torch.Tensor | None, chunk_size: int):
        C = chunk_size
        if C < 1 or C & (C - 1):
            raise ValueError(f"chunk_size must be a power of two, got {C}")
        self.batch, self.tokens, self.heads, _ = k.shape
        self.chunk = C
        self.num_chunks = max(1, math.ceil(self.tokens / C))
        self.lengths = lengths
        self.valid = None  # [B, T]: real (not padded) steps; None when every segment is T long
        if lengths is not None:
            self.valid = torch.arange(self.tokens, device=k.device)[None, :] < lengths.to(k.device)[:, None]

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [B, H, N, C, D], zero at padded steps and at the end (identity steps)."""
        if self.valid is not None:
            x = torch.where(self.valid.view(*self.valid.shape, *(1,) * (x.dim() - 2)), x, 0.0)
        pad = self.num_chunks * self.chunk - self.tokens
        return F.pad(x.transpose(1, 2), (0, 0, 0, pad)).reshape(
            self.batch, self.heads, self.num_chunks, self.chunk, x.shape[-1]
        )

    def inputs(self, q, k, v, g, scalars: tuple[torch.Tensor, ...], scale: float) -> ChunkedInputs:
        """q, k, g [B, T, H, K] (g may be per head), v [B, T, H, V], scalars [B, T, H] in chunks."""
        return chunked_inputs(self.cut, q, k, v, g, scalars, scale)

    def initial(self, initial_state: torch.Tensor | None, x: ChunkedInputs) -> torch.Tensor:
        """[B, H, K, V] fp32: the given initial states, zeros if None."""
        if initial_state is not None:
            return initial_state.float()
        return x.k.new_zeros(self.batch, self.heads, x.k.shape[-1], x.v.shape[-1])

    def scan(self, trans, drive, initial):
        """(chunk-start states [B, H, N, K, V], final states [B, H, K, V]) by :class:`StateScan`."""
        return StateScan.apply(trans, drive, initial)

    def outputs(self, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, H, N, C, V] per chunk slot -> [B, T, H, V] in ``dtype``, zero at padded steps."""
        o = o.reshape(self.batch, self.heads, -1, o.shape[-1])[:, :, : self.tokens].transpose(1, 2)
        if self.valid is not None:
            o = torch.where(self.valid[:, :, None, None], o, 0.0)
        return o.to(dtype)

    def states_at(self, at, initial, final, starts, u, x: ChunkedInputs) -> torch.Tensor:
        """[B, S, H, K, V]: the state after ``at`` [B, S] tokens of each segment.

        ``starts`` are the chunk-start states and ``u`` [B, H, N, C, V] what each step writes (the
        delta rule's u, or v): S_p = diag(e^{sum g}) S0 + sum_j k_j e^{..} u_j^T. 0 tokens is the
        initial state and a segment's length or more its final state (padded steps are
        identities); only the offsets strictly inside a segment replay part of a chunk, gathered
        as one flat list, so unused columns of ``at`` (a call's segments emit different numbers of
        states) cost nothing.
        """
        at = at.to(starts.device)
        if self.lengths is None:
            length = torch.full_like(at[:, :1], self.tokens)
        else:
            length = self.lengths.to(at.device)[:, None]
        shape = (*at.shape, *final.shape[1:])
        states = torch.where(
            (at <= 0)[..., None, None, None], initial[:, None].expand(shape), final[:, None].expand(shape)
        )
        b, s = ((at > 0) & (at < length)).nonzero(as_tuple=True)
        if not b.numel():
            return states
        # Autograd keeps each request's gathered chunk of k and u ([P, H, C, K + V]) for backward:
        # real requests only, about 2 MiB at the peak of a 1000-token bailing_hybrid micro-batch,
        # where recomputing them in backward cost 6% of the step.
        inner = _states_at(b, at[b, s], starts, u, x.k, x.g, self.chunk)
        return states.index_put((b, s), inner)


def _states_at(b, p, S0, U, k, g, C):
    """State of segment ``b[i]`` after ``p[i]`` tokens (0 < p <= its length), for P requests:
    gather chunk n = (p-1)//C and replay m = p - nC steps.

    S_p = diag(exp(sum_{s<m} g_s)) S0_n + sum_{j<m} (k_j exp(sum_{j<s<m} g_s)) u_j^T   (chunk-local s, j).
    """
    n = (p - 1) // C
    m = p - n * C

    def pick(x):  # [B, H, N, ...] -> [P, H, ...]
        return x[b, :, n]

    keep = (torch.arange(C, device=p.device) < m[:, None])[:, None, :, None]  # [P, 1, C, 1]
    g_kept = pick(g) * keep
    decay0 = torch.exp(g_kept.sum(-2))  # [P, H, K]
    kw = pick(k) * torch.exp(exclusive_suffix_sum(g_kept, -2)) * keep
    return decay0[..., None] * pick(S0) + kw.transpose(-1, -2) @ pick(U)
