"""Write ``examples/rollouts.jsonl``: a small agentic rollout file for ``examples/train.toml``.

Four tasks (groups) of four multi-turn rollouts over one shared system prompt, from
:func:`harts.data.synthetic.agentic` on the tiny models' 128-token vocabulary: the rollouts of a
task branch at turn boundaries and drop earlier thinking, so the file shares most of its tokens
(harts analyze examples/rollouts.jsonl). Each line carries what an RL trainer gets from its
sampler: ``tokens``, ``loss_mask`` (the prompt is not trained on), ``rollout_logprobs`` (the tiny
bailing_hybrid model's own log-probs at seed 0, so the first step is on-policy), a 0/1
``reward`` and the task as ``group_id``; advantages come from the config's estimator.

Usage: ``python examples/make_rollouts.py`` (needs a transformers with bailing_hybrid).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import harts
from harts.data.synthetic import agentic
from harts.tiny import tiny_model

SYSTEM, USER = 96, 16
SHAPE = dict(system_len=SYSTEM, user_len=USER, num_tasks=4, rollouts_per_task=4, turns=3, turn_len=30)


def main() -> None:
    trajectories = agentic(**SHAPE, vocab_size=128, seed=0)
    prompt = SYSTEM + USER
    tasks: dict[tuple, int] = {}
    model = tiny_model("bailing_hybrid", seed=0)
    with torch.no_grad():
        logprobs = harts.forward(model, harts.build_forest(trajectories)).all_trajectory_logprobs()
    rng = np.random.default_rng(0)
    path = Path(__file__).with_name("rollouts.jsonl")
    with path.open("w") as f:
        for tokens, lp in zip(trajectories, logprobs, strict=True):
            task = tasks.setdefault(
                tuple(tokens[SYSTEM:prompt]), len(tasks)
            )  # the user prompt names the task
            record = {
                "tokens": tokens,
                "loss_mask": [0] * prompt + [1] * (len(tokens) - prompt),
                "rollout_logprobs": [0.0] + [round(float(x), 4) for x in lp],
                "reward": float(rng.integers(0, 2)),
                "group_id": f"task-{task}",
            }
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    forest = harts.build_forest(trajectories)
    print(f"wrote {path}: {len(trajectories)} rollouts in {len(tasks)} groups, {forest.describe()}, "
          f"{path.stat().st_size / 1024:.0f} KiB")  # fmt: skip


if __name__ == "__main__":
    main()
