"""``harts train`` with the faulty test backends of tests/test_verify.py registered (each rank of
tests/test_verify_sharded.py imports them before the command runs)."""

from __future__ import annotations

import sys

import tests.test_verify  # noqa: F401 (registers the faulty backends)
from harts.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
