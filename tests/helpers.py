"""Shared data shapes and helpers of the test suite: the one module test files import each other's from.

A test module never imports another test module; what two of them share lives here, one section
per topic, each saying which tests use it. The fp64 reference is in ``tests/reference.py``, the
torchrun entry point in ``tests/distributed_worker.py``.

- Training runs (``harts train`` configs, one thread, a run in its own process, a small rollout
  file): test_rl, test_distributed, test_train_config, test_train_optim, test_train_resume,
  test_train_run, test_train_reference, test_train_ppo.
- Random forests (a hypothesis strategy): test_forest, test_plans.
- Equivalence edge shapes: test_equivalence, test_split, test_full_attention_families.
- MoE forests and plain expert counts: test_moe_stats, test_full_attention_families.
- Tree-op forests: test_ops_tree, test_plans (in its shapes).
- Linear-attention plan shapes and path helpers: test_plans, test_ops_recurrence.
- Tree attention forests, plan arguments and the fused switch: test_tree_attention,
  test_tree_attention_window_sinks.
- Chat template, conversation and a local tokenizer: test_chat_rollouts, test_train_run.
- Whether torch's bf16 attention runs on this process's CPU kernels: test_train_resume.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import random
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from harts.tiny import FAMILIES

VOCAB = 128  # the tiny models' vocabulary: random tokens are drawn from [3, VOCAB)


# ---- low precision on this process's CPU kernels: test_train_resume ----------------------------
def _bf16_attention_refusal() -> str | None:
    """torch's own message when its CPU flash attention cannot run bf16 in this process, else None.

    With ``ATEN_CPU_CAPABILITY`` set below a processor's AMX (simulating an AVX2 machine on an
    AMX one), torch's bf16 flash kernel still takes its AMX path and stops ("pack_vnni2 is only
    supported when avx512 is supported"): the stock forward of any model fails there too, so a
    bf16 comparison has nothing to compare. A real AVX2 processor has no AMX path to take."""
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


_BF16_REFUSAL = _bf16_attention_refusal()
needs_bf16_attention = pytest.mark.skipif(
    _BF16_REFUSAL is not None,
    reason=f"torch's CPU bf16 attention does not run in this process: {_BF16_REFUSAL}",
)


# ---- training runs: test_rl, test_distributed, test_train_config, test_train_optim, ------------
# ---- test_train_resume, test_train_run ---------------------------------------------------------
# Configs for the ``harts train`` tests: a TOML file over the example rollouts, any family.
# The tests run on every supported transformers version, so the family comes from
# ``harts.tiny.FAMILIES`` (what the installed version has), not from the example's
# bailing_hybrid. One thread keeps the runs deterministic and fast on a shared 2-core machine.
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_ROLLOUTS = ROOT / "examples" / "rollouts.jsonl"
FAMILY = FAMILIES[0]  # the newest family the installed transformers has (hybrid attention + MoE)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and a busy 2-core machine makes two threads crawl.
    A test module that imports this fixture runs on one thread and restores the count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


TRAIN_TABLES = {
    "model": {"tiny": FAMILY},
    "data": {"path": str(EXAMPLE_ROLLOUTS), "rollouts_per_step": 8},
    "objective": {"kind": "sft"},
    "logging": {"plot": False},
}


def write_config(path: Path, top: dict | None = None, tables: dict | None = None, **sections: dict) -> Path:
    """A config file: ``top`` keys, then ``[section]`` tables: ``tables`` (default: a short SFT
    ``harts train`` run) updated by the keyword sections."""
    top = {"seed": 0, "steps": 3, "threads": 1, **(top or {})}
    tables = {name: dict(table) for name, table in (tables or TRAIN_TABLES).items()}
    for name, table in sections.items():
        tables[name] = {**tables.get(name, {}), **table}
    lines = [f"{k} = {toml_value(v)}" for k, v in top.items() if v is not None]
    for name, table in tables.items():
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_train(config: Path, out: Path) -> subprocess.Popen:
    """``harts train CONFIG --out OUT`` as a real process of its own (to be killed)."""
    # a shell that runs the suite in the background starts it with SIGINT ignored, which the child
    # would inherit (and Python would keep): give the child the default disposition, as a terminal's
    return subprocess.Popen(
        [sys.executable, "-m", "harts.cli", "train", str(config), "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def wait_for(process: subprocess.Popen, path: Path, timeout: float = 120.0) -> None:
    """Poll until ``path`` exists (the process still running), then return."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the run ended early: {process.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)


def kill_after(config: Path, out: Path, checkpoint: str) -> None:
    """Start ``harts train CONFIG --out OUT`` and SIGKILL it once ``OUT/checkpoints/CHECKPOINT``
    appears (no handler runs: whatever it was writing stays half-written)."""
    process = start_train(config, out)
    wait_for(process, out / "checkpoints" / checkpoint)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL


def write_small_rollouts(path: Path, groups: int = 6, per_group: int = 3, seed: int = 0) -> Path:
    """A short rollout file of GRPO groups (for runs whose passes are checked against a per-trajectory
    forward): one system prefix, a prompt per group, responses of 3-8 tokens under a loss mask,
    the sampler's log-probs and 0/1 rewards, every group with both rewards."""
    rng = random.Random(seed)
    system = random_tokens(rng, 5)
    lines = []
    for g in range(groups):
        prompt = system + random_tokens(rng, rng.randrange(3, 7))
        for k in range(per_group):
            response = random_tokens(rng, rng.randrange(3, 9))
            tokens = prompt + response
            lines.append({
                "tokens": tokens, "loss_mask": [0] * len(prompt) + [1] * len(response),
                "rollout_logprobs": [0.0] * len(prompt) + [-rng.uniform(0.5, 4.0) for _ in response],
                "reward": float(k % 2), "group_id": f"g{g}",
            })  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# ---- random forests: test_forest, test_plans ---------------------------------------------------
@st.composite
def forests(draw, max_trajectories: int = 8, max_len: int = 9, alphabet: int = 3) -> list[list[int]]:
    """Trajectories that collide: fresh ones, extensions of earlier prefixes, duplicates, prefixes."""
    tok = st.integers(0, alphabet - 1)
    out: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_trajectories))):
        kind = draw(st.sampled_from(["fresh", "extend", "duplicate", "prefix"])) if out else "fresh"
        if kind == "fresh":
            out.append(draw(st.lists(tok, min_size=1, max_size=max_len)))
            continue
        base = out[draw(st.integers(0, len(out) - 1))]
        if kind == "extend":
            keep = draw(st.integers(0, len(base)))
            out.append(base[:keep] + draw(st.lists(tok, min_size=0 if keep else 1, max_size=max_len)))
        elif kind == "duplicate":
            out.append(list(base))
        else:
            out.append(base[: draw(st.integers(1, len(base)))])
    return out


# ---- equivalence edge shapes: test_equivalence, test_split, test_full_attention_families -------
def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def edge_shapes() -> dict[str, list[list[int]]]:
    """Hand-made forests that stress one mechanism each."""
    rng = random.Random(0)
    p = random_tokens(rng, 20)
    shapes = {
        "single-T17": [random_tokens(rng, 17)],
        "star-P20-G4": [p + random_tokens(rng, rng.randrange(3, 12)) for _ in range(4)],
        # branch points stacked at several depths, with one-token nodes between them
        "stacked-branches": [
            p[:5] + [9] + [10, 11],
            p[:5] + [9] + [12],
            p[:5] + [13] + [14, 15, 16],
            p[:5] + [13],
            p[:5] + [9] + [10, 17, 18],
        ],
        # parents shorter than the conv kernel (4): windows cross two ancestors
        "short-parents": [
            [3, 4] + [5] + [6, 7, 8, 9],
            [3, 4] + [5] + [10],
            [3, 4] + [11, 12],
            [3, 4, 5, 6, 7, 20],
        ],
        "prefix-of-another": [p[:9], p, p + random_tokens(rng, 5)],
        "duplicates": [p, p, p[:7] + [50, 51], p[:7] + [50, 51]],
        "unrelated-roots": [random_tokens(rng, 8), random_tokens(rng, 3), [5], [5, 6, 7]],
        "one-token-trajectories": [[7], [7], [8], [7, 9]],
    }
    # node lengths around the delta-rule chunk size (64)
    trunk = random_tokens(rng, 63)
    shapes["chunk-edges-63-64-65"] = [trunk, trunk + [4], trunk + [4, 5], trunk + random_tokens(rng, 66)]
    shapes["long-branch-T130"] = [trunk + random_tokens(rng, 67), trunk[:40] + random_tokens(rng, 90)]
    return shapes


EDGE_SHAPES = edge_shapes()


# ---- MoE forests and plain expert counts: test_moe_stats, test_full_attention_families ---------
def moe_forests() -> dict[str, list[list[int]]]:
    rng = random.Random(11)

    def seq(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    p = seq(8)
    star = [p + seq(n) for n in (4, 7, 3, 9)]
    nested = [p[:3] + [40, 41] + seq(5), p[:3] + [40, 41] + seq(2), p[:3] + [42] + seq(6), p[:3]]
    return {
        # one prompt, four completions, two of them duplicated
        "star-dups-P8-G6": star + [list(star[1]), list(star[3])],
        # branches at depths 3 and 5, a trajectory that ends where others branch, and a second root
        "nested-branches-2roots": nested + [list(nested[0]), seq(7)],
    }


MOE_FORESTS = moe_forests()


def loop_counts(indices: list[torch.Tensor], keep: list[bool], num_experts: int) -> list[list[int]]:
    """Counts written plainly: for every layer, every kept token, every chosen expert, add one."""
    counts = [[0] * num_experts for _ in indices]
    for layer, idx in enumerate(indices):
        for token, experts in enumerate(idx.tolist()):
            if keep[token]:
                for e in experts:
                    counts[layer][e] += 1
    return counts


# ---- tree-op forests: test_ops_tree, test_plans (part of PLAN_SHAPES) --------------------------
OP_FORESTS = {
    "star-P9-G3": [[1] * 9 + [2, 3], [1] * 9 + [4], [1] * 9 + [5, 6, 7, 8]],
    "short-parents-K4": [[1, 2, 3, 4, 5], [1, 2, 6], [1, 7, 8, 9, 10], [1, 7, 11], [12]],
    "chunk-edge-T70": [list(range(3, 73)), list(range(3, 40)) + [99] * 30, list(range(3, 68))],
}


# ---- linear-attention plan shapes and path helpers: test_plans, test_ops_recurrence ------------
PLAN_BASE = list(range(3, 203))
PLAN_BINARY = [[7, *bits] for bits in itertools.product([0, 1], repeat=3)]
PLAN_SHAPES = {
    "chain-M5": [PLAN_BASE[:c] for c in (3, 5, 9, 10, 14)],
    "star-P9-G5": [[1] * 9 + [2 + i] * (i + 1) for i in range(5)],
    "caterpillar-D8": [PLAN_BASE[: 2 * (d + 1)] + [1, d] for d in range(8)] + [PLAN_BASE[:18]],
    "binary-D3": PLAN_BINARY,
    "roots-3": [[200, *t] for t in PLAN_BINARY] + [[201] * 4, [201] * 6, [202, 1], [202, 2], [202, 3]],
    "chunk-boundaries-T200": [
        PLAN_BASE[:64],
        PLAN_BASE[:128],
        PLAN_BASE[:129],
        PLAN_BASE,
        PLAN_BASE[:64] + [1] * 70,
        PLAN_BASE[:128] + [2],
    ],
    **OP_FORESTS,
}


def path_tokens(forest, node: int) -> torch.Tensor:
    """The token indices of the root-to-``node`` path, root first."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(forest.node_parent[node])
    s, n = forest.node_start, forest.node_length
    return torch.cat([torch.arange(int(s[v]), int(s[v] + n[v])) for v in reversed(path)])


def root_of(forest, node: int) -> int:
    while int(forest.node_parent[node]) >= 0:
        node = int(forest.node_parent[node])
    return node


# ---- tree attention: test_tree_attention, test_tree_attention_window_sinks ---------------------
FLASH = importlib.import_module("harts.ops.tree_attention.flash")  # holds the fused switch
GATHER = importlib.import_module("harts.ops.tree_attention.gather")  # holds the padding-mask bound
ATTENTION_SCALE = 0.35


def token_run(start, n):
    return list(range(start, start + n))


ATTENTION_FORESTS = {
    "chain-N3-T30": [token_run(1, 10), token_run(1, 20), token_run(1, 30)],
    "star-P40-G6": [token_run(1, 40) + [100 + g] * (3 + g) for g in range(6)],
    "deep-binary-D5-S3": [[t for d in range(5) for t in ([2 * d + ((b >> d) & 1)] * 3)] for b in range(32)],
    "one-token-nodes-D4": [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 7, 8], [1, 7, 9, 10], [11]],
    "long-P700-G3": [token_run(1, 700) + token_run(1000 * g, 20 + 90 * g) for g in range(1, 4)],
    "roots-R4": [token_run(1, 15), token_run(1, 9) + [50, 51], [60] * 7, [70, 71], [70, 72, 73]],
    # one-token leaves below a two-token root (one key each once a shared prefix takes the root's)
    # beside a one-token root (its one key is its whole path)
    "one-token-leaves-R2": [[7, 6, 9], [7, 6, 5, 1], [8], [7, 6, 3]],
}


def ancestor_keys(forest):
    """Per node: key rows (= forest token indices) of all tokens on its ancestors, root first."""
    starts, lengths = forest.node_start.tolist(), forest.node_length.tolist()
    keys = []
    for p in forest.node_parent.tolist():  # parents come first, so keys[p] is ready
        own = torch.arange(starts[p], starts[p] + lengths[p]) if p >= 0 else None
        keys.append(torch.empty(0, dtype=torch.long) if p < 0 else torch.cat([keys[p], own]))
    return keys


def plan_args(forest, cut):
    """Plan arguments for nodes ``[cut, M)``: keys are all forest tokens, queries start at node ``cut``."""
    ext = int(forest.node_start[cut])
    nodes = slice(cut, forest.num_nodes)
    return dict(
        node_query_start=forest.node_start[nodes] - ext,
        node_length=forest.node_length[nodes],
        node_key_start=forest.node_start[nodes],
        node_ancestor_keys=ancestor_keys(forest)[nodes],
        num_queries=forest.num_tokens - ext,
        num_keys=forest.num_tokens,
    ), ext


@contextlib.contextmanager
def fused_kernels(on: bool):
    """CPU flash attention's fused kernels (True) or the recompute path of other devices (False)."""
    old, FLASH._FUSED_CPU = FLASH._FUSED_CPU, on
    try:
        yield
    finally:
        FLASH._FUSED_CPU = old


PLAN_ATTENTION = importlib.import_module("harts.plan.attention")
PLAN_PREFIXES = importlib.import_module("harts.plan.attention_prefixes")


@contextlib.contextmanager
def shared_prefixes(kind: str):
    """Tree-attention plans with shared-prefix calls where the defaults choose them ("default"),
    for every run of ancestor keys that some block reads ("all"), or never ("off")."""
    old = PLAN_PREFIXES._MIN_PREFIX_KEYS, PLAN_PREFIXES._MIN_PREFIX_SAVED
    PLAN_PREFIXES._MIN_PREFIX_KEYS, PLAN_PREFIXES._MIN_PREFIX_SAVED = {
        "default": old, "all": (1, 0), "off": (1, 1 << 62)}[kind]
    try:
        yield
    finally:
        PLAN_PREFIXES._MIN_PREFIX_KEYS, PLAN_PREFIXES._MIN_PREFIX_SAVED = old


_DENSE_DEFAULT = PLAN_ATTENTION._DENSE_CALL_WORK


@contextlib.contextmanager
def dense_plans(kind: str):
    """Tree-attention plans marked dense where the defaults choose it ("default"), wherever the
    dense mask fits ("on"), or never ("off": the groups' own machinery)."""
    old = PLAN_ATTENTION._DENSE_CALL_WORK
    PLAN_ATTENTION._DENSE_CALL_WORK = {"default": _DENSE_DEFAULT, "on": 1 << 62, "off": -(1 << 62)}[kind]
    try:
        yield
    finally:
        PLAN_ATTENTION._DENSE_CALL_WORK = old


@contextlib.contextmanager
def padding_by(kind: str | int):
    """Key padding removed by per-block masks within the default bound ("mask"), always by the
    padding channel ("channel"), or by masks within a bound of that many elements (an int)."""
    old = GATHER._MASKED_PADDING_ELEMENTS
    GATHER._MASKED_PADDING_ELEMENTS = {"mask": old, "channel": 0}.get(kind, kind)
    try:
        yield
    finally:
        GATHER._MASKED_PADDING_ELEMENTS = old


# ---- chat template, conversation and a local tokenizer: test_chat_rollouts, test_train_run -----
SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]

# ChatML with tools in a system block and tool calls after the assistant's content
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% if 'tool_calls' in m %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "({{ c.function.arguments | tojson }})</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "content": "18C, sunny"},
    {"role": "assistant", "content": "18C and sunny."},
]  # fmt: skip


def save_tokenizer(path, template, extra_tokens=()):
    """A character-level tokenizer with ChatML special tokens and ``template``, saved to ``path``."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token a character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )  # fmt: skip
    if extra_tokens:
        fast.add_tokens(list(extra_tokens))
    fast.chat_template = template
    fast.save_pretrained(path)
    return path


def prompt_response_batch(prompts, responses) -> dict[str, torch.Tensor]:
    """verl's padded layout of prompt/response pairs: prompts left-padded, responses right-padded,
    ``input_ids`` and ``attention_mask`` the two side by side, ``position_ids`` counted over the
    mask, ``response_mask`` the responses' mask (a copy, for tests to edit)."""
    size, width_p, width_r = len(prompts), max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.zeros(size, width_p, dtype=torch.long)
    response_ids = torch.zeros(size, width_r, dtype=torch.long)
    prompt_mask, response_mask = torch.zeros_like(prompt_ids), torch.zeros_like(response_ids)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[b, width_p - len(p) :], prompt_mask[b, width_p - len(p) :] = torch.tensor(p), 1
        response_ids[b, : len(r)], response_mask[b, : len(r)] = torch.tensor(r), 1
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], 1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "prompts": prompt_ids,
        "responses": response_ids, "response_mask": response_mask.clone(),
    }  # fmt: skip


def run_train(config, out, *extra) -> int:
    """``harts train CONFIG --out OUT ...`` in this process; its exit status."""
    from harts.cli import main

    try:
        main(["train", str(config), "--out", str(out), *extra])
    except SystemExit as exc:
        return exc.code
    return 0


def group_spans(rollouts) -> list[list[int]]:
    """Indices of the rollouts of each group (runs of equal ``group_id``), in order."""
    spans: list[list[int]] = []
    for i, r in enumerate(rollouts):
        if spans and rollouts[spans[-1][0]].group_id == r.group_id:
            spans[-1].append(i)
        else:
            spans.append([i])
    return spans
