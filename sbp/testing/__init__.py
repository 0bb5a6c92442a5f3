"""sbp.testing: run code on every rank of a mesh (`spmd`), in-process or on gloo, for tests and users.

>>> import sbp, sbp.testing, torch
>>> sbp.testing.spmd(lambda mesh: mesh.coord, (2, 2))
[(0, 0), (0, 1), (1, 0), (1, 1)]
"""
from .spmd import SpmdError, spmd, submesh
from .asserts import assert_layout_equivalent

_STRATEGIES = ("meshes", "placements", "global_shapes", "layouts")


def __getattr__(name: str):
    # Hypothesis is a dev extra: the strategies are imported only when asked for
    if name in _STRATEGIES:
        from . import strategies
        return getattr(strategies, name)
    raise AttributeError(f"module 'sbp.testing' has no attribute {name!r}")
