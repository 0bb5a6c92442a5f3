"""DeviceMesh as a pure value: sizes, names, rank <-> coord, groups along axes, sub-meshes, bad input.

Pure tier: numpy is the oracle for row-major order (`np.ndindex`, `np.ravel_multi_index`, `np.moveaxis`).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import sbp
from sbp.values.mesh import as_mesh_shape

NAMES = ("dp", "tp", "pp")


@st.composite
def meshes(draw, max_axes: int = 3) -> sbp.DeviceMesh:
    """Meshes with 1..3 axes of size 1..4, maybe named, over a random subset/order of world ranks."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=max_axes)))
    size = math.prod(shape)
    ranks = None
    if draw(st.booleans()):
        ranks = draw(st.permutations(range(size + draw(st.integers(0, 4)))))[:size]
    names = NAMES[:len(shape)] if draw(st.booleans()) else None
    return sbp.DeviceMesh(shape, names=names, ranks=ranks)


@st.composite
def mesh_and_axes(draw):
    mesh = draw(meshes())
    axes = tuple(sorted(draw(st.sets(st.integers(0, mesh.ndim - 1), min_size=1))))
    return mesh, axes


# ---- basic values ----------------------------------------------------------------------------------
def test_named_mesh():
    mesh = sbp.DeviceMesh((2, 3), names=("dp", "tp"))
    assert mesh.shape == (2, 3)
    assert mesh.names == ("dp", "tp")
    assert mesh.ndim == 2
    assert mesh.size() == 6
    assert (mesh.size(0), mesh.size(1), mesh.size("tp"), mesh.size(-1)) == (2, 3, 3, 3)
    assert mesh.ranks == (0, 1, 2, 3, 4, 5)
    assert (mesh.axis("dp"), mesh.axis("tp"), mesh.axis(-2), mesh.axis(1)) == (0, 1, 0, 1)
    assert mesh.device_type == "cpu"
    assert repr(mesh) == "DeviceMesh((2, 3), names=('dp', 'tp'))"


def test_shape_forms():
    assert sbp.DeviceMesh(4).shape == (4,)
    assert sbp.DeviceMesh([2, 2]).shape == (2, 2)
    assert sbp.DeviceMesh((4,), names="dp").names == ("dp",)  # a lone string is one name
    assert sbp.DeviceMesh((2, 2), names=["a", "b"]).names == ("a", "b")
    assert repr(sbp.DeviceMesh((2,), ranks=[2, 3])) == "DeviceMesh((2,), ranks=[2, 3])"
    assert repr(sbp.DeviceMesh((4,))) == "DeviceMesh((4,))"
    # numpy integers count as ints, as in global shapes and coords (they were refused here only)
    assert sbp.DeviceMesh((np.int64(2), np.int32(2))).shape == (2, 2)
    assert type(sbp.DeviceMesh(np.array([2, 4])).shape[0]) is int
    assert sbp.plan((8,), np.array([2]), "S(0)", "B", itemsize=np.int64(4)).bytes_per_rank == 16


def test_pinned_coords_and_groups():
    mesh = sbp.DeviceMesh((2, 3))
    assert [mesh.coord_of(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert mesh.coords() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert mesh.groups(0) == ((0, 3), (1, 4), (2, 5))
    assert mesh.groups(1) == ((0, 1, 2), (3, 4, 5))
    assert mesh.groups((0, 1)) == ((0, 1, 2, 3, 4, 5),)
    assert mesh.groups(()) == ((0,), (1,), (2,), (3,), (4,), (5,))
    cube = sbp.DeviceMesh((2, 3, 2), names=("a", "b", "c"))
    assert cube.groups(("a", "c")) == ((0, 1, 6, 7), (2, 3, 8, 9), (4, 5, 10, 11))
    assert cube.groups((2, 0)) == cube.groups((0, 2)) == cube.groups(("c", "a"))  # members row-major over sorted axes
    assert cube.groups(-1) == cube.groups(2) == cube.groups("c")
    assert cube.axes(("c", 0, -1)) == (0, 2)
    assert cube.group_index((1, 2, 1), (0, 2)) == 3
    assert cube.group_index((1, 2, 1), (1,)) == 2


def test_ranks_subset():
    mesh = sbp.DeviceMesh((2, 2), names=("dp", "tp"), ranks=[4, 5, 6, 7])
    assert mesh.coord_of(6) == (1, 0)
    assert mesh.rank_of((0, 1)) == 5
    assert mesh.groups("tp") == ((4, 5), (6, 7))
    assert mesh.groups("dp") == ((4, 6), (5, 7))
    sub = mesh.submesh("dp", (0, 1))
    assert sub == sbp.DeviceMesh((2,), names=("dp",), ranks=[5, 7])
    assert sub.coord_of(7) == (1,)
    permuted = sbp.DeviceMesh((3,), ranks=[2, 0, 1])
    assert [permuted.coord_of(r) for r in (2, 0, 1)] == [(0,), (1,), (2,)]
    assert permuted.groups(0) == ((2, 0, 1),)


def test_submesh_several_axes():
    cube = sbp.DeviceMesh((2, 3, 2), names=("a", "b", "c"))
    sub = cube.submesh(("a", "c"), (1, 2, 0))
    assert sub.shape == (2, 2)
    assert sub.names == ("a", "c")
    assert sub.ranks == (4, 5, 10, 11)
    assert cube.submesh("b", (1, 0, 1)) == sbp.DeviceMesh((3,), names=("b",), ranks=[7, 9, 11])


def test_equality_and_hash():
    a = sbp.DeviceMesh((2, 2))
    assert a == sbp.DeviceMesh([2, 2], ranks=range(4))
    assert hash(a) == hash(sbp.DeviceMesh([2, 2], ranks=range(4)))
    assert a != sbp.DeviceMesh((4,))
    assert a != sbp.DeviceMesh((2, 2), names=("x", "y"))
    assert a != sbp.DeviceMesh((2, 2), ranks=[1, 0, 2, 3])
    assert a != sbp.DeviceMesh((2, 2), device_type="cuda")
    assert a == sbp.DeviceMesh((2, 2), binding=object())  # binding never changes equality
    assert hash(a) == hash(sbp.DeviceMesh((2, 2), binding=object()))
    assert len({a, sbp.DeviceMesh((2, 2)), sbp.DeviceMesh((4,))}) == 2


def test_frozen():
    mesh = sbp.DeviceMesh((2, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.shape = (4,)
    with pytest.raises(dataclasses.FrozenInstanceError):   # not a field (kept out of the value), frozen too
        mesh.binding = object()
    with pytest.raises(dataclasses.FrozenInstanceError):
        del mesh.names
    assert mesh.shape == (2, 2) and mesh.binding is None


def test_as_mesh_shape():
    assert as_mesh_shape("2x4") == (2, 4)
    assert as_mesh_shape("2X2x1") == (2, 2, 1)
    assert as_mesh_shape("8") == (8,)
    assert as_mesh_shape((2, 2)) == (2, 2)
    assert as_mesh_shape(4) == (4,)
    assert as_mesh_shape(sbp.DeviceMesh((3, 1), ranks=[5, 6, 7])) == (3, 1)


# ---- properties against numpy ----------------------------------------------------------------------
@pytest.mark.slow
@given(meshes())
@settings(max_examples=200, deadline=None)
def test_rank_coord_round_trip(mesh):
    assert mesh.size() == math.prod(mesh.shape) == len(mesh.ranks)
    assert mesh.ndim == len(mesh.shape)
    assert mesh.coords() == list(np.ndindex(*mesh.shape))
    for index, coord in enumerate(mesh.coords()):
        rank = mesh.ranks[index]
        assert mesh.index_of(coord) == np.ravel_multi_index(coord, mesh.shape) == index
        assert mesh.coord_of_index(index) == coord
        assert mesh.rank_of(coord) == rank
        assert mesh.coord_of(rank) == coord
    assert sorted(mesh.rank_of(c) for c in mesh.coords()) == sorted(mesh.ranks)


@pytest.mark.slow
@given(mesh_and_axes())
@settings(max_examples=200, deadline=None)
def test_groups_match_numpy(case):
    mesh, axes = case
    grid = np.array(mesh.ranks).reshape(mesh.shape)
    # Move the group axes last (keeping the others in order): each row is one group, row-major over `axes`.
    expected = np.moveaxis(grid, axes, range(mesh.ndim - len(axes), mesh.ndim))
    expected = expected.reshape(-1, math.prod(mesh.shape[a] for a in axes))
    groups = mesh.groups(axes)
    assert groups == tuple(tuple(int(r) for r in row) for row in expected)
    assert sorted(r for g in groups for r in g) == sorted(mesh.ranks)  # a partition of the mesh
    others = [a for a in range(mesh.ndim) if a not in axes]
    for group in groups:
        coords = [mesh.coord_of(r) for r in group]
        assert len({tuple(c[a] for a in others) for c in coords}) == 1  # members differ only on `axes`
        for position, coord in enumerate(coords):
            assert mesh.group_index(coord, axes) == position
    if mesh.names is not None:
        assert mesh.groups(tuple(mesh.names[a] for a in axes)) == groups


@pytest.mark.slow
@given(mesh_and_axes(), st.data())
@settings(max_examples=200, deadline=None)
def test_submesh(case, data):
    mesh, axes = case
    coord = data.draw(st.sampled_from(mesh.coords()))
    sub = mesh.submesh(axes, coord)
    assert sub.shape == tuple(mesh.shape[a] for a in axes)
    assert sub.names == (None if mesh.names is None else tuple(mesh.names[a] for a in axes))
    assert mesh.rank_of(coord) in sub.ranks
    assert sub.ranks in mesh.groups(axes)
    for rank in sub.ranks:
        full = mesh.coord_of(rank)
        assert sub.coord_of(rank) == tuple(full[a] for a in axes)
        assert all(full[a] == coord[a] for a in range(mesh.ndim) if a not in axes)


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: sbp.DeviceMesh(()), "mesh shape must be a non-empty tuple of positive ints, got ()"),
    (lambda: sbp.DeviceMesh((2, 0)), "mesh shape must be a non-empty tuple of positive ints, got (2, 0)"),
    (lambda: sbp.DeviceMesh((2, -1)), "mesh shape must be a non-empty tuple of positive ints, got (2, -1)"),
    (lambda: sbp.DeviceMesh((2.0,)), "mesh shape must be a non-empty tuple of positive ints, got (2.0,)"),
    (lambda: sbp.DeviceMesh((2, True)), "mesh shape must be a non-empty tuple of positive ints, got (2, True)"),
    (lambda: sbp.DeviceMesh((2, np.bool_(True))),
     "mesh shape must be a non-empty tuple of positive ints, got (2, np.True_)"),
    (lambda: sbp.DeviceMesh((np.int64(0),)),
     "mesh shape must be a non-empty tuple of positive ints, got (np.int64(0),)"),
    (lambda: sbp.DeviceMesh("2x2"), "mesh shape must be a non-empty tuple of positive ints, got '2x2'"),
    (lambda: sbp.DeviceMesh(None), "mesh shape must be a tuple of positive ints, got None"),
    (lambda: sbp.DeviceMesh((2, 2), names=("a",)), "mesh names ('a',) must have one name per axis of shape (2, 2)"),
    (lambda: sbp.DeviceMesh((2, 2), names="dp"), "mesh names ('dp',) must have one name per axis of shape (2, 2)"),
    (lambda: sbp.DeviceMesh((2,), names=("a", "b")), "mesh names ('a', 'b') must have one name per axis of shape (2,)"),
    (lambda: sbp.DeviceMesh((2, 2), names=("a", "a")),
     "mesh axis names must be unique, got ('a', 'a') (duplicated: a)"),
    (lambda: sbp.DeviceMesh((2, 2, 2), names=("x", "y", "x")),
     "mesh axis names must be unique, got ('x', 'y', 'x') (duplicated: x)"),
    (lambda: sbp.DeviceMesh((2, 2), names=("a", "")), "mesh axis names must be non-empty strings, got ('a', '')"),
    (lambda: sbp.DeviceMesh((2, 2), names=("a", 1)), "mesh axis names must be non-empty strings, got ('a', 1)"),
    (lambda: sbp.DeviceMesh((2, 2), ranks=[0, 1, 2]), "mesh of shape (2, 2) needs 4 ranks, got 3: [0, 1, 2]"),
    (lambda: sbp.DeviceMesh((2,), ranks=[0, 1, 2]), "mesh of shape (2,) needs 2 ranks, got 3: [0, 1, 2]"),
    (lambda: sbp.DeviceMesh((2,), ranks=[1, 1]), "mesh ranks must be distinct, got [1, 1]"),
    (lambda: sbp.DeviceMesh((2,), ranks=[-1, 0]), "mesh ranks must be non-negative ints, got [-1, 0]"),
    (lambda: sbp.DeviceMesh((2,), ranks=[0, "1"]), "mesh ranks must be non-negative ints, got [0, '1']"),
    (lambda: sbp.DeviceMesh((2,), device_type="tpu"), "device_type must be 'cpu' or 'cuda', got 'tpu'"),
])
def test_invalid_construction(make, message):
    with pytest.raises(sbp.MeshError) as info:
        make()
    assert str(info.value) == message
    assert isinstance(info.value, sbp.SbpError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("call, message", [
    (lambda m: m.axis("pp"), "mesh has no axis named 'pp' (axis names: ('dp', 'tp'))"),
    (lambda m: m.groups("pp"), "mesh has no axis named 'pp' (axis names: ('dp', 'tp'))"),
    (lambda m: m.size("pp"), "mesh has no axis named 'pp' (axis names: ('dp', 'tp'))"),
    (lambda m: m.submesh(("dp", "pp"), (0, 0)), "mesh has no axis named 'pp' (axis names: ('dp', 'tp'))"),
    (lambda m: m.axis(2), "mesh axis 2 is out of range for a 2-axis mesh (valid: -2..1 or a name)"),
    (lambda m: m.axis(-3), "mesh axis -3 is out of range for a 2-axis mesh (valid: -2..1 or a name)"),
    (lambda m: m.coord_of(4), "rank 4 is not in this mesh (ranks: [0, 1, 2, 3])"),
    (lambda m: m.rank_of((2, 0)), "coord (2, 0) is not in a mesh of shape (2, 2)"),
    (lambda m: m.rank_of((0,)), "coord (0,) is not in a mesh of shape (2, 2)"),
    (lambda m: m.coord, "mesh.coord needs a mesh bound to processes (sbp.init_mesh or sbp.testing.spmd); "
                        "this DeviceMesh(2, 2) is a pure value"),
    (lambda m: m.rank, "mesh.rank needs a mesh bound to processes (sbp.init_mesh or sbp.testing.spmd); "
                       "this DeviceMesh(2, 2) is a pure value"),
    (lambda m: m["tp"], "mesh['tp'] (the sub-mesh along an axis through this rank) needs a mesh bound to "
                        "processes (sbp.init_mesh or sbp.testing.spmd); DeviceMesh((2, 2), names=('dp', 'tp')) "
                        "is a pure value"),
])
def test_invalid_use(call, message):
    mesh = sbp.DeviceMesh((2, 2), names=("dp", "tp"))
    with pytest.raises(sbp.MeshError) as info:
        call(mesh)
    assert str(info.value) == message


def test_unnamed_mesh_axis_name():
    with pytest.raises(sbp.MeshError) as info:
        sbp.DeviceMesh((2, 2)).axis("tp")
    assert str(info.value) == "mesh has no axis named 'tp' (axis names: None)"


def test_rank_outside_subset_mesh():
    with pytest.raises(sbp.MeshError) as info:
        sbp.DeviceMesh((2,), ranks=[2, 3]).coord_of(0)
    assert str(info.value) == "rank 0 is not in this mesh (ranks: [2, 3])"


@pytest.mark.parametrize("text, message", [
    ("2x", "cannot parse mesh shape '2x'; write it like '2x2' or '8'"),
    ("two", "cannot parse mesh shape 'two'; write it like '2x2' or '8'"),
    ("2x0", "mesh shape must be a non-empty tuple of positive ints, got (2, 0)"),
])
def test_as_mesh_shape_errors(text, message):
    with pytest.raises(sbp.MeshError) as info:
        as_mesh_shape(text)
    assert str(info.value) == message


def _dtensor_spellings(mesh):
    sub = sbp.testing.submesh(mesh, (2,), ranks=[1, 3])
    x = sbp.distribute(torch.ones(4), mesh, "S(0), B")
    return (mesh.mesh_dim_names, mesh.get_coordinate(), mesh.get_local_rank("tp"), mesh.get_local_rank(0),
            sub.get_coordinate(), x.device_mesh is x.mesh)


def test_dtensor_spellings_of_mesh_facts():
    # code ported from DTensor reads mesh.mesh_dim_names, get_coordinate(), get_local_rank(dim), x.device_mesh
    got = sbp.testing.spmd(_dtensor_spellings, (2, 2), names=("dp", "tp"))
    assert got == [(("dp", "tp"), [0, 0], 0, 0, None, True), (("dp", "tp"), [0, 1], 1, 0, [0], True),
                   (("dp", "tp"), [1, 0], 0, 1, None, True), (("dp", "tp"), [1, 1], 1, 1, [1], True)]
    with pytest.raises(sbp.SbpError, match="get_local_rank needs mesh_dim on a 2-axis mesh"):
        sbp.testing.spmd(lambda mesh: mesh.get_local_rank(), (2, 2))


def _dtensor_redistribute(mesh):
    x = sbp.distribute(torch.arange(8.0).reshape(4, 2), mesh, "S(0), B")
    moved = [x.redistribute(mesh, [sbp.B, sbp.S(1)]), x.redistribute(device_mesh=mesh, placements="B, S(1)"),
             x.redistribute(placements="B, S(1)")]
    return [(y.placements, y.to_local().tolist()) for y in moved]


def _dtensor_constructor_spellings(mesh):
    a = sbp.from_local(torch.full((2, 3), float(mesh.rank)), mesh, [sbp.S(0)], run_check=False, shape=(4, 3),
                       stride=(3, 1))
    b = sbp.from_local(torch.full((2, 3), float(mesh.rank)), mesh, [sbp.S(0)], run_check=True)
    c = sbp.distribute(torch.arange(4.0) if mesh.rank == 0 else None, mesh, "S(0)", src_data_rank=0)
    return a.full().tolist() == b.full().tolist() == [[0.0] * 3] * 2 + [[1.0] * 3] * 2, c.to_local().tolist()


def test_from_local_and_distribute_take_dtensor_keywords():
    # code ported from DTensor passes from_local(run_check=, shape=, stride=) and distribute(src_data_rank=)
    assert sbp.testing.spmd(_dtensor_constructor_spellings, (2,)) == [(True, [0.0, 1.0]), (True, [2.0, 3.0])]


def test_redistribute_takes_dtensor_order_and_names():
    # DTensor's x.redistribute(device_mesh, placements) and its keywords, beside sbp's x.redistribute(placements)
    for rank, got in enumerate(sbp.testing.spmd(_dtensor_redistribute, (2, 2))):
        want = torch.arange(8.0).reshape(4, 2)[:, rank % 2:rank % 2 + 1].tolist()
        assert got == [((sbp.B, sbp.S(1)), want)] * 3
