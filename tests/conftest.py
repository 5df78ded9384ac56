"""Suite-wide hooks: families the installed transformers lacks, and the oldest version's run.

A test of a family the installed transformers lacks is skipped, saying so.

harts registers a family only when the installed transformers has it; the older end of the
supported range lacks the newest families. Such a test fails with ``FamilyUnavailable`` when it
builds the model; it is reported as skipped with the reason, never as a pass.
"""

from __future__ import annotations

import pytest

from harts.adapters import FamilyUnavailable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(FamilyUnavailable):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {call.excinfo.value}")


# ---- `make test-oldest`: what can differ between transformers versions ---------------------------
#: modules that never build a Hugging Face model, tokenizer or config: pure functions of harts' own
#: code (forests, plans, kernels against their references, objectives), the same on any version
VERSION_INDEPENDENT = frozenset({
    "test_advantages", "test_architecture", "test_forest", "test_gae", "test_gpu_check", "test_objectives",
    "test_objective_registry", "test_ops_packed", "test_ops_recurrence", "test_ops_tree", "test_plans",
    "test_rollout", "test_rollout_stats", "test_synthetic", "test_tree_attention",
    "test_tree_attention_window_sinks",
})  # fmt: skip


def pytest_addoption(parser):
    parser.addoption(
        "--version-axis", action="store_true",
        help="run only what can differ between transformers versions: skip the modules of pure "
        "functions, and run each family's crossings (shapes, budgets, objectives) at their first and "
        "last case",
    )  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Under ``--version-axis``, keep what a transformers version can change: each family's stock
    model classes. The axes crossed with a family (forest shapes, budgets, objectives) run through
    harts' own code, the same on every version, so the full crossing runs once (with the newest
    version) and here each test function keeps its first and last case per family."""
    if not config.getoption("--version-axis"):
        return
    cases: dict[tuple[str, object], list] = {}
    kept, dropped = [], []
    for item in items:
        if item.path.stem in VERSION_INDEPENDENT:
            dropped.append(item)
            continue
        callspec = getattr(item, "callspec", None)
        family = callspec.params.get("family") if callspec is not None else None
        if family is None:
            kept.append(item)
        else:
            cases.setdefault((item.nodeid.split("[")[0], family), []).append(item)
    for group in cases.values():
        kept += group[:1] + group[-1:] if len(group) > 1 else group
        dropped += group[1:-1]
    order = {id(item): i for i, item in enumerate(items)}
    kept.sort(key=lambda item: order[id(item)])
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
