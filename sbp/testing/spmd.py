"""`spmd(fn, mesh_shape)`: run `fn(mesh)` on every rank of a fresh bound mesh and collect the results.

Two backends: ``"threads"`` (ranks are threads of this process; starts in microseconds; the default)
and ``"gloo"`` (one process per rank on 127.0.0.1, real torch.distributed). Gloo workers are started
once per world size (from a forkserver, see `_context`) and reused by later calls, so `fn` and its
results travel pickled: `fn` must be a module-level function (or a `functools.partial` of one).
The pool registry below is the one piece of module-level state in sbp: a process-lifetime resource
(like an open file), never a behaviour flag; it is shut down at exit. A pool is discarded (its
workers killed) when a run leaves a rank stuck in a collective, a worker died, or a collective
failed; an exception that every rank got past is harmless.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import pickle
import signal
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

from ..runtime.agreement import debug, is_enabled
from ..runtime.backends.dist import MAX_TIMEOUT_S, MIN_TIMEOUT_S, collective_failures, init_mesh
from ..runtime.backends.threads import spmd_threads
from ..values.errors import CommError, MeshError, SbpError
from ..values.mesh import LIVE_MESHES, DeviceMesh

BACKENDS = ("threads", "gloo")
FAILURE_GRACE_S = 0.5  # after one rank fails, how long to wait for the others' reports before giving up


class SpmdError(SbpError):
    """A rank of an `spmd` run raised; the message names the rank, the original is chained (`__cause__`).

    >>> import sbp, torch
    >>> try:
    ...     spmd(lambda mesh: sbp.distribute(torch.ones(4), mesh, "S(1)"), (2,))
    ... except SpmdError as e:
    ...     print(e.rank, type(e.__cause__).__name__, e)
    0 PlacementError rank 0 of 2 raised PlacementError: S(1) is out of range for a 1-d tensor (valid: -1..0)
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def spmd(fn: Callable[[DeviceMesh], Any], mesh_shape: "int | Sequence[int]", backend: str = "threads",
         names: Sequence[str] | None = None, timeout: float = 60.0) -> list[Any]:
    """Run `fn(mesh)` on every rank of a bound mesh of `mesh_shape`; return the results in rank order.

    A rank that raises makes the whole call raise `SpmdError` naming that rank and chaining its
    exception; the other ranks' pending collectives fail fast instead of waiting. `timeout` (seconds)
    bounds every collective.

    >>> import sbp, sbp.testing, torch
    >>> def fn(mesh):
    ...     return mesh.binding.all_reduce(torch.tensor([mesh.rank]), (0,), "sum").item()
    >>> spmd(fn, (4,))
    [6, 6, 6, 6]

    With ``backend="gloo"`` `fn` must live in an importable module (it travels pickled), and a script
    must keep its top-level code under ``if __name__ == "__main__":``: the gloo workers start from a
    fresh interpreter that imports the main module again.

    >>> spmd(fn, (4,), backend="gloo")     # doctest: +SKIP
    [6, 6, 6, 6]
    """
    if backend not in BACKENDS:
        raise SbpError(f"spmd backend must be one of {BACKENDS}, got {backend!r}")
    if not callable(fn):
        raise SbpError(f"spmd runs fn(mesh) on every rank; fn must be callable, got {type(fn).__name__}")
    least = MIN_TIMEOUT_S if backend == "gloo" else 0   # torch.distributed counts whole milliseconds
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S \
            or timeout < least:
        raise SbpError(f"spmd timeout must be a positive number of seconds, at most {MAX_TIMEOUT_S:g}"
                       + (f" and at least {least:g} on gloo" if least else "")
                       + f" (it bounds every collective), got {timeout!r}")
    mesh = DeviceMesh(mesh_shape, names)
    if backend == "threads":
        results, errors, order = spmd_threads(fn, mesh, timeout)
        if order:
            rank = _first_cause({r: (errors[r], "") for r in order}, fallback=order[0])
            raise SpmdError(f"rank {rank} of {mesh.size()} raised {type(errors[rank]).__name__}: {errors[rank]}",
                            rank) from errors[rank]
        return results
    try:
        payload = pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing
        raise SbpError(f"spmd(backend='gloo') sends fn to worker processes pickled, but {fn!r} cannot be "
                       f"pickled ({e}); use a module-level function") from e
    return _POOLS.run(payload, mesh, timeout)


def submesh(world: DeviceMesh, shape: "int | Sequence[int]", names: Sequence[str] | None = None, *,
            ranks: Sequence[int]) -> DeviceMesh:
    """A mesh over some ranks of `world`'s processes, bound like `world` (threads or gloo); every rank of
    `world` must call it, in the same order (on gloo it creates process groups).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda w: submesh(w, (2,), ranks=[3, 1]).coord, (4,))
    [None, (1,), None, (0,)]
    """
    if not isinstance(world, DeviceMesh):
        raise MeshError(f"submesh needs the bound world mesh that spmd passes to fn, got {type(world).__name__}")
    if world.binding is None:
        raise MeshError(f"submesh needs the bound world mesh that spmd passes to fn, got the pure value {world!r}")
    return world.binding.bind(DeviceMesh(shape, names, ranks, world.device_type))


# ---- gloo worker pool -----------------------------------------------------------------------------

class _RemoteError(Exception):
    """Stands in for a worker's exception that could not be pickled back."""


class _WorkerDied(CommError):
    """A gloo worker process ended without replying (`os._exit`, a crash, a kill): the root cause of the
    other ranks' broken collectives, not one of them. `exitcode` is the process's, None if unknown."""

    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.exitcode = exitcode
        self.status = _exit_status(exitcode)
        super().__init__(f"rank {rank}'s worker process died without replying ({self.status})")


class _Pool:
    """`size` worker processes joined in one gloo world through a TCPStore hosted by this process."""

    def __init__(self, size: int, timeout: float) -> None:
        import torch.distributed as dist  # only the gloo backend needs it

        self.size = size
        self.answered = False   # every worker has answered a call (not yet: a worker dying starts up)
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        ctx = _context()
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, size, self.store.port, theirs, timeout),
                               name=f"sbp-gloo-{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, payload: bytes, mesh: DeviceMesh,
            timeout: float) -> tuple[list[Any], dict[int, tuple], bool, bool]:
        """Send the job to every worker.

        Returns (results, {rank: (exception, traceback text)}, whether some rank never reported back, whether
        a rank saw a collective fail -- even one its function caught: gloo closes the group's connections).
        """
        for conn in self.conns:
            conn.send((payload, mesh.shape, mesh.names, timeout, is_enabled()))
        results: list[Any] = [None] * self.size
        errors: dict[int, tuple] = {}
        broken = False
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        deadline = time.monotonic() + timeout + 30.0  # worker start-up and group creation on top
        while pending:
            left = deadline - time.monotonic()
            if errors:
                left = min(left, FAILURE_GRACE_S)
            ready = wait(list(pending) + list(sentinels), timeout=max(left, 0))
            if not ready:
                if not errors:
                    for rank in pending.values():
                        errors[rank] = (CommError(f"rank {rank} did not finish within {timeout:g} s "
                                                  f"(+30 s start-up)"), "")
                break
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        status, *rest = obj.recv()
                    except (EOFError, ConnectionError):  # the worker died without a reply (a closed pipe stays
                        errors[rank] = self._died(rank)   # readable: it must leave `pending`, or `wait` spins on it)
                        continue
                    except Exception as e:  # noqa: BLE001 - a reply that does not unpickle here (its bytes
                        errors[rank] = (SbpError(  # are read: the pipe stays in step for the next call)
                            f"rank {rank}'s reply (its result, or the error it raised) cannot be unpickled in "
                            f"the calling process: {type(e).__name__}: {e}. Return plain values (tensors, "
                            f"numbers, lists; a global tensor as x.to_local() or x.full()) and raise errors "
                            f"that pickle"), "")
                        continue
                    broken |= rest[-1]
                    if status == "ok":
                        results[rank] = rest[0]
                    else:
                        errors[rank] = (rest[0], rest[1])
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = self.conns[rank]
                    if conn in pending and not conn.poll():  # else its reply (or EOF) is read above
                        del pending[conn]
                        errors[rank] = self._died(rank)
        return results, errors, bool(pending), broken

    def _died(self, rank: int) -> tuple[CommError, str]:
        proc = self.procs[rank]
        proc.join(timeout=1.0)  # a closed pipe can come a moment before the exit status
        return _WorkerDied(rank, proc.exitcode), ""

    def close(self, force: bool = False) -> None:
        """Stop the workers: politely (they leave their process group), or at once after a failure,
        when some may be stuck in a collective that will never complete."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            if force:
                proc.kill()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


def _exit_status(code: int | None) -> str:
    """`Process.exitcode` in words: a code, a signal (negative codes), or unknown (still exiting)."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _context() -> mp.context.BaseContext:
    """Workers come from a forkserver that imported torch once: a clean process (never a fork of the
    caller, which may hold threads), and four times faster to start than four `spawn`s importing torch
    each. Like `spawn`, it sends `fn` pickled and re-imports the caller's main module. Where there is no
    forkserver (Windows), plain `spawn`."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "sbp.runtime.backends.dist"])  # read only when the forkserver starts
    return ctx


class _Pools:
    """One reusable pool per world size; a pool whose run failed is closed and replaced next time."""

    def __init__(self) -> None:
        self._pools: dict[int, _Pool] = {}
        atexit.register(self.close_all)

    def run(self, payload: bytes, mesh: DeviceMesh, timeout: float) -> list[Any]:
        size = mesh.size()
        pool = self._pools.get(size)
        if pool is None:
            pool = self._pools[size] = _Pool(size, timeout)
        results, errors, stuck, broken = pool.run(payload, mesh, timeout)
        first_run = not pool.answered
        pool.answered |= not stuck
        if stuck or broken or any(isinstance(e, CommError) for e, _ in errors.values()):
            # a rank still inside a collective, or a failed or timed-out collective (even one the function
            # caught: gloo closes the group's connections): the pool is unusable
            del self._pools[size]
            pool.close(force=True)
        if not errors:
            return results
        rank = _first_cause(errors)
        exc, text = errors[rank]
        if isinstance(exc, _WorkerDied):
            message = f"rank {rank} of {size} died: its worker process ended without replying ({exc.status})"
            others = sorted(r for r in errors if r != rank)
            if others:  # knock-on failures (a broken collective), or their own: named, the first is chained
                message += f"; ranks {others} failed too"
            if exc.exitcode == -signal.SIGABRT:   # gloo's own check of a message's size failed
                message += ("; gloo aborts a process whose collective receives another size than it expects: "
                            "ranks that disagree (shapes, placements, dtypes, calls; run under sbp.debug() to have "
                            "them named)")
            elif first_run and exc.exitcode == 1:   # an exception ended it (a signal or os._exit: not this)
                message += ("; the workers start by importing the calling script as __main__ (multiprocessing's "
                            "forkserver or spawn): a script that calls spmd(..., backend=\"gloo\") at its top level "
                            "needs an `if __name__ == \"__main__\":` guard, or each worker runs it again and dies")
        else:
            message = f"rank {rank} of {size} raised {type(exc).__name__}: {exc}"
        if text:
            message += f"\n--- traceback on rank {rank} ---\n{text}"
        raise SpmdError(message, rank) from exc

    def close_all(self) -> None:
        while self._pools:
            _, pool = self._pools.popitem()
            pool.close()


def _first_cause(errors: dict[int, tuple], fallback: int | None = None) -> int:
    """The rank to blame: the lowest one whose worker process died (the others' collectives broke
    because of it, and may surface as any exception, e.g. a raw torch.distributed error); else the lowest
    one whose error is not a CommError (those are usually knock-on); else `fallback` (the first to fail)
    or the lowest rank."""
    dead = [r for r, (e, _) in errors.items() if isinstance(e, _WorkerDied)]
    if dead:
        return min(dead)
    own = [r for r, (e, _) in errors.items() if not isinstance(e, CommError)]
    if own:
        return min(own)
    return min(errors) if fallback is None else fallback


_POOLS = _Pools()


START_S = 60.0   # the least time a worker waits for the others to join the world (they may start slowly)


def _worker(rank: int, size: int, port: int, conn: Connection, timeout: float) -> None:
    """Worker main loop: join the gloo world, then run jobs until told to stop (None)."""
    import torch
    import torch.distributed as dist


    torch.set_num_threads(1)  # several ranks share the cores
    delta = timedelta(seconds=max(timeout, START_S))   # joining the world is no collective of the job's
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=delta)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=delta)
    meshes: dict[tuple, DeviceMesh] = {}
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        payload, shape, names, job_timeout, debug_checks = job
        failures = collective_failures()
        try:
            fn = pickle.loads(payload)
            key = (shape, names, job_timeout)
            if key not in meshes:
                meshes[key] = init_mesh(shape, names, device_type="cpu", timeout=job_timeout)
            mesh = meshes[key]
            LIVE_MESHES.remember(mesh, per_thread=False)   # this job's mesh is the one torch.load binds to (an
            mesh.binding.counters.reset()                   # earlier job's, of another timeout, may be newer)
            with debug(debug_checks):  # the caller's sbp.debug() setting travels with the job
                reply = ("ok", fn(mesh))
        except BaseException as e:  # noqa: BLE001 - sent back to the parent with the rank
            reply = ("err", e, traceback.format_exc())
        broken = collective_failures() != failures
        try:
            conn.send((*reply, broken))
        except Exception as e:  # noqa: BLE001 - the result or the exception did not pickle
            text = reply[2] if reply[0] == "err" else ""
            conn.send(("err", _RemoteError(f"could not send the result back: {e}"), text, broken))
    dist.destroy_process_group()
