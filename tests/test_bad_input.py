"""Bad input, one table: every public entry point refuses invalid arguments with the right `sbp.SbpError`
subclass and a message naming the rule, the offending values and what is valid -- never a bare
TypeError / RuntimeError / AssertionError from inside torch.

Each row is (id, call, expected error class, message fragment, where): ``pure`` rows run here, ``threads``
rows run ``call(mesh)`` on every rank of an in-process mesh (`sbp.testing.spmd`), ``gloo`` rows run in one
batch on four gloo processes (what needs real process groups: `init_mesh`, DTensor interop). Rows marked
``xfail`` document bad input that files outside this test's reach still mishandle (see the reasons).
"""
from __future__ import annotations

import functools
import os
import pickle
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, NamedTuple

import hypothesis
import pytest
import torch
import torch.nn as nn

import sbp
import sbp.testing
import sbp.testing.strategies
from sbp import DeviceMesh, Partial, S, Split

MIN_ROWS = 230          # the table below has at least this many rows (237; 233 where CUDA is available)
CUDA = torch.cuda.is_available()


class Row(NamedTuple):
    id: str
    call: Callable[..., Any]
    error: type
    fragment: str
    where: str = "pure"                  # "pure" | "threads" | "gloo"
    mesh: tuple[int, ...] = (2,)         # threads rows: the mesh shape
    xfail: str = ""                      # reason, for bad input a file outside this suite mishandles


def T(id, call, error, fragment, mesh=(2,), xfail=""):
    """A row that runs `call(mesh)` on every rank of an in-process mesh."""
    return Row(id, call, error, fragment, "threads", mesh, xfail)


def G(id, call, error, fragment):
    """A row that runs `call(mesh)` on every rank of a 4-process gloo world."""
    return Row(id, call, error, fragment, "gloo", (4,))


PE, ME, SE, PLE, DE = sbp.PlacementError, sbp.MeshError, sbp.ShapeError, sbp.PlanError, sbp.DTypeError
CE, E = sbp.CheckpointError, sbp.SbpError
MESH = DeviceMesh((2, 2), names=("dp", "tp"))
M1 = DeviceMesh((2,))


def cuda_mesh(mesh):
    """The same ranks as `mesh`, as a CUDA mesh bound to the same (threads) world."""
    return mesh.binding.bind(DeviceMesh(mesh.shape, mesh.names, mesh.ranks, device_type="cuda"))


@contextmanager
def _without_torchrun_env():
    saved = {k: os.environ.pop(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _init_mesh_without_env():
    with _without_torchrun_env():
        return sbp.init_mesh((2,))


def _init_mesh_with_env(**env):
    """init_mesh with a torchrun environment of `env` (the rest valid: loopback, a port nothing listens on)."""
    with _without_torchrun_env():
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2", **env})
        try:
            return sbp.init_mesh((2,), device_type="cpu", timeout=5)
        finally:
            for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
                os.environ.pop(k, None)


def _x(mesh, pls="S(0)", t=None):
    return sbp.distribute(torch.ones(4, 4) if t is None else t, mesh, pls)


_CKPT = tempfile.mkdtemp(prefix="sbp-bad-input-")


def _saved_checkpoint() -> str:
    path = os.path.join(_CKPT, "ok")
    if not os.path.exists(path):
        sbp.save({"w": torch.arange(8.).view(4, 2)}, path)
    return path


def _parallelize(mesh, plan, **kw):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    return sbp.nn.parallelize(model, mesh, plan, **kw)


ROWS: list[Row] = [
    # ---- placements: parsing and construction -------------------------------------------------------------
    Row("placements-int", lambda: sbp.placements(5), PE, "must be a string, a placement or an iterable of placements, got int"),
    Row("placements-none", lambda: sbp.placements(None), PE, "got NoneType"),
    Row("placements-set", lambda: sbp.placements({sbp.S(1), sbp.S(0)}), PE, "must be in mesh-axis order (a tuple or list, one per axis), got a set, which has no order"),
    Row("local-shape-set", lambda: sbp.local_shape((4, 6), (2, 3), {sbp.S(1), sbp.S(0)}, (0, 0)), PE, "got a set, which has no order"),
    Row("placements-bad-dim", lambda: sbp.placements("S(x)"), PE, "cannot parse placement 'S(x)'; accepted: S(d) or Sd"),
    Row("placements-unknown", lambda: sbp.placements("Q"), PE, "cannot parse placement 'Q'"),
    Row("placements-empty-item", lambda: sbp.placements("S(0),,B"), PE, "cannot parse placement ''"),
    Row("placements-bytes", lambda: sbp.placements(b"S0"), PE, "83 is not a placement"),
    Row("placements-list-of-int", lambda: sbp.placements([1]), PE, "1 is not a placement; accepted"),
    Row("placements-mixed-float", lambda: sbp.placements([S(0), 3.5]), PE, "3.5 is not a placement"),
    Row("placements-partial-op", lambda: sbp.placements("P(avg)"), PE, "Partial op 'avg' is not one of ('sum', 'min', 'max')"),
    Row("placements-partial-upper", lambda: sbp.placements("P(SUM)"), PE, "cannot parse placement 'P(SUM)'"),
    Row("placements-double-paren", lambda: sbp.placements("((S0))"), PE, "cannot parse placement '(S0)'"),
    Row("placements-unclosed", lambda: sbp.placements("S(0"), PE, "cannot parse placement 'S(0'"),
    Row("placements-float-dim", lambda: sbp.placements("S(1.5)"), PE, "cannot parse placement 'S(1.5)'"),
    Row("placements-b-with-arg", lambda: sbp.placements("B(0)"), PE, "cannot parse placement 'B(0)'"),
    Row("split-str", lambda: Split("0"), PE, "Split dim must be an int, got '0' (str)"),
    Row("split-bool", lambda: Split(True), PE, "Split dim must be an int, got True (bool)"),
    Row("split-float", lambda: Split(1.0), PE, "got 1.0 (float)"),
    Row("split-none", lambda: Split(None), PE, "got None (NoneType)"),
    Row("partial-avg", lambda: Partial("avg"), PE, "Partial op must be one of ('sum', 'min', 'max'), got 'avg'"),
    Row("partial-list", lambda: Partial(["sum"]), PE, "got ['sum']"),
    Row("partial-none", lambda: Partial(None), PE, "got None"),
    Row("partial-upper", lambda: Partial("SUM"), PE, "got 'SUM'"),
    # ---- placements meet a tensor and a mesh -------------------------------------------------------------
    Row("normalize-dim-high", lambda: sbp.local_shape((4,), (2,), "S(1)", (0,)), PE, "S(1) is out of range for a 1-d tensor (valid: -1..0)"),
    Row("normalize-dim-low", lambda: sbp.local_shape((4,), (2,), "S(-2)", (0,)), PE, "S(-2) is out of range for a 1-d tensor (valid: -1..0)"),
    Row("normalize-0d", lambda: sbp.local_shape((), (2,), "S(0)", (0,)), PE, "valid: none: a 0-d tensor cannot be split"),
    Row("normalize-too-many", lambda: sbp.local_shape((4,), (2,), "S(0), B", (0,)), PE, "give 2 placement(s) but the mesh has 1 axes (need exactly one placement per mesh axis)"),
    Row("normalize-too-few", lambda: sbp.local_shape((4,), (2, 2), "S(0)", (0, 0)), PE, "give 1 placement(s) but the mesh has 2 axes"),
    Row("normalize-none-given", lambda: sbp.local_shape((4,), (2,), "", (0,)), PE, "give 0 placement(s)"),
    # ---- DeviceMesh as a value ------------------------------------------------------------------------------
    Row("mesh-str", lambda: DeviceMesh("2x2"), ME, "mesh shape must be a non-empty tuple of positive ints, got '2x2'"),
    Row("mesh-none", lambda: DeviceMesh(None), ME, "mesh shape must be a tuple of positive ints, got None"),
    Row("mesh-empty", lambda: DeviceMesh(()), ME, "got ()"),
    Row("mesh-zero", lambda: DeviceMesh((2, 0)), ME, "got (2, 0)"),
    Row("mesh-negative", lambda: DeviceMesh((-1,)), ME, "got (-1,)"),
    Row("mesh-too-many-ranks", lambda: DeviceMesh((99999999999,)), ME, "mesh shape (99999999999,) has 99999999999 ranks; a mesh holds at most 16777216"),
    Row("plan-mesh-too-many-ranks", lambda: sbp.plan((4,), (1 << 20, 1 << 20), "S0, B", "B, B"), ME, "has 1099511627776 ranks; a mesh holds at most 16777216"),
    Row("mesh-coord-of-bool", lambda: DeviceMesh((2, 2)).coord_of(True), ME, "a rank is an int, got True"),
    Row("mesh-float", lambda: DeviceMesh((2.0,)), ME, "got (2.0,)"),
    Row("mesh-bool", lambda: DeviceMesh((True,)), ME, "got (True,)"),
    Row("mesh-names-int", lambda: DeviceMesh((2,), names=5), ME, "mesh names must be a tuple of strings, one per axis of shape (2,), got 5"),
    Row("mesh-names-count", lambda: DeviceMesh((2, 2), names=("a",)), ME, "mesh names ('a',) must have one name per axis of shape (2, 2)"),
    Row("mesh-names-duplicate", lambda: DeviceMesh((2, 2), names=("tp", "tp")), ME, "mesh axis names must be unique, got ('tp', 'tp') (duplicated: tp)"),
    Row("mesh-names-not-str", lambda: DeviceMesh((2, 2), names=(1, 2)), ME, "mesh axis names must be non-empty strings, got (1, 2)"),
    Row("mesh-names-empty", lambda: DeviceMesh((2, 2), names=("", "b")), ME, "non-empty strings"),
    Row("mesh-ranks-int", lambda: DeviceMesh((2,), ranks=5), ME, "mesh ranks must be a sequence of 2 distinct world ranks (row-major), got 5"),
    Row("mesh-ranks-count", lambda: DeviceMesh((2,), ranks=[0]), ME, "mesh of shape (2,) needs 2 ranks, got 1: [0]"),
    Row("mesh-ranks-duplicate", lambda: DeviceMesh((2,), ranks=[0, 0]), ME, "mesh ranks must be distinct, got [0, 0]"),
    Row("mesh-ranks-negative", lambda: DeviceMesh((2,), ranks=[0, -1]), ME, "mesh ranks must be non-negative ints, got [0, -1]"),
    Row("mesh-ranks-float", lambda: DeviceMesh((2,), ranks=[0, 1.0]), ME, "non-negative ints, got [0, 1.0]"),
    Row("mesh-device-tpu", lambda: DeviceMesh((2,), device_type="tpu"), ME, "device_type must be 'cpu' or 'cuda', got 'tpu'"),
    Row("mesh-device-none", lambda: DeviceMesh((2,), device_type=None), ME, "device_type must be 'cpu' or 'cuda', got None"),
    Row("mesh-axis-range", lambda: MESH.axis(5), ME, "mesh axis 5 is out of range for a 2-axis mesh (valid: -2..1 or a name)"),
    Row("mesh-axis-unknown-name", lambda: MESH.axis("pp"), ME, "mesh has no axis named 'pp' (axis names: ('dp', 'tp'))"),
    Row("mesh-axis-none", lambda: MESH.axis(None), ME, "mesh axis None is out of range"),
    Row("mesh-axis-unnamed-mesh", lambda: M1.axis("tp"), ME, "mesh has no axis named 'tp' (axis names: None)"),
    Row("mesh-size-unknown-name", lambda: MESH.size("pp"), ME, "no axis named 'pp'"),
    Row("mesh-coord-of", lambda: MESH.coord_of(9), ME, "rank 9 is not in this mesh (ranks: [0, 1, 2, 3])"),
    Row("mesh-index-of-int", lambda: MESH.index_of(5), ME, "coord 5 is not in a mesh of shape (2, 2) (a coord is a tuple of 2 ints, one per axis)"),
    Row("mesh-rank-of-range", lambda: MESH.rank_of((2, 0)), ME, "coord (2, 0) is not in a mesh of shape (2, 2)"),
    Row("mesh-rank-of-none", lambda: MESH.rank_of(None), ME, "coord None is not in a mesh of shape (2, 2)"),
    Row("mesh-groups-none", lambda: MESH.groups(None), ME, "mesh axes must be an axis (index or name) or a sequence of them, got None"),
    Row("mesh-groups-bad-item", lambda: MESH.groups(["dp", 7]), ME, "mesh axis 7 is out of range"),
    Row("mesh-submesh-none", lambda: MESH.submesh(0, None), ME, "coord None is not in a mesh"),
    Row("mesh-coord-pure", lambda: MESH.coord, ME, "mesh.coord needs a mesh bound to processes (sbp.init_mesh or sbp.testing.spmd)"),
    Row("mesh-rank-pure", lambda: MESH.rank, ME, "this DeviceMesh(2, 2) is a pure value"),
    Row("mesh-getitem-pure", lambda: MESH["tp"], ME, "needs a mesh bound to processes"),
    # ---- layout maths ---------------------------------------------------------------------------------------
    Row("layout-coord-none", lambda: sbp.local_shape((4,), (2,), "S(0)", None), SE, "coord None is not in a mesh of shape (2,) (a coord is a tuple of 1 int, one per axis)"),
    Row("layout-coord-int", lambda: sbp.local_shape((4,), (2,), "S(0)", 0), SE, "coord 0 is not in a mesh of shape (2,)"),
    Row("layout-coord-range", lambda: sbp.local_slices((4,), (2,), "S(0)", (2,)), SE, "coord (2,) is not in a mesh of shape (2,)"),
    Row("layout-coord-length", lambda: sbp.global_offset((4,), (2,), "S(0)", (0, 0)), SE, "coord (0, 0) is not in a mesh of shape (2,)"),
    Row("layout-shape-str", lambda: sbp.local_shape("ab", (2,), "B", (0,)), SE, "global_shape must be a sequence of non-negative ints, got 'ab'"),
    Row("layout-shape-negative", lambda: sbp.local_shape((-1,), (2,), "B", (0,)), SE, "got (-1,)"),
    Row("layout-shape-float", lambda: sbp.local_shape((4.0,), (2,), "B", (0,)), SE, "got (4.0,)"),
    Row("layout-shape-none", lambda: sbp.local_slices(None, (2,), "B", (0,)), SE, "got None"),
    Row("layout-mesh-str", lambda: sbp.global_offset((4,), "2x", "S(0)", (0,)), ME, "cannot parse mesh shape '2x'; write it like '2x2' or '8'"),
    Row("layout-mesh-none", lambda: sbp.local_shape((4,), None, "S(0)", (0,)), ME, "mesh shape must be a tuple of positive ints, got None"),
    Row("layout-mesh-zero", lambda: sbp.local_shape((4,), 0, "S(0)", (0,)), ME, "got 0"),
    # ---- the planner ------------------------------------------------------------------------------------------
    Row("plan-itemsize-zero", lambda: sbp.plan((4,), (2,), "S(0)", "B", 0), PLE, "itemsize must be a positive int (bytes per element), got 0"),
    Row("plan-itemsize-str", lambda: sbp.plan((4,), (2,), "S(0)", "B", "4"), PLE, "got '4'"),
    Row("plan-itemsize-float", lambda: sbp.plan((4,), (2,), "S(0)", "B", 2.0), PLE, "got 2.0"),
    Row("plan-itemsize-bool", lambda: sbp.plan((4,), (2,), "S(0)", "B", True), PLE, "got True"),
    Row("plan-latency-negative", lambda: sbp.plan((4,), (2,), "S(0)", "B", latency_bytes=-1), PLE, "latency_bytes must be a non-negative int, got -1"),
    Row("plan-latency-float", lambda: sbp.plan((4,), (2,), "S(0)", "B", latency_bytes=1.5), PLE, "got 1.5"),
    Row("plan-mesh-str", lambda: sbp.plan((4,), "a", "S(0)", "B"), ME, "cannot parse mesh shape 'a'"),
    Row("plan-mesh-empty", lambda: sbp.plan((4,), (), "S(0)", "B"), ME, "non-empty tuple of positive ints, got ()"),
    Row("plan-dst-range", lambda: sbp.plan((4,), (2,), "S(0)", "S(3)"), PE, "S(3) is out of range for a 1-d tensor (valid: -1..0)"),
    Row("plan-src-none", lambda: sbp.plan((4,), (2,), None, "B"), PE, "got NoneType"),
    Row("plan-src-length", lambda: sbp.plan((4, 4), (2, 2), "S(0)", "B, B"), PE, "give 1 placement(s) but the mesh has 2 axes"),
    Row("plan-shape-none", lambda: sbp.plan(None, (2,), "B", "B"), SE, "global_shape must be a sequence of non-negative ints, got None"),
    Row("lower-bound-itemsize", lambda: sbp.lower_bound_bytes((4,), (2,), "S(0)", "B", -1), PLE, "got -1"),
    Row("lower-bound-dst", lambda: sbp.lower_bound_bytes((4,), (2,), "S(0)", "P(avg)"), PE, "Partial op 'avg'"),
    Row("cross-src-mesh-tuple", lambda: sbp.plan_cross_mesh((4,), (2,), "S(0)", M1, "B"), ME, "src_mesh must be a sbp.DeviceMesh (with the world ranks it covers), got tuple"),
    Row("cross-dst-mesh-str", lambda: sbp.plan_cross_mesh((4,), M1, "S(0)", "2", "B"), ME, "dst_mesh must be a sbp.DeviceMesh"),
    Row("cross-placements", lambda: sbp.plan_cross_mesh((4,), M1, "S(0), B", M1, "B"), PE, "give 2 placement(s) but the mesh has 1 axes"),
    Row("cross-itemsize", lambda: sbp.plan_cross_mesh((4,), M1, "S(0)", M1, "B", 0), PLE, "itemsize must be a positive int"),
    # ---- factories (mesh=None: plain tensors) --------------------------------------------------------------
    Row("zeros-dtype-str", lambda: sbp.zeros((2,), dtype="float32"), DE, "dtype must be a torch.dtype (e.g. torch.float32) or None, got 'float32'"),
    Row("zeros-shape-str", lambda: sbp.zeros("ab"), SE, "global_shape must be a sequence of non-negative ints, got 'ab'"),
    Row("zeros-shape-negative", lambda: sbp.zeros(-1), SE, "got (-1,)"),
    Row("zeros-shape-float", lambda: sbp.zeros(2.5), SE, "got 2.5"),
    Row("zeros-placements-no-mesh", lambda: sbp.zeros((2,), placements="S(0)"), E, "placements 'S(0)' need a mesh; pass mesh= or drop placements"),
    Row("zeros-pure-mesh", lambda: sbp.zeros((2,), M1, "S(0)"), ME, "factories need an sbp.DeviceMesh bound to processes"),
    Row("zeros-mesh-str", lambda: sbp.zeros((2,), "2x2"), ME, "got '2x2'"),
    Row("rand-seed-and-generator", lambda: sbp.rand((2,), seed=3, generator=torch.Generator()), E, "give seed= or generator=, not both (got seed=3 and a generator)"),
    Row("mesh-names-set", lambda: DeviceMesh((2, 2), names={"dp", "tp"}), ME, "mesh names must be ordered (a tuple or list, one per axis / rank in row-major order), got a set"),
    Row("mesh-ranks-dict", lambda: DeviceMesh((2,), ranks={3: 0, 1: 0}), ME, "mesh ranks must be ordered (a tuple or list, one per axis / rank in row-major order), got a dict"),
    Row("mesh-index-range", lambda: DeviceMesh((2, 2)).coord_of_index(99), ME, "a mesh index of mesh shape (2, 2) is an int in 0..3, got 99"),
    Row("mesh-index-str", lambda: DeviceMesh((2, 2)).coord_of_index("a"), ME, "got 'a'"),
    Row("topology-preset-list", lambda: sbp.Topology.preset(["a"], (2, 2)), PLE, "unknown topology preset ['a'] (valid: "),
    Row("zeros-shape-huge", lambda: sbp.zeros((10**30,)), SE, "global_shape (1000000000000000000000000000000,) has more than 2**63 - 1 elements"),
    Row("plan-shape-too-many-elements", lambda: sbp.plan((2**40 + 3, 2**40 + 5), (2, 2), "S(0), S(1)", "B, B"), SE, "has more than 2**63 - 1 elements"),
    Row("plan-shape-huge-dim-large-mesh", lambda: sbp.plan((2**64 + 1, 3), (128, 128), "S(0), S(1)", "S(1), S(0)"), SE, "has more than 2**63 - 1 elements"),
    Row("plan-shape-set", lambda: sbp.plan({64, 3}, (2,), "S(0)", "B"), SE, "global_shape must be a sequence of non-negative ints, got {"),
    Row("plan-itemsize-dtype", lambda: sbp.plan((4,), (2,), "S(0)", "B", torch.float32), PLE, "itemsize must be a positive int (bytes per element), got torch.float32 (a dtype's is torch.float32.itemsize)"),
    Row("zeros-sizes-one-by-one", lambda: sbp.zeros(4, 6), ME, "got 6 (an int: the global shape is one argument, a tuple -- (4, 6), mesh, placements -- not sizes one by one)"),
    Row("zeros-int-requires-grad", lambda: sbp.zeros(2, dtype=torch.int64, requires_grad=True), DE, "requires_grad=True needs a floating point or complex dtype (only those have gradients), got torch.int64"),
    Row("zeros-requires-grad-str", lambda: sbp.zeros(2, requires_grad="yes"), E, "requires_grad must be a bool, got 'yes'"),
    Row("full-value-str", lambda: sbp.full((2,), "abc"), DE, "fill_value must be a Python number (bool, int, float or complex), got 'abc' (str)"),
    Row("full-value-none", lambda: sbp.full((2,), None), DE, "got None (NoneType)"),
    Row("full-truncate", lambda: sbp.full((2,), 1.5, dtype=torch.int64), DE, "fill_value 1.5 cannot be represented as torch.int64 (not an integer)"),
    Row("full-overflow", lambda: sbp.full((2,), 300, dtype=torch.uint8), DE, "cannot be represented as torch.uint8 (out of range 0..255)"),
    Row("full-bool-two", lambda: sbp.full((2,), 2, dtype=torch.bool), DE, "bool holds only 0/False and 1/True"),
    Row("full-float16-overflow", lambda: sbp.full((2,), 1e10, dtype=torch.float16), DE, "beyond its largest finite value 65504.0"),
    Row("full-complex64-overflow", lambda: sbp.full((2,), complex(1e39, 0), dtype=torch.complex64), DE, "fill_value (1e+39+0j) cannot be represented as torch.complex64 (beyond its largest finite value 3.4028234663852886e+38)"),
    Row("full-complex-to-real", lambda: sbp.full((2,), 1 + 2j, dtype=torch.float32), DE, "a complex number with an imaginary part needs a complex dtype"),
    Row("full-nan-to-int", lambda: sbp.full((2,), float("nan"), dtype=torch.int32), DE, "cannot be represented as torch.int32 (not an integer)"),
    Row("rand-int-dtype", lambda: sbp.rand((2,), dtype=torch.int64), DE, "random factories need a floating dtype, got torch.int64"),
    Row("rand-dtype-str", lambda: sbp.randn((2,), dtype="float32"), DE, "dtype must be a torch.dtype"),
    Row("rand-seed-str", lambda: sbp.rand((2,), seed="x"), E, "seed must be an int, got 'x'"),
    Row("rand-seed-float", lambda: sbp.rand((2,), seed=1.5), E, "seed must be an int, got 1.5"),
    Row("strategy-meshes-min-axes", lambda: sbp.testing.strategies.meshes(min_axes=0), E, "meshes(min_axes=...) must be an int >= 1, got 0"),
    Row("strategy-placements-ndim", lambda: sbp.testing.strategies.placements(1.5, 2), E, "placements(mesh_ndim, ...) must be an int >= 1, got 1.5"),
    Row("strategy-placements-ops", lambda: sbp.testing.strategies.placements(2, 2, ops="sum"), E, "placements(ops=...) must be a tuple or list of reduce ops from ('sum', 'min', 'max'), got 'sum'"),
    Row("strategy-placements-ops-none", lambda: sbp.testing.strategies.placements(2, 2, ops=None), E, "placements(ops=...) must be a tuple or list of reduce ops from ('sum', 'min', 'max'), got None"),
    Row("strategy-layouts-mesh", lambda: hypothesis.find(sbp.testing.strategies.layouts(mesh_shape=(0,)), lambda case: True), ME, "mesh shape must be a non-empty tuple of positive ints, got (0,)"),
    Row("rand-seed-too-big", lambda: sbp.randn((2,), seed=2**64), E, "seed must fit in 64 bits (as torch.manual_seed: -2**63 <= seed < 2**64), got 18446744073709551616"),
    Row("rand-seed-too-small", lambda: sbp.rand((2,), seed=-2**63 - 1), E, "seed must fit in 64 bits"),
    Row("rand-float8", lambda: sbp.rand((2,), seed=0, dtype=torch.float8_e4m3fn), DE, "torch cannot draw random numbers in torch.float8_e4m3fn"),
    Row("randn-float8", lambda: sbp.randn((2,), seed=0, dtype=torch.float8_e5m2), DE, "torch cannot draw random numbers in torch.float8_e5m2"),
    Row("rand-generator-str", lambda: sbp.rand((2,), generator="g"), E, "generator must be a torch.Generator or None, got str"),
    # ---- visualize -------------------------------------------------------------------------------------------
    Row("visualize-int", lambda: sbp.visualize(5), E, "visualize(x) needs an sbp.GlobalTensor, got int"),
    Row("visualize-plain-tensor", lambda: sbp.visualize(torch.ones(2)), E, "got Tensor; for a layout without data pass global_shape=, mesh= and placements="),
    Row("visualize-nothing", lambda: sbp.visualize(), E, "visualize needs a GlobalTensor, or global_shape=, mesh= and placements="),
    Row("visualize-mesh-str", lambda: sbp.visualize(global_shape=(4,), mesh="2x", placements="S(0)"), ME, "cannot parse mesh shape '2x'"),
    Row("visualize-placements", lambda: sbp.visualize(global_shape=(4,), mesh=(2,), placements="S(1)"), PE, "S(1) is out of range for a 1-d tensor"),
    Row("visualize-shape", lambda: sbp.visualize(global_shape="ab", mesh=(2,), placements="B"), SE, "global_shape must be a sequence"),
    # ---- DTensor interop -------------------------------------------------------------------------------------
    Row("to-dtensor-plain", lambda: sbp.to_dtensor(torch.ones(2)), E, "to_dtensor needs an sbp.GlobalTensor, got Tensor"),
    Row("from-dtensor-plain", lambda: sbp.from_dtensor(torch.ones(2)), E, "from_dtensor needs a torch.distributed.tensor.DTensor, got Tensor"),
    # ---- the testing kit --------------------------------------------------------------------------------------
    Row("spmd-backend", lambda: sbp.testing.spmd(len, (2,), backend="mpi"), E, "spmd backend must be one of ('threads', 'gloo'), got 'mpi'"),
    Row("spmd-fn-not-callable", lambda: sbp.testing.spmd(5, (2,)), E, "fn must be callable, got int"),
    Row("spmd-mesh-shape", lambda: sbp.testing.spmd(len, (0,)), ME, "mesh shape must be a non-empty tuple of positive ints, got (0,)"),
    Row("spmd-names-duplicate", lambda: sbp.testing.spmd(len, (2, 2), names=("a", "a")), ME, "mesh axis names must be unique"),
    Row("spmd-timeout-str", lambda: sbp.testing.spmd(len, (2,), timeout="x"), E, "spmd timeout must be a positive number of seconds, at most 1e+08 (it bounds every collective), got 'x'"),
    Row("spmd-timeout-huge", lambda: sbp.testing.spmd(len, (2,), timeout=1e10), E, "spmd timeout must be a positive number of seconds, at most 1e+08 (it bounds every collective), got 10000000000.0"),
    Row("as-timeout-huge", lambda: sbp.runtime.backends.dist.as_timeout(10 ** 400), ME, "timeout must be a positive, finite duration of at least 0.001 s (torch.distributed counts whole milliseconds) and at most 1e+08 s"),
    Row("as-timeout-under-a-millisecond", lambda: sbp.runtime.backends.dist.as_timeout(1e-4), ME, "at least 0.001 s (torch.distributed counts whole milliseconds) and at most 1e+08 s (collectives fail after it), got 0.0001"),
    Row("spmd-gloo-timeout-under-a-millisecond", lambda: sbp.testing.spmd(len, (2,), backend="gloo", timeout=1e-4), E, "spmd timeout must be a positive number of seconds, at most 1e+08 and at least 0.001 on gloo (it bounds every collective), got 0.0001"),
    Row("spmd-timeout-negative", lambda: sbp.testing.spmd(len, (2,), timeout=-1), E, "got -1"),
    Row("spmd-timeout-zero", lambda: sbp.testing.spmd(len, (2,), timeout=0), E, "got 0"),
    Row("assert-layout-int", lambda: sbp.testing.assert_layout_equivalent(5, 5), E, "assert_layout_equivalent compares tensors (GlobalTensor or plain torch.Tensor); x is a int"),
    Row("assert-layout-rtol-alone", lambda: sbp.testing.assert_layout_equivalent(torch.ones(1), torch.ones(1), rtol=1e-3), E, "give rtol and atol together (or neither, for the dtype's defaults), got rtol=0.001, atol=None"),
    Row("assert-layout-rtol-negative", lambda: sbp.testing.assert_layout_equivalent(torch.ones(1), torch.ones(1), rtol=-1, atol=0), E, "assert_layout_equivalent(rtol=...) must be a number >= 0, got -1"),
    Row("assert-layout-atol-str", lambda: sbp.testing.assert_layout_equivalent(torch.ones(1), torch.ones(1), rtol=0, atol="x"), E, "assert_layout_equivalent(atol=...) must be a number >= 0, got 'x'"),
    Row("assert-layout-exact", lambda: sbp.testing.assert_layout_equivalent(torch.ones(1), torch.ones(1), exact="yes"), E, "exact=...) must be None or a bool, got 'yes'"),
    Row("submesh-pure-world", lambda: sbp.testing.submesh(M1, (2,), ranks=[0, 1]), ME, "submesh needs the bound world mesh that spmd passes to fn"),
    # ---- init_mesh before any process group exists --------------------------------------------------------
    Row("init-mesh-device", lambda: sbp.init_mesh((2,), device_type="tpu"), ME, "device_type must be 'cpu' or 'cuda' (or None for automatic), got 'tpu'"),
    Row("init-mesh-timeout-str", lambda: sbp.init_mesh((2,), timeout="x"), ME, "timeout must be a datetime.timedelta or a number of seconds, got 'x'"),
    Row("init-mesh-timeout-negative", lambda: sbp.init_mesh((2,), timeout=-1), ME, "timeout must be a positive, finite duration"),
    Row("init-mesh-shape", lambda: sbp.init_mesh((0,)), ME, "mesh shape must be a non-empty tuple of positive ints, got (0,)"),
    Row("init-mesh-names", lambda: sbp.init_mesh((2, 2), names=("a", "a")), ME, "mesh axis names must be unique"),
    Row("init-mesh-ranks-dup", lambda: sbp.init_mesh((2,), ranks=[1, 1]), ME, "mesh ranks must be distinct"),
    Row("init-mesh-no-env", _init_mesh_without_env, ME, "torch.distributed is not initialised and the environment lacks MASTER_ADDR"),
    Row("init-mesh-env-world-size", lambda: _init_mesh_with_env(WORLD_SIZE="abc"), ME, "the torchrun environment is inconsistent: WORLD_SIZE='abc' is not a non-negative int"),
    Row("init-mesh-env-rank", lambda: _init_mesh_with_env(RANK="5"), ME, "RANK=5 is not below WORLD_SIZE=2"),
    Row("submesh-int-world", lambda: sbp.testing.submesh(5, (2,), ranks=[0, 1]), ME, "submesh needs the bound world mesh that spmd passes to fn, got int"),
    Row("init-device-mesh-type", lambda: sbp.init_device_mesh("tpu", (2,)), ME, "got 'tpu'"),
    *([Row("init-mesh-cuda-missing", lambda: sbp.init_mesh((2,), device_type="cuda"), ME, "init_mesh(device_type='cuda') needs CUDA")]
      if not CUDA else []),
    # ---- checkpoints ---------------------------------------------------------------------------------------
    Row("save-not-dict", lambda: sbp.save([1], os.path.join(_CKPT, "a")), CE, "a state_dict must be a dict, got list"),
    Row("save-object-leaf", lambda: sbp.save({"a": object()}, os.path.join(_CKPT, "b")), CE, "entry 'a' is a object, which a checkpoint cannot hold"),
    Row("load-missing", lambda: sbp.load(os.path.join(_CKPT, "missing"), {}), CE, "is not a directory; write one with sbp.save"),
    Row("load-into-list", lambda: sbp.load(_saved_checkpoint(), [1]), CE, "a state_dict must be a dict, got list"),
    Row("load-keys", lambda: sbp.load(_saved_checkpoint(), {"v": torch.zeros(4, 2)}), CE, "have different keys: missing from the checkpoint: ['v']"),
    Row("load-shape", lambda: sbp.load(_saved_checkpoint(), {"w": torch.zeros(4, 3)}), CE, "tensor 'w': global shape (4, 2) in the checkpoint, (4, 3) in the state_dict"),
    Row("load-into-expand", lambda: sbp.load(_saved_checkpoint(), {"w": torch.zeros(1, 2).expand(4, 2)}), CE, "tensor 'w': the state_dict's tensor shares memory between its elements (an expand)"),
    Row("load-dtype", lambda: sbp.load(_saved_checkpoint(), {"w": torch.zeros(4, 2, dtype=torch.int64)}), CE, "dtype float32 in the checkpoint, int64 in the state_dict"),
    Row("save-path-int", lambda: sbp.save({"a": torch.ones(1)}, 5), CE, "save: path must be a str or os.PathLike naming the checkpoint directory, got int (5)"),
    Row("load-path-int", lambda: sbp.load(5, {}), CE, "load: path must be a str or os.PathLike naming the checkpoint directory, got int (5)"),
    Row("load-path-empty", lambda: sbp.load("", {}), CE, "load: path must be a str or os.PathLike naming the checkpoint directory, got ''"),
    Row("load-strict-str", lambda: sbp.load(_saved_checkpoint(), {"w": torch.zeros(4, 2)}, strict="no"), E, "load: strict must be True or False, got 'no'"),
    Row("save-mesh-str", lambda: sbp.save({"a": 1}, os.path.join(_CKPT, "c"), mesh="tp"), E, "save: mesh must be an sbp.DeviceMesh or None, got str"),

    # ---- distribute (threads) ------------------------------------------------------------------------------
    T("distribute-list", lambda m: sbp.distribute([1, 2], m, "S(0)"), E, "distribute needs a torch.Tensor on every rank when src=None, got list; pass src=rank"),
    T("distribute-global", lambda m: sbp.distribute(_x(m, "B"), m, "B"), E, "distribute needs a plain torch.Tensor, got a GlobalTensor; use x.redistribute(placements)"),
    T("distribute-split-range", lambda m: _x(m, "S(2)"), PE, "S(2) is out of range for a 2-d tensor (valid: -2..1)"),
    T("distribute-placements-length", lambda m: _x(m, "S(0), B"), PE, "give 2 placement(s) but the mesh has 1 axes"),
    T("distribute-src-range", lambda m: sbp.distribute(torch.ones(4), m, "S(0)", src=5), ME, "distribute src=5 must be a world rank of the mesh (ranks: [0, 1])"),
    T("distribute-src-str", lambda m: sbp.distribute(torch.ones(4), m, "S(0)", src="0"), ME, "src='0' must be a world rank"),
    T("distribute-src-bool", lambda m: sbp.distribute(torch.ones(4), m, "S(0)", src=True), ME, "src=True must be a world rank"),
    T("distribute-src-missing", lambda m: sbp.distribute(None, m, "S(0)", src=0), E, "distribute(src=0): rank 0 must pass the full tensor, got NoneType"),
    T("distribute-bool-psum", lambda m: _x(m, "P(sum)", torch.ones(4, dtype=torch.bool)), PE, "distribute: P(sum) cannot hold a torch.bool tensor: a sum of bools is not a bool (valid for bool: S(d), B, P(min), P(max)"),
    T("distribute-complex-pmax", lambda m: _x(m, "P(max)", torch.ones(4, dtype=torch.complex64)), PE, "distribute: P(max) needs ordered values; torch.complex64 has no min/max (valid for complex: S(d), B, P(sum))"),
    T("distribute-src-bool-psum", lambda m: sbp.distribute(torch.ones(4, dtype=torch.bool) if m.rank == 0 else None, m, "P(sum)", src=0), PE, "P(sum) cannot hold a torch.bool tensor"),
    T("distribute-int-grad", lambda m: sbp.distribute(torch.ones(4, dtype=torch.int32), m, "S(0)", requires_grad=True), DE, "only floating point and complex tensors can require gradients, got torch.int32"),
    T("distribute-grad-str", lambda m: sbp.distribute(torch.ones(4), m, "S(0)", requires_grad="yes"), E, "requires_grad=...) must be None or a bool, got 'yes'"),
    T("distribute-meta-tensor-src", lambda m: sbp.distribute(torch.empty(4, device="meta") if m.rank == 0 else None, m, "S(0)", src=0), ME, "cannot move"),
    Row("distribute-pure-mesh", lambda: sbp.distribute(torch.ones(4), M1, "S(0)"), ME, "distribute needs a mesh bound to processes (sbp.init_mesh or sbp.testing.spmd); DeviceMesh((2,)) is a pure value"),
    Row("distribute-mesh-tuple", lambda: sbp.distribute(torch.ones(4), (2,), "S(0)"), ME, "distribute needs an sbp.DeviceMesh, got tuple"),
    *([T("distribute-cuda-mesh", lambda m: sbp.distribute(torch.ones(4), cuda_mesh(m), "S(0)"), ME, "distribute: the mesh's device_type is 'cuda' but CUDA is not available in this process")]
      if not CUDA else []),
    # ---- from_local (threads) ------------------------------------------------------------------------------
    T("from-local-list", lambda m: sbp.from_local([1], m, "S(0)"), E, "from_local needs this rank's plain local torch.Tensor, got list"),
    T("from-local-global", lambda m: sbp.from_local(_x(m), m, "S(0)"), E, "got GlobalTensor"),
    T("from-local-uneven", lambda m: sbp.from_local(torch.ones(m.rank + 1), m, "S(0)"), SE, "local shapes do not fit global shape (3,) with placements (S(0),) on mesh (2,) (sbp splits are balanced, as numpy.array_split): rank 0 has (1,), expected (2,); rank 1 has (2,), expected (1,)"),
    T("from-local-global-shape", lambda m: sbp.from_local(torch.ones(2), m, "S(0)", global_shape=(5,)), SE, "rank 0 has (2,), expected (3,)"),
    T("from-local-global-ndim", lambda m: sbp.from_local(torch.ones(2), m, "S(0)", global_shape=(4, 1)), SE, "from_local: global_shape (4, 1) has 2 dims but the local tensor has 1 (shape (2,))"),
    T("from-local-global-int", lambda m: sbp.from_local(torch.ones(2), m, "S(0)", global_shape=4), SE, "global_shape must be a sequence of non-negative ints, got 4"),
    T("from-local-sparse", lambda m: sbp.from_local(torch.eye(2).to_sparse(), m, "S(0)"), E, "from_local needs a dense (strided) tensor, got layout torch.sparse_coo"),
    T("distribute-sparse", lambda m: sbp.distribute(torch.eye(2).to_sparse_csr(), m, "S(0)"), E, "distribute needs a dense (strided) tensor, got layout torch.sparse_csr"),
    T("distribute-quantized", lambda m: sbp.distribute(torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8), m, "S(0)"), DE, "distribute does not take quantized tensors, got torch.quint8; dequantize it first"),
    T("from-local-quantized", lambda m: sbp.from_local(torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), m, "S(0)"), DE, "from_local does not take quantized tensors, got torch.qint8"),
    Row("zeros-quantized", lambda: sbp.zeros(2, dtype=torch.quint8), DE, "sbp's factories do not make quantized tensors, got dtype torch.quint8"),
    T("distribute-nested", lambda m: sbp.distribute(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), m, "B"), E, "distribute needs a dense (strided) tensor, got a nested tensor"),
    T("calibrate-shape", lambda m: sbp.calibrate((2, 2)), E, "calibrate needs a bound sbp.DeviceMesh (sbp.init_mesh, or inside sbp.testing.spmd), got tuple"),
    T("calibrate-sizes-int", lambda m: sbp.calibrate(m, sizes=4096), E, "calibrate sizes must be a tuple or list of ints >= 4"),
    T("from-local-global-str", lambda m: sbp.from_local(torch.ones(2), m, "S(0)", global_shape="ab"), SE, "global_shape must be a sequence of non-negative ints, got 'ab'"),
    T("from-local-0d-split", lambda m: sbp.from_local(torch.tensor(1.), m, "S(0)"), PE, "S(0) is out of range for a 0-d tensor"),
    T("from-local-placements-length", lambda m: sbp.from_local(torch.ones(2), m, "S(0), B"), PE, "give 2 placement(s)"),
    T("from-local-bool-psum", lambda m: sbp.from_local(torch.ones(2, dtype=torch.bool), m, "P(sum)"), PE, "from_local: P(sum) cannot hold a torch.bool tensor"),
    T("from-local-complex-pmin", lambda m: sbp.from_local(torch.ones(2, dtype=torch.complex128), m, "P(min)"), PE, "P(min) needs ordered values; torch.complex128 has no min/max"),
    T("from-local-cpu-on-cuda-mesh", lambda m: sbp.from_local(torch.ones(2), cuda_mesh(m), "S(0)"), ME, "from_local: the local tensor is on cpu but the mesh's device_type is 'cuda'; move it first (local.to('cuda'))"),
    T("from-local-meta", lambda m: sbp.from_local(torch.empty(2, device="meta"), m, "S(0)"), ME, "the local tensor is on meta but the mesh's device_type is 'cpu'"),
    Row("from-local-pure-mesh", lambda: sbp.from_local(torch.ones(2), M1, "S(0)"), ME, "from_local needs a mesh bound to processes"),
    T("from-local-check-str", lambda m: sbp.from_local(torch.ones(2), m, "S(0)", check="no"), E, "from_local(check=...) takes a bool, got 'no'"),
    T("parallelize-bucket-bytes-no-dp-axis", lambda m: sbp.nn.parallelize(torch.nn.Linear(2, 2), m, {"": "colwise"}, dp_bucket_bytes=-1), E, "dp_bucket_bytes must be a positive number of bytes, got -1"),
    T("backward-grad-other-mesh", lambda m: (sbp.distribute(torch.ones(4), m, "S(0)", requires_grad=True) * 2).backward(
        sbp.distribute(torch.ones(4), sbp.testing.submesh(m, (1,), ranks=[0]), "B")), ME,
      "the gradient reaching a leaf of global shape (4,) on DeviceMesh((2,)) is on another mesh, DeviceMesh((1,))"),
    T("redistribute-async-str", lambda m: _x(m).redistribute("B", async_op="yes"), E, "redistribute(async_op=...) takes a bool, got 'yes'"),
    T("submesh-transposed", lambda m: m[1, 0], ME, "a sub-mesh takes its axes in the mesh's order, each once: got (1, 0); write (0, 1)", mesh=(2, 2)),
    T("submesh-repeated", lambda m: m[0, 0], ME, "a sub-mesh takes its axes in the mesh's order, each once: got (0, 0); write 0", mesh=(2, 2)),
    T("from-local-stride", lambda m: sbp.from_local(torch.ones(2, 3), m, "S(0)", shape=(4, 3), stride=(1, 4)), E, "from_local(stride=(1, 4)): a global tensor's logical strides are the contiguous ones of its shape (4, 3), (3, 1)"),
    T("from-local-stride-no-shape", lambda m: sbp.from_local(torch.ones(2, 3), m, "S(0)", stride=(3, 1)), E, "from_local(stride=...) needs the shape too"),
    T("from-local-run-check-str", lambda m: sbp.from_local(torch.ones(2, 3), m, "S(0)", run_check="no"), E, "from_local(run_check=...) takes a bool, got 'no'"),
    T("from-local-shape-twice", lambda m: sbp.from_local(torch.ones(2, 3), m, "S(0)", shape=(4, 3), global_shape=(5, 3)), E, "from_local got global_shape=(5, 3) and shape=(4, 3)"),
    T("distribute-src-twice", lambda m: sbp.distribute(torch.ones(4), m, "S(0)", src=0, src_data_rank=1), E, "distribute got src=0 and src_data_rank=1"),
    T("redistribute-no-placements", lambda m: _x(m).redistribute(), E, "redistribute needs the target placements"),
    T("redistribute-two-positional", lambda m: _x(m).redistribute("B", "B"), E, "got a second positional argument: 'B'"),
    T("redistribute-mesh-twice", lambda m: _x(m).redistribute(m, "B", mesh=m), E, "redistribute got a mesh twice"),
    T("redistribute-mesh-and-device-mesh", lambda m: _x(m).redistribute("B", mesh=m, device_mesh=sbp.testing.submesh(m, (1,), ranks=[0])), E,
      "redistribute got both mesh= and device_mesh="),
    Row("strict-str", lambda: sbp.strict("no").__enter__(), E, "sbp.strict(enabled) takes a bool, got 'no'"),
    # ---- redistribute and the other GlobalTensor methods (threads) ---------------------------------------
    T("redistribute-range", lambda m: _x(m).redistribute("S(2)"), PE, "S(2) is out of range for a 2-d tensor (valid: -2..1)"),
    T("redistribute-int", lambda m: _x(m).redistribute(5), PE, "placements must be a string, a placement or an iterable of placements, got int"),
    T("redistribute-length", lambda m: _x(m).redistribute("B, B"), PE, "give 2 placement(s) but the mesh has 1 axes"),
    T("redistribute-bool-psum", lambda m: _x(m, "S(0)", torch.ones(4, dtype=torch.bool)).redistribute("P(sum)"), PE, "redistribute: P(sum) cannot hold a torch.bool tensor"),
    T("redistribute-complex-pmax", lambda m: _x(m, "S(0)", torch.ones(4, dtype=torch.complex64)).redistribute("P(max)"), PE, "redistribute: P(max) needs ordered values"),
    T("redistribute-mesh-str", lambda m: _x(m).redistribute("B", mesh="x"), ME, "redistribute(mesh=...) needs an sbp.DeviceMesh, got str"),
    T("redistribute-mesh-pure", lambda m: _x(m).redistribute("B", mesh=DeviceMesh((2,), ranks=(1, 0))), ME, "redistribute(mesh=...) needs a mesh bound to processes (sbp.init_mesh, sbp.testing.submesh); DeviceMesh((2,), ranks=[1, 0]) is a pure value"),
    T("redistribute-mesh-device", lambda m: _x(m).redistribute("B", mesh=cuda_mesh(m)), ME, "moves between meshes of one device type; the tensor is on a 'cpu' mesh, the target mesh is 'cuda'"),
    T("redistribute-cross-length", lambda m: _x(m).redistribute("B", mesh=m.binding.bind(DeviceMesh((1, 2)))), PE, "give 1 placement(s) but the mesh has 2 axes"),
    T("to-local-grad-placements", lambda m: _x(m).to_local(grad_placements="S(3)"), PE, "S(3) is out of range for a 2-d tensor"),
    T("to-local-grad-int", lambda m: _x(m).to_local(grad_placements=5), PE, "got int"),
    T("to-dtensor-threads", lambda m: sbp.to_dtensor(_x(m)), ME, "DTensor interop needs a mesh bound to torch.distributed (sbp.init_mesh, or sbp.testing.spmd(..., backend='gloo')); DeviceMesh((2,)) is bound to the 'threads' backend"),
    T("setitem-complex-into-float", lambda m: _x(m).__setitem__(slice(1, 3), 1 + 2j), DE, "x[...] = (1+2j): the value does not convert to the tensor's dtype torch.float32 (global shape (4, 4))"),
    T("requires-grad-int", lambda m: _x(m, "B", torch.arange(4)).requires_grad_(), DE, "only floating point and complex global tensors can require gradients, got torch.int64 (global shape (4,), placements (B,))"),
    T("requires-grad-attr-int", lambda m: setattr(_x(m, "B", torch.arange(4)), "requires_grad", True), DE, "only floating point and complex global tensors can require gradients, got torch.int64"),
    T("assert-layout-meshes", lambda m: sbp.testing.assert_layout_equivalent(_x(m), sbp.distribute(torch.ones(4, 4), sbp.testing.submesh(m, (1,), ranks=[0]), "B")), E, "assert_layout_equivalent compares tensors on one mesh"),
    T("assert-layout-str", lambda m: sbp.testing.assert_layout_equivalent(_x(m), "x"), E, "y is a str"),
    # ---- factories on a mesh (threads) ---------------------------------------------------------------------
    T("zeros-placements-range", lambda m: sbp.zeros((2,), m, "S(1)"), PE, "S(1) is out of range for a 1-d tensor"),
    T("ones-bool-psum", lambda m: sbp.ones((2,), m, "P(sum)", dtype=torch.bool), PE, "factory: P(sum) cannot hold a torch.bool tensor"),
    T("full-complex-pmax", lambda m: sbp.full((2,), 1j, m, "P(max)"), PE, "factory: P(max) needs ordered values; torch.complex64 has no min/max"),
    T("randn-int", lambda m: sbp.randn((2,), m, "S(0)", dtype=torch.int32), DE, "random factories need a floating dtype, got torch.int32"),
    T("rand-seed-str-mesh", lambda m: sbp.rand((2,), m, "S(0)", seed="x"), E, "seed must be an int"),
    *([T("zeros-cuda-mesh", lambda m: sbp.zeros((2,), cuda_mesh(m), "S(0)"), ME, "factory: the mesh's device_type is 'cuda' but CUDA is not available")]
      if not CUDA else []),
    # ---- bound meshes: sizes against the world, axis names (threads) --------------------------------------
    T("mesh-getitem-unknown", lambda m: m["zz"], ME, "mesh has no axis named 'zz' (axis names: ('dp', 'tp'))", (2, 2)),
    T("mesh-getitem-range", lambda m: m[5], ME, "mesh axis 5 is out of range for a 2-axis mesh (valid: -2..1 or a name)", (2, 2)),
    T("mesh-larger-than-world", lambda m: m.binding.bind(DeviceMesh((4,))), ME, "mesh ranks [0, 1, 2, 3] do not fit a world of 2 thread-ranks (valid ranks: 0..1)"),
    T("submesh-ranks-range", lambda m: sbp.testing.submesh(m, (2,), ranks=[0, 5]), ME, "mesh ranks [0, 5] do not fit a world of 2 thread-ranks"),
    T("submesh-ranks-duplicate", lambda m: sbp.testing.submesh(m, (2,), ranks=[1, 1]), ME, "mesh ranks must be distinct, got [1, 1]"),
    T("submesh-names", lambda m: sbp.testing.submesh(m, (2,), names=("a", "b"), ranks=[0, 1]), ME, "must have one name per axis"),
    # ---- tensor parallelism and operators (threads) ----------------------------------------------------
    T("parallelize-style", lambda m: _parallelize(m, {"0": "diagonal"}), E, "plan entry '0': 'diagonal' is not a style; valid: 'colwise', 'rowwise', 'embedding', 'sequence'"),
    T("parallelize-path", lambda m: _parallelize(m, {"9": "colwise"}), E, "plan entry '9' matches no module of Sequential (module paths look like: '0', '1', '2')"),
    T("parallelize-plan-list", lambda m: _parallelize(m, ["0"]), E, "plan must map module paths to styles, got list"),
    T("parallelize-tp-axis", lambda m: _parallelize(m, {"0": "colwise"}, tp_axis=5), ME, "mesh axis 5 is out of range for a 1-axis mesh"),
    T("parallelize-module-kind", lambda m: _parallelize(m, {"1": "colwise"}), E, "style 'colwise' cannot shard '1', a ReLU; valid modules for 'colwise': nn.Linear"),
    T("parallelize-base-style", lambda m: _parallelize(m, {"0": sbp.nn.styles.Style()}), E, "plan entry '0': Style("),
    T("visualize-layout-twice", lambda m: sbp.visualize(_x(m), placements="B"), E, "visualize(x) takes the layout from x; placements= would be ignored"),
    T("parallelize-key-int", lambda m: _parallelize(m, {0: "colwise"}), E, "plan keys must be module paths (str), got 0"),
    T("parallelize-not-module", lambda m: sbp.nn.parallelize(5, m, {}), E, "parallelize needs an nn.Module, got int"),
    Row("parallelize-pure-mesh", lambda: sbp.nn.parallelize(nn.Linear(2, 2), M1, {"": "colwise"}), E, "parallelize needs a bound sbp.DeviceMesh"),
    T("ops-different-meshes", lambda m: _x(m) + sbp.distribute(torch.ones(4, 4), m.binding.bind(DeviceMesh((2,), ranks=(1, 0))), "B"), E, "mixes global tensors on different meshes"),
    T("ops-different-mesh-ndim-mm", lambda m: _x(m) @ sbp.distribute(torch.ones(4, 4), m.binding.bind(DeviceMesh((2, 1))), "B, B"), E, "aten.mm.default mixes global tensors on different meshes"),
    T("ops-different-mesh-ndim-cat", lambda m: torch.cat([_x(m), sbp.distribute(torch.ones(4, 4), m.binding.bind(DeviceMesh((2, 1))), "S(0), B")]), E, "aten.cat.default mixes global tensors on different meshes"),
    # in-place ops that would change a global tensor's shape: refused before anything runs (the metadata went stale)
    T("ops-resize-inplace", lambda m: _x(m).resize_(8, 2), SE, "aten.resize_.default on global shape (4, 4) with placements (S(0),): it would change a global tensor's shape in place ((4, 4) -> (8, 2)); sbp does not resize a global tensor (its shape is its layout): make a new one instead"),
    T("ops-resize-as-inplace", lambda m: _x(m, "B").resize_as_(torch.ones(2, 8)), SE, "it would change a global tensor's shape in place ((4, 4) -> (2, 8))"),
    T("ops-as-strided-inplace", lambda m: _x(m, "B").as_strided_((2, 2), (1, 1)), SE, "aten.as_strided_.default on global shape (4, 4) with placements (B,): it would change a global tensor's shape in place ((4, 4) -> (2, 2))"),
    T("ops-matmul-shapes", lambda m: _x(m) @ _x(m, "B", torch.ones(3, 3)), SE, "aten.mm.default on global shapes (4, 4) and (3, 3) with placements (S(0),) and (B,): a and b must have same reduction dim, but got [4, 4] X [3, 3]."),
    T("ops-matmul-plain", lambda m: _x(m) @ torch.ones(3, 3), SE, "aten.mm.default on global shapes (4, 4) and (3, 3) with placements (S(0),) and plain: "),
    T("ops-sum-dim", lambda m: _x(m).sum(5), SE, "aten.sum.dim_IntList on global shape (4, 4) with placements (S(0),): Dimension out of range (expected to be in range of [-2, 1], but got 5)"),
    T("ops-view-numel", lambda m: _x(m).view(3, 3), SE, "aten.view.default on global shape (4, 4) with placements (S(0),): shape '[3, 3]' is invalid for input of size 16"),
    T("ops-index-range", lambda m: _x(m)[10], SE, "x[10] on global shape (4, 4) with placements (S(0),): index 10 is out of bounds for dimension 0 with size 4"),
    T("ops-setitem-range", lambda m: _x(m).__setitem__((1, 7), 0.0), SE, "x[1, 7] on global shape (4, 4) with placements (S(0),): index 7 is out of bounds for dimension 1 with size 4"),
    T("ops-cat-shapes", lambda m: torch.cat([_x(m), _x(m, "B", torch.ones(3, 3))]), SE, "aten.cat.default on global shapes (4, 4) and (3, 3) with placements (S(0),) and (B,): Sizes of tensors must match except in dimension 0"),
    T("ops-broadcast", lambda m: _x(m) + _x(m, "S(0)", torch.ones(2, 3)), SE, "aten.add.Tensor on global shapes (4, 4) and (2, 3) with placements (S(0),) and (S(0),): "),
    T("ops-softmax-dim", lambda m: _x(m).softmax(4), SE, "aten._softmax.default on global shape (4, 4) with placements (S(0),): dim 4 is out of range for a 2-d tensor (valid: -2..1)"),
    T("ops-no-rule-dim", lambda m: torch.kthvalue(_x(m), 1, 5), SE, "aten.kthvalue.default on global shape (4, 4) with placements (S(0),): Dimension out of range"),
    T("ops-bmm-dtypes", lambda m: torch.bmm(_x(m, "S(0)", torch.ones(2, 4, 4)), _x(m, "B", torch.ones(2, 4, 2, dtype=torch.int64))), DE, "aten.bmm.default on global shapes (2, 4, 4) and (2, 4, 2) with placements (S(0),) and (B,): the matrix inputs must share one dtype"),
    T("ops-mm-dtypes", lambda m: _x(m) @ _x(m, "B", torch.ones(4, 4, dtype=torch.int64)), DE, "aten.mm.default on global shapes (4, 4) and (4, 4) with placements (S(0),) and (B,): the matrix inputs must share one dtype, got ['torch.float32', 'torch.int64']"),
    T("ops-index-float", lambda m: _x(m).index_select(0, torch.tensor([0.5])), DE, "the index must be an integer tensor, got torch.float32"),
    T("ops-item-many", lambda m: _x(m).item(), SE, ".item() needs a global tensor with exactly one element, got global shape (4, 4) (16 elements)"),
    T("ops-inplace-promotion", lambda m: _x(m, "S(0)", torch.ones(4, 4, dtype=torch.int64)).add_(_x(m, "B")), DE, "aten.add_.Tensor on global shapes (4, 4) and (4, 4) with placements (S(0),) and (B,): Promotion of int.add/sub_(float) in in-place ops are not possible"),

    # ---- real process groups (gloo, 4 processes) -----------------------------------------------------------
    G("init-mesh-smaller-than-world", lambda m: sbp.init_mesh((3,)), ME, "mesh of shape (3,) has 3 ranks but the world has 4 processes; pass ranks=[...] to put the mesh on part of the world"),
    G("init-mesh-larger-than-world", lambda m: sbp.init_mesh((2, 4)), ME, "mesh of shape (2, 4) has 8 ranks but the world has 4 processes"),
    G("init-mesh-ranks-outside-world", lambda m: sbp.init_mesh((2,), ranks=[3, 4]), ME, "mesh ranks [3, 4] do not fit a world of 4 processes (valid ranks: 0..3)"),
    G("init-mesh-duplicate-names", lambda m: sbp.init_mesh((2, 2), names=("tp", "tp")), ME, "mesh axis names must be unique, got ('tp', 'tp') (duplicated: tp)"),
    G("init-mesh-timeout-zero", lambda m: sbp.init_mesh((4,), timeout=0), ME, "timeout must be a positive, finite duration"),
    G("from-dtensor-mesh-str", lambda m: sbp.from_dtensor(sbp.to_dtensor(_x(m)), mesh="x"), ME, "from_dtensor(mesh=...) needs a bound sbp.DeviceMesh over the DTensor's ranks (or None to make one), got str"),
    G("from-dtensor-mesh-shape", lambda m: sbp.from_dtensor(sbp.to_dtensor(_x(m)), mesh=sbp.init_mesh((2, 2))), ME, "from_dtensor: mesh DeviceMesh((2, 2)) (ranks [0, 1, 2, 3]) does not match the DTensor's mesh of shape (4,)"),
    G("gloo-distribute-bool-psum", lambda m: _x(m, "P(sum)", torch.ones(4, dtype=torch.bool)), PE, "P(sum) cannot hold a torch.bool tensor"),
    G("gloo-from-local-uneven", lambda m: sbp.from_local(torch.ones(m.rank + 1), m, "S(0)"), SE, "rank 3 has (4,), expected (2,)"),
]

ROWS_BY_ID = {row.id: row for row in ROWS}


def test_table_size():
    """The number of bad inputs the table covers (printed with -s)."""
    assert len(ROWS_BY_ID) == len(ROWS), "row ids must be unique"
    print(f"\n{len(ROWS)} bad inputs: {sum(r.where == 'pure' for r in ROWS)} pure, "
          f"{sum(r.where == 'threads' for r in ROWS)} on threads, {sum(r.where == 'gloo' for r in ROWS)} on gloo, "
          f"{sum(bool(r.xfail) for r in ROWS)} known failures outside this suite's files")
    assert len(ROWS) >= MIN_ROWS


def _outcome(call: Callable[[], Any]) -> tuple[str, str, bool]:
    """(error class name, message, is it an SbpError) of calling `call`; ("ok", repr, False) if it returned."""
    try:
        result = call()
    except sbp.testing.SpmdError as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        return type(cause).__name__, str(cause), isinstance(cause, sbp.SbpError)
    except BaseException as e:  # noqa: BLE001 - what we test is which exception
        return type(e).__name__, str(e), isinstance(e, sbp.SbpError)
    return "ok", repr(result)[:200], False


def _run_threads(row: Row) -> tuple[str, str, bool]:
    names = ("dp", "tp") if len(row.mesh) == 2 else None
    return _outcome(lambda: sbp.testing.spmd(row.call, row.mesh, names=names, timeout=20))


def _run_gloo_rows(ids: list[str], mesh: sbp.DeviceMesh) -> list[tuple[str, str, bool]]:
    """On every gloo rank: each row's outcome (rows raise before or without leaving a collective behind)."""
    out = []
    for row_id in ids:
        call = ROWS_BY_ID[row_id].call
        out.append(_outcome(lambda: call(mesh)))
    return out


@pytest.fixture(scope="module")
def gloo_outcomes() -> dict[str, list[tuple[str, str, bool]]]:
    ids = [r.id for r in ROWS if r.where == "gloo"]
    per_rank = sbp.testing.spmd(functools.partial(_run_gloo_rows, ids), (4,), backend="gloo", timeout=60)
    return {row_id: [outcomes[i] for outcomes in per_rank] for i, row_id in enumerate(ids)}


def _check(row: Row, outcome: tuple[str, str, bool]) -> None:
    name, message, is_sbp = outcome
    assert name != "ok", f"{row.id}: no error, returned {message}"
    assert is_sbp, f"{row.id}: bare {name}: {message}"
    assert name == row.error.__name__ or issubclass(getattr(sbp, name, getattr(sbp.testing, name, Exception)),
                                                    row.error), f"{row.id}: {name} is not a {row.error.__name__}: {message}"
    assert row.fragment in message, f"{row.id}: {message!r} lacks {row.fragment!r}"


def _marks(row: Row) -> list[pytest.MarkDecorator]:
    """xfail rows document open gaps (strict: a fix must remove the mark); gloo rows start four processes."""
    marks = [pytest.mark.xfail(reason=row.xfail, strict=True)] if row.xfail else []
    return marks + ([pytest.mark.gloo] if row.where == "gloo" else [])


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=_marks(r)) for r in ROWS])
def test_bad_input(row: Row, request) -> None:
    if row.where == "pure":
        outcome = _outcome(row.call)
    elif row.where == "threads":
        outcome = _run_threads(row)
    else:
        outcomes = request.getfixturevalue("gloo_outcomes")[row.id]
        assert all(o == outcomes[0] for o in outcomes), outcomes  # every rank raises the same
        outcome = outcomes[0]
    _check(row, outcome)


# ---- errors torch raises too keep torch's class: code written for plain tensors / DTensor still catches them ----
ALIKE = [("ops-index-range", IndexError), ("ops-matmul-shapes", RuntimeError), ("ops-sum-dim", IndexError),
         ("ops-bmm-dtypes", None)]


@pytest.mark.parametrize("row_id, torch_class", ALIKE, ids=[r for r, _ in ALIKE])
def test_an_error_torch_raises_too_is_also_torchs_class(row_id, torch_class) -> None:
    row = ROWS_BY_ID[row_id]
    plain = {"ops-index-range": lambda: torch.ones(4, 4)[10], "ops-matmul-shapes": lambda: torch.ones(4, 4) @
             torch.ones(3, 3), "ops-sum-dim": lambda: torch.ones(4, 4).sum(5)}.get(row_id)
    if plain is not None:   # the class torch itself raises for the same input on plain tensors
        with pytest.raises(torch_class):
            plain()

    def fn(mesh):
        try:
            row.call(mesh)
        except sbp.SbpError as e:
            return e
        return None

    for e in sbp.testing.spmd(fn, row.mesh):   # returned by thread ranks: the error object itself
        assert isinstance(e, row.error) and type(e).__name__ == row.error.__name__, (row_id, type(e))
        if torch_class is not None:
            assert isinstance(e, torch_class), (row_id, type(e).__mro__)
        else:   # sbp's own check (one dtype for the matrix inputs): an SbpError only
            assert not isinstance(e, (IndexError, RuntimeError)), (row_id, type(e).__mro__)
        again = pickle.loads(pickle.dumps(e))   # gloo ranks send errors pickled
        assert type(again) is type(e) and str(again) == str(e)


def _index_ten(mesh):
    return sbp.distribute(torch.ones(4, 4), mesh, "S(0)")[10]


def _catch_as_torch(mesh):
    """On a gloo rank: the classes torch code would catch these errors with."""
    x = sbp.distribute(torch.ones(4, 4), mesh, "S(0)")
    caught = []
    for call, cls in ((lambda: x[10], IndexError), (lambda: x @ sbp.distribute(torch.ones(3, 3), mesh, "B"),
                                                    RuntimeError)):
        try:
            call()
        except cls as e:
            caught.append((cls.__name__, isinstance(e, sbp.ShapeError)))
    return caught


@pytest.mark.gloo
def test_errors_torch_raises_too_cross_processes_with_both_classes() -> None:
    with pytest.raises(sbp.testing.SpmdError) as info:   # the rank's own error is chained, unpickled
        sbp.testing.spmd(_index_ten, (2,), backend="gloo")
    assert isinstance(info.value.__cause__, sbp.ShapeError) and isinstance(info.value.__cause__, IndexError)
    assert sbp.testing.spmd(_catch_as_torch, (2,), backend="gloo") == [[("IndexError", True),
                                                                        ("RuntimeError", True)]] * 2


# ---- inputs that look odd but are valid: accepted, with the right values --------------------------------

def test_non_contiguous_and_expanded_locals_are_accepted():
    """A transposed view and a stride-0 expanded tensor are fine locals: every move reads them correctly."""
    def fn(mesh):
        base = torch.arange(6.).view(2, 3) + 10 * mesh.rank
        x = sbp.from_local(base.t(), mesh, "S(0)")                        # (3, 2) non-contiguous
        y = sbp.from_local(torch.tensor([1.0 + mesh.rank]).expand(4), mesh, "S(0)")   # stride 0
        return x.full().tolist(), y.redistribute("B").to_local().tolist(), x.redistribute("S(1)").to_local().tolist()

    out = sbp.testing.spmd(fn, (2,))
    full = (torch.cat([torch.arange(6.).view(2, 3).t(), (torch.arange(6.).view(2, 3) + 10).t()])).tolist()
    assert all(o[0] == full for o in out)
    assert out[0][1] == [1.0] * 4 + [2.0] * 4
    assert out[1][2] == [[row[1]] for row in full]


def test_bool_partial_min_max_and_complex_partial_sum_are_accepted():
    def fn(mesh):
        b = sbp.distribute(torch.tensor([True, False]), mesh, "S(0)").redistribute("P(max)").full()
        c = sbp.distribute(torch.tensor([1 + 1j, 2j]), mesh, "P(sum)").full()
        return b.tolist(), c.tolist()

    assert sbp.testing.spmd(fn, (2,))[1] == ([True, False], [1 + 1j, 2j])


def test_docs_examples_are_current():
    """docs/errors.md quotes real messages: each example naming a row of this table must match it exactly."""
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "errors.md"
    checked = 0
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        match = re.match(r"`([a-z0-9-]+)`:", cells[2]) if len(cells) == 4 else None
        if match is None or match.group(1) not in ROWS_BY_ID:
            continue
        row = ROWS_BY_ID[match.group(1)]
        name, message, _ = _outcome(row.call) if row.where == "pure" else _run_threads(row)
        assert cells[0] == f"`{name}`", (row.id, name, cells[0])
        assert cells[3] == message, (row.id, message)
        checked += 1
    assert checked >= 15
