"""Ranks that pass different placements, shapes, dtypes or src to one SPMD call get `RankMismatchError`.

Free checks (always on) ride on collectives the call makes anyway: `from_local` inferring the global
shape, `distribute(..., src=r)`. Under `sbp.debug()` (or SBP_DEBUG=1) every distribute / from_local /
redistribute checks, including that every rank computed the same plan. In-process ranks, plus one gloo
case each for a free check and a debug check.
"""
from __future__ import annotations

import sys
import threading

import pytest
import torch

import sbp
import sbp.testing


def raises_mismatch(fn, mesh_shape=(2, 2), *, debug: bool = False, backend: str = "threads") -> str:
    """Run `fn` on every rank; every rank must raise the same RankMismatchError; return its message."""
    def wrapped(mesh):
        try:
            fn(mesh)
        except sbp.RankMismatchError as e:
            return str(e)
        return None

    with sbp.debug(debug):
        messages = sbp.testing.spmd(wrapped, mesh_shape, backend=backend, timeout=20)
    assert messages[0] is not None, "no RankMismatchError"
    assert all(m == messages[0] for m in messages), messages   # every rank reports the same
    return messages[0]


# ---- free checks: no debug, no extra collective --------------------------------------------------------

def test_from_local_placements_disagree_is_caught_without_debug():
    def fn(mesh):
        sbp.from_local(torch.ones(2, 2), mesh, "S(0), P(sum)" if mesh.rank == 3 else "S(0), B")

    msg = raises_mismatch(fn)
    assert msg == ("from_local: ranks disagree on placements (every rank must pass the same; SPMD): "
                   "(S(0), B) on ranks [0, 1, 2]; (S(0), P(sum)) on ranks [3]")


def test_from_local_dtype_disagree_is_caught_without_debug():
    def fn(mesh):
        sbp.from_local(torch.ones(2, dtype=torch.float64 if mesh.rank == 1 else torch.float32), mesh, "S(0)")

    msg = raises_mismatch(fn, (4,))
    assert msg.endswith("ranks disagree on dtype (every rank must pass the same; SPMD): "
                        "torch.float32 on ranks [0, 2, 3]; torch.float64 on ranks [1]")


def test_from_local_ndim_disagree_is_caught_without_debug():
    def fn(mesh):
        sbp.from_local(torch.ones(2, 2) if mesh.rank else torch.ones(4), mesh, "B")

    msg = raises_mismatch(fn, (2,))
    assert msg == ("from_local: ranks disagree on the local tensor's ndim (every rank must pass the same; SPMD): "
                   "1 on ranks [0]; 2 on ranks [1]")


def test_from_local_shape_disagree_names_ranks_and_shapes():
    def fn(mesh):
        sbp.from_local(torch.ones(3 if mesh.rank == 2 else 2, 5), mesh, "S(0)")

    with pytest.raises(sbp.testing.SpmdError) as info:
        sbp.testing.spmd(fn, (4,))
    assert isinstance(info.value.__cause__, sbp.ShapeError)
    assert "rank 2 has (3, 5), expected (2, 5)" in str(info.value)


def test_distribute_src_disagree_is_caught_without_debug():
    def fn(mesh):
        src = 1 if mesh.rank == 3 else 0
        sbp.distribute(torch.ones(4), mesh, "S(0)", src=src)

    msg = raises_mismatch(fn)
    assert msg == ("distribute: ranks disagree on src (every rank must pass the same; SPMD): "
                   "0 on ranks [0, 1, 2]; 1 on ranks [3]")


def test_distribute_from_src_placements_disagree_is_caught_without_debug():
    def fn(mesh):
        sbp.distribute(torch.ones(4, 4) if mesh.rank == 0 else None, mesh,
                       "B, S(1)" if mesh.rank in (1, 2) else "S(0), B", src=0)

    msg = raises_mismatch(fn)
    assert msg == ("distribute: ranks disagree on placements (every rank must pass the same; SPMD): "
                   "(S(0), B) on ranks [0, 3]; (B, S(1)) on ranks [1, 2]")


def test_distribute_from_src_with_unsupported_dtype_fails_on_every_rank():
    def fn(mesh):
        try:
            sbp.distribute(torch.ones(4, dtype=torch.uint16) if mesh.rank == 0 else None, mesh, "S(0)", src=0)
        except sbp.DTypeError as e:
            return str(e)

    out = sbp.testing.spmd(fn, (2,), timeout=10)
    assert all(m and "cannot be scattered" in m for m in out), out   # nobody is left waiting in the scatter
    assert "(torch.uint16)" in out[0]


def test_threads_backend_names_ranks_calling_different_collectives():
    """Without debug, a disagreeing redistribute is still caught at the first collective that differs."""
    def fn(mesh):
        x = sbp.distribute(torch.ones(4, 4), mesh, "P(sum)")
        x.redistribute("B" if mesh.rank == 0 else "S(0)")

    with pytest.raises(sbp.testing.SpmdError) as info:
        sbp.testing.spmd(fn, (2,), timeout=10)
    assert isinstance(info.value.__cause__, sbp.RankMismatchError)
    assert "rank 1 calls reduce_scatter(sum) on axes (0,)" in str(info.value.__cause__) or \
        "rank 0 calls all_reduce(sum) on axes (0,)" in str(info.value.__cause__)


@pytest.mark.parametrize("route", ["full", "reduce", "transfer"])
def test_threads_backend_catches_ranks_that_disagree_on_dtype(route):
    """Without debug, the in-process backend sees every member's tensor: ranks that distributed different
    dtypes of the same itemsize (float32 / int32) fail at the first collective, by rank (a gathered float
    was cast to int on the other rank, silently)."""
    def fn(mesh):
        t = torch.tensor([0.5, 1.5, 2.5, 3.5]) if mesh.rank == 0 else torch.arange(4, dtype=torch.int32)
        if route == "full":
            sbp.distribute(t, mesh, "S(0)").full()
        elif route == "reduce":
            sbp.distribute(t, mesh, "P(sum)").redistribute("B")
        else:
            sbp.distribute(t.reshape(2, 2), mesh, "S(0)").redistribute("S(1)")

    message = raises_mismatch(fn, (2,))
    assert "ranks disagree on dtype" in message and "torch.float32 on ranks [0]; torch.int32 on ranks [1]" in message


# ---- under sbp.debug(): every call ------------------------------------------------------------------------

def test_debug_redistribute_dst_disagree():
    def fn(mesh):
        x = sbp.distribute(torch.ones(4, 4), mesh, "S(0), B")
        x.redistribute("B, B" if mesh.coord[1] == 0 else "S(1), B")

    msg = raises_mismatch(fn, debug=True)
    assert msg == ("redistribute: ranks disagree on dst placements (every rank must pass the same; SPMD): "
                   "(B, B) on ranks [0, 2]; (S(1), B) on ranks [1, 3]")


def test_debug_catches_a_rank_that_skips_a_no_op_redistribute():
    """Rank 0 asks for the placements it already has (a no-op); the others gather. Without debug rank 0
    would walk away and the others hang until the timeout."""
    def fn(mesh):
        x = sbp.distribute(torch.ones(4), mesh, "S(0)")
        x.redistribute("S(0)" if mesh.rank == 0 else "B")

    msg = raises_mismatch(fn, (2,), debug=True)
    assert "ranks disagree on dst placements" in msg and "(S(0),) on ranks [0]; (B,) on ranks [1]" in msg


def test_debug_distribute_shape_and_dtype_disagree():
    def fn(mesh):
        t = torch.ones(4, 3) if mesh.rank != 1 else torch.ones(5, 3, dtype=torch.float64)
        sbp.distribute(t, mesh, "S(0)")

    msg = raises_mismatch(fn, (2,), debug=True)
    assert msg == ("distribute: ranks disagree on dtype (every rank must pass the same; SPMD): torch.float32 on "
                   "ranks [0]; torch.float64 on ranks [1] | ranks disagree on global shape (every rank must pass "
                   "the same; SPMD): (4, 3) on ranks [0]; (5, 3) on ranks [1]")


@pytest.mark.parametrize("call, field", [
    (lambda m: sbp.zeros((2 + m.rank,), m, "S(0)"),
     "global shape (every rank must pass the same; SPMD): (2,) on ranks [0]; (3,) on ranks [1]"),
    (lambda m: sbp.ones((2,), m, "S(0)" if m.rank else "B"), "placements"),
    (lambda m: sbp.full((2,), float(m.rank), m, "B"), "fill value"),
    (lambda m: sbp.rand((2,), m, "B", seed=m.rank),
     "seed (every rank must pass the same; SPMD): 0 on ranks [0]; 1 on ranks [1]"),
], ids=["zeros-shape", "ones-placements", "full-value", "rand-seed"])
def test_debug_factories_disagree(call, field):
    # the factories make no collective; under debug they agree first (before: a B tensor whose values differed
    # by rank, or a different global shape on each rank, passed silently)
    assert f"factory: ranks disagree on {field}" in raises_mismatch(call, (2,), debug=True)


def test_without_debug_distribute_src_none_does_not_communicate():
    """The cost model: outside debug, distribute(src=None) makes no collective (so it cannot check)."""
    def fn(mesh):
        sbp.distribute(torch.ones(4), mesh, "S(0)")
        return len(mesh.binding.counters.calls)

    assert sbp.testing.spmd(fn, (2,)) == [0, 0]
    with sbp.debug():
        assert sbp.testing.spmd(fn, (2,)) == [1, 1]


def test_debug_from_local_global_shape_disagree():
    def fn(mesh):
        sbp.from_local(torch.ones(2), mesh, "S(0)", global_shape=(4,) if mesh.rank == 0 else None)

    msg = raises_mismatch(fn, (2,), debug=True)
    assert msg == ("from_local: ranks disagree on global_shape (every rank must pass the same; SPMD): "
                   "(4,) on ranks [0]; None on ranks [1]")


def test_debug_redistribute_global_shape_disagree():
    """Tensors built inconsistently (trusting from_local(global_shape=...) without debug) are caught at the
    next redistribute under debug."""
    def fn(mesh):
        x = sbp.from_local(torch.ones(2), mesh, "B", global_shape=(2,))
        y = sbp.from_local(torch.ones(1), mesh, "S(0)", global_shape=(1,) if mesh.rank == 0 else (3,))
        with sbp.debug():
            x.redistribute("S(0)")              # agrees: no error
            y.redistribute("B")

    msg = raises_mismatch(fn, (2,))
    assert msg.startswith("redistribute: ranks disagree on global shape (every rank must pass the same; SPMD): "
                          "(1,) on ranks [0]; (3,) on ranks [1]")


def test_debug_checks_that_every_rank_computed_the_same_plan(monkeypatch):
    """Same arguments but a different plan on one rank (a planner that is not deterministic) is named."""
    debug_module = sys.modules["sbp.runtime.agreement"]   # the module behind the sbp.debug context manager
    original = debug_module.plan_signature

    def skewed(plan):
        text = original(plan)
        return text + (" (skewed)" if threading.current_thread().name == "sbp-rank-1" else "")

    monkeypatch.setattr(debug_module, "plan_signature", skewed)

    def fn(mesh):
        sbp.distribute(torch.ones(4), mesh, "S(0)").redistribute("B")

    msg = raises_mismatch(fn, (2,), debug=True)
    assert msg.startswith("redistribute: ranks disagree on plan (every rank must pass the same; SPMD): plan ")
    assert msg.endswith("(skewed) on ranks [1]")


def test_debug_covers_redistributions_inside_ops_and_full():
    def fn(mesh):
        x = sbp.distribute(torch.ones(4, 4), mesh, "S(0)")
        if mesh.rank == 1:
            x = sbp.from_local(x.to_local(), mesh, "S(0)", global_shape=(4, 4))   # same: no error
        x.full()
        y = sbp.from_local(torch.ones(2, 4), mesh, "S(0)" if mesh.rank == 0 else "S(1)", global_shape=(4, 4)
                           if mesh.rank == 0 else (2, 8))
        with sbp.debug():
            y.full()

    msg = raises_mismatch(fn, (2,))
    assert "ranks disagree on global shape" in msg and "ranks disagree on src placements" in msg


def test_debug_cross_mesh_dst_placements_disagree():
    def fn(world):
        a = sbp.testing.submesh(world, (2,), ranks=[0, 1])
        b = sbp.testing.submesh(world, (2,), ranks=[2, 3])
        x = sbp.distribute(torch.arange(4.), a, "S(0)")
        x.redistribute("B" if world.rank == 3 else "S(0)", mesh=b)

    msg = raises_mismatch(fn, (4,), debug=True)
    assert msg == ("redistribute(mesh=...): ranks disagree on dst placements (every rank must pass the same; "
                   "SPMD): (S(0),) on ranks [0, 1, 2]; (B,) on ranks [3]")


def test_debug_passes_when_ranks_agree_and_env_switches_it_on(monkeypatch):
    def fn(mesh):
        x = sbp.distribute(torch.arange(8.).view(4, 2), mesh, "S(0), B")
        y = sbp.from_local(x.to_local(), mesh, "S(0), B")
        return torch.equal(y.redistribute("B, S(1)").full(), torch.arange(8.).view(4, 2)), \
            len(mesh.binding.counters.calls)

    plain = sbp.testing.spmd(fn, (2, 2))
    monkeypatch.setenv("SBP_DEBUG", "1")
    checked = sbp.testing.spmd(fn, (2, 2))
    assert all(ok for ok, _ in plain + checked)
    assert all(c > p for (_, c), (_, p) in zip(checked, plain))   # debug adds its signature gathers
    with sbp.debug(False):                                         # the context beats the environment
        assert sbp.testing.spmd(fn, (2, 2)) == plain


def test_debug_takes_a_bool():
    with pytest.raises(sbp.SbpError, match="takes a bool"):
        with sbp.debug("yes"):
            pass


# ---- the same on gloo (the 4-process pool is shared with the other gloo tests) ----------------------------

def _gloo_disagree(mesh: sbp.DeviceMesh) -> list:
    out = []
    try:   # free: rides on from_local's shape gather
        sbp.from_local(torch.ones(2, 2), mesh, "S(0), P(max)" if mesh.rank == 2 else "S(0), B")
    except sbp.RankMismatchError as e:
        out.append(str(e))
    x = sbp.distribute(torch.ones(4, 4), mesh, "S(0), S(1)")
    try:   # debug: the signature gather before the plan runs
        with sbp.debug():
            x.redistribute("B, B" if mesh.rank != 0 else "B, S(1)")
    except sbp.RankMismatchError as e:
        out.append(str(e))
    out.append(torch.equal(x.full(), torch.ones(4, 4)))      # the mesh still works afterwards
    return out


@pytest.mark.gloo
def test_gloo_ranks_that_disagree():
    for free, debug, ok in sbp.testing.spmd(_gloo_disagree, (2, 2), backend="gloo", timeout=60):
        assert free == ("from_local: ranks disagree on placements (every rank must pass the same; SPMD): "
                        "(S(0), B) on ranks [0, 1, 3]; (S(0), P(max)) on ranks [2]")
        assert debug == ("redistribute: ranks disagree on dst placements (every rank must pass the same; SPMD): "
                         "(B, S(1)) on ranks [0]; (B, B) on ranks [1, 2, 3]")
        assert ok
