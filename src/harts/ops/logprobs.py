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
of [chunk, vocab] logits in forward and backward. The target logits are read from the same chunks'
logits, once per distinct (predictor, target) pair, as a stock ``log_softmax(...).gather`` reads
them; their gradients join the chunk's logit gradients in backward (one entry each), so the head's
weight gradient is the chunks' products alone: no gathered [pairs, D] rows of the weight, and no
[vocab, D] buffer for a scatter of their gradients.
``plain_token_logprobs`` is the reference: full logits and autograd.

A head that is not a plain linear layer (LoRA on the head, a forward hook, a quantised or wrapped
module) is called as a module: :func:`head_token_logprobs` runs it on one chunk of predictors at a
time under activation checkpointing (non-reentrant), so it too keeps no [U, vocab] logits; the
head runs again in backward, as it would under activation checkpointing in stock training.

A sampling temperature T divides the logits: every function here returns the log-probs and
entropies of ``softmax(logits / T)``, as an inference engine that sampled at T computes them.

Final logit soft-capping (Gemma: ``final_logit_softcapping`` = c) maps the head's logits through
``c * tanh(logits / c)`` before anything reads them. With ``softcap=c`` every function here applies
it to each chunk's logits in the stock order (head, divide by c, tanh, multiply by c, in the head's
output dtype), then the temperature, as a stock user's ``model(...).logits / T`` has them; the
chunked backward chains d/d logits back through the same maps (``1 - tanh^2``). A plain head's
temperature is then applied to the capped logits, not folded into the weight (the cap is not
linear).

Shapes: hidden [U, D], weight [V, D], bias [V] or None, predictor [R] (index into U), target [R].
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from harts.ops.precision import autocast_dtype, autocast_state, no_autocast, restored_autocast

__all__ = [
    "token_logprobs",
    "head_token_logprobs",
    "plain_token_logprobs",
    "softcap_logits",
    "DEFAULT_CHUNK_ROWS",
]

DEFAULT_CHUNK_ROWS = 1024


def _acc(t: torch.Tensor) -> torch.dtype:
    """Softmax maths in fp32, or fp64 for fp64 weights."""
    return torch.promote_types(t.dtype, torch.float32)


def softcap_logits(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in the stock forward's order of ops and in the logits'
    dtype (``logits`` unchanged for None)."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def _head_output(h, weight, bias):
    """The logits a stock head (``nn.Linear``) returns: in fp32 (fp64 for fp64 weights), or under
    autocast in its dtype ``low``: inputs, weight and bias rounded to ``low``, sums in fp32, rounded
    once."""
    low = autocast_dtype(h.device, h, weight)
    if low is not None:
        with no_autocast(h.device):
            logits = h.to(low).float() @ weight.to(low).float().t()
            if bias is not None:
                logits = logits + bias.to(low).float()
            return logits.to(low)
    logits = (h @ weight.t()).to(_acc(weight))
    return logits + bias.to(logits.dtype) if bias is not None else logits


def _logits(h, weight, bias, softcap=None, temperature=1.0, raw=None):
    """A chunk's logits for the softmax, widened to fp32 (fp64): the head's output (``raw``, when
    already formed), soft-capped in its dtype when ``softcap``, then divided by ``temperature``
    (which a plain head without a cap folds into its weight instead, so it is 1 here)."""
    raw = _head_output(h, weight, bias) if raw is None else raw
    logits = softcap_logits(raw, softcap).to(_acc(weight))
    return logits / temperature if temperature != 1.0 else logits


def _capped_grad(grad, raw, softcap, temperature):
    """d loss / d head output ``raw`` from d loss / d its capped, tempered logits: the stock autograd
    chain of ``tanh(raw / c) * c / T`` (divide by T, times c, times 1 - tanh^2, divide by c)."""
    if temperature != 1.0:
        grad = grad / temperature
    t = torch.tanh(raw / softcap).to(grad.dtype)  # in the head's dtype, as the forward had it
    return grad * softcap * (1 - t * t) / softcap


class _LseEntropy(torch.autograd.Function):
    """(lse [U], entropy [U], target logits [P]) of the logits ``hidden @ weight.T + bias`` in row
    chunks; the target logits are those at the P distinct pairs (``pair_pred``, ``pair_target``),
    sorted by predictor, read from the chunks' logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, chunk, softcap, temperature, pair_pred, pair_target):
        u = hidden.shape[0]
        lse = torch.empty(u, dtype=_acc(weight), device=hidden.device)
        entropy = torch.empty(u, dtype=_acc(weight), device=hidden.device)
        target_logit = torch.empty(pair_pred.shape, dtype=_acc(weight), device=hidden.device)
        # each chunk's pairs: a contiguous run, as the pairs are sorted by predictor
        edges = torch.searchsorted(pair_pred, torch.arange(0, u + chunk, chunk, device=pair_pred.device))
        edges = edges.tolist()
        for i, s in enumerate(range(0, u, chunk)):
            logits = _logits(hidden[s : s + chunk], weight, bias, softcap, temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            logp = logits - chunk_lse[:, None]
            lse[s : s + chunk] = chunk_lse
            entropy[s : s + chunk] = -(logp.exp() * logp).sum(-1)
            a, b = edges[i], edges[i + 1]
            target_logit[a:b] = logits[pair_pred[a:b] - s, pair_target[a:b]]
        ctx.save_for_backward(hidden, weight, bias, entropy, pair_pred, pair_target)
        ctx.chunk, ctx.autocast, ctx.edges = chunk, autocast_state(hidden.device), edges
        ctx.softcap, ctx.temperature = softcap, temperature
        ctx.set_materialize_grads(False)  # an output no loss reads gets None: its term is skipped
        return lse, entropy, target_logit

    @staticmethod
    def backward(ctx, grad_lse, grad_entropy, grad_target):
        with restored_autocast(ctx.autocast):  # the chunks' logits as the forward formed them
            return _LseEntropy._backward(ctx, grad_lse, grad_entropy, grad_target)

    @staticmethod
    def _backward(ctx, grad_lse, grad_entropy, grad_target):
        hidden, weight, bias, entropy, pair_pred, pair_target = ctx.saved_tensors
        chunk, softcap, temperature, edges = ctx.chunk, ctx.softcap, ctx.temperature, ctx.edges
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        acc = _acc(weight)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for i, s in enumerate(range(0, hidden.shape[0], chunk)):
            h = hidden[s : s + chunk]
            raw = _head_output(h, weight, bias)
            logp = torch.log_softmax(_logits(h, weight, bias, softcap, temperature, raw), dim=-1)
            p = logp.exp()
            # d lse / d logits = p, d entropy / d logits = -p (log p + entropy); a None gradient
            # (an output no loss reads) contributes nothing and is not formed.
            inner = None if grad_lse is None else grad_lse[s : s + chunk, None].to(acc)
            if grad_entropy is not None:
                ge = grad_entropy[s : s + chunk, None].to(acc) * (logp + entropy[s : s + chunk, None])
                inner = -ge if inner is None else inner - ge
            grad_logits = p * inner if inner is not None else torch.zeros_like(p)
            a, b = edges[i], edges[i + 1]
            if grad_target is not None and b > a:  # d target logit / d its logit = 1; pairs distinct
                grad_logits[pair_pred[a:b] - s, pair_target[a:b]] += grad_target[a:b].to(acc)
            if softcap is not None:
                grad_logits = _capped_grad(grad_logits, raw, softcap, temperature)
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
            None,
            None,
            None,
            None,
        )


def _check(hidden, predictor, target, chunk_rows: int = 1):
    if hidden.dim() != 2:
        raise ValueError(f"expected hidden [U, D], got shape {tuple(hidden.shape)}")
    if predictor.shape != target.shape or predictor.dim() != 1:
        raise ValueError(
            f"expected predictor [R] and target [R], got {tuple(predictor.shape)} and {tuple(target.shape)}"
        )
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float, refused unless positive and finite."""
    t = float(temperature)
    if not t > 0 or t == float("inf"):
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    return t


def _check_softcap(softcap: float | None) -> float | None:
    if softcap is None:
        return None
    c = float(softcap)
    if not c > 0 or c == float("inf"):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap}")
    return c


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    predictor: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logprob [R], entropy [R]) in fp32 (fp64 for fp64 weights), differentiable in all inputs.

    ``softcap`` c: of the logits ``c * tanh((h . W + b) / c)`` (then divided by ``temperature``)."""
    _check(hidden, predictor, target, chunk_rows)
    temperature, softcap = check_temperature(temperature), _check_softcap(softcap)
    if softcap is None and temperature != 1.0:
        # logits / T == h . (W / T) + b / T: the same chunked path on a scaled head
        weight = weight / temperature
        bias = bias / temperature if bias is not None else None
        temperature = 1.0
    predictor, target = predictor.long(), target.long()
    # Rows of a shared token repeat one (predictor, target) pair once per trajectory through it:
    # each distinct pair's target logit is read once (sorted by predictor, as unique returns them).
    pairs, row_pair = torch.unique(predictor * weight.shape[0] + target, return_inverse=True)
    pair_pred, pair_target = pairs // weight.shape[0], pairs % weight.shape[0]
    lse, entropy, target_logit = _LseEntropy.apply(
        hidden, weight, bias, chunk_rows, softcap, temperature, pair_pred, pair_target
    )
    return (target_logit - lse[pair_pred])[row_pair], entropy[predictor]


def _head_chunk(head, h, predictor, target, temperature, softcap=None):
    """(logprob of each row, entropy of each predictor) of one chunk: [r], [u]."""
    logits = softcap_logits(head(h[None])[0], softcap)  # the head sees [1, n, D], as in the stock forward
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp[predictor, target], entropy


def head_token_logprobs(
    hidden: torch.Tensor,
    head,
    predictor: torch.Tensor,
    target: torch.Tensor,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [R], entropy [R]) through ``head`` called as a module, ``chunk_rows`` predictors at a
    time; ``softcap``: the head's output soft-capped first."""
    _check(hidden, predictor, target, chunk_rows)
    temperature, softcap = check_temperature(temperature), _check_softcap(softcap)
    predictor, target = predictor.long(), target.long()
    if hidden.shape[0] == 0:
        empty = torch.empty(0, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        return empty, empty
    order = torch.argsort(predictor, stable=True)
    bounds = torch.searchsorted(
        predictor[order], torch.arange(0, hidden.shape[0] + chunk_rows, chunk_rows, device=predictor.device)
    ).tolist()
    row_parts, entropies = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in _params(head)))
    for c, s in enumerate(range(0, hidden.shape[0], chunk_rows)):
        rows = order[bounds[c] : bounds[c + 1]]
        args = (head, hidden[s : s + chunk_rows], predictor[rows] - s, target[rows], temperature, softcap)
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args)
        row_parts.append(lp)
        entropies.append(ent)
    logprob = torch.empty(predictor.numel(), dtype=entropies[0].dtype, device=hidden.device)
    logprob = logprob.index_put((order,), torch.cat(row_parts)) if predictor.numel() else logprob
    return logprob, torch.cat(entropies)[predictor]


def _params(module):
    return module.parameters() if hasattr(module, "parameters") else ()


def plain_token_logprobs(
    hidden, weight, predictor, target, bias=None, temperature: float = 1.0, softcap: float | None = None
):
    """Reference for :func:`token_logprobs`: full logits, plain autograd."""
    _check(hidden, predictor, target)
    logp = torch.log_softmax(_logits(hidden, weight, bias, softcap) / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp[predictor.long(), target.long()], entropy[predictor.long()]
