"""The repository files tests read (docs, examples, golden outputs), and an example script loaded as a module."""
from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "golden"   # pinned explain() and CLI outputs (SBP_REGEN_GOLDEN=1 rewrites them)


@functools.cache
def load_example(name: str) -> ModuleType:
    """`examples/<name>.py` as the module `<name>`, loaded once per process (its dataclasses look their module
    up in sys.modules). E.g. ``load_example("train_tp").Config``."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
