"""MoE routing statistics on a forest, equal to those of the flat batch.

In a forest the router of every MoE layer runs once per unique token, but a unique token stands
for ``multiplicity`` flat tokens: one per trajectory through it. Every load-balancing statistic is
a sum over flat tokens, so weighting each unique token by its multiplicity gives the flat batch's
value exactly. The same functions serve a stock padded batch with its attention mask as the
weight, which is how the tests compare the two. These are pure functions of router outputs;
recording them from a model is :class:`harts.runtime.routers.RouterRecorder`'s job.

- :func:`load_balancing_loss`: the Switch Transformer auxiliary loss, exactly as transformers'
  ``load_balancing_loss_func`` computes it over a padded batch (qwen3_next, softmax routing);
  :func:`routing_sums` and :func:`aux_loss_from_sums` are its two halves, so that sums over the
  micro-batches of a step give the step's loss.
- :func:`expert_counts`: per-layer per-expert token counts of the step, integers, for the
  aux-loss-free bias balancing of bailing_hybrid and kimi_linear; :func:`bias_update` is the
  DeepSeek-V3 rule they feed (not applied here: that is the trainer's job).
- :class:`MoEConfig` and :class:`MoEStats`: what ``rollout_step(moe=...)`` takes and returns.

Shapes: N tokens recorded (unique tokens of a forest, or B*T of a padded batch), E experts,
k experts per token, L MoE layers.

The aux loss is a product of two means over the whole step, ``E * sum_e f_e P_e``; only ``P``
carries a gradient. Under a token budget the step sums each micro-batch's routing counts in a
first pass (giving ``f``), then backpropagates ``E * sum_e f_e P_e^(part)`` part by part: the
same value and the same gradient as one pass over the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "load_balancing_loss",
    "routing_sums",
    "aux_loss_from_sums",
    "expert_counts",
    "bias_update",
    "MoEConfig",
    "MoEStats",
]

Tensor = torch.Tensor


def _check_weight(rows: Sequence[Tensor], weight: Tensor) -> None:
    if weight.dim() != 1:
        raise ValueError(f"weight must be [N], got shape {tuple(weight.shape)}")
    for layer, t in enumerate(rows):
        if t.shape[0] != weight.shape[0]:
            raise ValueError(
                f"MoE layer {layer} recorded {t.shape[0]} tokens but weight has {weight.shape[0]}: record "
                f"exactly one forward of the forest (or batch) the weight belongs to"
            )


def routing_sums(
    router_logits: Sequence[Tensor], weight: Tensor, top_k: int, chosen: Sequence[Tensor] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(routed [E] fp64, prob_sum [E], tokens)`` of recorded router logits, each token weighted.

    ``routed[e] = sum_l sum_t w_t [e in topk(softmax(z_lt))]`` (fp64, exact past 2^24 tokens),
    ``prob_sum[e] = sum_l sum_t w_t softmax(z_lt)_e`` (differentiable, the logits' dtype, at least
    fp32) and ``tokens = L * sum_t w_t`` (fp64). Sums over disjoint token sets add up.
    ``chosen``: [N, k] per layer, the experts the router was made to choose (routing replay), which
    ``routed`` then counts instead of the softmax's own top-k.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one layer")
    _check_weight(router_logits, weight)
    num_experts = router_logits[0].shape[-1]
    dtype = torch.promote_types(router_logits[0].dtype, torch.float32)
    device = router_logits[0].device
    w = weight.to(device=device, dtype=torch.float64)
    routed = torch.zeros(num_experts, dtype=torch.float64, device=device)
    prob_sum = torch.zeros(num_experts, dtype=dtype, device=device)
    for layer, logits in enumerate(router_logits):
        probs = torch.softmax(logits.to(dtype), dim=-1)
        picked = torch.topk(probs, top_k, dim=-1).indices if chosen is None else chosen[layer].to(device)
        routed = routed.scatter_add(0, picked.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * w.to(dtype)[:, None]).sum(0)
    return routed, prob_sum, w.sum() * len(router_logits)


def aux_loss_from_sums(routed: Tensor, prob_sum: Tensor, tokens: Tensor) -> Tensor:
    """``E * sum_e (routed_e / tokens) * (prob_sum_e / tokens)``, in ``prob_sum``'s dtype."""
    num_experts = routed.shape[-1]
    return (num_experts * ((routed / tokens) * (prob_sum / tokens)).sum()).to(prob_sum.dtype)


def load_balancing_loss(
    router_logits: Sequence[Tensor], weight: Tensor, top_k: int, chosen: Sequence[Tensor] | None = None
) -> Tensor:
    """Switch Transformer load-balancing loss over all MoE layers, each token weighted by ``weight``.

    Fedus et al. 2022, "Switch Transformers", eqs. 4-6, in the form of transformers 5.23's
    ``load_balancing_loss_func`` (qwen3_next) on a padded batch, with the attention mask replaced
    by a weight per recorded token (``forest.token_multiplicity`` on a forest, the flat mask on a
    padded batch)::

        f_e = sum_l sum_t w_t [e in topk(softmax(z_lt))] / (L sum_t w_t)
        P_e = sum_l sum_t w_t softmax(z_lt)_e          / (L sum_t w_t)
        loss = E * sum_e f_e P_e

    ``router_logits``: [N, E] per layer. The top-k is recomputed from the softmax, as the stock
    function does, unless ``chosen`` gives the replayed choice (:func:`routing_sums`). Counts and
    totals are accumulated in fp64 so they stay exact past 2^24 flat tokens; the result has the
    logits' dtype (at least fp32) and backpropagates through P only.
    """
    return aux_loss_from_sums(*routing_sums(router_logits, weight, top_k, chosen))


def expert_counts(indices: Sequence[Tensor], weight: Tensor, num_experts: int) -> Tensor:
    """[L, E] int64: flat tokens each layer sent to each expert (top-k assignments).

    ``indices``: [N, k] chosen experts per layer; ``weight`` [N]: integer multiplicity of each
    recorded token (a padded batch's attention mask gives 0 to padding). Exact integers.
    """
    if not indices:
        raise ValueError("expert_counts needs the chosen experts of at least one layer")
    _check_weight(indices, weight)
    if weight.dtype.is_floating_point and not bool((weight == weight.round()).all()):
        raise ValueError("expert_counts needs integer weights (token multiplicities or a 0/1 mask)")
    device = indices[0].device
    w = weight.to(device=device, dtype=torch.long)
    out = torch.zeros(len(indices), num_experts, dtype=torch.long, device=device)
    for layer, idx in enumerate(indices):
        out[layer].scatter_add_(0, idx.reshape(-1), w.repeat_interleave(idx.shape[-1]))
    return out


def bias_update(counts: Tensor, speed: float = 1e-3) -> Tensor:
    """[L, E] change of each router's score-correction bias for one step (not applied here).

    DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI 2024, arXiv 2412.19437, sec. 2.1.2):
    after each step, an expert that received more tokens than its layer's mean has its bias
    lowered by ``speed`` and one that received fewer has it raised::

        bias[l, e] += speed * sign(mean_e' counts[l, e'] - counts[l, e])

    ``counts`` must be the step's counts over all micro-batches and ranks (sum the
    :func:`expert_counts` of each, all-reduce across ranks) so that every rank applies the same
    update. The paper uses ``speed`` = 0.001 for most of training. Bias-balanced routers choose
    experts by ``sigmoid(logits) + bias`` but weight them by the sigmoid alone, so the bias steers
    load without entering the gradient.
    """
    counts = counts.to(torch.float64)
    return (speed * torch.sign(counts.mean(-1, keepdim=True) - counts)).to(torch.float32)


@dataclass(frozen=True)
class MoEConfig:
    """MoE terms of a step (see ``rollout_step``).

    ``aux_loss_coef``: weight of :func:`load_balancing_loss` in the loss. None takes the model
    config's ``router_aux_loss_coef`` for families trained with it (softmax routing, e.g.
    qwen3_next) and 0 for bias-balanced ones; a positive value for a bias-balanced family is
    refused.
    """

    aux_loss_coef: float | None = None

    def __post_init__(self):
        if self.aux_loss_coef is not None and not self.aux_loss_coef >= 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {self.aux_loss_coef}")


@dataclass(frozen=True)
class MoEStats:
    """Routing statistics of one forest (or padded batch), equal to the flat batch's.

    - ``layers``: decoder layer index of each MoE layer, (L,).
    - ``expert_counts`` [L, E] int64: flat tokens routed to each expert (top-k assignments).
    - ``tokens``: 0-dim int64, flat tokens seen by each MoE layer (sum of the weights).
    - ``aux_loss``: 0-dim :func:`load_balancing_loss` for families trained with it, else None
      (differentiable from :func:`harts.moe_stats`, detached in a step's result).
    """

    layers: tuple[int, ...]
    expert_counts: Tensor
    tokens: Tensor
    aux_loss: Tensor | None
