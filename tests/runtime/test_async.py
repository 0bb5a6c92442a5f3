"""Asynchronous redistribution (`x.redistribute(..., async_op=True)`, `x.wait()`, `sbp.runtime.pending`):
results equal the synchronous ones, the call returns before its collectives ran, queued and synchronous
collectives keep one order per rank, backward is asynchronous too; on threads and on 4 gloo processes."""
from __future__ import annotations

import functools
import threading

import pytest
import torch

import sbp
import sbp.testing
from sbp.runtime import pending
from sbp.runtime.pending import PendingTensor, is_pending

PAIRS = [("S(0)", "B"), ("S(1)", "S(0)"), ("P(sum)", "S(0)"), ("P(max)", "B"), ("B", "S(1)"), ("S(0)", "P(sum)")]


def _layouts_equal(mesh) -> list[bool]:
    """Every pair async == sync, with several moves in flight at once on the same group."""
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))   # thread ranks share torch's global RNG
    out = []
    xs = [sbp.distribute(full, mesh, src) for src, _ in PAIRS]
    if mesh.ndim == 1:
        for x, (src, _) in zip(xs, PAIRS):   # real Partial contributions, not zeros beside one value
            if src.startswith("P"):
                x.to_local().add_(0 if src == "P(max)" else mesh.coord[0] - (1.5 if mesh.coord[0] == 0 else 0.5))
    pending = [x.redistribute(dst, async_op=True) for x, (_, dst) in zip(xs, PAIRS)]  # all queued before any wait
    for x, y, (_, dst) in zip(xs, pending, PAIRS):
        want = x.redistribute(dst)   # a synchronous move after the queued ones: drains first, same order
        out.append(torch.equal(y.wait().to_local(), want.to_local()) and y.placements == want.placements)
        out.append(not isinstance(y.to_local(), PendingTensor))
    return out


def test_async_equals_sync_threads() -> None:
    for per_rank in sbp.testing.spmd(_layouts_equal, (4,)):
        assert all(per_rank), per_rank


def test_returns_before_the_collective_ran() -> None:
    """Rank 1 starts its part only after rank 0 got its result object back: the call did not block."""
    submitted = threading.Event()

    def fn(mesh):
        x = sbp.distribute(torch.arange(6.), mesh, "S(0)")
        if mesh.coord[0] == 1:
            assert submitted.wait(30)
        y = x.redistribute("B", async_op=True)
        before = is_pending(y._local) and not y._local.done()
        if mesh.coord[0] == 0:
            submitted.set()
        return before, (y + 1).full().tolist()   # first use waits

    results = sbp.testing.spmd(fn, (2,))
    assert results[0][0] is True
    assert all(r[1] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] for r in results)


def _backward(mesh, async_op: bool):
    # a generator of its own: thread ranks share torch's global one, and two ranks seeding and drawing from it at
    # once could lay out different "full" tensors (a flaky comparison)
    w = sbp.distribute(torch.randn(8, 3, generator=torch.Generator().manual_seed(1)), mesh, "S(0)", requires_grad=True)
    seen = []
    w.register_hook(lambda g: seen.append(is_pending(g._local)))   # what backward hands the leaf
    y = w.redistribute("B", async_op=async_op)
    loss = (y * y).sum() + y.sum(0).pow(3).sum()
    loss.backward()
    return w.grad.placements, w.grad.to_local().tolist(), seen


def test_backward_is_async_and_exact_threads() -> None:
    sync = sbp.testing.spmd(functools.partial(_backward, async_op=False), (2,))
    asyn = sbp.testing.spmd(functools.partial(_backward, async_op=True), (2,))
    assert [r[:2] for r in sync] == [r[:2] for r in asyn]
    assert all(r[2] == [True] for r in asyn) and all(r[2] == [False] for r in sync)


def test_error_surfaces_at_wait() -> None:
    """A collective that fails (a rank never arrives) raises its CommError where the result is waited for."""
    def fn(mesh):
        if mesh.coord[0] == 1:
            return None
        y = sbp.distribute(torch.arange(4.), mesh, "S(0)").redistribute("B", async_op=True)
        try:
            y.wait()
        except sbp.CommError as e:
            return "timed out" in str(e)
        return False

    assert sbp.testing.spmd(fn, (2,), timeout=0.5)[0] is True


def _writes_after_the_call(mesh):
    """Per move: whether `y` holds the value `x` had at the call, after writes into `x` made while each rank's
    queue was held (without the copy taken at the call the write always wins)."""
    full = torch.arange(12.).reshape(4, 3)
    out = []
    for dst, write in (("B", lambda x: x.mul_(0)), ("S(1)", lambda x: x.to_local().fill_(-1)),
                       ("P(sum)", lambda x: x.add_(5))):
        x = sbp.distribute(full, mesh, "S(0)")
        release = threading.Event()
        held = pending.submit(mesh.binding, lambda: (release.wait(30), torch.zeros(0))[1], (0,),
                              torch.float32, torch.device("cpu"))
        y = x.redistribute(dst, async_op=True)
        write(x)
        release.set()
        held.wait()
        out.append(torch.equal(y.full(), full))
    return out


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_writes_into_the_source_after_the_call_do_not_reach_the_result(backend) -> None:
    """The queue reads the source later than the call returns: a write into `x` (in place, or into its
    local) before the queue gets there must not reach `y`."""
    for per_rank in sbp.testing.spmd(_writes_after_the_call, (2,), backend=backend, timeout=60):
        assert per_rank == [True, True, True]


def _direct_after_queued(mesh):
    """Rank 0's queue is held for a moment; every rank queues an async move, then calls a collective directly
    on the binding (as a row move, a check or a cross-mesh exchange does): it must wait for the queued move."""
    if mesh.rank == 0:
        release = threading.Event()
        threading.Timer(0.3, release.set).start()
        pending.submit(mesh.binding, lambda: (release.wait(30), torch.zeros(0))[1], (0,), torch.float32,
                       torch.device("cpu"))
    y = sbp.distribute(torch.arange(4.), mesh, "S(0)").redistribute("B", async_op=True)
    total = mesh.binding.all_reduce(torch.ones(1), (0,), "sum")   # rank 0 made it first: a mismatch (or a hang)
    return total.item(), y.full().tolist()


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_direct_collectives_wait_for_queued_ones(backend) -> None:
    for total, y in sbp.testing.spmd(_direct_after_queued, (2,), backend=backend, timeout=30):
        assert total == 2.0 and y == [0.0, 1.0, 2.0, 3.0]


def _gloo_all(mesh):
    return _layouts_equal(mesh), _backward(mesh, True)[:2] == _backward(mesh, False)[:2]


@pytest.mark.gloo
def test_async_on_gloo() -> None:
    for layouts, backward in sbp.testing.spmd(_gloo_all, (4,), backend="gloo", timeout=60):
        assert all(layouts), layouts
        assert backward
