"""Forest building: property tests against brute force, edge shapes, and input errors.

Every structural claim in ``harts.forest`` (round trip, counts, node maximality, multiplicity,
path positions, node order, predecessors) is checked against a brute-force computation over the
raw token lists: a token *is* its prefix, so a prefix's set of trajectories says everything a node
should be. Small alphabets make prefixes collide, duplicates and prefixes-of-others frequent.

Left out: speed (benchmarks measure it) and the planner/executor that consume the forest.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.data.synthetic import random_forest
from harts.forest import Forest, build_forest
from tests.helpers import forests

PROPS = settings(max_examples=200, deadline=None)


# ---- brute force -------------------------------------------------------------------------------
def owners(trajs: list[list[int]]) -> dict[tuple[int, ...], frozenset[int]]:
    """Every distinct non-empty prefix -> the set of trajectories that contain it."""
    sets: dict[tuple[int, ...], set[int]] = {}
    for i, t in enumerate(trajs):
        for k in range(1, len(t) + 1):
            sets.setdefault(tuple(t[:k]), set()).add(i)
    return {p: frozenset(s) for p, s in sets.items()}


def paths(f: Forest) -> list[list[int]]:
    return [f.trajectory_token_indices(i).tolist() for i in range(f.num_trajectories)]


def check_round_trip(trajs, f: Forest) -> None:
    assert f.num_trajectories == len(trajs)
    for i, t in enumerate(trajs):
        expected = torch.as_tensor(np.asarray(t, dtype=np.int64))
        got = f.trajectory(i)
        assert got.dtype == torch.int64
        assert torch.equal(got, expected), f"trajectory {i}"


def check_structure(trajs: list[list[int]], f: Forest) -> None:
    """Everything the brute force can say about a prefix-sharing forest."""
    sets = owners(trajs)
    m, n = f.num_nodes, f.num_tokens
    node_of = f.token_node.tolist()
    # A unique token is a prefix: the map prefix -> token index is a bijection onto range(N).
    token_of: dict[tuple[int, ...], int] = {}
    for t, idx in zip(trajs, paths(f), strict=True):
        assert len(idx) == len(t)
        for k, ti in enumerate(idx):
            assert token_of.setdefault(tuple(t[: k + 1]), ti) == ti, "one prefix, two tokens"
    assert sorted(token_of.values()) == list(range(n)) and n == len(sets)
    # Maximality: along a path, a node boundary sits exactly where the owner set changes.
    starts = set()
    for t, idx in zip(trajs, paths(f), strict=True):
        for k in range(len(t)):
            here = sets[tuple(t[: k + 1])]
            new_node = k == 0 or sets[tuple(t[:k])] != here
            assert (k == 0 or node_of[idx[k]] != node_of[idx[k - 1]]) == new_node, (t, k)
            if new_node:
                starts.add(tuple(t[: k + 1]))
            # multiplicity of the node and of the token: trajectories through this prefix
            assert int(f.node_multiplicity[node_of[idx[k]]]) == len(here)
            assert int(f.token_multiplicity[idx[k]]) == len(here)
    assert m == len(starts)
    # A branch (two children) is always a boundary: children of a node start new nodes.
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for p in sets:
        children.setdefault(p[:-1], []).append(p)
    for kids in children.values():
        if len(kids) > 1:
            assert all(q in starts for q in kids)


def check_order(f: Forest) -> None:
    """Parents before children, contiguous subtrees, depths, path starts, token layout."""
    m = f.num_nodes
    parent = f.node_parent.tolist()
    depth = f.node_depth.tolist()
    assert f.node_length.min() >= 1
    assert torch.equal(f.node_start, torch.cumsum(f.node_length, 0) - f.node_length)
    assert int(f.node_length.sum()) == f.num_tokens
    descendants: list[set[int]] = [set() for _ in range(m)]
    for c in range(m):
        p = parent[c]
        assert -1 <= p < c
        assert depth[c] == (depth[p] + 1 if p >= 0 else 0)
        expected_start = int(f.node_path_start[p] + f.node_length[p]) if p >= 0 else 0
        assert int(f.node_path_start[c]) == expected_start
        while p >= 0:
            descendants[p].add(c)
            p = parent[p]
    for c in range(m):
        assert descendants[c] == set(range(c + 1, int(f.node_subtree_end[c]))), c
    assert f.max_depth == (max(depth) if m else 0)


def check_paths(trajs, f: Forest) -> None:
    """Positions, end nodes, node_trajectory, previous tokens, predecessor windows."""
    prev = f.token_previous.tolist()
    windows = {w: f.token_predecessors(w).tolist() for w in (1, 2, 3, 5)}
    for i, idx in enumerate(paths(f)):
        assert f.token_position[idx].tolist() == list(range(len(idx)))
        assert int(f.trajectory_end_node[i]) == int(f.token_node[idx[-1]])
        assert int(f.trajectory_length[i]) == len(trajs[i])
        nodes = f.trajectory_nodes(i).tolist()
        assert nodes == sorted(set(f.token_node[idx].tolist()))
        for k, ti in enumerate(idx):
            assert prev[ti] == (idx[k - 1] if k else -1)
            for w, rows in windows.items():
                assert rows[ti] == [idx[j] if j >= 0 else -1 for j in range(k - w + 1, k + 1)]
    for node in range(f.num_nodes):
        assert node in f.trajectory_nodes(int(f.node_trajectory[node])).tolist()


def check_all(trajs, f: Forest) -> None:
    check_round_trip(trajs, f)
    if f.shares_prefixes:
        check_structure(trajs, f)
    check_order(f)
    check_paths(trajs, f)


# ---- properties --------------------------------------------------------------------------------
@PROPS
@given(forests())
def test_round_trip(trajs):
    check_round_trip(trajs, build_forest(trajs))
    check_round_trip(trajs, build_forest(trajs, share_prefixes=False))


@PROPS
@given(forests(), st.sampled_from(["tuple", "int32", "int64", "uint16", "torch32", "torch64"]))
def test_round_trip_input_types(trajs, kind):
    convert = {
        "tuple": tuple,
        "int32": lambda t: np.asarray(t, dtype=np.int32),
        "int64": lambda t: np.asarray(t, dtype=np.int64),
        "uint16": lambda t: np.asarray(t, dtype=np.uint16),
        "torch32": lambda t: torch.tensor(t, dtype=torch.int32),
        "torch64": lambda t: torch.tensor(t, dtype=torch.int64),
    }[kind]
    f = build_forest([convert(t) for t in trajs])
    check_round_trip(trajs, f)
    assert f.num_tokens == len(owners(trajs))


@PROPS
@given(forests())
def test_counts(trajs):
    f = build_forest(trajs)
    flat = sum(map(len, trajs))
    assert f.num_trajectories == len(trajs)
    assert f.num_flat_tokens == flat
    assert f.num_tokens == len(owners(trajs))
    assert f.redundancy == pytest.approx(flat / f.num_tokens)
    g = build_forest(trajs, share_prefixes=False)
    assert g.num_tokens == g.num_flat_tokens == flat and g.redundancy == 1.0


@PROPS
@given(forests())
def test_nodes_are_maximal_and_multiplicities_count_trajectories(trajs):
    check_structure(trajs, build_forest(trajs))


@PROPS
@given(forests())
def test_node_order_subtrees_depths(trajs):
    check_order(build_forest(trajs))
    check_order(build_forest(trajs, share_prefixes=False))


@PROPS
@given(forests())
def test_positions_previous_and_predecessors(trajs):
    check_paths(trajs, build_forest(trajs))
    check_paths(trajs, build_forest(trajs, share_prefixes=False))


@PROPS
@given(forests())
def test_flat_layout_one_root_per_trajectory(trajs):
    f = build_forest(trajs, share_prefixes=False)
    b = len(trajs)
    assert not f.shares_prefixes
    assert f.num_nodes == b
    assert f.node_parent.tolist() == [-1] * b
    assert f.trajectory_end_node.tolist() == list(range(b))  # input order, duplicates apart
    assert f.node_length.tolist() == [len(t) for t in trajs]
    assert f.node_multiplicity.tolist() == [1] * b
    assert f.tokens.tolist() == [x for t in trajs for x in t]


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"random-B40-L30-seed{s}")
def test_random_forest_generator_shapes(seed):
    """Larger shapes than hypothesis draws: more trajectories, deeper trees."""
    trajs = random_forest(num_trajectories=40, max_len=30, vocab_size=3, seed=seed)
    check_all(trajs, build_forest(trajs))


def _long_shapes() -> dict[str, list[list[int]]]:
    """Trajectories longer than the vectorised-LCP cut-off (256), which take the per-pair path."""
    rng = np.random.default_rng(0)
    b = rng.integers(0, 3, 400).tolist()
    x = rng.integers(3, 6, 50).tolist()
    shapes = {
        "long-prefix-L300-of-L400": [b, b[:300]],
        "long-duplicates-L400": [b, b, b[:5]],
        "long-branch-at-290": [b[:290] + x, b, b[:290] + x[:1]],
        "long-equal-up-to-last-token": [b[:-1] + [9], b],
    }
    for seed in range(3):
        shapes[f"long-random-B6-L600-seed{seed}"] = random_forest(6, 600, vocab_size=2, seed=seed)
    return shapes


@pytest.mark.parametrize("trajs", list(_long_shapes().values()), ids=list(_long_shapes()))
def test_long_trajectories(trajs):
    check_all(trajs, build_forest(trajs))


# ---- edge shapes -------------------------------------------------------------------------------
EDGE = {
    # name: (trajectories, expected number of nodes, expected node_multiplicity)
    "single-L5": ([[1, 2, 3, 4, 5]], 1, [1]),
    "single-token": ([[7]], 1, [1]),
    "star-P3-G4": ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6, 6], [1, 2, 3, 7]], 5, [4, 1, 1, 1, 1]),
    "stacked-branches": ([[1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 5, 7], [8]], 8, [4, 2, 1, 1, 2, 1, 1, 1]),
    "one-token-node": ([[1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 6]], 5, [3, 1, 2, 1, 1]),
    "prefix-of-another": ([[1, 2, 3, 4], [1, 2]], 2, [2, 1]),
    "prefix-first": ([[1, 2], [1, 2, 3, 4]], 2, [2, 1]),
    "duplicates": ([[1, 2, 3], [1, 2, 3]], 1, [2]),
    "duplicates-under-branch": ([[1, 2, 3], [1, 2, 4], [1, 2, 4]], 3, [3, 1, 2]),
    "unrelated-roots-3": ([[3, 1], [1, 1, 1], [2]], 3, [1, 1, 1]),
    "nested-prefixes": ([[1], [1, 2], [1, 2, 3]], 3, [3, 2, 1]),
    "single-tokens-shared": ([[5], [5], [5, 5]], 2, [3, 1]),
}


@pytest.mark.parametrize("trajs,num_nodes,mult", list(EDGE.values()), ids=list(EDGE))
def test_edge_shapes(trajs, num_nodes, mult):
    f = build_forest(trajs)
    check_all(trajs, f)
    assert f.num_nodes == num_nodes
    assert f.node_multiplicity.tolist() == mult
    check_all(trajs, build_forest(trajs, share_prefixes=False))


def test_duplicates_share_end_node():
    f = build_forest([[4, 5, 6], [4, 5], [4, 5, 6]])
    end = f.trajectory_end_node.tolist()
    assert end[0] == end[2] != end[1]
    assert int(f.node_multiplicity[end[0]]) == 2 and int(f.node_multiplicity[end[1]]) == 3


def test_prefix_trajectory_ends_at_internal_node():
    f = build_forest([[1, 2, 3, 4], [1, 2]])
    short = int(f.trajectory_end_node[1])
    assert int(f.node_path_start[short] + f.node_length[short]) == 2
    assert int(f.node_subtree_end[short]) > short + 1  # it has a child: the longer trajectory's rest


def test_star_shape_layout():
    f = build_forest([[9, 9, 9, 1], [9, 9, 9, 2, 2], [9, 9, 9, 3]])
    assert f.node_length.tolist() == [3, 1, 2, 1]
    assert f.node_parent.tolist() == [-1, 0, 0, 0]
    assert f.node_subtree_end.tolist() == [4, 2, 3, 4]
    assert f.token_position.tolist() == [0, 1, 2, 3, 3, 4, 3]


def test_two_dimensional_batch_needs_its_mask():
    batch = np.array([[1, 2, 3], [1, 2, 4]], dtype=np.int64)
    with pytest.raises(ValueError, match="pass attention_mask"):
        build_forest(batch)  # the padding of a [B, L] tensor cannot be told from its tokens
    f = build_forest(batch, attention_mask=np.ones_like(batch))
    check_all(batch.tolist(), f)
    assert f.num_tokens == 4
    assert build_forest(list(batch)).num_tokens == 4  # a list of rows is a list of trajectories


def test_trajectory_index_out_of_range():
    f = build_forest([[1, 2]])
    with pytest.raises(IndexError, match="trajectory index 1"):
        f.trajectory(1)


def test_predecessor_window_must_be_positive():
    with pytest.raises(ValueError, match="window"):
        build_forest([[1, 2]]).token_predecessors(0)


# ---- errors ------------------------------------------------------------------------------------
OK = [[0, 1, 2], [0, 1, 3], [5]]
ERRORS = {
    # name: (trajectories, exception, message fragment)
    "no-trajectories": ([], ValueError, "empty forest"),
    "empty-trajectory": (OK + [[]], ValueError, "trajectory 3"),
    "empty-numpy": (OK + [np.zeros(0, dtype=np.int64)], ValueError, "trajectory 3"),
    "negative-list": (OK + [[0, 1, 2, 3, 4, -5]], ValueError, "trajectory 3, position 5"),
    "negative-numpy": (OK + [np.array([0, 1, 2, 3, 4, -5])], ValueError, "trajectory 3, position 5"),
    "negative-torch": (OK + [torch.tensor([0, 1, 2, 3, 4, -5])], ValueError, "trajectory 3, position 5"),
    "float-list": (OK + [[0, 1, 2, 3, 4, 5.0]], TypeError, "trajectory 3, position 5"),
    "float-numpy": (OK + [np.array([0.0, 1.0])], TypeError, "trajectory 3"),
    "float-torch": (OK + [torch.tensor([0.0, 1.0])], TypeError, "trajectory 3"),
    "bool-list": (OK + [[0, True]], TypeError, "trajectory 3, position 1"),
    "numpy-bool-in-list": (OK + [[0, 1, np.bool_(True)]], TypeError, "trajectory 3, position 2"),
    "bool-numpy": (OK + [np.array([True, False])], TypeError, "trajectory 3"),
    "bool-torch": (OK + [torch.tensor([True, False])], TypeError, "trajectory 3"),
    "2d-numpy-in-list": (OK + [np.ones((2, 2), dtype=np.int64)], ValueError, "trajectory 3"),
    "2d-torch-in-list": (OK + [torch.ones(2, 2, dtype=torch.long)], ValueError, "trajectory 3"),
    "nested-list": (OK + [[0, [1, 2]]], TypeError, "trajectory 3, position 1"),
    "string-trajectory": (OK + ["abc"], TypeError, "trajectory 3"),
    "string-token": (OK + [[0, "1"]], TypeError, "trajectory 3, position 1"),
    "string-forest": ("abc", TypeError, "sequence of trajectories"),
    "none-trajectory": (OK + [None], TypeError, "trajectory 3"),
    "ids-not-trajectories": ([1, 2, 3], TypeError, "trajectory 0"),
    "too-large-list": (OK + [[0, 2**63]], ValueError, "trajectory 3, position 1"),
    "too-large-uint64": (OK + [np.array([0, 2**64 - 1], np.uint64)], ValueError, "trajectory 3, position 1"),
}


@pytest.mark.parametrize("trajs,exc,fragment", list(ERRORS.values()), ids=list(ERRORS))
@pytest.mark.parametrize("share", [True, False], ids=["tree", "flat"])
def test_input_errors_name_trajectory_and_position(trajs, exc, fragment, share):
    with pytest.raises(exc) as info:
        build_forest(trajs, share_prefixes=share)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "trajs,vocab,traj,pos",
    [
        ([[1, 2, 3], [1, 2, 9], [4, 5, 6, 7, 99]], 10, 2, 4),  # unshared bad token
        ([[1, 2, 3], [1, 2, 9], [4, 5, 6, 7, 8]], 9, 1, 2),  # just after a branch point
        ([[4, 5, 6, 7, 8], [1, 2, 3], [1, 2, 3, 4, 50]], 9, 2, 4),  # below a prefix trajectory
    ],
    ids=["unshared-T2-P4", "branch-T1-P2", "below-prefix-T2-P4"],
)
@pytest.mark.parametrize("share", [True, False], ids=["tree", "flat"])
def test_check_vocabulary_names_trajectory_and_position(trajs, vocab, traj, pos, share):
    f = build_forest(trajs, share_prefixes=share)
    with pytest.raises(ValueError, match=rf"trajectory {traj}, position {pos}\b"):
        f.check_vocabulary(vocab)
    f.check_vocabulary(max(max(t) for t in trajs) + 1)  # all ids below vocab_size: no error


def test_check_vocabulary_on_shared_token_names_a_trajectory_that_has_it():
    trajs = [[0, 1], [20, 21, 22], [20, 21, 23], [0, 2]]
    f = build_forest(trajs)
    with pytest.raises(ValueError) as info:
        f.check_vocabulary(10)
    msg = str(info.value)
    traj, pos = (int(x) for x in msg.split(":")[0].replace("trajectory ", "").split(", position "))
    assert trajs[traj][pos] >= 10 and pos == 0
