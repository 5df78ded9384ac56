"""Configs for the ``harts train`` tests: a TOML file over the example rollouts, any family.

The tests run on every supported transformers version, so the family comes from
``harts.testing.FAMILIES`` (what the installed version has), not from the example's
bailing_hybrid. One thread keeps the runs deterministic and fast on a shared 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harts.testing import FAMILIES

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
