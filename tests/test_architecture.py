"""Imports run one way: forest <- plan <- ops <- adapters <- runtime <- steps <- trainer; objectives pure.

``batch_positions`` (where trajectories sit in padded or packed tensors) sits with the forest, below
everything.

Each harts module belongs to a layer and may import only its own and lower layers (read from the
source with ``ast``, so imports inside functions count too). Objectives see the forest and
nothing that runs a model. The tools on top (benchmarks, demo, command line, the package's
public API) may import anything. A failure names the module and the import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import harts

SRC = Path(harts.__file__).parent
# layer -> the layers it may import (its own included)
ALLOWED = {
    "batch_positions": {"batch_positions"},
    "forest": {"batch_positions", "forest"},
    "data": {"batch_positions", "forest", "objectives", "data"},
    "objectives": {"batch_positions", "forest", "objectives"},
    "plan": {"batch_positions", "forest", "plan"},
    "ops": {"batch_positions", "forest", "plan", "ops"},
    "adapters": {"batch_positions", "forest", "plan", "ops", "adapters"},
    "runtime": {"batch_positions", "forest", "plan", "ops", "adapters", "runtime"},
    "steps": {"batch_positions", "forest", "plan", "ops", "adapters", "runtime", "objectives", "steps"},
    "tiny": {"adapters", "tiny"},
}
# the recorded MoE routes of a forest's tokens: beside the forest, read wherever the forest is
ALLOWED["forest_routes"] = {"forest_routes"}
for _layer, _allowed in ALLOWED.items():
    if "forest" in _allowed:
        _allowed.add("forest_routes")
# training runs (harts train): every layer above and the tiny models; nothing below imports it
ALLOWED["trainer"] = set(ALLOWED) | {"trainer"}
# online RL (harts rl): a layer above the training run, whose pieces it reuses; trainer never imports it
ALLOWED["rl"] = ALLOWED["trainer"] | {"rl"}
# RL stacks' batches (TRL, verl) through the step: above steps, beside the trainer, which never needs it
ALLOWED["integrations"] = ALLOWED["steps"] | {"integrations"}
TOOLS = {"bench", "demo", "cli", "analyze", "__init__", "__main__"}


def layer_of(module: str) -> str:
    """``harts.plan.layout`` -> ``plan``; ``harts`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def harts_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "harts"]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "harts"
        ):
            if node.module == "harts":  # from harts import x: x is a subpackage or a re-export
                found += [f"harts.{a.name}" if (SRC / a.name).exists() or (SRC / f"{a.name}.py").exists()
                          else "harts" for a in node.names]  # fmt: skip
            else:
                found.append(node.module)
    return found


def modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        yield name, path


def test_every_module_has_a_layer():
    unknown = {layer_of(m) for m, _ in modules()} - set(ALLOWED) - TOOLS
    assert not unknown, f"modules outside every layer: {sorted(unknown)}"


def test_imports_run_one_way():
    upward = []
    for name, path in modules():
        layer = layer_of(name)
        if layer in TOOLS:
            continue
        for target in harts_imports(path):
            if layer_of(target) not in ALLOWED[layer]:
                upward.append(f"{name} imports {target}")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_cycles_between_modules():
    graph = {name: set() for name, _ in modules()}
    for name, path in modules():
        for target in harts_imports(path):
            # "harts.x.y" may name a function re-exported by a package: keep the longest module prefix
            while target not in graph and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in graph and target != name and layer_of(name) not in TOOLS:
                graph[name].add(target)
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check can fail: an ops module importing the runtime is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from harts.runtime.backward import forest_backward\n")
    assert harts_imports(bad) == ["harts.runtime.backward"]
    assert layer_of("harts.runtime.backward") not in ALLOWED["ops"]


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore stays in its module: what two modules share is public."""
    found = [
        f"{name}: from {node.module} import {alias.name}"
        for name, path in modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "harts"
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not found, found


def test_loss_kinds_are_tested_only_inside_objectives():
    """What a loss kind needs is declared by its registry entry (objectives/losses.py); no code
    outside objectives/ branches on a kind."""
    found = [
        f"{name}:{node.lineno}"
        for name, path in modules()
        if layer_of(name) != "objectives"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "LossKind"
    ]
    assert not found, found


# where a family name may be written outside adapters/: the defaults of tools and benchmarks
FAMILY_DEFAULTS = {"harts.demo", "harts.bench.cases", "harts.bench.overhead", "harts.bench.critic_step",
                   "harts.bench.distributed_step", "harts.bench.fsdp_memory", "harts.bench.integrations_grpo",
                   "harts.bench.master_weights", "harts.bench.three_passes",
                   "harts.bench.ideal_share", "harts.bench.gpu_check"}  # fmt: skip


def test_family_knowledge_stays_in_the_adapters():
    """A family's facts live on its adapter; elsewhere a family name appears only as a default."""
    from harts.adapters.base import all_families

    names = set(all_families())
    found = sorted({
        f"{name}: {node.value!r}"
        for name, path in modules()
        if layer_of(name) != "adapters" and name not in FAMILY_DEFAULTS
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    })  # fmt: skip
    assert names and not found, found


MAX_MODULE_LINES = 500  # a module a reader holds in mind at once
MAX_FUNCTION_LINES = 80  # a function read without scrolling, docstring included


def test_modules_and_functions_stay_small():
    """Small units: no module over 500 lines, no function over 80; split by meaning when one grows."""
    long_modules, long_functions = [], []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(SRC)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_the_docs_index_links_every_page():
    """docs/index.md links every page of docs/ (and every link it holds resolves)."""
    docs = SRC.parents[1] / "docs"
    index = (docs / "index.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+)", index))
    pages = {str(p.relative_to(docs)) for p in docs.rglob("*.md") if p.name != "index.md"}
    assert pages <= linked, f"pages docs/index.md does not link: {sorted(pages - linked)}"
    missing = [link for link in linked if not (docs / link).exists()]
    assert not missing, f"links in docs/index.md that lead nowhere: {missing}"


def test_src_is_as_the_formatter_leaves_it():
    """``ruff format`` lays out src/ (the size rules above measure what it leaves); a few tables may
    keep their own layout with ``fmt: skip``."""
    markers = sum(path.read_text().count("fmt: skip") for path in SRC.rglob("*.py"))
    assert markers <= 10, f"{markers} fmt: skip markers in src/harts (at most 10, for tables)"
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.exists():
        pytest.skip("ruff is not installed beside this interpreter (the dev extra installs it)")
    done = subprocess.run([str(ruff), "format", "--check", str(SRC)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
