"""Running a `CrossMeshPlan` on one rank: source-side steps, one point-to-point exchange, local moves.

`pack` and `assemble` are pure per-rank functions (the reference simulation in the tests routes their
outputs by hand); `redistribute_cross` runs them with the source mesh's communicator, whose
`exchange` sends each peer its pieces (on torch.distributed: one `all_to_all_single` on the group over
exactly the ranks of both meshes, made when they were bound, so every member of it takes part).
Ranks outside both meshes return at once and are never waited on.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..planning.crossmesh import CrossMeshPlan, plan_cross_mesh
from ..values.errors import MeshError
from ..values.layout import block, block_shape, relative
from ..values.mesh import DeviceMesh
from .agreement import agree, is_enabled, peer_gather, plan_signature
from .executor import execute

REDUCE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}


def pack(plan: CrossMeshPlan, rank: int, local: Optional[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """The pieces `rank` sends, per destination rank, in plan order; `local` is its block of `plan.mid`."""
    out: dict[int, list[torch.Tensor]] = {}
    if rank not in plan.src_mesh.ranks:
        return out
    have = block(plan.global_shape, plan.src_mesh.shape, plan.mid, plan.src_mesh.coord_of(rank))
    for p in plan.pieces_of(rank):
        if p.src_rank == rank and p.dst_rank != rank:
            out.setdefault(p.dst_rank, []).append(local[relative(p.block, have)])
    return out


def expected(plan: CrossMeshPlan, rank: int) -> dict[int, list[tuple[int, ...]]]:
    """The shapes `rank` receives, per source rank, in plan order."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for p in plan.pieces_of(rank):
        if p.dst_rank == rank and p.src_rank != rank:
            out.setdefault(p.src_rank, []).append(block_shape(p.block))
    return out


def assemble(plan: CrossMeshPlan, rank: int, local: Optional[torch.Tensor], received: dict[int, list[torch.Tensor]],
             dtype: torch.dtype, device) -> torch.Tensor:
    """`rank`'s block of `plan.land` built from its own pieces and `received` (as `expected` orders them).

    Partial contributions are reduced with the plan's op in contribution order (the same on every rank).
    """
    coord = plan.dst_mesh.coord_of(rank)
    want = block(plan.global_shape, plan.dst_mesh.shape, plan.land, coord)
    have = None
    if rank in plan.src_mesh.ranks:
        have = block(plan.global_shape, plan.src_mesh.shape, plan.mid, plan.src_mesh.coord_of(rank))
    parts: list[Optional[torch.Tensor]] = [None] * plan.parts
    cursor = {peer: 0 for peer in received}
    for p in plan.pieces_of(rank):
        if p.dst_rank != rank:
            continue
        if p.src_rank == rank:
            data = local[relative(p.block, have)]
        else:
            data = received[p.src_rank][cursor[p.src_rank]]
            cursor[p.src_rank] += 1
        if parts[p.part] is None:
            parts[p.part] = torch.empty(block_shape(want), dtype=dtype, device=device)
        parts[p.part][relative(p.block, want)] = data
    filled = [t for t in parts if t is not None]
    if not filled:  # an empty target block
        return torch.empty(block_shape(want), dtype=dtype, device=device)
    out = filled[0]
    for t in filled[1:]:
        out = REDUCE[plan.op](out, t)
    return out


def redistribute_cross(local: torch.Tensor, src_mesh: DeviceMesh, global_shape: Sequence[int], src,
                       dst_mesh: DeviceMesh, dst) -> torch.Tensor:
    """Move this rank's `local` block (placements `src` on `src_mesh`) to its block of `dst` on `dst_mesh`.

    Every rank of both meshes must call it (SPMD); others return their `local` untouched. Ranks outside
    `dst_mesh` return an empty tensor.

    >>> import sbp, sbp.testing, torch
    >>> from sbp.runtime.crossmesh import redistribute_cross
    >>> def fn(world):
    ...     a = sbp.testing.submesh(world, (2,), ranks=[0, 1])
    ...     b = sbp.testing.submesh(world, (2,), ranks=[2, 3])
    ...     full = torch.arange(8.)
    ...     local = full[4 * a.coord[0]:][:4] if a.coord is not None else full[:0]
    ...     return redistribute_cross(local, a, (8,), "S(0)", b, "B").tolist()
    >>> sbp.testing.spmd(fn, (4,))  # doctest: +SKIP
    [[], [], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    comm = src_mesh.binding
    if comm is None:
        raise MeshError("cross-mesh redistribution needs a bound source mesh (sbp.init_mesh or sbp.testing.spmd)")
    plan = plan_cross_mesh(global_shape, src_mesh, src, dst_mesh, dst, local.element_size())
    rank = comm.rank
    if rank not in plan.ranks:
        return local
    if is_enabled():  # every rank of both meshes: same arguments, same plan (sbp.debug)
        agree(peer_gather(comm, plan.ranks), plan.ranks, "redistribute(mesh=...)", {
            "src mesh": src_mesh, "dst mesh": dst_mesh, "dtype": local.dtype, "global shape": tuple(global_shape),
            "src placements": plan.src, "dst placements": plan.dst, "plan": plan_signature(plan)},
            device=local.device)
    if rank in src_mesh.ranks:
        local = execute(plan.pre, local, src_mesh)
    send = pack(plan, rank, local)
    recv_shapes = expected(plan, rank)
    received = comm.exchange(plan.ranks, send, recv_shapes, dtype=local.dtype, device=local.device)
    if rank not in dst_mesh.ranks:
        return local.new_empty((0,) * len(plan.global_shape))
    out = assemble(plan, rank, local, received, local.dtype, local.device)
    if dst_mesh.binding is None:
        raise MeshError("cross-mesh redistribution needs a bound destination mesh")
    return execute(plan.post, out, dst_mesh)
