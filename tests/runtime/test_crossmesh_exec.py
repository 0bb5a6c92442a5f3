"""Cross-mesh redistribution run for real: threads backend for the table, gloo for the issue's cases.

Each case checks that the logical tensor survives, that every destination rank holds exactly its block,
that ranks outside both meshes take no part, and that the bytes counted at the communicator in the
point-to-point phase equal the plan's per-rank figures.
"""
from __future__ import annotations

import pytest
import torch

import sbp
from sbp.testing import spmd, submesh
from tests.support.cases import SHAPES

WORLD = 4
MESHES = {  # name -> (shape, world ranks)
    "r01": ((2,), (0, 1)),
    "r23": ((2,), (2, 3)),
    "all4": ((4,), (0, 1, 2, 3)),
    "g22": ((2, 2), (0, 1, 2, 3)),
    "r12": ((2,), (1, 2)),
    "r3": ((1,), (3,)),
}
CASES = [
    ("r01", "S(0)", "all4", "S(1)"),     # 2 ranks -> 4 ranks
    ("g22", "S(0), S(1)", "r01", "B"),   # 4 ranks (2,2) -> 2 ranks
    ("r01", "S(0)", "r23", "S(0)"),      # disjoint sets {0,1} -> {2,3}
    ("all4", "S(1)", "r12", "S(0)"),     # overlapping sets
    ("r01", "P", "all4", "S(0)"),        # Partial source, reduced at the destination
    ("g22", "P, S(0)", "r23", "B"),      # Partial source, reduced on the source side
    ("r01", "P(max)", "r3", "B"),
    ("r12", "B", "g22", "S(1), P"),      # Partial target
]


def make_value(shape):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 - 3


def run_case(world, a, src, b, dst, shape):
    sm = submesh(world, MESHES[a][0], ranks=MESHES[a][1])
    dm = submesh(world, MESHES[b][0], ranks=MESHES[b][1])
    full = make_value(shape)
    x = sbp.distribute(full, sm, src)
    counters = sm.binding.counters  # the exchange runs on the source mesh's communicator
    counters.reset()
    y = x.redistribute(dst, mesh=dm)
    got = [c for c in counters.calls if c.collective == "exchange"]
    received = sum(c.received for c in got)
    plan = sbp.plan_cross_mesh(shape, sm, src, dm, dst, itemsize=8)
    assert received == plan.received.get(world.rank, 0)
    assert y.mesh == dm and y.placements == plan.dst
    if dm.coord is None:
        return "outside", tuple(y.to_local().shape)
    whole = y.full()
    if not any(isinstance(p, sbp.Partial) for p in plan.dst):
        sl = sbp.local_slices(shape, dm.shape, plan.dst, dm.coord)
        assert torch.equal(y.to_local(), full[sl])
    return "inside", bool(torch.allclose(whole, full, rtol=0, atol=1e-12))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}:{c[1]}->{c[2]}:{c[3]}")
def test_cross_mesh_threads(case, shape):
    a, src, b, dst = case
    out = spmd(lambda world: run_case(world, a, src, b, dst, shape), (WORLD,))
    for rank, (where, ok) in enumerate(out):
        if rank in MESHES[b][1]:
            assert where == "inside" and ok is True
        else:
            assert where == "outside"


def test_ranks_outside_both_meshes_are_not_blocked():
    def fn(world):
        a = submesh(world, (2,), ranks=[0, 1])
        b = submesh(world, (1,), ranks=[2])
        x = sbp.distribute(make_value((4, 4)), a, "S(0)")
        if world.rank == 3:  # outside both: returns at once, even though it never meets the others
            return x.redistribute("B", mesh=b).to_local().numel()
        return x.redistribute("B", mesh=b).to_local().numel()
    assert spmd(fn, (4,)) == [0, 0, 16, 0]


def test_cross_mesh_backward_is_the_reverse_move():
    def fn(world):
        a = submesh(world, (2,), ranks=[0, 1])
        b = submesh(world, (2,), ranks=[2, 3])
        t = make_value((6, 4))
        x = sbp.distribute(t, a, "S(0)", requires_grad=True)
        y = x.redistribute("S(1)", mesh=b)
        y.to_local().sum().backward() if b.coord is not None else y.to_local().sum().backward()
        return None if a.coord is None else x.grad.to_local().tolist()
    out = spmd(fn, (4,))
    assert out[0] == [[1.0] * 4] * 3 and out[1] == [[1.0] * 4] * 3


def _gloo_cases(world):
    results = []
    for case in [("r01", "S(0)", "all4", "S(1)"), ("g22", "S(0), S(1)", "r01", "B"),
                 ("r01", "S(0)", "r23", "S(0)"), ("r01", "P", "all4", "S(0)"), ("g22", "P, S(0)", "r23", "B")]:
        for shape in [(7, 5), (0, 4)]:
            results.append(run_case(world, *case, shape))
    return results


@pytest.mark.gloo
def test_cross_mesh_gloo():
    out = spmd(_gloo_cases, (WORLD,), backend="gloo")
    cases = [("r01", "S(0)", "all4", "S(1)"), ("g22", "S(0), S(1)", "r01", "B"), ("r01", "S(0)", "r23", "S(0)"),
             ("r01", "P", "all4", "S(0)"), ("g22", "P, S(0)", "r23", "B")]
    for rank, results in enumerate(out):
        for (a, src, b, dst), (where, ok) in zip([c for c in cases for _ in range(2)], results):
            if rank in MESHES[b][1]:
                assert (where, ok) == ("inside", True)
            else:
                assert where == "outside"


def test_spmd_training_step_with_a_loss_on_a_mesh_over_some_ranks():
    """Every rank runs the same step: the loss lives on ranks 2, 3 only; ranks 0, 1 get a 0-d placeholder
    from full() (nan), call backward too and so take their part in the backward of the cross-mesh move;
    .item() outside the loss's mesh is an error, not torch's empty-tensor error."""
    def fn(mesh):
        sub = submesh(mesh, (2,), ranks=[2, 3])
        w = sbp.distribute(torch.arange(8.0).view(4, 2), mesh, "S(0), S(1)", requires_grad=True)
        moved = w.redistribute("S(0)", mesh=sub)
        loss = (moved * moved).sum().full()
        loss.backward()
        try:
            value = moved.sum().item()
        except sbp.MeshError as e:
            value = str(e)
        return tuple(loss.shape), loss.item(), w.grad.placements, w.grad.full(), value

    for rank, (shape, loss, placements, grad, value) in enumerate(spmd(fn, (2, 2))):
        assert shape == () and placements == (sbp.S(0), sbp.S(1))
        assert torch.equal(grad, 2 * torch.arange(8.0).view(4, 2))
        if rank < 2:
            assert loss != loss and value.startswith(f".item() on rank {rank}, which is outside the tensor's mesh")
        else:
            assert loss == 140.0 and value == 28.0


@pytest.mark.parametrize("op", ["sum", "max"])
def test_a_partial_target_on_other_ranks_receives_only_each_ranks_block(op):
    # the planner landed a Partial target axis as B: every destination rank received the whole tensor (8x the
    # bytes on 8 ranks) and then kept its share; a split landing sends each rank its block, made Partial locally
    plan = sbp.plan_cross_mesh((1024, 1024), sbp.DeviceMesh((8,), ranks=range(8)), "S(0)",
                               sbp.DeviceMesh((8,), ranks=range(8, 16)), f"P({op})")
    assert (plan.bytes_per_rank, plan.transfer_bytes) == (1024 * 1024 * 4 // 8, 1024 * 1024 * 4)
    full = torch.arange(64.).reshape(8, 8)

    def fn(world):
        a, b = submesh(world, (2,), ranks=[0, 1]), submesh(world, (4,), ranks=[2, 3, 4, 5])
        x = sbp.distribute(full, a, "S(0)")
        world.binding.counters.reset()
        y = x.redistribute(f"P({op})", mesh=b)
        return world.binding.counters.received, y.full() if b.coord is not None else None

    out = spmd(fn, (6,))
    assert [received for received, _ in out] == [0, 0] + [16 * 4] * 4   # 16 of the 64 elements each
    assert all(torch.equal(y, full) for _, y in out[2:])
