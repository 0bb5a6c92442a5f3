"""The executor: runs a `Plan` step by step on this rank's local tensor through the mesh's communicator.

Every size comes from layout maths (`sbp.values.layout.block` with the step's placements and the members'
coords), never from an assumed flat split: 10 rows nested over a 2x2 mesh are 3,2,3,2, not 3,3,2,2.
Where each piece lies in the flat buffers a collective reads and writes is `sbp.runtime.buffers` (cached per
step and coord): uneven pieces are padded to one length for all_gather / reduce_scatter and trimmed
after; all_to_all and transfers use exact per-peer sizes from `sbp.planning.exchange.exchange`. Buffers are the
local or the result themselves wherever the pieces line up, so most steps copy nothing around the
collective. A group whose pieces are all empty makes no call at all (every member knows it from
layout maths alone). The caller's local is never written to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from ..planning.api import plan as make_plan
from ..values.errors import MeshError, PlanError, ShapeError
from ..values.layout import Block, block, block_shape, check_global_shape, relative
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, Split, normalize
from ..values.steps import Plan, Step
from . import pending, symbolic, traced
from .buffers import exchange_layout, gather, messages_copy_nothing, p2p_layout, scatter
from .communicator import Communicator
from .reduce_exchange import run_reduce_transfer


@dataclass(frozen=True, slots=True)
class _Ctx:
    """What every step needs besides its own fields: the tensor, the mesh and this rank's place."""

    global_shape: tuple[int, ...]
    mesh: DeviceMesh  # only its shape and ranks are used
    coord: tuple[int, ...]
    comm: Communicator
    caller_storage: int  # address of the caller's local tensor's memory: never written to
    tracing: bool = False  # under torch.compile / fake tensors: collectives lower to `sbp.runtime.traced`
    elem: tuple = ()  # trailing dims of every local past the plan's shape (symbolic sizes, `symbolic`)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in memory the executor allocated (so a collective may work in place)."""
        return t.untyped_storage().data_ptr() not in (0, self.caller_storage)

    def block(self, pls: tuple[Placement, ...], coord: tuple[int, ...] | None = None) -> Block:
        return block(self.global_shape, self.mesh.shape, pls, self.coord if coord is None else coord)


def execute(plan: Plan, local: torch.Tensor, mesh: DeviceMesh, elem: tuple = ()) -> torch.Tensor:
    """Run `plan` on this rank's `local` block of the source layout; return its block of the target.

    `elem`: trailing dims of `local` the plan does not know (under torch.compile, dims of symbolic size no
    placement splits, `sbp.runtime.symbolic`): each position of the plan's shape holds a tensor of that shape.

    `mesh` must be bound (`sbp.init_mesh`, `sbp.testing.spmd`). A rank outside the mesh returns its
    (empty) `local` unchanged and takes part in nothing. The result is contiguous.

    >>> import sbp, sbp.testing, torch
    >>> from sbp.runtime.executor import execute
    >>> def fn(mesh):
    ...     p = sbp.plan((4, 2), mesh, "S(0)", "B")
    ...     local = torch.arange(8.).view(4, 2)[2 * mesh.coord[0]:][:2]
    ...     return execute(p, local, mesh).sum().item()
    >>> sbp.testing.spmd(fn, (2,))
    [28.0, 28.0]
    """
    local = pending.ready(local)   # an async result is waited for before it is read
    ctx = _context(plan, mesh, local, elem)
    if ctx is None:
        return local
    expected = block_shape(ctx.block(plan.src))
    if tuple(local.shape[:local.dim() - len(elem)]) != expected or local.dim() != len(expected) + len(elem):
        raise ShapeError(f"rank {ctx.comm.rank} at coord {ctx.coord}: local shape {tuple(local.shape)} does not "
                         f"match the block {expected} that placements {plan.src} give a global shape "
                         f"{plan.global_shape} on mesh {plan.mesh_shape}")
    for step in plan.steps:
        local = _run(step, local, ctx)
    return local.contiguous()


def execute_step(step: Step, local: torch.Tensor, mesh: DeviceMesh, global_shape: Sequence[int]) -> torch.Tensor:
    """Run one step (tests use it to attribute traffic to steps); see `execute`.

    >>> import sbp, sbp.testing, torch
    >>> from sbp.runtime.executor import execute_step
    >>> def fn(mesh):
    ...     step = sbp.plan((4,), mesh, "B", "S(0)").steps[0]
    ...     return execute_step(step, torch.arange(4), mesh, (4,)).tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [[0, 1], [2, 3]]
    """
    ctx = _context(Plan(tuple(global_shape), tuple(mesh.shape), step.src, step.dst, local.element_size(),
                        (step,)), mesh, local)
    return local if ctx is None else _run(step, local, ctx).contiguous()


def redistribute_local(local: torch.Tensor, mesh: DeviceMesh, global_shape: Sequence[int], src, dst) -> torch.Tensor:
    """This rank's block of the tensor laid out as `dst`, from its block laid out as `src` (plans, then runs).

    Placements may be objects or strings; the plan is cached, so repeated calls cost no planning.

    >>> import sbp, sbp.testing, torch
    >>> from sbp.runtime.executor import redistribute_local
    >>> def fn(mesh):
    ...     x = torch.arange(16.).view(4, 4)
    ...     local = x[sbp.local_slices((4, 4), mesh, "S(0), S(1)", mesh.coord)]
    ...     return redistribute_local(local, mesh, (4, 4), "S(0), S(1)", "S(1), B").tolist()
    >>> sbp.testing.spmd(fn, (2, 2))[3]
    [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0], [14.0, 15.0]]
    """
    if symbolic.any_symbolic(global_shape):
        return _redistribute_symbolic(local, mesh, tuple(global_shape), src, dst)
    shape = check_global_shape(global_shape)
    src = normalize(src, len(shape), mesh.ndim)
    dst = normalize(dst, len(shape), mesh.ndim)
    if local.is_meta and mesh.coord is not None:   # no storage (deferred init): nothing to move, only the shape
        return torch.empty(block_shape(block(shape, tuple(mesh.shape), dst, mesh.coord)), dtype=local.dtype,
                           device="meta")
    return execute(cached_plan(shape, tuple(mesh.shape), src, dst, local.element_size()), local, mesh)


def _redistribute_symbolic(local: torch.Tensor, mesh: DeviceMesh, global_shape: tuple, src, dst) -> torch.Tensor:
    """`redistribute_local` under torch.compile with symbolic sizes: planned on the sizes' hints. A dim no
    step moves (whole, or split alike in every state: `symbolic.frozen_splits`) is moved behind the others
    and rides along as each position's element (`execute(..., elem=...)`), so the graph holds for every size
    it takes; a plan that moves one pins its size (a guard: `sbp.runtime.symbolic`), unless the move only
    narrows each rank's block (`symbolic.narrows`: ``B -> S(0)``), which is cut with symbolic bounds, or
    only gathers, reduce-scatters or exchanges dims along one axis at a time (`symbolic.runs_symbolically`)."""
    hints = symbolic.hint_shape(global_shape)
    src = normalize(src, len(hints), mesh.ndim)
    dst = normalize(dst, len(hints), mesh.ndim)
    plan = cached_plan(hints, tuple(mesh.shape), src, dst, local.element_size())
    dyn = symbolic.dynamic_dims(global_shape)
    if plan.steps and symbolic.narrows(src, dst, len(hints)) and traced.is_tracing(local):
        # each rank cuts its block out of the one it holds: bounds in the symbolic sizes, nothing pinned
        coord = mesh.coord
        if coord is not None:
            return symbolic.narrow_block(local, global_shape, tuple(mesh.shape), src, dst, coord).contiguous()
    moved_dims = symbolic.moved_dims(plan, dyn)
    if moved_dims and not plan.steps:
        # nothing moves: only a mesh axis of size 1 changes its placement (``(S(1), B) -> (S(1), S(1))`` on a
        # (2, 1) mesh), so no size is pinned (pinned in a backward AOTAutograd traces, it broke the partitioner)
        return pending.ready(local).contiguous()
    coord = mesh.coord
    if moved_dims and coord is not None and traced.is_tracing(local) and symbolic.runs_symbolically(plan):
        return _moved_symbolically(plan, pending.ready(local), mesh, global_shape, coord)
    if moved_dims:   # a size the plan moves is pinned (a guard); the others still ride along
        symbolic.specialize([global_shape[d] for d in moved_dims])
        dyn = tuple(d for d in dyn if d not in moved_dims)
        if not dyn:
            return execute(plan, local, mesh)
    if plan.steps and all(step.kind == "all_reduce" for step in plan.steps):   # no layout maths: as it is
        ctx = _context(plan, mesh, local)
        for step in plan.steps if ctx is not None else ():
            local = _run(step, local, ctx)
        return local.contiguous()
    keep = [d for d in range(len(hints)) if d not in dyn]
    order = keep + list(dyn)
    in_place = order == sorted(order)   # the dims ride along where they are: no permutes in the graph
    moved = local if in_place else local.permute(order)
    out = execute(symbolic.without_dims(plan, dyn), moved, mesh, tuple(moved.shape[len(keep):]))
    back = [order.index(d) for d in range(len(order))]
    return (out if in_place else out.permute(back)).contiguous()


def _moved_symbolically(plan: Plan, local: torch.Tensor, mesh: DeviceMesh, global_shape: tuple,
                        coord: tuple[int, ...]) -> torch.Tensor:
    """`plan`'s steps (`symbolic.runs_symbolically`) with the moved dims' sizes symbolic."""
    for step in plan.steps:
        if step.kind == "all_reduce":
            local = traced.run_step(step, local, plan.global_shape, tuple(mesh.shape), coord, mesh.binding)
            continue
        if len(step.axes) > 1:   # an all_gather of one dim's splits on several axes: each member's rows
            d, shape = step.src[step.axes[0]].dim, tuple(mesh.shape)
            members = [mesh.coord_of(rank) for rank in mesh.binding.members(step.axes)]   # member order
            lengths = []
            for member in members:
                lo, hi = symbolic.block_of(global_shape, shape, step.src, member)[d]
                lengths.append(hi - lo)
            local = traced.run_symbolic_gather(step, local, d, lengths, members.index(coord), mesh.binding)
            continue
        (axis,) = step.axes
        ranges = {}   # each moved dim's range the axis splits: its block where the axis does not split it
        for moved, whole in ((step.src[axis], step.dst), (step.dst[axis], step.src)):
            if isinstance(moved, Split):
                lo, hi = symbolic.block_of(global_shape, tuple(mesh.shape), whole, coord)[moved.dim]
                ranges[moved.dim] = hi - lo
        local = traced.run_symbolic_step(step, local, ranges, coord[axis], mesh.binding)
    return local.contiguous()


@lru_cache(maxsize=4096)
def cached_plan(shape: tuple[int, ...], mesh_shape: tuple[int, ...], src, dst, itemsize: int) -> Plan:
    """`sbp.plan` for arguments already normalised (a checked shape tuple, normalised placements): the
    executor's hot-path cache in front of the planner's own (it skips re-validating the arguments).

    >>> import sbp
    >>> cached_plan((8,), (2,), (sbp.S(0),), (sbp.B,), 4) is cached_plan((8,), (2,), (sbp.S(0),), (sbp.B,), 4)
    True
    """
    return make_plan(shape, mesh_shape, src, dst, itemsize)


def _context(plan: Plan, mesh: DeviceMesh, local: torch.Tensor, elem: tuple = ()) -> _Ctx | None:
    coord = mesh.coord  # raises MeshError for a pure (unbound) mesh
    if coord is None:
        return None
    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise MeshError(f"plan is for a mesh of shape {plan.mesh_shape}, the mesh has shape {mesh.shape}")
    if traced.is_tracing(local):  # fake / functional tensors have no memory to read the address of
        return _Ctx(plan.global_shape, mesh, coord, mesh.binding, 0, True, tuple(elem))
    if elem:
        raise PlanError("trailing element dims (symbolic sizes) are only run while tracing")
    return _Ctx(plan.global_shape, mesh, coord, mesh.binding,
                local.untyped_storage().data_ptr())


def _run(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    if ctx.tracing and step.kind != "local":
        return traced.run_step(step, local, ctx.global_shape, tuple(ctx.mesh.shape), ctx.coord, ctx.comm,
                               ctx.elem)
    match step.kind:
        case "local":
            return _local(step, local, ctx)
        case "all_gather":
            return _all_gather(step, local, ctx)
        case "reduce_scatter":
            return _reduce_scatter(step, local, ctx)
        case "all_reduce":
            return _all_reduce(step, local, ctx)
        case "all_to_all" | "transfer":
            route = ctx.comm.exchange_route
            if route == "messages" or route == "auto" and messages_copy_nothing(
                    ctx.global_shape, ctx.mesh.shape, step.src, step.dst, step.axes, ctx.coord):
                return _send_recv(step, local, ctx)
            return _exchange(step, local, ctx)
        case "reduce_transfer":
            return run_reduce_transfer(step, local, ctx.global_shape, ctx.mesh.shape, ctx.coord, ctx.comm)
        case _:  # pragma: no cover - Step validates its kind
            raise PlanError(f"unknown step kind {step.kind!r}")


# ---- local moves ----------------------------------------------------------------------------------

def _local(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """Several axes at once become one-axis moves: embeddings (S -> P) innermost axis first, so each
    widens the block to its parent, then slices and keep/zero moves outermost first."""
    changed = [a for a in range(len(step.src)) if step.src[a] != step.dst[a]]
    widen = [a for a in changed if isinstance(step.src[a], Split)]
    order = widen[::-1] + [a for a in changed if a not in widen]
    state = step.src
    for a in order:
        nxt = state[:a] + (step.dst[a],) + state[a + 1:]
        local = _local_axis(local, state, nxt, a, ctx)
        state = nxt
    return local


def _local_axis(local: torch.Tensor, src: tuple[Placement, ...], dst: tuple[Placement, ...], axis: int,
                ctx: _Ctx) -> torch.Tensor:
    have, want = ctx.block(src), ctx.block(dst)
    match src[axis], dst[axis]:
        case Broadcast(), Split():
            _check_inside(want, have, src, dst)
            return local[relative(want, have)]
        case Broadcast(), Partial(op="sum"):
            return local if ctx.coord[axis] == 0 else torch.zeros_like(local)
        case Broadcast(), Partial():
            return local
        case Split(), Partial(op=op):
            _check_inside(have, want, src, dst)
            out = local.new_full(block_shape(want) + ctx.elem, identity(op, local.dtype))
            out[relative(have, want)] = local
            return out
        case Partial(op=a), Partial(op=b) if a == b:
            return local
    raise PlanError(f"a local step cannot turn {src[axis]!r} into {dst[axis]!r} on mesh axis {axis} "
                    f"(local moves: B -> S(d), B -> P(op), S(d) -> P(op))")


def identity(op: str, dtype: torch.dtype) -> "int | float | bool":
    """The identity element of `op` for `dtype` (what a non-contributing Partial rank holds).

    >>> identity("sum", torch.float32), identity("min", torch.float16), identity("max", torch.int8)
    (0, inf, -128)
    """
    if op == "sum":
        return 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return float("inf") if op == "min" else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if op == "min" else info.min


def _check_inside(inner: Block, outer: Block, src, dst) -> None:
    if any(not olo <= ilo <= ihi <= ohi for (ilo, ihi), (olo, ohi) in zip(inner, outer)):
        raise PlanError(f"{src} -> {dst} is not a local move: block {inner} is not inside {outer}")


# ---- collectives ----------------------------------------------------------------------------------

def _all_gather(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """S(d) -> B on step.axes: gather every member's piece (padded flat) into one buffer; the result is a
    view of it when the pieces are consecutive runs of the result, else assembled from it."""
    lay = gather(ctx.global_shape, ctx.mesh.shape, step.src, step.dst, step.axes, ctx.coord)
    if lay.width == 0:
        return local.new_empty(lay.shape)
    buf = local.new_empty(len(lay.numels) * lay.width)
    ctx.comm.all_gather(_flat_padded(local, lay.width), step.axes, numels=lay.numels, out=buf)
    if lay.runs is not None:
        if len(lay.runs) == 1:
            return buf[lay.runs[0][0]:lay.runs[0][1]].view(lay.shape)
        return torch.cat([buf[lo:hi] for lo, hi in lay.runs]).view(lay.shape)
    if lay.stack is not None:   # equal pieces side by side along one dim: one copy, not one per member
        return buf.view(lay.members_shape).movedim(0, lay.stack).reshape(lay.shape)
    out = local.new_empty(lay.shape)
    for where, shape, offset in lay.places:
        out[where] = buf[offset:offset + math.prod(shape)].view(shape)
    return out


def _reduce_scatter(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """P(op) -> S(d) on step.axes: the local as the input when its pieces are runs of it in member order
    (equal: `reduce_scatter`; unequal: `reduce_scatter_runs`, which pads only where the backend needs
    it), else its pieces copied into one padded buffer; reduce-scatter; trim this rank's piece."""
    lay = scatter(ctx.global_shape, ctx.mesh.shape, step.src, step.dst, step.axes, ctx.coord)
    if lay.width == 0:
        return local.new_empty(lay.shape)
    if lay.runs is not None:   # unequal runs of the local, in member order
        flat = local.contiguous().view(-1)
        return ctx.comm.reduce_scatter_runs(flat, lay.numels, step.axes, _op(step)).view(lay.shape)
    if lay.direct:
        inp = local.reshape(-1)
    elif lay.stack is not None:   # equal pieces side by side along one dim: one copy, not one per member
        inp = local.unflatten(lay.stack, (len(lay.numels), -1)).movedim(lay.stack, 0).reshape(-1)
    else:
        inp = local.new_empty(len(lay.numels) * lay.width)
        for where, shape, offset in lay.places:
            inp[offset:offset + math.prod(shape)].view(shape).copy_(local[where])
        for lo, hi in lay.pads:
            inp[lo:hi] = 0
    got = ctx.comm.reduce_scatter(inp, step.axes, _op(step), numels=lay.numels)  # n pieces of width
    return got[:lay.numels[lay.index]].view(lay.shape)


def _all_reduce(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """P(op) -> B on step.axes; in place when the executor made `local` (never on the caller's tensor)."""
    if local.numel() == 0:
        return local.contiguous()
    return ctx.comm.all_reduce(local, step.axes, _op(step), inplace=ctx.owns(local))


def _exchange(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """all_to_all / transfer: send exactly the listed blocks, receive the listed blocks, keep the rest.
    Send and receive buffers are the local and the result themselves where the blocks line up; the kept
    part is copied while the call is in flight (it touches neither buffer)."""
    lay = exchange_layout(ctx.global_shape, ctx.mesh.shape, step.src, step.dst, step.axes, ctx.coord)
    out, keep = _result_and_keep(lay, local)
    if not lay.moves:  # nothing moves anywhere in this group: no call
        return out
    if lay.send_run is not None and local.is_contiguous():
        inp = local.view(-1)[lay.send_run[0]:lay.send_run[1]]
    else:
        inp = local.new_empty(sum(lay.in_splits))
        for where, shape, offset in lay.sends:
            inp[offset:offset + math.prod(shape)].view(shape).copy_(local[where])
    if lay.recv_run is not None:
        ctx.comm.all_to_all_single(out.view(-1)[lay.recv_run[0]:lay.recv_run[1]], inp, lay.out_splits,
                                   lay.in_splits, step.axes, meanwhile=keep)
        return out
    got = ctx.comm.all_to_all_single(local.new_empty(sum(lay.out_splits)), inp, lay.out_splits, lay.in_splits,
                                     step.axes, meanwhile=keep)
    for where, shape, offset in lay.recvs:
        out[where] = got[offset:offset + math.prod(shape)].view(shape)
    return out


def _send_recv(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """all_to_all / transfer as point-to-point messages: each block is sent from the local and received
    into the result where it is one run there (a block for two peers is not copied at all), else packed
    just before its send or unpacked after; the kept part is copied while messages are in flight."""
    lay = p2p_layout(ctx.global_shape, ctx.mesh.shape, step.src, step.dst, step.axes, ctx.coord)
    out, keep = _result_and_keep(lay, local)
    if not lay.moves:  # nothing moves anywhere in this group: no call
        return out
    flat_in = local.view(-1) if local.is_contiguous() else None
    flat_out = out.view(-1)
    sends = [(peer, flat_in[run[0]:run[1]] if run is not None and flat_in is not None else _packer(local, where))
             for peer, run, where in lay.sends]
    recvs, unpack = [], []
    for peer, run, where, shape in lay.recvs:
        if run is not None:
            recvs.append((peer, flat_out[run[0]:run[1]]))
        else:
            buf = local.new_empty(shape)
            recvs.append((peer, buf))
            unpack.append((where, buf))
    ctx.comm.send_recv(sends, recvs, step.axes, meanwhile=keep, dtype=local.dtype)
    for where, buf in unpack:
        out[where] = buf
    return out


def _result_and_keep(lay, local: torch.Tensor):
    """An exchange's result buffer and the copy of the kept part into it (done now when nothing moves,
    else returned to run while the messages are in flight)."""
    out = local.new_empty(lay.shape)
    keep = None if lay.keep is None else lambda: out[lay.keep[1]].copy_(local[lay.keep[0]])
    if not lay.moves and keep is not None:
        keep()
    return out, keep


def _packer(local: torch.Tensor, where: tuple[slice, ...]):
    return lambda: local[where].contiguous()


# ---- helpers --------------------------------------------------------------------------------------

def _op(step: Step) -> str:
    if step.op is not None:
        return step.op
    p = step.src[step.axes[0]]
    if not isinstance(p, Partial):
        raise PlanError(f"{step!r} reduces, but its source placement on axis {step.axes[0]} is {p!r}, not Partial")
    return p.op


def _flat_padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` flattened (contiguous: a view when it already is) and zero-padded to `width` elements."""
    flat = t.reshape(-1)
    if flat.numel() == width:
        return flat
    out = flat.new_empty(width)
    out[:flat.numel()] = flat
    out[flat.numel():] = 0
    return out
