"""`fully_shard`: fully sharded data parallelism (FSDP / ZeRO-3) for unchanged `torch.nn` models.

Applied to each block and then to the root, as PyTorch FSDP2's `fully_shard`. Each *unit* (the module
`fully_shard` was applied to, minus the units inside it) stores every parameter split on `axis`: `S(d)`
there, on the first dim `d` no other mesh axis splits, on top of any tensor-parallel placement from
`parallelize` (axes before `axis` are replicate axes: HSDP). Per unit and training step:

=================  ==========================================================================================
forward, before    one all_gather on `axis` of the unit's shards, flattened into one buffer; the next unit's
                   gather is issued first (prefetch), so it runs while this unit computes
forward, after     the gathered copies are freed (`reshard_after_forward`; the root unit keeps them)
backward, before   one all_gather again (when freed), the previous unit's issued ahead (prefetch)
backward, after    one reduce_scatter on `axis` of the unit's gradients, flattened (HSDP: and one all_reduce
                   on the replicate axes), with a "used" flag per trainable parameter (`.grad` is left alone
                   where no rank's backward reached it, as FSDP2); the gathered copies are freed; leaf `.grad`
                   has the stored placements, so `torch.optim` states are shards too
=================  ==========================================================================================

Every collective runs on the rank's ordered queue (`sbp.runtime.pending`): issuing returns at once and the
value is waited for where it is used. Gathered copies are freed by shrinking their storage to nothing and
gathered back into the same storage, so tensors saved for backward see the values again (FSDP2's way).

A parameter whose every dim is already split by another axis (a colwise bias under tensor parallelism)
is split on `axis` on the same dim and moves by a planned redistribution (exact, the lower-bound bytes)
beside the unit's buffer: a unit's 1-d ones with one layout, split evenly, together as one (`_Group`),
any other by its own. A 0-d parameter stays replicated. A unit of per-sample computation without inner
units computes on this rank's plain share of the batch once its first forward showed the two ways agree
(`fully_shard`'s `local_batch`); with tensor parallelism its colwise / rowwise layers then compute on their
local pieces (`sbp.nn.tp_local`). Plain tensors entering the root are
the full batch, laid out `S(0)` on `axis` and the replicate axes (the rule `parallelize` follows on its
data-parallel axes); pass `sbp.from_local(my_share, mesh, ...)` to give each rank's own share instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch import nn
from torch._dynamo import compiled_autograd
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from ..runtime import agreement, pending
from ..runtime.pending import PendingTensor
from ..tensor.autograd import differentiable_once, from_local_autograd
from ..tensor.construct import distribute, from_local
from ..tensor.global_tensor import GlobalTensor, redistribute_raw
from ..values.errors import MeshError, SbpError, ShapeError
from ..values.layout import local_shape, local_slices
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, Split
from . import rebuild, tp_local
from .rebuild import refuse

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
_UNITS: "weakref.WeakKeyDictionary[nn.Module, Unit]" = weakref.WeakKeyDictionary()   # module -> its unit
# id(stored param) -> its unit (tensors compare by value, so they cannot be dictionary keys themselves)
_OWNER: "weakref.WeakValueDictionary[int, Unit]" = weakref.WeakValueDictionary()


@dataclass
class _Slot:
    """One parameter of a unit: where it sits in its module, its stored and gathered layouts, and where its
    pieces lie in the unit's flat buffer (member m's piece at ``m * width + offset``, ``sizes[m]`` long)."""

    owner: nn.Module
    name: str
    param: nn.Parameter
    stored: tuple[Placement, ...]
    compute: tuple[Placement, ...]
    dim: Optional[int]            # the dim split on the unit's axis; None: replicated (0-d)
    flat: bool                    # in the unit's flat buffer (else its own planned redistribution)
    shapes: list[tuple[int, ...]] = field(default_factory=list)   # each member's stored local shape
    sizes: list[int] = field(default_factory=list)                 # their element counts
    offset: int = 0
    local: Optional[torch.Tensor] = None   # the gathered local (storage freed when resharded)
    even_rows: bool = False       # split on dim 0 in equal pieces: the gathered local is the pieces in a row
    accumulator: Any = None       # the stored parameter's autograd accumulator node (see `_store_grads`)


@dataclass
class _Group:
    """1-d parameters outside the flat buffer (every dim already split by another axis: colwise biases under
    tensor parallelism) with one stored and one compute layout, split evenly into `rows` pieces: moved
    together as one planned redistribution of a (rows, width) matrix whose columns are theirs side by side
    (each parameter viewed as (rows, its length / rows): the same pieces on the same ranks, see
    `_layout_groups`)."""

    at: list[int]                 # the slots' positions in the unit's `slots`
    slots: list[_Slot]
    cols: list[tuple[int, int]]   # each slot's (first column, columns)
    stored: tuple[Placement, ...]
    compute: tuple[Placement, ...]
    rows: int
    width: int


@dataclass
class _GradLayout:
    """The flat gradient buffer: the flat slots that take gradients (frozen ones send nothing), packed as the
    gather buffer is (the even block first) -- member m's piece of slot k at ``m * width + offsets[k]`` --
    then one "used" flag per trainable slot of the unit (flat or not) at ``m * width + data_width + j``:
    every rank writes its flags into every member's piece, so the reduce_scatter hands each rank the flags
    summed over the ranks (0: no rank's backward reached that parameter; see `Unit.reduce_grads`)."""

    live: list[tuple[int, _Slot]]          # (position in `slots`, slot), in buffer order
    offsets: dict[int, int]
    width: int                             # data_width + len(flagged)
    even: list[tuple[int, _Slot]]          # the even-rows slots among them, packed first
    even_width: int
    numels: list[int]                      # each member's elements in the buffer (flags included)
    data_width: int = 0                    # the gradients' columns (each slot padded to its longest piece)
    flagged: list[int] = field(default_factory=list)   # positions in `slots` of the flags' slots, in order
    ones: dict[tuple[torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)   # all used


@dataclass
class _Unused:
    """The parameters a unit's backward did not reach on this rank, whose gradient went into the reduction as
    zeros: they keep a gradient only where another rank's backward reached them (their summed flag is not 0)."""

    flags: PendingTensor                   # this rank's piece of the reduced flags (summed over the ranks)
    at: dict[int, int]                     # slot position -> its flag's index
    values: Optional[list[float]] = None

    def used(self, k: int) -> bool:
        """Whether any rank's backward reached slot `k` (waits for the reduction, once)."""
        if self.values is None:
            self.values = pending.ready(self.flags).tolist()
        return self.values[self.at[k]] != 0


class Unit:
    """The state of one `fully_shard` unit (see the module docstring); `schedule` is shared by a root and
    the units inside it."""

    def __init__(self, module: nn.Module, mesh: DeviceMesh, axis: int, reshard: bool,
                 param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype], name: str) -> None:
        self.module, self.mesh, self.axis, self.name = module, mesh, axis, name
        self.reshard_after_forward = reshard
        self.reshard_after_backward = True   # False (set_reshard_after_backward): keep the gathered copies
        self.kept = False   # gathered copies a backward kept (reshard_after_backward False) for the next forward
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.replicate_axes = tuple(range(axis))
        self.slots: list[_Slot] = []
        self.width = 0
        # the flat slots split on dim 0 in equal pieces (`even_rows`), in buffer order: the buffer's first
        # `even_width` columns of every member's segment, packed and gathered by one op each way
        self.even: list[_Slot] = []
        self.even_at: list[int] = []  # their positions in `slots` (where their gradients come in backward)
        self.even_width = 0
        self.numels: list[int] = []   # each member's elements in the flat buffer
        self.grad_layouts: dict[tuple[bool, ...], _GradLayout] = {}   # by the slots' requires_grad flags
        self.state = "sharded"        # sharded -> gathering -> gathered -> sharded
        self.gathering: Optional[PendingTensor] = None
        self.planned: list[Optional[GlobalTensor]] = []
        self.groups: list[_Group] = []       # the planned slots moved together (see `_Group`)
        self.grouped: list[GlobalTensor] = []   # their gathers on the way, one per group
        self.schedule = Schedule(self)
        self.backward_started = False
        self.tied: dict[tuple[int, str], _Slot] = {}   # (id(owner module), name) -> the slot holding it
        self.local_batch = False    # the unit computes on plain local tensors (see fully_shard)
        # local_batch=None: "unverified" until the first forward on the batch compares the two ways, then
        # "local" or "global"; "off" where the unit cannot compute locally (inner units, tensor parallelism)
        self.auto = "off"
        self.computing_local = False   # the forward in progress runs on plain local tensors
        self.forward_local = False     # how the last forward with autograd ran (its recompute runs the same way)
        self.probe = False             # the forward in progress is compared against a local run
        self.inputs_checked = False    # the root's first eager forward compared its plain inputs across ranks
        self.batch_lengths: dict[int, int] = {}   # local -> global batch length seen at the forward's inputs
        self.owners: dict[int, nn.Module] = {}
        self.hook_ids: frozenset[int] = frozenset()   # the ids of the unit's own forward hooks (`_install_hooks`)
        self._gathered_bytes: Optional[int] = None
        # the stored parameters' version counters when the gather was issued: a gather issued before an
        # in-place change (optimizer step, load_state_dict) is stale and is dropped (`unshard`)
        self.versions: tuple[tuple[int, int, int], ...] = ()
        # id(stored param) -> the gathered tensor forward bound: bound again for backward, where activation
        # checkpointing recomputes the forward (their storage is freed and refilled with the unit's)
        self.bound: Optional[dict[int, torch.Tensor]] = None
        # set_requires_gradient_sync(False): backward keeps the gradients unreduced (summed over the steps, each
        # slot's this-rank part P(sum) on the axis) until a backward with sync reduces them with its own
        self.gradient_sync = True
        self.held: Optional[list[Optional[GlobalTensor]]] = None
        self.held_used: Optional[list[bool]] = None   # which slots the held backwards reached (on this rank)

    # ---- gather --------------------------------------------------------------------------------
    def issue_gather(self, phase: str) -> None:
        """Queue this unit's gather (no-op when gathered or on the way); returns at once."""
        if self.state != "sharded":
            return
        if not self.slots:
            self.state = "gathered"
            return
        self.state = "gathering"
        self.versions = self.current_versions()
        self.schedule.log.append(("issue_gather", self.name, phase))
        comm, n = self.mesh.binding, self.mesh.shape[self.axis]
        dtype = self.param_dtype or self.slots[0].param.dtype
        flat = [s for s in self.slots if s.flat]
        even, rest, ew = self.even, [s for s in flat if not s.even_rows], self.even_width
        if even and not rest:   # no padding anywhere: the shards side by side, one op
            send = torch.cat([s.param._local.reshape(-1) for s in even]).to(dtype)
        else:   # this rank's shards, one after another, each padded to the longest member's
            send = torch.zeros(self.width, dtype=dtype, device=comm_device_of(self.mesh))
            if even:
                torch.cat([s.param._local.reshape(-1) for s in even], out=send[:ew])
            for s in rest:
                local = s.param._local
                send[s.offset:s.offset + local.numel()].copy_(local.reshape(-1))
        numels = self.numels
        log, name = self.schedule.log, self.name

        def run() -> torch.Tensor:
            before = len(comm.counters.calls)
            buf = send.new_empty(n * self.width)
            if self.width:
                comm.all_gather(send, (self.axis,), numels=numels, out=buf)
            log.append(("all_gather", name, phase, tuple(comm.counters.calls[before:])))
            rows = buf.view(n, self.width)
            if even:   # split on dim 0 in equal pieces: each gathered local is the members' rows, one op for all
                with torch.no_grad():
                    torch.split_with_sizes_copy(rows[:, :ew], [s.sizes[0] for s in even], dim=1,
                                                out=[_refill_target(s, buf, n) for s in even])
            for s in rest:   # copy out into the gathered locals (their storage again, when freed)
                pieces = [buf[m * self.width + s.offset:][:s.sizes[m]].view(s.shapes[m]) for m in range(n)]
                _refill(s, torch.cat(pieces, dim=s.dim))
            return send.new_empty(0)   # nothing of the buffer outlives the copy-out

        self.gathering = pending.submit(comm, run, (0,), dtype, send.device, axes=(self.axis,))
        in_group = {k for g in self.groups for k in g.at}
        self.planned = [redistribute_raw(_cast(s.param, self.param_dtype), s.compute, async_op=True, snapshot=False)
                        if not s.flat and s.dim is not None and k not in in_group else None
                        for k, s in enumerate(self.slots)]
        self.grouped = []
        for g in self.groups:   # one redistribution per group: the slots' stored pieces side by side
            side = torch.cat([_cast(s.param, self.param_dtype)._local.reshape(1, -1) for s in g.slots], dim=1)
            matrix = GlobalTensor(side, self.mesh, g.stored, (g.rows, g.width))
            self.grouped.append(redistribute_raw(matrix, g.compute, async_op=True, snapshot=False))

    def current_versions(self) -> tuple[tuple[int, int, int], ...]:
        """The stored parameters' version counters and their local tensors' (in-place changes bump them: the
        optimizer's through the parameter, `sbp.load`'s and ``p.to_local()``'s through the local; writes through
        ``p.data`` bump neither, as autograd does not see them either), and which local tensor each holds (a
        new one after ``model.double()`` / ``model.to(...)``, which swap it)."""
        return tuple((s.param._version, s.param._local._version, id(s.param._local)) for s in self.slots)

    def drop_stale(self) -> None:
        """Free a gather (done or on the way) issued before the stored parameters changed."""
        if self.state != "sharded" and self.versions != self.current_versions():
            if self.state == "gathering":   # a prefetch issued before the parameters changed: drop it
                self._wait_gather()
            self.reshard()

    def unshard(self, phase: str) -> None:
        """Issue (if not yet) and wait for this unit's gather: every slot's gathered local holds values."""
        self.drop_stale()
        self.issue_gather(phase)
        if self.state != "gathering":
            return
        self._wait_gather()

    def _wait_gather(self) -> None:
        self.gathering.wait()
        for s, g in zip(self.slots, self.planned):
            if g is not None:
                _refill(s, g.wait()._local)
            elif s.dim is None:
                s.local = _cast(s.param, self.param_dtype)._local
        for g, moved in zip(self.groups, self.grouped):
            value = moved.wait()._local   # (this rank's compute rows, width)
            for s, (lo, n) in zip(g.slots, g.cols):
                piece = value[:, lo:lo + n].reshape(-1)   # (a view of the group's buffer: own storage at first)
                _refill(s, piece if s.local is not None else piece.clone())
        self.gathering, self.planned, self.grouped = None, [], []
        self.state = "gathered"

    def gathered(self, local: bool) -> tuple[torch.Tensor, ...]:
        """The gathered parameters as the unit's computation sees them: global tensors with the compute
        placements, or (`local`: computing on the batch share) the plain gathered locals."""
        # aliases of the gathered locals, not the locals or views of them: their own version counters, so a
        # refill of the storage (the backward gather) trips no autograd check on views taken in the forward
        if local:
            return tuple(_alias(s.local) for s in self.slots)
        return tuple(GlobalTensor(_alias(s.local), self.mesh, s.compute, tuple(s.param.shape)) for s in self.slots)

    def gathered_bytes(self) -> int:
        """Bytes of this unit's gathered copies (what a gather makes it hold; computed once)."""
        if self._gathered_bytes is None:
            itemsize = self.param_dtype.itemsize if self.param_dtype is not None else None
            self._gathered_bytes = sum(_compute_numel(s, self.mesh) * (itemsize or s.param.element_size())
                                       for s in self.slots if s.dim is not None)
        return self._gathered_bytes

    def reshard(self) -> None:
        """Free the gathered copies (their storage shrinks to nothing; tensors saved for backward keep the
        storage object, which the next gather fills again)."""
        if self.state != "gathered":
            return
        for s in self.slots:
            if s.dim is not None and s.local is not None:
                s.local.untyped_storage().resize_(0)
        self.state, self.kept = "sharded", False

    # ---- backward --------------------------------------------------------------------------------
    def reduce_grads(self, grads: tuple[Optional[torch.Tensor], ...], local: bool = False,
                     used: Optional[list[bool]] = None
                     ) -> tuple[tuple[Optional[torch.Tensor], ...], Optional[_Unused]]:
        """The gradients of the stored parameters from those of the gathered ones: one queued reduce_scatter
        of the unit's flattened gradients on the axis (and an all_reduce on the replicate axes).

        `used` (default: the slots whose gradient is given) says which slots this rank's backward reached.
        Their "used" flags travel in the same buffer (`_GradLayout`); a flat slot not reached sends zeros.
        Returns the stored gradients and, where this rank did not reach some trainable slot, the `_Unused`
        record of those: their gradient is the reduced one only where the reduced flag says another rank
        reached them (`_UnitGather.backward` decides, as FSDP2 leaves ``.grad`` None where no rank did)."""
        comm, n = self.mesh.binding, self.mesh.shape[self.axis]
        me = self.mesh.coord[self.axis]
        layout = self.grad_layout()
        flat, offsets, width, even = layout.live, layout.offsets, layout.width, layout.even
        dw, flagged = layout.data_width, layout.flagged
        out: list[Optional[torch.Tensor]] = [None] * len(self.slots)
        # (the gathered dtype where no gradient came: a dtype every rank agrees on)
        dtype = self.reduce_dtype or self.param_dtype or next((g.dtype for g in grads if g is not None),
                                                              self.slots[0].param.dtype)
        device = comm_device_of(self.mesh)
        if used is None:
            used = [g is not None for g in grads]
        unsure = {k: j for j, k in enumerate(flagged) if not used[k]}
        flags = None
        if flagged:   # (n, flags): this rank's flags, the same in every member's piece
            flags = layout.ones.get((dtype, device))
            if flags is None:
                flags = layout.ones[(dtype, device)] = torch.ones(1, len(flagged), dtype=dtype,
                                                                  device=device).expand(n, -1)
            if unsure:
                flags = torch.tensor([[0.0 if k in unsure else 1.0 for k in flagged]], dtype=dtype,
                                     device=device).expand(n, -1)
        packed = bool(even) and all(grads[k] is not None for k, _ in even)
        if packed:   # split on dim 0 in equal pieces: member m's piece of each is the m-th run of its gradient
            parts = [self._grad_parts(s, grads[k], local).to(dtype).reshape(n, s.sizes[0]) for k, s in even]
        if packed and layout.even_width == dw:   # the gradients and the flags side by side: one op
            buf = torch.cat(parts + ([flags] if flags is not None else []), dim=1).reshape(-1)
        else:
            buf = torch.zeros(n * width, dtype=dtype, device=device)
            if packed:
                buf.view(n, width)[:, :layout.even_width].copy_(torch.cat(parts, dim=1))
            if flags is not None:
                buf.view(n, width)[:, dw:].copy_(flags)
        for k, s in flat:
            if packed and s.even_rows:
                continue
            g = self._grad_parts(s, grads[k], local)
            if g is None:   # (not reached on this rank: zeros)
                continue
            lo = offsets[k]
            if s.even_rows:   # split on dim 0 in equal pieces: member m's piece is the m-th run of the flat gradient
                buf.view(n, width)[:, lo:lo + s.sizes[0]].copy_(g.reshape(n, s.sizes[0]))
                continue
            start = 0
            for m in range(n):   # member m's piece of the gathered gradient, along the split dim
                length = s.shapes[m][s.dim] if s.shapes[m] else 0
                piece = g.narrow(s.dim, start, length)
                buf[m * width + lo:][:s.sizes[m]].view(s.shapes[m]).copy_(piece)
                start += length
        done = set()
        for group in self.groups:   # one redistribution per group where its gradients line up
            done.update(self._reduce_group(group, grads, out, local))
        for k, s in enumerate(self.slots):
            if not s.flat and grads[k] is not None and k not in done:   # planned slots: their own (async)
                g = self._global_grad(s, grads[k], local)
                out[k] = _cast(redistribute_raw(g, s.stored, async_op=True, snapshot=False), s.param.dtype)
        log, name, axis, rep = self.schedule.log, self.name, self.axis, self.replicate_axes
        numels = layout.numels

        def run() -> torch.Tensor:
            before = len(comm.counters.calls)
            seg = comm.reduce_scatter(buf, (axis,), "sum", numels=numels) \
                if width else buf[:0]
            if rep and seg.numel():
                seg = comm.all_reduce(seg, rep, "sum", inplace=True)
            log.append(("reduce_scatter", name, "backward", tuple(comm.counters.calls[before:])))
            return seg

        seg = pending.submit(comm, run, (width,), dtype, buf.device, axes=(axis, *rep))
        for k, s in flat:
            if grads[k] is None and k not in unsure:
                continue
            lo, shape, want = offsets[k], s.shapes[me], s.param.dtype
            local = seg.then(lambda v, lo=lo, shape=shape, want=want: v[lo:lo + int(torch.Size(shape).numel())]
                             .view(shape).to(want), shape, want)
            out[k] = GlobalTensor(local, self.mesh, s.stored, tuple(s.param.shape))
        self.schedule.log.append(("issue_reduce_scatter", self.name, "backward"))
        unused = None
        if unsure and flags is not None:
            unused = _Unused(seg.then(lambda v: v[dw:], (len(flagged),)), unsure)
        return tuple(out), unused

    def grad_layout(self) -> _GradLayout:
        """The flat gradient buffer's layout for the slots' current requires_grad flags (made once per flags;
        the flags are the module's, the same on every rank). The "used" flags ride along where the unit
        reduce-scatters gradients at all (some trainable flat slot holds elements): one per trainable slot."""
        key = tuple(s.param.requires_grad for s in self.slots)
        found = self.grad_layouts.get(key)
        if found is None:
            live = sorted(((k, s) for k, s in enumerate(self.slots) if s.flat and s.param.requires_grad),
                          key=lambda ks: ks[1].offset)
            offsets, width = {}, 0
            for k, s in live:
                offsets[k], width = width, width + max(s.sizes, default=0)
            flagged = [k for k, s in enumerate(self.slots) if s.param.requires_grad] if width else []
            even = [(k, s) for k, s in live if s.even_rows]
            numels = [sum(s.sizes[m] for _, s in live) + len(flagged) for m in range(self.mesh.shape[self.axis])]
            found = self.grad_layouts[key] = _GradLayout(live, offsets, width + len(flagged), even,
                                                         sum(s.sizes[0] for _, s in even), numels, width, flagged)
        return found

    def _reduce_group(self, g: _Group, grads: tuple[Optional[torch.Tensor], ...],
                      out: list[Optional[torch.Tensor]], local: bool = False) -> list[int]:
        """The stored gradients of group `g`'s slots by one queued redistribution of their gradients side by
        side (into `out`); returns the positions done -- none where the gradients do not line up (one missing,
        differing layouts or dtypes, a split the stored layout lacks): those go one by one."""
        if any(grads[k] is None for k in g.at):
            return []
        gs = [self._global_grad(s, grads[k], local) for k, s in zip(g.at, g.slots)]
        pls, dtype = gs[0].placements, gs[0].dtype
        split = [i for i, p in enumerate(pls) if isinstance(p, Split)]
        if any(t.placements != pls or t.dtype != dtype for t in gs) or \
                any(pls[i] is not Split(0) or g.stored[i] is not Split(0) for i in split):
            return []
        rows = g.rows // math.prod(self.mesh.shape[i] for i in split)   # this rank's rows of the matrix
        side = torch.cat([pending.ready(t._local).reshape(rows, -1) for t in gs], dim=1)
        moved = redistribute_raw(GlobalTensor(side, self.mesh, pls, (g.rows, g.width)), g.stored, async_op=True,
                                 snapshot=False)
        local = moved._local   # (1, width): the stored pieces side by side
        for k, s, (lo, n) in zip(g.at, g.slots, g.cols):
            want = s.param.dtype
            piece = (lambda v, lo=lo, n=n, want=want: v[:, lo:lo + n].reshape(-1).to(want))
            mine = local.then(piece, (n,), want) if isinstance(local, PendingTensor) else piece(local)
            out[k] = GlobalTensor(mine, self.mesh, s.stored, tuple(s.param.shape))
        return list(g.at)

    def _global_grad(self, s: _Slot, grad: torch.Tensor, local: bool) -> GlobalTensor:
        """The gradient of a gathered parameter as a global tensor: computed on local shares (`local`), a plain
        gradient is this rank's part of the sum over the batch (`P(sum)` on the axis and the replicate axes) of
        its gathered piece (the compute placements elsewhere); otherwise a plain gradient is the full value."""
        if local and not isinstance(grad, GlobalTensor):
            return GlobalTensor(grad, self.mesh, self._summed(s), tuple(s.param.shape))
        return _as_global(grad, self.mesh, s)

    def _summed(self, s: _Slot) -> tuple[Placement, ...]:
        return tuple(Partial("sum") if a == self.axis or a in self.replicate_axes else
                     (Broadcast() if isinstance(p, Partial) else p) for a, p in enumerate(s.compute))

    def _summed_grad(self, s: _Slot, grad: torch.Tensor, local: bool) -> GlobalTensor:
        """The gathered gradient laid out `P(sum)` on the axis and the replicate axes (this rank's part of the
        sum over the batch), in `reduce_dtype`."""
        g = self._global_grad(s, grad, local)
        want = self._summed(s)
        if g.placements != want:
            g = redistribute_raw(g, want)
        return _cast(g, self.reduce_dtype)

    def _grad_parts(self, s: _Slot, grad: Optional[torch.Tensor], local: bool) -> Optional[torch.Tensor]:
        """This rank's part of the gathered gradient, laid out `P(sum)` on the axis and the replicate axes."""
        return None if grad is None else pending.ready(self._summed_grad(s, grad, local)._local)

    def reduce_held(self) -> None:
        """Reduce the gradients that backwards without sync held, at the end of a backward with sync that did not
        reach this unit (one that did reduced them with its own, `_UnitGather.backward`): into ``.grad``, where
        some rank's micro-batch reached the parameter, as a single process accumulates them."""
        used, self.held_used = self.held_used, None
        out, unused = self.reduce_grads(tuple(self.with_held((None,) * len(self.slots), False)), False, used)
        for k, (s, g) in enumerate(zip(self.slots, out)):
            if g is not None and (unused is None or k not in unused.at or unused.used(k)):
                _accumulate(s.param, g)

    def with_held(self, grads: tuple[Optional[torch.Tensor], ...], local: bool) -> list[Optional[GlobalTensor]]:
        """The gradients plus the held ones (which are let go), each in its `P(sum)` layout."""
        held, self.held = self.held or [None] * len(self.slots), None
        out: list[Optional[GlobalTensor]] = []
        for s, g, h in zip(self.slots, grads, held):
            part = None if g is None else self._summed_grad(s, g, local)
            if part is not None and h is not None:
                part = GlobalTensor(pending.ready(h._local) + pending.ready(part._local), self.mesh, h._placements,
                                    tuple(h.shape))
            out.append(h if part is None else part)
        return out


def _compute_shape(s: _Slot) -> tuple[int, ...]:
    """The slot's gathered local shape: the members' stored pieces joined on the split dim."""
    shape = list(s.shapes[0])
    shape[s.dim] = sum(piece[s.dim] for piece in s.shapes)
    return tuple(shape)


def _compute_numel(s: _Slot, mesh: DeviceMesh) -> int:
    return int(torch.Size(local_shape(tuple(s.param.shape), mesh.shape, s.compute, mesh.coord)).numel())


def memory_report(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
    """This rank's bytes, by tensor storage (each storage once): the stored parameters, their gradients,
    the optimizer's states, and the most gathered copies held at once in the last step (`peak_gathered`,
    every unit under `module`'s root); ``"total"`` adds them up, ``"largest_two_units"`` is what the two
    largest units hold when gathered.

    >>> import torch, sbp, sbp.testing
    >>> sbp.load_torch_layers()
    >>> def fn(mesh):
    ...     m = sbp.nn.fully_shard(torch.nn.Linear(4, 2, bias=False), mesh)
    ...     m(torch.ones(2, 4)).sum().backward()
    ...     r = memory_report(m)
    ...     return r["params"], r["grads"], r["peak_gathered"]
    >>> sbp.testing.spmd(fn, (2,), names=("dp",))[0]        # 4 of 8 floats stored, the whole 8 gathered
    (16, 20, 32)

    (The gradient's 4 floats are a view of this rank's reduced piece, which ends with the unit's one "used"
    flag per trainable parameter: 1 float here.)
    """
    unit = unit_of(module)
    pending.wait_all(unit.mesh.binding)
    seen: set[int] = set()

    def size(t: Optional[torch.Tensor]) -> int:
        if t is None:
            return 0
        local = pending.ready(t._local) if isinstance(t, GlobalTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = list(module.parameters())
    out = {"params": sum(size(p) for p in params), "grads": sum(size(p.grad) for p in params)}
    out["optimizer"] = sum(size(v) for state in (optimizer.state.values() if optimizer else ())
                           for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    out["peak_gathered"] = unit.schedule.peak_gathered
    out["total"] = sum(out.values())
    out["largest_two_units"] = sum(sorted((u.gathered_bytes() for u in unit.schedule.units), reverse=True)[:2])
    return out


def _as_global(grad: torch.Tensor, mesh: DeviceMesh, s: _Slot) -> GlobalTensor:
    if isinstance(grad, GlobalTensor):
        return grad
    pls = tuple(Broadcast() for _ in range(mesh.ndim))   # a plain gradient is the full value on every rank
    return GlobalTensor(grad[local_slices(tuple(grad.shape), mesh.shape, pls, mesh.coord)], mesh, pls,
                        tuple(grad.shape))


def _cast(t: GlobalTensor, dtype: Optional[torch.dtype]) -> GlobalTensor:
    if dtype is None or t.dtype == dtype:
        return t
    local = t._local
    return GlobalTensor(local.to(dtype) if not isinstance(local, PendingTensor) else
                        local.then(lambda v: v.to(dtype), tuple(local.shape), dtype), t._mesh, t._placements,
                        tuple(t.shape))


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor on `t`'s storage with `t`'s geometry (not a view: its own version counter)."""
    if isinstance(t, PendingTensor):
        return t
    return t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _refill(s: _Slot, value: torch.Tensor) -> None:
    """Put `value` into the slot's gathered local, reusing its storage (grown back after a reshard): tensors
    that backward saved hold that storage object."""
    if s.local is None or s.local.dtype != value.dtype:
        s.local = value.contiguous()
        return
    with torch.no_grad():
        _refill_target(s, value, 0).copy_(value)


def _refill_target(s: _Slot, like: torch.Tensor, rows: int) -> torch.Tensor:
    """The slot's gathered local (its storage grown back after a reshard; made on first use, with `like`'s
    dtype and device), as `rows` rows if given: where the members' pieces of a dim-0 split are copied to."""
    if s.local is None or s.local.dtype != like.dtype:
        s.local = like.new_empty(_compute_shape(s))
    storage = s.local.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(s.local.numel() * s.local.element_size())
    return s.local.view(rows, -1) if rows else s.local


def comm_device_of(mesh: DeviceMesh) -> torch.device:
    device = getattr(mesh.binding, "device", None)
    return device if isinstance(device, torch.device) else torch.device(mesh.device_type)


class _UnitGather(torch.autograd.Function):
    """Stored parameters -> gathered ones (already filled by `Unit.unshard`); backward: `Unit.reduce_grads`."""

    @staticmethod
    def forward(ctx, unit: Unit, local: bool, *stored: torch.Tensor):  # type: ignore[override]
        ctx.unit, ctx.local = unit, local
        out = unit.gathered(local)
        # a frozen parameter's gathered copy takes no gradient (none computed, none reduced: as FSDP2); a
        # trainable one the backward does not reach gets None here (see `backward`)
        ctx.frozen = tuple(not p.requires_grad for p in stored)
        ctx.mark_non_differentiable(*[g for g, frozen in zip(out, ctx.frozen) if frozen])
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        # A trainable parameter this backward did not reach (None) takes part in the unit's reduction all the
        # same -- ranks may differ in what they use (a mixture of experts) and every rank's collectives must
        # match -- as zeros, with a "used" flag of 0 in the same buffer (`Unit.reduce_grads`): where no rank
        # reached it its .grad is left alone (None, as FSDP2), else it gets the reduced gradient.
        unit: Unit = ctx.unit
        grads = tuple(None if frozen else g for g, frozen in zip(grads, ctx.frozen))
        used = [g is not None for g in grads]
        if unit.held_used is not None:   # reached in an earlier micro-batch (held, no sync) counts too
            used = [a or b for a, b in zip(used, unit.held_used)]
        if not all(used[k] or frozen for k, frozen in enumerate(ctx.frozen)):   # a parameter the graph missed
            # a flat slot sends zeros from the buffer; the others (their own redistributions), or all where no
            # flags travel (no trainable flat elements), take zeros made here, as every rank must send its part
            flags = unit.grad_layout().width > 0
            zeros = [g is None and not frozen and not (flags and s.flat)
                     for g, frozen, s in zip(grads, ctx.frozen, unit.slots)]
            if any(zeros):
                like = unit.gathered(ctx.local)
                grads = tuple(torch.zeros_like(t) if z else g for g, t, z in zip(grads, like, zeros))
        if unit.gradient_sync:
            unit.held_used = None
            out, unused = unit.reduce_grads(grads if unit.held is None else tuple(unit.with_held(grads, ctx.local)),
                                            ctx.local, used)
        else:   # held (this rank's parts, no communication), reduced by a later backward with sync
            unit.held, unit.held_used, out, unused = unit.with_held(grads, ctx.local), used, None, None
        _after_backward(unit)
        if out is None:
            return (None, None) + (None,) * len(grads)
        return (None, None) + differentiable_once(_store_grads(unit, out, unused), grads,
                                                  "sbp.nn.fully_shard's gradient reduction")


def _after_backward(unit: Unit) -> None:
    """A unit's backward is done: its gathered copies freed, or kept for the next forward
    (`set_reshard_after_backward(False)`); the module holds its stored parameters again."""
    if unit.reshard_after_backward:
        unit.reshard()
    elif unit.state == "gathered":
        unit.kept = True
    _place(unit)


def _store_grads(unit: Unit, grads: tuple[Optional[torch.Tensor], ...], unused: Optional[_Unused] = None
                 ) -> tuple[Optional[torch.Tensor], ...]:
    """Put the stored parameters' gradients into their ``.grad`` here, as FSDP2 does, and hand autograd None
    for them: autograd's own accumulation would detach each one (an op dispatch per parameter and step) and
    call its leaf hook. Only where that is all autograd would do -- a ``.backward()`` that accumulates into
    this leaf (not ``autograd.grad``), no ``create_graph``, no hooks on the parameter but sbp's layout rule
    (a no-op here: the gradients already have the stored placements) -- else the gradient goes back to
    autograd as before. An existing ``.grad`` is added to in place, as autograd does.

    The `unused` slots (this rank's backward did not reach them) keep a gradient only where another rank's
    did: known once the reduction has run, so where the unit would store them they are stored at the end of
    the backward (`Schedule.finish_backward`: the reduction keeps running behind the rest of the backward);
    where autograd takes the gradient, it is waited for here and is None where no rank reached the parameter."""
    out = list(grads)
    if unused is not None:
        task = torch._C._current_graph_task_id()
        later = not torch.is_grad_enabled() and unit.schedule.finish_task == task
        for k in unused.at:
            g, s = out[k], unit.slots[k]
            if g is None:
                continue
            if later and isinstance(g, GlobalTensor) and _accumulates_plainly(s):
                unit.schedule.unused.append((task, s.param, g, unused, k))
                out[k] = None
            elif not unused.used(k):
                out[k] = None
    if torch.is_grad_enabled():   # create_graph: the gradients are part of a graph, autograd's to keep
        return tuple(out)
    for k, (s, g) in enumerate(zip(unit.slots, out)):
        if g is None or not isinstance(g, GlobalTensor) or not _accumulates_plainly(s):
            continue
        _accumulate(s.param, g)
        out[k] = None
    return tuple(out)


def _accumulate(p: torch.Tensor, g: GlobalTensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        with torch.no_grad():
            p.grad.add_(g)


def _accumulates_plainly(s: _Slot) -> bool:
    """Whether autograd would only store (or add) the gradient into `s.param.grad` in this backward: its
    accumulator runs (`_will_engine_execute_node`: refused for ``autograd.grad``, which captures leaf
    gradients instead) and the parameter has no hooks but sbp's leaf layout rule."""
    p = s.param
    if s.accumulator is None or p._post_accumulate_grad_hooks or \
            len(p._backward_hooks or ()) > (1 if p._notes is not None and p._notes.leaf_rule else 0):
        return False
    try:
        return torch._C._will_engine_execute_node(s.accumulator)
    except RuntimeError:   # autograd.grad with this leaf among its inputs
        return False


class _PreBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs before the unit's own: gather (prefetch the next)."""

    @staticmethod
    def forward(ctx, unit: Unit, *xs: torch.Tensor):  # type: ignore[override]
        ctx.unit = unit
        return tuple(GlobalTensor(x._local, x._mesh, x._placements, tuple(x.shape)) if isinstance(x, GlobalTensor)
                     else x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        ctx.unit.schedule.pre_backward(ctx.unit)
        return (None,) + grads


class Schedule:
    """The units under one root, in forward order (recorded each step; module order before the first), and
    the log of the last step: what was issued, run and computed, in order (tests read the prefetch order
    and the collectives per unit from it)."""

    def __init__(self, root: Unit) -> None:
        self.root = root
        self.units: list[Unit] = [root]
        self.order: list[Unit] = []      # forward order of the step in progress
        self.log: list[tuple] = []
        self.peak_gathered = 0           # most bytes of gathered copies held (or on the way) at once, this step
        self.finish_task = -1            # the backward (graph task id) `finish_backward` is queued to end
        # whether this step prefetches the next unit's gather (a batch the dp size divides, see `_even_batch`)
        self.prefetch = True
        # (graph task, parameter, gradient, `_Unused`, slot): gradients of parameters a unit's backward did not
        # reach on this rank, stored at the end of that backward where another rank reached them (`_store_grads`)
        self.unused: list[tuple[int, torch.Tensor, GlobalTensor, _Unused, int]] = []

    def note_memory(self) -> None:
        """Update `peak_gathered` with the gathered copies held or being gathered now."""
        now = sum(u.gathered_bytes() for u in self.units if u.state != "sharded")
        self.peak_gathered = max(self.peak_gathered, now)

    def neighbour(self, unit: Unit, step: int) -> Optional[Unit]:
        order = self.order if unit in self.order and step < 0 else self.units
        i = order.index(unit) + step if unit in order else -1
        return order[i] if 0 <= i < len(order) else None

    def pre_forward(self, unit: Unit) -> None:
        if unit is self.root:
            if self.order:
                self.units = self.order + [u for u in self.units if u not in self.order]
            self.order, self.log, self.peak_gathered = [], [], 0
            for u in self.units:
                u.backward_started = False
                if u is not self.root and u.state == "gathered" and not u.kept:
                    u.reshard()   # left gathered by a forward without backward
        self.order.append(unit)
        self.log.append(("forward_start", unit.name))
        unit.issue_gather("forward")
        nxt = self.neighbour(unit, 1) if self.prefetch else None
        if nxt is not None:
            nxt.issue_gather("forward")   # prefetch: it runs while this unit computes
        self.note_memory()
        unit.unshard("forward")

    def post_forward(self, unit: Unit) -> None:
        self.log.append(("forward_end", unit.name))
        if unit.reshard_after_forward and unit is not self.root:
            unit.reshard()

    def pre_backward(self, unit: Unit) -> None:
        # (not after a create_graph backward: the graph it makes reads the gathered copies in the next backward)
        task = torch._C._current_graph_task_id()   # (per backward: one that raised never ran its callback)
        if task != self.finish_task and not compiled_autograd.in_compiled_autograd_region and \
                not torch.is_grad_enabled():
            self.finish_task = task
            Variable._execution_engine.queue_callback(self.finish_backward)
        if unit.backward_started:   # another use of the unit in this backward, or a retained graph: gather again
            unit.unshard("backward")
            return
        unit.backward_started = True
        self.log.append(("backward_start", unit.name))
        unit.issue_gather("backward")
        prev = self.order[-1] if unit is self.root and len(self.order) > 1 else self.neighbour(unit, -1)
        if prev is not None and prev is not unit and self.prefetch:
            prev.issue_gather("backward")   # prefetch in backward: the unit before runs next
        self.note_memory()
        unit.unshard("backward")
        if unit.bound is not None:   # a recomputed forward (activation checkpointing) reads the gathered parameters
            _place(unit, unit.bound)

    def finish_backward(self) -> None:
        """When a backward ends: every unit holds its stored parameters again, its gathered copies freed. Units
        whose gradients came back did so themselves (`_UnitGather.backward`); this covers the others: a unit
        with no trainable parameter, one ``autograd.grad`` did not reach, a prefetch the backward never used.
        Then the gradients of parameters a unit's backward did not reach on this rank go into ``.grad`` where
        another rank's did (their units' "used" flags, reduced with the gradients: `_store_grads`). A unit that
        holds gradients of backwards without sync which this backward with sync did not reach (a branch not
        taken, a unit frozen since) reduces them here (`Unit.reduce_held`)."""
        for u in self.units:
            if u.state == "gathering":
                u._wait_gather()
            if u.state == "gathered" or any(_owner_of(u, owner_id)._parameters.get(name) is not s.param
                                            for (owner_id, name), s in u.tied.items()):
                _after_backward(u)
            if u.gradient_sync and u.held is not None:   # held, and this backward with sync did not reach it
                u.reduce_held()
        if self.unused:   # (entries of a backward that raised before its end are dropped)
            task, entries, self.unused = torch._C._current_graph_task_id(), self.unused, []
            for t, p, g, unused, k in entries:
                if t == task and unused.used(k):
                    _accumulate(p, g)


MIXED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)   # param_dtype / reduce_dtype


def fully_shard(module: nn.Module, mesh: Optional[DeviceMesh] = None, axis: "int | str" = "dp", *,
                reshard_after_forward: Optional[bool] = True,
                param_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None,
                local_batch: Optional[bool] = None, mp_policy: Optional[object] = None,
                offload_policy: Optional[object] = None, shard_placement_fn: Optional[object] = None,
                ignored_params: Optional[object] = None) -> nn.Module:
    """Shard `module`'s parameters on `mesh`'s `axis` (FSDP); apply to each block first, then to the root.

    Returns `module`. Parameters may be plain (every rank holds the same full init) or global tensors
    from `parallelize` (their tensor-parallel placements stay). See the module docstring for the schedule.

    `local_batch` (for a unit without inner units whose inputs are the batch: `S(0)` on `axis` and the
    replicate axes, `B` elsewhere): a unit whose computation is independent per sample runs on this rank's
    share of the batch as plain tensors, as FSDP2's does -- global inputs become their local share, plain
    outputs the batch `S(0)` again -- skipping sbp's per-op dispatch. ``None`` (default): verified on the
    unit's first forward on the batch, which runs on global tensors (exact) and once more on the local shares
    without gradients; where every rank's outputs match bitwise, the unit computes locally from then on, else
    on global tensors for good (an op mixing samples, a random op, the batch length used as a number). A unit
    with tensor-parallel parameters qualifies where every layer `parallelize` styled in it is `Colwise` or
    `Rowwise`: on local shares those layers compute on their local pieces and `parallelize`'s hooks make the
    tp collectives (`sbp.nn.tp_local`), as FSDP2 + `parallelize_module` does; its check also requires that its
    Broadcast parameters and inputs never meet the tp-split activations (`tp_local.SplitTracker`). ``True``:
    local without the check (the user's promise; not for tensor-parallel units); ``False``: global tensors
    always. `mp_policy`: FSDP2's ``MixedPrecisionPolicy`` (or any object with its fields), another spelling
    of `param_dtype` / `reduce_dtype` (floating inputs are cast to `param_dtype`, as its default
    ``cast_forward_inputs=True``; ``output_dtype`` and ``cast_forward_inputs=False`` are refused). FSDP2's
    `offload_policy`, `shard_placement_fn` and `ignored_params` have no counterpart: anything but None is an
    `SbpError` saying why (a mesh is required: there is no default world mesh). Under
    torch.compile the unit's hooks run eagerly between graphs (a graph break at each unit boundary):
    compile the root, or each block (``block.compile(...)``; with ``fullgraph=True`` before `fully_shard`).

    >>> import copy, torch, sbp, sbp.testing
    >>> _ = sbp.load_torch_layers(), torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    >>> def fn(mesh):
    ...     m = copy.deepcopy(model)
    ...     sbp.nn.fully_shard(m[0], mesh); sbp.nn.fully_shard(m[2], mesh); sbp.nn.fully_shard(m, mesh)
    ...     m(torch.ones(4, 6)).sum().backward()                # the full batch: S(0) on dp
    ...     return m[0].weight.placements, m[0].weight.grad.placements, tuple(m[0].weight.to_local().shape)
    >>> sbp.testing.spmd(fn, (2,), names=("dp",))
    [((S(0),), (S(0),), (4, 6)), ((S(0),), (S(0),), (4, 6))]
    """
    if not isinstance(module, nn.Module):
        raise SbpError(f"fully_shard needs an nn.Module, got {type(module).__name__}")
    for name, value, why in (("offload_policy", offload_policy, "parameters stay on the mesh's device"),
                             ("shard_placement_fn", shard_placement_fn, "each parameter's split is sbp's (dim 0 "
                              "of its tensor-parallel piece on the sharding axis)"),
                             ("ignored_params", ignored_params, "every parameter of a unit is sharded; keep one "
                              "whole by holding it in a module outside the units")):
        if value is not None:
            raise SbpError(f"fully_shard({name}=...) is FSDP2's and has no counterpart here: {why}")
    if not isinstance(mesh, DeviceMesh) or mesh.binding is None:
        raise SbpError(f"fully_shard needs a bound sbp.DeviceMesh (sbp.init_mesh or sbp.testing.spmd), got {mesh!r}")
    try:
        a = mesh.axis(axis)
    except MeshError as e:
        raise MeshError(f"fully_shard: the mesh has no axis {axis!r} to shard on (mesh shape {mesh.shape}, axis names "
                        f"{mesh.names}); name the data-parallel axis: fully_shard(module, mesh, axis=...)") from e
    if mesh.coord is None:
        raise MeshError(f"fully_shard: this rank is outside the mesh (its ranks: {list(mesh.ranks)}); a module is "
                        f"sharded by the ranks of its mesh: call fully_shard on those ranks only")
    if module in _UNITS:
        original = type(module).__bases__[1].__name__   # (the class before fully_shard made it FSDP<class>)
        raise SbpError(f"fully_shard was already applied to this {original}; apply it once per module (blocks "
                       f"first, then the root)")
    if reshard_after_forward is None:   # FSDP2's default: resharded after forward but in the root, as True is here
        reshard_after_forward = True
    if not isinstance(reshard_after_forward, bool):
        raise SbpError(f"fully_shard(reshard_after_forward={reshard_after_forward!r}): needs True, False or None (as "
                       f"True: the root keeps its copies); resharding to a smaller group after forward, FSDP2's int "
                       f"form, is not supported")
    if local_batch is not None and not isinstance(local_batch, bool):
        raise SbpError(f"fully_shard(local_batch={local_batch!r}): needs None (verify on the first forward), True or "
                       f"False")
    if mp_policy is not None:
        param_dtype, reduce_dtype = _from_policy(mp_policy, param_dtype, reduce_dtype)
    for dtype, what in ((param_dtype, "param_dtype"), (reduce_dtype, "reduce_dtype")):
        if dtype is not None and dtype not in MIXED_DTYPES:   # float8 computes no ops, reduces no sums on CPU
            raise SbpError(f"fully_shard({what}={dtype!r}): needs None or one of "
                           f"{', '.join(map(str, MIXED_DTYPES))} (the dtypes torch computes and reduces in)")
    unit = Unit(module, mesh, a, reshard_after_forward, param_dtype, reduce_dtype, "<root>")
    inner = [_UNITS[m] for m in module.modules() if m is not module and m in _UNITS]
    inner_modules = {id(u.module) for u in inner}
    for path, owner in _modules_outside(module, inner_modules):
        for name, param in list(owner.named_parameters(recurse=False)):
            owner._parameters[name] = _adopt(unit, owner, name, param, f"{path}.{name}".lstrip("."))
    _layout_buffer(unit)
    tp = [(s.name, s.compute) for s in unit.slots if any(not isinstance(p, Broadcast) for p in s.compute)]
    if local_batch is None and not inner and (not tp or tp_local.local_styles(module.modules())):
        unit.auto = "unverified"
    if local_batch:
        if tp or inner:
            raise SbpError(f"fully_shard(local_batch=True) computes on plain tensors: it needs a unit without "
                           f"inner units and without tensor-parallel parameters, got inner units "
                           f"{[u.name for u in inner]} and parameters {tp} (valid: a block on a data-parallel mesh)")
        unit.local_batch = True
    _UNITS[module] = unit
    _add_methods(module)
    refuse(module, "copy.deepcopy or torch.save of a fully_shard module is not supported (its units hold gathers, "
                   "hooks and a schedule bound to the original), as with FSDP2: deep-copy the model before "
                   "fully_shard; move weights with state_dict() / load_state_dict() (per-rank files) or "
                   "sbp.save / sbp.load, which reshard")
    for path, m in module.named_modules():   # names for the log: paths under the outermost unit
        if m in _UNITS:
            _UNITS[m].name = path or "<root>"
    for u in inner:   # this unit is their root now: one schedule, forward order module order until recorded
        u.schedule = unit.schedule
    unit.schedule.units = [unit] + [u for u in inner]
    _install_hooks(unit)
    return module


def _from_policy(policy: object, param_dtype: Optional[torch.dtype],
                 reduce_dtype: Optional[torch.dtype]) -> tuple[Optional[torch.dtype], Optional[torch.dtype]]:
    """`fully_shard`'s (param_dtype, reduce_dtype) from FSDP2's ``MixedPrecisionPolicy`` `policy`."""
    if param_dtype is not None or reduce_dtype is not None:
        raise SbpError("fully_shard: give mp_policy= or param_dtype= / reduce_dtype=, not both")
    fields = {name: getattr(policy, name, None) for name in ("param_dtype", "reduce_dtype", "output_dtype")}
    if not hasattr(policy, "param_dtype") or not hasattr(policy, "reduce_dtype"):
        raise SbpError(f"fully_shard(mp_policy={policy!r}): needs FSDP2's MixedPrecisionPolicy (an object with "
                       f"param_dtype and reduce_dtype), or pass param_dtype= / reduce_dtype=")
    if fields["output_dtype"] is not None:
        raise SbpError(f"fully_shard(mp_policy=...): output_dtype={fields['output_dtype']} is not supported (the "
                       f"outputs keep param_dtype); cast the root's output yourself")
    if getattr(policy, "cast_forward_inputs", True) is not True:
        raise SbpError("fully_shard(mp_policy=...): cast_forward_inputs=False is not supported (floating inputs "
                       "are cast to param_dtype)")
    return fields["param_dtype"], fields["reduce_dtype"]


class FullyShardedModule:
    """What `fully_shard` adds to the module it is applied to, as FSDP2's ``FSDPModule``: the module's class
    becomes ``FSDP<its class>``, a subclass of both (``isinstance(model, LlamaForCausalLM)`` stays true, and
    transformers names the architecture without the prefix when it saves the config)."""

    def __getattr__(self, name: str):
        """FSDP2's module methods that have no counterpart here are found, and raise `SbpError` saying why when
        called (``hasattr`` stays true, as for an FSDP2 module); anything else is looked up as nn.Module does."""
        why = _FSDP2_ONLY.get(name)
        if why is None:
            return super().__getattr__(name)

        def unsupported(*args, **kwargs):
            raise SbpError(f"{name} is FSDP2's; sbp.nn.fully_shard has no such setting: {why}")
        return unsupported

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters the gradients (default True). With False -- the micro-batches of a
        gradient accumulation but the last -- each unit keeps its gradients unreduced (the gathered size,
        summed over the steps) and sends nothing; the next backward with sync reduces them with its own, so
        ``.grad`` gets the sum over all the micro-batches. `recurse`: also the units inside this one.

        >>> import torch, sbp, sbp.testing
        >>> sbp.load_torch_layers()
        >>> def fn(mesh):
        ...     m = sbp.nn.fully_shard(torch.nn.Linear(2, 2, bias=False), mesh)
        ...     for step, x in enumerate([torch.ones(2, 2), 2 * torch.ones(2, 2)]):
        ...         m.set_requires_gradient_sync(step == 1)    # reduced once, in the last backward
        ...         m(x).sum().backward()
        ...     return m.weight.grad.full().tolist()
        >>> sbp.testing.spmd(fn, (2,), names=("dp",))[0]
        [[6.0, 6.0], [6.0, 6.0]]
        """
        _set_on_units(self, "set_requires_gradient_sync", "gradient_sync", requires_gradient_sync, recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether forward frees the gathered parameters (`fully_shard`'s ``reshard_after_forward``; the root
        unit keeps them either way). `recurse`: also the units inside this one.

        >>> import torch, sbp, sbp.testing
        >>> sbp.load_torch_layers()
        >>> def fn(mesh):
        ...     m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        ...     sbp.nn.fully_shard(m[0], mesh)
        ...     sbp.nn.fully_shard(m, mesh).set_reshard_after_forward(False)
        ...     m(torch.ones(4, 2))
        ...     return sbp.nn.fsdp.unit_of(m[0]).state     # still gathered for backward
        >>> sbp.testing.spmd(fn, (2,), names=("dp",))[0]
        'gathered'
        """
        _set_on_units(self, "set_reshard_after_forward", "reshard_after_forward", reshard_after_forward, recurse)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether backward frees the gathered parameters (default True). With False -- the micro-batches of a
        gradient accumulation but the last -- each unit keeps them, and the next forward and backward gather
        nothing (the memory of the whole unsharded unit stays in use meanwhile). A change of the stored
        parameters (an optimizer step, ``p.mul_()`` under no_grad, ``p.to_local()``'s in-place ops, a
        ``load_state_dict``) makes the kept copies stale: the next forward gathers anew. A write through
        ``p.data`` bumps no version counter (autograd does not see it either) and is not seen: the kept
        copies stay, so write the parameter itself under ``torch.no_grad()``.

        >>> import torch, sbp, sbp.testing
        >>> sbp.load_torch_layers()
        >>> def fn(mesh):
        ...     m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        ...     sbp.nn.fully_shard(m[0], mesh)
        ...     sbp.nn.fully_shard(m, mesh).set_reshard_after_backward(False)
        ...     m(torch.ones(4, 2)).sum().backward()
        ...     return sbp.nn.fsdp.unit_of(m[0]).state
        >>> sbp.testing.spmd(fn, (2,), names=("dp",))[0]
        'gathered'
        """
        _set_on_units(self, "set_reshard_after_backward", "reshard_after_backward", reshard_after_backward, recurse)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's flag for the last backward of a step, where it waits for the gradients' reductions: every
        backward here ends with that wait (and with the gradients in ``.grad``), so the flag changes nothing.
        Accepted so code written for FSDP2 runs as it is.

        >>> import torch, sbp, sbp.testing
        >>> sbp.load_torch_layers()
        >>> def fn(mesh):
        ...     m = sbp.nn.fully_shard(torch.nn.Linear(2, 2), mesh)
        ...     m.set_is_last_backward(True)
        ...     m(torch.ones(4, 2)).sum().backward()
        ...     return m.weight.grad.placements
        >>> sbp.testing.spmd(fn, (2,), names=("dp",))[0]
        (S(0),)
        """
        _check_flag("set_is_last_backward", is_last_backward)

    def unshard(self, async_op: bool = False) -> "Optional[UnshardHandle]":
        """Gather this unit's parameters now (the next forward uses them without gathering); with `async_op`
        the gather is issued and a handle returned whose ``wait()`` waits for it.

        >>> import torch, sbp, sbp.testing
        >>> sbp.load_torch_layers()
        >>> def fn(mesh):
        ...     m = sbp.nn.fully_shard(torch.nn.Linear(2, 2), mesh)
        ...     m.unshard(async_op=True).wait()
        ...     gathered = sbp.nn.fsdp.unit_of(m).state
        ...     m.reshard()
        ...     return gathered, sbp.nn.fsdp.unit_of(m).state
        >>> sbp.testing.spmd(fn, (2,), names=("dp",))[0]
        ('gathered', 'sharded')
        """
        unit = unit_of(self)
        if async_op:
            unit.drop_stale()
            unit.issue_gather("unshard")
            return UnshardHandle(unit)
        unit.unshard("unshard")
        return None

    def reshard(self) -> None:
        """Free this unit's gathered copies (a gather on the way is waited for first); the module holds its
        stored parameters again. The next forward gathers anew."""
        unit = unit_of(self)
        if unit.state == "gathering":
            unit._wait_gather()
        unit.reshard()
        _place(unit)


_PREFETCH = ("sbp prefetches by itself: in forward the next unit of the order the last step recorded, in backward "
             "the one before; drop the call")
_DIVIDE = ("gradients are not divided by the data-parallel size here: a loss over the batch (a global tensor, S(0) "
           "on the data-parallel axis) already takes its mean over the whole batch; scale the loss instead")
_FSDP2_ONLY = {   # FSDP2's module methods without a counterpart, and what to do instead
    "set_modules_to_forward_prefetch": _PREFETCH, "set_modules_to_backward_prefetch": _PREFETCH,
    "set_gradient_divide_factor": _DIVIDE, "set_reduce_scatter_divide_factor": _DIVIDE,
    "set_force_sum_reduction_for_comms": "gradients are reduced by sums already (P(sum) to the stored placements)",
    "set_requires_all_reduce": "the replicate axes' reduction (HSDP) follows set_requires_gradient_sync",
    "set_post_optim_event": "CUDA stream events are not used by sbp's schedule; drop the call",
    "set_unshard_in_backward": "a unit whose parameters take no gradient is not gathered in backward; drop the call",
    "set_all_reduce_hook": "no hook runs on the reduced gradients; run yours on .grad after backward",
    "set_custom_all_gather": "sbp plans its own gathers", "set_custom_reduce_scatter": "sbp plans its own reductions",
    "set_reduce_scatter_unused_params": "unused parameters' gradients follow the used flags reduced with the others",
    "set_reduce_scatter_max_input_buffers": "sbp keeps no buffer pool for reductions",
    "set_separate_reduce_scatter_group": "reductions run on the mesh axis's own group",
    "set_allocate_memory_from_process_group_for_comm": "communication buffers are plain tensors",
    "set_symm_mem_for_comm": "symmetric memory is not used", "reset_iter_state": "there is no iteration state to reset",
}


def _check_flag(method: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SbpError(f"{method} needs True or False, got {value!r}")


def _set_on_units(module: nn.Module, method: str, attr: str, value: bool, recurse: bool) -> None:
    """A `FullyShardedModule` setter: `value` (a bool) as `attr` of the module's unit and, with `recurse`, of
    the units inside it."""
    _check_flag(method, value)
    for unit in _units_under(module, recurse):
        setattr(unit, attr, value)


class UnshardHandle:
    """The gather `FullyShardedModule.unshard(async_op=True)` issued; ``wait()`` waits for it."""

    def __init__(self, unit: Unit) -> None:
        self._unit = unit

    def wait(self) -> None:
        """Wait for the gather (nothing to do once the unit holds its gathered copies)."""
        if self._unit.state == "gathering":
            self._unit._wait_gather()


_SHARDED_CLASSES: dict[type, type] = {}


def _add_methods(module: nn.Module) -> None:
    """Make `module` an instance of ``FSDP<its class>`` (`FullyShardedModule` first), as FSDP2 does."""
    cls = type(module)
    if issubclass(cls, FullyShardedModule):
        return
    sharded = _SHARDED_CLASSES.get(cls)
    if sharded is None:
        sharded = _SHARDED_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FullyShardedModule, cls),
                                               {"__module__": cls.__module__})
    module.__class__ = sharded


def _units_under(module: nn.Module, recurse: bool) -> list[Unit]:
    return [_UNITS[m] for m in (module.modules() if recurse else (module,)) if m in _UNITS]


def _modules_outside(module: nn.Module, inner: set[int]):
    """(path, module) of `module` and its descendants that no inner unit contains."""
    stack = [("", module)]
    while stack:
        path, m = stack.pop()
        yield path, m
        for name, child in reversed(list(m.named_children())):
            if id(child) not in inner:
                stack.append((f"{path}.{name}".lstrip("."), child))


def _adopt(unit: Unit, owner: nn.Module, name: str, param: nn.Parameter, path: str) -> nn.Parameter:
    """The stored (sharded) parameter for `param`; a tied parameter already stored by this unit is reused."""
    mesh, a = unit.mesh, unit.axis
    # a parameter met again (tied within or across units) is its stored parameter: ties survive fully_shard
    param = getattr(param, "_sbp_stored", param)
    other = _OWNER.get(id(param))
    slot = next((s for s in other.slots if s.param is param), None) if other is not None else None
    if slot is not None:
        if other is unit:
            unit.slots.append(replace(slot, owner=owner, name=name))
            return param
        if other.mesh != mesh or other.axis != a:
            raise SbpError(f"fully_shard: parameter {path!r} is shared with unit {other.name}, which stores it "
                           f"with placements {slot.stored} on mesh {other.mesh.shape} (axis {other.axis}); here it "
                           f"would be sharded on axis {a} of mesh {mesh.shape}: shared parameters need one layout "
                           f"(apply fully_shard with the same mesh and axis, or to a module holding both users)")
        unit.slots.append(replace(slot, owner=owner, name=name, local=None))
        return param
    if isinstance(param, GlobalTensor):
        if param.mesh != mesh:
            raise SbpError(f"fully_shard: parameter {path!r} lives on mesh {param.mesh!r}, the unit on {mesh!r}; "
                           f"parallelize and fully_shard need one mesh: {_one_mesh_hint(param.mesh, mesh)}")
        if not isinstance(param.placements[a], Broadcast):
            raise SbpError(f"fully_shard: parameter {path!r} has placement {param.placements[a]!r} on axis {a}, which "
                           f"fully_shard would split; the data-parallel axis must hold it Broadcast (valid: B there)")
        before = next((i for i in range(a) if not isinstance(param.placements[i], Broadcast)), None)
        if before is not None:   # the axes before `axis` are replicate axes (HSDP): gradients all_reduced there
            name = mesh.names[before] if mesh.names else before
            raise SbpError(f"fully_shard: parameter {path!r} has placement {param.placements[before]!r} on mesh axis "
                           f"{name!r}, which comes before the sharding axis {mesh.names[a] if mesh.names else a!r}: "
                           f"the axes before it are data-parallel replicate axes (HSDP), where parameters are "
                           f"Broadcast; put the tensor-parallel axis after the data-parallel ones (e.g. names=('dp', "
                           f"'tp'), parallelize(..., tp_axis='tp'))")
        base = param.placements
    else:
        base = tuple(Broadcast() for _ in range(mesh.ndim))
    busy = {p.dim for i, p in enumerate(base) if isinstance(p, Split) and i != a}
    free = [d for d in range(param.ndim) if d not in busy]
    dim = free[0] if free else (0 if param.ndim else None)
    stored = base if dim is None else tuple(Split(dim) if i == a else p for i, p in enumerate(base))
    # (a meta parameter, FSDP2's deferred init, gives shards of no storage until to_empty)
    value = _laid_out(param.detach(), mesh, stored)
    if isinstance(param, GlobalTensor):   # a copy: a slice of the replicated local would keep all of it alive
        value = GlobalTensor(value._local.clone(), mesh, stored, tuple(param.shape))
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    compute = tuple(Broadcast() if i == a else p for i, p in enumerate(stored))
    slot = _Slot(owner, name, new, stored, compute, dim, flat=bool(free), accumulator=_accumulator(new))
    n = mesh.shape[a]
    if dim is not None and free:
        coord = list(mesh.coord)
        for m in range(n):
            coord[a] = m
            slot.shapes.append(local_shape(tuple(param.shape), mesh.shape, stored, tuple(coord)))
        slot.sizes = [int(torch.Size(shape).numel()) for shape in slot.shapes]
        slot.even_rows = dim == 0 and len(set(slot.sizes)) == 1 and slot.sizes[0] > 0
    unit.slots.append(slot)
    _OWNER[id(new)] = unit
    param._sbp_stored = new   # (the original parameter is dropped with its module's old slot: no cycle kept)
    return new


def _one_mesh_hint(param_mesh: DeviceMesh, mesh: DeviceMesh) -> str:
    """What to pass instead: sbp's styles and units take the whole mesh and name their axis, where DTensor code
    passes its sub-meshes (``mesh["tp"]`` to parallelize_module, ``mesh["dp"]`` to FSDP2's fully_shard)."""
    tp = param_mesh.names[0] if param_mesh.ndim == 1 and param_mesh.names else "tp"
    dp = mesh.names[0] if mesh.ndim == 1 and mesh.names else "dp"
    return (f"pass the whole mesh to both and name the axes -- parallelize(model, mesh, plan, tp_axis={tp!r}) and "
            f"fully_shard(block, mesh, {dp!r}) -- not its sub-meshes (mesh[{tp!r}], mesh[{dp!r}]) as DTensor's "
            f"parallelize_module and FSDP2 take them")


def sharded_by(param: Any) -> Optional[str]:
    """The name of the `fully_shard` unit storing `param` (a parameter `fully_shard` made), else None."""
    unit = _OWNER.get(id(param))
    return None if unit is None else unit.name


def _accumulator(param: nn.Parameter) -> Any:
    """The autograd node accumulating `param`'s gradients, kept alive (autograd holds it weakly: a new one
    per graph otherwise); None where the parameter takes no gradient."""
    if not param.requires_grad:
        return None
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


def _layout_buffer(unit: Unit) -> None:
    """Offsets of the flat slots in each member's segment: each slot padded to its longest member piece."""
    dtypes = sorted({str(s.param.dtype) for s in unit.slots if s.flat})
    if len(dtypes) > 1 and unit.param_dtype is None:
        raise SbpError(f"fully_shard: the unit's parameters have dtypes {dtypes}; its one gather buffer needs one "
                       f"(convert the module, e.g. module.float(), or pass param_dtype=...)")
    offset, seen = 0, {}
    flat = [s for s in unit.slots if s.flat]
    for s in [s for s in flat if s.even_rows] + [s for s in flat if not s.even_rows]:   # the even block first
        if id(s.param) in seen:   # a tied parameter: one place in the buffer
            s.offset = seen[id(s.param)]
            continue
        s.offset = seen[id(s.param)] = offset
        offset += max(s.sizes, default=0)
    unit.width = offset
    # tied slots share one gathered local: keep only the first slot per parameter in the flat list
    firsts, out = set(), []
    for s in unit.slots:
        if id(s.param) in firsts:
            continue
        firsts.add(id(s.param))
        out.append(s)
    unit.tied = {(id(s.owner), s.name): next(f for f in out if f.param is s.param) for s in unit.slots}
    unit.slots = out
    unit.even = sorted((s for s in out if s.flat and s.even_rows), key=lambda s: s.offset)
    position = {id(s): k for k, s in enumerate(out)}
    unit.even_at = [position[id(s)] for s in unit.even]
    unit.even_width = sum(s.sizes[0] for s in unit.even)
    n = unit.mesh.shape[unit.axis]
    unit.numels = [sum(s.sizes[m] for s in out if s.flat) for m in range(n)]
    unit.groups = _layout_groups(unit)


def _layout_groups(unit: Unit) -> list[_Group]:
    """The planned (not flat) slots that move together: 1-d parameters with one stored and compute layout
    whose every split is `S(0)` and whose length the splits divide evenly (`rows` pieces, `rows` the product
    of the splitting axes' sizes). Viewed as (rows, length / rows), a parameter's stored and compute pieces
    are whole rows -- the same rows of the (rows, width) matrix of the group's parameters side by side."""
    by_layout: dict[tuple, list[int]] = {}
    for k, s in enumerate(unit.slots):
        if s.flat or s.dim is None or s.param.ndim != 1:
            continue
        split = [i for i, p in enumerate(s.stored) if isinstance(p, Split)]
        rows = math.prod(unit.mesh.shape[i] for i in split)
        if any(s.stored[i] is not Split(0) for i in split) or s.param.shape[0] % rows:
            continue
        by_layout.setdefault((s.stored, s.compute, s.param.dtype, s.param.requires_grad, rows), []).append(k)
    groups = []
    for (stored, compute, _, _, rows), at in by_layout.items():
        slots = [unit.slots[k] for k in at]
        cols, width = [], 0
        for s in slots:
            cols.append((width, s.param.shape[0] // rows))
            width += cols[-1][1]
        groups.append(_Group(at, slots, cols, stored, compute, rows, width))
    return groups


# refused at the root's forward with gradients: the units' backward hooks, compiled into the autograd graph, gave
# wrong gradients without a word (7e-2 off after 3 SGD steps on 2 ranks; torch's FSDP2 gives the same numbers)
_COMPILED_AUTOGRAD = ("fully_shard does not train under compiled autograd (torch._dynamo.config.compiled_autograd"
                      " = True): its units' backward hooks (the gathers and reduce_scatters) would be compiled into "
                      "the autograd graph, which computes wrong gradients. Set it to False for a fully-sharded model; "
                      "torch.compile of the root or of its blocks still compiles the forward and its backward graphs")


def _install_hooks(unit: Unit) -> None:
    module = unit.module

    # the hooks' own tensor calls (packing, copies, wrappers) are bookkeeping: a torch function mode active
    # around the forward (`parallelize`'s SplitBatchMatmul, a user's) is not called for each of them
    def pre(mod: nn.Module, args: tuple, kwargs: dict):
        with _NO_TORCH_FUNCTION():
            sched = unit.schedule
            if unit is sched.root:
                if torch.is_grad_enabled() and getattr(torch._dynamo.config, "compiled_autograd", False):
                    raise SbpError(_COMPILED_AUTOGRAD)
                args, kwargs = _root_inputs(unit, args, kwargs)
                sched.prefetch = _even_batch(unit, args, kwargs)
            elif unit.param_dtype is not None:   # every unit's floating inputs, as FSDP2's cast_forward_inputs
                args, kwargs = _cast_inputs(unit.param_dtype, args, kwargs)
            sched.pre_forward(unit)
            if torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled():
                # a forward recomputed in backward (activation checkpointing): the way the original ran, which
                # the first step's check may have changed since (unverified and global -> local)
                unit.computing_local, unit.probe = unit.forward_local, None
            else:
                on_batch = unit.auto in ("unverified", "local") and _batch_only(unit, args, kwargs)
                unit.computing_local = unit.local_batch or (on_batch and unit.auto == "local")
                # (checked in training mode only: a module may mix samples in training alone, batch statistics)
                unit.probe = (args, kwargs) if on_batch and unit.auto == "unverified" and unit.module.training \
                    and _rerunnable(args, kwargs) else None
                if unit.probe is not None and _foreign_hooks(unit):   # a user's hooks would see the check's rerun
                    unit.probe, unit.auto = None, "global"            # and then plain local shares: stay global
                if torch.is_grad_enabled():
                    unit.forward_local = unit.computing_local
            if unit.computing_local:
                args, kwargs = _local_inputs(unit, args, kwargs)
            _bind(unit, unit.computing_local)
            return args, kwargs

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if unit.probe is not None:   # runs the unit's forward again: as the user's forward ran (modes on)
            _verify_local(unit, out)
        with _NO_TORCH_FUNCTION():
            _place(unit)
            unit.schedule.post_forward(unit)
            if unit.computing_local:
                out = _global_outputs(unit, out)
            if not torch.is_grad_enabled():
                return out
            leaves = [t for t in _tensors(out) if t.requires_grad]
            if not leaves:
                return out
            wrapped = dict(zip(map(id, leaves), _PreBackward.apply(unit, *leaves)))
            return tree_map(lambda t: wrapped.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)

    owners = {id(m): m for m in module.modules()}
    unit.owners = owners
    module.register_load_state_dict_post_hook(lambda mod, incompatible: _take_assigned(unit))
    # under torch.compile the hooks run eagerly (graph breaks at unit boundaries): they keep state, issue
    # queued collectives and resize storages, none of which belongs in a graph; a unit's compute compiles
    handles = (module.register_forward_pre_hook(torch._dynamo.disable(pre, recursive=True, reason=_EAGER_HOOKS),
                                                with_kwargs=True),
               module.register_forward_hook(torch._dynamo.disable(post, recursive=True, reason=_EAGER_HOOKS),
                                            with_kwargs=True))
    unit.hook_ids = frozenset(h.id for h in handles)


_EAGER_HOOKS = ("sbp.nn.fully_shard: a unit's hooks run eagerly between graphs (they gather and free parameters "
                "and keep the unit's state): a fully-sharded module compiles with a graph break at each unit "
                "boundary; for one graph per block, compile each block with fullgraph=True before fully_shard")


def _bind(unit: Unit, local: bool) -> None:
    """Put the gathered parameters (global tensors, or plain locals when `local`) into the unit's modules,
    through `_UnitGather` when they need gradients."""
    gathered = _UnitGather.apply(unit, local, *[s.param for s in unit.slots]) if torch.is_grad_enabled() and any(
        s.param.requires_grad for s in unit.slots) else unit.gathered(local)
    by_param = {id(s.param): g for s, g in zip(unit.slots, gathered)}
    if torch.is_grad_enabled():
        unit.bound = by_param   # kept: bound again for backward (activation checkpointing recomputes the forward there)
    _place(unit, by_param)


def _place(unit: Unit, by_param: Optional[dict[int, torch.Tensor]] = None) -> None:
    """Put into the unit's modules the tensors `by_param` maps its stored parameters to (by id), or the stored
    parameters themselves (None)."""
    for (owner_id, name), s in unit.tied.items():
        _owner_of(unit, owner_id)._parameters[name] = s.param if by_param is None else by_param[id(s.param)]


def _foreign_hooks(unit: Unit) -> bool:
    """Whether a module of the unit has forward hooks that are neither sbp's nor this unit's, or torch has global
    ones: hooks that may read or keep activations, which on local shares would be plain tensors of this rank."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks) or any(
        rebuild.foreign_hooks(m, unit.hook_ids if m is unit.module else ()) for m in unit.module.modules())


def _batch_layout(unit: Unit) -> tuple[Placement, ...]:
    return tuple(Split(0) if i <= unit.axis else Broadcast() for i in range(unit.mesh.ndim))


def _batch_shares(unit: Unit) -> int:
    """The pieces the batch is split in: the dp size times the replicate axes' sizes."""
    return math.prod(unit.mesh.shape[:unit.axis + 1])


def _batch_only(unit: Unit, args: tuple, kwargs: dict) -> bool:
    """Whether every tensor input is a global tensor laid out as the batch (0-d plain tensors aside), and
    there is one: what `local_batch=None` may compute on plain local shares."""
    batch = _batch_layout(unit)
    tensors = [t for t in _tensors((args, kwargs)) if isinstance(t, GlobalTensor) or t.ndim]
    return bool(tensors) and all(isinstance(t, GlobalTensor) and t.mesh == unit.mesh and t.placements == batch
                                 for t in tensors)


# argument values the check's second run of a forward can take again: nothing it could change in place
_VALUES = (int, float, bool, complex, str, bytes, type(None), type(Ellipsis), slice, range, torch.dtype, torch.device,
           torch.layout, torch.memory_format)


def _rerunnable(args: tuple, kwargs: dict) -> bool:
    """Whether a forward's arguments are tensors and plain values only, so `_verify_local` may run it a second
    time: an object among them (a transformers `Cache`, which each layer's forward updates in place) would be
    changed twice -- a static cache's write position moved past the prompt, wrong tokens from `generate()`.
    Such a forward is not checked (the unit stays global; a later forward without one is checked)."""
    return all(isinstance(v, (torch.Tensor, *_VALUES)) for v in tree_flatten((args, kwargs))[0])


def _verify_local(unit: Unit, out: Any) -> None:
    """`local_batch=None`, the first forward on the batch: run the unit's forward again on this rank's plain
    shares (no gradients; buffers restored after) and compare with the global run bitwise; every rank's
    verdict is agreed (one all_reduce on the mesh). "local" from the next forward on where all ranks match,
    "global" for good otherwise (an op mixing samples, a random op, a shape used as a number...).

    Where the two differ in the last bits only, the global run may have been compiled (a compiled root's unit:
    its graph is decomposed otherwise than eager ops) or run without gradients (a tensor-parallel block's global
    run without gradients was 1 ulp off its local run, with gradients equal to it bitwise): the global forward
    is run again eagerly with gradients, and that run decides (a unit that truly mixes samples differs there
    as well)."""
    args, kwargs = unit.probe
    unit.probe = None
    with torch.no_grad():
        try:
            largs, lkwargs = _local_inputs(unit, args, kwargs)
            inputs = _tensors((largs, lkwargs))
            versions = [t._version for t in inputs]
            _bind(unit, True)
            tracker = _split_tracker(unit, largs, lkwargs)
            with tracker if tracker is not None else contextlib.nullcontext():
                mine = _rerun(unit, largs, lkwargs)
            same = _same_as_local(unit, out, mine)
            # a unit writing into its input (``ReLU(inplace=True)`` first): autograd refuses that on the local
            # share, a view made in sbp's to_local
            if (tracker is not None and tracker.bad is not None) or versions != [t._version for t in inputs]:
                same = False
        except Exception:   # a local run that fails cannot stand in for the global one: keep computing globally
            same = False
        verdict = _agreed(unit, same)
        if verdict is None:   # close on some ranks, equal on the others: every rank runs the global forward eagerly,
            bound = unit.bound  # with gradients (its graph is dropped; the forward's binding is kept)
            try:
                with torch.enable_grad():
                    _bind(unit, False)
                    again = _rerun(unit, args, kwargs)
                same = _same_as_local(unit, again, mine) is True
            except Exception:   # as above
                same = False
            finally:
                unit.bound = bound
            verdict = _agreed(unit, same)
    unit.auto = "local" if verdict else "global"
    unit.schedule.log.append(("verify_local", unit.name, unit.auto))


def _agreed(unit: Unit, same: Optional[bool]) -> Optional[bool]:
    """Every rank's `_same_as_local` verdict agreed (one all_reduce on the unit's mesh): False where a rank has
    False, else None where a rank has None, else True."""
    comm = unit.mesh.binding
    code = 0.0 if same is True else 1.0 if same is None else 2.0
    flag = torch.tensor([code], dtype=torch.float64, device=comm_device_of(unit.mesh))
    axes = tuple(range(unit.mesh.ndim))
    worst = pending.ready(pending.submit(comm, lambda: comm.all_reduce(flag, axes, "max"), (1,), flag.dtype,
                                         flag.device)).item()
    return True if worst == 0 else None if worst == 1 else False


@torch._dynamo.disable
def _rerun(unit: Unit, args: tuple, kwargs: dict) -> Any:
    """The unit's forward run again in the caller's grad mode, on the parameters the caller bound; eagerly,
    also under a compiled root (whose hooks run between its graphs, where dynamo would compile the run's
    frames too); its buffers are clones for the run (the originals are never written), restored after."""
    swapped = []   # (module, name, original)
    for mod in unit.module.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None:
                swapped.append((mod, name, b))
                mod._buffers[name] = b.detach().clone()
    try:
        return unit.module.forward(*args, **kwargs)
    finally:
        for mod, name, b in swapped:
            mod._buffers[name] = b


def _split_tracker(unit: Unit, args: tuple, kwargs: dict) -> Optional[tp_local.SplitTracker]:
    """For a unit with tensor-parallel parameters: the check that its Broadcast parameters and inputs never meet
    the tp pieces on local shares (`sbp.nn.tp_local.SplitTracker`); the gathered parameters bound already."""
    if not any(tp_local.split_params(s.compute) for s in unit.slots):
        return None
    split, replicated = [], list(_tensors((args, kwargs)))
    for (owner_id, name), s in unit.tied.items():
        bound = _owner_of(unit, owner_id)._parameters[name]
        (split if tp_local.split_params(s.compute) else replicated).append(bound)
    return tp_local.SplitTracker(split, replicated)


def _same_as_local(unit: Unit, out: Any, mine: Any) -> Optional[bool]:
    """Whether the global run's outputs `out` are the batch and their local shares equal the local run's
    `mine` exactly (same structure, dtypes and bits): True; None where every difference is in the last bits
    (`_close`); False otherwise."""
    flat, spec = tree_flatten(out)
    flat_mine, spec_mine = tree_flatten(mine)
    if spec != spec_mine:
        return False
    batch = _batch_layout(unit)
    verdict: Optional[bool] = True
    for g, m in zip(flat, flat_mine):
        if isinstance(g, GlobalTensor):
            if isinstance(m, GlobalTensor) or not isinstance(m, torch.Tensor) or g.placements != batch:
                return False
            share = pending.ready(g._local)
            if share.dtype != m.dtype or share.shape != m.shape:
                return False
            if not torch.equal(share, m):
                if not (share.is_floating_point() and _close(share, m)):
                    return False
                verdict = None
        elif isinstance(g, torch.Tensor):   # a plain output of the global run: a 0-d value at most
            if g.ndim or not isinstance(m, torch.Tensor) or m.ndim or not torch.equal(g, m):
                return False
        elif type(g) is not type(m) or g != m:
            return False
    return verdict


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` differ in their last bits only: a compiled global run and the eager local one differ
    by the compiled kernels' other order of operations (float32: relative ~1e-6; bfloat16: a few of its ulps),
    within 1e-4 or 64 ulps of the dtype, relative to `b`'s largest magnitude. A unit drawing random numbers
    (dropout's zeros) is off by far more. Only a gate: the eager rerun it leads to decides bitwise."""
    tol = max(1e-4, 64 * torch.finfo(a.dtype).eps)
    scale = float(b.abs().max()) if b.numel() else 0.0
    return torch.allclose(a, b, rtol=tol, atol=tol * scale, equal_nan=True)


def _local_inputs(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`local_batch`: global inputs (the batch: `S(0)` on the axis and the replicate axes, `B` elsewhere)
    become this rank's share, a plain tensor; their global batch length is kept for the outputs."""
    batch, shares = _batch_layout(unit), _batch_shares(unit)
    unit.batch_lengths = {}   # (this forward's: a length seen in an earlier one says nothing of this one's outputs)

    def convert(t: Any) -> Any:
        if not isinstance(t, GlobalTensor):
            return t
        if t.placements != batch or t.mesh != unit.mesh:
            raise SbpError(f"fully_shard(local_batch=True): unit {unit.name} takes inputs laid out as the batch, "
                           f"{batch} on mesh {unit.mesh.shape}; got placements {t.placements} on mesh "
                           f"{t.mesh.shape} (valid: the batch split on dim 0; or local_batch=False)")
        if t.shape[0] >= shares:   # (an empty share's 0 rows would match any rank's empty output: not a sign)
            unit.batch_lengths[t.to_local().shape[0]] = t.shape[0]
        return t.to_local()

    return tree_map(convert, args), tree_map(convert, kwargs)


def _global_outputs(unit: Unit, out: Any) -> Any:
    """`local_batch`: plain outputs are this rank's share of a batch: global tensors `S(0)` again."""
    batch = _batch_layout(unit)

    def wrap(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or isinstance(t, GlobalTensor) or t.ndim == 0:
            return t
        n = unit.batch_lengths.get(t.shape[0])
        if n is None:   # not the batch length seen at the inputs: from_local infers (and checks) the global one
            try:
                return from_local(t, unit.mesh, batch)
            except ShapeError as e:   # (every rank raises: the check compares all ranks' shapes)
                raise ShapeError(f"fully_shard: unit {unit.name} computes on this rank's share of the batch "
                                 f"(local_batch), but an output with {t.shape[0]} rows here is no balanced share "
                                 f"of a batch on the other ranks ({e}); its rows depend on the batch's shape "
                                 f"beyond its length: pass local_batch=False for this unit") from None
        # this rank's rows of a global batch of n, as at the inputs: the layout holds by construction
        return from_local_autograd(t, unit.mesh, batch, (n,) + tuple(t.shape[1:]))

    return tree_map(wrap, out)


def _take_assigned(unit: Unit) -> None:
    """After ``load_state_dict(..., assign=True)`` replaced parameters of the unit's modules: their values go into
    the stored parameters (laid out as stored), which the modules hold again, as after a plain load."""
    for (owner_id, name), s in unit.tied.items():
        new = _owner_of(unit, owner_id)._parameters.get(name)
        if new is None or new is s.param:
            continue
        if tuple(new.shape) != tuple(s.param.shape):
            raise ShapeError(f"fully_shard: load_state_dict(assign=True) gave {name!r} of unit {unit.name} the shape "
                             f"{tuple(new.shape)}; it holds {tuple(s.param.shape)}")
        with torch.no_grad():
            value = _laid_out(new.detach(), unit.mesh, s.stored)
            s.param._local.copy_(value._local)   # (requires_grad stays the module's, as torch's assign keeps it)
    _place(unit)


def _laid_out(value: torch.Tensor, mesh: DeviceMesh, stored: tuple[Placement, ...]) -> GlobalTensor:
    """`value` (a full plain tensor, or a global one on `mesh`) laid out as `stored` (no copy where it is)."""
    if isinstance(value, GlobalTensor):
        return redistribute_raw(value, stored) if value.placements != stored else value
    return distribute(value, mesh, stored)


def _owner_of(unit: Unit, owner_id: int) -> nn.Module:
    return unit.owners[owner_id]


def _tensors(out: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if isinstance(t, torch.Tensor) else None, out)
    return found


def _even_batch(unit: Unit, args: tuple, kwargs: dict) -> bool:
    """Whether the root's batch inputs split evenly over the dp shares. Otherwise a compiled graph may move rows
    on the dp group (an uneven batch reshaped), and a prefetched gather on sbp's queue thread would reach that
    group concurrently with it -- in an order that differs by rank (a hang): that step gathers each unit at
    its own turn. (sbp's eager collectives wait for the queue first; a compiled graph's cannot.)"""
    shares = _batch_shares(unit)
    return all(t.shape[0] % shares == 0 for t in _tensors((args, kwargs)) if t.ndim)


def _root_inputs(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Plain tensors entering the root, also inside lists, tuples and dicts (``model({"x": x})``): the full
    batch, `S(0)` on the axis and the replicate axes (B after); floating ones cast to `param_dtype`."""
    mesh = unit.mesh
    if (not unit.inputs_checked or agreement.is_enabled()) and not torch.compiler.is_compiling():
        _check_full_batch(unit, args, kwargs)
        unit.inputs_checked = True

    def convert(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if unit.param_dtype is not None and t.is_floating_point():
            t = t.to(unit.param_dtype)
        if isinstance(t, GlobalTensor) or t.ndim == 0:
            return t
        pls = _batch_layout(unit)
        if t.requires_grad:   # differentiable: the full value, whose gradient is the full one on every rank
            return from_local(t, mesh, (Broadcast(),) * mesh.ndim).redistribute(pls)
        return distribute(t, mesh, pls)

    return tree_map(convert, args), tree_map(convert, kwargs)


def _check_full_batch(unit: Unit, args: tuple, kwargs: dict) -> None:
    """The root's first forward (every forward under `sbp.debug()`): one all_gather of a digest of the plain
    tensors entering it, so ranks passing each their own share (FSDP2's habit) get a `RankMismatchError`
    instead of training on a mix of their batches."""
    plain = [t for t in tree_flatten((args, kwargs))[0]
             if isinstance(t, torch.Tensor) and not isinstance(t, GlobalTensor) and t.ndim > 0]
    data = hashlib.blake2b(digest_size=8)
    for t in plain:
        data.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    gather, members = agreement.mesh_gather(unit.mesh)
    agreement.agree(gather, members, "fully_shard: a plain tensor entering the root is the full batch, equal on "
                    "every rank (pass each rank's own share as sbp.from_local(share, mesh, \"S(0)\"))",
                    {"input shapes": [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in plain],
                     "input values": f"digest {data.hexdigest()}"},
                    device=comm_device_of(unit.mesh))


def _cast_inputs(dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Floating tensors among a unit's inputs, in `dtype` (`param_dtype`)."""
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t
    return tree_map(cast, args), tree_map(cast, kwargs)


def unit_of(module: nn.Module) -> Unit:
    """The `Unit` record of a module `fully_shard` was applied to (its slots, state and schedule).

    >>> import torch, sbp, sbp.testing
    >>> sbp.load_torch_layers()
    >>> def fn(mesh):
    ...     u = unit_of(sbp.nn.fully_shard(torch.nn.Linear(4, 2), mesh))
    ...     return u.state, [s.stored for s in u.slots]
    >>> sbp.testing.spmd(fn, (2,), names=("dp",))[0]
    ('sharded', [(S(0),), (S(0),)])
    """
    unit = _UNITS.get(module)
    if unit is None:
        raise SbpError(f"{type(module).__name__} is not a fully_shard unit (apply sbp.nn.fully_shard to it first)")
    return unit


def schedule_log(module: nn.Module) -> list[tuple]:
    """The last training step's log of the root unit `module` (or of a unit under it), in order: entries
    ``("forward_start" | "forward_end" | "backward_start", unit)``, ``("issue_gather", unit, phase)``,
    ``("all_gather" | "reduce_scatter", unit, phase, calls)`` (the communicator's `CallRecord`s that ran),
    ``("issue_reduce_scatter", unit, "backward")``, ``("verify_local", unit, "local" | "global")`` (the
    step that checked a `local_batch=None` unit, and its verdict).

    >>> import torch, sbp, sbp.testing
    >>> sbp.load_torch_layers()
    >>> def fn(mesh):
    ...     m = sbp.nn.fully_shard(torch.nn.Linear(4, 2), mesh)
    ...     m(torch.ones(2, 4)).sum().backward()
    ...     return [e[0] for e in schedule_log(m) if e[0] in ("all_gather", "reduce_scatter")]
    >>> sbp.testing.spmd(fn, (2,), names=("dp",))[0]
    ['all_gather', 'reduce_scatter']
    """
    unit = unit_of(module)
    pending.wait_all(unit.mesh.binding)
    return list(unit.schedule.log)
