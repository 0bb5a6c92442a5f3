"""sbp: sharded global tensors for PyTorch with Split / Broadcast / Partial placements.

>>> import sbp
>>> sbp.placements("S(0), B")
(S(0), B)
"""
from .errors import (CheckpointError, CommError, MeshError, PlacementError, PlanError, RankMismatchError,
                     SbpError, ShapeError, UnsupportedOpError)
from .layout import global_offset, local_shape, local_slices
from .mesh import DeviceMesh
from .placement import B, Broadcast, Partial, PartialMax, PartialMin, PartialSum, Placement, S, Split, placements

__version__ = "0.1.0"
from .planner import lower_bound_bytes, plan
from .steps import Plan, Step
from .backends.dist import init_device_mesh, init_mesh
from .crossmesh import CrossMeshPlan, plan_cross_mesh
from .tensor import FallbackWarning, GlobalTensor
from .api import distribute, from_local
from .factories import empty, full, ones, rand, randn, zeros
from .visualize import visualize
from .interop import from_dtensor, to_dtensor
from . import nn
from .checkpoint import load, save
from . import ops as _ops  # installs the operator rules (sbp.ops) into GlobalTensor dispatch
from .ops import strict
from .errors import DTypeError
from .debug import debug
from . import testing  # sbp.testing.spmd, strategies and assertions without a separate import
