"""RL and SFT objectives on forests through a real model equal a per-trajectory stock reference.

Forest side: the one training step, ``harts.forest_step`` (the model once per unique token,
log-probs once per unique predictor, ``compute_loss`` over global normalisers, backward), fp32,
without a budget and under token budgets down to one token per micro-batch. Reference side,
written here plainly and independently of ``harts.objectives``: the stock Hugging Face forward
of each trajectory alone in fp64 (``tests/reference.py``: fp64 copy, exact linear-attention
kernels), then each objective's textbook formula in Python loops over trajectories and
positions, then the aggregation as the papers write it. Loss values must agree to 1e-5 relative and every
parameter's gradient to 1e-4 relative (``grad_relative_errors``).

The fp64 reference log-probs of a (family, forest) are computed once with their graph kept, and
each objective takes its gradient with ``torch.autograd.grad``. Rollout log-probs are the fp32
model's own plus noise, with a few shifted far down, so PPO's clip (both sides), the dual clip
and GSPO's sequence clip are all exercised; the reference refuses data that sits on a clip
boundary, where fp32 and fp64 could take different branches.

Coverage. The objective and its aggregation are functions of the rows (log-probs, entropies,
annotations), checked without a model on many forests in ``test_objectives.py``; the family
decides how the rows and their gradients come out of the model. So each check crosses the axes
that meet: every family with one objective (PPO with the k3 KL and the entropy bonus, whose
gradient reaches every logit of each row), and every objective x every aggregation on two
families, one full-attention (qwen3) and one hybrid (qwen3_next), both in every supported
transformers. The forests: "branchy" (branch tokens with different targets per child, a shared
token loss-bearing in one trajectory and masked in another, a duplicate, a trajectory that is a
prefix of another) whole and under budgets that cut it at every node or inside nodes;
"two-groups" (two prompts, a fully masked trajectory) with the step split into micro-batches,
and with advantages from every estimator feeding PPO.

Conditioning note: the most sensitive quantity here is bailing_hybrid's last-layer
``forget_gate.A_log`` gradient under clipped losses, a sum of per-token terms with heavy
cancellation (their magnitudes add up to about 54 times the gradient's norm, ~7e-5). Any fp32
computation of it is off by about its terms' rounding times that factor: stock fp32
per-trajectory misses 1e-4 with some token draws and kernels, and harts sits at ~1.4e-4. So the
gradient check (``tests.reference.gradient_failures``) holds harts to 1e-4 relative to the sum of
the terms' magnitudes (``tests.reference.token_cancellation``, computed in fp64), or to twice the
stock fp32 error, and reports both.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

import harts
from harts.objectives import (
    Aggregation,
    LossKind,
    PolicyLossConfig,
    Rollout,
    build_loss_rows,
    estimate_advantages,
    normalizers_for,
)
from harts.tiny import FAMILIES
from tests.reference import (
    GRAD_RTOL,
    cached_model,
    exact_linear_kernels,
    fp64_copy,
    grad_relative_errors,
    gradient_failures,
    param_grads,
    token_cancellation,
)

LOSS_RTOL = 1e-5
MAX_LENGTH = 24.0  # Dr. GRPO's constant for seq-mean-token-sum-norm
GRPO_EPS = 1e-6  # grpo_advantages' default
VOCAB = 128
BOUNDARY_MARGIN = 1e-5  # closest a ratio may sit to a clip boundary


# ---- data ----------------------------------------------------------------------------------------
@dataclass
class Traj:
    """One trajectory and its annotations, position p describing token p (plain lists)."""

    tokens: list[int]
    mask: list[bool]
    group: str
    reward: float
    first_error: int | None = None
    old: list[float] | None = None  # rollout log-probs
    ref: list[float] | None = None  # reference log-probs
    adv: list[float] | None = None


def _shapes() -> dict[str, list[Traj]]:
    rng = random.Random(5)

    def seq(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    def mask(length, on):
        return [p in on for p in range(length)]

    p = seq(6)
    a, b, c, x = 40, 41, 42, 43
    r0 = p + [a, b, c] + seq(4)
    branchy = [
        Traj(r0, mask(13, range(6, 13)), "g", 1.0),
        # a, b (positions 6, 7) are masked here and loss-bearing in r0; b predicts c there and x here
        Traj(p + [a, b, x] + seq(3), mask(12, range(8, 12)), "g", 0.0, first_error=9),
        Traj(p + seq(9), mask(15, [6, 7, 8, 11, 12, 13, 14]), "g", 0.5, first_error=11),
        Traj(list(r0), mask(13, range(6, 13)), "g", 1.0),  # duplicate, its own annotations
        Traj(p + [a, b, c], mask(9, [7, 8]), "g", 0.25),  # a prefix of r0
    ]
    q0, q1 = seq(5), seq(4)
    u0, v0 = q0 + seq(8), q1 + seq(12)
    two_groups = [
        Traj(u0, mask(13, range(5, 13)), "q0", 1.0),
        Traj(q0 + u0[5:8] + seq(5), mask(13, [5, 6, 7, 8, 11, 12]), "q0", 0.0, first_error=7),
        Traj(q0 + seq(3), mask(8, range(5, 8)), "q0", 0.0),
        Traj(v0, mask(16, range(4, 16)), "q1", 0.3, first_error=10),
        Traj(q1 + v0[4:6] + seq(14), mask(20, range(4, 20)), "q1", 0.9),
        Traj(q1 + seq(3), mask(7, []), "q1", 0.0),  # fully masked: no rows, not counted in S
    ]
    return {"branchy-B5": branchy, "two-groups-B6": two_groups}


SHAPES = _shapes()
# micro-batches of "two-groups-B6": disjoint trajectory sets, each its own forest
SPLITS = {"mb2": [[0, 4], [1, 2, 3, 5]], "mb3": [[0, 4], [1, 5], [2, 3]]}


@dataclass
class Case:
    model: torch.nn.Module
    trajs: list[Traj]
    lp64: list[torch.Tensor]  # [L_b - 1] fp64 log-prob of token p at index p - 1, with graph
    ent64: list[torch.Tensor]  # [L_b - 1] fp64 entropy of the distribution predicting token p
    params64: dict[str, torch.nn.Parameter]
    stock32: Case | None = None  # the same reference from the stock fp32 model (conditioning)


_CASES: dict[tuple[str, str], Case] = {}


def model_of(family):
    return cached_model(family, seed=7)


def _clips(own, old, adv, mask) -> bool:
    """Whether a loss token's ratio (own over behaviour, behaviour capped at 0) leaves [0.8, 1.28]
    on the side its advantage clips."""
    for o, b, a, m in zip(own, old, adv, mask, strict=True):
        ratio = np.exp(o - min(b, 0.0))
        if m and ((a > 0 and ratio > 1.28) or (a < 0 and ratio < 0.8)):
            return True
    return False


# the per-token ratio boundaries of OBJECTIVES: clip 0.2, clip-higher 0.28, the dual clip 3
RATIO_EDGES = (0.8, 1.2, 1.28, 3.0)


def _off_the_edges(own, old):
    """The draw's behaviour log-probs, each one whose ratio (own over it) falls within 1e-3 of a
    clip boundary moved 0.01 lower: a ratio on a boundary clips or not by rounding alone, which
    the test refuses (``BOUNDARY_MARGIN``); 1e-3 leaves room for harts' and stock's own rounding."""
    return [
        b - 0.01 if any(abs(np.exp(o - min(b, 0.0)) - edge) < 1e-3 for edge in RATIO_EDGES) else b
        for o, b in zip(own, old, strict=True)
    ]


def _fp64_rows(model64, token_lists) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per trajectory alone through the stock fp64 model: ([L - 1] log-prob of token p at index
    p - 1, [L - 1] entropy of the distribution predicting it), with graph."""
    lps, ents = [], []
    for tokens in token_lists:
        ids = torch.tensor([tokens])
        with exact_linear_kernels(model64):
            logp = torch.log_softmax(model64(input_ids=ids).logits[0], -1)
        lps.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1)[:-1])
    return lps, ents


def case_of(family: str, shape: str) -> Case:
    """Annotated trajectories and the fp64 per-trajectory reference, once per (family, forest)."""
    if (family, shape) in _CASES:
        return _CASES[family, shape]
    model = model_of(family)
    model64 = fp64_copy(model)
    g = np.random.default_rng(zlib.crc32(f"{family}/{shape}".encode()))
    trajs, lp64, ent64, owns = [], [], [], []
    for i, t in enumerate(SHAPES[shape]):
        ids = torch.tensor([t.tokens])
        with torch.no_grad():
            own = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
            own = [0.0] + own.gather(1, ids[0, 1:, None])[:, 0].tolist()
        (lp,), (ent,) = _fp64_rows(model64, [t.tokens])
        lp64.append(lp)
        ent64.append(ent)
        n = len(t.tokens)
        old = _off_the_edges(own, [o + 0.2 * z for o, z in zip(own, g.standard_normal(n), strict=True)])
        ref = [o + 0.3 * z for o, z in zip(own, g.standard_normal(n), strict=True)]
        # Mostly positive advantages keep the loss away from 0, where fp32 rounding of a difference
        # of large sums would be judged against a tiny value.
        adv = (1.0 + 0.8 * g.standard_normal(n)).tolist()
        owns.append(own)
        if i in (1, 2):  # far-off behaviour log-probs with negative advantages: ratios ~4.5, dual clip
            far = [p for p in range(n) if p % 4 == 1]
            old = [o - 1.5 if p in far else o for p, o in enumerate(old)]
            adv = [-0.5 - abs(a) if p in far else a for p, a in enumerate(adv)]
        trajs.append(Traj(t.tokens, t.mask, t.group, t.reward, t.first_error,
                          [min(v, 0.0) for v in old], [min(v, 0.0) for v in ref], adv))  # fmt: skip
    if not any(_clips(own, t.old, t.adv, t.mask) for own, t in zip(owns, trajs, strict=True)):
        # the draw left the (single) clip unexercised: behaviour log-probs 0.5 below on a few tokens
        # of the first trajectory, with positive advantages (ratios ~1.65), so every family's data clips
        t, near = trajs[0], set(range(3, len(trajs[0].tokens), 5))
        pairs = enumerate(zip(owns[0], t.old, strict=True))
        trajs[0] = replace(
            t, old=[min(o - 0.5, 0.0) if p in near else b for p, (o, b) in pairs],
            adv=[0.5 + abs(a) if p in near else a for p, a in enumerate(t.adv)],
        )  # fmt: skip
    params64 = dict(model64.named_parameters())
    # The stock fp32 per-trajectory computation of the same references: how exact fp32 can be.
    lp32, ent32 = [], []
    for t in SHAPES[shape]:
        ids = torch.tensor([t.tokens])
        logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
        lp32.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0])
        ent32.append(-(logp.exp() * logp).sum(-1)[:-1])
    stock32 = Case(model, trajs, lp32, ent32, dict(model.named_parameters()))
    _CASES[family, shape] = Case(model, trajs, lp64, ent64, params64, stock32)
    return _CASES[family, shape]


def rollouts_of(trajs: list[Traj], with_advantages: bool = True) -> list[Rollout]:
    return [
        Rollout(t.tokens, loss_mask=t.mask, rollout_logprobs=t.old, ref_logprobs=t.ref,
                advantages=t.adv if with_advantages else None, reward=t.reward, group_id=t.group,
                first_error_position=t.first_error)
        for t in trajs
    ]  # fmt: skip


# ---- the textbook reference ----------------------------------------------------------------------
OBJECTIVES = {
    "sft": PolicyLossConfig(kind=LossKind.SFT),
    # DAPO's clip-higher (asymmetric) and the dual clip
    "ppo-clip0.2-0.28-dual3": PolicyLossConfig(kind="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0),
    # a wider clip than the paper's 3e-4 / 4e-4, so that the test data's sequences fall on both sides
    "gspo-clip0.05-0.08": PolicyLossConfig(kind="gspo", clip_low=0.05, clip_high=0.08),
    "ppo-kl_k3-entropy": PolicyLossConfig(kind="ppo", kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
}
MODES = list(Aggregation)


def _check_margin(value: float, boundaries, what: str) -> None:
    for edge in boundaries:
        if abs(value - edge) < BOUNDARY_MARGIN:
            raise AssertionError(f"test data puts a {what} at {value}, on the clip boundary {edge}")


def _pessimistic(adv, ratio, low, high):
    """PPO's clipped surrogate as a loss (Schulman et al. 2017): max(-A r, -A clip(r, 1-low, 1+high))."""
    _check_margin(float(ratio.detach()), (1 - low, 1 + high), "ratio")
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))


def reference_loss(case: Case, trajs: list[Traj], config: PolicyLossConfig, advantages=None, absolute=False):
    """fp64 loss of the whole step: per-trajectory loops, then the aggregation as written.

    ``advantages``: {(b, p): A} from a reference estimator, replacing the annotations.
    ``absolute`` aggregates |per-row term| instead: the scale fp32 rounding errors are relative to.
    """
    low, high = config.clip()
    seq_sums, seq_counts = [], []
    for b, t in enumerate(trajs):
        positions = [p for p in range(1, len(t.tokens)) if t.mask[p]]
        if not positions:
            continue
        lp, ent = case.lp64[b], case.ent64[b]
        adv = {p: advantages[b, p] if advantages else t.adv[p] for p in positions}
        if config.kind is LossKind.GSPO:  # Zheng et al. 2025: log of the geometric-mean ratio
            seq_log_ratio = sum(float(lp[p - 1].detach()) - t.old[p] for p in positions) / len(positions)
            _check_margin(math.exp(seq_log_ratio), (1 - low, 1 + high), "sequence ratio")
        total = 0.0
        for p in positions:
            x = lp[p - 1]
            if config.kind is LossKind.SFT:
                term = -x
            elif config.kind is LossKind.PPO:
                term = _pessimistic(adv[p], torch.exp(x - t.old[p]), low, high)
                if config.dual_clip is not None and adv[p] < 0:  # Ye et al. 2020
                    _check_margin(float(-term.detach() / adv[p]), (config.dual_clip,), "dual-clip ratio")
                    term = torch.clamp(term, max=-config.dual_clip * adv[p])
            else:  # GSPO-token (sec. 4.3): value = sequence ratio, gradient through this token
                term = _pessimistic(adv[p], torch.exp(seq_log_ratio + x - x.detach()), low, high)
            if config.kl_coef:  # k3 (Schulman 2020) of KL(pi || pi_ref) with d = log pi_ref - log pi
                d = t.ref[p] - x
                term = term + config.kl_coef * (torch.exp(d) - d - 1)
            if config.entropy_coef:
                term = term - config.entropy_coef * ent[p - 1]
            total = total + (term.abs() if absolute else term)
        seq_sums.append(total)
        seq_counts.append(len(positions))
    S, T = len(seq_sums), sum(seq_counts)
    mode = config.aggregation
    if mode is Aggregation.TOKEN_MEAN:
        return sum(seq_sums) / T
    if mode is Aggregation.SEQ_MEAN_TOKEN_SUM:
        return sum(seq_sums) / S
    if mode is Aggregation.SEQ_MEAN_TOKEN_MEAN:
        return sum(s / n for s, n in zip(seq_sums, seq_counts, strict=True)) / S
    return sum(seq_sums) / (MAX_LENGTH * S)


def reference_grads(case: Case, loss) -> dict[str, torch.Tensor]:
    names = list(case.params64)
    grads = torch.autograd.grad(loss, [case.params64[n] for n in names], retain_graph=True, allow_unused=True)
    return {
        n: (g if g is not None else torch.zeros_like(case.params64[n]))
        for n, g in zip(names, grads, strict=True)
    }


# ---- the forest side -----------------------------------------------------------------------------
def forest_step(model, rollouts, parts, config, estimator=None, budget=None):
    """Sum of the losses of ``parts`` (each its own forest and step, global normalisers), the grads
    and each part's metrics; ``budget`` cuts each part further into micro-batches."""
    model.zero_grad(set_to_none=True)
    built = []
    for part in parts:
        forest = harts.build_forest([rollouts[i].tokens for i in part])
        rows = build_loss_rows(forest, [rollouts[i] for i in part])
        if estimator is not None:
            name, params = estimator
            rows = estimate_advantages(rows, name, forest=forest, **params)
        built.append((forest, rows))
    norms = normalizers_for([rows for _, rows in built], max_length=MAX_LENGTH)
    total, metrics, results = torch.zeros((), dtype=torch.float64), [], []
    for forest, rows in built:
        result = harts.forest_step(model, forest, rows, config, normalizers=norms, budget_tokens=budget)
        if budget is not None:
            assert max(result.tokens_per_micro_batch) <= budget
        total = total + result.loss.double()
        metrics.append(result.metrics)
        results.append(result)
    return total, param_grads(model), metrics, results


def check(case, config, parts, estimator=None, ref_advantages=None, budget=None):
    """Assert loss and gradients against the reference; return the errors and the step's metrics.

    The loss error is relative to the same aggregation of |per-row terms| (as in
    ``test_objectives.py``): group-centred advantages and dual-clip bounds make the loss a
    difference of sums of order one, and fp32 rounding of the log-probs is relative to those sums,
    not to their difference. Where the loss does not cancel, this is the plain relative error.
    """
    ref = reference_loss(case, case.trajs, config, ref_advantages)
    ref_grads = reference_grads(case, ref)
    stock_grads = reference_grads(
        case.stock32, reference_loss(case.stock32, case.trajs, config, ref_advantages)
    )
    with torch.no_grad():
        scale = float(reference_loss(case, case.trajs, config, ref_advantages, absolute=True))
    rollouts = rollouts_of(case.trajs, with_advantages=estimator is None)
    loss, grads, metrics, results = forest_step(case.model, rollouts, parts, config, estimator, budget)
    diff, ref_value = abs(float(loss) - float(ref.detach())), float(ref.detach())
    loss_err = diff / scale
    errors = grad_relative_errors(grads, ref_grads)
    worst = max(errors, key=errors.get)

    def cancellation(names):  # the reference rerun on the fp64 model, for the per-token terms
        def fp64_loss(model64):
            lp, ent = _fp64_rows(model64, [t.tokens for t in case.trajs])
            return reference_loss(replace(case, lp64=lp, ent64=ent), case.trajs, config, ref_advantages)

        return token_cancellation(fp64_copy(case.model), fp64_loss, names)

    failures = gradient_failures(grads, ref_grads, stock_grads, cancellation)
    assert loss_err <= LOSS_RTOL, (
        f"loss {float(loss):.8g} vs {ref_value:.8g}: error {loss_err:.2e} of the |terms| scale {scale:.3g} "
        f"({diff / abs(ref_value):.2e} of the loss)"
    )
    assert not failures, f"gradients off: {failures}"
    assert any(g.norm() > 0 for g in ref_grads.values())
    return {"loss": loss_err, "loss_plain": diff / abs(ref_value), "grad": errors[worst], "param": worst,
            "metrics": metrics, "results": results}  # fmt: skip


def _config(name, mode):
    return PolicyLossConfig(**{**OBJECTIVES[name].__dict__, "aggregation": mode})


# ---- tests ---------------------------------------------------------------------------------------
FAMILY_OBJECTIVE = "ppo-kl_k3-entropy"  # the objective every family runs
FAMILY_MODE = Aggregation.SEQ_MEAN_TOKEN_MEAN
CROSS_FAMILIES = ("qwen3", "qwen3_next")  # every objective x aggregation: full attention, hybrid


def crossed(modes=(FAMILY_MODE,)) -> list[tuple[str, str, Aggregation]]:
    """(family, objective, aggregation): every family with the family objective, then every
    objective x ``modes`` on the cross families (ids spell all three)."""
    cases = [(f, FAMILY_OBJECTIVE, FAMILY_MODE) for f in FAMILIES]
    cases += [(f, o, m) for f in CROSS_FAMILIES for o in OBJECTIVES for m in modes]
    return list(dict.fromkeys(cases))


def crossed_ids(cases) -> list[str]:
    return ["-".join(str(getattr(x, "value", x)) for x in case) for case in cases]


BRANCHY_CASES = crossed(MODES)


@pytest.mark.parametrize("family,objective,mode", BRANCHY_CASES, ids=crossed_ids(BRANCHY_CASES))
def test_objective_on_branchy_forest_matches_per_trajectory_stock(family, objective, mode):
    case = case_of(family, "branchy-B5")
    metrics = check(case, _config(objective, mode), [list(range(len(case.trajs)))])["metrics"]
    if objective != "sft":  # the data exercises the clip on both sides, and the dual clip
        assert 0 < float(metrics[0]["clip_fraction"]) < 1
    if OBJECTIVES[objective].dual_clip is not None:
        assert float(metrics[0]["dual_clip_fraction"]) > 0


MICRO_BATCH_CASES = [(f, FAMILY_OBJECTIVE, FAMILY_MODE, "mb3") for f in FAMILIES] + [
    (f, FAMILY_OBJECTIVE, m, "mb3") for f in CROSS_FAMILIES for m in MODES if m is not FAMILY_MODE
] + [
    (f, o, m, "mb2") for f in ("qwen3_next", "bailing_hybrid") for o in ("sft", "gspo-clip0.05-0.08")
    for m in (Aggregation.SEQ_MEAN_TOKEN_MEAN, Aggregation.SEQ_MEAN_TOKEN_SUM_NORM)
]  # fmt: skip


@pytest.mark.parametrize("family,objective,mode,split", MICRO_BATCH_CASES, ids=crossed_ids(MICRO_BATCH_CASES))
def test_micro_batches_with_global_normalizers_match_whole_step(family, objective, mode, split):
    case = case_of(family, "two-groups-B6")
    check(case, _config(objective, mode), SPLITS[split])


# ---- advantage estimators, written plainly -------------------------------------------------------
def _group_stats(trajs):
    by_group: dict[str, list[float]] = {}
    for t in trajs:
        by_group.setdefault(t.group, []).append(t.reward)
    return by_group


def reference_advantages(trajs: list[Traj], name: str) -> dict[tuple[int, int], float]:
    """{(b, p): A} for every position of every trajectory."""
    groups = _group_stats(trajs)
    out = {}
    for b, t in enumerate(trajs):
        rewards = groups[t.group]
        n, mean = len(rewards), sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)  # population std (DeepSeekMath)
        for p in range(1, len(t.tokens)):
            if name == "grpo":
                a = (t.reward - mean) / (std + GRPO_EPS)
            elif name == "dr_grpo":
                a = t.reward - mean
            elif name == "rloo":
                a = t.reward - (sum(rewards) - t.reward) / (n - 1) if n > 1 else 0.0
            elif name == "pitfall":  # +1 before the first error, -0.5 from it on
                a = -0.5 if t.first_error is not None and p >= t.first_error else 1.0
            else:
                a = _tree_advantage(trajs, b, p, mean)
            out[b, p] = a
    return out


def _through(trajs, b, p) -> frozenset[int]:
    """Trajectories that contain token p of trajectory b (the same prefix up to p)."""
    prefix = trajs[b].tokens[: p + 1]
    return frozenset(c for c, t in enumerate(trajs) if t.tokens[: p + 1] == prefix)


def _tree_advantage(trajs, b, p, group_mean) -> float:
    """V(node of p) - V(parent node); V = mean reward of the trajectories through the node.

    A node is a maximal run of tokens shared by the same trajectories, so the parent node is
    where that set last changed before p; a root's parent value is the group mean.
    """
    here = _through(trajs, b, p)
    value = sum(trajs[c].reward for c in here) / len(here)
    for q in range(p - 1, -1, -1):
        before = _through(trajs, b, q)
        if before != here:
            return value - sum(trajs[c].reward for c in before) / len(before)
    return value - group_mean


ESTIMATORS = {"grpo": {}, "dr_grpo": {}, "rloo": {}, "tree": {}, "pitfall": {"a_neg": 0.5}}
PPO_GRPO = PolicyLossConfig(kind=LossKind.PPO, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                            aggregation=Aggregation.SEQ_MEAN_TOKEN_MEAN)  # fmt: skip


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("family", ["qwen3_next", "bailing_hybrid", "llama"])
def test_advantage_estimators_feed_ppo(family, estimator, shape):
    case = case_of(family, shape)
    ref_adv = reference_advantages(case.trajs, estimator)
    assert any(abs(a) > 1e-3 for a in ref_adv.values())
    check(case, PPO_GRPO, [list(range(len(case.trajs)))], (estimator, ESTIMATORS[estimator]), ref_adv)


def test_forests_hold_the_cases_they_claim():
    trajs = SHAPES["branchy-B5"]
    rollouts = rollouts_of(trajs)
    forest = harts.build_forest([t.tokens for t in trajs])
    rows = build_loss_rows(forest, rollouts)
    targets: dict[int, set[int]] = {}
    for pred, tgt in zip(rows.predictor.tolist(), rows.target.tolist(), strict=True):
        targets.setdefault(pred, set()).add(tgt)
    assert any(len(t) > 1 for t in targets.values()), "a branch token predicting different targets"
    masked = {int(forest.trajectory_token_indices(b)[p]) for b, t in enumerate(trajs)
              for p in range(1, len(t.tokens)) if not t.mask[p]}  # fmt: skip
    assert masked & set(rows.target_index.tolist()), (
        "a token loss-bearing in one trajectory, masked in another"
    )
    assert int(forest.node_multiplicity[forest.trajectory_end_node[3]]) >= 2, "a duplicate"
    two = SHAPES["two-groups-B6"]
    assert not any(two[5].mask) and len({t.group for t in two}) == 2
    assert all(len(t.tokens) <= 20 for shape in SHAPES.values() for t in shape)


# ---- the budgeted step ----------------------------------------------------------------------------
BUDGETS = [1, 5]


STEP_CASES = [(f, o) for f, o, _ in crossed()]
STEP_IDS = [f"{f}-{o}" for f, o in STEP_CASES]


@pytest.mark.parametrize("budget", BUDGETS, ids=[f"budget{b}" for b in BUDGETS])
@pytest.mark.parametrize("family,objective", STEP_CASES, ids=STEP_IDS)
def test_budgeted_step_matches_per_trajectory_stock_and_unbudgeted_step(family, objective, budget):
    """Under budgets that cut the forest at every node (1) or inside nodes (5): loss and
    gradients against the reference, metrics against no budget."""
    case = case_of(family, "branchy-B5")
    config = _config(objective, Aggregation.SEQ_MEAN_TOKEN_MEAN)
    parts = [list(range(len(case.trajs)))]
    whole = check(case, config, parts)["metrics"][0]
    cut = check(case, config, parts, budget=budget)["metrics"][0]
    assert set(cut) == set(whole)
    for name in whole:
        assert abs(float(cut[name]) - float(whole[name])) <= 1e-5 * max(1.0, abs(float(whole[name]))), name


@pytest.mark.parametrize("family,objective", STEP_CASES, ids=STEP_IDS)
def test_micro_batches_of_whole_trees_run_once(family, objective):
    """Two trees, each its own micro-batch: each runs forward and backward once, on its own rows
    (no first pass without autograd), and the step still matches the reference."""
    case = case_of(family, "two-groups-B6")
    config = _config(objective, Aggregation.SEQ_MEAN_TOKEN_MEAN)
    result = check(case, config, [list(range(len(case.trajs)))], budget=40)["results"][0]
    assert result.num_micro_batches == 2 and result.num_cuts == 0
    assert result.part_forwards == 2


# ---- rollout_step ----------------------------------------------------------------------------------
def test_rollout_step_equals_forest_step_and_flat_layout():
    case = case_of("kimi_linear", "branchy-B5")
    config = _config("ppo-kl_k3-entropy", Aggregation.SEQ_MEAN_TOKEN_MEAN)
    rollouts = rollouts_of(case.trajs)
    whole, grads, _, _ = forest_step(case.model, rollouts, [list(range(len(rollouts)))], config)
    with torch.no_grad():  # fp32 rounding of either step is relative to the |terms|, as in check()
        scale = float(reference_loss(case, case.trajs, config, absolute=True))
    for share, budget in ((True, None), (False, None), (True, 4), (False, 4)):
        case.model.zero_grad(set_to_none=True)
        step = harts.rollout_step(case.model, rollouts, config, share_prefixes=share, budget_tokens=budget)
        assert step.moe is None and set(step.metrics) >= {"loss", "policy_loss", "kl", "entropy"}
        assert step.num_micro_batches > (1 if budget else 0)
        assert abs(float(step.loss) - float(whole)) <= LOSS_RTOL * scale
        errors = grad_relative_errors(param_grads(case.model), grads)
        assert max(errors.values()) <= GRAD_RTOL


def test_rollout_step_refuses_bad_input_before_compute():
    model = model_of("qwen3")
    calls = []
    handle = model.model.embed_tokens.register_forward_pre_hook(lambda *a: calls.append(1))
    good = Rollout([3, 4, 5, 6], rollout_logprobs=[0.0, -1.0, -1.0, -1.0], advantages=1.0)
    try:
        cases = [
            ([Rollout([3, 4, 500])], PolicyLossConfig(kind="sft"), r"trajectory 0, position 2: token id 500"),
            ([Rollout([3, 4, 5], advantages=1.0)], PolicyLossConfig(), "rollout_logprobs"),
            ([Rollout([3, 4, 5], rollout_logprobs=[0.0, -1.0, -1.0])], PolicyLossConfig(), "advantages"),
            ([good], PolicyLossConfig(kl_coef=0.1), "ref_logprobs"),
            ([good], PolicyLossConfig(aggregation="seq-mean-token-sum-norm"), "max_length"),
            ([Rollout([3, 4], loss_mask=[0, 1, 1])], PolicyLossConfig(kind="sft"), "loss_mask has 3 values"),
        ]
        for rollouts, config, match in cases:
            with pytest.raises(ValueError, match=match):
                harts.rollout_step(model, rollouts, config)
        with pytest.raises(ValueError, match="disagrees"):
            harts.rollout_step(model, [good], PolicyLossConfig(), budget_tokens=4,
                               run=harts.RunConfig(budget_tokens=8))  # fmt: skip
        forest = harts.build_forest([[3, 4, 5], [3, 4, 6]])
        other = build_loss_rows(
            harts.build_forest([[3, 4, 7], [3, 4, 6]]), [Rollout([3, 4, 7]), Rollout([3, 4, 6])]
        )
        with pytest.raises(ValueError, match="not built on this forest"):
            harts.forest_step(model, forest, other, PolicyLossConfig(kind="sft"))
        predictor, target = harts.next_token_rows(forest)
        bad_target = torch.tensor([4, 900, 5, 6])
        with pytest.raises(ValueError, match="row 1: target token id 900 is outside the model's vocabulary"):
            harts.forest_backward(model, forest, predictor, bad_target, lambda lp, en: lp.sum())
    finally:
        handle.remove()
    assert calls == [], "no model compute may run before the inputs are validated"
