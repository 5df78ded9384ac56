"""``[reference] model = "initial"``: the KL term's reference log-probs computed by the trainer.

They must be the starting weights' log-probs of each trajectory alone (the stock Hugging Face
forward, in fp64 with exact kernels: ``tests/reference.py``) whatever the token budget, stay those
of the starting weights while the policy trains, and survive a resume only when the reference is
the one the run started with.

Tolerance: harts' fp32 logits are within ``LOGIT_ATOL`` of the exact ones (docs/architecture.md,
"References and tolerances"); a log-prob is ``z_t - logsumexp(z)``, and logsumexp moves by at most
the largest move of any logit, so a log-prob is within ``2 * LOGIT_ATOL``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import harts
from harts.runtime.forward_only import forest_logprobs
from harts.tiny import tiny_model
from harts.trainer.config_files import load_config
from harts.trainer.inputs import load_model, rollout_steps
from harts.trainer.ppo import StepUpdates, load_reference
from tests.helpers import (
    FAMILY,
    one_thread,  # noqa: F401 (autouse: one thread)
    run_train,
    write_config,
    write_small_rollouts,
)
from tests.reference import LOGIT_ATOL, stock_logprobs

TOL = 2 * LOGIT_ATOL  # a log-prob from logits within LOGIT_ATOL (module docstring)
MIDDLE = 24  # unique tokens per micro-batch: cuts the trees of the small file's steps


def _config(tmp_path, budget=MIDDLE, steps=3, **sections):
    data = write_small_rollouts(tmp_path / "small.jsonl")
    tables = dict(
        model={"tiny": FAMILY},
        data={"path": str(data), "rollouts_per_step": 9},
        objective={"kind": "ppo", "advantage": "grpo", "kl_coef": 0.5},
        reference={"model": "initial"},
        run={"budget_tokens": budget},
        optimizer={"lr": 1e-2, "weight_decay": 0.0},
        checkpoint={"every": 0},
        logging={"plot": False},
    )
    for name, table in sections.items():
        tables[name] = {**tables.get(name, {}), **table} if table is not None else None
    return write_config(tmp_path / "run.toml", {"steps": steps}, {k: v for k, v in tables.items() if v})


def _max_error(got: list, want: list, rollouts) -> float:
    worst = 0.0
    for g, w, r in zip(got, want, rollouts, strict=True):
        mask = torch.as_tensor(r.loss_mask, dtype=torch.bool)
        assert torch.all(g[~mask] == 0)  # unscored positions hold 0, as the file form has them
        worst = max(worst, float((g.double() - w)[mask].abs().max()))
    return worst


@pytest.mark.parametrize("budget", [1, MIDDLE, None], ids=["budget-1", f"budget-{MIDDLE}", "whole"])
def test_reference_logprobs_equal_each_trajectory_alone(tmp_path, budget):
    config = load_config(_config(tmp_path, budget))
    policy = load_model(config.model, config.seed)
    reference = load_reference(config.reference, config.model, config.seed)
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    for (name, a), b in zip(policy.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # "initial": the starting weights, bit for bit
    initial = tiny_model(FAMILY, seed=config.seed)
    for rollouts in rollout_steps(config.data):
        step = StepUpdates(config, policy, reference, config.run.run_config(), rollouts)
        got = [torch.as_tensor(r.ref_logprobs) for r in step.rollouts]
        assert _max_error(got, stock_logprobs(initial, rollouts), rollouts) <= TOL


def test_the_bound_tells_a_reference_one_update_away(tmp_path):
    """The check above can fail: after one update at the run's learning rate the policy's
    log-probs are beyond TOL of the starting weights' ones."""
    config = load_config(_config(tmp_path))
    policy = load_model(config.model, config.seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.optimizer.lr, weight_decay=0.0)
    rollouts = next(iter(rollout_steps(config.data)))
    harts.rollout_step(policy, rollouts, harts.PolicyLossConfig(kind="sft"))
    optimizer.step()
    moved = forest_logprobs(policy, rollouts, loss_positions_only=True).logprobs
    assert _max_error(moved, stock_logprobs(tiny_model(FAMILY, seed=0), rollouts), rollouts) > 10 * TOL


def test_a_run_reads_the_starting_weights_all_along(tmp_path):
    """A run with ``"initial"`` ends with the bytes of a run whose file carries the starting
    weights' log-probs of each step (the same pass, so the same bits): the reference never
    follows the policy. The KL is not 0 by the last step, so the term is live."""
    config = _config(tmp_path)
    assert run_train(config, tmp_path / "computed") == 0
    loaded = load_config(config)
    initial = load_model(loaded.model, loaded.seed)
    lines = []
    for rollouts in rollout_steps(loaded.data):
        values = forest_logprobs(initial, rollouts, run=loaded.run.run_config(), loss_positions_only=True)
        for r, lp in zip(rollouts, values.logprobs, strict=True):
            fields = {k: np.asarray(getattr(r, k)).tolist() for k in ("tokens", "loss_mask",
                                                                     "rollout_logprobs")}  # fmt: skip
            lines.append({**fields, "ref_logprobs": lp.tolist(), "reward": r.reward, "group_id": r.group_id})
    file = tmp_path / "with_ref.jsonl"
    file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    from_file = _config(tmp_path, data={"path": str(file)}, reference=None)
    assert run_train(from_file, tmp_path / "file") == 0
    final = "checkpoints/step-000003/model.safetensors"
    assert (tmp_path / "computed" / final).read_bytes() == (tmp_path / "file" / final).read_bytes()
    kl = [json.loads(x)["kl"] for x in (tmp_path / "computed" / "metrics.jsonl").read_text().splitlines()]
    file_kl = [json.loads(x)["kl"] for x in (tmp_path / "file" / "metrics.jsonl").read_text().splitlines()]
    assert kl == file_kl and kl[-1] > 1e-6


def test_a_resume_against_other_reference_weights_is_refused(tmp_path, capsys):
    config = _config(tmp_path, steps=2)
    assert run_train(config, tmp_path / "out") == 0
    # the starting weights are now another seed's: the run's KL term would change
    other = _config(tmp_path, steps=3, model={"seed": 1})
    assert run_train(other, tmp_path / "out", "--resume") == 2
    err = capsys.readouterr().err
    assert "reference.model = 'initial': its weights (sha256 " in err
    assert "are not those step-000002 was trained against" in err
    assert not (tmp_path / "out" / "checkpoints" / "step-000003").exists()
