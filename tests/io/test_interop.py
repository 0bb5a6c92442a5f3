"""DTensor interop on real process groups (gloo, 4 processes): round trips on 1-D and 2-D meshes, even and
uneven shapes (DTensor's torch.chunk blocks differ from sbp's balanced ones), Partial placements, autograd.

Functions run on the workers are module-level (they travel pickled); cases are batched into few calls.
"""
from __future__ import annotations

import functools

import pytest
import torch

import sbp
import sbp.testing
from sbp.io.interop import _meeting_point, dtensor_block

spmd = functools.partial(sbp.testing.spmd, backend="gloo", timeout=60)

CASES_1D = [((8, 4), "S(0)"), ((10, 3), "S(0)"), ((5, 3), "S(1)"), ((2, 3), "S(0)"), ((0, 3), "S(0)"),
            ((6,), "B"), ((7, 2), "P(sum)"), ((9,), "P(max)")]
CASES_2D = [((8, 4), "S(0), S(1)"), ((10, 6), "S(0), S(0)"), ((5, 7), "S(1), S(0)"), ((7, 3), "B, S(0)"),
            ((6, 5), "P(sum), S(1)"), ((3, 3), "S(0), P(min)"), ((4, 4), "S(1), S(1)")]


def values(shape) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 1


def _round_trips(cases, mesh):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for shape, pls in cases:
        t = values(shape)
        x = sbp.distribute(t, mesh, pls)
        dt = sbp.to_dtensor(x)
        own_shape, _ = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        back = sbp.from_dtensor(dt)
        out.append((
            [type(p).__name__ for p in dt.placements],
            tuple(dt.to_local().shape) == tuple(own_shape),       # DTensor's own layout: nothing mis-assembled
            torch.equal(dt.full_tensor(), t),
            back.placements == x.placements and back.mesh == x.mesh,
            torch.equal(back.to_local(), x.to_local()),            # the same local block as before
        ))
    return out


@pytest.mark.parametrize("mesh_shape,cases", [((4,), CASES_1D), ((2, 2), CASES_2D)], ids=["1d", "2d"])
@pytest.mark.gloo
def test_round_trip_with_dtensor(mesh_shape, cases):
    out = spmd(functools.partial(_round_trips, cases), mesh_shape)
    for rank, per_rank in enumerate(out):
        for (shape, pls), (names, own, full, same_pls, same_local) in zip(cases, per_rank):
            expect = [{"S": "Shard", "B": "Replicate", "P": "Partial"}[p.strip()[0]] for p in pls.split(",")]
            assert names == expect
            assert own and full and same_pls and same_local, (rank, shape, pls)


def _from_native(mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from sbp.io.interop import _torch_mesh

    torch_mesh = _torch_mesh(mesh)
    out = []
    for shape, placements in [((10, 3), [Shard(0), Shard(0)]), ((5, 6), [Replicate(), Shard(1)]),
                              ((3, 5), [Shard(1), Shard(0)])]:
        t = values(shape)
        x = sbp.from_dtensor(distribute_tensor(t, torch_mesh, placements))
        out.append(torch.equal(x.full(), t) and x.mesh is mesh)
    try:
        sbp.from_dtensor(DTensor.from_local(values((4,)), torch_mesh, [Replicate(), Partial("avg")]))
    except sbp.SbpError as e:
        out.append(str(e))
    return out


@pytest.mark.gloo
def test_from_native_dtensor_and_refusal():
    for per_rank in spmd(_from_native, (2, 2)):
        assert per_rank[:3] == [True, True, True]
        assert "has no sbp equivalent" in per_rank[3] and "Partial('sum'|'min'|'max')" in per_rank[3]


def _grads(mesh):
    t = values((10, 3))
    x = sbp.distribute(t, mesh, "S(0), B", requires_grad=True)
    dt = sbp.to_dtensor(x)                                    # uneven: 10 rows chunk 5,5 then 3,2 vs balanced
    (dt.full_tensor() * t).sum().backward()
    return x.grad.placements == x.placements and torch.equal(x.grad.full(), t)


def _partial_grads(mesh):
    """The gradient of a Partial value is B, counted once: DTensor hands it back as Replicate."""
    t = values((5, 3))
    out = []
    for pls in ("P(sum), S(0)", "S(1), P(max)", "P, P"):
        x = sbp.distribute(t, mesh, pls, requires_grad=True)
        (sbp.to_dtensor(x).full_tensor() * t).sum().backward()
        out.append(torch.equal(x.grad.full(), t))
    return out


@pytest.mark.gloo
def test_to_dtensor_is_differentiable():
    assert spmd(_grads, (2, 2)) == [True] * 4
    assert spmd(_partial_grads, (2, 2)) == [[True] * 3] * 4


def _mixed_partials(mesh):
    return sbp.to_dtensor(sbp.zeros((4,), mesh, "P(sum), P(max)"))


def test_mixed_partial_ops_are_refused_with_the_fix():
    # DTensor holds one Partial op per tensor: its own refusal was a raw ValueError ("Mixed Partial reduce types")
    with pytest.raises(sbp.SbpError, match=r"\(P\(sum\), P\(max\)\) mixes Partial ops \(max, sum\).*"
                       r"sbp.to_dtensor\(x.redistribute\(\"P\(sum\), B\"\)\)") as info:
        sbp.testing.spmd(_mixed_partials, (2, 2))
    assert isinstance(info.value.__cause__, sbp.PlacementError)


def _threads_refused(mesh):
    return sbp.to_dtensor(sbp.zeros((2,), mesh, "B"))


def test_threads_backend_is_refused():
    with pytest.raises(sbp.SbpError, match="needs a mesh bound to torch.distributed"):
        sbp.testing.spmd(_threads_refused, (2,))


@pytest.mark.parametrize("shape,mesh_shape,pls", [((10,), (4,), "S(0)"), ((5, 7), (2, 2), "S(1), S(0)"),
                                                  ((10, 6), (2, 3), "S(0), S(0)"), ((1, 9), (2, 2), "S(1), S(1)")])
def test_dtensor_block_matches_torch(shape, mesh_shape, pls):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    pls = sbp.placements(pls)
    torch_pls = [Shard(p.dim) for p in pls]
    for index in range(sbp.DeviceMesh(mesh_shape).size()):
        coord = sbp.DeviceMesh(mesh_shape).coord_of_index(index)
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), torch_pls)
        ours = dtensor_block(shape, mesh_shape, pls, coord)
        assert tuple(hi - lo for lo, hi in ours) == tuple(local)
        assert all(lo == off for (lo, hi), off in zip(ours, offset) if hi > lo)


def test_meeting_point_keeps_coinciding_dims():
    assert _meeting_point((8, 10), (4,), sbp.placements("S(0)")) == sbp.placements("S(0)")
    assert _meeting_point((8, 10), (4,), sbp.placements("S(1)")) == sbp.placements("B")   # 3,3,2,2 vs 3,3,3,1
    assert _meeting_point((8, 10), (2, 2), sbp.placements("S(0), S(1)")) == sbp.placements("S(0), S(1)")
    assert _meeting_point((10, 8), (2, 2), sbp.placements("S(0), S(0)")) == sbp.placements("S(0), S(0)")  # 3,2,3,2
    assert _meeting_point((6, 9), (4, 2), sbp.placements("S(0), S(1)")) == sbp.placements("B, S(1)")  # 2,2,1,1 rows
