"""Forward-only log-probs under a token budget (``harts.forest_logprobs``) against the stock forward.

- Per family (full attention, Gated DeltaNet and KDA hybrids with MoE, MoE full attention, short
  convolutions, Mamba-2) and budget (one token per micro-batch up to the whole forest): every
  trajectory's log-probs and entropies equal those of the stock Hugging Face forward of that
  trajectory alone, in fp64 (linear-attention kernels exact) and in fp32, within the logit bound
  of ``tests/reference.py`` (1e-4; a log-prob and an entropy move by no more than the logits do
  in the tests that derive it, ``tests/test_equivalence.py``, ``tests/test_model_setups.py``).
- Against harts itself: bit for bit the log-probs of ``harts.forward`` when the forest is one
  micro-batch; within the split bound of ``tests/test_split.py`` (1e-5) when it is cut; and bit
  for bit the row log-probs of ``harts.rollout_step`` under the same budget (the old policy's
  log-probs of an unchanged model give a PPO ratio of exactly 1).
- The plan is the step's (same micro-batches), each part runs once, nothing keeps a graph, and
  the tensor peak follows the budget, not the forest.
- Alignment with ``Rollout``'s per-token fields (position 0 filled), loss positions only, and the
  refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch

import harts
from harts.bench.memory import tensor_peak_bytes
from harts.tiny import FAMILIES, tiny_model
from tests.helpers import EDGE_SHAPES
from tests.reference import LOGIT_ATOL, cached_model, exact_linear_kernels, fp64_copy, stock_logits

SPLIT_ATOL = 1e-5  # budgeted against unbudgeted log-probs (tests/test_split.py)

TRAJECTORIES = (
    EDGE_SHAPES["stacked-branches"] + EDGE_SHAPES["prefix-of-another"] + EDGE_SHAPES["one-token-trajectories"]
    + EDGE_SHAPES["long-branch-T130"]
)  # fmt: skip
# full attention; Gated DeltaNet + gated attention, MoE; KDA + MLA, MoE; MoE full attention; short
# convolutions; Mamba-2 (each where the installed transformers has it)
EXACT_FAMILIES = [f for f in ("qwen3", "qwen3_next", "bailing_hybrid", "qwen3_moe", "lfm2", "nemotron_h")
                  if f in FAMILIES]  # fmt: skip
BUDGETS = [1, 3, 40, None]  # 40 cuts inside the 130-token node; None: one micro-batch
TEMPERATURE = 0.7


def model_of(family):
    return cached_model(family, seed=13)


def stock_values(logits: torch.Tensor, trajectory, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock log-probs and entropies [L - 1] from a trajectory's logits [L, V]."""
    logp = torch.log_softmax(logits[:-1] / temperature, -1)
    lp = logp.gather(1, torch.as_tensor(trajectory[1:], dtype=torch.long)[:, None])[:, 0]
    return lp, -(logp.exp() * logp).sum(-1)


@functools.cache
def stock_references(family: str, temperature: float):
    """Per trajectory: (fp64 log-probs, fp64 entropies, fp32 log-probs, fp32 entropies), each [L - 1]."""
    model = model_of(family)
    model64 = fp64_copy(model)
    out = []
    with torch.no_grad():
        with exact_linear_kernels(model64):
            exact = [stock_values(stock_logits(model64, t), t, temperature) for t in TRAJECTORIES]
        plain = [stock_values(stock_logits(model, t), t, temperature) for t in TRAJECTORIES]
    for (lp64, ent64), (lp32, ent32) in zip(exact, plain, strict=True):
        out.append((lp64, ent64, lp32, ent32))
    return out


def worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g.double() - w.double()).abs().max().item() if w.numel() else 0.0)
               for g, w in zip(got, want, strict=True))  # fmt: skip


@pytest.mark.parametrize("budget", BUDGETS, ids=[f"budget{b}" for b in BUDGETS])
@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_logprobs_match_stock_per_trajectory(family, budget):
    model = model_of(family)
    temperature = TEMPERATURE if family == "qwen3_next" else 1.0
    refs = stock_references(family, temperature)
    result = harts.forest_logprobs(model, TRAJECTORIES, budget_tokens=budget, entropies=True,
                                   temperature=temperature)  # fmt: skip
    if budget is not None:
        assert result.num_micro_batches > 2 and result.rows.num_cuts >= 2
        assert max(result.rows.tokens_per_micro_batch) <= budget
    assert result.rows.part_forwards == result.num_micro_batches, "each part runs once"
    for i, t in enumerate(TRAJECTORIES):
        assert result.logprobs[i].shape == (len(t),) and result.entropies[i].shape == (len(t),)
        assert result.logprobs[i][0] == 0 and result.entropies[i][0] == 0, "position 0: the fill"
        assert torch.equal(result.scored[i], torch.arange(len(t)) > 0)
    logprobs = [lp[1:] for lp in result.logprobs]
    entropies = [ent[1:] for ent in result.entropies]
    errors = {
        "logprob vs fp64": worst(logprobs, [r[0] for r in refs]),
        "entropy vs fp64": worst(entropies, [r[1] for r in refs]),
        "logprob vs fp32": worst(logprobs, [r[2] for r in refs]),
        "entropy vs fp32": worst(entropies, [r[3] for r in refs]),
    }
    bad = {k: v for k, v in errors.items() if v > LOGIT_ATOL}
    assert not bad, f"{bad} > {LOGIT_ATOL}"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_against_harts_forward_and_the_step(family):
    """One micro-batch: the log-probs of ``harts.forward``, bit for bit. Cut: within the split
    bound of them, and bit for bit the step's own row log-probs under the same budget."""
    model = model_of(family)
    forest = harts.build_forest(TRAJECTORIES)
    with torch.no_grad():
        whole = harts.forward(model, forest).all_trajectory_logprobs()
    rollouts = [harts.Rollout(t) for t in TRAJECTORIES]
    for budget in (3, 40, None, forest.num_tokens):
        got = harts.forest_logprobs(model, forest, budget_tokens=budget)
        logprobs = [lp[1:] for lp in got.logprobs]
        if got.num_micro_batches == 1:
            assert all(torch.equal(g, w) for g, w in zip(logprobs, whole, strict=True))
        else:
            assert worst(logprobs, whole) <= SPLIT_ATOL
        step = harts.rollout_step(model, rollouts, harts.PolicyLossConfig(kind="sft"), budget_tokens=budget)
        model.zero_grad(set_to_none=True)
        assert step.tokens_per_micro_batch == got.rows.tokens_per_micro_batch, "the step's plan"
        rows = step.rows
        mine = torch.stack([got.logprobs[int(b)][int(p)] for b, p in zip(rows.trajectory, rows.position,
                                                                           strict=True)])  # fmt: skip
        assert torch.equal(mine, step.logprob)


def test_no_graph_whatever_the_grad_mode():
    model = model_of("qwen3_next")
    model.zero_grad(set_to_none=True)
    assert torch.is_grad_enabled()
    got = harts.forest_logprobs(model, TRAJECTORIES, budget_tokens=4, entropies=True)
    assert not any(t.requires_grad for t in got.logprobs + got.entropies)
    assert got.rows.logprob.grad_fn is None
    assert all(p.grad is None for p in model.parameters())


def test_rollouts_loss_positions_and_fill():
    model = model_of("qwen3")
    masks = [[0] * (len(t) // 2) + [1] * (len(t) - len(t) // 2) for t in TRAJECTORIES]
    for m in masks:
        m[0] = 0
    rollouts = [harts.Rollout(t, loss_mask=m) for t, m in zip(TRAJECTORIES, masks, strict=True)]
    every = harts.forest_logprobs(model, rollouts, budget_tokens=6)
    only = harts.forest_logprobs(model, rollouts, budget_tokens=6, loss_positions_only=True,
                                 fill=float("nan"))  # fmt: skip
    for i, m in enumerate(masks):
        m = torch.tensor(m, dtype=torch.bool)
        assert torch.equal(only.scored[i], m)
        assert torch.isnan(only.logprobs[i][~m]).all()
        assert torch.allclose(only.logprobs[i][m], every.logprobs[i][m], atol=SPLIT_ATOL, rtol=0)
    # the values slot into the rollouts' per-token fields and through the step's checks
    with_ref = [
        harts.Rollout(r.tokens, loss_mask=r.loss_mask, rollout_logprobs=old, ref_logprobs=old, advantages=1.0)
        for r, old in zip(rollouts, only.logprobs, strict=True)
    ]
    config = harts.PolicyLossConfig(kind="ppo", kl_coef=0.1)
    step = harts.rollout_step(model, with_ref, config, budget_tokens=6)
    model.zero_grad(set_to_none=True)
    assert float(step.metrics["kl"]) == 0.0 and float(step.metrics["clip_fraction"]) == 0.0


def test_flat_layout_and_token_sequences():
    model = model_of("qwen3")
    tree = harts.forest_logprobs(model, TRAJECTORIES, budget_tokens=7)
    flat = harts.forest_logprobs(model, TRAJECTORIES, budget_tokens=7, share_prefixes=False)
    assert flat.forest.num_tokens == sum(map(len, TRAJECTORIES)) > tree.forest.num_tokens
    assert worst(flat.logprobs, tree.logprobs) <= 2 * SPLIT_ATOL  # each within the split bound of one


def test_peak_memory_follows_the_budget_not_the_forest():
    """Twice as many trees: the whole forest's tensor peak doubles, a budgeted pass's stays."""
    # wide activations, a small head: the activations, not the head's chunk, set the whole pass's peak
    model = tiny_model("qwen3", seed=2, vocab_size=128, hidden_size=256, intermediate_size=1024)
    gen = torch.Generator().manual_seed(0)

    def tree():
        prompt = torch.randint(3, 128, (96,), generator=gen).tolist()
        return [prompt + torch.randint(3, 128, (64,), generator=gen).tolist() for _ in range(4)]

    small = [t for _ in range(4) for t in tree()]
    large = small + [t for _ in range(4) for t in tree()]
    peaks = {}
    for name, trajs in (("small", small), ("large", large)):
        forest = harts.build_forest(trajs)
        for budget in (None, 64):
            peaks[name, budget] = tensor_peak_bytes(lambda f=forest, b=budget: harts.forest_logprobs(
                model, f, budget_tokens=b))  # fmt: skip
    assert peaks["large", None] > 1.8 * peaks["small", None]
    assert peaks["small", 64] < peaks["small", None] / 3
    # what grows with the forest under a budget: the returned values and the plan's node lists
    assert peaks["large", 64] < peaks["small", 64] * 1.3


def test_refusals_before_compute():
    model = model_of("qwen3")
    calls = []
    handle = model.model.embed_tokens.register_forward_pre_hook(lambda *a: calls.append(1))
    forest = harts.build_forest(TRAJECTORIES)
    try:
        for kwargs, error, match in [
            (dict(inputs=[[5, 6, 900]]), ValueError, "trajectory 0, position 2: token id 900"),
            (dict(inputs=forest, temperature=0.0), ValueError, "temperature"),
            (dict(inputs=forest, loss_positions_only=True), ValueError, "needs rollouts"),
            (dict(inputs=forest, share_prefixes=False), ValueError, "already built"),
            (dict(inputs=[harts.Rollout([1, 2, 3], loss_mask=[0, 1])]), ValueError, "loss_mask has shape"),
            (dict(inputs=forest, budget_tokens=0), ValueError, "budget_tokens"),
            (dict(inputs=forest, run={"budget_tokens": 4}), TypeError, "RunConfig"),
            (dict(inputs="tokens"), TypeError, "expected a harts Forest"),
        ]:
            kwargs = {"loss_positions_only": False, **kwargs}
            if "loss_mask has shape" in match:
                kwargs["loss_positions_only"] = True
            with pytest.raises(error, match=match):
                harts.forest_logprobs(model, **kwargs)
    finally:
        handle.remove()
    assert calls == [], "no model compute may run before the input is checked"
    with pytest.raises(ValueError, match="harts.forest_logprobs"):
        harts.forward(model, forest, harts.RunConfig(budget_tokens=4))
