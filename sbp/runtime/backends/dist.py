"""torch.distributed backend: `init_mesh` binds a mesh to process groups; collectives run on NCCL or gloo.

Process groups are created eagerly by `init_mesh`, one per group of every non-empty subset of mesh axes
(a 2x2 mesh: the 2 + 2 groups of each axis and the flattened group of both; 2**ndim - 1 subsets in all),
in one fixed order, by every rank of the world (also ranks outside the mesh: `new_group` is collective
over the default group). That keeps group creation deterministic without relying on
`use_local_synchronization` and leaves no lazily created group that some rank might create in another
order. They live on the binding and are shared with sub-meshes; `PROCESS_GROUPS` caches them per
process by (ranks, backend, timeout), so binding the same ranks again makes no duplicate, and binding a
mesh also makes the group over its ranks and those of each mesh bound before it, on which cross-mesh
moves run (one `all_to_all_single` every member takes part in).

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

from ...values.errors import CommError, MeshError
from ...values.mesh import DeviceMesh
from ..communicator import Counters, Outgoing, from_reducible, reduce_list, to_reducible
from .base import BoundComm, Members, bound, outgoing_tensor

DEFAULT_TIMEOUT = timedelta(minutes=5)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# dtypes both gloo and NCCL carry and reduce (complex travels as real pairs: torch views it so itself, except
# in reduce_scatter); moves of others (int16) travel as their bytes, reductions of them in int32
WIRE_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool})
# torch 2.13 renamed the *_into_tensor / *_tensor collectives; take the new names where they exist
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


_FAILURES = [0]   # collectives that failed or timed out in this process: their process groups may be unusable


def collective_failures() -> int:
    """How many collectives of this process have failed or timed out (each raised `CommError`), caught or
    not. A gloo group whose collective timed out has closed its connections: a runner reusing the process
    (`sbp.testing.spmd`'s gloo workers) starts afresh when the count moved.

    >>> collective_failures() >= 0
    True
    """
    return _FAILURES[0]


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
    backend = _backend(device_type)
    if not dist.is_initialized():
        _init_default(backend, device_type, timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device_type == "cuda":   # also when the caller initialised torch.distributed without set_device
        select_cuda_device(rank)
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
            groups[key] = PROCESS_GROUPS.get(key, backend, timeout)
    PROCESS_GROUPS.add_mesh(mesh.ranks, backend, timeout)   # and the groups a cross-mesh move with it runs on
    return bound(mesh, DistComm(mesh, rank, {k: g for k, g in groups.items() if g is not None}, timeout))


MIN_TIMEOUT_S = 1e-3   # torch.distributed rounds a timeout down to whole milliseconds: less is none at all
MAX_TIMEOUT_S = 1e8   # about three years: longer waits overflow the clocks that time them (timedelta, time_t)


def as_timeout(timeout: "timedelta | float") -> timedelta:
    """A collective timeout from a `timedelta` or seconds; it must be positive.

    >>> as_timeout(2.5)
    datetime.timedelta(seconds=2, microseconds=500000)
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout) if not isinstance(timeout, int) or abs(timeout) < 2 ** 53 else float("inf")
    else:
        raise MeshError(f"timeout must be a datetime.timedelta or a number of seconds, got {timeout!r}")
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise MeshError(f"timeout must be a positive, finite duration of at least {MIN_TIMEOUT_S:g} s (torch."
                        f"distributed counts whole milliseconds) and at most {MAX_TIMEOUT_S:g} s (collectives fail "
                        f"after it), got {timeout!r}")
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
    numbers = {k: os.environ[k] for k in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    bad = {k: v for k, v in numbers.items() if not v.strip().isdigit()}
    if bad or not int(numbers["RANK"]) < int(numbers["WORLD_SIZE"]):
        raise MeshError("the torchrun environment is inconsistent: "
                        + (", ".join(f"{k}={v!r} is not a non-negative int" for k, v in bad.items()) if bad else
                           f"RANK={numbers['RANK']} is not below WORLD_SIZE={numbers['WORLD_SIZE']}")
                        + " (launch with torchrun, which sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)")
    if device_type == "cuda":
        select_cuda_device(int(os.environ["RANK"]))
    dist.init_process_group(backend, init_method="env://", timeout=timeout)


def select_cuda_device(rank: int) -> torch.device:
    """Make this process's current CUDA device the one of its rank on the node, as DTensor does: LOCAL_RANK
    when the launcher set it, else ``rank % torch.cuda.device_count()``. Without it a world initialised
    by the caller (no ``torch.cuda.set_device``) puts every rank on cuda:0.

    >>> select_cuda_device(0)          # doctest: +SKIP
    device(type='cuda', index=0)
    """
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local is not None else rank % torch.cuda.device_count()
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


class ProcessGroups:
    """The process groups this process has made, keyed by (sorted members, backend, timeout), so `bind()`,
    DTensor interop and another `init_mesh` over ranks already grouped reuse the group (every NCCL
    communicator costs GPU memory) instead of making a duplicate.

    Every group is made by every rank of the world, in the same order (`init_mesh` is called so), so every
    rank's cache holds the same keys (a rank outside a group keeps None). For cross-mesh moves, whose
    other ranks take no part, binding a mesh also makes the group over its ranks together with the ranks
    of each mesh bound before it (same backend): a move between any two bound meshes then has a group
    where every member takes part. (``use_local_synchronization`` groups, made by the members alone, are
    not used: torch names them after the number of groups each rank knows, which differs between ranks
    inside and outside earlier groups.) Forgotten when the default group changes.

    >>> ProcessGroups().clear()
    """

    def __init__(self) -> None:
        self._world: object = None
        self._groups: dict[tuple, "dist.ProcessGroup | None"] = {}
        self._meshes: list[tuple[Members, str]] = []   # rank sets of the meshes bound so far, in order
        self.made = 0   # groups this cache created (tests count them)

    def clear(self) -> None:
        """Forget every group (they stay valid in torch.distributed)."""
        self._groups.clear()
        self._meshes.clear()
        self._world = None

    def _check_world(self) -> None:
        if dist.group.WORLD is not self._world:
            self.clear()
            self._world = dist.group.WORLD

    def get(self, members: Members, backend: str, timeout: timedelta) -> "dist.ProcessGroup | None":
        """The group of the sorted `members`, made on first use; None on a rank outside it. Every rank of
        the world calls it, in the same order."""
        self._check_world()
        key = (tuple(sorted(members)), backend, timeout)
        if key not in self._groups:
            try:
                pg = dist.new_group(list(key[0]), timeout=timeout, backend=backend)
            except dist.DistError as e:   # its rendezvous through the store timed out, or the store is gone
                raise CommError(f"could not create the {backend} process group of ranks {list(key[0])} "
                                f"(timeout {timeout.total_seconds():g} s): {type(e).__name__}: {e}") from e
            self.made += 1
            self._groups[key] = pg if dist.get_rank() in key[0] else None
        return self._groups[key]

    def find(self, members: Members, backend: str) -> "dist.ProcessGroup | None":
        """A group over exactly `members` on `backend` (any timeout), or None."""
        self._check_world()
        key = tuple(sorted(members))
        return next((g for (m, b, _), g in self._groups.items() if m == key and b == backend and g is not None),
                    None)

    def add_mesh(self, ranks: Sequence[int], backend: str, timeout: timedelta) -> None:
        """Note a bound mesh's ranks and make the union groups with every mesh bound before (world-collective)."""
        self._check_world()
        mine = tuple(sorted(ranks))
        for other, other_backend in list(self._meshes):
            union = tuple(sorted(set(mine) | set(other)))
            if other_backend == backend and len(union) > 1 and \
                    not any(m == union and b == backend for m, b, _ in self._groups):
                self.get(union, backend, timeout)
        if (mine, backend) not in self._meshes:
            self._meshes.append((mine, backend))


PROCESS_GROUPS = ProcessGroups()   # process groups are process-wide in torch.distributed; this is their cache


def _axis_subsets(ndim: int) -> list[tuple[int, ...]]:
    """Every non-empty subset of axes, singletons first (a fixed order every rank follows)."""
    return [s for k in range(1, ndim + 1) for s in itertools.combinations(range(ndim), k)]


class DistComm(BoundComm):
    """A rank's communicator over torch.distributed process groups (one per flattened axis set)."""

    backend = "dist"

    def __init__(self, mesh: DeviceMesh, rank: int, groups: dict[Members, dist.ProcessGroup],
                 timeout: timedelta, counters: Counters | None = None, device: torch.device | None = None) -> None:
        super().__init__(mesh, rank, counters)
        self.timeout = timeout
        # the one device every tensor handed to a collective must be on: type *and* index
        self.device = device if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu"))
        self._groups = groups
        self._orders: dict[Members, list[int] | None] = {}
        self._gloo = mesh.device_type == "cpu"
        self.exchange_route = "auto" if self._gloo else "all_to_all"

    def _rebind(self, mesh: DeviceMesh) -> "DistComm":
        return DistComm(mesh, self.rank, self._groups, self.timeout, self.counters, self.device)

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
        if t.device != self.device:   # the index too: a tensor on another GPU of the node is refused
            raise CommError(f"{what} on mesh axes {axes}{self.axis_names(axes)}: tensor is on {t.device} but this "
                            f"rank's mesh device is {self.device} (a {self.mesh.device_type!r} mesh); move the "
                            f"local tensor to {self.device}")

    _check = _check_device   # BoundComm calls it before the one-member shortcut

    def _guarded(self, what: str, axes: tuple[int, ...], members: Members, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except (RuntimeError, ValueError, TypeError, dist.DistError) as e:
            _FAILURES[0] += 1
            names = self.axis_names(axes)
            raise CommError(f"{what} on mesh axes {axes}{names} (group ranks {list(members)}) failed on rank "
                            f"{self.rank} (timeout {self.timeout}): {e}") from e

    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, members: Members, axes: tuple[int, ...]) -> None:
        pg, order = self._group(members)
        flat, out = _wire(t.reshape(-1)), _wire(out)
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
        # torch's reduce_scatter does not view complex as real (NCCL has no complex type): do it here
        wire_in, wire_out = _reducible(inp, op), _reducible(out.view(-1), op)
        self._call(f"reduce_scatter({op})", axes, members, inp,
                   lambda: _reduce_scatter_flat(wire_out, wire_in, op=_REDUCE_OPS[op], group=pg))
        if wire_out.dtype != out.dtype and not out.dtype.is_complex:
            out.view(-1).copy_(from_reducible(wire_out, out.dtype, op))
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
        wire = _reducible(out, op)
        self._call(f"all_reduce({op})", axes, members, out,
                   lambda: dist.all_reduce(wire, op=_REDUCE_OPS[op], group=pg))
        if wire.dtype != out.dtype and not out.dtype.is_complex:
            out.copy_(from_reducible(wire, out.dtype, op))
        return out

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: tuple[int, ...],
                    in_splits: tuple[int, ...], members: Members, axes: tuple[int, ...],
                    meanwhile: Callable[[], object] | None, what: str = "all_to_all") -> None:
        pg, order = self._group(members)
        if _wire(inp) is not inp:   # a dtype the wire lacks (int16): its bytes, runs scaled by the item size
            k = inp.element_size()
            self._all_to_all(out.view(torch.uint8), inp.view(torch.uint8), tuple(n * k for n in out_splits),
                             tuple(n * k for n in in_splits), members, axes, meanwhile, what)
            return
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
                   members: Members, axes: tuple[int, ...], meanwhile: Callable[[], object] | None,
                   dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """gloo: isend/irecv on the group's process group, receives posted first; every wait is bounded by
        the mesh's timeout. NCCL: one all_to_all_single (see the module notes)."""
        if not self._gloo:
            return super()._send_recv(sends, recvs, members, axes, meanwhile, dtype)
        pg, _ = self._group(members)
        what = f"send_recv (to ranks {[members[i] for i, _ in sends]}, from ranks {[members[i] for i, _ in recvs]})"
        works, sent = [], []

        def post() -> None:
            for i, buf in recvs:
                self._check_device("send_recv", axes, buf)
                works.append(dist.irecv(_wire(buf.view(-1)), src=members[i], group=pg))
            for i, t in sends:
                t = outgoing_tensor(t)
                self._check_device("send_recv", axes, t)
                sent.append(t)  # kept alive until its send is waited for
                works.append(dist.isend(_wire(t.view(-1)), dst=members[i], group=pg))

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
        """One `all_to_all_single` over a group of exactly `ranks` (`init_mesh` made it on every world rank
        when it bound the second of the two meshes): every member takes part, also one with nothing to
        send (zero sizes), so NCCL never sees a point-to-point batch that some member of the group skips,
        and the group has the mesh's backend whatever the default group's is."""
        members = tuple(sorted(ranks))
        if self.rank not in members:
            raise CommError(f"exchange among ranks {list(members)} called on rank {self.rank}, which is not one "
                            f"of them")
        numel = lambda shape: int(torch.Size(shape).numel())
        pieces, in_splits, out_splits = [], [], []
        for peer in members:
            mine = [t.reshape(-1) for t in send.get(peer, [])] if peer != self.rank else []
            pieces += mine
            in_splits.append(sum(t.numel() for t in mine))
            out_splits.append(sum(numel(s) for s in recv_shapes.get(peer, [])) if peer != self.rank else 0)
        inp = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        inbox = torch.empty(sum(out_splits), dtype=dtype, device=device)
        self._check_device("exchange", (), inbox)
        if len(members) > 1:
            pg = self._groups.get(members) or PROCESS_GROUPS.find(members, _backend(self.mesh.device_type))
            if pg is not None:
                self._groups[members] = pg
                self._all_to_all(inbox, inp, tuple(out_splits), tuple(in_splits), members, (), None,
                                 what="exchange")
            else:   # ranks that no two bound meshes span: unbatched pairs on the default group
                self._pairs(members, inp, inbox, in_splits, out_splits)
        out, runs = {}, dict(zip(members, inbox.split(out_splits)))
        for peer, shapes in recv_shapes.items():
            sizes = [numel(s) for s in shapes]
            out[peer] = [piece.view(s) for piece, s in zip(runs[peer].split(sizes), shapes)]
        return out

    def _pairs(self, members: Members, inp: torch.Tensor, inbox: torch.Tensor, in_splits: list[int],
               out_splits: list[int]) -> None:
        """isend / irecv per peer with something to move, not batched: on NCCL each pair of ranks gets its
        own communicator on first use, so ranks outside the pair need not take part (a batch would need
        every rank of the group in its first call)."""
        works, sent = [], []
        what = f"exchange (ranks {list(members)}, point to point)"

        def post() -> None:
            for peer, piece in zip(members, inbox.split(out_splits)):
                if piece.numel():
                    works.append(dist.irecv(_wire(piece), src=peer))
            for peer, piece in zip(members, inp.split(in_splits)):
                if piece.numel():
                    sent.append(piece)
                    works.append(dist.isend(_wire(piece), dst=peer))

        self._guarded(what, (), members, post)
        for work in works:
            self._guarded(what, (), members, lambda: work.wait(self.timeout))


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A flat contiguous tensor as what gloo and NCCL carry: itself, or its bytes for a dtype they lack.

    >>> _wire(torch.ones(2, dtype=torch.int16)).dtype, _wire(torch.ones(2)).dtype
    (torch.uint8, torch.float32)
    """
    return t if t.dtype in WIRE_DTYPES or t.dtype.is_complex else t.view(torch.uint8)


def _reducible(t: torch.Tensor, op: str) -> torch.Tensor:
    """`t` as a tensor gloo and NCCL reduce with `op`: complex as its (real, imag) pairs (a view: sums are the
    same), a dtype they lack as `sbp.runtime.communicator.to_reducible` maps it (int16 widened to int32, uint64
    as int64 bits, float8 as float32, ...: the caller writes the result back with `from_reducible`).

    >>> c, i = torch.ones(2, dtype=torch.complex64), torch.ones(2, dtype=torch.int16)
    >>> _reducible(c, "sum").shape, _reducible(i, "sum").dtype
    (torch.Size([2, 2]), torch.int32)
    """
    if t.dtype.is_complex:
        return torch.view_as_real(t)
    return to_reducible(t, op)
