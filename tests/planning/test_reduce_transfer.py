"""The ``reduce_transfer`` step: reduce each piece of the target at one owner, then deliver it from there.

Three tiers over the same steps:

- pure: the schedule of `sbp.planning.exchange.reduce_exchange` pinned for the 2x2 case, its refusals, and a
  replay of random schedules in one process (every element reduced from each contribution exactly
  once, every output element written exactly once, send and receive lists mirror each other, the
  busiest rank's reception equal to the priced bytes);
- simulation: the same random steps run by `sbp.runtime.simulate` (the logical definition) rebuild the tensor;
- in-process SPMD: the executor on the threads backend, with the bytes counted at the communicator
  equal to the step's figure and at most two calls.
"""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

import sbp
import sbp.testing
from sbp import B, Partial, S
from sbp.planning.cost import Costing
from sbp.planning.exchange import reduce_exchange, reducible
from sbp.runtime.communicator import reduce_list
from sbp.runtime.executor import execute, execute_step
from sbp.runtime.simulate import assemble, scatter, simulate
from sbp.values.errors import PlanError
from sbp.values.layout import block, block_shape, relative
from sbp.values.placement import Broadcast, Split
from sbp.values.steps import Plan, Step
from tests.support import conformance as conf
from tests.support.cases import SHAPES

MIB = 1 << 20
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.filter_too_much])


# ---- the case that motivated it --------------------------------------------------------------------------
def test_partial_to_split_broadcast_reaches_the_bound_in_one_step():
    p = sbp.plan((1024, 1024), (2, 2), "P, S(0)", "S(0), B")
    assert [s.kind for s in p.steps] == ["reduce_transfer"]
    assert p.bytes_per_rank == sbp.lower_bound_bytes((1024, 1024), (2, 2), "P, S(0)", "S(0), B") == 2 * MIB
    assert p.num_collectives == 2 and p.steps[0].calls == 2
    assert p.peak_bytes <= 2 * (2 * MIB + 2 * MIB)


def test_schedule_per_rank_table():
    """4x2 on 2x2, (P, S(0)) -> (S(0), B): member (p, h) holds contribution p of row half h and needs
    row half p. The owner of half p is (p, p); it receives the other contribution, the other member
    of row p receives the result. Every member receives one half (4 elements)."""
    ex = reduce_exchange((4, 2), (2, 2), (Partial(), S(0)), (S(0), B), (0, 1), (0, 0))
    top, bottom = ((0, 2), (0, 2)), ((2, 4), (0, 2))
    assert ex.members == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert ex.owned == (((top, True),), (), (), ((bottom, True),))
    assert ex.recv1 == (((2, top),), (), (), ((1, bottom),))
    assert ex.send1 == ((), ((3, bottom),), ((0, top),), ())
    assert ex.recv2 == ((), ((0, top),), ((3, bottom),), ())
    assert ex.send2 == (((1, top),), (), (), ((2, bottom),))
    assert [ex.recv_elems(i) for i in range(4)] == [4, 4, 4, 4]


def test_pieces_are_shared_out_among_holders_else_among_needers():
    """4x4 on 2x2, (S(0), P) -> (S(1), B): member (h, p) holds contribution p of row half h and needs
    column half h. Both members that need columns 0-1 hold rows 0-1 of them: they split that piece
    (one row each, one contribution to receive). Nobody who needs columns 0-1 holds rows 2-3: the two
    needers split that piece too and receive both contributions of their row."""
    ex = reduce_exchange((4, 4), (2, 2), (S(0), Partial()), (S(1), B), (0, 1), (0, 0))
    assert ex.owned[0] == ((((0, 1), (0, 2)), True), (((2, 3), (0, 2)), False))
    assert ex.owned[1] == ((((1, 2), (0, 2)), True), (((3, 4), (0, 2)), False))
    assert ex.recv1[0] == ((1, ((0, 1), (0, 2))), (2, ((2, 3), (0, 2))), (3, ((2, 3), (0, 2))))
    # 2 + 4 elements of contributions, then rows 1 and 3 of columns 0-1 from their owner, member 1
    assert [ex.recv_elems(i) for i in range(4)] == [10, 10, 10, 10]


@pytest.mark.parametrize("src, dst, axes", [
    ((Partial(), Partial("max")), (B, B), (0, 1)),              # two ops in one group
    ((Partial(), Partial("max")), (B, Partial("max")), (0,)),   # a P(max) after the reduced P(sum)
    ((Partial(), S(0)), (Partial("max"), B), (0, 1)),           # a Partial target in the group
    ((B, S(0)), (S(0), B), (0, 1)),                             # nothing to reduce
    ((Partial(), S(0)), (S(0), S(0)), (0,)),                    # axis 1 splits dim 0 after the group's axis
    ((Partial(), S(0)), (B, B), (0,)),                          # axis 1 changes outside the group
])
def test_refused_changes(src, dst, axes):
    assert not reducible(src, dst, axes)
    with pytest.raises(PlanError, match="reduce_transfer"):
        reduce_exchange((4, 4), (2, 2), src, dst, axes, (0, 0))


def test_calls_and_json():
    p = sbp.plan((8, 8), (2, 2), "P(max), S(0)", "S(0), B")
    data = p.to_dict()
    assert data["steps"][0]["kind"] == "reduce_transfer" and data["steps"][0]["op"] == "max"
    assert data["steps"][0]["calls"] == 2 and data["num_collectives"] == 2
    assert "reduce_transfer(max)" in p.explain()


# ---- random steps: replayed schedule and simulator ------------------------------------------------------
@st.composite
def reduce_steps(draw):
    """(shape, mesh, src, dst, axes, op) for which a reduce_transfer on `axes` is valid."""
    mesh = draw(st.sampled_from([(2, 2), (2, 3), (3, 2), (2, 2, 2)]))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    op = draw(st.sampled_from(["sum", "max"]))
    naxes, ndim = len(mesh), len(shape)
    axes = tuple(a for a in range(naxes) if draw(st.booleans())) or tuple(range(naxes))
    sb = [Broadcast()] + [Split(d) for d in range(ndim)]
    src, dst = [], []
    for a in range(naxes):
        p = draw(st.sampled_from(sb + [Partial(op)] * 2))
        src.append(p)
        dst.append(draw(st.sampled_from(sb)) if a in axes else p)
    src, dst = tuple(src), tuple(dst)
    assume(reducible(src, dst, axes))
    return shape, mesh, src, dst, axes, op


def replay(step: Step, locals_: dict, shape: tuple, mesh: tuple) -> tuple[dict, int]:
    """Run the schedule of every group in one process with plain tensor indexing; return the new
    locals and the elements the busiest rank received. Asserts the schedule's invariants as it goes."""
    pax = [a for a in step.axes if isinstance(step.src[a], Partial)]
    q = math.prod(mesh[a] for a in pax)
    out, busiest = {}, 0
    for group in sbp.DeviceMesh(mesh).groups(step.axes):
        coord = sbp.DeviceMesh(mesh).coord_of(group[0])
        ex = reduce_exchange(shape, mesh, step.src, step.dst, step.axes, coord)
        n = len(ex.members)
        for i, j in itertools.product(range(n), repeat=2):
            for recv, send in ((ex.recv1, ex.send1), (ex.recv2, ex.send2)):
                assert [b for p, b in recv[i] if p == j] == [b for p, b in send[j] if p == i]
        have = [block(shape, mesh, step.src, m) for m in ex.members]
        want = [block(shape, mesh, step.dst, m) for m in ex.members]
        result = [torch.zeros(block_shape(w), dtype=torch.float64) for w in want]
        written = [torch.zeros(block_shape(w), dtype=torch.int64) for w in want]
        for i, m in enumerate(ex.members):
            for b, holds in ex.owned[i]:
                sources = ([i] if holds else []) + [p for p, bb in ex.recv1[i] if bb == b]
                # one part per contribution: the Partial coords of the senders are all different
                assert sorted(tuple(ex.members[p][a] for a in pax) for p in sources) == sorted(
                    itertools.product(*(range(mesh[a]) for a in pax))), (b, sources)
                assert len(sources) == q
                parts = [locals_[ex.members[p]][relative(b, have[p])] for p in sources]
                result[i][relative(b, want[i])] = reduce_list(parts, step.op)
                written[i][relative(b, want[i])] += 1
        for i in range(n):
            for p, b in ex.recv2[i]:
                assert any(b == ob for ob, _ in ex.owned[p])
                result[i][relative(b, want[i])] = result[p][relative(b, want[p])]
                written[i][relative(b, want[i])] += 1
            assert bool((written[i] == 1).all()), f"member {ex.members[i]}: elements written {written[i].tolist()}"
            out[ex.members[i]] = result[i]
        busiest = max([busiest] + [ex.recv_elems(i) for i in range(n)])
    return out, busiest


@SETTINGS
@given(reduce_steps(), st.integers(0, 2**16))
# replicas of a Broadcast axis before the Partial one hold different contributions: never mix them
@pytest.mark.slow
@example(((2,), (2, 2), (B, Partial()), (B, B), (0, 1), "sum"), 0)
@example(((5, 3), (2, 2, 2), (Partial("max"), B, Partial("max")), (S(1), S(0), B), (0, 1, 2), "max"), 1)
def test_random_steps_reproduce_the_logical_tensor(case, seed):
    shape, mesh, src, dst, axes, op = case
    step = Costing(shape, mesh, 8).step("reduce_transfer", axes, src, dst, op=op)
    gen = torch.Generator().manual_seed(seed)
    value = torch.randint(-9, 10, shape, generator=gen).to(torch.float64)
    locals_ = scatter(value, mesh, src, parts=gen)
    simulated = simulate(Plan(shape, mesh, src, dst, 8, (step,)), locals_)
    assert torch.equal(assemble(simulated, mesh, dst, shape), value)
    replayed, busiest = replay(step, locals_, shape, mesh)
    assert torch.equal(assemble(replayed, mesh, dst, shape), value), step
    assert busiest * 8 == step.bytes


@pytest.mark.slow
@SETTINGS
@given(reduce_steps())
def test_random_steps_never_beat_the_lower_bound(case):
    shape, mesh, src, dst, axes, op = case
    step = Costing(shape, mesh, 4).step("reduce_transfer", axes, src, dst, op=op)
    assert step.bytes >= sbp.lower_bound_bytes(shape, mesh, src, dst)
    assert sbp.plan(shape, mesh, src, dst).bytes_per_rank <= step.bytes  # the planner finds it or better


# ---- the executor on the threads backend ------------------------------------------------------------------
EXEC_CASES = [  # (mesh, src, dst, axes)
    ((2, 2), "P, S(0)", "S(0), B", (0, 1)),
    ((2, 2), "P(max), B", "S(1), S(0)", (0, 1)),
    ((2, 3), "P, S(1)", "S(1), B", (0, 1)),
    ((2, 2, 2), "P, P, S(0)", "S(0), B, S(1)", (0, 1, 2)),
    ((2, 2, 2), "S(1), P(max), P(max)", "B, B, S(0)", (0, 1, 2)),
    ((2, 2, 2), "P, S(0), P", "S(0), B, P", (0, 1)),          # a same-op Partial axis rides along
    ((2, 2, 2), "S(1), P, S(0)", "S(1), S(0), B", (1, 2)),    # axis 0 splits outside the group
]
EXEC_MESHES = list(dict.fromkeys(m for m, *_ in EXEC_CASES))   # (2, 2), (2, 3), (2, 2, 2)


def _run_steps(mesh: sbp.DeviceMesh, route: str = "auto") -> list:
    mesh.binding.exchange_route = route
    out = []
    for (mshape, src, dst, axes), shape in itertools.product(EXEC_CASES, SHAPES):
        if tuple(mshape) != tuple(mesh.shape):
            continue
        s, d = sbp.placements(src), sbp.placements(dst)
        op = next(p.op for p in s if isinstance(p, Partial))
        step = Costing(shape, mesh.shape, 4).step("reduce_transfer", axes, s, d, op=op)
        seed = conf.stable_seed("reduce_transfer", _text(s), _text(d), shape)
        g = conf.global_tensor(shape, torch.float32, seed)
        local = conf.source_local(g, mesh.shape, s, mesh.coord, seed)
        counters = mesh.binding.counters
        received, calls = counters.received, len(counters.calls)
        result = execute_step(step, local, mesh, shape)
        out.append((step, shape, result, counters.received - received, len(counters.calls) - calls))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("route", ["auto", "all_to_all"])
@pytest.mark.parametrize("mesh_shape", EXEC_MESHES)
def test_threads_backend_runs_and_counts_it(mesh_shape, route):
    per_rank = sbp.testing.spmd(functools.partial(_run_steps, route=route), mesh_shape)
    coords = sbp.DeviceMesh(mesh_shape).coords()
    assert per_rank[0], "no case for this mesh"
    for k, (step, shape, _, _, _) in enumerate(per_rank[0]):
        locals_ = {c: per_rank[r][k][2] for r, c in enumerate(coords)}
        for c in coords:
            assert tuple(locals_[c].shape) == sbp.local_shape(shape, mesh_shape, step.dst, c)
        got = conf.logical(locals_, mesh_shape, step.dst)
        seed = conf.stable_seed("reduce_transfer", _text(step.src), _text(step.dst), shape)
        assert torch.equal(got, conf.global_tensor(shape, torch.float32, seed)), (step, shape)
        assert max(per_rank[r][k][3] for r in range(len(coords))) == step.bytes, (step, shape)
        calls = max(per_rank[r][k][4] for r in range(len(coords)))
        assert calls == _expected_calls(step, shape, mesh_shape) <= step.calls, (step, shape, calls)


def _expected_calls(step: Step, shape: tuple, mesh_shape: tuple) -> int:
    """One call per phase in which some member of the group receives something."""
    mesh = sbp.DeviceMesh(mesh_shape)
    schedules = [reduce_exchange(shape, mesh_shape, step.src, step.dst, step.axes, mesh.coord_of(g[0]))
                 for g in mesh.groups(step.axes)]
    return max(any(ex.recv1) + any(ex.recv2) for ex in schedules)


def _text(pls) -> str:
    return ", ".join(map(repr, pls))


def test_planned_change_executes_at_the_lower_bound():
    def fn(mesh):
        p = sbp.plan((64, 32), mesh, "P, S(0)", "S(0), B")
        g = conf.global_tensor((64, 32), torch.float32, 5)
        local = conf.source_local(g, mesh.shape, p.src, mesh.coord, 5)
        mesh.binding.counters.reset()
        out = execute(p, local, mesh)
        return p, out, mesh.binding.counters.received

    per_rank = sbp.testing.spmd(fn, (2, 2))
    p = per_rank[0][0]
    assert [s.kind for s in p.steps] == ["reduce_transfer"] and p.bytes_per_rank == p.lower_bound
    got = conf.logical({c: r[1] for c, r in zip(sbp.DeviceMesh((2, 2)).coords(), per_rank)}, (2, 2), p.dst)
    assert torch.equal(got, conf.global_tensor((64, 32), torch.float32, 5))
    assert [r[2] for r in per_rank] == [p.bytes_per_rank] * 4  # every rank receives exactly one half
