"""``harts rl``: the task's checker, the tree sampler's cache, tree against flat, the command.

- the checker accepts the right answer and refuses wrong ones; observations and rewards follow;
- the sampler's log-probs (computed with the model's cache, across branch points) equal a fresh
  full forward of each sampled trajectory at the sampling temperature, on every family;
- the same generator samples the same rollouts; the tree is a tree (branches share prefixes);
- tree and flat layouts give the same gradients for the same rollouts (GRPO and tree
  advantages), and two runs of the command, one per layout, the same rewards, losses and, up to
  fp32 rounding, parameters;
- the command runs end to end, writes the promised metrics and a loadable checkpoint, resumes
  to the same bytes; bad configs are refused naming the key.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from harts.cli import main as cli
from harts.rl import RunningSum, SamplingConfig, TaskConfig, load_rl_config, rl_step, run_rl, sample_tree
from harts.rl.config import Layout, parse_rl_config
from harts.rl.loop import step_randomness
from harts.rl.sampler import cache_not_exact
from harts.rl.task import Episode, decode, encode
from harts.tiny import FAMILIES, tiny_model
from tests.helpers import one_thread  # noqa: F401 (autouse: one thread)
from tests.helpers import write_config as write_train_config
from tests.reference import GRAD_RTOL

ROOT = Path(__file__).resolve().parents[1]
# the loop tests want a fast sampler: Gated DeltaNet's reference chunk kernel is quick on the CPU
FAMILY = "qwen3_next" if "qwen3_next" in FAMILIES else FAMILIES[0]
METRIC_KEYS = {"step", "reward", "loss", "grad_norm", "tokens", "unique_tokens", "computed_tokens",
               "redundancy", "micro_batches", "recomputed_parts", "sample_seconds", "train_seconds",
               "seconds", "wall_seconds", "layout", "groups_same_reward", "response_tokens_mean"}  # fmt: skip


RL_TABLES = {
    "model": {"tiny": FAMILY},
    "task": {"turns": 2, "max_addend": 9},
    "sampling": {"prompts_per_step": 3, "branching": [2, 2], "temperature": 1.0},
    "objective": {"kind": "ppo", "advantage": "grpo"},
    "optimizer": {"lr": 1e-3, "weight_decay": 0.0},
    "checkpoint": {"every": 0, "keep_last": 1},
    "logging": {"plot": False},
}


def write_config(path: Path, top: dict | None = None, **sections: dict) -> Path:
    """A small, fast ``harts rl`` config; keyword sections update the defaults."""
    return write_train_config(path, {"steps": 2, **(top or {})}, RL_TABLES, **sections)


# ---- the task --------------------------------------------------------------------------------------
def test_the_checker_accepts_the_right_answer_only():
    task = RunningSum(TaskConfig(turns=3))
    episode = Episode(start=7, addends=(5, 9, 1))  # totals 2, 1, 2
    assert episode.totals() == [2, 1, 2]
    assert task.check(episode, 0, encode("2")) and task.check(episode, 1, encode("1"))
    for wrong in ("3", "7", "+", "y"):
        assert not task.check(episode, 0, encode(wrong))
    assert task.reward(episode, [encode("2"), encode("0"), encode("2")]) == pytest.approx(2 / 3)
    assert task.reward(episode, [encode("9")] * 3) == 0.0
    # the observation gives the verdict and the next question from the TRUE total, right or wrong
    assert decode(task.observation(episode, 0, encode("2"))) == "y|2+9="
    assert decode(task.observation(episode, 0, encode("4"))) == "n|2+9="
    prompt = decode(task.prompt(episode))
    assert prompt.endswith("|7+5=") and prompt.startswith("add each number")
    with pytest.raises(ValueError, match="turns 0 .. 1"):
        task.observation(episode, 2, encode("2"))
    with pytest.raises(ValueError, match="an answer is 1 token"):
        task.check(episode, 0, encode("22"))
    with pytest.raises(ValueError, match=r"character 'X' at position 1"):
        encode("1X")


def test_episodes_are_drawn_from_the_rng():
    task = RunningSum(TaskConfig(turns=4, max_addend=3))
    a = task.episodes(50, np.random.default_rng(1))
    assert a == task.episodes(50, np.random.default_rng(1))
    assert {b for e in a for b in e.addends} == {1, 2, 3} and all(len(e.addends) == 4 for e in a)


# ---- the sampler ---------------------------------------------------------------------------------
@pytest.mark.parametrize("family", [f for f in FAMILIES if cache_not_exact(f) is None])
def test_sampled_logprobs_equal_a_full_forward(family):
    """The cache, gathered at every branch point and extended by answer + observation, gives the
    log-probs a fresh forward of the whole trajectory gives, at the sampling temperature."""
    task = RunningSum(TaskConfig(turns=3))
    model = tiny_model(family, seed=3, vocab_size=task.vocab_size).train()
    config = SamplingConfig(prompts_per_step=2, branching=(2, 1, 2), temperature=0.7)
    episodes = task.episodes(2, np.random.default_rng(0))
    generator = torch.Generator().manual_seed(0)
    sample = sample_tree(model, task, episodes, config, generator, group_ids=["a", "b"])
    assert len(sample.rollouts) == 8 and [r.group_id for r in sample.rollouts] == ["a"] * 4 + ["b"] * 4
    worst = 0.0
    with torch.no_grad():
        for r in sample.rollouts:
            tokens = torch.as_tensor(r.tokens)
            positions = torch.as_tensor(r.loss_mask).nonzero()[:, 0]
            assert len(positions) == task.turns
            logits = model(input_ids=tokens[None]).logits[0].float()
            full = torch.log_softmax(logits / 0.7, -1)[positions - 1, tokens[positions]]
            sampled = torch.as_tensor(r.rollout_logprobs)[positions]
            worst = max(worst, float((full.double() - sampled).abs().max()))
            answers = [tokens[p : p + 1].tolist() for p in positions]
            episode = episodes[0 if r.group_id == "a" else 1]
            assert r.reward == task.reward(episode, answers)
    assert worst < 2e-5, f"{family}: sampled log-probs differ from the full forward by {worst:.2e}"


@pytest.mark.parametrize("family", [f for f in FAMILIES if cache_not_exact(f) is not None])
def test_families_whose_cache_is_not_exact_are_refused(family):
    task = RunningSum(TaskConfig(turns=3))
    model = tiny_model(family, seed=3, vocab_size=task.vocab_size)
    config = SamplingConfig(prompts_per_step=2, branching=(2, 1, 2), temperature=0.7)
    episodes = task.episodes(2, np.random.default_rng(0))
    with pytest.raises(ValueError, match=f"cannot sample {family}"):
        sample_tree(model, task, episodes, config, torch.Generator().manual_seed(0))


def test_sampling_is_reproducible_and_branches_share_prefixes():
    task = RunningSum(TaskConfig(turns=3))
    model = tiny_model(FAMILY, seed=0, vocab_size=task.vocab_size).train()
    config = SamplingConfig(prompts_per_step=4, branching=(3, 2, 2), temperature=1.0)
    episodes = task.episodes(4, np.random.default_rng(0))

    def tokens(seed):
        sample = sample_tree(model, task, episodes, config, torch.Generator().manual_seed(seed))
        return [torch.as_tensor(r.tokens).tolist() for r in sample.rollouts]

    first = tokens(0)
    assert first == tokens(0) and first != tokens(1)
    assert len(first) == 4 * 12
    prompt = len(task.prompt(episodes[0]))
    for g in range(4):  # every trajectory of an episode shares its prompt; branches differ after it
        group = first[12 * g : 12 * (g + 1)]
        assert all(t[:prompt] == group[0][:prompt] for t in group)
        assert len({tuple(t) for t in group}) > 1


def test_sampler_refuses_a_model_of_another_vocabulary():
    task = RunningSum(TaskConfig(turns=2))
    model = tiny_model(FAMILY, seed=0)  # 128 tokens
    with pytest.raises(ValueError, match="vocab_size is 128"):
        sample_tree(model, task, task.episodes(1, np.random.default_rng(0)), SamplingConfig(branching=(1, 1)),
                    torch.Generator())  # fmt: skip


# ---- tree against flat ---------------------------------------------------------------------------
@pytest.mark.parametrize("advantage", ["grpo", "tree"])
def test_tree_and_flat_layouts_give_the_same_gradients(tmp_path, advantage):
    config = parse_rl_config({"model": {"tiny": FAMILY}, "task": {"turns": 3},
                              "sampling": {"prompts_per_step": 3, "branching": [2, 2, 2]},
                              "objective": {"advantage": advantage}}, tmp_path)  # fmt: skip
    task = RunningSum(config.task)
    model = tiny_model(FAMILY, seed=1, vocab_size=task.vocab_size).train()
    rng, generator = step_randomness(0, 1)
    rollouts = sample_tree(model, task, task.episodes(3, rng), config.sampling, generator).rollouts
    # an untrained model rarely scores: rewards of every size, so every advantage is non-zero
    rewards = torch.rand(len(rollouts)).tolist()
    rollouts = [dataclasses.replace(r, reward=v) for r, v in zip(rollouts, rewards, strict=True)]
    grads, losses = {}, {}
    for layout in Layout:
        copy_ = copy.deepcopy(model)
        run = config.run.run_config()
        result, forest = rl_step(copy_, rollouts, config.objective, config.loss_config(), run, layout)
        grads[layout] = torch.cat([p.grad.flatten() for p in copy_.parameters() if p.grad is not None])
        losses[layout] = float(result.loss)
    assert forest.redundancy > 3  # a real tree: the prompt and earlier turns are shared
    tree, flat = grads[Layout.TREE], grads[Layout.FLAT]
    assert tree.abs().max() > 0
    assert float((tree - flat).norm() / flat.norm()) < 1e-5
    assert abs(losses[Layout.TREE] - losses[Layout.FLAT]) < 1e-6


# AdamW settings for comparing layouts: eps above every gradient element (checked against the logged
# norm), so that the update is Lipschitz in the gradient (see the test's docstring).
COMPARE_EPS, COMPARE_LR = 100.0, 2.0


def test_two_steps_of_tree_and_flat_runs_agree(tmp_path):
    """Same seed, both layouts, two steps each: the same rollouts (rewards) at every step, losses
    equal to rounding, and parameters whose gap is bounded by the gradients' fp32 tolerance.

    With its default eps, AdamW's first steps move an element by about lr * g / (|g| + eps)
    whatever the size of g, so an element whose gradient sits at rounding level moves by a
    rounding-dependent fraction of lr, and how many such elements there are depends on the
    processor's kernels: no count of them bounds anything. With eps >= every |g| (eps >= the
    gradient norm), the update m / (sqrt(v) + eps) is Lipschitz in the gradients instead. Per
    element and step, m and sqrt(v) are weighted means (L1 and L2) of the gradients so far, so a
    gradient gap dg moves m by at most max |dg| and sqrt(v) by at most max |dg|; since
    sqrt(v) + eps >= eps and |m| <= eps, the update moves by at most 2 lr max |dg| / eps. Each
    layout's gradient is within GRAD_RTOL of the exact one, so ||dg|| <= 2 GRAD_RTOL ||g||, and
    over the steps ||gap|| <= sum of 4 lr GRAD_RTOL max ||g|| / eps. A factor of 2 covers the
    second step's gradient being taken at weights that already differ by the first step's gap (a
    second-order term: lr / eps times the curvature).
    """
    config = load_rl_config(write_config(
        tmp_path / "rl.toml", {"max_grad_norm": 0}, sampling={"prompts_per_step": 8},
        optimizer={"lr": COMPARE_LR, "eps": COMPARE_EPS, "weight_decay": 0.0},
    ))  # fmt: skip
    runs = {}
    for layout in ("tree", "flat"):
        out = tmp_path / layout
        with open(out.with_suffix(".log"), "w") as log:
            run_rl(config.with_overrides(layout=layout), out, log=log)
        model = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step-000002")
        runs[layout] = ([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
                        model.state_dict())  # fmt: skip
    (tree_log, tree), (flat_log, flat) = runs["tree"], runs["flat"]
    assert [r["reward"] for r in tree_log] == [r["reward"] for r in flat_log]
    assert all(r["reward_std"] > 0 for r in tree_log)  # some answers right: the advantages move the weights
    assert all(abs(a["loss"] - b["loss"]) < 1e-6 for a, b in zip(tree_log, flat_log, strict=True))
    assert tree_log[0]["computed_tokens"] < flat_log[0]["computed_tokens"] == flat_log[0]["tokens"]
    norms = [r["grad_norm"] for r in tree_log + flat_log]
    assert max(norms) <= COMPARE_EPS, f"eps must exceed every gradient element: norms {norms}"
    task = RunningSum(config.task)
    start = tiny_model(FAMILY, seed=0, vocab_size=task.vocab_size).state_dict()
    moved = torch.cat([(tree[k] - start[k]).flatten() for k in tree])
    gap = torch.cat([(tree[k] - flat[k]).flatten() for k in tree])
    bound = 2 * sum(4 * r["lr"] * GRAD_RTOL * max(norms) / COMPARE_EPS for r in tree_log)
    assert float(moved.norm()) > 10 * bound  # the update is far above what rounding may move
    assert float(gap.norm()) <= bound, f"gap {float(gap.norm()):.3e} > bound {bound:.3e}"


# ---- the command ---------------------------------------------------------------------------------
def test_the_command_runs_end_to_end_and_resumes_to_the_same_bytes(tmp_path, capsys):
    path = write_config(tmp_path / "rl.toml", {"steps": 4}, checkpoint={"every": 2, "keep_last": 2})
    cli(["rl", str(path), "--out", str(tmp_path / "whole"), "--layout", "tree"])
    err = capsys.readouterr().err
    assert "step 4/4 | reward" in err and "tree:" in err
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(METRIC_KEYS <= set(r) for r in records), METRIC_KEYS - set(records[0])
    assert all(0 <= r["reward"] <= 1 and r["rollouts"] == 3 * 4 and r["tokens"] % 12 == 0 for r in records)
    walls = [r["wall_seconds"] for r in records]
    assert walls == sorted(walls) and walls[0] > 0
    final = tmp_path / "whole" / "checkpoints" / "step-000004"
    assert (final / "manifest.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert loaded.config.vocab_size == RunningSum(TaskConfig()).vocab_size
    # a run stopped after step 2, resumed: the same final weights, byte for byte
    cli(["rl", str(path), "--out", str(tmp_path / "parts"), "--steps", "2"])
    cli(["rl", str(path), "--out", str(tmp_path / "parts"), "--resume"])
    assert "resuming from" in capsys.readouterr().err
    part = tmp_path / "parts" / "checkpoints" / "step-000004" / "model.safetensors"
    assert part.read_bytes() == (final / "model.safetensors").read_bytes()
    resumed = [json.loads(line) for line in (tmp_path / "parts" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in resumed] == [r["reward"] for r in records]


def test_a_second_run_into_a_directory_with_checkpoints_is_refused(tmp_path, capsys):
    path = write_config(tmp_path / "rl.toml", {"steps": 1})
    cli(["rl", str(path), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as exit_:
        cli(["rl", str(path), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "already holds checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("top", "sections", "message"),
    [
        ({"layout": "packed"}, {}, "layout: expected one of tree, flat"),
        ({"stepz": 3}, {}, "stepz: unknown key in the top level"),
        ({}, {"sampler": {"n": 1}}, r"unknown section \[sampler\]"),
        ({}, {"sampling": {"branching": [2, 2, 2]}}, "sampling.branching: 3 entries for task.turns = 2"),
        ({}, {"sampling": {"branching": [2, 0]}}, r"sampling.branching\[1\]: expected a positive integer"),
        ({}, {"sampling": {"branching": 2}}, "sampling.branching: expected a list"),
        ({}, {"sampling": {"temperature": 0.0}}, "sampling.temperature: expected a positive number"),
        ({}, {"objective": {"temperature": 0.5}}, "objective.temperature = 0.5 differs from sampling"),
        ({}, {"objective": {"kind": "sft"}}, "objective.kind: 'sft' has nothing to imitate"),
        ({}, {"objective": {"advantage": "best"}}, "objective.advantage: expected one of"),
        ({}, {"objective": {"advantage": "gae"}}, "objective.advantage: gae needs a critic's values, and"),
        ({}, {"task": {"max_addend": 12}}, r"task.max_addend: expected an integer in \[1, 9\]"),
        ({}, {"task": {"name": "chess"}}, "task.name: expected one of running_sum"),
        ({}, {"model": {"tiny": None, "path": "/models/x"}}, "model.path: harts rl trains on its built-in"),
        ({}, {"model": {"gradient_checkpointing": True}}, None),  # refused when the run starts
        ({}, {"optimizer": {"lr": "fast"}}, "optimizer.lr: expected a number, got 'fast'"),
    ],
    ids=["layout", "top-key", "section", "branching-length", "branching-zero", "branching-type",
         "temperature", "objective-temperature", "sft", "estimator", "gae", "addend", "task", "model-path",
         "checkpointing", "lr"],
)  # fmt: skip
def test_bad_configs_are_refused_naming_the_key(tmp_path, capsys, top, sections, message):
    path = write_config(tmp_path / "rl.toml", top, **sections)
    if message is None:
        with pytest.raises(SystemExit) as exit_:
            cli(["rl", str(path), "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2
        assert "model.gradient_checkpointing: the sampler needs the model's cache" in capsys.readouterr().err
        return
    with pytest.raises(ValueError, match=message) as error:
        load_rl_config(path)
    assert str(error.value).startswith(str(path))
    with pytest.raises(SystemExit) as exit_:
        cli(["rl", str(path), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "harts rl: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_the_example_config_parses():
    config = load_rl_config(ROOT / "examples" / "rl.toml")
    assert config.layout == "tree" and config.sampling.leaves() == 8 and config.objective.advantage == "grpo"
    assert config.loss_config().temperature == config.sampling.temperature
