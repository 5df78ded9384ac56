"""Recorded MoE routes as part of a token's identity in the forest (routing replay).

An inference engine can record, for every token it processed, which experts each MoE layer routed
it to (SGLang's ``routed_experts``, vLLM's). Replaying those choices in the trainer removes the
engine-trainer routing mismatch from an RL update. A token's computation then depends on its
recorded routes as well as on its id and its prefix, so two trajectories may share a forest token
only where their ids *and* their recorded routes agree up to it: equal prefix ids that were routed
differently part into two branches.

Routes are ``[L, layers, k]`` per trajectory (``L`` tokens, one row per decoder layer, the router's
top-k), integers, ``-1`` where a layer has no routed experts or the token was not recorded (the
router then chooses). The merge keys every token by its id and the number of its route row among
the batch's distinct rows, ``id + base * number`` with ``base`` above every id, so the prefix merge
of :func:`harts.forest.build_forest` sees both; ids and routes are read back from the unique keys.
Distinct rows are found exactly: grouped by a hash, then every row compared in full with its
group's (a collision falls back to a sort of the rows' bytes), so no two routes are ever merged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["as_route_array", "RouteKeys", "routes_of"]


def as_route_array(routes, index: int, length: int) -> np.ndarray:
    """One trajectory's routes as int32 ``[length, layers, k]``, with errors that name the trajectory
    and position: a wrong shape, a non-integer, or an id below -1."""
    if isinstance(routes, torch.Tensor):
        if routes.dtype.is_floating_point or routes.dtype == torch.bool:
            raise TypeError(f"trajectory {index}: routed_experts must be integers, got dtype {routes.dtype}")
        routes = routes.detach().cpu().numpy()
    array = np.asarray(routes)
    if array.dtype.kind not in "iu":
        raise TypeError(f"trajectory {index}: routed_experts must be integers, got dtype {array.dtype}")
    if array.ndim != 3 or array.shape[0] != length:
        raise ValueError(
            f"trajectory {index}: routed_experts must be [tokens={length}, decoder layers, top-k], "
            f"got shape {tuple(array.shape)}"
        )
    if array.size and int(array.min()) < -1:
        position = int(np.argwhere(array < -1)[0, 0])
        raise ValueError(
            f"trajectory {index}, position {position}: routed expert id {int(array.min())} (ids are >= 0, "
            f"-1 where not recorded)"
        )
    if array.size and int(array.max()) >= 2**31:
        raise ValueError(f"trajectory {index}: routed expert id {int(array.max())} is out of range")
    return array.astype(np.int32, copy=False)


@dataclass(frozen=True)
class RouteKeys:
    """The trie keys of a batch's trajectories with their routes, and how to read both back."""

    keys: list[np.ndarray]
    base: int
    rows: np.ndarray  # [R, layers, k] int32: the distinct route rows

    @classmethod
    def of(cls, arrays: list[np.ndarray], routes: Sequence) -> RouteKeys:
        """``arrays``: the trajectories' ids; ``routes``: one entry per trajectory, its routes or None
        (not recorded: -1 everywhere, the shape of the others')."""
        if len(routes) != len(arrays):
            raise ValueError(f"routed_experts has {len(routes)} entries for {len(arrays)} trajectories")
        given = {
            i: as_route_array(r, i, a.size)
            for i, (a, r) in enumerate(zip(arrays, routes, strict=True))
            if r is not None
        }
        if not given:
            raise ValueError("routed_experts holds no routes: pass None to build a forest without them")
        shapes = {r.shape[1:] for r in given.values()}
        if len(shapes) > 1:
            first = next(iter(given))
            other = next(i for i, r in given.items() if r.shape[1:] != given[first].shape[1:])
            theirs, ours = given[other].shape[1:], given[first].shape[1:]
            raise ValueError(
                f"trajectory {other}: routed_experts is [tokens, {theirs[0]}, {theirs[1]}] but trajectory "
                f"{first}'s is [tokens, {ours[0]}, {ours[1]}]"
            )
        (shape,) = shapes
        full = [
            given[i] if i in given else np.full((a.size, *shape), -1, dtype=np.int32)
            for i, a in enumerate(arrays)
        ]
        flat = np.ascontiguousarray(np.concatenate(full).reshape(-1, int(np.prod(shape))))
        first_of, number = _distinct_rows(flat)
        base = max(int(a.max()) for a in arrays) + 1
        starts = np.cumsum([a.size for a in arrays]) - np.asarray([a.size for a in arrays])
        keys = [
            a + base * number[s : s + a.size].astype(np.int64) for a, s in zip(arrays, starts, strict=True)
        ]
        return cls(keys=keys, base=base, rows=flat[first_of].reshape(-1, *shape))

    def split(self, keys: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """The ids ``[N]`` and routes ``[N, layers, k]`` (int32) of the forest's unique keys."""
        return keys % self.base, torch.from_numpy(self.rows[keys // self.base])


_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection of 64-bit words


def _distinct_rows(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the first row of each distinct row, each row's distinct number) of ``flat`` [T, W] int32.

    Rows are grouped by a 64-bit hash (one pass per pair of columns, a sort of T integers), then every
    row is compared with its group's first in full: equal everywhere, the grouping is exact; a
    collision (two different rows with one hash) falls back to sorting the rows' bytes, which is
    exact and slower (a sort of T rows of W values)."""
    if flat.shape[1] % 2:  # pairs of int32 read as one 64-bit word
        flat = np.concatenate([flat, np.zeros((flat.shape[0], 1), dtype=flat.dtype)], axis=1)
    words = np.ascontiguousarray(flat).view(np.uint64)
    hashed = np.zeros(words.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in words.T:  # FNV-style: xor a word in, multiply by an odd constant (mod 2^64)
            hashed = (hashed ^ column) * _MIX
    _, first_of, number = np.unique(hashed, return_index=True, return_inverse=True)
    if np.array_equal(flat[first_of][number], flat):
        return first_of, number
    as_bytes = flat.view(np.dtype((np.void, flat.shape[1] * flat.itemsize))).ravel()
    _, first_of, number = np.unique(as_bytes, return_index=True, return_inverse=True)
    return first_of, number


def routes_of(rollouts) -> list | None:
    """Each rollout's ``routed_experts`` (None where it has none), or None when no rollout has them:
    what :func:`harts.forest.build_forest` takes for them."""
    routes = [getattr(r, "routed_experts", None) for r in rollouts]
    return routes if any(r is not None for r in routes) else None
