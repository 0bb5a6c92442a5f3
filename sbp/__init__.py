"""sbp: sharded global tensors for PyTorch with Split / Broadcast / Partial placements.

The package is layered (see docs/architecture.md): ``sbp.values`` and ``sbp.planning`` are pure Python
and load here at once, so ``python -m sbp plan`` and ``import sbp.planning`` never import torch. The
names of the torch layers (``sbp.distribute``, ``sbp.init_mesh``, ``sbp.nn``, ...) load on first use:
`load_torch_layers` imports them and wires the operator rules into `GlobalTensor` dispatch
(``sbp.ops.install()``) and registers sbp's types for ``torch.load(weights_only=True)``, once. A program
that imported torch before sbp gets them at ``import sbp``; importing a torch layer directly (``import sbp.nn``,
``import sbp.testing``, ``import sbp.ops``) installs the rules and registers the types as well.

>>> import sbp
>>> sbp.placements("S(0), B")
(S(0), B)
>>> sbp.distribute is sbp.tensor.construct.distribute      # the first use loads the torch layers
True
"""
from __future__ import annotations

import importlib
import sys

from .planning.api import lower_bound_bytes, plan
from .planning.crossmesh import CrossMeshPlan, plan_cross_mesh
from .values.errors import (
    CheckpointError,
    CommError,
    DTypeError,
    MeshError,
    PlacementError,
    PlanError,
    RankMismatchError,
    SbpError,
    ShapeError,
    UnsupportedOpError,
)
from .values.layout import global_offset, local_shape, local_slices
from .values.mesh import DeviceMesh
from .values.placement import B, Broadcast, Partial, PartialMax, PartialMin, PartialSum, Placement, S, Split, placements
from .values.steps import Plan, Step
from .values.topology import Topology

__version__ = "0.1.0"

# public name -> the module of the torch layers that defines it
_TORCH_NAMES = {
    "init_mesh": "sbp.runtime.backends.dist", "init_device_mesh": "sbp.runtime.backends.dist",
    "debug": "sbp.runtime.agreement", "calibrate": "sbp.runtime.calibrate",
    "GlobalTensor": "sbp.tensor.global_tensor", "FallbackWarning": "sbp.tensor.global_tensor",
    "distribute": "sbp.tensor.construct", "from_local": "sbp.tensor.construct",
    "empty": "sbp.tensor.factories", "full": "sbp.tensor.factories", "ones": "sbp.tensor.factories",
    "rand": "sbp.tensor.factories", "randn": "sbp.tensor.factories", "zeros": "sbp.tensor.factories",
    "strict": "sbp.ops.strict",
    "from_dtensor": "sbp.io.interop", "to_dtensor": "sbp.io.interop", "full_state_dict": "sbp.io.interop",
    "load": "sbp.io.checkpoint", "save": "sbp.io.checkpoint",
    "visualize": "sbp.tools.visualize",
}
# subpackages reachable as attributes after a plain `import sbp` (sbp.nn.parallelize, sbp.testing.spmd)
_SUBPACKAGES = ("nn", "ops", "testing", "tensor", "runtime", "io", "tools", "values", "planning")

__all__ = sorted([
    "CheckpointError", "CommError", "DTypeError", "MeshError", "PlacementError", "PlanError",
    "RankMismatchError", "SbpError", "ShapeError", "UnsupportedOpError", "global_offset", "local_shape",
    "local_slices", "DeviceMesh", "B", "Broadcast", "Partial", "PartialMax", "PartialMin", "PartialSum",
    "Placement", "S", "Split", "placements", "Plan", "Step", "Topology", "lower_bound_bytes", "plan", "CrossMeshPlan",
    "plan_cross_mesh", "nn", "testing", *_TORCH_NAMES])


def load_torch_layers() -> None:
    """Import the torch layers (runtime, tensor, ops, nn, io, tools, testing) and wire the operator rules
    into `GlobalTensor` dispatch. Called on the first use of a torch-level name; calling it again is free.

    >>> import sbp
    >>> sbp.load_torch_layers(); sbp.ops.is_installed()
    True
    """
    if "GlobalTensor" in globals():
        return
    ops = importlib.import_module("sbp.ops")
    ops.install()
    importlib.import_module("sbp.tensor.global_tensor").register_safe_globals()
    for name in ("nn", "testing"):
        globals()[name] = importlib.import_module(f"sbp.{name}")
    for name, module in _TORCH_NAMES.items():
        globals()[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        load_torch_layers()
        return globals()[name]
    if name in _SUBPACKAGES:
        load_torch_layers()
        return importlib.import_module(f"sbp.{name}")
    raise AttributeError(f"module 'sbp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))


# A program that imported torch first will use it with sbp: wire the torch layers now, so that even its
# first `torch.load` (weights_only by default) knows sbp's types. The planning CLI never imports torch.
if "torch" in sys.modules:
    load_torch_layers()
