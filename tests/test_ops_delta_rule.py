"""Chunked gated delta rule (fp32) against the per-token fp64 loop, and against transformers' own chunk forms.

Inputs are at the scale the models feed: q, k l2-normalised, v ~ N(0, 1), beta in (0, 1), state ~ N(0, 1).
Tolerances (fixed, never loosened to pass): outputs and states max abs error <= 1e-5, gradients relative
error ||a - b|| / ||b|| <= 1e-5, for q, k, v, g, beta and the initial state, under a random linear
functional of the outputs and the final state.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harts.ops.delta_rule import chunked_gated_delta_rule, naive_recurrent_gated_delta_rule

ATOL = 1e-5
GRAD_RTOL = 1e-5
NAMES = ("q", "k", "v", "g", "beta", "s0")


def make_inputs(B, T, H, K, V, gate="kda", seed=0):
    """Unit-scale inputs. gate: 'kda' (logsigmoid, mostly in (-3, 0)), 'strongN' (-U(0, N)), 'constN' (-N)."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen)

    q = F.normalize(rn(B, T, H, K), dim=-1)
    k = F.normalize(rn(B, T, H, K), dim=-1)
    v = rn(B, T, H, V)
    if gate == "kda":
        g = F.logsigmoid(rn(B, T, H, K) + 2.0)
    elif gate.startswith("strong"):
        g = -torch.rand(B, T, H, K, generator=gen) * float(gate[6:])
    else:
        g = torch.full((B, T, H, K), -float(gate[5:]))
    beta = torch.rand(B, T, H, generator=gen)
    s0 = rn(B, H, K, V)
    return [q, k, v, g, beta, s0]


def leaves(xs, dtype):
    return [x.detach().to(dtype).requires_grad_(True) for x in xs]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def maxabs(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def functional_weights(o_shape, s_shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*o_shape, generator=gen), torch.randn(*s_shape, generator=gen)


def run_pair(xs, chunk_size=64, s0=True):
    """Chunked fp32 vs naive fp64 on the same values; returns outputs, states and gradients of both."""
    res = {}
    for tag, dtype in (("chunk", torch.float32), ("naive", torch.float64)):
        q, k, v, g, beta, st = leaves(xs, dtype)
        init = st if s0 else None
        if tag == "chunk":
            o, S = chunked_gated_delta_rule(q, k, v, g, beta, init, chunk_size=chunk_size)
        else:
            o, S = naive_recurrent_gated_delta_rule(q, k, v, g, beta, init)
        wo, ws = functional_weights(o.shape, S.shape)
        ((o * wo.to(dtype)).sum() + (S * ws.to(dtype)).sum()).backward()
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in (q, k, v, g, beta, st)]
        res[tag] = (o, S, grads)
    return res["chunk"], res["naive"]


def assert_close(chunk, naive, check_s0_grad=True):
    (o, S, grads), (on, Sn, gradsn) = chunk, naive
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert maxabs(o, on) <= ATOL, f"output max abs err {maxabs(o, on):.3g}"
    assert maxabs(S, Sn) <= ATOL, f"state max abs err {maxabs(S, Sn):.3g}"
    for name, a, b in zip(NAMES, grads, gradsn, strict=True):
        if name == "s0" and not check_s0_grad:
            continue
        assert torch.isfinite(a).all(), f"non-finite grad {name}"
        assert rel(a, b) <= GRAD_RTOL, f"grad {name} rel err {rel(a, b):.3g}"


def sid(B, T, H, K, V, C=64):
    return f"B{B}-T{T}-H{H}-K{K}-V{V}" + ("" if C == 64 else f"-C{C}")


SHAPES = [
    (2, 300, 4, 32, 16, 64),  # T not a multiple of the chunk
    (2, 128, 2, 16, 32, 64),  # T a multiple of the chunk
    (1, 40, 2, 16, 8, 64),  # T < chunk
    (1, 1, 2, 8, 8, 64),  # one token
    (1, 100, 2, 16, 16, 32),
    (1, 50, 1, 8, 8, 8),  # chunk smaller than the sub-block
]


@pytest.mark.parametrize("shape", [pytest.param(s, id=sid(*s)) for s in SHAPES])
def test_matches_naive(shape):
    *bthkv, C = shape
    chunk, naive = run_pair(make_inputs(*bthkv), chunk_size=C)
    assert_close(chunk, naive)


def test_zero_initial_state_default():
    chunk, naive = run_pair(make_inputs(2, 70, 2, 16, 8, seed=3), s0=False)
    assert_close(chunk, naive, check_s0_grad=False)


@pytest.mark.parametrize(
    "gate", ["strong5", "strong20", "const5", "const20", "strong60"], ids=lambda s: f"B2-T150-H2-K16-V8-{s}"
)
def test_strong_decay(gate):
    """g down to -20 (and -60) per step: intra-chunk factors must neither overflow nor lose precision."""
    chunk, naive = run_pair(make_inputs(2, 150, 2, 16, 8, gate=gate, seed=5))
    assert_close(chunk, naive)


@pytest.mark.parametrize("form", ["expanded", "head", "head-1"])
def test_gdn_per_head_gate(form):
    """GDN: one gate per head, expanded over K by the caller or passed per head ([B, T, H] or
    [B, T, H, 1]) for the op to expand; either way the gradient flows back to the per-head gate."""
    B, T, H, K, V = 2, 90, 3, 16, 8
    xs = make_inputs(B, T, H, K, V, seed=7)
    xs[3] = F.logsigmoid(torch.randn(B, T, H, generator=torch.Generator().manual_seed(8)) + 2.0)
    out = {}
    for tag, dtype in (("chunk", torch.float32), ("naive", torch.float64)):
        q, k, v, gh, beta, s0 = leaves(xs, dtype)
        g = {"expanded": gh[..., None].expand(B, T, H, K), "head": gh, "head-1": gh[..., None]}[form]
        fn = chunked_gated_delta_rule if tag == "chunk" else naive_recurrent_gated_delta_rule
        o, S = fn(q, k, v, g, beta, s0)
        wo, ws = functional_weights(o.shape, S.shape)
        ((o * wo.to(dtype)).sum() + (S * ws.to(dtype)).sum()).backward()
        out[tag] = (o, S, [x.grad for x in (q, k, v, gh, beta, s0)])
    assert_close(out["chunk"], out["naive"])


def test_padded_batch_matches_each_segment_alone():
    """Right-padded batch with lengths: each row equals the naive run of that segment alone."""
    B, T, H, K, V = 4, 150, 2, 16, 8
    lengths = torch.tensor([150, 67, 1, 0])
    xs = make_inputs(B, T, H, K, V, seed=11)
    q, k, v, g, beta, s0 = leaves(xs, torch.float32)
    o, S = chunked_gated_delta_rule(q, k, v, g, beta, s0, lengths=lengths)
    wo, ws = functional_weights(o.shape, S.shape)
    ((o * wo).sum() + (S * ws).sum()).backward()
    grads = [q.grad, k.grad, v.grad, g.grad, beta.grad, s0.grad]
    for b, L in enumerate(lengths.tolist()):
        assert (o[b, L:] == 0).all()
        for gr in grads[:5]:
            assert (gr[b, L:] == 0).all(), "padded positions must get no gradient"
        seg = [x[b : b + 1, :L] for x in xs[:5]] + [xs[5][b : b + 1]]
        qn, kn, vn, gn, bn, sn = leaves(seg, torch.float64)
        on, Sn = naive_recurrent_gated_delta_rule(qn, kn, vn, gn, bn, sn)
        ((on * wo[b : b + 1, :L].double()).sum() + (Sn * ws[b : b + 1].double()).sum()).backward()
        assert maxabs(o[b : b + 1, :L], on) <= ATOL
        assert maxabs(S[b : b + 1], Sn) <= ATOL
        for name, a, ref in zip(NAMES, grads, (qn, kn, vn, gn, bn, sn), strict=True):
            a = a[b : b + 1] if name == "s0" else a[b : b + 1, :L]
            if L == 0 and name != "s0":
                continue
            assert rel(a, ref.grad) <= GRAD_RTOL, f"segment {b} grad {name} rel err {rel(a, ref.grad):.3g}"


@pytest.mark.parametrize("C", [64, 16], ids=lambda c: f"B2-T150-H2-K16-V8-C{c}")
def test_output_states_at(C):
    """States after p tokens (0, chunk edges, mid-chunk, T) equal the naive final state of the prefix."""
    B, T, H, K, V = 2, 150, 2, 16, 8
    at = torch.tensor([[0, 1, C - 1, C, C + 1, 99, T], [T, 5, 0, 2 * C, 77, 150, 3]])
    lengths = torch.tensor([T, 120])
    xs = make_inputs(B, T, H, K, V, seed=13)
    q, k, v, g, beta, s0 = leaves(xs, torch.float32)
    o, S, states = chunked_gated_delta_rule(
        q, k, v, g, beta, s0, lengths=lengths, chunk_size=C, output_states_at=at
    )
    assert states.shape == (B, at.shape[1], H, K, V)
    w = torch.randn(states.shape, generator=torch.Generator().manual_seed(2))
    (states * w).sum().backward()
    ref_grads = [torch.zeros_like(x, dtype=torch.float64) for x in xs]
    for b in range(B):
        for i, p in enumerate(at[b].tolist()):
            p_eff = min(p, int(lengths[b]))  # the state is frozen past the true length
            seg = [x[b : b + 1, :p_eff] for x in xs[:5]] + [xs[5][b : b + 1]]
            ls = leaves(seg, torch.float64)
            _, Sn = naive_recurrent_gated_delta_rule(*ls)
            assert maxabs(states[b : b + 1, i], Sn) <= ATOL, f"row {b} p={p}"
            (Sn * w[b : b + 1, i].double()).sum().backward()
            for r, x in zip(ref_grads[:5], ls[:5], strict=True):
                if x.grad is not None:  # None when p_eff = 0
                    r[b : b + 1, :p_eff] += x.grad
            ref_grads[5][b : b + 1] += ls[5].grad
    grads = (q.grad, k.grad, v.grad, g.grad, beta.grad, s0.grad)
    for name, a, r in zip(NAMES, grads, ref_grads, strict=True):
        assert rel(a, r) <= GRAD_RTOL, f"grad {name} rel err {rel(a, r):.3g}"


def test_low_precision_inputs_keep_fp32_state():
    xs = make_inputs(1, 70, 2, 16, 8, seed=17)
    q, k, v, g, beta, s0 = (x.bfloat16() for x in xs)
    o, S = chunked_gated_delta_rule(q, k, v, g, beta, s0.float())
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    on, Sn = naive_recurrent_gated_delta_rule(q, k, v, g, beta, s0.float())
    assert maxabs(S, Sn) <= ATOL  # same (bf16-rounded) values in, fp32 maths inside


def test_matches_transformers_kimi_chunk():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                               reason="kimi_linear is not in the installed transformers")  # fmt: skip
    chunk_kimi_delta_attention = kimi.chunk_kimi_delta_attention

    q, k, v, g, beta, s0 = make_inputs(1, 100, 2, 16, 16, seed=19)
    o_ref, S_ref = chunk_kimi_delta_attention(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    o, S = chunked_gated_delta_rule(q, k, v, g, beta, s0)
    assert maxabs(o, o_ref) <= ATOL and maxabs(S, S_ref) <= ATOL


def test_matches_transformers_qwen3_next_gdn():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    B, T, H, K, V = 1, 100, 2, 16, 16
    q, k, v, _, beta, s0 = make_inputs(B, T, H, K, V, seed=23)
    gh = F.logsigmoid(torch.randn(B, T, H, generator=torch.Generator().manual_seed(24)) + 2.0)
    o_ref, S_ref = torch_chunk_gated_delta_rule(
        q, k, v, gh, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=False
    )
    o, S = chunked_gated_delta_rule(q, k, v, gh[..., None].expand(B, T, H, K), beta, s0)
    assert maxabs(o, o_ref) <= ATOL and maxabs(S, S_ref) <= ATOL


def test_rejects_chunk_size_not_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        chunked_gated_delta_rule(*make_inputs(1, 10, 1, 8, 8), chunk_size=48)


@pytest.mark.parametrize("per_step", [2.5, 2.8, 3.0, 20.0], ids=lambda g: f"g-{g}")
def test_intra_chunk_scores_both_forms(per_step):
    """P and A of one 16-slot chunk against fp64 sums, each within the rounding its form allows.

    Gates -U(0.8, 1) * per_step make the chunk's path sums spread about 15 * 0.9 * per_step: below
    FACTOR_SPAN (factored about the midpoint) at 2.5 and 2.8, above it at 3.0 and 20 (binary split).
    Bound per entry, over the sum |terms| of its K products: factored, each factor is an fp64
    exponential rounded once, then two products and K - 1 additions: (K + 4) eps; the split also
    forms its exponents as fp32 sums of up to C / 2 gates, whose error is at most C / 2 eps times
    the sum's magnitude, so each factor carries that much more relative error. Products that
    underflow (strong decays) may each lose up to fp32's smallest normal number, absolutely.
    """
    from harts.ops.chunked import scores

    C, K = 16, 8
    gen = torch.Generator().manual_seed(7)
    q = F.normalize(torch.randn(3, C, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(3, C, K, generator=gen), dim=-1)
    g = -(0.8 + 0.2 * torch.rand(3, C, K, generator=gen)) * per_step
    G = g.double().cumsum(-2)
    span = float((G.amax(-2) - G.amin(-2)).max())
    factored = span <= scores.FACTOR_SPAN
    assert factored == (per_step < 3.0), f"spread {span:.1f} is on the wrong side of the bound"
    assert (scores._factored_scores(q, k, g, True) is not None) == factored

    D = torch.exp((G[:, :, None, :] - G[:, None, :, :]).clamp_max(0))  # [3, t, j, K], j <= t read only
    eps = torch.finfo(torch.float32).eps
    terms = {"P": q.double()[:, :, None, :] * k.double()[:, None, :, :] * D,
             "A": k.double()[:, :, None, :] * k.double()[:, None, :, :] * D}
    P, A = scores.intra_chunk_scores(q, k, g)
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    for name, got, mask in (("P", P, lower), ("A", A, lower.tril(-1))):
        exact = terms[name].sum(-1) * mask
        slack = K + 4 if factored else K + 4 + 2 * (C // 2) * float(G.abs().amax())
        underflow = 4 * K * torch.finfo(torch.float32).tiny
        bound = (slack * eps * terms[name].abs().sum(-1) + underflow) * mask
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), f"{name}: error {float((err - bound).max()):.3g} above its bound"
    P_only, none = scores.intra_chunk_scores(q, k, g, keys=False)
    assert none is None and torch.equal(P_only, P)
