"""Objectives on forest rows against a per-trajectory textbook reference (loops, fp64).

The "model" is a leaf tensor W [K, vocab] with one row per distinct prefix: the log-prob of the
token at position p is log_softmax(W[prefix tokens[:p]])[tokens[p]]. The forest side reaches W
through unique predictors (rows, one logit row per unique predicting token, fp32); the reference
reaches it through each trajectory's own prefixes, position by position. Loss values must agree
to 1e-5 and gradients w.r.t. W to 1e-4 (relative).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.forest import build_forest
from harts.objectives import (
    Aggregation,
    KLEstimator,
    LossKind,
    PolicyLossConfig,
    Rollout,
    build_loss_rows,
    compute_loss,
    normalizers_for,
    ppo_clip_loss,
    unique_predictors,
)

VOCAB = 9
MAX_LENGTH = 32.0  # Dr. GRPO's constant for SEQ_MEAN_TOKEN_SUM_NORM
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


# ---- data ----------------------------------------------------------------------------------------
def random_tokens(seed: int, num: int = 12) -> list[np.ndarray]:
    """Trajectories with shared prefixes at many depths, one duplicate and one prefix of another."""
    g = np.random.default_rng(seed)
    prompts = [g.integers(0, VOCAB, size=int(g.integers(2, 5))) for _ in range(3)]
    trajs: list[np.ndarray] = []
    for _ in range(num):
        if trajs and g.random() < 0.6:  # branch off an earlier trajectory
            base = trajs[int(g.integers(len(trajs)))]
            cut = int(g.integers(1, len(base) + 1))
            t = np.concatenate([base[:cut], g.integers(0, VOCAB, size=int(g.integers(1, 6)))])
        else:
            t = np.concatenate(
                [prompts[int(g.integers(3))], g.integers(0, VOCAB, size=int(g.integers(1, 8)))]
            )
        trajs.append(t)
    trajs.append(trajs[1].copy())  # duplicate
    trajs.append(trajs[2][: max(2, len(trajs[2]) - 2)].copy())  # prefix of another
    return trajs


def prefix_keys(trajs) -> dict[tuple, int]:
    keys: dict[tuple, int] = {}
    for t in trajs:
        for p in range(1, len(t) + 1):
            keys.setdefault(tuple(t[:p].tolist()), len(keys))
    return keys


def reference_logprobs(W, tokens, keys, positions):
    """[n] log-probs and entropies of ``positions`` of one trajectory, from its own prefixes."""
    lps, ents = [], []
    for p in positions:
        logp = torch.log_softmax(W[keys[tuple(tokens[:p].tolist())]], -1)
        lps.append(logp[int(tokens[p])])
        ents.append(-(logp.exp() * logp).sum())
    return lps, ents


def annotated_batch(seed: int, W: torch.Tensor, keys) -> list[Rollout]:
    """Random masks (one trajectory fully masked), advantages, rewards, groups, noisy log-probs."""
    g = np.random.default_rng(seed + 1000)
    trajs = random_tokens(seed)
    rollouts = []
    for i, t in enumerate(trajs):
        mask = g.random(len(t)) < 0.7
        mask[0] = False
        if i == 3:
            mask[:] = False
        with torch.no_grad():
            lp, _ = reference_logprobs(W.double(), t, keys, range(1, len(t)))
        true = np.array([0.0] + [float(x) for x in lp])
        rollouts.append(
            Rollout(
                tokens=t,
                loss_mask=mask,
                rollout_logprobs=np.minimum(true + 0.5 * g.standard_normal(len(t)), 0.0),
                ref_logprobs=np.minimum(true + 0.5 * g.standard_normal(len(t)), 0.0),
                advantages=g.standard_normal(len(t)),
                reward=float(g.standard_normal()),
                group_id=int(g.integers(3)),
            )
        )
    return rollouts


def make_model(seed: int, trajs):
    keys = prefix_keys(trajs)
    gen = torch.Generator().manual_seed(seed)
    W = (1.5 * torch.randn(len(keys), VOCAB, generator=gen)).requires_grad_()
    return W, keys


# ---- forest side ---------------------------------------------------------------------------------
def forest_logprobs(W, forest, rows, rollouts, keys):
    """Per-row (logprob [R], entropy [R]) with logits once per unique predictor."""
    key_of_unique = torch.full((forest.num_tokens,), -1, dtype=torch.long)
    for i, r in enumerate(rollouts):
        idx = forest.trajectory_token_indices(i)
        k = torch.tensor([keys[tuple(r.tokens[: p + 1].tolist())] for p in range(len(r.tokens))])
        assert bool(((key_of_unique[idx] == -1) | (key_of_unique[idx] == k)).all())
        key_of_unique[idx] = k
    unique_index, inverse = unique_predictors(rows)
    logp = torch.log_softmax(W[key_of_unique[unique_index]], -1)  # [U, V]
    entropy = -(logp.exp() * logp).sum(-1)
    return logp[inverse, rows.target], entropy[inverse]


def forest_loss(W, rollouts_parts, keys, config, share_prefixes=True):
    """Sum of the micro-batch losses of a step split into ``rollouts_parts``; grads land in W."""
    built = []
    for part in rollouts_parts:
        forest = build_forest([r.tokens for r in part], share_prefixes=share_prefixes)
        built.append((forest, build_loss_rows(forest, part, dtype=W.dtype), part))
    norm = normalizers_for([rows for _, rows, _ in built], max_length=MAX_LENGTH)
    total, metrics = 0.0, []
    for forest, rows, part in built:
        lp, ent = forest_logprobs(W, forest, rows, part, keys)
        loss, m = compute_loss(lp, ent, rows, config, norm)
        loss.backward()
        total += loss.detach().double()
        metrics.append(m)
    return total, metrics


# ---- textbook reference --------------------------------------------------------------------------
def _clip_max(adv, ratio, low, high):
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high))


def reference_loss(W, rollouts, keys, config: PolicyLossConfig, absolute: bool = False):
    """Loop over trajectories and positions, fp64, then the aggregation as written in the papers.

    ``absolute`` aggregates |term| instead: the scale that fp32 rounding errors are relative to.
    """
    low, high = config.clip()
    seq_sums, seq_counts = [], []
    for r in rollouts:
        positions = [p for p in range(1, len(r.tokens)) if r.loss_mask[p]]
        if not positions:
            continue
        lps, ents = reference_logprobs(W, r.tokens, keys, positions)
        old = [float(r.rollout_logprobs[p]) for p in positions]
        if config.kind is LossKind.GSPO:
            mean_log_ratio = sum(lp.detach() - o for lp, o in zip(lps, old, strict=True)) / len(positions)
        terms = []
        for j, p in enumerate(positions):
            lp, adv = lps[j], float(r.advantages[p])
            if config.kind is LossKind.SFT:
                term = -lp
            elif config.kind is LossKind.PPO:
                term = _clip_max(adv, torch.exp(lp - old[j]), low, high)
                if config.dual_clip is not None and adv < 0:
                    term = torch.minimum(term, torch.tensor(-adv * config.dual_clip, dtype=torch.float64))
            else:  # GSPO-token: the sequence ratio's value, this token's gradient
                term = _clip_max(adv, torch.exp(lp - lp.detach() + mean_log_ratio), low, high)
            if config.kl_coef:
                lr = float(r.ref_logprobs[p]) - lp
                kl = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - lr - 1}[config.kl_estimator.value]
                term = term + config.kl_coef * kl
            term = term - config.entropy_coef * ents[j]
            terms.append(term.abs() if absolute else term)
        seq_sums.append(sum(terms))
        seq_counts.append(len(terms))
    S, T = len(seq_sums), sum(seq_counts)
    agg = config.aggregation
    if agg is Aggregation.TOKEN_MEAN:
        return sum(seq_sums) / T
    if agg is Aggregation.SEQ_MEAN_TOKEN_SUM:
        return sum(seq_sums) / S
    if agg is Aggregation.SEQ_MEAN_TOKEN_MEAN:
        return sum(s / n for s, n in zip(seq_sums, seq_counts, strict=True)) / S
    return sum(s / MAX_LENGTH for s in seq_sums) / S


def reference_loss_and_grad(W, rollouts, keys, config):
    W64 = W.detach().double().requires_grad_()
    loss = reference_loss(W64, rollouts, keys, config)
    loss.backward()
    return loss.detach(), W64.grad


def rel_err(x, ref) -> float:
    x, ref = torch.as_tensor(x).double(), torch.as_tensor(ref).double()
    return float((x - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


CONFIGS = {
    "sft": PolicyLossConfig(kind=LossKind.SFT),
    "sft-kl_k3": PolicyLossConfig(kind=LossKind.SFT, kl_coef=0.3),
    "ppo": PolicyLossConfig(kind=LossKind.PPO),
    "ppo-cliphigher-dual1.5": PolicyLossConfig(kind="ppo", clip_low=0.2, clip_high=0.28, dual_clip=1.5),
    "ppo-kl_k1": PolicyLossConfig(kind=LossKind.PPO, kl_coef=0.1, kl_estimator=KLEstimator.K1),
    "ppo-kl_k2-entropy": PolicyLossConfig(kind="ppo", kl_coef=0.2, kl_estimator="k2", entropy_coef=0.01),
    "gspo": PolicyLossConfig(kind=LossKind.GSPO, clip_low=0.05, clip_high=0.08),
    "gspo-kl_k3-entropy": PolicyLossConfig(kind=LossKind.GSPO, clip_low=0.05, clip_high=0.08, kl_coef=0.1,
                                           entropy_coef=0.02),
}  # fmt: skip
AGGREGATIONS = list(Aggregation)


def run_case(seed, config, parts=1, share_prefixes=True, dtype=torch.float64):
    """(loss error, gradient error, per-micro-batch metrics) of the forest path against the reference.

    In fp64 the loss error is relative to the reference loss. In fp32 it is relative to the same
    aggregation of |per-row terms|: advantages of both signs make the loss a difference of large
    sums, and fp32 rounding of the inputs is relative to those sums, not to their difference.
    """
    trajs = random_tokens(seed)
    W, keys = make_model(seed, trajs)
    rollouts = annotated_batch(seed, W, keys)
    order = np.random.default_rng(seed).permutation(len(rollouts))
    split = [[rollouts[i] for i in chunk] for chunk in np.array_split(order, parts)]
    W_forest = W.detach().to(dtype).requires_grad_()
    loss, metrics = forest_loss(W_forest, split, keys, config, share_prefixes)
    W64 = W.detach().double().requires_grad_()
    ref = reference_loss(W64, rollouts, keys, config)
    ref.backward()
    if dtype == torch.float64:
        loss_err = rel_err(loss, ref.detach())
    else:
        with torch.no_grad():
            scale = reference_loss(W64, rollouts, keys, config, absolute=True)
        loss_err = float((loss - ref.detach()).abs() / scale)
    return loss_err, rel_err(W_forest.grad, W64.grad), metrics


DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("aggregation", AGGREGATIONS, ids=[a.value for a in AGGREGATIONS])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forest_rows_match_per_trajectory_reference(name, aggregation, dtype):
    config = PolicyLossConfig(**{**CONFIGS[name].__dict__, "aggregation": aggregation})
    for seed in (0, 1) if dtype == "fp64" else (0,):
        loss_err, grad_err, metrics = run_case(seed, config, dtype=DTYPES[dtype])
        assert loss_err <= LOSS_RTOL, f"seed {seed}: loss rel err {loss_err:.2e}"
        assert grad_err <= GRAD_RTOL, f"seed {seed}: grad rel err {grad_err:.2e}"
    if config.kind is not LossKind.SFT:  # the data must exercise the clip
        assert float(metrics[0]["clip_fraction"]) > 0
    if config.dual_clip is not None:
        assert float(metrics[0]["dual_clip_fraction"]) > 0


@pytest.mark.parametrize("aggregation", AGGREGATIONS, ids=[a.value for a in AGGREGATIONS])
@pytest.mark.parametrize("name", ["ppo-cliphigher-dual1.5", "gspo-kl_k3-entropy", "sft-kl_k3"])
@pytest.mark.parametrize("parts", [3], ids=["mb3"])
def test_micro_batches_with_global_normalizers_match_whole_step(name, aggregation, parts):
    config = PolicyLossConfig(**{**CONFIGS[name].__dict__, "aggregation": aggregation})
    loss_err, grad_err, metrics = run_case(2, config, parts=parts)
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL, (loss_err, grad_err)
    _, _, whole_metrics = run_case(2, config, parts=1)
    for k, v in whole_metrics[0].items():
        assert rel_err(sum(m[k] for m in metrics), v) <= LOSS_RTOL, k


@pytest.mark.parametrize("name", ["ppo-cliphigher-dual1.5", "gspo"])
def test_flat_layout_matches_reference(name):
    loss_err, grad_err, _ = run_case(3, CONFIGS[name], share_prefixes=False)
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL


def test_batch_covers_branches_mixed_masks_and_duplicates():
    trajs = random_tokens(0)
    W, keys = make_model(0, trajs)
    rollouts = annotated_batch(0, W, keys)
    forest = build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts)
    # a branch token: one predictor, several distinct targets
    pairs = set(zip(rows.predictor.tolist(), rows.target.tolist(), strict=True))
    preds = [p for p, _ in pairs]
    assert any(preds.count(p) > 1 for p in preds)
    # a unique token loss-bearing in one trajectory and masked in another
    bearing = set(rows.target_index.tolist())
    masked = {
        int(forest.trajectory_token_indices(i)[p])
        for i, r in enumerate(rollouts)
        for p in range(1, len(r.tokens))
        if not r.loss_mask[p]
    }
    assert bearing & masked
    assert forest.node_multiplicity[forest.trajectory_end_node[1]] >= 2  # the duplicate
    unique_index, inverse = unique_predictors(rows)
    assert torch.equal(unique_index[inverse], rows.predictor) and unique_index.numel() < rows.num_rows


def test_rows_of_a_small_forest_by_hand():
    rollouts = [
        Rollout([5, 6, 7], loss_mask=[0, 1, 1], advantages=[0.0, 1.0, 2.0]),
        Rollout([5, 6, 8], loss_mask=[0, 0, 1], advantages=[0.0, 3.0, 4.0]),
    ]
    forest = build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts, dtype=torch.float64)
    idx0, idx1 = forest.trajectory_token_indices(0), forest.trajectory_token_indices(1)
    assert rows.trajectory.tolist() == [0, 0, 1] and rows.position.tolist() == [1, 2, 2]
    assert rows.target.tolist() == [6, 7, 8]
    assert rows.predictor.tolist() == [int(idx0[0]), int(idx0[1]), int(idx1[1])]
    assert rows.predictor[1] == rows.predictor[2]  # the branch token predicts both children
    assert rows.advantage.tolist() == [1.0, 2.0, 4.0] and rows.has_advantage
    assert not rows.has_rollout_logprob and rows.rollout_logprob.tolist() == [0.0, 0.0, 0.0]
    assert rows.tokens_per_trajectory.tolist() == [2, 1]


def test_gspo_token_equals_sequence_level_gspo_with_sequence_advantages():
    """With one advantage per sequence and seq-mean-token-mean, GSPO-token is GSPO (Zheng et al. 2025)."""
    trajs = random_tokens(4)
    W, keys = make_model(4, trajs)
    rollouts = [
        Rollout(r.tokens, r.loss_mask, r.rollout_logprobs, r.ref_logprobs, advantages=float(r.reward))
        for r in annotated_batch(4, W, keys)
    ]
    config = PolicyLossConfig(kind=LossKind.GSPO, clip_low=0.05, clip_high=0.08,
                              aggregation=Aggregation.SEQ_MEAN_TOKEN_MEAN)  # fmt: skip
    loss, _ = forest_loss(W, [rollouts], keys, config)
    W64 = W.detach().double().requires_grad_()
    seq_losses = []
    for r in rollouts:
        positions = [p for p in range(1, len(r.tokens)) if r.loss_mask[p]]
        if positions:
            lps, _ = reference_logprobs(W64, r.tokens, keys, positions)
            s = torch.exp(sum(lp - float(r.rollout_logprobs[p]) for lp, p in zip(lps, positions, strict=True))
                          / len(positions))  # fmt: skip
            seq_losses.append(_clip_max(float(r.advantages), s, 0.05, 0.08))
    ref = sum(seq_losses) / len(seq_losses)
    ref.backward()
    assert rel_err(loss, ref.detach()) <= LOSS_RTOL and rel_err(W.grad, W64.grad) <= GRAD_RTOL


def test_missing_annotations_and_bad_shapes_are_refused():
    rollouts = [Rollout([1, 2, 3], advantages=1.0), Rollout([1, 2, 4], advantages=-1.0)]
    forest = build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts)
    lp = torch.full((rows.num_rows,), -1.0, requires_grad=True)
    norm = normalizers_for(rows)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_loss(lp, None, rows, PolicyLossConfig(), norm)
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(lp, None, rows, PolicyLossConfig(kind="sft", kl_coef=0.1), norm)
    with pytest.raises(ValueError, match="entropy"):
        compute_loss(lp, None, rows, PolicyLossConfig(kind="sft", entropy_coef=0.1), norm)
    with pytest.raises(ValueError, match=r"shape \[R\]"):
        compute_loss(lp[:2], None, rows, PolicyLossConfig(kind="sft"), norm)
    with pytest.raises(ValueError, match="max_length"):
        compute_loss(
            lp, None, rows, PolicyLossConfig(kind="sft", aggregation="seq-mean-token-sum-norm"), norm
        )
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyLossConfig(dual_clip=0.5)
    # On-policy: old log-probs = the new ones, detached; the gradient is -A * grad(logprob) / T.
    loss = ppo_clip_loss(lp, rows, old_logprob=lp.detach()).sum() / rows.num_rows
    loss.backward()
    assert torch.allclose(lp.grad, -rows.advantage / rows.num_rows)


def test_step_without_rows_gives_zero_loss():
    rollouts = [Rollout([1, 2, 3], loss_mask=[0, 0, 0], advantages=1.0, rollout_logprobs=[0.0, -1.0, -1.0])]
    forest = build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts)
    lp = torch.zeros(0, requires_grad=True)
    for agg in Aggregation:
        norm = normalizers_for(rows, max_length=8)
        loss, _ = compute_loss(lp, None, rows, PolicyLossConfig(aggregation=agg), norm)
        assert float(loss.detach()) == 0.0


def test_loss_path_never_reads_tensors_back_to_the_host(monkeypatch):
    """A CPU proxy for 'no host syncs': .item(), bool(), float(), int() and .tolist() are forbidden."""
    trajs = random_tokens(0)
    W, keys = make_model(0, trajs)
    rollouts = annotated_batch(0, W, keys)
    forest = build_forest([r.tokens for r in rollouts])
    rows = build_loss_rows(forest, rollouts)
    lp, ent = forest_logprobs(W, forest, rows, rollouts, keys)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync inside the loss")

    for method in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, method, refuse)
    for config in CONFIGS.values():
        for agg in Aggregation:
            norm = normalizers_for([rows], max_length=MAX_LENGTH)
            cfg = PolicyLossConfig(**{**config.__dict__, "aggregation": agg})
            loss, _ = compute_loss(lp, ent, rows, cfg, norm)
            loss.backward(retain_graph=True)
    monkeypatch.undo()
    assert W.grad is not None
