"""How far the engine that sampled the rollouts is from the trainer, measured on their log-probs.

For every loss token, the behaviour policy's log-prob ``b`` (the engine's, ``rollout_logprobs``)
and the old policy's ``o`` (the trainer's before the update) give ``log rho = o - b``. The step's
sums over its loss tokens (``mismatch_kl``, ``mismatch_log_rho_abs``: token means under the step's
normalisers) come with the loss (:mod:`harts.objectives.corrections`); the figures here are the ones
no sum over micro-batches and ranks can carry, computed on the whole step's rows at once:

- ``mismatch_log_rho_abs_max``: the largest |log rho|;
- ``mismatch_prob_corr``: Pearson's correlation of the engine's and the trainer's probabilities
  (``exp b`` and ``exp o``) over the loss tokens (absent when either is constant): 1 when they agree;
  drifting below that as a run goes on is the warning sign engine-trainer studies report;
- ``mismatch_kl_q1`` .. ``q4`` and ``mismatch_log_rho_abs_q1`` .. ``q4``: the k3 estimate of
  KL(behaviour || old) (``rho - 1 - log rho``, unbiased under the behaviour's samples) and the mean
  |log rho| over each quarter of every trajectory's loss tokens, in order: a gap that grows along
  the trajectory (recurrent state and long-context kernels drifting apart) shows as rising quarters.

Pure functions of the rows' log-probs; no model.
"""

from __future__ import annotations

import torch

__all__ = ["mismatch_figures", "QUARTERS"]

Tensor = torch.Tensor

QUARTERS = 4


def _quarters(trajectory: Tensor) -> Tensor:
    """[R] which quarter of its trajectory's loss tokens each row is in (rows come trajectory by
    trajectory, positions ascending): ``floor(4 * rank / count)``."""
    _, counts = torch.unique_consecutive(trajectory, return_counts=True)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rank = torch.arange(trajectory.numel(), device=trajectory.device) - starts
    return torch.div(QUARTERS * rank, torch.repeat_interleave(counts, counts), rounding_mode="floor")


def mismatch_figures(behaviour: Tensor, old: Tensor, trajectory: Tensor) -> dict[str, float]:
    """The figures of the module docstring from ``behaviour`` and ``old`` [R] log-probs of the loss
    tokens and ``trajectory`` [R] (each row's trajectory, rows grouped by trajectory in position
    order); {} without rows."""
    if behaviour.numel() == 0:
        return {}
    b, o = behaviour.detach().double().cpu(), old.detach().double().cpu()
    log_rho = o - b
    k3 = torch.expm1(log_rho) - log_rho
    figures = {"mismatch_log_rho_abs_max": float(log_rho.abs().max())}
    pb, po = b.exp(), o.exp()
    spread = pb.std(unbiased=False) * po.std(unbiased=False)
    if float(spread) > 0:
        figures["mismatch_prob_corr"] = float(((pb - pb.mean()) * (po - po.mean())).mean() / spread)
    quarter = _quarters(trajectory.cpu())
    for q in range(QUARTERS):
        here = quarter == q
        if bool(here.any()):
            figures[f"mismatch_kl_q{q + 1}"] = float(k3[here].mean())
            figures[f"mismatch_log_rho_abs_q{q + 1}"] = float(log_rho[here].abs().mean())
    return figures
