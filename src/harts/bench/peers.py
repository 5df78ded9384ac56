"""Peer systems for ``harts bench``: PrefixGrouper and flash-pref on a one-prefix forest.

Both peers share one prompt among G completions of a full-attention model, so they run only on
a forest with a single root of at least two trajectories and depth 1 (the ``star`` shape) and only
on families whose every layer is full attention (qwen3, llama). Each peer step computes the same
objective as harts' (minus the sum of every trajectory's next-token log-probs), taking one
log-softmax over the logits' rows as the peer's users would, and runs backward.
Neither package is a harts dependency: they are imported here, lazily, and a missing or failing
peer becomes a reason string in the results.

- **PrefixGrouper** (``prefix-grouper`` 0.0.1): the prompt once, then the G suffixes, as one
  [1, P + sum S] sequence with path position ids; its attention function runs the prefix part
  and the suffix part separately. Its default kernel is ``flash_attention_2`` (CUDA); its masks
  are 2-D padding masks, which transformers' ``sdpa`` function would broadcast wrongly, so on
  the CPU we register a padded-causal SDPA function (bottom-right aligned causal mask and the
  padding mask) and pass it as ``prefix_grouper_attn_func``; the peer's own grouping code runs
  unchanged.
- **flash-pref** (``flash-pref`` 0.1.1, pins transformers < 4.52): a context manager that
  de-duplicates the prompt before layer 0 and restores it after the last layer. Only with
  ``flash_attention_2`` does it share attention too; with ``sdpa`` (the CPU case) it shares the
  MLP, norms and projections and runs attention on the re-expanded padded batch. Its layer
  wrapper expects decoder layers to return tuples (transformers 4.x); transformers 5 returns a
  tensor, so :func:`_tuple_layers` adapts the layers for the duration of the call.

Install to try: ``pip install prefix-grouper flash-pref torch==<installed>``; flash-pref's pin
pulls transformers 4.51 back, so reinstall ``transformers==5.23.*`` afterwards (or install it
with ``--no-deps``).

What this leaves out: the peers' trainer integrations (trl DPO/reward trainers), GPU kernels.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from harts.forest import Forest

__all__ = ["peer_steps", "PEERS"]

PEERS = ("prefix_grouper", "flash_pref")
_ATTN_NAME = "harts_bench_padded_causal_sdpa"


def _one_prefix(forest: Forest) -> int | None:
    """Prompt length P when ``forest`` is one prompt with >= 2 completions (depth 1), else None."""
    roots = int((forest.node_parent < 0).sum())
    if roots != 1 or forest.max_depth != 1 or forest.num_trajectories < 2:
        return None
    if bool((forest.trajectory_end_node == 0).any()):
        return None  # a trajectory that is the prompt alone has no suffix
    return int(forest.node_length[0])


def _full_attention_only(model: nn.Module) -> bool:
    types_ = getattr(model.config, "layer_types", None)
    return types_ is None or all(t == "full_attention" for t in types_)


def _logprob_sum(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None):
    """Sum of log p(targets[i] | logits[rows[i]]) (row i where ``rows`` is None): one log-softmax
    over the logits' rows, each once however many trajectories read it (a shared prompt's rows
    once, as a user of the peer would)."""
    logp = logits.float().log_softmax(-1)
    return (logp[rows, targets] if rows is not None else logp.gather(-1, targets[:, None])).sum()


# ---- PrefixGrouper -------------------------------------------------------------------------------
def _padded_causal_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """q [b, h, Lq, d], k/v [b, h_kv, Lk, d], mask [b, Lk] bool -> ([b, Lq, h, d], None).

    Query i sits at key index i + Lk - Lq (suffix queries follow the whole prompt).
    """
    lq, lk = query.shape[2], key.shape[2]
    pos_k = torch.arange(lk, device=query.device)
    pos_q = torch.arange(lq, device=query.device) + (lk - lq)
    mask = (pos_k[None, :] <= pos_q[:, None])[None, None] & attention_mask.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=getattr(module, "scaling", None), enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def _attn_implementation(model: nn.Module, name: str):
    old = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = old


def _prefix_grouper_step(model, trajectories, prompt_len) -> Callable[[], torch.Tensor]:
    from prefix_grouper import PrefixGrouper
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()
    AttentionInterface.register(_ATTN_NAME, _padded_causal_sdpa)
    device = next(model.parameters()).device
    p = prompt_len
    suffixes = [t[p:] for t in trajectories]
    ids = torch.tensor(trajectories[0][:p] + [x for s in suffixes for x in s], device=device)
    positions = torch.tensor(list(range(p)) + [p + i for s in suffixes for i in range(len(s))], device=device)
    index, start = [], p
    for s in suffixes:  # each trajectory's positions in the grouped sequence
        index.append(torch.cat([torch.arange(p), torch.arange(start, start + len(s))]).to(device))
        start += len(s)
    # every trajectory's (predicting row, target) pairs: the prompt's rows repeat once per trajectory
    rows, targets = torch.cat([i[:-1] for i in index]), torch.cat([ids[i[1:]] for i in index])
    grouper = PrefixGrouper([[p] + [len(s) for s in suffixes]], device=device)

    def step() -> torch.Tensor:
        with _attn_implementation(model, "prefix_grouper_attention"):
            logits = model(
                input_ids=ids[None],
                position_ids=positions[None],
                use_cache=False,
                prefix_grouper=grouper,
                prefix_grouper_attn_func=_ATTN_NAME,
            ).logits[0]
        loss = -_logprob_sum(logits, targets, rows)
        loss.backward()
        return loss.detach()

    return step


# ---- flash-pref ----------------------------------------------------------------------------------
@contextmanager
def _tuple_layers(model: nn.Module):
    """Decoder layers that return ``(hidden,)`` to flash-pref's wrapper and a tensor to the model."""
    layers = list(model.model.layers)
    hooks = []
    for layer in layers:
        cls_forward = type(layer).forward

        def as_tuple(self, *args, _forward=cls_forward, **kwargs):
            out = _forward(self, *args, **kwargs)
            return out if isinstance(out, tuple) else (out,)

        layer.forward = types.MethodType(as_tuple, layer)
        hooks.append(layer.register_forward_hook(lambda m, a, out: out[0] if isinstance(out, tuple) else out))
    try:
        yield
    finally:
        for layer, hook in zip(layers, hooks, strict=True):
            hook.remove()
            del layer.forward


def _flash_pref_step(model, trajectories) -> Callable[[], torch.Tensor]:
    from flash_pref import shared_prefix
    from torch.nn.utils.rnn import pad_sequence

    device = next(model.parameters()).device
    rows = [torch.tensor(t, device=device) for t in trajectories]
    ids = pad_sequence(rows, batch_first=True, padding_value=int(model.config.pad_token_id or 0))
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)

    width = ids.shape[1]
    # each row's predicting positions in the flattened [G * L] batch, and their targets
    flat_rows = torch.cat([b * width + torch.arange(len(r) - 1, device=device) for b, r in enumerate(rows)])
    targets = ids.view(-1)[flat_rows + 1]

    def step() -> torch.Tensor:
        share = shared_prefix(model, input_ids=ids, attention_mask=mask, group_size=len(rows))
        with _tuple_layers(model), share:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            loss = -_logprob_sum(logits.flatten(0, 1)[flat_rows], targets)  # no padded rows
            loss.backward()  # inside the context, as flash-pref's trainers do
        return loss.detach()

    return step


# ---- entry point ---------------------------------------------------------------------------------
def peer_steps(
    model: nn.Module, trajectories: list[list[int]], forest: Forest
) -> dict[str, Callable[[], torch.Tensor] | str]:
    """For each peer: a step callable (forward + backward, returns the loss) or the reason it cannot run."""
    if not _full_attention_only(model):
        reason = "full attention only (model has linear-attention layers)"
        return {name: reason for name in PEERS}
    prompt_len = _one_prefix(forest)
    if prompt_len is None:
        reason = f"one shared prompt + G completions only (forest depth {forest.max_depth})"
        return {name: reason for name in PEERS}
    out: dict[str, Callable[[], torch.Tensor] | str] = {}
    builders = {
        "prefix_grouper": lambda: _prefix_grouper_step(model, trajectories, prompt_len),
        "flash_pref": lambda: _flash_pref_step(model, trajectories),
    }
    for name, build in builders.items():
        try:
            out[name] = build()
        except ImportError as exc:
            out[name] = f"not installed ({exc.name or exc})"
        except Exception as exc:
            out[name] = f"cannot run: {type(exc).__name__}: {exc}"
    return out
