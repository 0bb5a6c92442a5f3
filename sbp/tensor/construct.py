"""Making global tensors from plain ones: `distribute` (from the full tensor) and `from_local` (from shards).

Both are SPMD calls: every rank of the mesh makes them in the same order. The only communication is a
scatter for ``distribute(..., src=rank)`` and one small all_gather of local shapes (more with
``check=True``) for `from_local`. Those metadata collectives also carry the ranks' src, dtype and
placements, so ranks that disagree get a `RankMismatchError` at no extra cost; under `sbp.debug()` every
call checks (see `sbp.debug`).
"""
from __future__ import annotations

import hashlib
import math
from typing import Optional, Sequence

import torch

from ..runtime import symbolic
from ..runtime.agreement import agree, digest, is_enabled, mesh_gather, mismatch
from ..runtime.traced import CompileError, assert_rows_agree, is_tracing, traced_here
from ..values.errors import DTypeError, MeshError, RankMismatchError, SbpError, ShapeError
from ..values.layout import check_global_shape, local_shape, local_slices, splitters
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Split, normalize, placements_repr
from .autograd import from_local_autograd
from .global_tensor import (
    GlobalTensor,
    check_local_device,
    check_partial_dtype,
    contiguous_strides,
    empty_outside,
    local_from_full,
    mesh_description,
    mesh_device,
    mesh_of,
    placements_text,
    sum_holds_value,
)

# every dtype a global tensor may have, by a stable code for metadata collectives
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def distribute(tensor: Optional[torch.Tensor], mesh: DeviceMesh, placements, *, src: Optional[int] = None,
               requires_grad: Optional[bool] = None, src_data_rank: Optional[int] = None) -> GlobalTensor:
    """Lay out a full tensor on `mesh` with `placements`; every rank keeps only its block.

    With ``src=None`` every rank passes the same full tensor and slices its block locally (no
    communication). With ``src=r`` only world rank `r` needs the data: the others pass None (or any
    tensor; it is ignored), learn the shape and dtype from one small all_gather, and receive exactly
    their block (one all_to_all in which only `r` sends). `P(sum)` keeps the value on coord 0 of the
    axis and zeros elsewhere; `P(min|max)` keep it everywhere. The result is a leaf; it requires grad
    when `requires_grad` is True (default: as `tensor`). ``src_data_rank=`` is DTensor's name for `src`.

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
    if src_data_rank is not None:
        if src is not None and src != src_data_rank:
            raise SbpError(f"distribute got src={src!r} and src_data_rank={src_data_rank!r} (DTensor's name for it); "
                           f"pass one")
        src = src_data_rank
    # dynamo: one opaque call, traced by AOTAutograd (slicing, no collective)
    if torch.compiler.is_compiling() and traced_here():
        if src is not None or requires_grad or (isinstance(tensor, torch.Tensor) and tensor.requires_grad
                                                and requires_grad is None):
            return _eager_distribute(tensor, mesh, placements, src, requires_grad)   # a graph break
        _check_in_graph(tensor, mesh, placements, "distribute")
        return _compiled_distribute(tensor, mesh_description(mesh), placements_text(placements))
    return _distribute(tensor, mesh, placements, src, requires_grad)


def _check_in_graph(tensor, mesh: DeviceMesh, placements, what: str, global_shape=None) -> None:
    """The argument checks of `distribute` / `from_local` that need no data, made in the code dynamo traces:
    a bad argument reaches the user as sbp's error inside dynamo's ("Observed exception ... PlacementError(
    'S(5) is out of range ...')"; without ``fullgraph`` the eager call raises it itself). Raised inside the
    opaque call, dynamo would report it as an unsupported output type of that call."""
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"{what} needs an sbp.DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, GlobalTensor):
        raise SbpError(f"{what} needs a plain torch.Tensor, got {type(tensor).__name__}")
    pls = normalize(placements, tensor.ndim, mesh.ndim, cache=False)
    check_partial_dtype(pls, tensor.dtype, what)
    if global_shape is not None:
        _check_global_ndim(tuple(global_shape), tensor)
        if mesh.coord is not None:
            _check_local_block(tensor, tuple(global_shape), mesh, pls, cache=False)


def _check_global_ndim(global_shape: tuple, local: torch.Tensor) -> None:
    if len(global_shape) != local.ndim:
        raise ShapeError(f"from_local: global_shape {global_shape} has {len(global_shape)} dims but the local "
                         f"tensor has {local.ndim} (shape {tuple(local.shape)})")


def _check_local_block(local: torch.Tensor, global_shape: tuple, mesh: DeviceMesh, pls, cache: bool = True) -> None:
    """This rank's local shape is its block of `global_shape`, compared where both sizes are ints (checking a
    symbolic one would add a guard); compiled code, where no collective can compare the ranks' shapes."""
    want = tuple(hi - lo for lo, hi in symbolic.block_of(global_shape, mesh.shape, pls, mesh.coord, cache))
    bad = [(w, g) for w, g in zip(want, local.shape) if type(w) is int and type(g) is int and w != g]
    if bad:
        raise ShapeError(f"from_local: local shape {tuple(local.shape)} does not fit global shape "
                         f"{tuple(global_shape)} with placements {placements_repr(pls)} on mesh {mesh.shape} at "
                         f"coord {mesh.coord}: expected {want}")


_DISTRIBUTE_IN_GRAPH = ("sbp.distribute with src= or with a result that requires grad is not traced into a compiled "
                        "graph (scattering from one rank takes a collective on the tensor's shape; a graph cannot "
                        "make a new leaf that requires grad): it runs eagerly between two graphs. With "
                        "fullgraph=True call distribute outside the compiled function (or pass a tensor that "
                        "does not require grad, from every rank)")


def _distribute_described(tensor: torch.Tensor, mesh: tuple, placements) -> GlobalTensor:
    return _distribute(tensor, mesh_of(mesh), placements, None, False)


_compiled_distribute = torch._dynamo.nonstrict_trace(_distribute_described)


def check_dense(t: torch.Tensor, what: str) -> None:
    """Refuse sparse, nested and other non-strided tensors: a global tensor's local is a dense strided block.

    >>> check_dense(torch.eye(2).to_sparse(), "distribute")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.values.errors.SbpError: distribute needs a dense (strided) tensor, got layout torch.sparse_coo; ...
    """
    if t.is_nested or t.layout != torch.strided:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise SbpError(f"{what} needs a dense (strided) tensor, got {kind}; convert it first (t.to_dense())")
    if t.is_quantized:   # its scale and zero point are no local block: ops on it fail inside torch later
        raise DTypeError(f"{what} does not take quantized tensors, got {t.dtype}; dequantize it first "
                         f"(t.dequantize()), or lay out its int_repr()")


def _distribute(tensor, mesh: DeviceMesh, placements, src: Optional[int],
                requires_grad: Optional[bool]) -> GlobalTensor:
    _check_bound(mesh, "distribute")
    if isinstance(tensor, GlobalTensor):
        raise SbpError("distribute needs a plain torch.Tensor, got a GlobalTensor; use x.redistribute(placements)")
    if isinstance(tensor, torch.Tensor):
        check_dense(tensor, "distribute")
    if requires_grad is not None and not isinstance(requires_grad, bool):
        raise SbpError(f"distribute(requires_grad=...) must be None or a bool, got {requires_grad!r}")
    mesh_device(mesh, "distribute")
    if src is None:
        if not isinstance(tensor, torch.Tensor):
            raise SbpError(f"distribute needs a torch.Tensor on every rank when src=None, got {type(tensor).__name__}; "
                           f"pass src=rank to scatter from one rank")
        pls = normalize(placements, tensor.ndim, mesh.ndim)
        check_partial_dtype(pls, tensor.dtype, "distribute")
        if is_enabled() and mesh.coord is not None:
            gather, members = mesh_gather(mesh)
            agree(gather, members, "distribute", {"mesh": mesh, "dtype": tensor.dtype, "global shape":
                  tuple(tensor.shape), "placements": pls, "src": None}, device=mesh.device_type)
        grad = tensor.requires_grad if requires_grad is None else requires_grad   # before detach()
        # a meta tensor (deferred init: built on the meta device, given storage by to_empty later) stays meta
        tensor = tensor.detach() if tensor.is_meta else _to_mesh_device(tensor.detach(), mesh)
        local = local_from_full(tensor, mesh, pls)
        shape = tuple(tensor.shape)
    else:
        local, pls, shape, grad = _scatter(tensor, mesh, placements, src)
        grad = grad if requires_grad is None else requires_grad
    out = GlobalTensor(local, mesh, pls, shape)
    if grad and not (out.dtype.is_floating_point or out.dtype.is_complex):
        raise DTypeError(f"distribute(requires_grad=True): only floating point and complex tensors can require "
                         f"gradients, got {out.dtype}")
    return out.requires_grad_(True) if grad else out


_eager_distribute = torch._dynamo.disable(_distribute, reason=_DISTRIBUTE_IN_GRAPH)


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
    gather, members = mesh_gather(mesh)
    # every rank sends the src it was given (free agreement check); only src fills in ndim, dtype, grad.
    # An unsupported dtype travels as code -1, so every rank raises together instead of leaving src alone.
    # A tensor src cannot move to the mesh's device (a meta tensor: no data) travels as code -2, the same way.
    unmoved: Optional[MeshError] = None
    if me == src:
        wants_grad = tensor.requires_grad
        try:
            tensor = _to_mesh_device(tensor.detach(), mesh)
            code = DTYPES.index(tensor.dtype) if tensor.dtype in DTYPES else -1
        except MeshError as e:
            unmoved, code = e, -2
        meta = [src, tensor.ndim, code, int(wants_grad)]
    else:
        meta = [src, -1, -1, 0]
    rows = [t.tolist() for t in comm.all_gather(_ints(meta, mesh), axes)]
    if len({r[0] for r in rows}) > 1:
        raise mismatch("distribute", "src", [r[0] for r in rows], members)
    src_index = mesh.ranks.index(src)
    _, ndim, code, grad = rows[src_index]
    if code == -2:
        raise unmoved or MeshError(f"distribute(src={src}): rank {src}'s tensor cannot move to the mesh's device "
                                   f"{mesh.device_type!r} (a meta tensor has no data to scatter)")
    if code < 0:
        raise DTypeError(f"distribute(src={src}): rank {src}'s tensor has a dtype that cannot be scattered "
                         f"{'(' + str(tensor.dtype) + ') ' if me == src else ''}(supported: "
                         f"{', '.join(map(str, DTYPES))})")
    dtype = DTYPES[code]
    pls = normalize(placements, ndim, mesh.ndim)
    check_partial_dtype(pls, dtype, "distribute")
    # the shape gather carries every rank's placements too (free agreement check)
    fields = {"placements": pls, **({"mesh": mesh} if is_enabled() else {})}
    shapes = agree(gather, members, "distribute", fields, list(tensor.shape) if me == src else [0] * ndim,
                   device=mesh.device_type)
    shape = tuple(shapes[src_index])
    device = torch.device(mesh.device_type)
    # Each distinct block leaves src once: to the first rank (coord 0) along the axes that repeat the value
    # (B and P(min|max)), which passes it on along those axes; src never holds more than the tensor itself.
    # (src itself leads its own group; other groups are led by their coord 0 along those axes)
    repeat = tuple(a for a, p in enumerate(pls) if not isinstance(p, Split) and p != Partial("sum"))
    coords = mesh.coords()
    src_coord = coords[src_index]
    lead = [src_coord if all(c[a] == src_coord[a] for a in range(mesh.ndim) if a not in repeat)
            else tuple(0 if a in repeat else k for a, k in enumerate(c)) for c in coords]
    holds = [sum_holds_value(mesh, pls, c) for c in coords]
    first = [h and c == ld for c, h, ld in zip(coords, holds, lead)]
    blocks = [local_shape(shape, mesh.shape, pls, c) for c in coords]
    empty = torch.empty(0, dtype=dtype, device=device)
    if me == src:
        send = [tensor[local_slices(shape, mesh.shape, pls, c)].contiguous() if f else empty
                for c, f in zip(coords, first)]
    else:
        send = [empty] * mesh.size()
    mine = mesh.index_of(coord)
    recv_shapes = [(0,)] * mesh.size()
    if first[mine]:
        recv_shapes[src_index] = blocks[mine]
    got = comm.all_to_all(send, recv_shapes, axes)[src_index]
    if repeat:   # every member of the group along `repeat` calls; its first member (index 0) sends
        sends: list = []
        recvs: list = []
        if holds[mine] and not first[mine]:
            got = torch.empty(blocks[mine], dtype=dtype, device=device)
        if holds[mine] and math.prod(blocks[mine]):
            group = comm.members(repeat)
            leader = group.index(mesh.ranks[mesh.index_of(lead[mine])])
            if first[mine]:
                sends = [(i, got) for i in range(len(group)) if i != leader]
            else:
                recvs = [(leader, got)]
        comm.send_recv(sends, recvs, repeat, dtype=dtype)
    local = got if holds[mine] else torch.zeros(blocks[mine], dtype=dtype, device=device)
    return local, pls, shape, bool(grad)


def from_local(local: torch.Tensor, mesh: DeviceMesh, placements, *, global_shape: Optional[Sequence[int]] = None,
               check: bool = False, run_check: Optional[bool] = None, shape: Optional[Sequence[int]] = None,
               stride: Optional[Sequence[int]] = None) -> GlobalTensor:
    """Wrap this rank's local tensor as its part of a global tensor (differentiable, no copy).

    Without `global_shape` it is inferred with one all_gather of the local shapes (each split dim's global
    length is the sum of the local lengths along its splitting axes); the local shapes must then form a
    balanced split (as `numpy.array_split`), otherwise `ShapeError` names the ranks that do not fit.
    Inside `torch.compile` the shards are taken as even instead (as DTensor's `from_local`), checked at run
    time by the same all_gather in the graph (docs/compile.md).
    With ``check=True`` the ranks also verify that they agree on ndim, dtype, placements, global shape
    and that Broadcast locals are bit-identical; a `RankMismatchError` names the ranks that differ.
    A rank outside the mesh must pass `global_shape`. DTensor's spellings work too: ``run_check=`` (as
    `check`), ``shape=`` (as `global_shape`) and ``stride=`` (the contiguous strides of the shape: a global
    tensor's logical layout).

    >>> import torch, sbp
    >>> def fn(mesh):
    ...     local = torch.full((3 - mesh.coord[0], 3), float(mesh.rank))   # 3 rows on rank 0, 2 on rank 1
    ...     return sbp.from_local(local, mesh, "S(0)").shape
    >>> sbp.testing.spmd(fn, (2,))
    [torch.Size([5, 3]), torch.Size([5, 3])]
    """
    if run_check is not None or shape is not None or stride is not None:
        global_shape, check = _dtensor_from_local(global_shape, check, run_check, shape, stride)
    # dynamo: one opaque call, traced by AOTAutograd (no collective)
    if torch.compiler.is_compiling() and traced_here():
        if check:
            return _eager_from_local(local, mesh, placements, global_shape, check)   # a graph break
        if global_shape is None:
            global_shape = _unsplit_shape(local, mesh, placements)   # None: even shards, checked in the graph
        _check_in_graph(local, mesh, placements, "from_local", global_shape)
        if global_shape is None:
            return _compiled_from_even_locals(local, mesh_description(mesh), placements_text(placements))
        return _compiled_from_local(local, mesh_description(mesh), placements_text(placements),
                                    tuple(global_shape), check)
    return _from_local(local, mesh, placements, global_shape, check)


def _unsplit_shape(local, mesh, placements) -> Optional[tuple]:
    """The global shape `from_local` can read off the local tensor alone: with no `Split` placement every
    rank holds the whole shape (`B`, `P`); None where it takes the other ranks' shapes (compiled: even
    shards, checked in the graph) or the arguments are bad (the traced call reports them)."""
    if not isinstance(local, torch.Tensor) or isinstance(local, GlobalTensor) or not isinstance(mesh, DeviceMesh):
        return None
    pls = normalize(placements, local.ndim, mesh.ndim, cache=False)
    return None if any(isinstance(p, Split) for p in pls) else tuple(local.shape)


def _dtensor_from_local(global_shape, check, run_check, shape, stride) -> tuple:
    """`from_local`'s (global_shape, check) given DTensor's ``run_check=``, ``shape=`` and ``stride=``."""
    if run_check is not None:
        if not isinstance(run_check, bool):
            raise SbpError(f"from_local(run_check=...) takes a bool, got {run_check!r}")
        check = check or run_check
    if shape is not None:
        if global_shape is not None and tuple(global_shape) != tuple(shape):
            raise SbpError(f"from_local got global_shape={tuple(global_shape)} and shape={tuple(shape)} (DTensor's "
                           f"name for it); pass one")
        global_shape = shape
    if stride is not None:
        if global_shape is None:
            raise SbpError("from_local(stride=...) needs the shape too (shape= or global_shape=), as DTensor's")
        want = contiguous_strides(tuple(global_shape))
        if tuple(stride) != want:
            raise SbpError(f"from_local(stride={tuple(stride)}): a global tensor's logical strides are the "
                           f"contiguous ones of its shape {tuple(global_shape)}, {want}; omit stride= or pass those")
    return global_shape, check


def _from_local(local: torch.Tensor, mesh: DeviceMesh, placements, global_shape, check: bool) -> GlobalTensor:
    _check_bound(mesh, "from_local")
    if not isinstance(local, torch.Tensor) or isinstance(local, GlobalTensor):
        raise SbpError(f"from_local needs this rank's plain local torch.Tensor, got {type(local).__name__}")
    if not isinstance(check, bool):   # a truthy "no" would run the checks, a falsy 0 skip them silently
        raise SbpError(f"from_local(check=...) takes a bool, got {check!r}")
    check_dense(local, "from_local")
    check_local_device(local, mesh, "from_local")
    pls = normalize(placements, local.ndim, mesh.ndim)
    check_partial_dtype(pls, local.dtype, "from_local")
    coord = mesh.coord
    if global_shape is not None:
        if not isinstance(global_shape, (tuple, list, torch.Size)):
            check_global_shape(global_shape)   # (raises its ShapeError: an int, a float, ...)
        dynamic = symbolic.any_symbolic(global_shape)   # torch.compile with dynamic shapes
        global_shape = tuple(global_shape) if dynamic else check_global_shape(global_shape)
        _check_global_ndim(global_shape, local)
    if coord is None:
        if global_shape is None:
            raise SbpError(f"from_local: rank {mesh.rank} is outside the mesh and cannot infer the global shape; "
                           f"pass global_shape=")
    elif is_tracing(local):  # a compiled graph: shapes are known at trace time
        if check:
            raise CompileError(_NEEDS_SHAPE)
        if global_shape is None:   # even shards, as DTensor's from_local; one all_gather checks it at run time
            global_shape = _even_global_shape(local, mesh, pls)
            assert_rows_agree(_shape_row(local, pls), mesh.binding, tuple(range(mesh.ndim)), local.device,
                              _UNEVEN_IN_GRAPH)
        elif dynamic:
            _check_local_block(local, global_shape, mesh, pls)
        else:
            _check_local_shapes(global_shape, mesh, pls, None, local)
    else:
        shapes = None
        if check:
            shapes = _check_ranks(local, mesh, pls, global_shape)
        if shapes is None and (global_shape is None or is_enabled()):
            shapes = _gather_shapes(local, mesh, pls, global_shape)
        if global_shape is None:
            global_shape = _infer_global_shape(shapes, mesh, pls)
        _check_local_shapes(global_shape, mesh, pls, shapes, local)
    return from_local_autograd(local, mesh, pls, tuple(global_shape))


_NEEDS_SHAPE = ("from_local(check=True) inside torch.compile: checking that the ranks agree takes collectives "
                "on values; pass check=False (or call from_local outside the compiled function)")
_INFERS_SHAPE = ("sbp.from_local(check=True) is not traced into a compiled graph: checking that the ranks agree "
                 "takes collectives on values; it runs eagerly between two graphs. With fullgraph=True pass "
                 "check=False (or call from_local outside the compiled function)")
_UNEVEN_IN_GRAPH = ("sbp.from_local inside a compiled graph without global_shape= takes the shards as even (every "
                    "rank's local shape the same, as DTensor's from_local), and the ranks' local shapes (or dtypes, "
                    "or placements) differ: pass global_shape= for uneven shards, or call from_local outside the "
                    "compiled function (ShapeError)")


def _even_global_shape(local: torch.Tensor, mesh: DeviceMesh, pls) -> tuple:
    """The global shape of equal local blocks: each split dim's local length times the sizes of the mesh
    axes that split it (symbolic where the local length is)."""
    shape = list(local.shape)
    for axis, p in enumerate(pls):
        if isinstance(p, Split):
            shape[p.dim] = shape[p.dim] * mesh.shape[axis]
    return tuple(shape)


def _shape_row(local: torch.Tensor, pls) -> list:
    """What the ranks of a compiled `from_local` compare: the local shape and digests of dtype and placements."""
    return [local.ndim, *local.shape, digest(local.dtype), digest(pls)]


def _from_local_described(local: torch.Tensor, mesh: tuple, placements, global_shape, check: bool) -> GlobalTensor:
    return _from_local(local, mesh_of(mesh), placements, global_shape, check)


def _from_even_locals(local: torch.Tensor, mesh: tuple, placements) -> GlobalTensor:
    return _from_local(local, mesh_of(mesh), placements, None, False)


_compiled_from_local = torch._dynamo.nonstrict_trace(_from_local_described)
_compiled_from_even_locals = torch._dynamo.nonstrict_trace(_from_even_locals)
_eager_from_local = torch._dynamo.disable(_from_local, reason=_INFERS_SHAPE)

# ---- from_local helpers ------------------------------------------------------------------------------
SHAPE_SLOTS = 16  # local shapes travel padded to this many dims, so ranks that disagree on ndim still meet


def _gather_shapes(local: torch.Tensor, mesh: DeviceMesh, pls, global_shape) -> list[tuple[int, ...]]:
    """Every mesh member's local shape, in row-major coord order (one all_gather over the whole mesh).

    The same collective carries digests of the dtype and placements (and, under `sbp.debug()`, of the
    mesh and global_shape), so ranks that disagree get a `RankMismatchError` naming them at no extra cost.
    """
    gather, members = mesh_gather(mesh)
    fields = {"dtype": local.dtype, "placements": pls}
    if is_enabled():
        fields.update({"mesh": mesh, "global_shape": global_shape})
    shape = list(local.shape)
    payload = [len(shape)] + shape + [0] * (max(SHAPE_SLOTS, len(shape)) - len(shape))
    rows = agree(gather, members, "from_local", fields, payload, device=mesh.device_type)
    if len({r[0] for r in rows}) > 1:
        raise mismatch("from_local", "the local tensor's ndim", [r[0] for r in rows], members)
    return [tuple(r[1:1 + r[0]]) for r in rows]


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
    meta = _ints([local.ndim, _digest(str(local.dtype).encode()), _digest(repr(pls).encode()),
                  _digest(repr(global_shape).encode()), _digest(_bytes_of(local))], mesh)
    rows = [t.tolist() for t in mesh.binding.all_gather(meta, axes)]
    for col, what in ((0, "ndim"), (1, "dtype"), (2, "placements"), (3, "global_shape")):
        _agree(mesh, [r[col] for r in rows], what)
    shapes = _gather_shapes(local, mesh, pls, global_shape)
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


def _check_bound(mesh: DeviceMesh, what: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"{what} needs an sbp.DeviceMesh, got {type(mesh).__name__}")
    if mesh.binding is None:
        raise MeshError(f"{what} needs a mesh bound to processes (sbp.init_mesh or sbp.testing.spmd); "
                        f"{mesh!r} is a pure value")


def _to_mesh_device(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if t.device.type == mesh.device_type:
        return t
    try:
        return t.to(mesh.device_type)
    except (RuntimeError, NotImplementedError, AssertionError) as e:  # e.g. a meta tensor has no data
        raise MeshError(f"distribute: cannot move the tensor from {t.device} to the mesh's device "
                        f"{mesh.device_type!r} ({e}); pass a tensor with data on {mesh.device_type!r}") from None
