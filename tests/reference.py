"""Per-trajectory references: the stock Hugging Face forward of each trajectory alone.

These are what harts must reproduce. They are deliberately plain: one stock ``model(input_ids)``
call per trajectory, no packing (stock packing leaks linear-attention state between sequences),
no cache.

Gradients are compared against the stock forward run in fp64, and in fp64 throughout: the stock
code casts to fp32 in several places whatever the model's dtype (the linear-attention fallbacks,
RMSNorm and gated RMSNorm, the KDA forget gate, the MoE routers' logits and softmax). Decay
parameter gradients (``A_log``, ``dt_bias``) are sums with heavy cancellation, and those fp32
islands put the stock fp32 result up to ~6e-4 and a half-fp64 reference up to ~2e-4 relative off
the exact value on tiny models (measured), more than the tolerance. So, during the reference
run only, :func:`exact_linear_kernels` swaps the chunked kernels the family's adapter names
(``stock_delta_rule_kernels``) for the plain fp64 recurrence of ``harts.ops.delta_rule.naive``
and keeps fp64 tensors from being cast down to fp32 (``Tensor.float/.to/.type`` and
``softmax(dtype=float32)`` return fp64 for fp64 input).
Everything else is the stock code.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable

import torch

from harts.adapters import adapter_for_type
from harts.ops.delta_rule import naive_recurrent_gated_delta_rule
from harts.tiny import tiny_model

LOGIT_ATOL = 1e-4  # fp32 max |logit diff| (docs/architecture.md, "References and tolerances")
GRAD_RTOL = 1e-4  # fp32 gradient relative error (same section)
GRAD_FLOOR = 1e-6  # norms below this are compared absolutely (see grad_relative_errors)


@functools.cache
def cached_model(family: str, seed: int = 7) -> torch.nn.Module:
    """One tiny model per (family, seed) for the whole test session (tests zero its grads first)."""
    return tiny_model(family, seed=seed)


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


def _keep64(dtype, source_dtype):
    return torch.float64 if source_dtype == torch.float64 and dtype == torch.float32 else dtype


@contextlib.contextmanager
def _no_fp32_downcasts():
    """Inside: an fp64 tensor asked to become fp32 stays fp64, and an integer tensor's ``.float()``
    (rotary positions, masks) becomes fp64, so that it meets fp64 operands."""
    tensor, functional = torch.Tensor, torch.nn.functional
    saved = {"float": tensor.float, "to": tensor.to, "type": tensor.type, "softmax": functional.softmax}

    def float_(self, *args, **kwargs):
        if self.dtype == torch.float64:
            return self
        if not self.dtype.is_floating_point:  # integer positions and masks: fp64 like the rest
            return saved["to"](self, torch.float64)
        return saved["float"](self, *args, **kwargs)

    def to(self, *args, **kwargs):
        args = tuple(_keep64(a, self.dtype) if isinstance(a, torch.dtype) else a for a in args)
        if "dtype" in kwargs:
            kwargs["dtype"] = _keep64(kwargs["dtype"], self.dtype)
        return saved["to"](self, *args, **kwargs)

    def type_(self, dtype=None, *args, **kwargs):
        if dtype is None:
            return saved["type"](self)
        return saved["type"](self, _keep64(dtype, self.dtype), *args, **kwargs)

    def softmax(input, *args, dtype=None, **kwargs):
        return saved["softmax"](input, *args, dtype=_keep64(dtype, input.dtype), **kwargs)

    tensor.float, tensor.to, tensor.type, functional.softmax = float_, to, type_, softmax
    try:
        yield
    finally:
        tensor.float, tensor.to, tensor.type = saved["float"], saved["to"], saved["type"]
        functional.softmax = saved["softmax"]


@contextlib.contextmanager
def exact_linear_kernels(model):
    """The stock fp64 model computing in fp64 throughout (see the module docstring)."""
    module = sys.modules[type(model).__module__]
    names = adapter_for_type(model.config.model_type).stock_delta_rule_kernels
    saved = {name: getattr(module, name) for name in names}
    try:
        for name in saved:
            setattr(module, name, _exact_delta_rule)
        with _no_fp32_downcasts():
            yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


# id(model) -> (model, its fp64 copy): holding the model keeps its id from being reused
_FP64: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}


def fp64_copy(model, cache: bool = True):
    """The same weights in an fp64 model of the same class (cached per model object unless
    ``cache`` is False: a test that changes the copy must not share it)."""
    key = id(model)
    if not cache or key not in _FP64:
        config = model.config.__class__.from_dict(model.config.to_dict())
        adapter = adapter_for_type(config.model_type)
        copy = adapter.model_from_config(config, dtype=torch.float64, experts_implementation="eager")
        # some versions keep chosen modules (e.g. short convolutions) in fp32 whatever the dtype
        copy = copy.double()
        copy.load_state_dict(model.state_dict())
        if not cache:
            return copy.eval()
        _FP64[key] = (model, copy.eval())
    return _FP64[key][1]


def stock_logprobs(model, rollouts) -> list[torch.Tensor]:
    """Each trajectory alone through the stock forward in fp64: [L] log-probs, position 0 = 0."""
    model64 = fp64_copy(model, cache=False)
    out = []
    with torch.no_grad(), exact_linear_kernels(model64):
        for r in rollouts:
            ids = torch.as_tensor(r.tokens)
            logp = torch.log_softmax(stock_logits(model64, r.tokens)[:-1], -1).gather(1, ids[1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1, dtype=logp.dtype), logp]))
    return out


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


def reference_sft_grads(model, trajectories) -> tuple[float, dict[str, torch.Tensor]]:
    """fp64 SFT sum (minus every next-token log-prob) and its gradients, one stock forward each."""
    model64 = fp64_copy(model)
    model64.zero_grad(set_to_none=True)
    total = 0.0
    with exact_linear_kernels(model64):
        for traj in trajectories:
            if len(traj) < 2:
                continue
            ids = torch.as_tensor(list(traj), dtype=torch.long)
            logp = torch.log_softmax(stock_logits(model64, traj)[:-1], -1).gather(1, ids[1:, None])
            loss = -logp.sum()
            loss.backward()
            total += float(loss.detach())
    return total, param_grads(model64)


def stock_row_loss_grads(
    model, trajectories, loss_fn, exact: bool = True, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(logprob [R], entropy [R], gradients) of ``loss_fn(logprob, entropy)`` over the rows of
    ``next_token_rows`` (each trajectory's next-token predictions in turn), each trajectory through
    the stock forward alone, its rows those of ``softmax(logits / temperature)`` as a trainer takes
    them: in fp64 throughout (``exact``, the truth) or the literal fp32 stock model (what stock fp32
    training computes; the model's grads are overwritten)."""
    target_model = fp64_copy(model) if exact else model
    target_model.zero_grad(set_to_none=True)
    logprob, entropy, loss = _stock_row_loss(target_model, trajectories, loss_fn, exact, temperature)
    loss.backward()
    return logprob.detach(), entropy.detach(), param_grads(target_model)


def _stock_row_loss(model, trajectories, loss_fn, exact: bool, temperature: float = 1.0):
    """(logprob [R], entropy [R], loss) of ``stock_row_loss_grads`` on ``model``, with graph."""
    context = exact_linear_kernels(model) if exact else contextlib.nullcontext()
    logprobs, entropies = [], []
    with context:
        for traj in trajectories:
            ids = torch.as_tensor(list(traj), dtype=torch.long)
            logp = torch.log_softmax(stock_logits(model, traj)[:-1] / temperature, -1)
            logprobs.append(logp.gather(1, ids[1:, None])[:, 0])
            entropies.append(-(logp.exp() * logp).sum(-1))
        logprob, entropy = torch.cat(logprobs), torch.cat(entropies)
        return logprob, entropy, loss_fn(logprob, entropy)


def row_loss_cancellation(model, trajectories, loss_fn, temperature: float = 1.0) -> Callable:
    """The ``cancellation`` of :func:`gradient_failures` for the loss of :func:`stock_row_loss_grads`:
    names -> {name: kappa} from its fp64 run (:func:`token_cancellation`)."""

    def fp64_loss(model64):
        return _stock_row_loss(model64, trajectories, loss_fn, True, temperature)[2]

    return lambda names: token_cancellation(fp64_copy(model), fp64_loss, names)


def grad_relative_errors(got: dict, ref: dict) -> dict[str, float]:
    """||got - ref|| / max(||ref||, GRAD_FLOOR) per parameter."""
    errors = {}
    for name, r in ref.items():
        g = got[name].to(r.dtype)
        # A gradient that is exactly zero in exact arithmetic (a lone token's query, say) comes out
        # as ~1e-17 in fp64 and ~1e-10 in fp32; below a norm of 1e-6 the check is absolute.
        errors[name] = (g - r).norm().item() / max(r.norm().item(), GRAD_FLOOR)
    return errors


def gradient_failures(
    got: dict, exact: dict, stock32: dict | None = None, cancellation: Callable | None = None
) -> dict[str, str]:
    """Parameters whose gradient misses the bound, with the figures; empty when all pass.

    The bound is ``GRAD_RTOL`` relative to the exact (fp64) gradient. A parameter whose gradient
    is a sum with heavy cancellation (a decay ``A_log`` under a clipped RL loss, say) can be out
    of fp32's reach, and is bounded in one of two ways, whichever is larger:

    - from the arithmetic (``cancellation`` given: names -> {name: kappa}, see
      :func:`token_cancellation`): a sum of per-token terms, each with relative error e, is off by
      at most e times the sum of their magnitudes, so the bound is ``GRAD_RTOL`` relative to that
      sum, i.e. ``kappa * GRAD_RTOL`` relative to the gradient, as the loss is bounded against the
      sum of |per-row terms|. It is asked for only for the parameters that miss ``GRAD_RTOL``;
    - against the stock fp32 per-trajectory computation (``stock32`` given): within twice its own
      error, i.e. at least as exact as the training it replaces.

    Both errors are reported either way.
    """
    mine = grad_relative_errors(got, exact)
    theirs = grad_relative_errors(stock32, exact) if stock32 is not None else {}
    missed = [name for name, err in mine.items() if err > GRAD_RTOL]
    kappa = cancellation(missed) if cancellation is not None and missed else {}
    failures = {}
    for name in missed:
        bound = max(GRAD_RTOL * kappa.get(name, 1.0), 2 * theirs.get(name, 0.0))
        if mine[name] > bound:
            failures[name] = (
                f"relative error {mine[name]:.2e} > {bound:.2e} (stock fp32: "
                f"{theirs.get(name, float('nan')):.2e}; cancellation: {kappa.get(name, float('nan')):.3g})"
            )
    return failures


def assert_gradients(got: dict, exact: dict, stock32: Callable) -> float:
    """``got`` against the fp64 truth ``exact`` (bound: GRAD_RTOL, or twice stock fp32's own error,
    ``stock32()`` its gradients, computed only when a parameter misses GRAD_RTOL); returns the worst
    relative error."""
    errors = grad_relative_errors(got, exact)
    if max(errors.values()) > GRAD_RTOL:
        failures = gradient_failures(got, exact, stock32())
        assert not failures, failures
    return max(errors.values())


def stock_fp32_grads(model, trajectories, loss_of_logits: Callable) -> dict[str, torch.Tensor]:
    """The gradients of ``sum_i loss_of_logits(i, logits_i)`` through the literal fp32 stock forward of
    each trajectory alone (``model``'s own ``.grad`` is left as it was)."""
    saved = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for i, traj in enumerate(trajectories):
        loss_of_logits(i, stock_logits(model, traj)).backward()
    grads = param_grads(model)
    for n, p in model.named_parameters():
        p.grad = saved[n]
    return grads


def token_cancellation(model64, fp64_loss: Callable, names) -> dict[str, float]:
    """{name: kappa} for the named parameters whose gradient is a sum of per-token terms:
    kappa = || sum_t |g_t| || / || sum_t g_t || (elementwise magnitudes, >= 1), where g_t is token
    t's term. 1 means no cancellation; a decay ``A_log`` whose per-token terms nearly cancel has
    tens.

    ``fp64_loss(model64)`` runs the fp64 reference on ``model64`` (an fp64 copy) and returns the
    loss. The terms come from the module that owns each parameter directly (a KDA forget gate for
    its ``A_log``): its input and output gradient are recorded during that run and its forward is
    differentiated one token at a time (``torch.func``). A parameter is reported only when the
    per-token terms add up to its whole gradient (fp64 rounding): a module that mixes tokens (a
    convolution, an attention) does not decompose so, and is left out (no derived bound).
    """
    from torch.func import functional_call, grad, vmap

    modules = dict(model64.named_modules())
    owners: dict[str, list[str]] = {}
    for name in names:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    records: dict[str, list] = {owner: [] for owner in owners}

    def recorder(rec):
        def hook(module, args, out):
            if len(args) == 1 and torch.is_tensor(args[0]) and torch.is_tensor(out) and out.requires_grad:
                entry = [args[0].detach(), None]
                rec.append(entry)
                out.register_hook(lambda g: entry.__setitem__(1, g.detach()))

        return hook

    handles = [modules[owner].register_forward_hook(recorder(records[owner])) for owner in owners]
    model64.zero_grad(set_to_none=True)
    try:
        fp64_loss(model64).backward()
    finally:
        for handle in handles:
            handle.remove()
    kappa = {}
    for owner, owned in owners.items():
        module = modules[owner]
        attrs = {name: name.rpartition(".")[2] for name in owned}
        params = {attr: getattr(module, attr).detach() for attr in attrs.values()}

        def one_token(p, x, g_out, module=module):  # x, g_out: one token's [...] -> [1, 1, ...]
            return (functional_call(module, p, (x[None, None],)) * g_out[None, None]).sum()

        total = {attr: torch.zeros_like(p) for attr, p in params.items()}
        magnitude = {attr: torch.zeros_like(p) for attr, p in params.items()}
        with _no_fp32_downcasts():
            for x, g_out in records[owner]:
                if g_out is None or x.dim() < 3 or g_out.shape[:2] != x.shape[:2]:
                    continue
                terms = vmap(grad(one_token), in_dims=(None, 0, 0))(
                    params, x.flatten(0, 1), g_out.flatten(0, 1)
                )
                for attr, t in terms.items():
                    total[attr] += t.detach().sum(0)
                    magnitude[attr] += t.detach().abs().sum(0)
        for name, attr in attrs.items():
            whole = getattr(module, attr).grad
            if whole is None or whole.norm() == 0:
                continue
            if (total[attr] - whole).norm() <= 1e-9 * magnitude[attr].norm():
                kappa[name] = float(magnitude[attr].norm() / whole.norm())
    model64.zero_grad(set_to_none=True)
    return kappa


def split_gradient_failures(
    budgeted: dict, whole: dict, model, trajectories, loss_fn
) -> tuple[dict[str, str], dict[str, float]]:
    """Split invariance of fp32 gradients: (failures, the budgeted run's relative errors to the
    unbudgeted one). A parameter passes when the two runs agree within ``GRAD_RTOL``; one that
    does not is judged against the truth instead: both runs must meet :func:`gradient_failures`
    against the fp64 stock gradients of ``loss_fn`` over the rows of each trajectory alone
    (:func:`stock_row_loss_grads`), with the stock fp32 computation's own error.

    Why: two fp32 computations of one gradient g, each within relative e of g, differ by up to
    2e (triangle inequality), so a direct bound ``GRAD_RTOL`` between them holds only where both
    are within ``GRAD_RTOL / 2`` of g. A sum with heavy cancellation (a decay ``A_log`` behind
    fp32 projections and a conv) can leave stock fp32 itself beyond that; there the runs may
    differ by up to the sum of their own errors, each bounded as the per-trajectory tests bound
    them, and only the truth tells which run is off.
    """
    direct = grad_relative_errors(budgeted, whole)
    if max(direct.values()) <= GRAD_RTOL:
        return {}, direct
    exact = stock_row_loss_grads(model, trajectories, loss_fn, exact=True)[2]
    stock32 = stock_row_loss_grads(model, trajectories, loss_fn, exact=False)[2]
    cancellation = row_loss_cancellation(model, trajectories, loss_fn)
    failures = {}
    for label, got in (("budgeted", budgeted), ("unbudgeted", whole)):
        for name, why in gradient_failures(got, exact, stock32, cancellation).items():
            if direct[name] > GRAD_RTOL:
                failures[name] = f"{label} run: {why} (runs apart by {direct[name]:.2e})"
    return failures, direct
