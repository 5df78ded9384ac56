"""Per-trajectory references: the stock Hugging Face forward of each trajectory alone.

These are what harts must reproduce. They are deliberately plain: one stock ``model(input_ids)``
call per trajectory, no packing (stock packing leaks linear-attention state between sequences),
no cache.

Gradients are compared against the stock forward run in fp64. The stock linear-attention
fallbacks cast to fp32 inside, and their chunked fp32 gradients of the decay parameters
(``A_log``, ``dt_bias``) are off from the exact value by up to ~6e-4 relative on tiny models
(measured), more than the tolerance; so for the fp64 reference those two kernel functions are
swapped, in the stock modeling module, for the plain fp64 recurrence of
``harts.ops.delta_rule_naive``. Everything else (projections, conv, gates, norms, MoE, attention)
is the stock code.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from harts.ops.delta_rule_naive import naive_recurrent_gated_delta_rule

LOGIT_ATOL = 1e-4  # design.md section 4: fp32 max |logit diff|
GRAD_RTOL = 1e-4  # design.md section 4: fp32 gradient relative error
GRAD_FLOOR = 1e-6  # norms below this are compared absolutely (see grad_relative_errors)


def stock_logits(model, trajectory) -> torch.Tensor:
    """[len, vocab] logits of one trajectory from the stock forward."""
    ids = torch.as_tensor(list(trajectory), dtype=torch.long)[None]
    return model(input_ids=ids).logits[0]


def _exact_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **kwargs,
):
    """fp64 stand-in with the signature of the stock chunked KDA / GDN fallbacks."""
    query, key, value, g, beta = (t.double() for t in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query = query / torch.sqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key / torch.sqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    heads = value.shape[2]
    if query.shape[2] != heads:  # GDN grouped value heads
        query = query.repeat_interleave(heads // query.shape[2], dim=2)
        key = key.repeat_interleave(heads // key.shape[2], dim=2)
    if g.dim() == 3:  # GDN: one decay per head
        g = g[..., None].expand_as(key)
    out, state = naive_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state)
    return out, (state if output_final_state else None)


_KERNEL_NAMES = ("chunk_kimi_delta_attention", "torch_chunk_gated_delta_rule")


@contextlib.contextmanager
def exact_linear_kernels(model):
    module = sys.modules[type(model).__module__]
    saved = {name: getattr(module, name) for name in _KERNEL_NAMES if hasattr(module, name)}
    try:
        for name in saved:
            setattr(module, name, _exact_delta_rule)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


_FP64: dict[int, torch.nn.Module] = {}


def fp64_copy(model):
    """The same weights in an fp64 model of the same class (cached per model object)."""
    key = id(model)
    if key not in _FP64:
        config = model.config.__class__.from_dict(model.config.to_dict())
        from transformers import AutoModelForCausalLM

        copy = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager")
        copy.load_state_dict(model.state_dict())
        _FP64[key] = copy.eval()
    return _FP64[key]


def functional_weights(trajectories, vocab: int, seed: int = 1234) -> list[torch.Tensor]:
    """One fixed random [len_i, vocab] tensor per trajectory: the loss is sum_i <W_i, logits_i>."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(len(t), vocab, generator=gen) for t in trajectories]


def param_grads(model) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def reference_grads(model, trajectories, weights) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """fp64 logits per trajectory and fp64 gradients of sum_i <W_i, logits_i>, one stock forward each."""
    model64 = fp64_copy(model)
    model64.zero_grad(set_to_none=True)
    logits = []
    with exact_linear_kernels(model64):
        for traj, w in zip(trajectories, weights, strict=True):
            out = stock_logits(model64, traj)
            (out * w.double()).sum().backward()
            logits.append(out.detach())
    return logits, param_grads(model64)


def grad_relative_errors(got: dict, ref: dict) -> dict[str, float]:
    """||got - ref|| / max(||ref||, GRAD_FLOOR) per parameter."""
    errors = {}
    for name, r in ref.items():
        g = got[name].to(r.dtype)
        # A gradient that is exactly zero in exact arithmetic (a lone token's query, say) comes out
        # as ~1e-17 in fp64 and ~1e-10 in fp32; below a norm of 1e-6 the check is absolute.
        errors[name] = (g - r).norm().item() / max(r.norm().item(), GRAD_FLOOR)
    return errors
