"""A rank that stalls or exits in the middle of a redistribution: the others fail within the timeout with
a `CommError` naming the collective and the mesh axis, instead of hanging.

The redistribution used is ``(P(sum), S(0)) -> (B, B)`` on a 2x2 mesh named ("dp", "tp"): step 1 is an
all_reduce over 'dp', step 2 an all_gather over 'tp'. Rank 3 takes part in step 1, then stalls (or exits)
in step 2, so only rank 2 -- its 'tp' partner -- is left waiting; ranks 0 and 1 finish. (The threads
case of a rank that leaves early uses a one-step plan, so exactly one group is left waiting.) A plain
"never joins" dead rank on gloo is covered in tests/runtime/test_execute_gloo.py.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import time

import pytest
import torch

import sbp
import sbp.testing

NAMES = ("dp", "tp")
PLAN = ("P(sum), S(0)", "B, B")


def _misbehave_in_all_gather(comm, *, stall_s: float = 0.0, exit_code: int | None = None) -> None:
    """Make this rank's communicator stall (or its process exit) when the plan reaches its all_gather."""
    real = comm.all_gather

    def all_gather(*args, **kwargs):
        if exit_code is not None:
            os._exit(exit_code)
        time.sleep(stall_s)
        return real(*args, **kwargs)

    comm.all_gather = all_gather  # an instance attribute shadows the method for this rank only


def test_the_plan_is_all_reduce_over_dp_then_all_gather_over_tp():
    steps = sbp.plan((8, 8), (2, 2), *PLAN).steps
    assert [(s.kind, s.axes) for s in steps] == [("all_reduce", (0,)), ("all_gather", (1,))]


# ---- threads backend ------------------------------------------------------------------------------------

def _threads_stall(mesh, seen: dict):
    x = sbp.distribute(torch.ones(8, 8), mesh, PLAN[0])
    if mesh.rank == 3:
        _misbehave_in_all_gather(mesh.binding, stall_s=1.0)
    start = time.monotonic()
    try:
        return x.redistribute(PLAN[1]).to_local().sum().item()
    except sbp.CommError as e:
        seen[mesh.rank] = (str(e), time.monotonic() - start)
        raise


def test_threads_stall_mid_redistribution_names_collective_and_axis():
    seen: dict = {}
    with pytest.raises(sbp.testing.SpmdError) as info:
        sbp.testing.spmd(functools.partial(_threads_stall, seen=seen), (2, 2), names=NAMES, timeout=0.3)
    assert isinstance(info.value.__cause__, sbp.CommError)
    message, elapsed = seen[2]
    assert message == ("all_gather on axes (1,) ('tp') timed out after 0.3 s on rank 2: group [2, 3] is waiting "
                       "for ranks [3] (call #0 on this group)")
    assert elapsed < 1.0        # within the timeout, not after the stalled rank wakes up
    assert 0 not in seen and 1 not in seen   # the other 'tp' group finished


def _threads_exit(mesh, seen: dict):
    x = sbp.distribute(torch.ones(8, 8), mesh, "B, S(0)")
    if mesh.rank == 1:
        return "left early"     # this rank's thread ends: it never joins the redistribution
    try:
        return x.redistribute("B, B").to_local().sum().item()   # one all_gather over 'tp'
    except sbp.CommError as e:
        seen[mesh.rank] = str(e)
        raise


def test_threads_rank_that_exits_makes_its_partners_fail_not_hang():
    seen: dict = {}
    start = time.monotonic()
    with pytest.raises(sbp.testing.SpmdError) as info:
        sbp.testing.spmd(functools.partial(_threads_exit, seen=seen), (2, 2), names=NAMES, timeout=0.3)
    assert time.monotonic() - start < 5
    assert isinstance(info.value.__cause__, sbp.CommError)
    assert seen == {0: "all_gather on axes (1,) ('tp') timed out after 0.3 s on rank 0: group [0, 1] is waiting "
                       "for ranks [1] (call #0 on this group)"}   # ranks 2 and 3 ('tp' group [2, 3]) finished


# ---- gloo (real process groups; the failing runs discard their worker pool) -----------------------------

def _gloo_misbehave(mesh, outdir: str, exit_code: int | None):
    x = sbp.distribute(torch.ones(8, 8), mesh, PLAN[0])
    if mesh.rank == 3:
        _misbehave_in_all_gather(mesh.binding, stall_s=3.0, exit_code=exit_code)
    start = time.monotonic()
    try:
        x.redistribute(PLAN[1])
        result = ["ok", time.monotonic() - start]
    except sbp.CommError as e:
        result = [str(e), time.monotonic() - start]
    pathlib.Path(outdir, f"rank{mesh.rank}.json").write_text(json.dumps(result))
    if mesh.rank == 3 and result[0] != "ok":
        raise sbp.CommError(result[0])   # a failed run: spmd discards the pool's broken process groups
    return result


def _reports(outdir: pathlib.Path, ranks, wait_s: float = 10.0) -> dict[int, list]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all((outdir / f"rank{r}.json").exists() for r in ranks):
        time.sleep(0.05)
    return {r: json.loads((outdir / f"rank{r}.json").read_text()) for r in ranks}


@pytest.mark.gloo
def test_gloo_stall_mid_redistribution_names_collective_and_axis(tmp_path):
    with pytest.raises(sbp.testing.SpmdError):
        sbp.testing.spmd(functools.partial(_gloo_misbehave, outdir=str(tmp_path), exit_code=None), (2, 2),
                         backend="gloo", names=NAMES, timeout=1.5)
    seen = _reports(tmp_path, range(4))
    assert seen[0][0] == seen[1][0] == "ok"
    message, elapsed = seen[2]
    assert message.startswith("all_gather on mesh axes (1,) ('tp') (group ranks [2, 3]) failed on rank 2 "
                              "(timeout 0:00:01.500000): "), message
    assert elapsed < 3.0        # rank 2 gave up after its timeout, long before rank 3 woke up


@pytest.mark.gloo
def test_gloo_rank_that_exits_mid_redistribution(tmp_path):
    died = r"rank 3 of 4 died: its worker process ended without replying \(exit code 3\)"
    with pytest.raises(sbp.testing.SpmdError, match=died):
        sbp.testing.spmd(functools.partial(_gloo_misbehave, outdir=str(tmp_path), exit_code=3), (2, 2),
                         backend="gloo", names=NAMES, timeout=1.5)
    seen = _reports(tmp_path, range(3))
    assert seen[0][0] == seen[1][0] == "ok"
    assert seen[2][0].startswith("all_gather on mesh axes (1,) ('tp') (group ranks [2, 3]) failed on rank 2"), seen[2]
    assert seen[2][1] < 1.5 + 1.0
    # the pool was replaced: the next run works
    assert sbp.testing.spmd(_sum_of_ranks, (2, 2), backend="gloo", timeout=60) == [6, 6, 6, 6]


def _sum_of_ranks(mesh):
    return mesh.binding.all_reduce(torch.tensor([mesh.rank]), (0, 1), "sum").item()


# ---- gloo messages (exchanges run as isend/irecv on CPU) -------------------------------------------------

def _gloo_stall_in_exchange(mesh, outdir: str):
    """(S(0), S(0)) -> (S(1), S(1)) on 2x2 is one transfer over both axes, run as messages here; every rank
    receives a block from rank 3, which sends nothing for 3 s."""
    x = sbp.distribute(torch.ones(8, 8), mesh, "S(0), S(0)")
    comm = mesh.binding
    comm.exchange_route = "messages"   # column blocks: "auto" would take one all_to_all
    if mesh.rank == 3:
        real = comm.send_recv
        comm.send_recv = lambda *a, **k: (time.sleep(3.0), real(*a, **k))[1]
    start = time.monotonic()
    try:
        x.redistribute("S(1), S(1)")
        result = ["ok", time.monotonic() - start]
    except sbp.CommError as e:
        result = [str(e), time.monotonic() - start]
    finally:
        vars(comm).pop("send_recv", None)
        comm.exchange_route = "auto"
    pathlib.Path(outdir, f"rank{mesh.rank}.json").write_text(json.dumps(result))
    if result[0] != "ok":
        raise sbp.CommError(result[0])
    return result


@pytest.mark.gloo
def test_gloo_stall_in_point_to_point_exchange_is_an_error_within_the_timeout(tmp_path):
    steps = sbp.plan((8, 8), (2, 2), "S(0), S(0)", "S(1), S(1)").steps
    assert [(s.kind, s.axes) for s in steps] == [("transfer", (0, 1))]
    with pytest.raises(sbp.testing.SpmdError):
        sbp.testing.spmd(functools.partial(_gloo_stall_in_exchange, outdir=str(tmp_path)), (2, 2),
                         backend="gloo", names=NAMES, timeout=1.5)
    seen = _reports(tmp_path, range(3))
    for rank in range(3):       # every rank receives a block from rank 3
        message, elapsed = seen[rank]
        assert message.startswith("send_recv (to ranks ") and "on mesh axes (0, 1) ('dp', 'tp')" in message, message
        assert f"failed on rank {rank} (timeout 0:00:01.500000)" in message, message
        assert elapsed < 3.0, elapsed   # gave up after the timeout, before rank 3 woke up
    assert sbp.testing.spmd(_sum_of_ranks, (2, 2), backend="gloo", timeout=60) == [6, 6, 6, 6]


def _gloo_stall_in_cross_mesh_move(mesh, outdir: str):
    """A move onto a mesh over ranks 2, 3, between meshes made with a 1 s timeout in a world whose default
    group waits 60 s: rank 0 sends its block 3 s late. The move's point-to-point exchange runs on the
    default group; the meshes' timeout must bound it."""
    fast = sbp.init_mesh(mesh.shape, NAMES, device_type="cpu", timeout=1.0)
    target = sbp.init_mesh((2,), ranks=[2, 3], device_type="cpu", timeout=1.0)
    x = sbp.distribute(torch.arange(32.0).view(8, 4), fast, "S(0), S(1)")
    comm = fast.binding
    if mesh.rank == 0:
        real = comm._exchange
        comm._exchange = lambda *a, **k: (time.sleep(3.0), real(*a, **k))[1]
    start = time.monotonic()
    try:
        x.redistribute("S(0)", mesh=target)
        result = ["ok", time.monotonic() - start]
    except sbp.CommError as e:
        result = [str(e), time.monotonic() - start]
    pathlib.Path(outdir, f"rank{mesh.rank}.json").write_text(json.dumps(result))
    if result[0] != "ok":
        raise sbp.CommError(result[0])
    return result


@pytest.mark.gloo
def test_gloo_stall_in_a_cross_mesh_move_is_an_error_within_the_timeout(tmp_path):
    with pytest.raises(sbp.testing.SpmdError):
        sbp.testing.spmd(functools.partial(_gloo_stall_in_cross_mesh_move, outdir=str(tmp_path)), (2, 2),
                         backend="gloo", names=NAMES, timeout=60)
    seen = _reports(tmp_path, range(1, 4))
    stalled = [rank for rank in (2, 3) if seen[rank][0] != "ok"]
    assert stalled, seen            # ranks 2 and 3 receive rank 0's rows
    for rank in stalled:
        message, elapsed = seen[rank]
        assert message.startswith("exchange on mesh axes ()") and "(timeout 0:00:01)" in message, message
        assert elapsed < 3.0, elapsed   # gave up after the meshes' timeout, before rank 0 woke up
    assert sbp.testing.spmd(_sum_of_ranks, (2, 2), backend="gloo", timeout=60) == [6, 6, 6, 6]


def test_threads_rank_that_never_returns_is_reported(monkeypatch):
    """A rank stuck outside any collective: spmd reports it after timeout + the job grace instead of
    waiting forever (the gloo backend bounds a job the same way)."""
    import threading

    import sbp.runtime.backends.threads as threads

    monkeypatch.setattr(threads, "JOB_GRACE_S", 0.5)
    release = threading.Event()

    def fn(mesh):
        if mesh.rank == 1:
            release.wait(30)      # hung, until the test lets it go
        return mesh.rank

    try:
        with pytest.raises(sbp.testing.SpmdError, match=r"rank 1 of 2 raised CommError: rank 1 did not finish "
                                                         r"within 0.5 s \(\+0.5 s\)"):
            sbp.testing.spmd(fn, (2,), timeout=0.5)
    finally:
        release.set()


def _fails_while_one_rank_sleeps(mesh):
    if mesh.coord == (1,):
        time.sleep(20)   # never reaches the collective within the test (a daemon thread, left to finish)
    return mesh.binding.all_reduce(torch.ones(1), (0,), "sum").item()


def test_threads_stop_waiting_for_a_busy_rank_soon_after_another_fails():
    # before: rank 0 failed at 1 s, but spmd waited for rank 1 until the timeout plus the 30 s job grace
    from sbp.runtime.backends.threads import FAILURE_GRACE_S, spmd_threads
    _, errors, order = spmd_threads(_fails_while_one_rank_sleeps, sbp.DeviceMesh((2,)), timeout=1)
    assert order == [0, 1]
    assert isinstance(errors[0], sbp.CommError)
    assert f"did not finish within {FAILURE_GRACE_S:g} s of rank 0's error" in str(errors[1])
