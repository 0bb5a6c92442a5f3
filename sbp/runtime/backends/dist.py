"""torch.distributed backend: `init_mesh` binds a mesh to process groups; collectives run on NCCL or gloo.

Process groups are created eagerly by `init_mesh`, one per group of every non-empty subset of mesh axes
(a 2x2 mesh: the 2 + 2 groups of each axis and the flattened group of both; 2**ndim - 1 subsets in all),
in one fixed order, by every rank of the world (also ranks outside the mesh: `new_group` is collective
over the default group). That keeps group creation deterministic without relying on
`use_local_synchronization` and leaves no lazily created group that some rank might create in another
order. They live on the binding (no module-level state) and are shared with sub-meshes.

Collectives used (all supported by gloo and NCCL in torch 2.13): `all_gather_single` /
`all_gather_into_tensor` and `reduce_scatter_single` / `reduce_scatter_tensor` (flat buffers),
`all_reduce` (SUM/MIN/MAX), `all_to_all_single` with per-peer split sizes, isend/irecv.

Where gloo is slow at something, the CPU route differs (measured, `docs/execution.md`):

- reduce_scatter runs as one `all_to_all_single` of the chunks and a local fold in member order (gloo's
  reduce_scatter costs about an all_reduce; the fold moves the same bytes in about 0.6 of the time);
- exchanges whose blocks are all runs of the local and of the result run as isend/irecv (`send_recv`)
  straight from one into the other, so a block for two peers is not packed twice
  (`sbp.runtime.buffers.messages_copy_nothing`).

On CUDA (NCCL) the collectives are the native ones and exchanges are one `all_to_all_single` (a batch
of point-to-point calls on NCCL needs every group member in its first call, which exchanges do not
promise). A failure or timeout becomes `sbp.CommError` naming the collective, the mesh axes and the group.
"""
from __future__ import annotations

import itertools
import os
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..communicator import Counters, Outgoing, reduce_list
from ...values.errors import CommError, MeshError
from ...values.mesh import DeviceMesh
from .base import BoundComm, Members, bound, outgoing_tensor

DEFAULT_TIMEOUT = timedelta(minutes=5)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# torch 2.13 renamed the *_into_tensor / *_tensor collectives; take the new names where they exist
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def init_mesh(shape: "int | Sequence[int]", names: Sequence[str] | None = None, *,
              ranks: Sequence[int] | None = None, device_type: str | None = None,
              timeout: "timedelta | float" = DEFAULT_TIMEOUT) -> DeviceMesh:
    """A `DeviceMesh` bound to torch.distributed; every rank of the world must call it, in the same order.

    Initialises the default process group from the torchrun environment (MASTER_ADDR, MASTER_PORT,
    RANK, WORLD_SIZE) when it is not initialised yet. `device_type` None picks "cuda" when available,
    else "cpu"; "cuda" uses NCCL, "cpu" gloo. Without `ranks` the mesh must cover the whole world;
    with `ranks` (row-major) other ranks get a mesh whose `coord` is None. `timeout` (a timedelta or
    seconds) bounds every collective on the mesh: a dead rank is an error, not a hang.

    Under ``torchrun --nproc-per-node 4``, on rank 3:

    >>> import sbp
    >>> mesh = sbp.init_mesh((2, 2), names=("dp", "tp"))      # doctest: +SKIP
    >>> mesh.coord, mesh["tp"].coord                         # doctest: +SKIP
    ((1, 1), (1,))
    """
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cpu", "cuda"):
        raise MeshError(f"device_type must be 'cpu' or 'cuda' (or None for automatic), got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise MeshError("init_mesh(device_type='cuda') needs CUDA, but torch.cuda.is_available() is False "
                        "in this process; use device_type='cpu' (gloo)")
    timeout = as_timeout(timeout)
    # a pure value first: bad shapes, names or ranks fail before any process group exists
    mesh = DeviceMesh(shape, names, ranks, device_type)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        _init_default(backend, device_type, timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks is None and mesh.size() != world:
        raise MeshError(f"mesh of shape {mesh.shape} has {mesh.size()} ranks but the world has {world} "
                        f"processes; pass ranks=[...] to put the mesh on part of the world")
    if max(mesh.ranks) >= world:
        raise MeshError(f"mesh ranks {list(mesh.ranks)} do not fit a world of {world} processes "
                        f"(valid ranks: 0..{world - 1})")
    groups = {}
    for axes in _axis_subsets(mesh.ndim):
        for members in mesh.groups(axes):
            key = tuple(sorted(members))
            if len(members) == 1 or key in groups:
                continue
            pg = dist.new_group(list(key), timeout=timeout, backend=backend)
            groups[key] = pg if rank in key else None
    return bound(mesh, DistComm(mesh, rank, {k: g for k, g in groups.items() if g is not None}, timeout))


def as_timeout(timeout: "timedelta | float") -> timedelta:
    """A collective timeout from a `timedelta` or seconds; it must be positive.

    >>> as_timeout(2.5)
    datetime.timedelta(seconds=2, microseconds=500000)
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise MeshError(f"timeout must be a datetime.timedelta or a number of seconds, got {timeout!r}")
    if not seconds > 0 or seconds == float("inf"):
        raise MeshError(f"timeout must be a positive, finite duration (collectives fail after it), got {timeout!r}")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def init_device_mesh(device_type: str, mesh_shape: Sequence[int],
                     mesh_dim_names: Sequence[str] | None = None, *,
                     timeout: "timedelta | float" = DEFAULT_TIMEOUT) -> DeviceMesh:
    """The DTensor spelling of `init_mesh`.

    >>> import sbp
    >>> mesh = sbp.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))   # doctest: +SKIP
    """
    return init_mesh(mesh_shape, mesh_dim_names, device_type=device_type, timeout=timeout)


def _init_default(backend: str, device_type: str, timeout: timedelta) -> None:
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise MeshError(f"torch.distributed is not initialised and the environment lacks {', '.join(missing)}; "
                        f"launch with torchrun (or set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), or call "
                        f"torch.distributed.init_process_group first")
    if device_type == "cuda":
        rank = int(os.environ["RANK"])
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(backend, init_method="env://", timeout=timeout)


def _axis_subsets(ndim: int) -> list[tuple[int, ...]]:
    """Every non-empty subset of axes, singletons first (a fixed order every rank follows)."""
    return [s for k in range(1, ndim + 1) for s in itertools.combinations(range(ndim), k)]


class DistComm(BoundComm):
    """A rank's communicator over torch.distributed process groups (one per flattened axis set)."""

    backend = "dist"

    def __init__(self, mesh: DeviceMesh, rank: int, groups: dict[Members, dist.ProcessGroup],
                 timeout: timedelta, counters: Counters | None = None) -> None:
        super().__init__(mesh, rank, counters)
        self.timeout = timeout
        self._groups = groups
        self._orders: dict[Members, list[int] | None] = {}
        self._gloo = mesh.device_type == "cpu"
        self.exchange_route = "auto" if self._gloo else "all_to_all"

    def _rebind(self, mesh: DeviceMesh) -> "DistComm":
        return DistComm(mesh, self.rank, self._groups, self.timeout, self.counters)

    def bind(self, mesh: DeviceMesh) -> DeviceMesh:
        """Another mesh over the same world (`init_mesh` with this mesh's timeout; every rank calls it)."""
        return init_mesh(mesh.shape, mesh.names, ranks=mesh.ranks, device_type=mesh.device_type, timeout=self.timeout)

    def _group(self, members: Members) -> tuple[dist.ProcessGroup, list[int] | None]:
        """The process group of `members` and, per group rank, the member index it is; None for that
        order when it is the member order itself (flat buffers then need no reordering)."""
        pg = self._groups.get(tuple(sorted(members)))
        if pg is None:
            raise CommError(f"no process group for ranks {list(members)} on rank {self.rank}; was the mesh "
                            f"made by sbp.init_mesh on every rank?")
        if members not in self._orders:
            order = [members.index(r) for r in dist.get_process_group_ranks(pg)]
            self._orders[members] = None if order == sorted(order) else order
        return pg, self._orders[members]

    def _call(self, what: str, axes: tuple[int, ...], members: Members, t: torch.Tensor,
              fn: Callable[[], object], meanwhile: Callable[[], object] | None = None) -> None:
        """Make the torch.distributed call `fn` (if it returns a `Work`, wait for it after `meanwhile`: local
        work that touches none of the call's buffers and so runs while the call is in flight)."""
        self._check_device(what, axes, t)
        work = self._guarded(what, axes, members, fn)
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            if work is not None:
                self._guarded(what, axes, members, work.wait)

    def _check_device(self, what: str, axes: tuple[int, ...], t: torch.Tensor) -> None:
        if t.device.type != self.mesh.device_type:
            raise CommError(f"{what} on mesh axes {axes}{self.axis_names(axes)}: tensor is on {t.device} but the "
                            f"mesh is a {self.mesh.device_type!r} mesh; move the local tensor to the mesh's device")

    def _guarded(self, what: str, axes: tuple[int, ...], members: Members, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except (RuntimeError, ValueError, TypeError, dist.DistError) as e:
            names = self.axis_names(axes)
            raise CommError(f"{what} on mesh axes {axes}{names} (group ranks {list(members)}) failed on rank "
                            f"{self.rank} (timeout {self.timeout}): {e}") from e

    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, members: Members, axes: tuple[int, ...]) -> None:
        pg, order = self._group(members)
        flat = t.reshape(-1)
        got = out if order is None else torch.empty_like(out)  # gloo takes no stacked output
        self._call("all_gather", axes, members, t, lambda: _all_gather_flat(got, flat, group=pg))
        if order is not None:
            k = flat.numel()
            for g, m in enumerate(order):
                out[m * k:(m + 1) * k] = got[g * k:(g + 1) * k]

    def _reduce_scatter(self, stacked: torch.Tensor, members: Members, axes: tuple[int, ...],
                        op: str) -> torch.Tensor:
        if self._gloo:   # by one all_to_all and a fold (see the module notes)
            flat = stacked.reshape(-1)
            out, _ = self._reduce_scatter_runs(flat, (flat.numel() // len(members),) * len(members), members,
                                               axes, op)
            return out.view(stacked.shape[1:])
        pg, order = self._group(members)
        inp = stacked.reshape(-1) if order is None else stacked[order].reshape(-1)
        out = stacked.new_empty(stacked.shape[1:])
        self._call(f"reduce_scatter({op})", axes, members, inp,
                   lambda: _reduce_scatter_flat(out.view(-1), inp, op=_REDUCE_OPS[op], group=pg))
        return out

    def _reduce_scatter_runs(self, flat: torch.Tensor, numels: tuple[int, ...], members: Members,
                             axes: tuple[int, ...], op: str) -> tuple[torch.Tensor, int]:
        """gloo: the runs as they are (no padding) by one all_to_all, then folded in member order (as the
        threads backend folds, so both give bit-identical results); NCCL: padded."""
        if not self._gloo:
            return super()._reduce_scatter_runs(flat, numels, members, axes, op)
        n, mine = len(members), numels[members.index(self.rank)]
        got = flat.new_empty((n, mine))
        self._all_to_all(got.view(-1), flat, (mine,) * n, numels, members, axes, None,
                         what=f"reduce_scatter({op})")
        return reduce_list(got.unbind(0), op), mine

    def _all_reduce(self, t: torch.Tensor, members: Members, axes: tuple[int, ...], op: str,
                    inplace: bool) -> torch.Tensor:
        pg, _ = self._group(members)
        out = t if inplace else t.clone()
        self._call(f"all_reduce({op})", axes, members, out,
                   lambda: dist.all_reduce(out, op=_REDUCE_OPS[op], group=pg))
        return out

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: tuple[int, ...],
                    in_splits: tuple[int, ...], members: Members, axes: tuple[int, ...],
                    meanwhile: Callable[[], object] | None, what: str = "all_to_all") -> None:
        pg, order = self._group(members)
        if order is None:
            self._call(what, axes, members, inp, lambda: dist.all_to_all_single(
                out, inp, list(out_splits), list(in_splits), group=pg, async_op=meanwhile is not None), meanwhile)
            return
        # group rank g is member order[g]: send and receive runs in group order, then back to member order
        pieces = inp.split(list(in_splits))
        send = torch.cat([pieces[m] for m in order])
        got = torch.empty_like(out)
        out_g, in_g = [out_splits[m] for m in order], [in_splits[m] for m in order]
        self._call(what, axes, members, send,
                   lambda: dist.all_to_all_single(got, send, out_g, in_g, group=pg), meanwhile)
        where = dict(zip(order, got.split(out_g)))
        for m, piece in zip(range(len(members)), out.split(list(out_splits))):
            piece.copy_(where[m])

    def _send_recv(self, sends: list[tuple[int, Outgoing]], recvs: list[tuple[int, torch.Tensor]],
                   members: Members, axes: tuple[int, ...],
                   meanwhile: Callable[[], object] | None) -> list[torch.Tensor]:
        """gloo: isend/irecv on the group's process group, receives posted first; every wait is bounded by
        the mesh's timeout. NCCL: one all_to_all_single (see the module notes)."""
        if not self._gloo:
            return super()._send_recv(sends, recvs, members, axes, meanwhile)
        pg, _ = self._group(members)
        what = f"send_recv (to ranks {[members[i] for i, _ in sends]}, from ranks {[members[i] for i, _ in recvs]})"
        works, sent = [], []

        def post() -> None:
            for i, buf in recvs:
                self._check_device("send_recv", axes, buf)
                works.append(dist.irecv(buf, src=members[i], group=pg))
            for i, t in sends:
                t = outgoing_tensor(t)
                self._check_device("send_recv", axes, t)
                sent.append(t)  # kept alive until its send is waited for
                works.append(dist.isend(t, dst=members[i], group=pg))

        self._guarded(what, axes, members, post)
        try:
            if meanwhile is not None:
                meanwhile()
        finally:
            for work in works:
                self._guarded(what, axes, members, lambda: work.wait(self.timeout))
        return sent

    def _exchange(self, ranks: Members, send: dict[int, list[torch.Tensor]], recv_shapes: dict[int, list[tuple]],
                  dtype: torch.dtype, device: torch.device) -> dict[int, list[torch.Tensor]]:
        """Batched isend/irecv on the default group: one flat buffer per peer, empty ones skipped (both
        sides know every size, so they skip the same ones)."""
        ops, inbox = [], {}
        for peer in sorted(send):
            pieces = [t.reshape(-1) for t in send[peer]]
            if sum(t.numel() for t in pieces):
                ops.append(dist.P2POp(dist.isend, torch.cat(pieces), peer))
        for peer in sorted(recv_shapes):
            sizes = [int(torch.Size(s).numel()) for s in recv_shapes[peer]]
            inbox[peer] = torch.empty(sum(sizes), dtype=dtype, device=device)
            if sum(sizes):
                ops.append(dist.P2POp(dist.irecv, inbox[peer], peer))

        def run() -> None:   # bounded by this mesh's timeout, not the default group's
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait(self.timeout)

        self._call("exchange", (), tuple(ranks), next(iter(inbox.values()), torch.empty(0, device=device)), run)
        out = {}
        for peer, shapes in recv_shapes.items():
            sizes = [int(torch.Size(s).numel()) for s in shapes]
            out[peer] = [piece.view(s) for piece, s in zip(inbox[peer].split(sizes), shapes)]
        return out
