"""The reference simulator (`sbp.runtime.simulate`): per-rank tables for every step kind, local-move semantics,
scatter/assemble round trips, and that it refuses wrong plans instead of papering over them.

Pure tier: one process, no torch.distributed.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sbp
from sbp import B, Partial
from sbp.runtime.simulate import SimulationError, assemble, identity, scatter, simulate
from sbp.testing.strategies import layouts
from sbp.values.steps import Plan, Step


def one_step(shape, mesh, kind, axes, src, dst, dims=(), op=None) -> Plan:
    """A hand-written one-step plan (the simulator must not trust the planner)."""
    src, dst = sbp.placements(src), sbp.placements(dst)
    return Plan(tuple(shape), tuple(mesh), src, dst, 4, (Step(kind, axes, src, dst, dims, op),))


def table(locals_: dict) -> dict:
    return {c: t.tolist() for c, t in sorted(locals_.items())}


# ---- scatter / assemble ---------------------------------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(layouts(max_dims=3, max_side=7), st.sampled_from([None, 1, 2]),
       st.sampled_from([torch.float64, torch.int64, torch.int32]))
def test_scatter_then_assemble_is_the_identity(case, parts, dtype):
    mesh, shape, pls = case
    value = torch.randint(-50, 50, shape).to(dtype)
    locals_ = scatter(value, mesh, pls, parts=parts)
    for coord, local in locals_.items():
        assert tuple(local.shape) == sbp.local_shape(shape, mesh, pls, coord)
    assert torch.equal(assemble(locals_, mesh, pls, shape), value)


def test_scatter_partial_default_is_value_at_coord_0_and_identity_elsewhere():
    t = torch.tensor([3.0, -1.0])
    assert table(scatter(t, (3,), "P(sum)")) == {(0,): [3.0, -1.0], (1,): [0.0, 0.0], (2,): [0.0, 0.0]}
    inf = float("inf")
    assert table(scatter(t, (2,), "P(min)")) == {(0,): [3.0, -1.0], (1,): [inf, inf]}
    ints = scatter(torch.tensor([3, -1], dtype=torch.int8), (2,), "P(max)")
    assert table(ints) == {(0,): [3, -1], (1,): [-128, -128]}


@pytest.mark.parametrize("op, reduce", [("sum", lambda x: x.sum(0)), ("min", lambda x: x.amin(0)),
                                        ("max", lambda x: x.amax(0))])
def test_scatter_random_parts_are_real_contributions(op, reduce):
    value = torch.randint(-9, 10, (5, 3)).to(torch.float64)
    locals_ = scatter(value, (4,), f"P({op})", parts=7)
    stacked = torch.stack([locals_[(c,)] for c in range(4)])
    assert torch.equal(reduce(stacked), value)  # reduced by hand, not by assemble
    assert not torch.equal(locals_[(0,)], value) or not torch.equal(locals_[(1,)], locals_[(0,)])
    assert scatter(value, (4,), f"P({op})", parts=7).keys() == locals_.keys()
    assert all(torch.equal(a, b) for a, b in zip(locals_.values(), scatter(value, (4,), f"P({op})", parts=7).values()))


def test_nested_partials_reduce_outer_op_of_inner_op():
    # (P(sum), P(max)) on 2x2: logical = sum over axis 0 of (max over axis 1)
    locals_ = {(0, 0): torch.tensor([1.0]), (0, 1): torch.tensor([5.0]),
               (1, 0): torch.tensor([2.0]), (1, 1): torch.tensor([-3.0])}
    assert assemble(locals_, (2, 2), "P(sum), P(max)", (1,)).tolist() == [7.0]
    assert assemble(locals_, (2, 2), "P(max), P(sum)", (1,)).tolist() == [6.0]


def test_identity_elements():
    assert identity("sum", torch.int32) == 0
    assert identity("min", torch.float16) == float("inf")
    assert identity("max", torch.int64) == torch.iinfo(torch.int64).min
    assert identity("min", torch.uint8) == 255
    assert identity("min", torch.bool) is True and identity("max", torch.bool) is False


# ---- collectives, as per-rank tables -------------------------------------------------------------------
def test_all_gather():
    locals_ = {(0,): torch.tensor([0, 1]), (1,): torch.tensor([2, 3]), (2,): torch.tensor([4])}
    out = simulate(one_step((5,), (3,), "all_gather", (0,), "S(0)", "B", dims=(0,)), locals_)
    assert table(out) == {(c,): [0, 1, 2, 3, 4] for c in range(3)}


def test_reduce_scatter_and_all_reduce():
    locals_ = {(0,): torch.tensor([1, 2, 3]), (1,): torch.tensor([10, 20, 30])}
    rs = simulate(one_step((3,), (2,), "reduce_scatter", (0,), "P", "S(0)", dims=(0,), op="sum"), locals_)
    assert table(rs) == {(0,): [11, 22], (1,): [33]}
    ar = simulate(one_step((3,), (2,), "all_reduce", (0,), "P(max)", "B", op="max"), locals_)
    assert table(ar) == {(0,): [10, 20, 30], (1,): [10, 20, 30]}


def test_all_to_all_per_rank_table():
    # 2x4 over (2,): S(0) -> S(1); rank 0 holds row 0, rank 1 row 1; afterwards columns 0-1 and 2-3
    t = torch.arange(8).reshape(2, 4)
    out = simulate(one_step((2, 4), (2,), "all_to_all", (0,), "S(0)", "S(1)", dims=(0, 1)), scatter(t, (2,), "S(0)"))
    assert table(out) == {(0,): [[0, 1], [4, 5]], (1,): [[2, 3], [6, 7]]}


def test_flattened_transfer():
    t = torch.arange(16).reshape(4, 4)
    p = one_step((4, 4), (2, 2), "transfer", (0, 1), "S(0), S(1)", "S(1), S(0)")
    out = simulate(p, scatter(t, (2, 2), "S(0), S(1)"))
    assert table(out)[(0, 1)] == [[8, 9], [12, 13]]  # columns 0-1 (axis 0), rows 2-3 (axis 1)
    assert torch.equal(assemble(out, (2, 2), "S(1), S(0)", (4, 4)), t)


# ---- local moves ------------------------------------------------------------------------------------------
def test_broadcast_to_partial_sum_keeps_coord_0_only():
    locals_ = {(c,): torch.tensor([4.0, 5.0]) for c in range(3)}
    out = simulate(one_step((2,), (3,), "local", (0,), "B", "P(sum)", op="sum"), locals_)
    assert table(out) == {(0,): [4.0, 5.0], (1,): [0.0, 0.0], (2,): [0.0, 0.0]}


@pytest.mark.parametrize("op", ["min", "max"])
def test_broadcast_to_partial_min_max_keeps_the_value(op):
    locals_ = {(c,): torch.tensor([4, 5]) for c in range(2)}
    out = simulate(one_step((2,), (2,), "local", (0,), "B", f"P({op})", op=op), locals_)
    assert table(out) == {(0,): [4, 5], (1,): [4, 5]}


@pytest.mark.parametrize("dtype, op, fill", [(torch.float32, "sum", 0.0), (torch.float32, "min", float("inf")),
                                             (torch.float64, "max", float("-inf")),
                                             (torch.int32, "min", 2**31 - 1), (torch.int16, "max", -(2**15))])
def test_split_to_partial_embeds_the_shard_into_the_identity(dtype, op, fill):
    locals_ = {(0,): torch.tensor([1, 2], dtype=dtype), (1,): torch.tensor([3], dtype=dtype)}
    out = simulate(one_step((3,), (2,), "local", (0,), "S(0)", f"P({op})", op=op), locals_)
    assert table(out) == {(0,): [1, 2, fill], (1,): [fill, fill, 3]}


def test_broadcast_to_split_slices():
    locals_ = {(c,): torch.arange(5) for c in range(2)}
    out = simulate(one_step((5,), (2,), "local", (0,), "B", "S(0)", dims=(0,)), locals_)
    assert table(out) == {(0,): [0, 1, 2], (1,): [3, 4]}


# ---- it refuses wrong plans ---------------------------------------------------------------------------------
def test_a_step_that_needs_data_the_group_lacks_is_refused():
    # (B, S(0)) -> (S(0), S(0)) by slicing on axis 0 alone: axis 1's splits came first, the data is elsewhere
    t = torch.arange(8)
    p = one_step((8,), (2, 2), "local", (0,), "B, S(0)", "S(0), S(0)", dims=(0,))
    with pytest.raises(SimulationError, match="does not hold"):
        simulate(p, scatter(t, (2, 2), "B, S(0)"))


def test_differing_broadcast_replicas_are_refused():
    locals_ = {(0,): torch.tensor([1]), (1,): torch.tensor([2])}
    with pytest.raises(SimulationError, match="replicas"):
        assemble(locals_, (2,), "B", (1,))


def test_reducing_in_the_wrong_nesting_order_gives_a_different_tensor():
    # the simulator runs a step as written; a plan that reduces the outer op first is caught by assemble
    src = "P(sum), P(max)"
    locals_ = {(0, 0): torch.tensor([1.0]), (0, 1): torch.tensor([5.0]),
               (1, 0): torch.tensor([2.0]), (1, 1): torch.tensor([-3.0])}
    t = assemble(locals_, (2, 2), src, (1,))  # 5 + 2
    wrong = Plan((1,), (2, 2), sbp.placements(src), (B, B), 4, (
        Step("all_reduce", (0,), sbp.placements(src), (B, Partial("max")), op="sum"),
        Step("all_reduce", (1,), (B, Partial("max")), (B, B), op="max")))
    right = Plan((1,), (2, 2), sbp.placements(src), (B, B), 4, (
        Step("all_reduce", (1,), sbp.placements(src), (Partial("sum"), B), op="max"),
        Step("all_reduce", (0,), (Partial("sum"), B), (B, B), op="sum")))
    assert torch.equal(assemble(simulate(right, locals_), (2, 2), "B, B", (1,)), t)
    assert assemble(simulate(wrong, locals_), (2, 2), "B, B", (1,)).tolist() == [3.0]  # max(1 + 2, 5 - 3)


def test_partial_to_other_partial_in_one_step_is_refused():
    locals_ = {(c,): torch.tensor([1.0]) for c in range(2)}
    with pytest.raises(SimulationError, match="not one move"):
        simulate(one_step((1,), (2,), "local", (0,), "P(sum)", "P(max)", op="max"), locals_)


@pytest.mark.parametrize("locals_, match", [
    ({(0,): torch.zeros(2)}, "one tensor per coord"),
    ({(0,): torch.zeros(2), (1,): torch.zeros(3)}, "has shape"),
    ({(0,): torch.zeros(2), (1,): torch.zeros(2, dtype=torch.int32)}, "one dtype"),
])
def test_bad_locals_are_user_errors(locals_, match):
    with pytest.raises(sbp.SbpError, match=match):
        simulate(sbp.plan((4,), (2,), "S(0)", "B"), locals_)


# ---- the planner's plans, end to end --------------------------------------------------------------------
@pytest.mark.parametrize("src, dst", [("S(0),S(1)", "S(1),S(0)"), ("S(0),S(0)", "S(1),S(1)"), ("S(0),S(0)", "B,S(0)"),
                                      ("S(0),B", "B,S(0)"), ("P,P", "B,B"), ("P(max),S(1)", "S(0),P(min)")])
@pytest.mark.parametrize("shape", [(16, 12), (7, 5), (0, 3)])
def test_known_plans_run_exactly(shape, src, dst):
    value = torch.randint(-9, 10, shape).to(torch.int64)
    p = sbp.plan(shape, (2, 2), src, dst, itemsize=8)
    out = simulate(p, scatter(value, (2, 2), src, parts=5))
    for coord, local in out.items():
        assert tuple(local.shape) == sbp.local_shape(shape, (2, 2), dst, coord)
    assert torch.equal(assemble(out, (2, 2), dst, shape), value)


# ---- reduce_transfer ---------------------------------------------------------------------------------------
def test_reduce_transfer_per_rank_table():
    # (P, S(0)) -> (S(0), B) on 2x2, 2 rows: coord (p, h) holds contribution p of row h, needs row p reduced
    locals_ = {(0, 0): torch.tensor([1]), (0, 1): torch.tensor([2]), (1, 0): torch.tensor([10]), (1, 1): torch.tensor([20])}
    out = simulate(one_step((2,), (2, 2), "reduce_transfer", (0, 1), "P, S(0)", "S(0), B", op="sum"), locals_)
    assert table(out) == {(0, 0): [11], (0, 1): [11], (1, 0): [22], (1, 1): [22]}


@pytest.mark.parametrize("src, dst, op", [("P(sum), P(max)", "B, B", "sum"), ("P(max), S(0)", "P(max), B", "max"),
                                          ("P(max), S(0)", "S(0), B", "sum")])
def test_reduce_transfer_of_two_ops_or_into_partial_is_refused(src, dst, op):
    t = torch.arange(4.)
    with pytest.raises(SimulationError, match="reduce_transfer"):
        simulate(one_step((4,), (2, 2), "reduce_transfer", (0, 1), src, dst, op=op), scatter(t, (2, 2), src))
