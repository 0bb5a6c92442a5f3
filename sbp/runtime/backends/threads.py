"""In-process SPMD backend: every rank is a thread of this process, collectives meet at a rendezvous.

Each collective is one rendezvous slot keyed by (group, call number): every member deposits a copy of
what it sends, waits until all members have arrived, then takes copies of what is meant for it. The
call number counts the calls each rank made on that group, so ranks need no shared clock; a member that
never arrives (dead, or stuck elsewhere) makes the others raise `CommError` after `timeout` seconds,
naming the collective, the axes and the missing ranks. Reductions fold in member order, so every rank
computes bit-identical results.
"""
from __future__ import annotations

import contextvars
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...values.errors import CommError, MeshError, RankMismatchError
from ...values.mesh import DeviceMesh
from ..agreement import mismatch
from ..communicator import Counters, reduce_list
from ..pending import drain
from .base import BoundComm, Members, bound


@dataclass
class _Slot:
    what: str
    items: dict[int, Any] = field(default_factory=dict)
    readers: int = 0


class ThreadWorld:
    """The shared rendezvous of `size` thread-ranks; `abort` wakes every waiter with an error.

    >>> world = ThreadWorld(2, timeout=5.0)
    >>> mesh = world.bind(DeviceMesh((2,)), rank=0)
    >>> mesh.coord
    (0,)
    """

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict[tuple[Members, int], _Slot] = {}
        self._calls: dict[tuple[int, Members], int] = {}
        self._aborted: str | None = None

    def bind(self, mesh: DeviceMesh, rank: int, counters: Counters | None = None) -> DeviceMesh:
        """`mesh` bound to this world as seen by `rank` (which may lie outside the mesh)."""
        if any(r >= self.size for r in mesh.ranks):
            raise MeshError(f"mesh ranks {list(mesh.ranks)} do not fit a world of {self.size} thread-ranks "
                            f"(valid ranks: 0..{self.size - 1})")
        return bound(mesh, ThreadComm(self, mesh, rank, counters))

    def abort(self, reason: str) -> None:
        """Make every pending and future collective raise `CommError(reason)`."""
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()

    def meet(self, rank: int, members: Members, what: str, payload: Any) -> list[Any]:
        """Deposit `payload` for the call `what` on `members`; return every member's payload, member order."""
        key = tuple(sorted(members))
        deadline = time.monotonic() + self.timeout
        with self._cond:
            number = self._calls.get((rank, key), 0)
            self._calls[(rank, key)] = number + 1
            slot = self._slots.setdefault((key, number), _Slot(what))
            if slot.what != what:
                raise RankMismatchError(f"ranks disagree on collective #{number} of group {list(members)}: "
                                        f"rank {rank} calls {what}, another member called {slot.what}")
            slot.items[rank] = payload
            self._cond.notify_all()
            while len(slot.items) < len(members):
                left = deadline - time.monotonic()
                if self._aborted is not None:
                    raise CommError(f"{what} aborted: {self._aborted}")
                if left <= 0:
                    missing = sorted(set(members) - set(slot.items))
                    raise CommError(f"{what} timed out after {self.timeout:g} s on rank {rank}: group "
                                    f"{list(members)} is waiting for ranks {missing} (call #{number} on this group)")
                self._cond.wait(left)
            items = [slot.items[m] for m in members]
            slot.readers += 1
            if slot.readers == len(members):
                del self._slots[(key, number)]
        return items


class ThreadComm(BoundComm):
    """A thread-rank's communicator; payloads are copied in and out, so no rank sees another's memory."""

    backend = "threads"

    def __init__(self, world: ThreadWorld, mesh: DeviceMesh, rank: int, counters: Counters | None = None) -> None:
        super().__init__(mesh, rank, counters)
        self.world = world

    def _rebind(self, mesh: DeviceMesh) -> "ThreadComm":
        return ThreadComm(self.world, mesh, self.rank, self.counters)

    def bind(self, mesh: DeviceMesh) -> DeviceMesh:
        """Another mesh over the same world, bound for this rank (the threads spelling of `init_mesh`).

        >>> import sbp, sbp.testing
        >>> def fn(mesh):
        ...     sub = mesh.binding.bind(sbp.DeviceMesh((2,), ranks=(2, 3)))
        ...     return sub.coord
        >>> sbp.testing.spmd(fn, (4,))
        [None, None, (0,), (1,)]
        """
        return self.world.bind(mesh, self.rank, self.counters)

    def _meet(self, members: Members, axes: tuple[int, ...], what: str, payload: Any) -> list[Any]:
        what = f"{what} on axes {axes}{self.axis_names(axes)}"
        return _same_dtype(what, self.world.meet(self.rank, members, what, payload), members)

    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, members: Members, axes: tuple[int, ...]) -> None:
        items = self._meet(members, axes, "all_gather", t.clone())
        shapes = {tuple(x.shape) for x in items}
        if len(shapes) > 1:
            raise RankMismatchError(f"all_gather on axes {axes} needs equal shapes, members sent {sorted(shapes)}")
        k = t.numel()
        for i, x in enumerate(items):
            out[i * k:(i + 1) * k] = x.reshape(-1)

    def _reduce_scatter(self, stacked: torch.Tensor, members: Members, axes: tuple[int, ...],
                        op: str) -> torch.Tensor:
        items = self._meet(members, axes, f"reduce_scatter({op})", stacked.clone())
        index = members.index(self.rank)
        return reduce_list([x[index] for x in items], op)

    def _all_reduce(self, t: torch.Tensor, members: Members, axes: tuple[int, ...], op: str,
                    inplace: bool) -> torch.Tensor:
        items = self._meet(members, axes, f"all_reduce({op})", t.clone())
        return reduce_list(items, op)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: tuple[int, ...],
                    in_splits: tuple[int, ...], members: Members, axes: tuple[int, ...],
                    meanwhile: Any) -> None:
        if meanwhile is not None:
            meanwhile()
        items = self._meet(members, axes, "all_to_all", [p.clone() for p in inp.split(list(in_splits))])
        index = members.index(self.rank)
        for peer, (sent, piece) in enumerate(zip(items, out.split(list(out_splits)))):
            if sent[index].numel() != piece.numel():
                raise RankMismatchError(f"all_to_all on axes {axes}: rank {self.rank} expects {piece.numel()} "
                                        f"elements from rank {members[peer]}, which sent {sent[index].numel()}")
            piece.copy_(sent[index])

    def _exchange(self, ranks: Members, send: dict[int, list[torch.Tensor]], recv_shapes: dict[int, list[tuple]],
                  dtype: torch.dtype, device: torch.device) -> dict[int, list[torch.Tensor]]:
        payload = {peer: [t.clone() for t in pieces] for peer, pieces in send.items()}
        items = dict(zip(ranks, _same_dtype("exchange", self.world.meet(self.rank, ranks, "exchange", payload), ranks)))
        out = {}
        for peer, shapes in recv_shapes.items():
            pieces = items[peer].get(self.rank, [])
            if [tuple(t.shape) for t in pieces] != list(shapes):
                raise RankMismatchError(f"exchange: rank {self.rank} expects shapes {list(shapes)} from rank "
                                        f"{peer}, which sent {[tuple(t.shape) for t in pieces]}")
            out[peer] = [t.clone() for t in pieces]
        return out


def _same_dtype(what: str, items: list[Any], members: Members) -> list[Any]:
    """`items` (the members' payloads of one collective), unless members sent different dtypes: ranks that
    disagree on a tensor's dtype (an SPMD slip: torch.distributed would reinterpret the bytes or abort) raise
    a `RankMismatchError` naming them. A member that sent no tensor (an empty exchange) agrees with any."""
    dtypes = [_dtype_of(x) for x in items]
    if len({d for d in dtypes if d is not None}) > 1:
        raise mismatch(what, "dtype", dtypes, members)
    return items


def _dtype_of(payload: Any) -> "torch.dtype | None":
    if isinstance(payload, torch.Tensor):
        return payload.dtype
    values = payload.values() if isinstance(payload, dict) else payload if isinstance(payload, (list, tuple)) else ()
    return next((d for d in map(_dtype_of, values) if d is not None), None)


JOB_GRACE_S = 30.0   # a job may compute this long beyond the collective timeout before it counts as hung


FAILURE_GRACE_S = 5.0   # after a rank raised, how long the others may take to finish (a hung one is reported)


def spmd_threads(fn: Any, mesh: DeviceMesh,
                 timeout: float) -> tuple[list[Any], list[BaseException | None], list[int]]:
    """Run `fn(bound mesh)` on one thread per rank.

    Returns (results, exceptions) in rank order and the ranks that raised, in the order they raised. A
    rank still running `timeout` + `JOB_GRACE_S` seconds after the start is reported as hung (its thread
    is left behind: a daemon thread cannot be stopped).
    Each rank runs in a copy of the caller's context, so context variables (`sbp.debug()`) carry over.
    """
    world = ThreadWorld(mesh.size(), timeout)
    results: list[Any] = [None] * mesh.size()
    errors: list[BaseException | None] = [None] * mesh.size()
    order: list[int] = []

    def main(rank: int) -> None:
        try:
            bound_mesh = world.bind(mesh, rank)
            results[rank] = fn(bound_mesh)
            drain(bound_mesh.binding)   # async work fn issued finishes before the world ends with the run
        except BaseException as e:  # noqa: BLE001 - reported to the caller with the rank
            errors[rank] = e
            order.append(rank)
            world.abort(f"rank {rank} raised {type(e).__name__}")

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(main, r), name=f"sbp-rank-{r}",
                                daemon=True) for r in range(mesh.size())]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + JOB_GRACE_S   # as the gloo backend bounds a whole job
    while time.monotonic() < deadline:
        alive = next((t for t in threads if t.is_alive()), None)   # (one look: a thread may end between two)
        if alive is None:
            break
        if order:   # a rank raised: the others get a few seconds to see the abort and finish, not the timeout
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        alive.join(min(0.05, max(deadline - time.monotonic(), 0)))
    first = order[0] if order else None
    for rank, t in enumerate(threads):
        if t.is_alive():   # a rank that never returns (not in a collective): report it, free the others
            errors[rank] = CommError(
                f"rank {rank} did not finish within {timeout:g} s (+{JOB_GRACE_S:g} s)" if first is None else
                f"rank {rank} did not finish within {FAILURE_GRACE_S:g} s of rank {first}'s error")
            order.append(rank)
            world.abort(f"rank {rank} did not finish")
    world.abort("the spmd run of this mesh has ended and its thread-ranks with it: a global tensor that fn "
                "returned can run no collective (return x.full() or x.to_local() from fn instead)")
    return results, errors, order
