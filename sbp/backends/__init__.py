"""Backends that run collectives: `threads` (ranks as threads in one process) and `dist` (torch.distributed).

`BoundComm` is their shared half: group lookup along mesh axes, trivial single-member groups, argument
checks and byte counting. A backend supplies the four raw collectives over a tuple of member ranks.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..comm import (ChunkList, CallRecord, Counters, check_recv_shapes, count_all_gather, count_all_reduce,
                    count_all_to_all, count_reduce_scatter, stacked, with_axes)
from ..errors import CommError
from ..mesh import DeviceMesh

Members = tuple[int, ...]  # world ranks of one group, in member (row-major) order


class BoundComm:
    """A communicator bound to `mesh` (a pure value: shape and world ranks) for world rank `rank`.

    Subclasses implement `_all_gather`, `_reduce_scatter`, `_all_reduce`, `_all_to_all` and `_rebind`.
    """

    backend = "abstract"

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
        members = self.members(axes)
        n = len(members)
        t = t.contiguous()
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
        members = self.members(axes)
        inp = stacked(chunks, len(members))
        index = members.index(self.rank)
        out = inp[0].clone() if len(members) == 1 else self._reduce_scatter(inp, members, axes, op)
        self._count(count_reduce_scatter(index, inp[0].numel(), numels, len(members), inp.element_size()), axes)
        return out

    def all_reduce(self, t: torch.Tensor, axes: tuple[int, ...], op: str, *, inplace: bool = False) -> torch.Tensor:
        """The `op`-reduction of every member's `t`, contiguous; a new tensor unless `inplace`, which lets
        the backend reduce into `t` itself (the caller owns it)."""
        members = self.members(axes)
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
        members = self.members(axes)
        n = len(members)
        if (len(in_splits) != n or len(out_splits) != n or sum(in_splits) != inp.numel()
                or sum(out_splits) != out.numel() or not (inp.is_contiguous() and out.is_contiguous())):
            raise ValueError(f"all_to_all_single needs contiguous flat buffers and one split per member ({n}): "
                             f"in_splits {list(in_splits)} for {inp.numel()} elements, out_splits "
                             f"{list(out_splits)} for {out.numel()}")
        index = members.index(self.rank)
        if n == 1:
            out.copy_(inp)
            if meanwhile is not None:
                meanwhile()
        else:
            self._all_to_all(out, inp, tuple(out_splits), tuple(in_splits), members, axes, meanwhile)
        self._count(count_all_to_all(index, in_splits, out_splits, inp.element_size()), axes)
        return out

    def exchange(self, ranks: Sequence[int], send: dict[int, list[torch.Tensor]],
                 recv_shapes: dict[int, list[Sequence[int]]], *, dtype: torch.dtype,
                 device: "torch.device | str") -> dict[int, list[torch.Tensor]]:
        """Point-to-point among world `ranks` (every one of them calls it; no group is needed).

        `send[peer]` are the pieces for world rank `peer`; `recv_shapes[peer]` the shapes expected from it.
        Returns the received pieces per peer, in the same order. Used by cross-mesh redistribution.
        """
        numel = lambda shape: int(torch.Size(shape).numel())
        sent = sum(t.numel() for pieces in send.values() for t in pieces)
        wanted = {peer: [tuple(s) for s in shapes] for peer, shapes in recv_shapes.items()}
        got = self._exchange(tuple(ranks), {p: [t.contiguous() for t in ts] for p, ts in send.items()}, wanted,
                             dtype, torch.device(device))
        received = sum(numel(s) for shapes in wanted.values() for s in shapes)
        size = torch.empty(0, dtype=dtype).element_size()
        self.counters.record(CallRecord("exchange", (), sent * size, received * size, sent * size, received * size))
        return got

    def _exchange(self, ranks: Members, send: dict[int, list[torch.Tensor]], recv_shapes: dict[int, list[tuple]],
                  dtype: torch.dtype, device: torch.device) -> dict[int, list[torch.Tensor]]:
        raise NotImplementedError  # pragma: no cover

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


def bound(mesh: DeviceMesh, comm: Any) -> DeviceMesh:
    """`mesh` with `comm` as its binding (the value is unchanged; binding never affects equality).

    >>> bound(DeviceMesh((2,)), None) == DeviceMesh((2,))
    True
    """
    return DeviceMesh(mesh.shape, mesh.names, mesh.ranks, mesh.device_type, comm)
