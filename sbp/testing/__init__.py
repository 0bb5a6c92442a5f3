"""sbp.testing: run code on every rank of a mesh (`spmd`), in-process or on gloo, for tests and users.

The Hypothesis strategies (`sbp.testing.strategies`, also reachable as `sbp.testing.meshes`,
`placements`, `global_shapes` and `layouts`) are imported on first use: they need hypothesis, a dev extra.

>>> import sbp, sbp.testing, torch
>>> sbp.testing.spmd(lambda mesh: mesh.coord, (2, 2))
[(0, 0), (0, 1), (1, 0), (1, 1)]
>>> sbp.testing.strategies.layouts is sbp.testing.layouts
True
"""
import importlib as _importlib

from .. import ops as _ops  # noqa: F401  (the rule table: a function run on the ranks may use any op)
from .asserts import assert_layout_equivalent
from .spmd import SpmdError, spmd, submesh

# The lazy, hypothesis-backed names (`strategies` and the names in `_STRATEGIES`) stay out of `__all__`:
# `from sbp.testing import *` must not need hypothesis.
__all__ = ["spmd", "submesh", "SpmdError", "assert_layout_equivalent"]

_STRATEGIES = ("meshes", "placements", "global_shapes", "layouts")


def __getattr__(name: str):
    # Hypothesis is a dev extra: the strategies are imported only when asked for. (import_module, not
    # `from . import strategies`, which would look the name up here again and recurse.)
    if name == "strategies" or name in _STRATEGIES:
        strategies = _importlib.import_module("sbp.testing.strategies")
        return strategies if name == "strategies" else getattr(strategies, name)
    raise AttributeError(f"module 'sbp.testing' has no attribute {name!r}")
