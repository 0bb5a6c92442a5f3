"""`torch.distributed.checkpoint` (DCP) interop: sbp state dicts saved as, and loaded from, DCP directories.

Both directions run on DCP's own `FileSystemWriter` / `FileSystemReader`, its metadata (``.metadata``)
and its default planners, which flatten nested state dicts to the same dotted keys as DTensor code
(``model.fc.weight``, ``optim.state.0.exp_avg``). sbp only tells the planners which block of each
global tensor a rank holds:

- saving, each distinct block of a global tensor becomes one DCP chunk (``WriteItemType.SHARD``) at its
  global offset, written by its first holder (row-major) -- sbp's balanced blocks, which DCP records
  as they are (chunks need not be `torch.chunk`'s); a `Partial` tensor is reduced first, so the
  checkpoint holds the logical value. Plain tensors and other values are DCP's ordinary entries.
- loading, each rank asks DCP for the chunk of its target block (`create_read_items_for_chunk_list`
  intersects it with the saved chunks) and DCP copies the overlaps straight into the local tensor.

So a DTensor job's ``dcp.save({"model": model.state_dict(), "optim": opt.state_dict()})`` loads into
an sbp-parallelized model on any mesh and placements, and a checkpoint sbp writes with
``format="dcp"`` loads into DTensors with ``dcp.load``. DCP is collective over the mesh's processes:
it needs torch.distributed (a mesh from `sbp.init_mesh`, or ``sbp.testing.spmd(..., backend="gloo")``)
or no mesh at all (a plain state dict, one process). Values DTensor code pickled are read with
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import io
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..runtime.backends.dist import PROCESS_GROUPS
from ..tensor.global_tensor import GlobalTensor
from ..values.errors import CheckpointError
from ..values.layout import Block, block, block_shape
from ..values.mesh import DeviceMesh
from .state import (
    check_tuple_slot,
    common_mesh,
    dtype_name,
    host_copy,
    json_value,
    leaves,
    like,
    reduced,
    target_block,
    writers,
)

METADATA = ".metadata"


def save_dcp(state_dict: dict, path: str, *, mesh: Optional[DeviceMesh] = None) -> None:
    """`sbp.save(state_dict, path, format="dcp")`: a DCP checkpoint of the logical tensors.

    >>> import sbp, torch
    >>> def fn(mesh):                                     # run with sbp.testing.spmd(fn, (4,), backend="gloo")
    ...     sbp.save({"w": sbp.distribute(torch.arange(10.), mesh, "S(0)")}, "ckpt", format="dcp")
    ...     state = {"w": torch.zeros(10)}                # DTensor code: dcp.load(state, checkpoint_id="ckpt")
    ...     torch.distributed.checkpoint.load(state, checkpoint_id="ckpt")
    ...     return state["w"].tolist() == list(range(10))
    >>> sbp.testing.spmd(fn, (4,), backend="gloo")     # doctest: +SKIP
    [True, True, True, True]
    """
    found = leaves(state_dict)
    mesh = common_mesh(found, mesh)
    if mesh is not None and mesh.coord is None:
        return
    chunks: dict[int, tuple[torch.Size, Block, Optional[torch.Tensor]]] = {}

    def local_of(leaf: GlobalTensor) -> torch.Tensor:
        x = reduced(leaf)
        shape = tuple(x.shape)
        mine = block(shape, x.mesh.shape, x.placements, x.mesh.coord)
        written = writers(x)
        writes = written.get(mine) == x.mesh.coord or (not written and x.mesh.index_of(x.mesh.coord) == 0)
        local = host_copy(x._local) if writes else x._local.detach()
        chunks[id(local)] = (torch.Size(shape), mine, local if writes else None)
        return local

    for key, (leaf, _, _) in found.items():
        if not isinstance(leaf, torch.Tensor):
            json_value(key, leaf)
    mirror = _mirror(state_dict, local_of)
    _run(dcp.save, mesh, mirror, storage_writer=dcp.FileSystemWriter(path), planner=_SavePlanner(chunks))


def load_dcp(path: str, state_dict: dict, *, strict: bool = True) -> dict:
    """`sbp.load` of a DCP directory: fills `state_dict` in place, resharding to its tensors' layouts.

    >>> import sbp, torch
    >>> def fn(mesh):                                     # run with sbp.testing.spmd(fn, (2, 2), backend="gloo")
    ...     torch.distributed.checkpoint.save({"w": torch.arange(10.)}, checkpoint_id="ckpt")
    ...     state = {"w": sbp.zeros((10,), mesh, "S(0), S(0)")}
    ...     sbp.load("ckpt", state)
    ...     return state["w"].to_local().tolist()
    >>> sbp.testing.spmd(fn, (2, 2), backend="gloo")   # doctest: +SKIP
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    """
    found = leaves(state_dict)
    mesh = common_mesh(found, None)
    if mesh is not None and mesh.coord is None:
        return state_dict
    for key, (leaf, container, _) in found.items():
        if not isinstance(leaf, torch.Tensor):
            check_tuple_slot(key, container)
    targets: dict[int, tuple[str, torch.Size, Optional[Block]]] = {}

    def local_of(leaf: GlobalTensor) -> torch.Tensor:
        local, want = target_block(leaf)
        local = leaf._local if local is None else local
        targets[id(local)] = (dtype_name(leaf.dtype), torch.Size(leaf.shape), want)
        return local

    mirror = _mirror(state_dict, local_of, lists=True)
    _run(dcp.load, mesh, mirror, storage_reader=dcp.FileSystemReader(path), planner=_LoadPlanner(targets, strict))
    back = leaves(mirror)
    for key, (leaf, container, index) in found.items():
        if not isinstance(leaf, torch.Tensor) and key in back:
            container[index] = like(back[key][0], leaf)
    return state_dict


# ---- plumbing --------------------------------------------------------------------------------------------

def _mirror(obj: Any, local_of, lists: bool = False) -> Any:
    """The state dict as DCP sees it: the same nesting, each global tensor replaced by its local tensor;
    with `lists`, tuples become lists (for loading: DCP sets the values it reads into their containers)."""
    if isinstance(obj, GlobalTensor):
        return local_of(obj)
    if isinstance(obj, dict):
        return {k: _mirror(v, local_of, lists) for k, v in obj.items()}
    if isinstance(obj, list) or (lists and isinstance(obj, tuple)):
        return [_mirror(v, local_of, lists) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_mirror(v, local_of, lists) for v in obj)
    return obj


def _run(call, mesh: Optional[DeviceMesh], state: dict, **kw) -> None:
    """`dcp.save` / `dcp.load` over the mesh's processes; their failures as `CheckpointError`."""
    if mesh is None:
        options: dict = {"no_dist": not dist.is_initialized()}
    else:
        if getattr(mesh.binding, "backend", None) != "dist":
            raise CheckpointError(f"DCP checkpoints need a mesh bound to torch.distributed (sbp.init_mesh, or "
                                  f"sbp.testing.spmd(..., backend='gloo')); {mesh!r} is bound to the "
                                  f"{getattr(mesh.binding, 'backend', None)!r} backend")
        if mesh.size() == dist.get_world_size():
            options = {"process_group": None}
        else:
            group = PROCESS_GROUPS.find(mesh.ranks, dist.get_backend())
            if group is None:  # pragma: no cover - init_mesh makes the group over a mesh's ranks
                raise CheckpointError(f"no process group over the ranks {list(mesh.ranks)} of {mesh!r}")
            options = {"process_group": group}
    try:
        with warnings.catch_warnings():   # no_dist in one process is the intent, not a surprise
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            call(state, **kw, **options)
    except dcp.api.CheckpointException as e:
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise CheckpointError(f"torch.distributed.checkpoint failed: {e}") from e
    except (RuntimeError, ValueError, OSError) as e:
        raise CheckpointError(f"torch.distributed.checkpoint failed: {e}") from e


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner, with each sbp block written as one chunk by its writer (nothing by the rest)."""

    def __init__(self, chunks: dict[int, tuple[torch.Size, Block, Optional[torch.Tensor]]]) -> None:
        super().__init__()
        self._by_id = chunks

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.chunks = {fqn: self._by_id[id(obj)] for fqn, obj in self.state_dict.items() if id(obj) in self._by_id}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self.chunks]
        for fqn, (size, b, local) in self.chunks.items():
            if local is None:
                continue
            offsets = torch.Size(lo for lo, _ in b)
            items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(
                                       chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(block_shape(b))),
                                       properties=TensorProperties.create_from_tensor(local), size=size)))
        self.plan = SavePlan(items, planner_data=plan.planner_data)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.chunks:
            return self.chunks[index.fqn][2]
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading for each sbp target only the chunk of its block."""

    def __init__(self, targets: dict[int, tuple[str, torch.Size, Optional[Block]]], strict: bool) -> None:
        super().__init__(allow_partial_load=not strict)
        self._by_id, self._strict = targets, strict

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.targets = {fqn: self._by_id[id(obj)] for fqn, obj in self.state_dict.items() if id(obj) in self._by_id}

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        missing = sorted(set(self.state_dict) - set(saved))
        extra = sorted(k for k in set(saved) - set(self.state_dict))
        if self._strict and (missing or extra):
            parts = ([f"missing from the checkpoint: {missing}"] if missing else []) + \
                    ([f"in the checkpoint but not in the state_dict: {extra}"] if extra else [])
            raise CheckpointError("the DCP checkpoint and the state_dict have different keys: " + "; ".join(parts))
        plain = {k: v for k, v in self.state_dict.items() if k not in self.targets and k in saved}
        requests = list(create_default_local_load_plan(plain, self.metadata, False).items)
        for fqn, (dtype, size, b) in self.targets.items():
            md = saved.get(fqn)
            if md is None:
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"entry {fqn!r} is a value in the DCP checkpoint but a tensor in the state_dict")
            if md.size != size:
                raise CheckpointError(f"tensor {fqn!r}: global shape {tuple(md.size)} in the checkpoint, "
                                      f"{tuple(size)} in the state_dict")
            if dtype_name(md.properties.dtype) != dtype:
                raise CheckpointError(f"tensor {fqn!r}: dtype {dtype_name(md.properties.dtype)} in the checkpoint, "
                                      f"{dtype} in the state_dict")
            if b is not None:
                chunk = ChunkStorageMetadata(offsets=torch.Size(lo for lo, _ in b), sizes=torch.Size(block_shape(b)))
                requests += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.targets:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)   # plain values only: never code from a pickle
        again = io.BytesIO()
        torch.save(obj, again)
        again.seek(0)
        super().load_bytes(read_item, again)
