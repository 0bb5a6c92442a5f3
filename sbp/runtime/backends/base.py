"""Backends that run collectives: `threads` (ranks as threads in one process) and `dist` (torch.distributed).

`BoundComm` is their shared half: group lookup along mesh axes, trivial single-member groups, argument
checks and byte counting. A backend supplies the four raw collectives over a tuple of member ranks.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ...values.errors import CommError
from ...values.mesh import LIVE_MESHES, DeviceMesh
from .. import pending
from ..communicator import (
    CallRecord,
    ChunkList,
    Counters,
    Outgoing,
    check_recv_shapes,
    count_all_gather,
    count_all_reduce,
    count_all_to_all,
    count_reduce_scatter,
    count_send_recv,
    stacked,
    with_axes,
)

Members = tuple[int, ...]  # world ranks of one group, in member (row-major) order


class BoundComm:
    """A communicator bound to `mesh` (a pure value: shape and world ranks) for world rank `rank`.

    Subclasses implement `_all_gather`, `_reduce_scatter`, `_all_reduce`, `_all_to_all` and `_rebind`;
    `_send_recv` defaults to one `_all_to_all` (packed), which a backend with real point-to-point overrides.
    """

    backend = "abstract"
    # how the executor runs exchanges: "auto" as messages (`send_recv`) where they copy nothing, else as
    # one `all_to_all_single`; "messages" always; "all_to_all" never
    exchange_route = "auto"

    def __init__(self, mesh: DeviceMesh, rank: int, counters: Counters | None = None) -> None:
        self.mesh = DeviceMesh(mesh.shape, mesh.names, mesh.ranks, mesh.device_type)  # unbound copy
        self.rank = rank
        self.counters = counters if counters is not None else Counters()
        self.coord = self.mesh.coord_of(rank) if rank in self.mesh.ranks else None
        self._members: dict[tuple[int, ...], Members] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} coord={self.coord} mesh={self.mesh}>"

    # ---- groups ------------------------------------------------------------------------------------
    def members(self, axes: Sequence[int]) -> Members:
        """World ranks of this rank's group along `axes`, in member order."""
        axes = tuple(axes)
        found = self._members.get(axes)
        if found is None:
            if self.coord is None:
                raise CommError(f"rank {self.rank} is outside mesh {self.mesh} and takes part in no collective")
            found = next(g for g in self.mesh.groups(axes) if self.rank in g)
            self._members[axes] = found
        return found

    def submesh_binding(self, mesh: DeviceMesh, axes: tuple[int, ...],
                        members: Members | None = None) -> "BoundComm":
        """Binding of `mesh`'s sub-mesh along `axes` made of `members` (default: the group containing this
        rank; another group gives a binding for which this rank is outside); counters are shared."""
        sub = DeviceMesh(tuple(mesh.shape[a] for a in axes),
                         None if mesh.names is None else tuple(mesh.names[a] for a in axes),
                         self.members(axes) if members is None else tuple(members), mesh.device_type)
        return self._rebind(sub)

    def _rebind(self, mesh: DeviceMesh) -> "BoundComm":  # pragma: no cover - abstract
        raise NotImplementedError

    def axis_names(self, axes: Sequence[int]) -> str:
        """The names of `axes` for messages, e.g. `` ('dp', 'tp')``; empty for an unnamed mesh.

        >>> import sbp, sbp.testing
        >>> sbp.testing.spmd(lambda mesh: mesh.binding.axis_names((1,)), (1, 2), names=("dp", "tp"))[0]
        " ('tp')"
        """
        if self.mesh.names is None or not axes:
            return ""
        return " (" + ", ".join(repr(self.mesh.names[a]) for a in axes) + ")"

    # ---- collectives -------------------------------------------------------------------------------
    def all_gather(self, t: torch.Tensor, axes: tuple[int, ...], *, numels: Sequence[int] | None = None,
                   out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every member's `t` in member order (shapes must be equal). With `out` (contiguous, n x `t.numel()`
        elements) the pieces are gathered into it, back to back, and the list holds views of it."""
        self._in_order()
        members = self.members(axes)
        n = len(members)
        t = t.contiguous()
        self._check("all_gather", axes, t)
        if out is None:
            out = t.new_empty(n * t.numel())
        elif out.numel() != n * t.numel() or not out.is_contiguous() or out.dtype != t.dtype:
            raise ValueError(f"all_gather into `out` needs a contiguous {t.dtype} tensor of {n} x {t.numel()} "
                             f"elements, got {out.dtype} of shape {tuple(out.shape)}")
        pieces = out.view((n,) + tuple(t.shape))
        if n == 1:
            pieces[0].copy_(t)
        else:
            self._all_gather(t, out.view(-1), members, axes)
        self._count(count_all_gather(members.index(self.rank), t.numel(), numels, n, t.element_size()), axes)
        return list(pieces.unbind(0))

    def reduce_scatter(self, chunks: ChunkList, axes: tuple[int, ...], op: str, *,
                       numels: Sequence[int] | None = None) -> torch.Tensor:
        """The `op`-reduction over members of the chunk meant for this rank."""
        self._in_order()
        members = self.members(axes)
        inp = stacked(chunks, len(members))
        self._check(f"reduce_scatter({op})", axes, inp)
        index = members.index(self.rank)
        out = inp[0].clone() if len(members) == 1 else self._reduce_scatter(inp, members, axes, op)
        self._count(count_reduce_scatter(index, inp[0].numel(), numels, len(members), inp.element_size()), axes)
        return out

    def reduce_scatter_runs(self, flat: torch.Tensor, numels: Sequence[int], axes: tuple[int, ...],
                            op: str) -> torch.Tensor:
        """Uneven reduce_scatter: the contiguous 1-d `flat` holds member i's piece as its i-th run of
        `numels[i]` elements; returns the `op`-reduction over the members of this rank's run (1-d).
        Backends whose reduce_scatter needs equal pieces pad them (one copy); gloo sends the runs as
        they are.

        >>> import sbp, sbp.testing, torch
        >>> def fn(mesh):    # 5 elements cut 3, 2; each rank contributes 1..5
        ...     return mesh.binding.reduce_scatter_runs(torch.arange(1., 6.), [3, 2], (0,), "sum").tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [[2.0, 4.0, 6.0], [8.0, 10.0]]
        """
        self._in_order()
        members = self.members(axes)
        n, index = len(members), members.index(self.rank)
        numels = tuple(int(k) for k in numels)
        if len(numels) != n or sum(numels) != flat.numel() or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"reduce_scatter_runs needs a contiguous 1-d tensor cut into one run per member "
                             f"({n}), got shape {tuple(flat.shape)} and runs {list(numels)}")
        self._check(f"reduce_scatter({op})", axes, flat)
        if n == 1:
            out, width = flat.clone(), numels[0]
        else:
            out, width = self._reduce_scatter_runs(flat, numels, members, axes, op)
        call = count_reduce_scatter(index, width, numels, n, flat.element_size())
        self._count(call, axes)
        return out

    def all_reduce(self, t: torch.Tensor, axes: tuple[int, ...], op: str, *, inplace: bool = False) -> torch.Tensor:
        """The `op`-reduction of every member's `t`, contiguous; a new tensor unless `inplace`, which lets
        the backend reduce into `t` itself (the caller owns it)."""
        self._in_order()
        members = self.members(axes)
        self._check(f"all_reduce({op})", axes, t)
        if not t.is_contiguous():
            t, inplace = t.contiguous(), True  # a fresh copy already
        if len(members) == 1:
            out = t if inplace else t.clone()
        else:
            out = self._all_reduce(t, members, axes, op, inplace)
        self._count(count_all_reduce(members.index(self.rank), t.numel(), len(members), t.element_size()), axes)
        return out

    def all_to_all(self, send: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]],
                   axes: tuple[int, ...]) -> list[torch.Tensor]:
        """`send[i]` goes to member i; returns what each member sent here, shaped by `recv_shapes`."""
        self._in_order()
        members = self.members(axes)
        check_recv_shapes(send, recv_shapes, len(members))
        recv_shapes = [tuple(s) for s in recv_shapes]
        out_splits = [int(torch.Size(s).numel()) for s in recv_shapes]
        inp = torch.cat([s.reshape(-1) for s in send])
        out = self.all_to_all_single(inp.new_empty(sum(out_splits)), inp, out_splits,
                                     [s.numel() for s in send], axes)
        return [piece.view(shape) for piece, shape in zip(out.split(out_splits), recv_shapes)]

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                          in_splits: Sequence[int], axes: tuple[int, ...], *,
                          meanwhile: Callable[[], object] | None = None) -> torch.Tensor:
        """Flat form of `all_to_all`: the i-th run of `in_splits[i]` elements of `inp` goes to member i, and
        what member i sends here lands in the i-th run of `out_splits[i]` elements of `out` (both flat
        and contiguous; this rank's own run is copied locally). `meanwhile`: local work that touches
        neither buffer, run while the call is in flight where the backend can. Returns `out`."""
        self._in_order()
        members = self.members(axes)
        n = len(members)
        if (len(in_splits) != n or len(out_splits) != n or sum(in_splits) != inp.numel()
                or sum(out_splits) != out.numel() or not (inp.is_contiguous() and out.is_contiguous())):
            raise ValueError(f"all_to_all_single needs contiguous flat buffers and one split per member ({n}): "
                             f"in_splits {list(in_splits)} for {inp.numel()} elements, out_splits "
                             f"{list(out_splits)} for {out.numel()}")
        index = members.index(self.rank)
        self._check("all_to_all", axes, inp)
        self._check("all_to_all", axes, out)
        if n == 1:
            out.copy_(inp)
            if meanwhile is not None:
                meanwhile()
        else:
            self._all_to_all(out, inp, tuple(out_splits), tuple(in_splits), members, axes, meanwhile)
        self._count(count_all_to_all(index, in_splits, out_splits, inp.element_size()), axes)
        return out

    def send_recv(self, sends: Sequence[tuple[int, Outgoing]], recvs: Sequence[tuple[int, torch.Tensor]],
                  axes: tuple[int, ...], *, meanwhile: Callable[[], object] | None = None,
                  dtype: torch.dtype | None = None) -> None:
        """Point-to-point inside the group along `axes`, every member calling (SPMD), also one with nothing
        to move. ``(i, t)`` in `sends` sends the contiguous `t` to member i; `t` may be a function that
        returns it, called when its turn comes (packing then overlaps the sends already in flight).
        ``(i, buf)`` in `recvs` fills the contiguous `buf` with member i's message, whose size the caller
        knows. At most one message per peer and direction; a rank never sends to itself (it copies).
        `meanwhile`: local work touching none of the buffers, run while messages are in flight. `dtype`: the
        messages' dtype, for a member with nothing to move (it takes part with empty buffers of it).

        >>> import sbp, sbp.testing, torch
        >>> def fn(mesh):
        ...     me, peer = mesh.coord[0], 1 - mesh.coord[0]
        ...     got = torch.empty(2)
        ...     mesh.binding.send_recv([(peer, torch.full((2,), float(me)))], [(peer, got)], (0,))
        ...     return got.tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [[1.0, 1.0], [0.0, 0.0]]
        """
        self._in_order()
        members = self.members(axes)
        n, index = len(members), members.index(self.rank)
        for what, pairs in (("send to", sends), ("receive from", recvs)):
            peers = [i for i, _ in pairs]
            if len(set(peers)) != len(peers) or any(not 0 <= i < n or i == index for i in peers):
                raise ValueError(f"send_recv: a rank may {what} each other member (0..{n - 1}, not itself: "
                                 f"{index}) at most once, got members {peers}")
        if any(not buf.is_contiguous() for _, buf in recvs):
            raise ValueError("send_recv needs contiguous receive buffers")
        for _, buf in recvs:
            self._check("send_recv", axes, buf)
        if n == 1:
            if meanwhile is not None:
                meanwhile()
            return
        sent = self._send_recv(list(sends), list(recvs), members, axes, meanwhile, dtype)
        itemsize = recvs[0][1].element_size() if recvs else max((t.element_size() for t in sent), default=1)
        self._count(count_send_recv(sum(t.numel() for t in sent), sum(b.numel() for _, b in recvs), itemsize),
                    axes)

    def exchange(self, ranks: Sequence[int], send: dict[int, list[torch.Tensor]],
                 recv_shapes: dict[int, list[Sequence[int]]], *, dtype: torch.dtype,
                 device: "torch.device | str") -> dict[int, list[torch.Tensor]]:
        """Pieces among world `ranks`, every one of them calling it (ranks outside take no part; the dist
        backend runs it on a group over exactly `ranks`, see `DistComm._exchange`).

        `send[peer]` are the pieces for world rank `peer`; `recv_shapes[peer]` the shapes expected from it.
        Returns the received pieces per peer, in the same order. Used by cross-mesh redistribution.
        """
        self._in_order()
        numel = lambda shape: int(torch.Size(shape).numel())
        sent = sum(t.numel() for pieces in send.values() for t in pieces)
        wanted = {peer: [tuple(s) for s in shapes] for peer, shapes in recv_shapes.items()}
        got = self._exchange(tuple(ranks), {p: [t.contiguous() for t in ts] for p, ts in send.items()}, wanted,
                             dtype, torch.device(device))
        received = sum(numel(s) for shapes in wanted.values() for s in shapes)
        size = dtype.itemsize
        self.counters.record(CallRecord("exchange", (), sent * size, received * size, sent * size, received * size))
        return got

    def _in_order(self) -> None:
        """Collectives keep the order of submission on every rank: one called directly (not from the rank's
        queue worker) first waits for the async work queued before it (`sbp.runtime.pending`); else a rank
        whose queue still runs a gather would make this call first, another rank second."""
        pending.drain(self)

    def _check(self, what: str, axes: tuple[int, ...], t: torch.Tensor) -> None:
        """Refuse a tensor a backend cannot take (the dist backend: one on another device than the mesh's).
        Called before the one-member shortcut, so a one-rank run catches what a larger one would."""

    def _exchange(self, ranks: Members, send: dict[int, list[torch.Tensor]], recv_shapes: dict[int, list[tuple]],
                  dtype: torch.dtype, device: torch.device) -> dict[int, list[torch.Tensor]]:
        raise NotImplementedError  # pragma: no cover

    def _reduce_scatter_runs(self, flat: torch.Tensor, numels: tuple[int, ...], members: Members,
                             axes: tuple[int, ...], op: str) -> tuple[torch.Tensor, int]:
        """Runs padded to the longest into one stacked buffer, then `_reduce_scatter`; returns this rank's
        run and the padded width (what crossed the wire per piece)."""
        n, width = len(members), max(numels)
        stacked = flat.new_zeros((n, width))
        for i, piece in enumerate(flat.split(list(numels))):
            stacked[i, :piece.numel()] = piece
        out = self._reduce_scatter(stacked, members, axes, op)
        return out[:numels[members.index(self.rank)]], width

    def _send_recv(self, sends: list[tuple[int, Outgoing]], recvs: list[tuple[int, torch.Tensor]],
                   members: Members, axes: tuple[int, ...], meanwhile: Callable[[], object] | None,
                   dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Messages as one `_all_to_all` (every member takes part): sends packed in member order, receives
        unpacked. Returns the tensors sent."""
        n = len(members)
        outgoing = [(i, outgoing_tensor(t)) for i, t in sends]
        ref = outgoing[0][1] if outgoing else (recvs[0][1] if recvs else None)
        if ref is None:  # nothing to move here, but the others may: take part with empty buffers
            ref = torch.empty(0, dtype=dtype, device=self.mesh.device_type)
        in_splits, out_splits = [0] * n, [0] * n
        for i, t in outgoing:
            in_splits[i] = t.numel()
        for i, buf in recvs:
            out_splits[i] = buf.numel()
        inp = torch.cat([t.reshape(-1) for _, t in sorted(outgoing, key=lambda it: it[0])]) if outgoing \
            else ref.new_empty(0)
        out = ref.new_empty(sum(out_splits))
        self._all_to_all(out, inp, tuple(out_splits), tuple(in_splits), members, axes, meanwhile)
        pieces = out.split(out_splits)
        for i, buf in recvs:
            buf.view(-1).copy_(pieces[i])
        return [t for _, t in outgoing]

    def _count(self, call: CallRecord, axes: tuple[int, ...]) -> None:
        self.counters.record(with_axes(call, axes))

    # ---- raw collectives, over `members` (len >= 2), flat buffers in member order -------------------
    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, members: Members, axes: tuple[int, ...]) -> None:
        """Fill `out` (n x `t.numel()`) with every member's `t`."""
        raise NotImplementedError  # pragma: no cover

    def _reduce_scatter(self, stacked: torch.Tensor, members: Members, axes: tuple[int, ...],
                        op: str) -> torch.Tensor:
        """`stacked[i]` is meant for member i; a new tensor shaped `stacked[0]`."""
        raise NotImplementedError  # pragma: no cover

    def _all_reduce(self, t: torch.Tensor, members: Members, axes: tuple[int, ...], op: str,
                    inplace: bool) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: tuple[int, ...],
                    in_splits: tuple[int, ...], members: Members, axes: tuple[int, ...],
                    meanwhile: Callable[[], object] | None) -> None:
        raise NotImplementedError  # pragma: no cover


def comm_device(mesh: DeviceMesh) -> torch.device:
    """The device of the tensors `mesh`'s collectives take: its binding's own where it names one (the dist
    backend: ``cuda:<local rank>`` on NCCL), else the mesh's device type.

    >>> comm_device(DeviceMesh((2,)))
    device(type='cpu')
    """
    device = getattr(mesh.binding, "device", None)
    return device if isinstance(device, torch.device) else torch.device(mesh.device_type)


def outgoing_tensor(t: Outgoing) -> torch.Tensor:
    """A message of `send_recv`: the tensor (packed now if given as a function), which must be contiguous.

    >>> outgoing_tensor(lambda: torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    t = t() if callable(t) else t
    if not t.is_contiguous():
        raise ValueError(f"send_recv sends contiguous tensors only, got one of shape {tuple(t.shape)} and "
                         f"strides {t.stride()}")
    return t


def bound(mesh: DeviceMesh, comm: Any) -> DeviceMesh:
    """`mesh` with `comm` as its binding (the value is unchanged; binding never affects equality).

    >>> bound(DeviceMesh((2,)), None) == DeviceMesh((2,))
    True
    """
    out = DeviceMesh(mesh.shape, mesh.names, mesh.ranks, mesh.device_type, comm)
    if comm is not None:   # an unpickled mesh of this description binds to it (per thread on "threads")
        LIVE_MESHES.remember(out, per_thread=comm.backend == "threads")
    return out
