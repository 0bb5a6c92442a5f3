"""The executor: runs a `Plan` step by step on this rank's local tensor through the mesh's communicator.

Every size comes from layout maths (`sbp.layout.block` with the step's placements and the members'
coords), never from an assumed flat split: 10 rows nested over a 2x2 mesh are 3,2,3,2, not 3,3,2,2.
Uneven pieces are padded to one length (flattened) for all_gather / reduce_scatter and trimmed after;
all_to_all and transfers use exact per-peer sizes from `sbp.transfer.exchange`. A group whose pieces
are all empty makes no call at all (every member knows it from layout maths alone).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from .comm import Communicator, joined
from .errors import MeshError, PlanError, ShapeError
from .layout import Block, block, block_numel, block_shape, check_global_shape, relative
from .mesh import DeviceMesh
from .placement import Broadcast, Partial, Placement, Split, normalize
from .planner import plan as make_plan
from .steps import Plan, Step
from .transfer import exchange


@dataclass(frozen=True, slots=True)
class _Ctx:
    """What every step needs besides its own fields: the tensor, the mesh and this rank's place."""

    global_shape: tuple[int, ...]
    mesh: DeviceMesh  # pure value: shape and ranks
    coord: tuple[int, ...]
    comm: Communicator

    def block(self, pls: tuple[Placement, ...], coord: tuple[int, ...] | None = None) -> Block:
        return block(self.global_shape, self.mesh.shape, pls, self.coord if coord is None else coord)

    def member_coords(self, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [self.mesh.coord_of(r) for r in self.comm.members(axes)]


def execute(plan: Plan, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Run `plan` on this rank's `local` block of the source layout; return its block of the target.

    `mesh` must be bound (`sbp.init_mesh`, `sbp.testing.spmd`). A rank outside the mesh returns its
    (empty) `local` unchanged and takes part in nothing. The result is contiguous.

    >>> import sbp, sbp.testing, torch
    >>> from sbp.execute import execute
    >>> def fn(mesh):
    ...     p = sbp.plan((4, 2), mesh, "S(0)", "B")
    ...     local = torch.arange(8.).view(4, 2)[2 * mesh.coord[0]:][:2]
    ...     return execute(p, local, mesh).sum().item()
    >>> sbp.testing.spmd(fn, (2,))
    [28.0, 28.0]
    """
    ctx = _context(plan, mesh)
    if ctx is None:
        return local
    expected = block_shape(ctx.block(plan.src))
    if tuple(local.shape) != expected:
        raise ShapeError(f"rank {ctx.comm.rank} at coord {ctx.coord}: local shape {tuple(local.shape)} does not "
                         f"match the block {expected} that placements {plan.src} give a global shape "
                         f"{plan.global_shape} on mesh {plan.mesh_shape}")
    for step in plan.steps:
        local = _run(step, local, ctx)
    return local.contiguous()


def execute_step(step: Step, local: torch.Tensor, mesh: DeviceMesh, global_shape: Sequence[int]) -> torch.Tensor:
    """Run one step (tests use it to attribute traffic to steps); see `execute`.

    >>> import sbp, sbp.testing, torch
    >>> from sbp.execute import execute_step
    >>> def fn(mesh):
    ...     step = sbp.plan((4,), mesh, "B", "S(0)").steps[0]
    ...     return execute_step(step, torch.arange(4), mesh, (4,)).tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [[0, 1], [2, 3]]
    """
    ctx = _context(Plan(tuple(global_shape), tuple(mesh.shape), step.src, step.dst, local.element_size(),
                        (step,)), mesh)
    return local if ctx is None else _run(step, local, ctx).contiguous()


def redistribute_local(local: torch.Tensor, mesh: DeviceMesh, global_shape: Sequence[int], src, dst) -> torch.Tensor:
    """This rank's block of the tensor laid out as `dst`, from its block laid out as `src` (plans, then runs).

    Placements may be objects or strings; the plan is cached, so repeated calls cost no planning.

    >>> import sbp, sbp.testing, torch
    >>> from sbp.execute import redistribute_local
    >>> def fn(mesh):
    ...     x = torch.arange(16.).view(4, 4)
    ...     local = x[sbp.local_slices((4, 4), mesh, "S(0), S(1)", mesh.coord)]
    ...     return redistribute_local(local, mesh, (4, 4), "S(0), S(1)", "S(1), B").tolist()
    >>> sbp.testing.spmd(fn, (2, 2))[3]
    [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0], [14.0, 15.0]]
    """
    shape = check_global_shape(global_shape)
    src = normalize(src, len(shape), mesh.ndim)
    dst = normalize(dst, len(shape), mesh.ndim)
    return execute(_plan(shape, tuple(mesh.shape), src, dst, local.element_size()), local, mesh)


@lru_cache(maxsize=4096)
def _plan(shape: tuple[int, ...], mesh_shape: tuple[int, ...], src, dst, itemsize: int) -> Plan:
    return make_plan(shape, mesh_shape, src, dst, itemsize)


def _context(plan: Plan, mesh: DeviceMesh) -> _Ctx | None:
    coord = mesh.coord  # raises MeshError for a pure (unbound) mesh
    if coord is None:
        return None
    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise MeshError(f"plan is for a mesh of shape {plan.mesh_shape}, the mesh has shape {mesh.shape}")
    return _Ctx(plan.global_shape, DeviceMesh(mesh.shape, ranks=mesh.ranks), coord, mesh.binding)


def _run(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
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
            return _exchange(step, local, ctx)
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
            out = local.new_full(block_shape(want), identity(op, local.dtype))
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
    """S(d) -> B on step.axes: gather every member's piece (padded flat), trim, place into the dst block."""
    pieces = [ctx.block(step.src, c) for c in ctx.member_coords(step.axes)]
    want = ctx.block(step.dst)
    numels = [block_numel(p) for p in pieces]
    _check_tiling(pieces, want, step)
    if max(numels) == 0:
        return local.new_empty(block_shape(want))
    got = ctx.comm.all_gather(_flat_padded(local, max(numels)), step.axes, numels=numels)
    if _in_memory_order(pieces, want):
        whole = joined(got) if len(set(numels)) == 1 else None  # no padding: maybe one buffer already
        if whole is None:
            whole = torch.cat([g[:n] for g, n in zip(got, numels)])
        return whole.view(block_shape(want))
    out = local.new_empty(block_shape(want))
    for piece, g, n in zip(pieces, got, numels):
        out[relative(piece, want)] = g[:n].view(block_shape(piece))
    return out


def _reduce_scatter(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """P(op) -> S(d) on step.axes: cut the local into the members' dst pieces, pad, reduce-scatter, trim."""
    have = ctx.block(step.src)
    pieces = [ctx.block(step.dst, c) for c in ctx.member_coords(step.axes)]
    numels = [block_numel(p) for p in pieces]
    _check_tiling(pieces, have, step)
    mine = pieces[ctx.comm.members(step.axes).index(ctx.comm.rank)]
    if max(numels) == 0:
        return local.new_empty(block_shape(mine))
    width = max(numels)
    chunks = [_flat_padded(local[relative(p, have)], width) for p in pieces]
    got = ctx.comm.reduce_scatter(chunks, step.axes, _op(step), numels=numels)
    return got[:block_numel(mine)].view(block_shape(mine))


def _all_reduce(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """P(op) -> B on step.axes."""
    if local.numel() == 0:
        return local.contiguous()
    return ctx.comm.all_reduce(local, step.axes, _op(step))


def _exchange(step: Step, local: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """all_to_all / transfer: send exactly the listed blocks, receive the listed blocks, keep the rest."""
    ex = exchange(ctx.global_shape, ctx.mesh.shape, step.src, step.dst, step.axes, ctx.coord)
    me = ex.members.index(ctx.coord)
    have, want = ctx.block(step.src), ctx.block(step.dst)
    out = local.new_empty(block_shape(want))
    if ex.keep[me] is not None:
        out[relative(ex.keep[me], want)] = local[relative(ex.keep[me], have)]
    if ex.max_recv_elems == 0:  # nothing moves anywhere in this group
        return out
    n = len(ex.members)
    send: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for peer, b in ex.send[me]:
        send[peer].append(local[relative(b, have)].reshape(-1))
    recv: list[list[Block]] = [[] for _ in range(n)]
    for peer, b in ex.recv[me]:
        recv[peer].append(b)
    empty = local.new_empty(0)
    outbox = [parts[0] if len(parts) == 1 else torch.cat(parts) if parts else empty for parts in send]
    got = ctx.comm.all_to_all(outbox, [(sum(block_numel(b) for b in blocks),) for blocks in recv], step.axes)
    for blocks, inbox in zip(recv, got):
        offset = 0
        for b in blocks:
            n_b = block_numel(b)
            out[relative(b, want)] = inbox[offset:offset + n_b].view(block_shape(b))
            offset += n_b
    return out


# ---- helpers --------------------------------------------------------------------------------------

def _op(step: Step) -> str:
    if step.op is not None:
        return step.op
    p = step.src[step.axes[0]]
    if not isinstance(p, Partial):
        raise PlanError(f"{step!r} reduces, but its source placement on axis {step.axes[0]} is {p!r}, not Partial")
    return p.op


def _flat_padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` flattened (contiguous) and zero-padded to `width` elements."""
    flat = t.reshape(-1)
    if flat.numel() == width:
        return flat.contiguous()
    out = flat.new_zeros(width)
    out[:flat.numel()] = flat
    return out


def _check_tiling(pieces: list[Block], whole: Block, step: Step) -> None:
    """The members' pieces must lie inside `whole` and add up to it (a mismatch is a planner bug)."""
    if sum(map(block_numel, pieces)) != block_numel(whole) or any(
            not olo <= lo <= hi <= ohi for p in pieces for (lo, hi), (olo, ohi) in zip(p, whole)):
        raise PlanError(f"{step!r}: the members' pieces {pieces} do not tile the block {whole}")


def _in_memory_order(pieces: list[Block], whole: Block) -> bool:
    """True when the pieces, in member order, are consecutive runs of `whole` laid out row-major."""
    if not pieces:
        return True
    dims = [d for d in range(len(whole)) if pieces[0][d] != whole[d]]
    if len(dims) > 1:
        return False
    if not dims:
        return len(pieces) == 1
    d = dims[0]
    if any(hi - lo != 1 for lo, hi in whole[:d]) and block_numel(whole) > 0:
        return False
    starts = [p[d][0] for p in pieces]
    return starts == sorted(starts) and all(p[d][1] == q[d][0] for p, q in zip(pieces, pieces[1:]))
