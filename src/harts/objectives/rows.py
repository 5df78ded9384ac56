"""Loss rows: one row per (trajectory, predicted position), the unit every objective sums over.

The model runs once per unique token of the forest; the loss runs once per row. A row of
trajectory ``b`` at position ``p`` (with ``loss_mask[p]`` true) holds the unique-token index of
position ``p - 1`` (the *predictor*), the target token id at ``p``, and ``b``'s own annotations at
``p``. A shared token can be a predictor in many rows: a branch token predicts a different target
in each child, and trajectories sharing a token can annotate it differently. So log-probs are per
row while logits are per unique predictor (see :func:`unique_predictors`).

Shapes: R rows, B trajectories, U unique predictors.

What this leaves out: logits and log-probs (``harts.ops.logprobs``), the objectives
(``losses.py``), advantage estimation (``advantages.py``). GSPO's sequence ratio reads all rows
of a trajectory together; every other objective is a sum of per-row terms over the step's
normalisers (a trajectory's row count, for seq-mean-token-mean, is ``tokens_per_trajectory``,
which a selection keeps whole), so any subset of rows gets its exact share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from harts.forest import Forest
from harts.objectives.rollout import Rollout, trajectory_sources, validate_rollouts

__all__ = ["LossRows", "build_loss_rows", "unique_predictors", "check_row_tensor"]


@dataclass(frozen=True, eq=False)
class LossRows:
    """Loss rows of a batch of trajectories; all tensors on one device.

    Per row [R]:

    - ``predictor``: unique-token index (into the forest) of position ``p - 1``, which predicts ``p``.
    - ``target``: token id at position ``p``.
    - ``target_index``: unique-token index of position ``p`` itself (tree advantages use its node).
    - ``trajectory``: index of the row's trajectory in the batch, ``[0, B)``.
    - ``position``: ``p``, the position of the target in its trajectory (>= 1).
    - ``weight``: the float loss mask, 1.0 for every row (masked positions have no row).
    - ``advantage``, ``rollout_logprob``, ``ref_logprob``: the annotations at ``p``; zeros where the
      batch has none (see the ``has_*`` flags), never NaN.
    - ``value_target``, ``rollout_value``: a critic's annotations at ``p`` (``Rollout.returns`` and
      ``Rollout.values``), zeros where absent (``has_value_target``, ``has_rollout_value``).
    - ``old_logprob``: the old policy's log-prob at ``p`` (``Rollout.old_logprobs``), zeros where
      absent (``has_old_logprob``); ``rollout_logprob`` is then the behaviour policy's alone.

    Per trajectory [B]:

    - ``tokens_per_trajectory``: number of rows of each trajectory (0 for a fully masked one).
    - ``group``: dense group id in ``[0, G)``, in order of first appearance; ``group_id=None``
      makes a trajectory a group of its own.
    - ``reward`` (0.0 where absent) and ``has_reward`` (bool).
    - ``first_error_position``: -1 where None.
    - ``trajectory_log_rho``: float64, sum over ALL of the trajectory's rows of
      ``old_logprob - rollout_logprob`` (the log of its importance ratio old / behaviour), None
      unless the rows hold both; computed once from the whole batch (:meth:`with_old_logprob`,
      :func:`build_loss_rows`) and kept whole by :meth:`select`, so a sequence-level correction
      of any subset of rows reads the whole trajectory's ratio.
    - ``source``: the trajectory each rollout is a piece of (``Rollout.trajectory_id``, dense), or
      None when every rollout is a whole trajectory; group estimators count a trajectory once.
    """

    predictor: torch.Tensor
    target: torch.Tensor
    target_index: torch.Tensor
    trajectory: torch.Tensor
    position: torch.Tensor
    weight: torch.Tensor
    advantage: torch.Tensor
    rollout_logprob: torch.Tensor
    ref_logprob: torch.Tensor
    tokens_per_trajectory: torch.Tensor
    group: torch.Tensor
    reward: torch.Tensor
    has_reward: torch.Tensor
    first_error_position: torch.Tensor
    has_advantage: bool = False
    has_rollout_logprob: bool = False
    has_ref_logprob: bool = False
    value_target: torch.Tensor | None = None
    rollout_value: torch.Tensor | None = None
    has_value_target: bool = False
    has_rollout_value: bool = False
    old_logprob: torch.Tensor | None = None
    has_old_logprob: bool = False
    trajectory_log_rho: torch.Tensor | None = None
    source: torch.Tensor | None = None

    def __post_init__(self):  # rows built without these annotations: zeros, as for the others
        for name in ("value_target", "rollout_value", "old_logprob"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, torch.zeros_like(self.weight))

    @property
    def num_rows(self) -> int:
        return int(self.predictor.numel())

    @property
    def num_trajectories(self) -> int:
        return int(self.tokens_per_trajectory.numel())

    @property
    def device(self) -> torch.device:
        return self.predictor.device

    def select(self, index: torch.Tensor) -> LossRows:
        """The rows ``index`` [r] (per-row tensors indexed, per-trajectory ones kept whole).

        Exact for every objective on any rows, except GSPO, whose sequence ratio needs all rows of
        each trajectory ``index`` touches.
        """
        index = torch.as_tensor(index, dtype=torch.long, device=self.device)
        per_row = (
            "predictor",
            "target",
            "target_index",
            "trajectory",
            "position",
            "weight",
            "advantage",
            "rollout_logprob",
            "ref_logprob",
            "value_target",
            "rollout_value",
            "old_logprob",
        )
        return replace(self, **{name: getattr(self, name)[index] for name in per_row})

    def with_old_logprob(self, old_logprob: torch.Tensor) -> LossRows:
        """These rows with ``old_logprob`` [R] as the old policy's log-probs (detached), and each
        trajectory's ``trajectory_log_rho`` from them. The rows must hold whole trajectories (all
        of the batch's: a subset's sums would miss the rows left out)."""
        check_row_tensor(old_logprob, self, "old_logprob")
        old = old_logprob.detach().to(self.device)
        sums = None
        if self.has_rollout_logprob:
            log_rho = old.to(torch.float64) - self.rollout_logprob.to(torch.float64)
            sums = torch.zeros(self.num_trajectories, dtype=torch.float64, device=self.device)
            sums = sums.index_add_(0, self.trajectory, log_rho)
        return replace(self, old_logprob=old, has_old_logprob=True, trajectory_log_rho=sums)

    def to(self, device) -> LossRows:
        """A copy with every tensor on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def __repr__(self) -> str:
        flags = [
            n
            for n in (
                "advantage",
                "rollout_logprob",
                "old_logprob",
                "ref_logprob",
                "value_target",
                "rollout_value",
            )
            if getattr(self, f"has_{n}")
        ]
        flags = flags or "no annotations"
        return f"LossRows({self.num_rows} rows, {self.num_trajectories} trajectories, with {flags})"


def _dense_groups(group_ids) -> torch.Tensor:
    ids: dict = {}
    out = []
    for g in group_ids:
        if g is None:
            out.append(len(ids))
            ids[object()] = len(ids)  # a fresh key: a group of its own
        else:
            out.append(ids.setdefault(g, len(ids)))
    return torch.tensor(out, dtype=torch.long)


def build_loss_rows(
    forest: Forest, rollouts: Sequence[Rollout], dtype: torch.dtype = torch.float32
) -> LossRows:
    """Rows of every loss-bearing (trajectory, position) of ``rollouts`` over ``forest``.

    ``forest`` must be ``build_forest([r.tokens for r in rollouts])`` (shared or flat layout):
    trajectory ``i`` of the forest is rollout ``i``. Rollouts are validated first (see
    :func:`validate_rollouts`). Float tensors get ``dtype``; index tensors are int64 on the CPU.
    Rows come trajectory by trajectory, positions ascending.
    """
    if not isinstance(forest, Forest):
        raise TypeError(f"expected a Forest, got {type(forest).__name__}")
    checked = validate_rollouts(rollouts)
    num = len(checked)
    if forest.num_trajectories != num:
        raise ValueError(
            f"the forest has {forest.num_trajectories} trajectories but {num} rollouts were given"
        )

    # One Python step per trajectory (its path's unique-token indices), never per token.
    paths = [forest.trajectory_token_indices(i) for i in range(num)]
    for i, (path, c) in enumerate(zip(paths, checked, strict=True)):
        path_tokens = forest.tokens[path].numpy()
        if path_tokens.size != c.tokens.size:
            raise ValueError(
                f"trajectory {i}: the forest's trajectory has {path_tokens.size} tokens but the rollout has "
                f"{c.tokens.size}"
            )
        diff = path_tokens != c.tokens
        if diff.any():
            raise ValueError(
                f"trajectory {i}, position {int(np.argmax(diff))}: the forest's token differs from the "
                f"rollout's"
            )

    lengths = forest.trajectory_length
    flat_index = torch.cat(paths)  # [F] unique-token index of every flat position
    flat_mask = torch.from_numpy(np.concatenate([c.loss_mask for c in checked]))
    flat_trajectory = torch.repeat_interleave(torch.arange(num), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    sel = flat_mask.nonzero().squeeze(1)  # [R] flat positions of rows; never a trajectory's position 0
    trajectory = flat_trajectory[sel]
    target_index = flat_index[sel]

    rewards = [c.reward for c in checked]
    errors = [c.first_error_position for c in checked]
    return LossRows(
        predictor=flat_index[sel - 1],
        target=forest.tokens[target_index],
        target_index=target_index,
        trajectory=trajectory,
        position=sel - starts[trajectory],
        weight=torch.ones(sel.numel(), dtype=dtype),
        tokens_per_trajectory=torch.bincount(trajectory, minlength=num),
        group=_dense_groups(c.group_id for c in checked),
        reward=torch.tensor([0.0 if r is None else r for r in rewards], dtype=dtype),
        has_reward=torch.tensor([r is not None for r in rewards], dtype=torch.bool),
        first_error_position=torch.tensor([-1 if e is None else e for e in errors], dtype=torch.long),
        source=_sources(rollouts),
        **_annotations(checked, sel, trajectory, dtype),
    )


def _sources(rollouts: Sequence[Rollout]) -> torch.Tensor | None:
    if all(getattr(r, "trajectory_id", None) is None for r in rollouts):
        return None
    return torch.tensor(trajectory_sources(rollouts), dtype=torch.long)


#: a rollout's per-position annotation -> the rows' field that holds it at each row
_ANNOTATIONS = {
    "advantages": "advantage",
    "rollout_logprobs": "rollout_logprob",
    "ref_logprobs": "ref_logprob",
    "returns": "value_target",
    "values": "rollout_value",
    "old_logprobs": "old_logprob",
}


def _annotations(checked, sel: torch.Tensor, trajectory: torch.Tensor, dtype: torch.dtype) -> dict:
    """The LossRows keywords of the annotations at the rows' flat positions ``sel``: each one's
    values in ``dtype`` (zeros where the batch has none) and its ``has_*`` flag, and the
    trajectories' log-ratios (``trajectory_log_rho``) summed from the float64 annotations, not
    from their rounding to ``dtype``."""
    out, flat64 = {}, {}
    for name, field in _ANNOTATIONS.items():
        arrays = [getattr(c, name) for c in checked]
        out[f"has_{field}"] = arrays[0] is not None
        if arrays[0] is None:
            out[field] = torch.zeros(sel.numel(), dtype=dtype)
            continue
        flat64[field] = torch.from_numpy(np.concatenate(arrays)[sel.numpy()])
        out[field] = flat64[field].to(dtype)
    if out["has_old_logprob"] and out["has_rollout_logprob"]:
        log_rho = flat64["old_logprob"] - flat64["rollout_logprob"]
        sums = torch.zeros(len(checked), dtype=torch.float64)
        out["trajectory_log_rho"] = sums.index_add_(0, trajectory, log_rho)
    return out


def unique_predictors(rows: LossRows) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique_index [U], inverse [R])``: the distinct predictors, and each row's slot among them.

    ``unique_index`` is sorted (forest order); ``unique_index[inverse] == rows.predictor``. Compute
    logits (softmax normaliser, entropy) once per entry of ``unique_index``, then read each row's
    own target: ``logprob[r] = log_softmax(logits[inverse[r]])[rows.target[r]]``.
    """
    unique_index, inverse = torch.unique(rows.predictor, sorted=True, return_inverse=True)
    return unique_index, inverse


def check_row_tensor(x: torch.Tensor, rows: LossRows, name: str) -> None:
    """Refuse ``x`` unless it is a tensor of one value per row of ``rows`` ([R]); errors name it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.shape != (rows.num_rows,):
        raise ValueError(f"{name} must have shape [R] = ({rows.num_rows},), got {tuple(x.shape)}")
