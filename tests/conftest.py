"""Shared test setup: `tests/` is importable (the conformance table lives there, and gloo workers
unpickle functions from it), and gloo worker pools are shut down when the session ends."""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pytest_sessionfinish(session, exitstatus) -> None:
    testing = sys.modules.get("sbp.testing.spmd")
    if testing is not None:
        testing._POOLS.close_all()
