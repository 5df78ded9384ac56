"""Log-probabilities and entropies of target tokens, with logits formed once per unique predictor.

In a forest one hidden state (a *predictor*) can predict several targets: a branch token predicts
a different next token in each child, and a shared token is a row of every trajectory through it.
The softmax normaliser and the entropy depend only on the predictor, so they are computed once per
unique predictor, in row chunks, without keeping logits:

    lse[u]     = logsumexp_v(h[u] . W[v] + b[v])
    entropy[u] = lse[u] - sum_v p[u, v] (h[u] . W[v] + b[v])
    logprob[r] = h[pred[r]] . W[target[r]] + b[target[r]] - lse[pred[r]]

The backward of (lse, entropy) recomputes each chunk's logits and uses
d lse / d logits = p and d entropy / d logits = -p (log p + entropy), so peak memory is one chunk
of [chunk, vocab] logits in forward and backward. The target logit is a plain gathered dot
product, differentiated by autograd, formed once per distinct (predictor, target) pair.
``plain_token_logprobs`` is the reference: full logits and autograd.

Shapes: hidden [U, D], weight [V, D], bias [V] or None, predictor [R] (index into U), target [R].
"""

from __future__ import annotations

import torch

__all__ = ["token_logprobs", "plain_token_logprobs", "DEFAULT_CHUNK_ROWS"]

DEFAULT_CHUNK_ROWS = 1024


def _acc(t: torch.Tensor) -> torch.dtype:
    """Softmax maths in fp32, or fp64 for fp64 weights."""
    return torch.promote_types(t.dtype, torch.float32)


def _logits(h, weight, bias):
    logits = (h @ weight.t()).to(_acc(weight))
    return logits + bias.to(logits.dtype) if bias is not None else logits


class _LseEntropy(torch.autograd.Function):
    """(lse [U], entropy [U]) of the logits ``hidden @ weight.T + bias`` in row chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, chunk):
        u = hidden.shape[0]
        lse = torch.empty(u, dtype=_acc(weight), device=hidden.device)
        entropy = torch.empty(u, dtype=_acc(weight), device=hidden.device)
        for s in range(0, u, chunk):
            logits = _logits(hidden[s : s + chunk], weight, bias)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            logp = logits - chunk_lse[:, None]
            lse[s : s + chunk] = chunk_lse
            entropy[s : s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, entropy)
        ctx.chunk = chunk
        return lse, entropy

    @staticmethod
    def backward(ctx, grad_lse, grad_entropy):
        hidden, weight, bias, entropy = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        acc = _acc(weight)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        if grad_lse is None:
            grad_lse = torch.zeros_like(entropy)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(entropy)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            logp = torch.log_softmax(_logits(h, weight, bias), dim=-1)
            p = logp.exp()
            gl = grad_lse[s : s + chunk, None].to(acc)
            ge = grad_entropy[s : s + chunk, None].to(acc)
            grad_logits = p * (gl - ge * (logp + entropy[s : s + chunk, None]))
            if need_h:
                grad_hidden[s : s + chunk] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_weight += grad_logits.t() @ h.to(acc)
            if need_b:
                grad_bias += grad_logits.sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_w else None,
            grad_bias.to(bias.dtype) if need_b else None,
            None,
        )


def _check(hidden, predictor, target):
    if hidden.dim() != 2:
        raise ValueError(f"expected hidden [U, D], got shape {tuple(hidden.shape)}")
    if predictor.shape != target.shape or predictor.dim() != 1:
        raise ValueError(
            f"expected predictor [R] and target [R], got {tuple(predictor.shape)} and {tuple(target.shape)}"
        )


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    predictor: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logprob [R], entropy [R]) in fp32 (fp64 for fp64 weights), differentiable in all inputs."""
    _check(hidden, predictor, target)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    predictor, target = predictor.long(), target.long()
    lse, entropy = _LseEntropy.apply(hidden, weight, bias, chunk_rows)
    # Rows of a shared token repeat one (predictor, target) pair once per trajectory through it:
    # form each distinct pair's target logit once, so memory is O(pairs x D), not O(rows x D).
    pairs, row_pair = torch.unique(predictor * weight.shape[0] + target, return_inverse=True)
    pair_pred, pair_target = pairs // weight.shape[0], pairs % weight.shape[0]
    target_logit = (hidden[pair_pred] * weight[pair_target]).sum(-1).to(lse.dtype)
    if bias is not None:
        target_logit = target_logit + bias[pair_target].to(lse.dtype)
    return (target_logit - lse[pair_pred])[row_pair], entropy[predictor]


def plain_token_logprobs(hidden, weight, predictor, target, bias=None):
    """Reference for :func:`token_logprobs`: full logits, plain autograd."""
    _check(hidden, predictor, target)
    logp = torch.log_softmax(_logits(hidden, weight, bias), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp[predictor.long(), target.long()], entropy[predictor.long()]
