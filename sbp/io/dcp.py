"""`torch.distributed.checkpoint` (DCP) interop: sbp state dicts saved as, and loaded from, DCP directories.

Both directions run on DCP's own `FileSystemWriter` / `FileSystemReader`, its metadata (``.metadata``)
and its default planners, which flatten nested state dicts to the same dotted keys as DTensor code
(``model.fc.weight``, ``optim.state.0.exp_avg``). sbp only tells the planners which block of each
global tensor a rank holds:

- saving, each distinct block of a global tensor becomes one DCP chunk (``WriteItemType.SHARD``) at its
  global offset, written by its first holder (row-major) -- sbp's balanced blocks, which DCP records
  as they are (chunks need not be `torch.chunk`'s); a `Partial` tensor is reduced first, so the
  checkpoint holds the logical value. Plain tensors and other values are DCP's ordinary entries; the
  JSON values are also written whole (`RECORD`), and `sbp.load` reads them from there, so that they
  replace the state dict's as in the other formats (DCP splits a dict value into one entry per item).
- loading, each rank asks DCP for the chunk of its target block (`create_read_items_for_chunk_list`
  intersects it with the saved chunks) and DCP copies the overlaps straight into the local tensor.

Saving is crash-safe as in the sbp format: DCP's files go into a new ``gen-*`` directory, and the
coordinator commits ``.metadata`` (entries naming ``gen-N/__0_0.distcp``) by one atomic rename
(`_GenerationWriter`). Loading checks keys, shapes, dtypes and the files' lengths in DCP's planning
step, whose failures DCP gathers: every rank raises before any rank reads (`_CheckedReader`).

So a DTensor job's ``dcp.save({"model": model.state_dict(), "optim": opt.state_dict()})`` loads into
an sbp-parallelized model on any mesh and placements, and a checkpoint sbp writes with
``format="dcp"`` loads into DTensors with ``dcp.load``. DCP is collective over the mesh's processes:
it needs torch.distributed (a mesh from `sbp.init_mesh`, or ``sbp.testing.spmd(..., backend="gloo")``)
or no mesh at all (a plain state dict, one process). Values DTensor code pickled are read with
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
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
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..runtime import agreement
from ..runtime.backends.dist import PROCESS_GROUPS
from ..tensor.global_tensor import GlobalTensor
from ..values.errors import CheckpointError
from ..values.layout import Block, block, block_shape
from ..values.mesh import DeviceMesh
from .state import (
    agree_save,
    check_target,
    check_tuple_slot,
    common_mesh,
    dtype_name,
    fsync_dir,
    has_tensor,
    host_copy,
    json_values,
    last_generation,
    leaves,
    like,
    raise_together,
    reduced,
    retire_others,
    save_lock,
    target_block,
    unsaved_tensors,
    writers,
)

METADATA = ".metadata"
# one more DCP entry of sbp's saves: the state dict's JSON values, whole, as JSON text. DCP itself splits a dict
# value into one entry per item (``meta.epoch``) and pickles a namedtuple with its class; sbp.load reads the values
# from here instead, so they replace the state dict's as in the other formats (DTensor code reads DCP's own)
RECORD = "__sbp_values__"


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
    first = mesh is None or mesh.index_of(mesh.coord) == 0
    values, refused = json_values(found)   # every refusal before the first collective, which carries it
    refused = refused or unsaved_tensors(found, dtensor=True)
    if RECORD in state_dict:
        refused = CheckpointError(f"entry {RECORD!r}: format='dcp' reserves this name for sbp's record of the JSON "
                                  f"values; rename the entry")
    with save_lock(path, first and refused is None) as locked:   # coord 0: one save at a time in `path`
        refused = refused or locked
        # the data go into a new directory beside the committed one (one all_reduce agrees on it, checks that
        # the ranks save the same keys, layouts and values, and carries refusals); the coordinator's
        # `.metadata` rename is the switch
        last, failed = agree_save(mesh, found, path, last_generation(path), refused is not None)
        if failed:
            raise_together(mesh, path, refused)
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

        mirror = _mirror(state_dict, local_of)
        if values:
            mirror[RECORD] = json.dumps(values)
        _run(dcp.save, mesh, mirror, storage_writer=_GenerationWriter(path, f"gen-{last + 1:08d}"),
             planner=_SavePlanner(chunks, first))


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
    targets: dict[int, tuple[str, torch.Size, Optional[Block]]] = {}
    unheld: list[GlobalTensor] = []   # P(sum) targets away from coord 0: zeroed once the load succeeded

    def local_of(leaf: GlobalTensor) -> torch.Tensor:
        local, want = target_block(leaf, zero=False)
        if local is None:
            local = leaf._local
            unheld.append(leaf)
        targets[id(local)] = (dtype_name(leaf.dtype), torch.Size(leaf.shape), want)
        return local

    mirror = _mirror(state_dict, local_of)
    reader = _CheckedReader(path)
    values = {key: entry for key, entry in found.items() if not isinstance(entry[0], torch.Tensor)}
    # targets a load cannot fill in place (meta, expanded, inference tensors), found now: DCP's planner would
    # swap a meta tensor of its mirror for a new one and load into that, nothing into the state dict
    unwritable: dict[str, CheckpointError] = {}
    for key, (leaf, _, _) in found.items():
        if isinstance(leaf, torch.Tensor):
            try:
                check_target(key, leaf, dtensor=True)
            except CheckpointError as e:
                unwritable[key] = e
    planner = _LoadPlanner(targets, values, strict, reader, unwritable)
    _run(dcp.load, mesh, mirror, storage_reader=reader, planner=planner)
    for leaf in unheld:
        target_block(leaf)
    if planner.loaded is not None:    # sbp's record of the values: they replace the state dict's
        for key, value in planner.loaded.items():
            _, container, index = values[key]
            container[index] = value
        return state_dict
    back = leaves(mirror)             # DCP's own entries (DTensor code's checkpoints), filled in place
    for key, (leaf, container, index) in values.items():
        if key in back:
            container[index] = like(key, back[key][0], leaf)
    return state_dict


# ---- plumbing --------------------------------------------------------------------------------------------

def _mirror(obj: Any, local_of) -> Any:
    """The state dict as DCP sees it: the same nesting, each global tensor replaced by its local tensor and
    each tuple holding a tensor by a list -- DCP walks lists holding tensors (``t.0``, the keys `leaves`
    gives) but pickles any tuple whole, tensors and all, and on loading it sets what it reads into their
    containers. A tuple of values stays one value (an optimizer's ``betas``, as DTensor code saves it)."""
    if isinstance(obj, GlobalTensor):
        return local_of(obj)
    if isinstance(obj, dict):
        return {k: _mirror(v, local_of) for k, v in obj.items()}
    if isinstance(obj, list) or (isinstance(obj, tuple) and has_tensor(obj)):
        return [_mirror(v, local_of) for v in obj]
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
    except dcp.api.CheckpointException as e:   # DCP gathers every rank's failure: each rank raises
        group = options.get("process_group")
        me = dist.get_rank(group) if dist.is_initialized() else 0   # ranks of DCP's group
        mine = e.failures.get(me)
        if mine is not None and isinstance(mine[0], CheckpointError):
            raise mine[0] from None
        ours = [(r, exc) for r, (exc, _) in sorted(e.failures.items()) if isinstance(exc, CheckpointError)]
        if ours:
            rank = ours[0][0] if group is None else dist.get_global_rank(group, ours[0][0])
            raise CheckpointError(f"{'save' if call is dcp.save else 'load'} failed on rank {rank}: "
                                  f"{ours[0][1]}") from None
        if e.failures:   # another failure (an OSError writing, a disk full): one line naming the rank, not
            first, (exc, _) = sorted(e.failures.items())[0]   # DCP's page of every rank's traceback
            rank = first if group is None else dist.get_global_rank(group, first)
            intact = "; nothing was committed: the previous checkpoint is intact" if call is dcp.save else ""
            raise CheckpointError(f"{'save' if call is dcp.save else 'load'} failed on rank {rank}: "
                                  f"{type(exc).__name__}: {exc}{intact}") from e
        raise CheckpointError(f"torch.distributed.checkpoint failed: {e}") from e
    except (RuntimeError, ValueError, OSError) as e:
        raise CheckpointError(f"torch.distributed.checkpoint failed: {e}") from e


class _GenerationWriter(dcp.FileSystemWriter):
    """DCP's own writer, writing into the data directory `root/data`; its ``finish`` (the coordinator, once
    every rank's files are written) then commits ``root/.metadata`` -- DCP's metadata with each entry's file
    named ``data/__0_0.distcp`` -- through a temporary file and one atomic rename, and only then removes the
    other formats' commit files and the data of earlier saves. A save that fails or dies before the rename
    leaves the previous ``.metadata`` and the files it names untouched; `dcp.load(checkpoint_id=root)` and
    `sbp.load(root)` read the committed one (DCP's reader opens each entry's file relative to the root)."""

    def __init__(self, root: str, data: str) -> None:
        super().__init__(os.path.join(root, data), overwrite=True)
        self.root, self.data = root, data

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)           # DCP's metadata, written inside the data directory
        inner = os.path.join(self.root, self.data, METADATA)
        storage = {index: dataclasses.replace(info, relative_path=f"{self.data}/{info.relative_path}")
                   for index, info in metadata.storage_data.items()}
        top = dataclasses.replace(metadata, storage_data=storage)
        if top.storage_meta is not None:
            top.storage_meta = dataclasses.replace(top.storage_meta, checkpoint_id=self.root)
        fsync_dir(os.path.join(self.root, self.data))
        tmp = os.path.join(self.root, f"{METADATA}.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(top, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, METADATA))   # the switch
        fsync_dir(self.root)
        try:
            os.remove(inner)                        # one .metadata per checkpoint: the committed one
        except OSError:
            pass                                    # committed already: a leftover is harmless
        retire_others(self.root, "dcp", self.data)


class _CheckedReader(dcp.FileSystemReader):
    """DCP's own reader, which first checks that every file this rank will read is there and long enough for
    the byte ranges ``.metadata`` gives. DCP runs this in its planning step, before any rank reads, and
    gathers every rank's failure: a missing or truncated file fails the load on every rank with nothing
    written. (DCP files carry no checksum: changed bytes inside a file are not detected.)"""

    digest = 0   # of the ``.metadata`` bytes this rank read (`read_metadata`)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """DCP's ``.metadata``, read once as bytes so the ranks can compare what they read (`prepare_global_plan`).
        (Unpickled as DCP itself does: a DCP directory is trusted code, as for ``dcp.load``.)"""
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
            raw = file.read()
        self.digest = agreement.digest(hashlib.sha256(raw).hexdigest())
        metadata = pickle.loads(raw)   # noqa: S301 -- DCP's own format (see above)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator, before any rank reads data: the ranks read one ``.metadata``. Another save
        committing between two ranks' reads made them load different saves, each rank part of one, without an
        error; now DCP raises this on every rank, nothing written."""
        if len({plan.storage_data for plan in plans}) > 1:
            raise CheckpointError(f"load of {self.path!r}: the ranks read different saves (another save committed "
                                  f"during the load; no rank's state_dict was changed); load again once the save "
                                  f"is done")
        return super().prepare_global_plan([dataclasses.replace(plan, storage_data=None) for plan in plans])

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = dataclasses.replace(plan, storage_data=self.digest)   # carried to `prepare_global_plan`
        ends: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            file = os.path.join(self.path, name)
            if not os.path.isfile(file):
                raise CheckpointError(f"DCP checkpoint file {file!r} is missing (.metadata names it)")
            size = os.path.getsize(file)
            if size < end:
                raise CheckpointError(f"DCP checkpoint file {file!r} has {size} bytes, .metadata places data up to "
                                      f"byte {end}: it is truncated or altered")
        return super().prepare_local_plan(plan)

    def read_data(self, plan: LoadPlan, planner) -> Any:
        """DCP's reads, with a failure inside a data file (bytes changed: DCP files carry no checksum, so a
        damaged file shows only where torch cannot read an entry back) raised as a `CheckpointError` naming the
        file, not as DCP's page of traceback; DCP then raises it on every rank."""
        opened: list[str] = []
        create = self.fs.create_stream

        def create_stream(path, mode):   # which file DCP is reading when it fails
            opened.append(os.fspath(path))
            return create(path, mode)

        self.fs.create_stream = create_stream
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever torch raised reading it back: the file is damaged
            where = f"DCP checkpoint file {opened[-1]!r}" if opened else f"the DCP checkpoint {self.path!r}"
            raise CheckpointError(f"cannot read {where}: {_unloadable(e)}; it is corrupt or altered (targets read "
                                  f"before it were filled, the others not: load from an intact checkpoint)") from e
        finally:
            del self.fs.create_stream

    def read_value(self, fqn: str) -> Any:
        """The value DCP saved as `fqn`, read with ``torch.load(weights_only=True)``: plain values only."""
        info = self.storage_data.get(MetadataIndex(fqn))
        if info is None or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"DCP entry {fqn!r} is stored in a form sbp does not decode")
        file = os.path.join(self.path, info.relative_path)
        try:
            with open(file, "rb") as f:
                f.seek(info.offset)
                return torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to read is the same user-facing problem
            raise CheckpointError(f"cannot read entry {fqn!r} from DCP checkpoint file {file!r}: "
                                  f"{_unloadable(e)}") from e

    def saved_value(self, fqn: str) -> str:
        """The repr of the value DCP saved as `fqn` (for a message), or what kept it from being read."""
        try:
            return repr(self.read_value(fqn))
        except CheckpointError as e:  # only the message's detail: the refusal stands either way
            return "stored in a form sbp does not decode" if "does not decode" in str(e) else \
                f"unreadable: {type(e.__cause__).__name__}"


def _unloadable(e: BaseException) -> str:
    """The line of a `torch.load(weights_only=True)` failure that says why (its message runs to a page, whose
    first line advises ``weights_only=False``: no help for damaged bytes).

    >>> _unloadable(RuntimeError("Weights only load failed. Re-run with weights_only=False\\n"
    ...                          "Please file an issue: WeightsUnpickler error: Unsupported operand 82"))
    'RuntimeError: WeightsUnpickler error: Unsupported operand 82'
    """
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    why = next((line for line in lines if "Unsupported global" in line), None)
    if why is None:
        unpickler = next((line for line in lines if "WeightsUnpickler error:" in line), None)
        why = unpickler[unpickler.index("WeightsUnpickler error:"):] if unpickler else lines[0] if lines else ""
    return f"{type(e).__name__}: {why}"


def _under(fqn: str, keys: "set[str] | dict[str, Any]") -> bool:
    """Whether DCP's entry `fqn` belongs to one of the sbp `keys`: is one, or is an item DCP split off one
    (``meta.epoch`` of a dict value ``meta``; ``optim.param_groups.0.lr``).

    >>> _under("meta.epoch", {"meta"}), _under("metal", {"meta"})
    (True, False)
    """
    at = fqn.find(".")
    while at != -1:
        if fqn[:at] in keys:
            return True
        at = fqn.find(".", at + 1)
    return fqn in keys


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner, with each sbp block written as one chunk by its writer (nothing by the rest), and
    each plain tensor by the mesh's coord 0 (`first`) alone, as the other formats write it: DCP's
    de-duplication picked a writer per entry to balance the load, so ranks holding different plain data (an
    RNG state) left a checkpoint of one rank's copy here and another's there."""

    def __init__(self, chunks: dict[int, tuple[torch.Size, Block, Optional[torch.Tensor]]], first: bool = True) -> None:
        super().__init__()
        self._by_id = chunks
        self._first = first

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.chunks = {fqn: self._by_id[id(obj)] for fqn, obj in self.state_dict.items() if id(obj) in self._by_id}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self.chunks
                 and (self._first or item.type != WriteItemType.TENSOR)]
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
    """DCP's default planner, reading for each sbp target only the chunk of its block, after the checks the
    sbp format makes (kinds, global shapes, dtypes: DCP itself would convert a plain tensor's dtype). When
    the checkpoint holds sbp's `RECORD` of the JSON values, the values come from it, whole (`loaded`), and
    DCP's own entries of them are neither compared nor read; keys are compared as `leaves` gives them."""

    def __init__(self, targets: dict[int, tuple[str, torch.Size, Optional[Block]]],
                 values: dict[str, tuple[Any, Any, Any]], strict: bool, reader: "_CheckedReader",
                 unwritable: Optional[dict[str, CheckpointError]] = None) -> None:
        super().__init__(allow_partial_load=not strict)
        self._by_id, self._values, self._strict, self._reader = targets, values, strict, reader
        self._unwritable = unwritable or {}   # {key: the refusal of a target the load cannot fill (`check_target`)}
        self.loaded: Optional[dict[str, Any]] = None   # the values from the RECORD, in the state dict's types

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.targets = {fqn: self._by_id[id(obj)] for fqn, obj in self.state_dict.items() if id(obj) in self._by_id}

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        for key, (_, container, _) in self._values.items():   # every check before any rank reads
            check_tuple_slot(key, container)
            if isinstance(saved.get(key), TensorStorageMetadata):
                raise CheckpointError(f"entry {key!r} is a tensor in the checkpoint but a "
                                      f"{type(self._values[key][0]).__name__} in the state_dict")
        stored = self._take_values(saved) if RECORD in saved else {}
        wanted = set(self.state_dict) | (set(self._values) if self.loaded is not None else set())
        have = set(saved) if self.loaded is None else \
            {fqn for fqn in saved if fqn != RECORD and not _under(fqn, stored)} | set(stored)
        missing, extra = sorted(wanted - have), sorted(have - wanted)
        if self._strict and (missing or extra):
            parts = ([f"missing from the checkpoint: {missing}"] if missing else []) + \
                    ([f"in the checkpoint but not in the state_dict: {extra}"] if extra else [])
            raise CheckpointError("the DCP checkpoint and the state_dict have different keys: " + "; ".join(parts))
        for fqn, obj in self.state_dict.items():
            if fqn in stored and isinstance(obj, torch.Tensor):
                raise CheckpointError(f"entry {fqn!r} is a value in the checkpoint ({stored[fqn]!r:.200}) but a "
                                      f"tensor in the state_dict")
            if fqn in saved and fqn in self._unwritable:
                raise self._unwritable[fqn]
            if fqn in saved and isinstance(obj, torch.Tensor):
                dtype, size, _ = self.targets.get(fqn, (dtype_name(obj.dtype), obj.shape, None))
                self._check_tensor(fqn, saved[fqn], dtype, size)
            elif isinstance(saved.get(fqn), TensorStorageMetadata):
                raise CheckpointError(f"entry {fqn!r} is a tensor in the checkpoint but a {type(obj).__name__} in "
                                      f"the state_dict")
        plain = {k: v for k, v in self.state_dict.items() if k not in self.targets and k in saved}
        requests = list(create_default_local_load_plan(plain, self.metadata, False).items)
        for fqn, (_, _, b) in self.targets.items():
            if fqn in saved and b is not None:
                chunk = ChunkStorageMetadata(offsets=torch.Size(lo for lo, _ in b), sizes=torch.Size(block_shape(b)))
                requests += create_read_items_for_chunk_list(fqn, saved[fqn], [chunk])
        return LoadPlan(requests)

    def _take_values(self, saved: dict) -> dict[str, Any]:
        """The JSON values of sbp's `RECORD`; sets `loaded` (those the state dict has, rebuilt in its types)
        and drops DCP's own entries of the state dict's values from what is read."""
        stored = self._reader.read_value(RECORD)
        try:
            stored = json.loads(stored)
        except (TypeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"DCP entry {RECORD!r} is not sbp's record of JSON values ({e}); the checkpoint "
                                  f"is corrupt or altered") from e
        if not isinstance(stored, dict):
            raise CheckpointError(f"DCP entry {RECORD!r} is not sbp's record of JSON values; the checkpoint is "
                                  f"corrupt or altered")
        for fqn in [fqn for fqn in self.state_dict if _under(fqn, self._values)]:
            del self.state_dict[fqn]
        self.loaded = {key: like(key, stored[key], leaf) for key, (leaf, _, _) in self._values.items() if key in stored}
        return stored

    def _check_tensor(self, fqn: str, md: Any, dtype: str, size: torch.Size) -> None:
        """The saved entry `md` of a tensor target: a tensor of the target's global shape and dtype."""
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"entry {fqn!r} is a value in the checkpoint ({self._reader.saved_value(fqn)}) "
                                  f"but a tensor in the state_dict")
        if md.size != size:
            raise CheckpointError(f"tensor {fqn!r}: global shape {tuple(md.size)} in the checkpoint, "
                                  f"{tuple(size)} in the state_dict")
        if dtype_name(md.properties.dtype) != dtype:
            raise CheckpointError(f"tensor {fqn!r}: dtype {dtype_name(md.properties.dtype)} in the checkpoint, "
                                  f"{dtype} in the state_dict")

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.targets:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)   # plain values only: never code from a pickle
        except Exception as e:  # noqa: BLE001 - (a pickled class: DTensor code pickles a namedtuple whole)
            raise CheckpointError(f"entry {read_item.dest_index.fqn!r} of the DCP checkpoint holds an object sbp "
                                  f"does not unpickle (plain values only: torch.load(weights_only=True)): "
                                  f"{_unloadable(e)}") from None
        again = io.BytesIO()
        torch.save(obj, again)
        again.seek(0)
        super().load_bytes(read_item, again)
