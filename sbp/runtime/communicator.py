"""The communicator interface the executor talks to, and the byte counters every backend shares.

A communicator is bound to one mesh and one rank. Each collective runs on the group along `axes` (mesh
axis indices) that contains this rank; with several axes the group is flattened row-major over them
(`DeviceMesh.groups`). Lists of per-member tensors are always in that member order.

Byte counting is *logical*: what the algorithm must move, not the padding a backend adds to make uneven
pieces equal. Per call and rank:

=================  ========================================  ==============================================
collective         received                                  sent
=================  ========================================  ==============================================
all_gather         sum of the other members' pieces          own piece x (n - 1)
reduce_scatter     own piece x (n - 1)                       sum of the pieces meant for the others
all_reduce         2 (n - 1) / n of the tensor, rounded down    the same (the ring figure the planner prices)
all_to_all         sum of what the peers send this rank      sum of what this rank sends to its peers
send_recv          sum of what the peers send this rank      sum of what this rank sends to its peers
=================  ========================================  ==============================================

The padded figures (what really crossed the wire) are kept beside them as `wire_sent` / `wire_received`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, Union, runtime_checkable

import torch

from ..values.layout import split_sizes
from ..values.mesh import DeviceMesh, MeshBinding

ChunkList = Union[Sequence[torch.Tensor], torch.Tensor]
# a message to send: the contiguous tensor, or a function that packs it when its turn comes
Outgoing = Union[torch.Tensor, Callable[[], torch.Tensor]]


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One collective as seen by one rank: logical and on-the-wire bytes.

    >>> CallRecord("all_gather", (0,), sent=12, received=36)
    CallRecord(all_gather, axes=(0,), sent=12, received=36)
    """

    collective: str
    axes: tuple[int, ...]
    sent: int = 0
    received: int = 0
    wire_sent: int = 0
    wire_received: int = 0

    def __repr__(self) -> str:
        return f"CallRecord({self.collective}, axes={self.axes}, sent={self.sent}, received={self.received})"


@dataclass(slots=True)
class Counters:
    """Running totals of one rank's traffic, plus the log of calls (for tests and benchmarks).

    >>> c = Counters()
    >>> c.record(CallRecord("all_reduce", (0,), sent=8, received=8))
    >>> c.sent, c.received, len(c.calls)
    (8, 8, 1)
    """

    sent: int = 0
    received: int = 0
    wire_sent: int = 0
    wire_received: int = 0
    calls: list[CallRecord] = field(default_factory=list)

    def record(self, call: CallRecord) -> None:
        """Add one call to the totals and the log."""
        self.sent += call.sent
        self.received += call.received
        self.wire_sent += call.wire_sent
        self.wire_received += call.wire_received
        self.calls.append(call)

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.sent = self.received = self.wire_sent = self.wire_received = 0
        self.calls.clear()


@runtime_checkable
class Communicator(MeshBinding, Protocol):
    """What the runtime needs from a backend: everything the layers above call on a mesh's `binding`.

    Every method is called by every member of the group, in the same order (SPMD).
    `numels` (optional) are the logical element counts of the members' pieces when the executor has
    padded them to one size; they only feed the counters.
    """

    rank: int                              # world rank
    backend: str                           # "dist" (torch.distributed: gloo or NCCL) or "threads"
    coord: tuple[int, ...] | None          # coord in the bound mesh; None outside it
    counters: Counters
    exchange_route: str                    # how the executor runs exchanges: "auto" (by messages where they
                                           # copy nothing), "messages" (`send_recv`), "all_to_all" (one
                                           # `all_to_all_single`)

    def members(self, axes: tuple[int, ...]) -> tuple[int, ...]:
        """World ranks of this rank's group along `axes`, in member (row-major) order."""

    def axis_names(self, axes: Sequence[int]) -> str:
        """The axes as text for messages (``"axis 'tp'"``, ``"axes 0, 1"``)."""

    def bind(self, mesh: DeviceMesh) -> DeviceMesh:
        """`mesh` (another mesh over ranks of the same world) bound to this backend; shares its groups."""

    def all_gather(self, t: torch.Tensor, axes: tuple[int, ...], *, numels: Sequence[int] | None = None,
                   out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every member's `t` (equal shapes), in member order; with `out` (contiguous, n x `t.numel()`
        elements) gathered into it back to back, the list holding views of it."""

    def reduce_scatter(self, chunks: ChunkList, axes: tuple[int, ...], op: str, *,
                       numels: Sequence[int] | None = None) -> torch.Tensor:
        """`chunks[i]` (equal shapes; or a tensor stacked along dim 0) is meant for member i; returns the
        `op`-reduction over the members of the chunk meant for this rank."""

    def reduce_scatter_runs(self, flat: torch.Tensor, numels: Sequence[int], axes: tuple[int, ...],
                            op: str) -> torch.Tensor:
        """Uneven reduce_scatter: the contiguous 1-d `flat` holds member i's piece as its i-th run of
        `numels[i]` elements; returns the `op`-reduction over the members of this rank's run (flat)."""

    def all_reduce(self, t: torch.Tensor, axes: tuple[int, ...], op: str, *, inplace: bool = False) -> torch.Tensor:
        """The `op`-reduction of every member's `t`: a new tensor, or with `inplace` possibly `t` itself."""

    def all_to_all(self, send: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]],
                   axes: tuple[int, ...]) -> list[torch.Tensor]:
        """`send[i]` goes to member i; returns what each member sent here, shaped by `recv_shapes`."""

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
                          in_splits: Sequence[int], axes: tuple[int, ...], *,
                          meanwhile: Callable[[], object] | None = None) -> torch.Tensor:
        """Flat `all_to_all`: the i-th run of `in_splits[i]` elements of `inp` goes to member i; member i's
        run lands in the i-th run of `out_splits[i]` elements of `out`. `meanwhile` (local work touching
        neither buffer) runs while the call is in flight where the backend can. Returns `out`."""

    def send_recv(self, sends: Sequence[tuple[int, Outgoing]], recvs: Sequence[tuple[int, torch.Tensor]],
                  axes: tuple[int, ...], *, meanwhile: Callable[[], object] | None = None) -> None:
        """Point-to-point inside the group along `axes`: ``(i, t)`` in `sends` sends `t` to member i (a
        function giving `t` is called when its turn comes, so packing overlaps earlier sends), ``(i, buf)``
        in `recvs` fills the contiguous `buf` with what member i sends here. At most one message per peer
        and direction, none to itself. Every member calls it, also one with nothing to move."""

    def submesh_binding(self, mesh: DeviceMesh, axes: tuple[int, ...],
                        members: tuple[int, ...] | None = None) -> "Communicator":
        """The binding of `mesh`'s sub-mesh along `axes` made of `members` (default: this rank's group);
        shares process groups and counters."""

    def exchange(self, ranks: Sequence[int], send: dict[int, list[torch.Tensor]],
                 recv_shapes: dict[int, list[Sequence[int]]], *, dtype: torch.dtype,
                 device: "torch.device | str") -> dict[int, list[torch.Tensor]]:
        """Point-to-point among world `ranks` (all of them call it): `send[peer]` are the pieces for world
        rank `peer`, `recv_shapes[peer]` the shapes expected from it; returns the pieces received per peer."""


# ---- shared helpers for backends ------------------------------------------------------------------

REDUCE_FNS = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}


# what torch's CPU kernels, gloo and NCCL all reduce as they are (complex: as (real, imag) pairs, by the caller)
REDUCIBLE = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                       torch.int32, torch.int64, torch.bool})
_SIGN64 = torch.iinfo(torch.int64).min


def to_reducible(t: torch.Tensor, op: str) -> torch.Tensor:
    """`t` in a dtype every backend reduces with `op` (`REDUCIBLE`), so that `from_reducible` of the reduction
    is the reduction in `t`'s dtype, exactly: int16 / uint16 widened to int32 (a sum narrowed back wraps as in
    its own dtype; min/max exact); uint32 as the int32 of its bits for a sum (a sum wraps alike) and widened to
    int64 for min/max; uint64 as the int64 of its bits, for min/max with the sign bit flipped (which orders them
    as unsigned); float8 widened to float32 (exact; a sum rounds once, narrowed back). Other dtypes: `t`.

    >>> x = torch.tensor([3_000_000_000], dtype=torch.uint32)
    >>> to_reducible(x, "max").dtype, to_reducible(x, "sum").dtype
    (torch.int64, torch.int32)
    """
    dtype = t.dtype
    if dtype in REDUCIBLE or dtype.is_complex:
        return t
    if dtype in (torch.int16, torch.uint16):
        return t.to(torch.int32)
    if dtype == torch.uint32:
        return t.view(torch.int32) if op == "sum" else t.to(torch.int64)
    if dtype == torch.uint64:
        return t.view(torch.int64) if op == "sum" else t.view(torch.int64) ^ _SIGN64
    if dtype.is_floating_point:   # the float8 kinds
        return t.to(torch.float32)
    return t


def from_reducible(r: torch.Tensor, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The reduction `r` of `to_reducible` tensors as a tensor of `dtype` (`r` itself when nothing was mapped).

    >>> x = torch.tensor([2**63 + 5], dtype=torch.uint64)
    >>> back = from_reducible(to_reducible(x, "max"), torch.uint64, "max")
    >>> back.dtype, back.view(torch.int64).item() == x.view(torch.int64).item()
    (torch.uint64, True)
    """
    if r.dtype == dtype:
        return r
    if dtype == torch.uint64:
        return (r if op == "sum" else r ^ _SIGN64).view(torch.uint64)
    if dtype == torch.uint32 and op == "sum":
        return r.view(torch.uint32)
    return r.to(dtype)


def reduce_list(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Element-wise `op` over tensors, folded left to right (the same order on every rank); dtypes torch's CPU
    kernels do not reduce (uint16/32/64, float8) go through `to_reducible`.

    >>> reduce_list([torch.tensor([1, 5]), torch.tensor([3, 2])], "max")
    tensor([3, 5])
    >>> reduce_list([torch.tensor([40000], dtype=torch.uint16)] * 2, "sum").tolist()   # wraps as uint16 does
    [14464]
    """
    fn = REDUCE_FNS[op]
    dtype = tensors[0].dtype
    mapped = dtype not in REDUCIBLE and not dtype.is_complex
    out = to_reducible(tensors[0], op).clone()
    for t in tensors[1:]:
        fn(out, to_reducible(t, op) if mapped else t, out=out)
    return from_reducible(out, dtype, op) if mapped else out


def joined(chunks: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The flat tensor that equal-sized contiguous `chunks` are consecutive views of, or None.

    Lets a backend or the executor skip a copy when pieces already lie side by side in one buffer.

    >>> buf = torch.arange(6)
    >>> joined([buf[0:3], buf[3:6]]).tolist(), joined([buf[3:6], buf[0:3]])
    ([0, 1, 2, 3, 4, 5], None)
    """
    first = chunks[0]
    n, step = first.numel(), first.numel() * first.element_size()
    if n == 0 or any(not c.is_contiguous() or c.numel() != n or c.dtype != first.dtype for c in chunks):
        return None
    base = first.untyped_storage().data_ptr()
    if any(c.untyped_storage().data_ptr() != base or c.data_ptr() != first.data_ptr() + i * step
           for i, c in enumerate(chunks)):
        return None
    return first.as_strided((n * len(chunks),), (1,), first.storage_offset())


def stacked(chunks: ChunkList, n: int) -> torch.Tensor:
    """`n` equal chunks as one contiguous tensor stacked along a new dim 0: from a list (a view when the
    chunks already lie back to back in one buffer), or from a tensor cut evenly along its dim 0.

    >>> stacked(torch.arange(6), 3).tolist(), stacked([torch.ones(2), torch.zeros(2)], 2).shape
    ([[0, 1], [2, 3], [4, 5]], torch.Size([2, 2]))
    """
    if isinstance(chunks, torch.Tensor):
        if chunks.ndim == 0 or chunks.shape[0] % n:
            raise ValueError(f"reduce_scatter needs {n} chunks of one shape: a tensor whose dim 0 divides by {n}, "
                             f"got shape {tuple(chunks.shape)}")
        return chunks.contiguous().view((n, chunks.shape[0] // n) + tuple(chunks.shape[1:]))
    chunks = list(chunks)
    if len(chunks) != n or len({tuple(c.shape) for c in chunks}) > 1:
        raise ValueError(f"reduce_scatter needs {n} chunks of one shape, got shapes {[tuple(c.shape) for c in chunks]}")
    whole = joined(chunks)
    return whole.view((n,) + tuple(chunks[0].shape)) if whole is not None else torch.stack(chunks)


def count_all_gather(index: int, numel: int, numels: Sequence[int] | None, n: int, itemsize: int) -> CallRecord:
    """Counts of an all_gather of `numel`-element (padded) pieces; `numels` the logical sizes."""
    sizes = list(numels) if numels is not None else [numel] * n
    others = sum(sizes) - sizes[index]
    return CallRecord("all_gather", (), sent=sizes[index] * (n - 1) * itemsize, received=others * itemsize,
                      wire_sent=numel * (n - 1) * itemsize, wire_received=numel * (n - 1) * itemsize)


def count_reduce_scatter(index: int, numel: int, numels: Sequence[int] | None, n: int,
                         itemsize: int) -> CallRecord:
    """Counts of a reduce_scatter of `numel`-element (padded) chunks; `numels` the logical sizes."""
    sizes = list(numels) if numels is not None else [numel] * n
    return CallRecord("reduce_scatter", (), sent=(sum(sizes) - sizes[index]) * itemsize,
                      received=sizes[index] * (n - 1) * itemsize,
                      wire_sent=numel * (n - 1) * itemsize, wire_received=numel * (n - 1) * itemsize)


def count_all_reduce(index: int, numel: int, n: int, itemsize: int) -> CallRecord:
    """Counts of an all_reduce as a ring: a reduce_scatter then an all_gather of balanced pieces, so
    ``2 (n-1) / n`` of the data when it divides evenly (the planner prices it the same way).

    >>> count_all_reduce(0, 8, 4, 4).received   # 2 (n-1)/n x 8 elements x 4 bytes
    48
    >>> count_all_reduce(0, 35, 4, 1).received, count_all_reduce(3, 35, 4, 1).received  # pieces 9,9,9,8
    (53, 51)
    """
    sizes = split_sizes(numel, n)
    moved = (sizes[index] * (n - 1) + numel - sizes[index]) * itemsize if n > 1 else 0
    return CallRecord("all_reduce", (), sent=moved, received=moved, wire_sent=moved, wire_received=moved)


def count_all_to_all(index: int, send_numels: Sequence[int], recv_numels: Sequence[int],
                     itemsize: int) -> CallRecord:
    """Counts of an all_to_all: everything but the piece a rank sends itself."""
    sent = (sum(send_numels) - send_numels[index]) * itemsize
    received = (sum(recv_numels) - recv_numels[index]) * itemsize
    return CallRecord("all_to_all", (), sent=sent, received=received, wire_sent=sent, wire_received=received)


def count_send_recv(sent_numel: int, received_numel: int, itemsize: int) -> CallRecord:
    """Counts of a `send_recv`: what this rank sends to and receives from its peers.

    >>> count_send_recv(6, 4, 2).received
    8
    """
    sent, received = sent_numel * itemsize, received_numel * itemsize
    return CallRecord("send_recv", (), sent=sent, received=received, wire_sent=sent, wire_received=received)


def with_axes(call: CallRecord, axes: tuple[int, ...]) -> CallRecord:
    """The same record, labelled with the group's axes."""
    return CallRecord(call.collective, tuple(axes), call.sent, call.received, call.wire_sent, call.wire_received)


def check_recv_shapes(send: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]], n: int) -> None:
    """Both lists must have one entry per member."""
    if len(send) != n or len(recv_shapes) != n:
        raise ValueError(f"all_to_all needs one send tensor and one recv shape per member ({n}), "
                         f"got {len(send)} and {len(recv_shapes)}")
