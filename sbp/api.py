"""Making global tensors from plain ones: `distribute` (from the full tensor) and `from_local` (from shards).

Both are SPMD calls: every rank of the mesh makes them in the same order. The only communication is a
scatter for ``distribute(..., src=rank)`` and one small all_gather of local shapes (more with
``check=True``) for `from_local`.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from .errors import MeshError, RankMismatchError, ShapeError, SbpError
from .layout import check_global_shape, local_shape, local_slices, splitters
from .mesh import DeviceMesh
from .placement import Broadcast, normalize
from .tensor import GlobalTensor, empty_outside, local_from_full, sum_holds_value

# every dtype a global tensor may have, by a stable code for metadata collectives
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def distribute(tensor: Optional[torch.Tensor], mesh: DeviceMesh, placements, *, src: Optional[int] = None,
               requires_grad: Optional[bool] = None) -> GlobalTensor:
    """Lay out a full tensor on `mesh` with `placements`; every rank keeps only its block.

    With ``src=None`` every rank passes the same full tensor and slices its block locally (no
    communication). With ``src=r`` only world rank `r` needs the data: the others pass None (or any
    tensor; it is ignored), learn the shape and dtype from one small all_gather, and receive exactly
    their block (one all_to_all in which only `r` sends). `P(sum)` keeps the value on coord 0 of the
    axis and zeros elsewhere; `P(min|max)` keep it everywhere. The result is a leaf; it requires grad
    when `requires_grad` is True (default: as `tensor`).

    Per-rank table for ``distribute(torch.arange(8.).view(4, 2), mesh2x2, "S(0), P(sum)")``:

    ======  =====  =====================
    rank    coord  local
    ======  =====  =====================
    0       (0,0)  rows 0:2
    1       (0,1)  zeros, shape (2, 2)
    2       (1,0)  rows 2:4
    3       (1,1)  zeros, shape (2, 2)
    ======  =====  =====================

    >>> import torch, sbp
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.arange(8.).view(4, 2), mesh, "S(0), B")
    ...     return x.to_local().tolist()
    >>> sbp.testing.spmd(fn, (2, 2))
    [[[0.0, 1.0], [2.0, 3.0]], [[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]], [[4.0, 5.0], [6.0, 7.0]]]
    """
    _check_bound(mesh, "distribute")
    if isinstance(tensor, GlobalTensor):
        raise SbpError("distribute needs a plain torch.Tensor, got a GlobalTensor; use x.redistribute(placements)")
    if src is None:
        if not isinstance(tensor, torch.Tensor):
            raise SbpError(f"distribute needs a torch.Tensor on every rank when src=None, got {type(tensor).__name__}; "
                           f"pass src=rank to scatter from one rank")
        tensor = _to_mesh_device(tensor.detach(), mesh)
        pls = normalize(placements, tensor.ndim, mesh.ndim)
        local = local_from_full(tensor, mesh, pls)
        shape = tuple(tensor.shape)
        grad = tensor.requires_grad if requires_grad is None else requires_grad
    else:
        local, pls, shape, grad = _scatter(tensor, mesh, placements, src)
        grad = grad if requires_grad is None else requires_grad
    out = GlobalTensor(local, mesh, pls, shape)
    return out.requires_grad_(True) if grad else out


def _scatter(tensor, mesh: DeviceMesh, placements, src: int):
    if isinstance(src, bool) or not isinstance(src, int) or src not in mesh.ranks:
        raise MeshError(f"distribute src={src!r} must be a world rank of the mesh (ranks: {list(mesh.ranks)})")
    coord = mesh.coord
    me = mesh.rank
    if me == src and not isinstance(tensor, torch.Tensor):
        raise SbpError(f"distribute(src={src}): rank {src} must pass the full tensor, got {type(tensor).__name__}")
    if coord is None:  # outside the mesh: no part in the scatter; the shape comes from what this rank passed
        if not isinstance(tensor, torch.Tensor):
            raise SbpError(f"distribute(src={src}): rank {me} is outside the mesh and cannot learn the shape; "
                           f"pass a tensor of the global shape and dtype (e.g. torch.empty(shape))")
        pls = normalize(placements, tensor.ndim, mesh.ndim)
        return empty_outside(tensor.ndim, tensor.dtype, tensor.device), pls, tuple(tensor.shape), False
    comm, axes = mesh.binding, tuple(range(mesh.ndim))
    if me == src:
        tensor = _to_mesh_device(tensor.detach(), mesh)
        meta = _ints([tensor.ndim, _dtype_code(tensor.dtype), int(tensor.requires_grad)], mesh)
    else:
        meta = _ints([-1, -1, 0], mesh)
    src_index = mesh.ranks.index(src)
    ndim, code, grad = comm.all_gather(meta, axes)[src_index].tolist()
    dtype = DTYPES[code]
    dims = _ints(list(tensor.shape) if me == src else [0] * ndim, mesh)
    shape = tuple(comm.all_gather(dims, axes)[src_index].tolist())
    pls = normalize(placements, ndim, mesh.ndim)
    device = torch.device(mesh.device_type)
    holds = [sum_holds_value(mesh, pls, c) for c in mesh.coords()]
    blocks = [local_shape(shape, mesh.shape, pls, c) for c in mesh.coords()]
    empty = torch.empty(0, dtype=dtype, device=device)
    if me == src:
        send = [tensor[local_slices(shape, mesh.shape, pls, c)].contiguous() if h else empty
                for c, h in zip(mesh.coords(), holds)]
    else:
        send = [empty] * mesh.size()
    mine = mesh.index_of(coord)
    recv_shapes = [(0,)] * mesh.size()
    if holds[mine]:
        recv_shapes[src_index] = blocks[mine]
    got = comm.all_to_all(send, recv_shapes, axes)[src_index]
    local = got if holds[mine] else torch.zeros(blocks[mine], dtype=dtype, device=device)
    return local, pls, shape, bool(grad)


def from_local(local: torch.Tensor, mesh: DeviceMesh, placements, *, global_shape: Optional[Sequence[int]] = None,
               check: bool = False) -> GlobalTensor:
    """Wrap this rank's local tensor as its part of a global tensor (differentiable, no copy).

    Without `global_shape` it is inferred with one all_gather of the local shapes (each split dim's global
    length is the sum of the local lengths along its splitting axes); the local shapes must then form a
    balanced split (as `numpy.array_split`), otherwise `ShapeError` names the ranks that do not fit.
    With ``check=True`` the ranks also verify that they agree on ndim, dtype, placements, global shape
    and that Broadcast locals are bit-identical; a `RankMismatchError` names the ranks that differ.
    A rank outside the mesh must pass `global_shape`.

    >>> import torch, sbp
    >>> def fn(mesh):
    ...     local = torch.full((3 - mesh.coord[0], 3), float(mesh.rank))   # 3 rows on rank 0, 2 on rank 1
    ...     return sbp.from_local(local, mesh, "S(0)").shape
    >>> sbp.testing.spmd(fn, (2,))
    [torch.Size([5, 3]), torch.Size([5, 3])]
    """
    _check_bound(mesh, "from_local")
    if not isinstance(local, torch.Tensor) or isinstance(local, GlobalTensor):
        raise SbpError(f"from_local needs this rank's plain local torch.Tensor, got {type(local).__name__}")
    pls = normalize(placements, local.ndim, mesh.ndim)
    coord = mesh.coord
    if global_shape is not None:
        global_shape = check_global_shape(global_shape)
        if len(global_shape) != local.ndim:
            raise ShapeError(f"from_local: global_shape {global_shape} has {len(global_shape)} dims but the local "
                             f"tensor has {local.ndim} (shape {tuple(local.shape)})")
    if coord is None:
        if global_shape is None:
            raise SbpError(f"from_local: rank {mesh.rank} is outside the mesh and cannot infer the global shape; "
                           f"pass global_shape=")
    else:
        shapes = None
        if check:
            shapes = _check_ranks(local, mesh, pls, global_shape)
        if global_shape is None:
            shapes = shapes if shapes is not None else _gather_shapes(local, mesh)
            global_shape = _infer_global_shape(shapes, mesh, pls)
        _check_local_shapes(global_shape, mesh, pls, shapes, local)
    from .autograd import from_local_autograd
    return from_local_autograd(local, mesh, pls, tuple(global_shape))


# ---- from_local helpers ------------------------------------------------------------------------------
def _gather_shapes(local: torch.Tensor, mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """Every mesh member's local shape, in row-major coord order (one all_gather over the whole mesh)."""
    got = mesh.binding.all_gather(_ints(list(local.shape), mesh), tuple(range(mesh.ndim)))
    return [tuple(t.tolist()) for t in got]


def _infer_global_shape(shapes: list[tuple[int, ...]], mesh: DeviceMesh, pls) -> tuple[int, ...]:
    out = []
    for dim in range(len(shapes[0])):
        axes = splitters(pls, dim)
        # the group along the splitting axes through coord 0 tiles the dim (nested, row-major over the axes)
        coords = [c for c in mesh.coords() if all(c[a] == 0 for a in range(mesh.ndim) if a not in axes)]
        out.append(sum(shapes[mesh.index_of(c)][dim] for c in coords))
    return tuple(out)


def _check_local_shapes(global_shape, mesh: DeviceMesh, pls, shapes, local: torch.Tensor) -> None:
    """Local shapes must be the layout's balanced blocks: all ranks' when gathered, else this rank's."""
    coords = mesh.coords() if shapes is not None else [mesh.coord]
    got = shapes if shapes is not None else [tuple(local.shape)]
    bad = [(mesh.rank_of(c), g, local_shape(global_shape, mesh.shape, pls, c))
           for c, g in zip(coords, got) if tuple(g) != local_shape(global_shape, mesh.shape, pls, c)]
    if bad:
        detail = "; ".join(f"rank {r} has {tuple(g)}, expected {e}" for r, g, e in bad)
        raise ShapeError(f"from_local: local shapes do not fit global shape {tuple(global_shape)} with placements "
                         f"{pls} on mesh {mesh.shape} (sbp splits are balanced, as numpy.array_split): {detail}")


def _check_ranks(local: torch.Tensor, mesh: DeviceMesh, pls, global_shape) -> list[tuple[int, ...]]:
    """check=True: compare ndim, dtype, placements, global_shape and Broadcast values across ranks."""
    axes = tuple(range(mesh.ndim))
    meta = _ints([local.ndim, _dtype_code(local.dtype), _digest(repr(pls).encode()),
                  _digest(repr(global_shape).encode()), _digest(_bytes_of(local))], mesh)
    rows = [t.tolist() for t in mesh.binding.all_gather(meta, axes)]
    for col, what in ((0, "ndim"), (1, "dtype"), (2, "placements"), (3, "global_shape")):
        _agree(mesh, [r[col] for r in rows], what)
    shapes = _gather_shapes(local, mesh)
    b_axes = [a for a, p in enumerate(pls) if isinstance(p, Broadcast)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(mesh.coords()):
        groups.setdefault(tuple(v for a, v in enumerate(c) if a not in b_axes), []).append(i)
    for members in groups.values():
        _agree(mesh, {i: rows[i][4] for i in members}, f"Broadcast values (axes {tuple(b_axes)})")
    return shapes


def _agree(mesh: DeviceMesh, values, what: str) -> None:
    items = values.items() if isinstance(values, dict) else enumerate(values)
    by_value: dict[int, list[int]] = {}
    for index, v in items:
        by_value.setdefault(v, []).append(mesh.ranks[index])
    if len(by_value) > 1:
        parts = sorted(by_value.values(), key=lambda rs: (-len(rs), rs))
        raise RankMismatchError(f"from_local(check=True): ranks disagree on {what}: "
                                + " vs ".join(f"ranks {rs}" for rs in parts))


def _bytes_of(t: torch.Tensor) -> bytes:
    head = repr((tuple(t.shape), t.dtype)).encode()
    return head + t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _ints(values: list[int], mesh: DeviceMesh) -> torch.Tensor:
    """A small int64 tensor for a metadata collective, on the mesh's device (NCCL needs CUDA tensors)."""
    return torch.tensor(values, dtype=torch.int64, device=torch.device(mesh.device_type))


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise SbpError(f"dtype {dtype} is not supported for global tensors (supported: {', '.join(map(str, DTYPES))})")
    return DTYPES.index(dtype)


def _check_bound(mesh: DeviceMesh, what: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"{what} needs an sbp.DeviceMesh, got {type(mesh).__name__}")
    if mesh.binding is None:
        raise MeshError(f"{what} needs a mesh bound to processes (sbp.init_mesh or sbp.testing.spmd); "
                        f"{mesh!r} is a pure value")


def _to_mesh_device(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return t if t.device.type == mesh.device_type else t.to(mesh.device_type)
