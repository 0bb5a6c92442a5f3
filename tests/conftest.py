"""Shared test setup: gloo worker pools are shut down when the session ends.

tests/ is a package (tests/<layer>/, helpers in tests/support/): pytest imports each test file by its
dotted name (``tests.runtime.test_execute_gloo``) with the repository root on sys.path, and gloo workers,
which start with the parent's sys.path, unpickle functions by that same name."""
from __future__ import annotations

import sys

import sbp

# tests build GlobalTensors directly too (not only through sbp.<name>): wire the operator rules first
sbp.load_torch_layers()


def pytest_sessionfinish(session, exitstatus) -> None:
    testing = sys.modules.get("sbp.testing.spmd")
    if testing is not None:
        testing._POOLS.close_all()
