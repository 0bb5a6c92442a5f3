"""Conversion to and from PyTorch DTensor (`to_dtensor`, `from_dtensor`), and the full state dict torch's
tools expect (`full_state_dict`).

Placements map one to one: ``S(d) <-> Shard(d)``, ``B <-> Replicate()``, ``P(op) <-> Partial(op)`` for op
in sum/min/max. The meshes cover the same world ranks in the same row-major order. The two libraries cut
uneven dims differently: DTensor like `torch.chunk` (ceil division: 10 over 4 -> 3,3,3,1), sbp balanced
(3,3,2,2). When the blocks of the two layouts coincide on every coord the local tensor passes through
unchanged (no communication). Otherwise the conversion is still exact: the split axes of the dims
whose blocks differ become Broadcast on the sending side (a planned gather), and the receiving side
splits those dims again locally in its own way. Both directions are differentiable.

Both calls are collective over the whole world the first time a mesh is converted (DTensor's
`DeviceMesh`, or sbp's `init_mesh`, creates process groups); the converted mesh is remembered for the
bound mesh's communicator, so later conversions create nothing. They need torch.distributed (a mesh from
`sbp.init_mesh`, or `sbp.testing.spmd(..., backend="gloo")`), not the threads backend.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..runtime.agreement import agree, mesh_gather
from ..runtime.backends.base import comm_device
from ..runtime.backends.dist import init_mesh
from ..tensor.construct import from_local
from ..tensor.global_tensor import GlobalTensor, contiguous_strides, grad_placements
from ..values.errors import CheckpointError, MeshError, PlacementError, SbpError
from ..values.layout import block
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, Split

# Two weak identity maps, so that nothing is written into torch's objects or sbp's bindings:
# binding -> {(shape, names, ranks, device type): torch DeviceMesh}, the torch meshes made for a bound mesh;
# torch DeviceMesh -> the bound sbp mesh over its ranks (lets from_dtensor find it again). Entries last as
# long as the binding (whose process groups the torch meshes use): one per mesh converted.
TORCH_MESHES = WeakIdKeyDictionary()
SBP_MESH_OF = WeakIdKeyDictionary()


def to_dtensor(x: GlobalTensor) -> Any:
    """The same logical tensor as a `torch.distributed.tensor.DTensor` on the same ranks.

    >>> import sbp, torch
    >>> def fn(mesh):                                   # run with sbp.testing.spmd(fn, (4,), backend="gloo")
    ...     x = sbp.distribute(torch.arange(10.), mesh, "S(0)")          # sbp: 3,3,2,2 rows
    ...     dt = sbp.to_dtensor(x)                                       # DTensor: 3,3,3,1 rows
    ...     return dt.to_local().numel(), torch.equal(dt.full_tensor(), torch.arange(10.))
    >>> sbp.testing.spmd(fn, (4,), backend="gloo")    # doctest: +SKIP
    [(3, True), (3, True), (3, True), (1, True)]
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(x, GlobalTensor):
        raise SbpError(f"to_dtensor needs an sbp.GlobalTensor, got {type(x).__name__}")
    ops = sorted({p.op for p in x.placements if isinstance(p, Partial)})
    if len(ops) > 1:   # DTensor itself raises a raw ValueError ("Mixed Partial reduce types are not supported")
        keep = next(p for p in x.placements if isinstance(p, Partial))
        fixed = ", ".join(repr(p if not isinstance(p, Partial) or p is keep else Broadcast()) for p in x.placements)
        raise PlacementError(f"to_dtensor: {x.placements} mixes Partial ops ({', '.join(ops)}); a DTensor "
                             f"holds one Partial op per tensor: reduce the others first, e.g. "
                             f"sbp.to_dtensor(x.redistribute(\"{fixed}\"))")
    torch_mesh = _torch_mesh(x.mesh)
    shape = tuple(x.shape)
    mid = _meeting_point(shape, x.mesh.shape, x.placements)
    y = x.redistribute(mid) if mid != x.placements else x
    # DTensor.from_local's backward hands back a Partial axis's gradient as Replicate (the whole gradient
    # on every rank), so the local's gradient is laid out with P -> B, not as P(sum) parts
    local = y.to_local(grad_placements=grad_placements(mid))
    dt = DTensor.from_local(local, torch_mesh, [_to_torch(p) for p in mid], run_check=False,
                            shape=torch.Size(shape), stride=contiguous_strides(shape))
    if mid != x.placements:
        dt = dt.redistribute(torch_mesh, [_to_torch(p) for p in x.placements])
    return dt


def from_dtensor(dt: Any, mesh: Optional[DeviceMesh] = None) -> GlobalTensor:
    """The same logical tensor as an sbp `GlobalTensor`; `mesh` (a bound sbp mesh over the same ranks) is
    found or made with `sbp.init_mesh` when not given.

    >>> import sbp
    >>> def fn(mesh):                                   # run with sbp.testing.spmd(fn, (2, 2), backend="gloo")
    ...     x = sbp.randn((5, 3), mesh, "S(0), P", seed=0)
    ...     return torch.equal(sbp.from_dtensor(sbp.to_dtensor(x)).full(), x.full())
    >>> sbp.testing.spmd(fn, (2, 2), backend="gloo")  # doctest: +SKIP
    [True, True, True, True]
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(dt, DTensor):
        raise SbpError(f"from_dtensor needs a torch.distributed.tensor.DTensor, got {type(dt).__name__}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise MeshError(f"from_dtensor(mesh=...) needs a bound sbp.DeviceMesh over the DTensor's ranks (or None "
                        f"to make one), got {type(mesh).__name__}")
    torch_mesh = dt.device_mesh
    pls = tuple(_from_torch(p, axis) for axis, p in enumerate(dt.placements))
    pls = tuple(Split(p.dim % dt.ndim) if isinstance(p, Split) else p for p in pls)
    mesh = _bound_mesh_of(torch_mesh) if mesh is None else _check_same_ranks(mesh, torch_mesh)
    shape = tuple(dt.shape)
    mid = _meeting_point(shape, mesh.shape, pls)
    if mid != pls:
        dt = dt.redistribute(torch_mesh, [_to_torch(p) for p in mid])
    x = from_local(dt.to_local(), mesh, mid, global_shape=shape)
    return x.redistribute(pls) if mid != pls else x


# ---- layouts -------------------------------------------------------------------------------------------
def dtensor_block(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], pls: tuple[Placement, ...],
                  coord: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The block DTensor gives `coord`: `torch.chunk` sizes (ceil division), nested in mesh-axis order.

    >>> [dtensor_block((10,), (4,), (Split(0),), (c,)) for c in range(4)]
    [((0, 3),), ((3, 6),), ((6, 9),), ((9, 10),)]
    """
    ranges = [(0, n) for n in global_shape]
    for axis, p in enumerate(pls):
        if isinstance(p, Split):
            lo, hi = ranges[p.dim]
            size, n = hi - lo, mesh_shape[axis]
            step = -(-size // n)
            start = min(lo + step * coord[axis], hi)
            ranges[p.dim] = (start, min(start + step, hi))
    return tuple(ranges)


def _meeting_point(shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                   pls: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """`pls` with every split axis of a dim whose sbp and DTensor blocks differ made Broadcast."""
    import itertools

    bad: set[int] = set()
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        ours, theirs = block(shape, mesh_shape, pls, coord), dtensor_block(shape, mesh_shape, pls, coord)
        for d, (a, b) in enumerate(zip(ours, theirs)):
            if a != b and not (a[0] == a[1] and b[0] == b[1]):  # two empty ranges hold the same (nothing)
                bad.add(d)
    return tuple(Broadcast() if isinstance(p, Split) and p.dim in bad else p for p in pls)


# ---- placements ----------------------------------------------------------------------------------------
def _to_torch(p: Placement) -> Any:
    from torch.distributed.tensor import Partial as TPartial, Replicate, Shard

    match p:
        case Split(dim=d):
            return Shard(d)
        case Broadcast():
            return Replicate()
        case Partial(op=op):
            return TPartial(op)
    raise SbpError(f"{p!r} is not an sbp placement")  # pragma: no cover


def _from_torch(p: Any, axis: int) -> Placement:
    from torch.distributed.tensor import Partial as TPartial, Replicate, Shard

    if type(p) is Shard:
        return Split(p.dim)
    if isinstance(p, Replicate):
        return Broadcast()
    if isinstance(p, TPartial) and p.reduce_op in ("sum", "min", "max"):
        return Partial(p.reduce_op)
    raise SbpError(f"DTensor placement {p!r} on mesh axis {axis} has no sbp equivalent "
                   f"(valid: Shard(d), Replicate(), Partial('sum'|'min'|'max'))")


# ---- meshes ----------------------------------------------------------------------------------------------
def _cache(mesh: DeviceMesh) -> dict:
    binding = mesh.binding
    if binding is None or getattr(binding, "backend", None) != "dist":
        raise MeshError(f"DTensor interop needs a mesh bound to torch.distributed (sbp.init_mesh, or "
                        f"sbp.testing.spmd(..., backend='gloo')); {mesh!r} is "
                        + ("a pure value" if binding is None else f"bound to the {binding.backend!r} backend"))
    found = TORCH_MESHES.get(binding)
    if found is None:
        found = TORCH_MESHES[binding] = {}
    return found


def _torch_mesh(mesh: DeviceMesh) -> Any:
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    cache = _cache(mesh)
    key = (mesh.shape, mesh.names, mesh.ranks, mesh.device_type)
    if key not in cache:
        ranks = torch.tensor(mesh.ranks, dtype=torch.int64).view(mesh.shape)
        torch_mesh = TorchMesh(mesh.device_type, ranks, mesh_dim_names=mesh.names)
        SBP_MESH_OF[torch_mesh] = mesh
        cache[key] = torch_mesh
    return cache[key]


def _bound_mesh_of(torch_mesh: Any) -> DeviceMesh:
    found = SBP_MESH_OF.get(torch_mesh)
    if found is not None:
        return found
    mesh = init_mesh(tuple(torch_mesh.shape), torch_mesh.mesh_dim_names,
                     ranks=torch_mesh.mesh.flatten().tolist(), device_type=torch_mesh.device_type)
    SBP_MESH_OF[torch_mesh] = mesh
    _cache(mesh)[(mesh.shape, mesh.names, mesh.ranks, mesh.device_type)] = torch_mesh
    return mesh


def _check_same_ranks(mesh: DeviceMesh, torch_mesh: Any) -> DeviceMesh:
    ranks = tuple(torch_mesh.mesh.flatten().tolist())
    if mesh.shape != tuple(torch_mesh.shape) or mesh.ranks != ranks:
        raise MeshError(f"from_dtensor: mesh {mesh!r} (ranks {list(mesh.ranks)}) does not match the DTensor's "
                        f"mesh of shape {tuple(torch_mesh.shape)} over ranks {list(ranks)}")
    _cache(mesh)
    return mesh


def full_state_dict(state_dict: Any, *, cpu_offload: bool = False) -> Any:
    """`state_dict` with each global tensor replaced by its logical value as a plain tensor (detached; on the
    CPU with `cpu_offload`), nested dicts, lists and tuples walked, every other value kept as it is -- what
    torch's ``get_model_state_dict(..., StateDictOptions(full_state_dict=True))`` gives for a DTensor model
    (torch's helpers gather DTensors only and hand sbp's global tensors back as they are). For a model's
    or an optimizer's state dict, ``sbp.full_state_dict(get_optimizer_state_dict(model, opt))`` included.

    Collective: every rank of the tensors' meshes calls it with the same keys (each global tensor is one
    gather, made in the order of the keys' paths, so ranks that built their dicts in different orders still
    agree); every rank gets the whole state. The ranks first agree on the keys and layouts (one small
    all_gather on the first tensor's mesh): a key or layout that differs is a `RankMismatchError` naming it.

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     sd = {"w": sbp.distribute(torch.arange(4.), mesh, "S(0)"), "step": 3}
    ...     return full_state_dict(sd)
    >>> sbp.testing.spmd(fn, (2,))[0]
    {'w': tensor([0., 1., 2., 3.]), 'step': 3}
    """
    found: dict[str, GlobalTensor] = {}
    _global_leaves(state_dict, "", found)
    paths = sorted(found)
    if paths:   # (a gather that a rank skipped or made of another tensor would wait forever or mix values)
        mesh = found[paths[0]].mesh
        gather, members = mesh_gather(mesh)
        agree(gather, members, "full_state_dict: the ranks' state dicts differ (every rank passes the same keys "
              "and layouts; SPMD)", {"keys": paths, "layouts": [(tuple(found[p].shape), found[p].placements,
                                                                  found[p].dtype) for p in paths]},
              device=comm_device(mesh))
    fulls = {}
    for path in paths:
        x = found[path]
        if id(x) not in fulls:   # (one tensor at two paths, a tied weight: gathered once)
            full = x.detach().full()
            fulls[id(x)] = full.cpu() if cpu_offload else full
    return _replaced(state_dict, fulls, cpu_offload)


def _global_leaves(obj: Any, path: str, found: dict) -> None:
    """The global tensors in `obj` by path (``model.0.weight``, ``optim.state[0].exp_avg``)."""
    if isinstance(obj, GlobalTensor):
        if path in found and found[path] is not obj:   # ``{"a.b": x, "a": {"b": y}}``: which one is meant
            raise CheckpointError(f"full_state_dict: two entries of the state_dict have the path {path!r}; rename "
                                  f"one")
        found[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _global_leaves(v, (f"{path}.{k}" if path else k) if isinstance(k, str) else f"{path}[{k!r}]", found)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _global_leaves(v, f"{path}[{i}]", found)


def _replaced(obj: Any, fulls: dict, cpu_offload: bool) -> Any:
    if isinstance(obj, GlobalTensor):
        return fulls[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)   # the same kind of dict (an OrderedDict keeps its `_metadata`)
        for k, v in obj.items():
            out[k] = _replaced(v, fulls, cpu_offload)
        return out
    if isinstance(obj, list):
        return [_replaced(v, fulls, cpu_offload) for v in obj]
    if isinstance(obj, tuple):
        values = [_replaced(v, fulls, cpu_offload) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if cpu_offload and isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    return obj
