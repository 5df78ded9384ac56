"""A test of a family the installed transformers lacks is skipped, saying so.

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
