"""Advantage estimators: from rewards (and the forest) to per-row advantages.

Group estimators map per-trajectory rewards [B] and group ids [B] to per-trajectory advantages
[B]: GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025), RLOO (Ahmadian et al. 2024). Per-row
estimators give each (trajectory, position) its own value [R]: tree advantages from node values
on the forest (the tree-value idea of TreeRL, Hou et al. 2025, and TreePO, Li et al. 2025) and
first-error-step ("pitfall") advantages (process supervision: Uesato et al. 2022, Lightman et al.
2023). :func:`estimate_advantages` runs one by name and writes the result into the rows;
:func:`advantages_to_rollouts` writes it back into rollouts, for a step that is split later.

GAE (Schulman et al. 2016) gives each row its advantage and return from per-token rewards and a
learned critic's values (``Rollout.values``), per trajectory, as verl's
``compute_gae_advantage_return`` does (:func:`gae_advantages`).

Estimate on the rows of a whole step (or at least of whole groups): a group's baseline needs all
of its rewards, and GAE's whitening the statistics of all rows. What this leaves out: reward shaping.
Shapes: B trajectories, G groups, M forest nodes, R rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np
import torch

from harts.forest import Forest
from harts.objectives.rollout import Rollout
from harts.objectives.rows import LossRows

__all__ = [
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "tree_node_values",
    "tree_advantages",
    "pitfall_advantages",
    "gae_advantages",
    "AdvantageEstimator",
    "ADVANTAGE_ESTIMATORS",
    "EstimatorEntry",
    "estimate_advantages",
    "with_advantages",
    "advantages_to_rollouts",
]

Tensor = torch.Tensor


def _group_sums(values: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """(count [G], sum [G]) of ``values`` [B] per group."""
    num_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, group, torch.ones_like(values)
    )
    total = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, group, values)
    return count, total


def _check_group_inputs(reward: Tensor, group: Tensor) -> None:
    if reward.dim() != 1 or group.shape != reward.shape:
        raise ValueError(
            f"reward and group must both be [B], got {tuple(reward.shape)} and {tuple(group.shape)}"
        )
    if not reward.dtype.is_floating_point:
        raise TypeError(f"reward must be a float tensor, got {reward.dtype}")


def grpo_advantages(reward: Tensor, group: Tensor, eps: float = 1e-6) -> Tensor:
    """[B] GRPO outcome advantage (Shao et al. 2024, DeepSeekMath sec. 4.1.2): (r - mean_g) / (std_g + eps).

    ``std_g`` is the population std of the group (unbiased=False), so a group of one gets 0, not NaN;
    verl and TRL use the sample std (unbiased=True), which is larger by sqrt(n / (n - 1)).
    """
    _check_group_inputs(reward, group)
    count, total = _group_sums(reward, group)
    centered = reward - (total / count)[group]
    _, sq = _group_sums(centered * centered, group)
    std = torch.sqrt(sq / count)
    return centered / (std[group] + eps)


def dr_grpo_advantages(reward: Tensor, group: Tensor) -> Tensor:
    """[B] Dr. GRPO advantage (Liu et al. 2025, "Understanding R1-Zero-Like Training"): r - mean_g.

    Dropping GRPO's division by the std removes its difficulty bias; pair it with
    ``Aggregation.SEQ_MEAN_TOKEN_SUM_NORM`` to also drop the length bias.
    """
    _check_group_inputs(reward, group)
    count, total = _group_sums(reward, group)
    return reward - (total / count)[group]


def rloo_advantages(reward: Tensor, group: Tensor) -> Tensor:
    """[B] RLOO advantage (Ahmadian et al. 2024): r - mean of the *other* rewards of the group.

    Equals n / (n - 1) * (r - mean_g); a group of one has no others and gets 0.
    """
    _check_group_inputs(reward, group)
    count, total = _group_sums(reward, group)
    n = count[group]
    others = (total[group] - reward) / torch.clamp(n - 1, min=1)
    return torch.where(n > 1, reward - others, torch.zeros_like(reward))


def tree_node_values(forest: Forest, reward: Tensor) -> Tensor:
    """[M] value of every node: mean reward of the trajectories that end in its subtree.

    Those are exactly the trajectories that pass through the node (``node_multiplicity``). Subtrees
    are contiguous node ranges, so the subtree sums are differences of one prefix sum.
    """
    if reward.shape != (forest.num_trajectories,):
        raise ValueError(f"reward must be [B] = ({forest.num_trajectories},), got {tuple(reward.shape)}")
    ends = torch.zeros(forest.num_nodes, dtype=reward.dtype).index_add_(0, forest.trajectory_end_node, reward)
    prefix = torch.cat([torch.zeros(1, dtype=reward.dtype), torch.cumsum(ends, 0)])
    node = torch.arange(forest.num_nodes)
    subtree_sum = prefix[forest.node_subtree_end] - prefix[node]
    return subtree_sum / forest.node_multiplicity.to(reward.dtype)


def _rewards(rows: LossRows, name: str) -> Tensor:
    if not bool(rows.has_reward.all()):
        missing = int((~rows.has_reward).nonzero()[0, 0])
        raise ValueError(f"trajectory {missing}: {name} needs a reward for every trajectory, got None")
    return rows.reward


def tree_advantages(forest: Forest, rows: LossRows) -> Tensor:
    """[R] tree advantage of each row's target token: V(node) - V(parent node).

    V is :func:`tree_node_values`: the expected reward once the path reaches the node, so the
    advantage is the value the node's tokens added over the branch point before them (TreeRL,
    Hou et al. 2025; TreePO, Li et al. 2025). Every token of a node gets the same value.
    Root case: a root's parent is a virtual node per group whose value is the mean reward of the
    row's trajectory's group in the batch, so along a trajectory the advantages telescope to
    V(end node) - mean_g; with one shared prompt root per group the root tokens get 0 and the
    first response node gets V(node) - mean_g, Dr. GRPO's advantage when nothing else is shared.
    Nodes shared by several groups (a common system prompt) mix their rewards in V.

    Deliberate simplification: TreeRL also adds the global term V(node) - V(root) and divides by
    sqrt(number of leaves); add those outside if wanted.
    """
    device = rows.device
    rows = rows.to("cpu")  # the forest's index tensors live on the CPU
    reward = _rewards(rows, "tree_advantages")
    values = tree_node_values(forest, reward)
    count, total = _group_sums(reward, rows.group)
    group_mean = total / count
    node = forest.token_node[rows.target_index]
    parent = forest.node_parent[node]
    baseline = torch.where(parent >= 0, values[parent.clamp(min=0)], group_mean[rows.group[rows.trajectory]])
    return (values[node] - baseline).to(device)


def pitfall_advantages(rows: LossRows, a_pos: float = 1.0, a_neg: float = 1.0) -> Tensor:
    """[R] first-error-step advantages.

    A trajectory with ``first_error_position`` e is a failed one whose first wrong step starts at
    position e: positions < e get ``+a_pos`` (the correct steps before the pitfall), positions >= e
    get ``-a_neg``. A trajectory without e is a success: ``+a_pos`` everywhere. Mark a failure
    whose error step is unknown with e = 0 (every position negative). Labels of this kind are
    the "first error step" of process supervision (Uesato et al. 2022; Lightman et al. 2023,
    PRM800K), here used directly as advantages. ``a_pos`` and ``a_neg`` must be >= 0.
    """
    if not (a_pos >= 0 and a_neg >= 0):
        raise ValueError(f"a_pos and a_neg must be >= 0, got {a_pos}, {a_neg}")
    err = rows.first_error_position[rows.trajectory]
    failed = (err >= 0) & (rows.position >= err)
    pos = torch.full_like(rows.weight, a_pos)
    return torch.where(failed, torch.full_like(pos, -a_neg), pos)


def gae_advantages(
    rows: LossRows,
    gamma: float = 1.0,
    lam: float = 1.0,
    token_rewards: Tensor | None = None,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """(advantages [R], returns [R]): generalised advantage estimation over each trajectory's rows.

    Along a trajectory's rows t = 1..T in position order (its loss-bearing positions; the others,
    prompt or tool tokens, are skipped, as verl's mask skips them), with V_t the rollout-time value
    of row t (``rows.rollout_value``) and r_t its reward::

        delta_t = r_t + gamma * V_{t+1} - V_t        (V_{T+1} = 0: the episode ends)
        A_t     = delta_t + gamma * lam * A_{t+1}    (A_{T+1} = 0)
        returns_t = A_t + V_t

    then, with ``whiten``, the advantages of all rows are whitened together:
    ``(A - mean) / sqrt(var + 1e-8)`` with the unbiased variance (verl's ``masked_whiten``); the
    returns are not. ``token_rewards`` [R]: each row's reward; None puts each trajectory's
    ``reward`` on its last row (verl's ``token_level_rewards`` of an outcome reward) and 0
    elsewhere. Computed in fp64, returned in the rows' dtype on their device.
    """
    if not rows.has_rollout_value:
        raise ValueError(
            "gae needs the critic's rollout-time values: give the rollouts values (harts.forward_values)"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae needs 0 <= gamma <= 1 and 0 <= lam <= 1, got gamma={gamma}, lam={lam}")
    traj = rows.trajectory.cpu()
    num_rows, num = rows.num_rows, rows.num_trajectories
    starts = torch.searchsorted(traj, torch.arange(num + 1))  # rows come trajectory by trajectory
    if token_rewards is None:
        reward = _rewards(rows, "gae").cpu().double()
        token_rewards = torch.zeros(num_rows, dtype=torch.float64)
        has_rows = starts[1:] > starts[:-1]
        token_rewards[starts[1:][has_rows] - 1] = reward[has_rows]
    else:
        if not isinstance(token_rewards, Tensor) or token_rewards.shape != (num_rows,):
            raise ValueError(
                f"token_rewards must be a tensor [R] = ({num_rows},), got "
                f"{tuple(getattr(token_rewards, 'shape', ()))}"
            )
        if not bool(torch.isfinite(token_rewards).all()):
            bad = int((~torch.isfinite(token_rewards)).nonzero()[0, 0])
            raise ValueError(
                f"trajectory {int(traj[bad])}, position {int(rows.position[bad])}: "
                f"token reward is {float(token_rewards[bad])}"
            )
        token_rewards = token_rewards.detach().cpu().double()
    values = rows.rollout_value.detach().cpu().double()
    # rows as a right-padded [B, T] grid, swept backwards in one vectorised loop over T
    rank = torch.arange(num_rows) - starts[traj]
    width = int(rank.max()) + 1 if num_rows else 0
    grid_r = torch.zeros(num, width + 1, dtype=torch.float64)
    grid_v = torch.zeros(num, width + 1, dtype=torch.float64)
    grid_r[traj, rank], grid_v[traj, rank] = token_rewards, values
    grid_a = torch.zeros(num, width + 1, dtype=torch.float64)  # column ``width``: after every end
    for t in range(width - 1, -1, -1):
        delta = grid_r[:, t] + gamma * grid_v[:, t + 1] - grid_v[:, t]
        grid_a[:, t] = delta + gamma * lam * grid_a[:, t + 1]
    advantages = grid_a[traj, rank]
    returns = advantages + values
    if whiten:
        if num_rows < 2:
            raise ValueError(f"gae's whitening needs at least 2 rows (an unbiased variance), got {num_rows}")
        advantages = (advantages - advantages.mean()) * torch.rsqrt(advantages.var(unbiased=True) + 1e-8)
    dtype, device = rows.weight.dtype, rows.device
    return advantages.to(device=device, dtype=dtype), returns.to(device=device, dtype=dtype)


def _gae(rows: LossRows, forest: Forest | None = None, **params) -> Tensor:
    return gae_advantages(rows, **params)[0]


# ---- registry ------------------------------------------------------------------------------------
class AdvantageEstimator(StrEnum):
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"
    TREE = "tree"
    PITFALL = "pitfall"
    GAE = "gae"


@dataclass(frozen=True)
class EstimatorEntry:
    """One estimator in :data:`ADVANTAGE_ESTIMATORS`: its function and what it reads, which
    ``harts train`` and ``harts rl`` read instead of testing names.

    - ``estimate(rows, forest=None, **params) -> advantages [R]``; an entry is called like it.
    - ``params``: the keyword parameters ``params`` may set (``objective.advantage_params`` in a config).
    - ``needs_reward``: reads each trajectory's ``reward`` (GAE puts it on the last row, unless
      ``token_rewards`` are given). Pitfall reads ``first_error_position`` instead, where given
      (none: a success).
    - ``needs_forest``: reads the forest the rows were built on (tree: values of subtrees).
    - ``needs_critic``: reads a critic's rollout-time value at every row (``Rollout.values``; GAE).

    The group estimators and tree's root baseline also read the rows' groups, which every rollout has.
    """

    estimate: Callable[..., Tensor]
    params: tuple[str, ...] = ()
    needs_reward: bool = True
    needs_forest: bool = False
    needs_critic: bool = False

    def __call__(self, rows: LossRows, forest: Forest | None = None, **params) -> Tensor:
        return self.estimate(rows, forest, **params)


def _per_trajectory(fn):
    """A group estimator over trajectories: the pieces of one (``rows.source``) count once, each
    taking the trajectory's advantage."""

    def run(rows: LossRows, forest: Forest | None = None, **params) -> Tensor:
        reward = _rewards(rows, fn.__name__)
        if rows.source is None:
            return fn(reward, rows.group, **params)[rows.trajectory]
        source = rows.source.to(reward.device)
        first = torch.full((int(source.max()) + 1,), len(source), dtype=torch.long, device=reward.device)
        first = first.scatter_reduce(0, source, torch.arange(len(source), device=reward.device), "amin")
        per_source = fn(reward[first], rows.group.to(reward.device)[first], **params)
        return per_source[source][rows.trajectory]

    return run


def _tree(rows: LossRows, forest: Forest | None = None) -> Tensor:
    if forest is None:
        raise ValueError("the tree estimator needs the forest the rows were built on")
    return tree_advantages(forest, rows)


def _pitfall(rows: LossRows, forest: Forest | None = None, **params) -> Tensor:
    return pitfall_advantages(rows, **params)


#: name -> its entry. To add one: its function and one entry here.
ADVANTAGE_ESTIMATORS: dict[AdvantageEstimator, EstimatorEntry] = {
    AdvantageEstimator.GRPO: EstimatorEntry(_per_trajectory(grpo_advantages), params=("eps",)),
    AdvantageEstimator.DR_GRPO: EstimatorEntry(_per_trajectory(dr_grpo_advantages)),
    AdvantageEstimator.RLOO: EstimatorEntry(_per_trajectory(rloo_advantages)),
    AdvantageEstimator.TREE: EstimatorEntry(_tree, needs_forest=True),
    AdvantageEstimator.PITFALL: EstimatorEntry(_pitfall, params=("a_pos", "a_neg"), needs_reward=False),
    AdvantageEstimator.GAE: EstimatorEntry(
        _gae, params=("gamma", "lam", "token_rewards", "whiten"), needs_critic=True
    ),
}


def with_advantages(rows: LossRows, advantages: Tensor) -> LossRows:
    """A copy of ``rows`` whose advantages are ``advantages``: per row [R] or per trajectory [B]."""
    if advantages.shape == (rows.num_rows,):
        per_row = advantages
    elif advantages.shape == (rows.num_trajectories,):
        per_row = advantages[rows.trajectory]
    else:
        raise ValueError(
            f"advantages must be [R] = ({rows.num_rows},) or [B] = ({rows.num_trajectories},), "
            f"got {tuple(advantages.shape)}"
        )
    if not bool(torch.isfinite(per_row).all()):
        raise ValueError("advantages contain NaN or inf")
    return replace(rows, advantage=per_row.detach().to(rows.weight.dtype), has_advantage=True)


def estimate_advantages(
    rows: LossRows, estimator: AdvantageEstimator | str, forest: Forest | None = None, **params
) -> LossRows:
    """Rows with advantages from the named estimator (``params`` go to it, e.g. ``eps``, ``a_neg``)."""
    entry = ADVANTAGE_ESTIMATORS[AdvantageEstimator(estimator)]
    return with_advantages(rows, entry(rows, forest, **params))


def advantages_to_rollouts(
    rollouts: Sequence[Rollout], rows: LossRows, advantages: Tensor, returns: Tensor | None = None
) -> list[Rollout]:
    """Copies of ``rollouts`` whose ``advantages`` hold ``advantages`` [R] at each row's position
    (and ``returns`` hold ``returns`` [R], GAE's, when given).

    ``rows`` must be ``build_loss_rows(forest, rollouts)``. Positions without a row get 0.
    """
    if len(rollouts) != rows.num_trajectories:
        raise ValueError(
            f"rows have {rows.num_trajectories} trajectories but {len(rollouts)} rollouts were given"
        )
    if advantages.shape != (rows.num_rows,):
        raise ValueError(f"advantages must be [R] = ({rows.num_rows},), got {tuple(advantages.shape)}")
    if returns is not None and returns.shape != (rows.num_rows,):
        raise ValueError(f"returns must be [R] = ({rows.num_rows},), got {tuple(returns.shape)}")
    traj = rows.trajectory.cpu().numpy()
    position = rows.position.cpu().numpy()
    bounds = np.searchsorted(traj, np.arange(len(rollouts) + 1))  # rows come trajectory by trajectory
    fields = {"advantages": advantages} if returns is None else {"advantages": advantages, "returns": returns}
    fields = {name: values.detach().cpu().double().numpy() for name, values in fields.items()}
    out = []
    for i, r in enumerate(rollouts):
        per_field = {}
        for name, values in fields.items():
            per_position = np.zeros(len(r.tokens), dtype=np.float64)
            per_position[position[bounds[i] : bounds[i + 1]]] = values[bounds[i] : bounds[i + 1]]
            per_field[name] = per_position
        out.append(replace(r, **per_field))
    return out
