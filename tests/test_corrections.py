"""Importance corrections on forests equal a per-trajectory loop, under budgets that cut trajectories.

Forest side: ``harts.forest_step`` in fp32 on a forest with shared prefixes (a shared response
prefix loss-bearing in several trajectories, a duplicate, a trajectory that is a prefix of
another), whole and under a 3-token budget that cuts trajectories across micro-batches. Reference
side, written here plainly: each trajectory alone through the stock fp64 forward, PPO's (or
GSPO's) term per loss token, the correction's weight from plain products and means of
rho = exp(old - behaviour) over the trajectory's loss tokens, then the aggregation as written.

Tolerances, from the arithmetic of the fp32 side (u = 2^-24, fp32's unit roundoff):

- loss: each per-row term is off by at most expm1(delta) from its log-prob (delta: the largest
  |fp32 row log-prob - fp64 reference| of the run, measured), plus the rounding of the old and
  behaviour log-probs to fp32 rows (at most |log-prob| u each, in the ratio and in a token-level
  rho) and of the weight and the term (a few u); the sum over R rows adds at most R u of the sum
  of |terms|. So the loss is off by at most ``loss_bound`` times the aggregation of |terms|; it is
  asserted, and so is the issue's criterion (1e-5 of that scale), which it is below.
- gradients: the project's bound, 1e-4 relative (``tests.reference.gradient_failures``).
- metrics: token means of per-row values cast to fp32 and summed in fp32 (R u relative), each
  value off by its derivative times the fp32 rounding of log rho.

The data keep every statistic away from its bounds (``MARGIN``), so both sides take the same
branch; bounds are put between neighbouring values of the data (in log space).
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

import harts
from harts.objectives import (
    Aggregation,
    Correction,
    LossKind,
    PolicyLossConfig,
    Rollout,
    build_loss_rows,
    compute_loss,
    normalizers_for,
)
from harts.rl.config import parse_rl_config
from harts.trainer.config_files import load_config
from tests.helpers import run_train, write_config, write_small_rollouts
from tests.reference import cached_model, fp64_copy, gradient_failures, param_grads

FAMILY = "qwen3"
VOCAB = 128
U32 = 2.0**-24  # fp32 unit roundoff
LOSS_RTOL = 1e-5  # the criterion, relative to the aggregation of |per-row terms|
MARGIN = 1e-4  # least |log statistic - log bound| and |ratio - clip edge| the data may have
BUDGET = 3  # unique tokens per micro-batch: cuts trajectories
CLIP = (0.2, 0.2)
GSPO_CLIP = (0.05, 0.08)


# ---- data ----------------------------------------------------------------------------------------
def _tokens() -> list[tuple[list[int], int, str]]:
    """(tokens, first loss position, group) of a forest with shared prefixes."""
    rng = random.Random(11)

    def seq(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    p, q, s = seq(5), seq(4), seq(4)
    t0 = p + s + seq(6)
    return [
        (t0, 5, "a"),
        (p + s + seq(5), 5, "a"),  # shares the loss-bearing response prefix s with t0
        (p + s[:2] + seq(7), 5, "a"),
        (list(t0), 5, "a"),  # a duplicate, with its own annotations
        (p + s, 6, "a"),  # a prefix of t0
        (p + seq(8), 5, "a"),
        (q + seq(9), 4, "b"),
        (q + seq(3) + seq(5), 7, "b"),
    ]


def _own_logprobs(model, tokens) -> list[float]:
    with torch.no_grad():
        ids = torch.tensor([tokens])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
    return [0.0] + logp.gather(1, ids[0, 1:, None])[:, 0].tolist()


def _rollouts(model) -> list[Rollout]:
    """Old log-probs near the model's own (PPO's ratio near 1, some clipped), behaviour log-probs
    off by a per-token and a per-trajectory log rho, so the corrections act on both sides."""
    g = np.random.default_rng(3)
    out = []
    for b, (tokens, start, group) in enumerate(_tokens()):
        n = len(tokens)
        own = _own_logprobs(model, tokens)
        old = [min(o + 0.1 * z, 0.0) for o, z in zip(own, g.standard_normal(n), strict=True)]
        shift = 0.12 * (b - 3.5) / 3.5
        log_rho = 0.25 * g.standard_normal(n) + shift
        behaviour = [min(o - r, 0.0) for o, r in zip(old, log_rho, strict=True)]
        mask = [p >= start for p in range(n)]
        adv = (1.0 + 0.8 * g.standard_normal(n)).tolist()
        out.append(Rollout(tokens, loss_mask=mask, rollout_logprobs=behaviour, old_logprobs=old,
                           advantages=adv, group_id=group))  # fmt: skip
    return out


def _positions(r: Rollout) -> list[int]:
    return [p for p in range(1, len(r.tokens)) if r.loss_mask[p]]


def _log_rho(r: Rollout) -> list[float]:
    return [r.old_logprobs[p] - r.rollout_logprobs[p] for p in _positions(r)]


def _statistics(rollouts, correction: Correction) -> list[float]:
    """Every log statistic the correction compares with its bounds (per token or per trajectory)."""
    if correction in (Correction.TOKEN_TIS, Correction.TOKEN_MIS):
        return [x for r in rollouts for x in _log_rho(r)]
    if correction is Correction.GEO_MIS:
        return [sum(_log_rho(r)) / len(_log_rho(r)) for r in rollouts]
    return [sum(_log_rho(r)) for r in rollouts]


def _between(values: list[float], rank: int) -> float:
    """exp of the midpoint between the ``rank``-th and the next smallest of ``values``."""
    v = sorted(values)
    return math.exp((v[rank] + v[rank + 1]) / 2)


def _config(rollouts, correction: Correction, kind=LossKind.PPO, mode=Aggregation.TOKEN_MEAN):
    """A config whose bounds sit between values of the data: some rows dropped, most kept."""
    stats = _statistics(rollouts, correction)
    n = len(stats)
    if correction is Correction.TOKEN_TIS:
        low, high = None, 1.2
    elif correction is Correction.TOKEN_MIS:
        low, high = 0.8, 1.25
    elif correction is Correction.SEQ_TIS:
        low, high = None, _between(stats, n - 3)
    else:
        low, high = _between(stats, 0), _between(stats, n - 3)
    for x in stats:
        for bound in (low, high):
            if bound is not None and abs(x - math.log(bound)) < MARGIN:
                raise AssertionError(f"test data put a log statistic {x} on the bound log {bound}")
    clip = GSPO_CLIP if kind is LossKind.GSPO else CLIP
    return PolicyLossConfig(kind=kind, clip_low=clip[0], clip_high=clip[1], aggregation=mode,
                            correction=correction, correction_low=low, correction_high=high)  # fmt: skip


# ---- the per-trajectory reference ----------------------------------------------------------------
def _weight(config: PolicyLossConfig, rhos: list[float], p_index: int) -> tuple[float, bool]:
    """(w, dropped) of one loss token from its trajectory's rhos, written out per correction."""
    lo, hi = config.correction_low, config.correction_high
    c = config.correction
    if c is Correction.TOKEN_TIS:
        return min(rhos[p_index], hi), rhos[p_index] > hi
    if c is Correction.TOKEN_MIS:
        keep = lo <= rhos[p_index] <= hi
        return (rhos[p_index] if keep else 0.0), not keep
    if c is Correction.SEQ_TIS:
        prod = math.prod(rhos)
        return min(prod, hi), prod > hi
    if c is Correction.SEQ_MIS:
        prod = math.prod(rhos)
        keep = lo <= prod <= hi
        return (prod if keep else 0.0), not keep
    geo = math.prod(rhos) ** (1.0 / len(rhos))
    keep = lo <= geo <= hi
    return (1.0 if keep else 0.0), not keep


def _margin(value: float, edges, what: str) -> None:
    for edge in edges:
        if abs(value - edge) < MARGIN:
            raise AssertionError(f"test data put a {what} {value} on the clip edge {edge}")


def _surrogate(adv, ratio, low, high, what):
    _margin(float(ratio.detach()), (1 - low, 1 + high), what)
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))


def reference_loss(lps, rollouts, config: PolicyLossConfig, absolute: bool = False):
    """The step's loss from per-trajectory loops; ``lps[b]`` [L - 1]: log-prob of token p at p - 1.
    ``absolute``: the aggregation of |per-row terms| instead (the scale of the rounding errors)."""
    low, high = config.clip()
    sums, counts = [], []
    for b, r in enumerate(rollouts):
        positions = _positions(r)
        rhos = [math.exp(x) for x in _log_rho(r)]
        lp = lps[b]
        if config.kind is LossKind.GSPO:
            seq = sum(float(lp[p - 1].detach()) - r.old_logprobs[p] for p in positions) / len(positions)
        total = 0.0
        for i, p in enumerate(positions):
            x, adv = lp[p - 1], r.advantages[p]
            if config.kind is LossKind.GSPO:  # GSPO-token: value = sequence ratio, gradient per token
                term = _surrogate(adv, torch.exp(seq + x - x.detach()), low, high, "sequence ratio")
            else:
                term = _surrogate(adv, torch.exp(x - r.old_logprobs[p]), low, high, "ratio")
            term = term * _weight(config, rhos, i)[0]
            total = total + (term.abs() if absolute else term)
        sums.append(total)
        counts.append(len(positions))
    mode = config.aggregation
    if mode is Aggregation.TOKEN_MEAN:
        return sum(sums) / sum(counts)
    if mode is Aggregation.SEQ_MEAN_TOKEN_SUM:
        return sum(sums) / len(sums)
    return sum(s / n for s, n in zip(sums, counts, strict=True)) / len(sums)


def reference_metrics(rollouts, config: PolicyLossConfig) -> dict[str, float]:
    """Token means over the step's loss tokens: k3 of KL(behaviour || old), |log rho|, dropped."""
    kl, absolute, dropped, tokens = 0.0, 0.0, 0, 0
    for r in rollouts:
        log_rho = _log_rho(r)
        rhos = [math.exp(x) for x in log_rho]
        for i, x in enumerate(log_rho):
            kl += rhos[i] - 1 - x
            absolute += abs(x)
            dropped += _weight(config, rhos, i)[1]
            tokens += 1
    name = (
        "correction_truncated_fraction" if config.correction_low is None else "correction_rejected_fraction"
    )
    return {"mismatch_kl": kl / tokens, "mismatch_log_rho_abs": absolute / tokens, name: dropped / tokens}


def _stock_logprobs(model, rollouts) -> list[torch.Tensor]:
    """[L - 1] log-prob of token p at p - 1, each trajectory alone through ``model``, with graph."""
    out = []
    for r in rollouts:
        ids = torch.tensor([list(r.tokens)])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        out.append(logp.gather(1, ids[0, 1:, None])[:, 0])
    return out


def _grads(loss, model) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return {
        n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named.items(), grads, strict=True)
    }


def loss_bound(delta: float, rollouts, rows: int) -> float:
    """The fp32 side's loss error over the aggregation of |terms| (the module docstring)."""
    return math.expm1(delta) + 3 * _largest(rollouts) * U32 + 4 * U32 + rows * U32


def _largest(rollouts) -> float:
    """The largest |old or behaviour log-prob| at a loss position."""
    return max(abs(r.old_logprobs[p]) + abs(r.rollout_logprobs[p]) for r in rollouts for p in _positions(r))


# ---- tests ---------------------------------------------------------------------------------------
CASES = [
    (Correction.TOKEN_TIS, LossKind.PPO, Aggregation.TOKEN_MEAN),
    (Correction.TOKEN_MIS, LossKind.PPO, Aggregation.SEQ_MEAN_TOKEN_MEAN),
    (Correction.SEQ_TIS, LossKind.PPO, Aggregation.SEQ_MEAN_TOKEN_SUM),
    (Correction.SEQ_MIS, LossKind.PPO, Aggregation.TOKEN_MEAN),
    (Correction.GEO_MIS, LossKind.PPO, Aggregation.SEQ_MEAN_TOKEN_MEAN),
    (Correction.SEQ_MIS, LossKind.GSPO, Aggregation.SEQ_MEAN_TOKEN_MEAN),
]
IDS = [f"{c.value}-{k.value}-{m.value}" for c, k, m in CASES]


@pytest.mark.parametrize("budget", [None, BUDGET], ids=["whole", f"budget{BUDGET}"])
@pytest.mark.parametrize("correction,kind,mode", CASES, ids=IDS)
def test_a_correction_on_a_forest_equals_the_per_trajectory_loop(correction, kind, mode, budget):
    model = cached_model(FAMILY)
    rollouts = _rollouts(model)
    config = _config(rollouts, correction, kind, mode)
    model64 = fp64_copy(model)
    lp64 = _stock_logprobs(model64, rollouts)
    ref = reference_loss(lp64, rollouts, config)
    ref_grads = _grads(ref, model64)
    stock32 = _grads(reference_loss(_stock_logprobs(model, rollouts), rollouts, config), model)
    with torch.no_grad():
        scale = float(reference_loss(lp64, rollouts, config, absolute=True))

    forest = harts.build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts)
    model.zero_grad(set_to_none=True)
    result = harts.forest_step(model, forest, rows, config, budget_tokens=budget)
    if budget is not None:
        assert result.num_cuts > 0 and max(result.tokens_per_micro_batch) <= budget
    where = zip(rows.trajectory.tolist(), rows.position.tolist(), strict=True)
    exact = torch.stack([lp64[b][p - 1].detach() for b, p in where])
    delta = float((result.logprob.double() - exact).abs().max())
    err = abs(float(result.loss) - float(ref.detach())) / scale
    bound = loss_bound(delta, rollouts, rows.num_rows)
    assert err <= bound and err <= LOSS_RTOL, f"loss error {err:.2e} of scale {scale:.3g}, bound {bound:.2e}"
    failures = gradient_failures(param_grads(model), ref_grads, stock32)
    assert not failures, f"gradients off: {failures}"

    expected = reference_metrics(rollouts, config)
    for name, value in expected.items():
        got = float(result.metrics[name])
        if name.startswith("correction_"):
            tol = 4 * U32
        else:  # log rho from fp32 rows: off by 2 |log-prob| u; k3's slope is |rho - 1| <= rho + 1
            slope = max(math.exp(abs(x)) for r in rollouts for x in _log_rho(r)) + 1
            tol = rows.num_rows * U32 * abs(value) + 2 * _largest(rollouts) * U32 * slope
        assert abs(got - value) <= tol, f"{name}: {got} vs {value} (tolerance {tol:.2e})"
    dropped = next(v for n, v in expected.items() if n.startswith("correction_"))
    assert 0 < dropped < 1  # the data exercise both sides of the bounds


@pytest.mark.parametrize("correction", list(Correction))
def test_subsets_of_rows_add_up_to_the_whole(correction):
    """Sequence weights read each trajectory's whole log-ratio, so any split of the rows (one row
    per part here) gives the whole loss: the sum of float64 terms, off by R float64 roundings."""
    model = cached_model(FAMILY)
    rollouts = _rollouts(model)
    config = _config(rollouts, correction, mode=Aggregation.SEQ_MEAN_TOKEN_MEAN)
    forest = harts.build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts, dtype=torch.float64)
    norm = normalizers_for(rows)
    lp = rows.old_logprob - 0.05 * torch.cos(torch.arange(rows.num_rows, dtype=torch.float64))
    whole = compute_loss(lp, None, rows, config, norm)[0]
    parts = sum(compute_loss(lp[[r]], None, rows.select(torch.tensor([r])), config, norm)[0]
                for r in range(rows.num_rows))  # fmt: skip
    assert abs(float(parts - whole)) <= rows.num_rows * 2.0**-53 * float(whole.abs()) * 4


def test_old_logprobs_passed_to_the_step_equal_the_rollouts():
    """``forest_step(old_logprob=...)`` on rollouts without old log-probs gives the loss of rollouts
    that carry them: the same float64 values (rows in float64), the same sums."""
    model = cached_model(FAMILY)
    rollouts = _rollouts(model)
    config = _config(rollouts, Correction.SEQ_MIS)
    forest = harts.build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts, dtype=torch.float64)
    bare = [Rollout(r.tokens, loss_mask=r.loss_mask, rollout_logprobs=r.rollout_logprobs,
                    advantages=r.advantages, group_id=r.group_id) for r in rollouts]  # fmt: skip
    bare_rows = build_loss_rows(forest, bare, dtype=torch.float64)
    assert not bare_rows.has_old_logprob and bare_rows.trajectory_log_rho is None
    results = []
    for step_rows, old in ((rows, None), (bare_rows, rows.old_logprob)):
        model.zero_grad(set_to_none=True)
        result = harts.forest_step(model, forest, step_rows, config, budget_tokens=BUDGET, old_logprob=old)
        results.append((float(result.loss), param_grads(model)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-12, abs=0)
    for name, grad in results[0][1].items():
        assert torch.allclose(grad, results[1][1][name], rtol=1e-6, atol=0), name


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"correction": "tis"},
         "correction must be one of token-tis, token-mis, seq-tis, seq-mis, geo-mis, got 'tis'"),
        ({"correction_high": 2.0}, "correction_high given without a correction"),
        ({"correction_low": 0.5, "correction_high": 2.0}, "correction_low and correction_high given without"),
        ({"correction": "seq-mis", "correction_low": 0.5}, "'seq-mis' needs correction_high"),
        ({"correction": "geo-mis", "correction_high": 2.0}, "'geo-mis' needs correction_low"),
        ({"correction": "token-tis", "correction_low": 0.5, "correction_high": 2.0},
         "'token-tis' truncates at correction_high only; correction_low = 0.5"),
        ({"correction": "token-mis", "correction_low": 2.0, "correction_high": 0.5},
         "correction_low must be <= correction_high, got 2.0 > 0.5"),
        ({"correction": "seq-tis", "correction_high": 0.0},
         "correction_high must be a positive finite number, got 0.0"),
        ({"correction": "seq-mis", "correction_low": -1.0, "correction_high": 2.0},
         "correction_low must be a positive finite number, got -1.0"),
        ({"correction": "seq-tis", "correction_high": math.inf}, "positive finite number, got inf"),
        ({"kind": "sft", "correction": "token-tis", "correction_high": 2.0},
         "kind 'sft' reads none: use one that does (ppo, gspo)"),
    ],
)  # fmt: skip
def test_a_bad_correction_config_is_refused(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PolicyLossConfig(**fields)


def test_a_correction_without_old_or_behaviour_logprobs_is_refused_before_the_model_runs():
    model = cached_model(FAMILY)
    rollouts = _rollouts(model)
    config = _config(rollouts, Correction.TOKEN_TIS)
    forest = harts.build_forest([r.tokens for r in rollouts])

    class Refuses(torch.nn.Module):  # the checks come first: a model that runs fails the test
        config = model.config

        def forward(self, *args, **kwargs):
            raise AssertionError("the model ran")

    for drop, message in (("old_logprobs", "needs the old policy's log-probs apart from the behaviour's"),
                          ("rollout_logprobs", "needs the behaviour policy's log-probs")):  # fmt: skip
        lacking = [Rollout(**{**r.__dict__, drop: None}) for r in rollouts]
        rows = build_loss_rows(forest, lacking)
        with pytest.raises(ValueError, match=message):
            harts.forest_step(Refuses(), forest, rows, config)


def test_the_objective_section_reads_a_correction(tmp_path):
    objective = {"kind": "ppo", "advantage": "grpo", "correction": "seq-mis", "correction_low": 0.5,
                 "correction_high": 2.0}  # fmt: skip
    path = write_config(tmp_path / "run.toml", objective=objective, ppo={"old_logprobs": "policy"})
    loss = load_config(path).objective.loss_config()
    assert (loss.correction, loss.correction_low, loss.correction_high) == (Correction.SEQ_MIS, 0.5, 2.0)
    for ppo, got in (
        ({}, "no [ppo] section"),
        ({"ppo": {"old_logprobs": "rollout"}}, "ppo.old_logprobs = 'rollout'"),
    ):
        path = write_config(tmp_path / "bad.toml", objective=objective, **ppo)
        with pytest.raises(ValueError, match=r"objective.correction = 'seq-mis' .* set \[ppo\] old_logprobs"):
            load_config(path)
        with pytest.raises(ValueError, match=got.replace("[", r"\[").replace("]", r"\]")):
            load_config(path)
    path = write_config(tmp_path / "typo.toml", objective={"kind": "ppo", "correction": "seq_mis"})
    with pytest.raises(ValueError, match="typo.toml: objective: correction must be one of .*got 'seq_mis'"):
        load_config(path)


def test_harts_train_records_the_mismatch_every_update(tmp_path):
    data = write_small_rollouts(tmp_path / "small.jsonl")
    tables = dict(
        model={"tiny": FAMILY}, data={"path": str(data), "rollouts_per_step": 9},
        objective={"kind": "ppo", "advantage": "grpo", "correction": "token-tis", "correction_high": 2.0},
        ppo={"epochs": 2, "mini_batches": 1}, run={"budget_tokens": 24}, logging={"plot": False},
    )  # fmt: skip
    config = write_config(tmp_path / "run.toml", {"steps": 2}, tables)
    assert run_train(config, tmp_path / "out") == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4  # 2 steps of rollouts x 2 PPO epochs
    for record in records:
        for key in ("mismatch_kl", "mismatch_log_rho_abs", "mismatch_log_rho_abs_max",
                    "correction_truncated_fraction"):  # fmt: skip
            assert math.isfinite(record[key]), key
        assert 0 <= record["correction_truncated_fraction"] <= 1
        assert record["mismatch_log_rho_abs_max"] >= record["mismatch_log_rho_abs"] > 0


def test_harts_rl_refuses_a_correction(tmp_path):
    """harts rl samples with the policy it trains: its rollouts' log-probs are the old policy's."""
    objective = {"advantage": "grpo", "correction": "token-tis", "correction_high": 2.0}
    table = {"model": {"tiny": FAMILY}, "task": {"turns": 1}, "objective": objective}
    with pytest.raises(ValueError, match="objective.correction: harts rl samples with the policy it trains"):
        parse_rl_config(table, tmp_path)
