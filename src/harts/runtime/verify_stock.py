"""The stock side of ``RunConfig(verify=True)`` (:mod:`harts.runtime.verify`): the sample's
fixed random loss, the stock forward (and backward) of each sampled trajectory alone, with its
images where it has some, on the model or on a copy of it one precision up (the truth), and the
gradients they leave, by name, with the model's own set aside while they run."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from harts.runtime.routing_replay import replayed_routing
from harts.runtime.verify_images import SampleImages, stock_kwargs, trainable
from harts.runtime.verify_sharded import local_grad

__all__ = ["RowLoss", "stock_rows_of_sample", "set_aside", "grads_by_name", "truth_model", "trainable"]

Tensor = torch.Tensor


class RowLoss:
    """``sum_r a_r * first_r + b_r * second_r``: a fixed random loss of the rows; with
    ``separable`` a sum of per-row terms (``subset`` and ``separable_rows``), as the call's is."""

    def __init__(self, a: Tensor, b: Tensor, separable: bool):
        self.a, self.b = a, b
        if separable:
            self.separable_rows = True
            self.subset = lambda index: RowLoss(a[index], b[index], True)

    def __call__(self, first: Tensor, second: Tensor) -> Tensor:
        a, b = self.a.to(first.device, first.dtype), self.b.to(second.device, second.dtype)
        return (a * first).sum() + (b * second).sum()


def _stock_rows(
    model: nn.Module,
    ids: Tensor,
    values: bool,
    temperature: float,
    autocast: bool = True,
    images: SampleImages | None = None,
) -> tuple[Tensor, Tensor]:
    """The stock forward of one trajectory (with its ``images``): (value, entropy) of each position
    ``p >= 1`` read at ``p - 1`` (log-prob of token ``p`` and the entropy; or the critic's value
    and zeros)."""
    # a text view: its whole model's forward, with the trajectory's images
    target = model.multimodal if getattr(model, "vision_language", None) is not None else model
    kwargs = stock_kwargs(model, ids, images)
    if "forward" in target.__dict__ and not autocast:
        # a wrapper's forward on the instance (accelerate's) may enter autocast itself: the truth
        # runs the class's own forward, at the precision asked for
        out = type(target).forward(target, **kwargs)
    else:
        out = target(**kwargs)
    logits = out if isinstance(out, Tensor) else out.logits
    if values:
        value = logits[0, :-1, 0].float()
        return value, torch.zeros_like(value)
    logp = torch.log_softmax(logits[0, :-1].float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, ids[1:, None])[:, 0], entropy


trainable = trainable


@contextlib.contextmanager
def set_aside(params: list[nn.Parameter]):
    """The gradients ``params`` hold, set aside while the block runs (``.grad`` None) and put back
    after it, whatever the block left there: the check never changes what the call accumulates."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, before in zip(params, held, strict=True):
            p.grad = before


def grads_by_name(named: list[tuple[str, nn.Parameter]]) -> dict[str, Tensor]:
    """Each parameter's gradient by name, fp64 on the CPU (zeros where none)."""
    zero = torch.zeros((), dtype=torch.float64)
    return {  # a sharded parameter: this rank's shard
        n: local_grad(p.grad.detach()).double().cpu()
        if p.grad is not None
        else zero.expand(local_grad(p).shape)
        for n, p in named
    }


def stock_rows_of_sample(
    model: nn.Module,
    trajectories: list[Tensor],
    loss: RowLoss | None,
    values: bool,
    temperature: float,
    autocast: bool,
    routes: list[Tensor] | None = None,
    images: list[SampleImages] | None = None,
) -> tuple[Tensor, dict[str, Tensor] | None]:
    """Stock row values of the sample (fp64, concatenated) and, with ``loss``, the gradients of
    its loss summed over the trajectories (fp64 by name); ``routes``: each trajectory's recorded
    MoE routes, replayed in its forward; ``images``: each trajectory's images."""
    device = next(model.parameters()).device
    named = trainable(model)
    out, offset, grads = [], 0, None
    grad_mode = torch.enable_grad() if loss is not None else torch.no_grad()
    cast = contextlib.nullcontext() if autocast else torch.autocast(device.type, enabled=False)
    with set_aside([p for _, p in named]), grad_mode, cast:
        for i, ids in enumerate(trajectories):
            ids = ids.to(device)
            replay = contextlib.nullcontext() if routes is None else replayed_routing(model, routes[i])
            with replay:
                own = images[i] if images is not None else None
                first, second = _stock_rows(model, ids, values, temperature, autocast, own)
            rows = first.numel()
            if loss is not None:
                RowLoss(loss.a[offset : offset + rows], loss.b[offset : offset + rows], False)(
                    first, second
                ).backward()
            out.append(first.detach().double().cpu())
            offset += rows
        if loss is not None:
            grads = grads_by_name(named)
    return torch.cat(out), grads


def truth_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` in ``dtype`` (eager MoE experts where the kernel has no fp64 path)."""
    truth = copy.deepcopy(model)
    whole = getattr(truth, "multimodal", truth)  # a text view's whole model, its vision tower too
    for module in [*truth.modules(), *whole.modules()]:
        # a wrapper may have replaced ``forward`` on the instance (accelerate's output casting): the
        # copy keeps a function bound to the original model, which would run instead of the copy
        module.__dict__.pop("forward", None)
    if dtype == torch.float64:  # the outermost transformers model (a ValueHead wraps one)
        owner = next((m for m in whole.modules() if hasattr(m, "set_experts_implementation")), None)
        if owner is not None:
            try:
                owner.set_experts_implementation("eager")
            except (ValueError, AttributeError):  # a model without experts
                pass
    whole.to(dtype)
    return truth.to(dtype)
