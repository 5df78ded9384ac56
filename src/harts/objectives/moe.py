"""MoE routing statistics on a forest, equal to those of the flat batch.

In a forest the router of every MoE layer runs once per unique token, but a unique token stands
for ``multiplicity`` flat tokens: one per trajectory through it. Every load-balancing statistic is
a sum over flat tokens, so weighting each unique token by its multiplicity gives the flat batch's
value exactly (design.md section 5, "MoE"). The same functions serve a stock padded batch with
its attention mask as the weight, which is how the tests compare the two.

- :class:`RouterRecorder`: a context manager with forward hooks on the model's routers; it keeps
  each layer's router logits [N, E] (in the autograd graph) and chosen experts [N, k].
- :func:`load_balancing_loss`: the Switch Transformer auxiliary loss, exactly as transformers'
  ``load_balancing_loss_func`` computes it over a padded batch (qwen3_next, softmax routing).
- :func:`expert_counts`: per-layer per-expert token counts of the step, integers, for the
  aux-loss-free bias balancing of bailing_hybrid and kimi_linear; :func:`bias_update` is the
  DeepSeek-V3 rule they feed (not applied here: that is the trainer's job).
- :class:`MoEConfig` and :class:`MoEStats`: what ``rollout_step(moe=...)`` takes and returns.

Shapes: N tokens recorded (unique tokens of a forest, or B*T of a padded batch), E experts,
k experts per token, L MoE layers.

What this leaves out: splitting the aux loss over micro-batches. It is a product of two means
over the whole step; a micro-batch's share is exact only with the step's global expert counts,
which a second pass would have to supply. Here the aux loss is the loss of one forest.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from harts.forest import Forest

__all__ = [
    "ROUTER_CLASSES", "AUX_LOSS_FAMILIES", "BIAS_BALANCED_FAMILIES", "find_routers", "RouterRecorder",
    "load_balancing_loss", "expert_counts", "bias_update", "MoEConfig", "MoEStats", "moe_stats",
]  # fmt: skip

Tensor = torch.Tensor

# model_type -> class name of its router; each returns (router_logits [N, E], weights [N, k], indices [N, k]).
ROUTER_CLASSES = {
    "bailing_hybrid": "BailingHybridTopkRouter",
    "kimi_linear": "KimiLinearTopkRouter",
    "qwen3_next": "Qwen3NextTopKRouter",
}
# Softmax routing trained with the Switch load-balancing loss (the stock ForCausalLM adds it).
AUX_LOSS_FAMILIES = ("qwen3_next",)
# Sigmoid routing with a score-correction bias and no aux loss (DeepSeek-V3's aux-loss-free balancing).
BIAS_BALANCED_FAMILIES = ("bailing_hybrid", "kimi_linear")

_LAYER = re.compile(r"layers\.(\d+)\.")


def find_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(decoder layer index, router module)`` of every MoE layer the forward runs, in layer order.

    Raises ValueError for a family without known routers, or a model without MoE layers. Routers
    of layers past ``num_hidden_layers`` (multi-token-prediction heads) are left out, since
    ``harts.forward`` does not run them.
    """
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in ROUTER_CLASSES:
        raise ValueError(
            f"MoE statistics need a model with known routers ({', '.join(ROUTER_CLASSES)}), got {family!r}"
        )
    wanted = ROUTER_CLASSES[family]
    num_layers = model.config.num_hidden_layers
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ != wanted:
            continue
        match = _LAYER.search(name)
        if match is None:
            raise ValueError(f"router {name!r} is not inside a numbered decoder layer")
        if int(match.group(1)) < num_layers:
            routers.append((int(match.group(1)), module))
    if not routers:
        raise ValueError(f"this {family} model has no MoE layer (no {wanted} module)")
    return sorted(routers, key=lambda r: r[0])


class RouterRecorder:
    """Forward hooks on a model's routers that keep their outputs while the context is open.

    ::

        with RouterRecorder(model) as rec:
            out = harts.forward(model, forest)
        stats = moe_stats(rec, forest)

    ``rec.logits[l]`` [N, E] stays in the autograd graph (the aux loss backpropagates through it
    into the router weights and everything below); ``rec.indices[l]`` [N, k] are the experts the
    router chose, after any bias and group limits. If a layer's router runs several times inside
    the context, its calls are concatenated in call order.
    """

    def __init__(self, model: nn.Module):
        self.family: str = model.config.model_type
        self._routers = find_routers(model)
        self.layers: tuple[int, ...] = tuple(layer for layer, _ in self._routers)
        self.top_k: int = int(self._routers[0][1].top_k)
        self.num_experts: int = int(self._routers[0][1].weight.shape[0])
        self._calls: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self._routers]
        self._handles: list = []

    def _hook(self, slot: int):
        def keep(module, args, output):
            logits, _, indices = output
            self._calls[slot].append((logits, indices.detach()))

        return keep

    def __enter__(self) -> RouterRecorder:
        if self._handles:
            raise RuntimeError("RouterRecorder is already recording")
        self.clear()
        self._handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self._routers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def clear(self) -> None:
        self._calls = [[] for _ in self._routers]

    def _joined(self, part: int) -> list[Tensor]:
        if any(not calls for calls in self._calls):
            raise RuntimeError("no router output recorded: run the forward inside `with RouterRecorder(...)`")
        return [torch.cat([c[part] for c in calls]) for calls in self._calls]

    @property
    def logits(self) -> list[Tensor]:
        """[N, E] router logits per MoE layer (differentiable)."""
        return self._joined(0)

    @property
    def indices(self) -> list[Tensor]:
        """[N, k] chosen experts per MoE layer."""
        return self._joined(1)


def _check_weight(rows: Sequence[Tensor], weight: Tensor) -> None:
    if weight.dim() != 1:
        raise ValueError(f"weight must be [N], got shape {tuple(weight.shape)}")
    for layer, t in enumerate(rows):
        if t.shape[0] != weight.shape[0]:
            raise ValueError(
                f"MoE layer {layer} recorded {t.shape[0]} tokens but weight has {weight.shape[0]}: record "
                f"exactly one forward of the forest (or batch) the weight belongs to"
            )


def load_balancing_loss(router_logits: Sequence[Tensor], weight: Tensor, top_k: int) -> Tensor:
    """Switch Transformer load-balancing loss over all MoE layers, each token weighted by ``weight``.

    Fedus et al. 2022, "Switch Transformers", eqs. 4-6, in the form of transformers 5.23's
    ``load_balancing_loss_func`` (qwen3_next) on a padded batch, with the attention mask replaced
    by a weight per recorded token (``forest.token_multiplicity`` on a forest, the flat mask on a
    padded batch)::

        f_e = sum_l sum_t w_t [e in topk(softmax(z_lt))] / (L sum_t w_t)
        P_e = sum_l sum_t w_t softmax(z_lt)_e          / (L sum_t w_t)
        loss = E * sum_e f_e P_e

    ``router_logits``: [N, E] per layer. The top-k is recomputed from the softmax, as the stock
    function does. Counts and totals are accumulated in fp64 so they stay exact past 2^24 flat
    tokens; the result has the logits' dtype (at least fp32) and backpropagates through P only.
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
    for logits in router_logits:
        probs = torch.softmax(logits.to(dtype), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        routed = routed.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * w.to(dtype)[:, None]).sum(0)
    total = w.sum() * len(router_logits)
    return (num_experts * ((routed / total) * (prob_sum / total)).sum()).to(dtype)


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
    config's ``router_aux_loss_coef`` for families trained with it (``AUX_LOSS_FAMILIES``) and 0
    for bias-balanced ones; a positive value for a bias-balanced family is refused.
    """

    aux_loss_coef: float | None = None

    def resolve(self, model: nn.Module) -> float:
        """The aux-loss coefficient for ``model``; raises ValueError before any compute."""
        find_routers(model)
        family = model.config.model_type
        coef = self.aux_loss_coef
        if coef is None:
            if family not in AUX_LOSS_FAMILIES:
                return 0.0
            return float(getattr(model.config, "router_aux_loss_coef", 0.0))
        if not coef >= 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {coef}")
        if coef > 0 and family not in AUX_LOSS_FAMILIES:
            raise ValueError(
                f"{family} balances experts by router bias, not an auxiliary loss: use expert_counts and "
                f"bias_update instead of aux_loss_coef={coef}"
            )
        return float(coef)


@dataclass(frozen=True)
class MoEStats:
    """Routing statistics of one forest (or padded batch), equal to the flat batch's.

    - ``layers``: decoder layer index of each MoE layer, (L,).
    - ``expert_counts`` [L, E] int64: flat tokens routed to each expert (top-k assignments).
    - ``tokens``: 0-dim int64, flat tokens seen by each MoE layer (sum of the weights).
    - ``aux_loss``: 0-dim, differentiable :func:`load_balancing_loss` for ``AUX_LOSS_FAMILIES``,
      else None.
    """

    layers: tuple[int, ...]
    expert_counts: Tensor
    tokens: Tensor
    aux_loss: Tensor | None


def moe_stats(recorder: RouterRecorder, weight: Forest | Tensor) -> MoEStats:
    """Statistics of what ``recorder`` saw; ``weight`` is the forest it ran (its token multiplicity
    is used) or a [N] integer weight per recorded token (a padded batch's flattened attention mask)."""
    if isinstance(weight, Forest):
        weight = weight.token_multiplicity
    indices = recorder.indices
    counts = expert_counts(indices, weight, recorder.num_experts)
    aux = None
    if recorder.family in AUX_LOSS_FAMILIES:
        aux = load_balancing_loss(recorder.logits, weight, recorder.top_k)
    return MoEStats(recorder.layers, counts, weight.to(torch.long).sum(), aux)
