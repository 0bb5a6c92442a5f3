"""Sharded checkpoints: `save` writes each rank's blocks, `load` reshards them onto any mesh and placements.

A checkpoint is a directory: ``metadata.json``, the commit point, names one data directory
(``gen-00000003/``) holding one file per writing rank (``rank00003.pt``: a `torch.save`d dict of plain
tensors, nothing else, read back with ``torch.load(weights_only=True)``). The metadata says, per tensor,
the global shape, dtype, mesh shape, placements and which file holds which block (half-open global
index ranges per dim), plus each file's size and SHA-256. Every size and block comes from layout maths
(`sbp.values.layout.block`): every rank knows every other rank's block without talking.

Crash safety: a save writes a new data directory next to the committed one, then coord 0 replaces
``metadata.json`` with one atomic rename, and only then removes the previous data directory. A job killed
at any moment leaves either the old checkpoint or the new one, both complete; `load` reads whichever
``metadata.json`` names (checkpoints of version 1, with the files beside the metadata, still load).

Saving: a Broadcast block is written once (by the first coord holding it, row-major); a `Partial`
tensor is first reduced (redistributed with each `P(op)` replaced by `B`): the checkpoint holds the
logical value, never partial parts. Plain tensors are written once, by the mesh's coord 0.
Loading: each rank intersects its target block with the saved blocks and opens only the files whose
blocks it needs. A shared filesystem is assumed (every rank sees the directory).
``format="dcp"`` and ``format="safetensors"`` write the ecosystem's formats instead (`sbp.io.dcp`,
`sbp.io.safetensors`), each committed by one atomic rename too; `load` recognises all three. After its
commit a save removes the other formats' commit files (`sbp.io.state.retire_others`): the newest save
into a directory is what loads, whatever its format.
Agreement: the first all_reduce (the generation) carries whether a rank refused the save before
writing (a value JSON would change, another save holding the directory: `sbp.io.state.save_lock`); the
all_gather of the files' hashes carries a digest of each rank's keys, layouts and JSON values (ranks that
differ raise `RankMismatchError`, nothing is committed) and whether its write failed, and the closing
all_reduce whether the commit failed: all ranks raise `CheckpointError` together. A load
makes every check before its first write and then all-reduces one failure flag and a digest of the
metadata each rank read, so all ranks raise together (a failure, or two saves read) or none does.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..runtime import agreement
from ..runtime.backends.base import comm_device
from ..tensor.global_tensor import GlobalTensor
from ..values.errors import CheckpointError, SbpError
from ..values.layout import Block, block, block_numel, block_shape, intersect, relative
from ..values.mesh import DeviceMesh
from ..values.placement import normalize, placements as parse_placements
from . import dcp, safetensors
from .state import (
    GENERATION,
    agree_loaded,
    agree_save,
    as_path,
    check_target,
    check_tuple_slot,
    common_mesh,
    dtype_name,
    fsync_dir,
    host_barrier,
    host_copy,
    json_values,
    last_generation,
    leaves,
    like,
    missing_keys,
    raise_together,
    reduced,
    retire_others,
    save_lock,
    target_block,
    target_meshes,
    unsaved_tensors,
    writers,
)

FORMAT = "sbp-checkpoint"
VERSION = 2
READS = (1, 2)           # version 1: the rank files beside metadata.json, no data directory
METADATA = "metadata.json"
FORMATS = ("sbp", "dcp", "safetensors")


# ---- save ----------------------------------------------------------------------------------------------

def save(state_dict: dict, path: "str | os.PathLike", *, mesh: Optional[DeviceMesh] = None,
         format: str = "sbp") -> None:
    """Write `state_dict` (global and plain tensors, nested dicts/lists, JSON values) to the directory `path`.

    An SPMD call: every rank of the tensors' mesh calls it with its own state_dict (same keys, same
    layouts). Pass `mesh` when the state_dict holds no global tensor. Each rank writes only its own
    blocks; the mesh's coord 0 commits ``metadata.json``. Returns when the whole checkpoint is on disk.
    Saving over an existing checkpoint is crash-safe: until the new one is committed, the old one stays
    loadable; a save into a directory another save is writing is refused on every rank (one at a time).
    ``format="dcp"`` writes a `torch.distributed.checkpoint` directory, ``"safetensors"`` one
    ``model.safetensors`` file.

    >>> import os, shutil, tempfile, torch, sbp, sbp.testing
    >>> path = tempfile.mkdtemp()
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.arange(12.).view(6, 2), mesh, "S(0)")
    ...     sbp.save({"x": x, "step": 3}, path)
    >>> _ = sbp.testing.spmd(fn, (4,))
    >>> _ = sbp.testing.spmd(fn, (4,))                  # again: a new generation replaces the first
    >>> sorted(os.listdir(path)), sorted(os.listdir(os.path.join(path, "gen-00000002")))
    (['gen-00000002', 'metadata.json'], ['rank00000.pt', 'rank00001.pt', 'rank00002.pt', 'rank00003.pt'])
    >>> shutil.rmtree(path)
    """
    path = as_path("save", path)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise SbpError(f"save: mesh must be an sbp.DeviceMesh or None, got {type(mesh).__name__}")
    if format not in FORMATS:
        raise CheckpointError(f"save: format {format!r} is not known (valid: {', '.join(map(repr, FORMATS))})")
    _check_one_process(state_dict, mesh)
    _agree_format(state_dict, mesh, format)
    if format == "dcp":
        return dcp.save_dcp(state_dict, path, mesh=mesh)
    if format == "safetensors":
        return safetensors.save_safetensors(state_dict, path, mesh=mesh)
    found = leaves(state_dict)
    mesh = common_mesh(found, mesh)
    coord = None if mesh is None else mesh.coord
    if mesh is not None and coord is None:
        return  # outside the mesh: holds nothing, takes part in nothing
    me = 0 if mesh is None else mesh.rank
    first = mesh is None or mesh.index_of(coord) == 0
    values, refused = json_values(found)   # every refusal before the first collective, which carries it
    refused = refused or unsaved_tensors(found)
    with save_lock(path, first and refused is None) as locked:   # coord 0: one save at a time in `path`
        refused = refused or locked
        # a data directory no save has used yet: above every generation any rank sees (committed or abandoned)
        # the first collective: agrees on the directory, checks that the ranks save the same keys, layouts and
        # values to the same path, and carries refusals
        last, failed = agree_save(mesh, found, path, last_generation(path), refused is not None)
        if failed:
            raise_together(mesh, path, refused)
        _save(found, path, mesh, me, first, values, f"gen-{last + 1:08d}")


def _agree_format(state_dict: dict, mesh: Optional[DeviceMesh], format: str) -> None:
    """The ranks of the save's mesh pass the same `format` (one all_gather of one digest): the formats run
    different collectives, so ranks that differ waited out the timeout (or, with DCP's on the default group,
    for ever) and left a half-made save behind; now a `RankMismatchError` names them before anything is
    written."""
    mesh = common_mesh(leaves(state_dict), mesh)
    if mesh is None or mesh.coord is None:
        return
    gather, members = agreement.mesh_gather(mesh)
    agreement.agree(gather, members, "save", {"format": format}, device=comm_device(mesh))


def _save(found: dict, path: str, mesh: Optional[DeviceMesh], me: int, first: bool, values: dict[str, Any],
          data: str) -> None:
    """The save once every rank passed its checks: write this rank's file into `data`, gather the digests,
    coord 0 commits, and a closing barrier tells every rank whether the commit failed."""
    mine: dict[str, torch.Tensor] = {}   # entry name -> the tensor whose host copy this rank writes
    tensors: dict[str, dict] = {}
    for key, (leaf, _, _) in found.items():
        if isinstance(leaf, GlobalTensor):
            x = reduced(leaf)   # a collective: every rank makes it
            entry, held = _describe_global(x, leaf.placements)
            if held is not None:
                mine[_entry_name(key, held)] = x._local
        elif isinstance(leaf, torch.Tensor):
            entry = _describe_plain(leaf, me if mesh is None else mesh.ranks[0])
            if first:
                mine[_entry_name(key, tuple((0, n) for n in leaf.shape))] = leaf
        else:
            continue
        tensors[key] = entry
    file = os.path.join(path, data, _file_name(me))
    digest, error = None, None
    try:   # a rank whose copy or write fails still joins the gather, carrying the failure: every rank raises at once
        os.makedirs(os.path.join(path, data), exist_ok=True)
        digest = _write({name: host_copy(t) for name, t in mine.items()}, file) if mine else None
    except Exception as e:  # noqa: BLE001 - a full disk (torch.save's writer: a RuntimeError), no memory, ...
        error = CheckpointError(f"save: cannot write {file!r}: {type(e).__name__}: {e} (the previous checkpoint in "
                                f"{path!r} is unchanged)")
        error.__cause__ = e
    files, failed = _gather_digests(digest, mesh, error is not None)
    if error is not None:
        raise error
    if failed:
        which = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
        raise CheckpointError(f"save of {path!r} failed on {which}, which could not write its file to {data!r}; "
                              f"nothing was committed (the previous checkpoint is unchanged)")
    if first:
        meta = {"format": FORMAT, "version": VERSION, "torch": torch.__version__, "data": data, "files": files,
                "tensors": tensors, "values": values}
        try:
            _commit(path, meta)
        except Exception as e:  # noqa: BLE001 - the others wait at the barrier below: they must learn of it
            error = CheckpointError(f"save: cannot commit {os.path.join(path, METADATA)!r}: {e} (the previous "
                                    f"checkpoint is unchanged)")
            error.__cause__ = e
        else:
            retire_others(path, "sbp", data)   # other formats' commits, then earlier saves' data
    # nobody returns before metadata.json is there; the same all_reduce tells every rank if the commit failed
    if mesh is not None and host_barrier(mesh, error is not None) and error is None:
        raise CheckpointError(f"save of {path!r}: the commit of {METADATA} by the mesh's coord 0 failed; "
                              f"the previous checkpoint is unchanged")
    if error is not None:
        raise error


def _check_one_process(state_dict: dict, mesh: Optional[DeviceMesh]) -> None:
    """A save without a mesh (no global tensor, no `mesh=`) writes as the only rank: refused in a job of
    several processes, where every process would write and commit the checkpoint as rank 0."""
    if mesh is not None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if common_mesh(leaves(state_dict), None) is None:
        raise CheckpointError(f"save: the state_dict holds no global tensor and no mesh= was given, but this is "
                              f"one of {dist.get_world_size()} processes (torch.distributed is initialised): each "
                              f"would write the checkpoint as rank 0; pass mesh= (its coord 0 writes the plain "
                              f"tensors)")


def _commit(path: str, meta: dict) -> None:
    """The switch: the data directory is durable, then one atomic rename makes `meta` the checkpoint."""
    fsync_dir(os.path.join(path, meta["data"]))
    tmp = os.path.join(path, f".{METADATA}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, METADATA))
    except Exception:
        if os.path.exists(tmp):   # not committed: the previous metadata.json stays
            os.remove(tmp)
        raise
    fsync_dir(path)


def _describe_global(x: GlobalTensor, original) -> tuple[dict, Optional[Block]]:
    """The metadata entry of `x` and this rank's block when this rank writes it (first holder, row-major)."""
    mesh, shape, pls = x.mesh, tuple(x.shape), x.placements
    written = writers(x)
    blocks = [{"file": _file_name(mesh.rank_of(c)), "block": [list(r) for r in b]} for b, c in written.items()]
    mine = block(shape, mesh.shape, pls, mesh.coord)
    entry = {"global_shape": list(shape), "dtype": dtype_name(x.dtype), "mesh_shape": list(mesh.shape),
             "placements": repr(tuple(original)), "saved_placements": repr(tuple(pls)), "blocks": blocks}
    return entry, (mine if written.get(mine) == mesh.coord else None)


def _describe_plain(t: torch.Tensor, writer: int) -> dict:
    shape = tuple(t.shape)
    blocks = [{"file": _file_name(writer), "block": [[0, n] for n in shape]}] if t.numel() else []
    return {"global_shape": list(shape), "dtype": dtype_name(t.dtype), "mesh_shape": None, "placements": None,
            "saved_placements": None, "blocks": blocks}


def _entry_name(key: str, b: Block) -> str:
    """A block's name inside its file: the key and the block, so a file can only answer for the block it holds.

    >>> _entry_name("fc.weight", ((0, 3), (0, 7)))
    'fc.weight[0:3,0:7]'
    """
    return f"{key}[{','.join(f'{lo}:{hi}' for lo, hi in b)}]"


def _file_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _write(shard: dict[str, torch.Tensor], file: str) -> tuple[str, int]:
    tmp = file + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(shard, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    return _sha256(file), os.path.getsize(file)


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _gather_digests(digest: Optional[tuple[str, int]], mesh: Optional[DeviceMesh],
                    failed: bool = False) -> tuple[dict[str, dict], list[int]]:
    """Every writer's file digest and size, for coord 0's metadata, and the ranks that passed `failed` (their
    write failed) -- one all_gather of 5 int64 per rank."""
    if mesh is None:
        files = {} if digest is None else {_file_name(0): {"sha256": digest[0], "bytes": digest[1]}}
        return files, [0] if failed else []
    row = torch.zeros(5, dtype=torch.int64, device="cpu")   # built on the host, then moved
    if digest is not None:
        row[:4] = torch.frombuffer(bytearray(bytes.fromhex(digest[0])), dtype=torch.int64)
        row[4] = digest[1] + 1  # 0 means "wrote no file"
    if failed:
        row[4] = -1             # -1: its write failed
    # the collective takes the row on the mesh's device (NCCL: CUDA tensors); the table comes back to the host
    rows = mesh.binding.all_gather(row.to(comm_device(mesh)), tuple(range(mesh.ndim)))
    out = {}
    failures = []
    for rank, r in zip(mesh.ranks, rows):
        r = r.cpu()
        if int(r[4]) < 0:
            failures.append(rank)
        elif int(r[4]):
            out[_file_name(rank)] = {"sha256": r[:4].contiguous().numpy().tobytes().hex(), "bytes": int(r[4]) - 1}
    return out, failures


def _mtime(file: str) -> Optional[int]:
    """When `file` was last modified (ns), or None when it is not a file (or went meanwhile)."""
    try:
        st = os.stat(file)
    except OSError:
        return None
    return st.st_mtime_ns if stat.S_ISREG(st.st_mode) else None


def checkpoint_format(path: str) -> str:
    """Which format the checkpoint at `path` has: "sbp" (``metadata.json``), "dcp" (``.metadata``) or
    "safetensors" (a ``.safetensors`` file, or a directory with ``model.safetensors`` or its index).
    Where both ``metadata.json`` and ``.metadata`` are there, the newer (a save by torch's own
    ``dcp.save`` into an sbp checkpoint's directory removes no ``metadata.json``).

    >>> import tempfile
    >>> checkpoint_format(tempfile.mkdtemp())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.values.errors.CheckpointError: checkpoint '...' has no metadata.json, .metadata (DCP) or model.safetensors; write one with sbp.save
    """
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return "safetensors"
    committed = {kind: _mtime(os.path.join(path, name)) for kind, name in (("sbp", METADATA), ("dcp", dcp.METADATA))}
    if committed["sbp"] is not None and committed["dcp"] is not None:
        # both committed: torch's own dcp.save (which removes no sbp commit) wrote into an sbp checkpoint's
        # directory, or a save died between its switch and removing the other format's commit. Either way the
        # newer commit is the newest whole save (a tie keeps the sbp format's)
        return "dcp" if committed["dcp"] > committed["sbp"] else "sbp"
    if committed["sbp"] is not None:
        return "sbp"
    if committed["dcp"] is not None:
        return "dcp"
    if any(os.path.isfile(os.path.join(path, name)) for name in safetensors.NAMES):
        return "safetensors"
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} is not a directory; write one with sbp.save")
    raise CheckpointError(f"checkpoint {path!r} has no {METADATA}, {dcp.METADATA} (DCP) or {safetensors.NAMES[0]}; "
                          f"write one with sbp.save")


# ---- load ----------------------------------------------------------------------------------------------

def load(path: "str | os.PathLike", state_dict: dict, *, strict: bool = True) -> dict:
    """Fill `state_dict` in place from the checkpoint at `path`, resharding to its tensors' layouts.

    Each target tensor keeps its mesh, placements and storage (so loading a ``model.state_dict()``
    updates the model's parameters); JSON values are replaced. The checkpoint may come from another
    mesh shape, another number of ranks or other placements. With `strict` (default) the keys must be
    the same; otherwise only the common keys are loaded. Any mismatch or damage raises
    `sbp.CheckpointError` naming the tensor and what differs; every check comes before the first write,
    so a failed load changes nothing, and every rank of the mesh raises when any rank fails (one
    all_reduce of one flag). Returns `state_dict`. `path` may also be a
    DCP directory (``.metadata``: `sbp.io.dcp`) or a safetensors file, a directory holding
    ``model.safetensors`` or a transformers index (`sbp.io.safetensors`).

    Saved on 4 ranks as ``(S(0),)``, loaded on a 2x2 mesh as ``(S(1), S(0))``:

    >>> import shutil, tempfile, torch, sbp, sbp.testing
    >>> path = tempfile.mkdtemp()
    >>> def save(mesh):
    ...     sbp.save({"x": sbp.distribute(torch.arange(12.).view(6, 2), mesh, "S(0)"), "step": 3}, path)
    >>> def load(mesh):
    ...     state = {"x": sbp.zeros((6, 2), mesh, "S(1), S(0)"), "step": 0}
    ...     sbp.load(path, state)
    ...     return state["x"].local_shape, state["x"].full()[5].tolist(), state["step"]
    >>> _ = sbp.testing.spmd(save, (4,))
    >>> sbp.testing.spmd(load, (2, 2))[3]
    (torch.Size([3, 1]), [10.0, 11.0], 3)
    >>> shutil.rmtree(path)
    """
    path = as_path("load", path)
    if not isinstance(strict, bool):
        raise SbpError(f"load: strict must be True or False, got {strict!r}")
    try:
        kind = checkpoint_format(path)
    except CheckpointError as e:   # (a directory this rank does not see): joins the others' agreement, which
        agree_loaded(target_meshes(leaves(state_dict)), path, e)   # then raises on every rank
        raise
    # the ranks read one format: a save of another format committing meanwhile made ranks take different
    # paths, whose collectives never met (a hang); now every rank raises "read different saves"
    found = leaves(state_dict)
    meshes = target_meshes(found)
    agree_loaded(meshes, path, None, agreement.digest(kind))
    if kind == "dcp":
        return dcp.load_dcp(path, state_dict, strict=strict)
    if kind == "safetensors":
        return safetensors.load_safetensors(path, state_dict, strict=strict)
    try:
        writes, read = _prepare(path, found, strict)   # every check, this rank's files verified: nothing written
        error = None
    except Exception as e:  # noqa: BLE001 - whatever failed, every rank must learn of it, then all raise
        writes, read, error = [], 0, e
    agree_loaded(meshes, path, error, read)   # one all_reduce: all ranks raise (a failure, mixed saves) or none
    with torch.no_grad():
        for leaf, container, index, pieces in writes:
            if container is not None:
                container[index] = pieces         # a JSON value
                continue
            local, _ = target_block(leaf)         # (zeroes a P(sum) target away from coord 0)
            for at, piece in pieces:
                local[at] = piece
    return state_dict


def _prepare(path: str, found: dict, strict: bool) -> tuple[list[tuple], int]:
    """Every check a load makes, before anything is written: the metadata, the keys, each tensor's global
    shape and dtype, and each file this rank reads (size, SHA-256, the blocks it must hold). Returns the
    writes: (leaf, None, None, [(slices of the local tensor, the piece that fills them)]) per tensor and
    (None, container, index, value) per JSON value, and the digest of the metadata read (which save)."""
    meta, read = _read_metadata(path)
    saved = set(meta["tensors"]) | set(meta["values"])
    missing, extra = missing_keys(found, saved), sorted(saved - set(found))
    if strict and (missing or extra):
        parts = ([f"missing from the checkpoint: {missing}"] if missing else []) + \
                ([f"in the checkpoint but not in the state_dict: {extra}"] if extra else [])
        raise CheckpointError(f"checkpoint {path!r} and the state_dict have different keys: " + "; ".join(parts))
    for key, (leaf, container, index) in found.items():
        if key in meta["values"] and isinstance(leaf, torch.Tensor):
            raise CheckpointError(f"entry {key!r} is a value in the checkpoint ({meta['values'][key]!r}) but a "
                                  f"tensor in the state_dict")
        if key in meta["values"]:
            check_tuple_slot(key, container)
        elif key in meta["tensors"]:
            _check_tensor(key, meta["tensors"][key], leaf)
    files = _Files(os.path.join(path, meta["data"]), meta)
    writes: list[tuple] = []
    for key, (leaf, container, index) in found.items():
        if key in meta["values"]:
            writes.append((None, container, index, like(key, meta["values"][key], leaf)))
        elif key in meta["tensors"]:
            writes.append((leaf, None, None, _pieces(key, meta["tensors"][key], leaf, files)))
    return writes, read


def _check_tensor(key: str, entry: dict, target: Any) -> None:
    if not isinstance(target, torch.Tensor):
        raise CheckpointError(f"entry {key!r} is a tensor in the checkpoint but a {type(target).__name__} in "
                              f"the state_dict")
    check_target(key, target)   # (meta, expanded, sparse...: a write there fails or does nothing)
    shape = tuple(entry["global_shape"])
    if tuple(target.shape) != shape:
        raise CheckpointError(f"tensor {key!r}: global shape {shape} in the checkpoint, {tuple(target.shape)} in "
                              f"the state_dict")
    if dtype_name(target.dtype) != entry["dtype"]:
        raise CheckpointError(f"tensor {key!r}: dtype {entry['dtype']} in the checkpoint, "
                              f"{dtype_name(target.dtype)} in the state_dict")


def _pieces(key: str, entry: dict, target: torch.Tensor, files: "_Files") -> list[tuple]:
    """[(slices of this rank's local target, the saved piece for them)]: the target block intersected with
    every saved block; the files holding them are opened (and checked) here."""
    local, want = target_block(target, zero=False)
    if local is None:
        return []
    out = []
    for saved in entry["blocks"]:
        b = tuple(tuple(r) for r in saved["block"])
        common = intersect(b, want)
        if common is not None:
            piece = files.block(saved["file"], key, b, entry["dtype"])
            out.append((relative(common, want), piece[relative(common, b)]))
    return out


class _Files:
    """Opens checkpoint files on demand, each once: size and SHA-256 checked, then `torch.load(weights_only)`."""

    def __init__(self, path: str, meta: dict) -> None:
        self.path, self.meta = path, meta
        self.open: dict[str, dict[str, torch.Tensor]] = {}

    def _users(self, name: str) -> list[str]:
        return sorted(k for k, e in self.meta["tensors"].items() if any(b["file"] == name for b in e["blocks"]))

    def load(self, name: str) -> dict[str, torch.Tensor]:
        if name in self.open:
            return self.open[name]
        file = os.path.join(self.path, name)
        expected = self.meta["files"].get(name)
        users = self._users(name)
        if expected is None:
            raise CheckpointError(f"metadata.json names file {name!r} (for tensors {users}) but does not list it "
                                  f"in 'files'; the metadata is altered")
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint file {file!r} is missing (it holds blocks of tensors {users})")
        try:   # the file may go between the checks: a concurrent save retires the data directory it read
            size = os.path.getsize(file)
            sha256 = _sha256(file) if size == expected["bytes"] else None
        except OSError as e:
            raise CheckpointError(f"cannot read checkpoint file {file!r} (it holds blocks of tensors {users}): {e}; "
                                  f"if another save committed meanwhile, load again") from e
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint file {file!r} has {size} bytes, metadata.json says {expected['bytes']}: "
                                  f"it is truncated or altered (it holds blocks of tensors {users})")
        if sha256 != expected["sha256"]:
            raise CheckpointError(f"checkpoint file {file!r} does not match its SHA-256 in metadata.json: it is "
                                  f"corrupt or altered (it holds blocks of tensors {users})")
        try:
            data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - any failure to read is the same user-facing problem
            raise CheckpointError(f"cannot read checkpoint file {file!r} (tensors {users}): {e}") from e
        if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
            raise CheckpointError(f"checkpoint file {file!r} does not hold a dict of tensors")
        self.open[name] = data
        return data

    def block(self, name: str, key: str, b: Block, dtype: str) -> torch.Tensor:
        data = self.load(name)
        t = data.get(_entry_name(key, b))
        if t is None:
            raise CheckpointError(f"tensor {key!r}: file {name!r} should hold its block {b} but does not; the "
                                  f"metadata is altered or the file belongs to another checkpoint")
        if tuple(t.shape) != block_shape(b) or dtype_name(t.dtype) != dtype:
            raise CheckpointError(f"tensor {key!r}: file {name!r} holds shape {tuple(t.shape)} {dtype_name(t.dtype)}, "
                                  f"metadata.json says block {b} (shape {block_shape(b)}) of {dtype}")
        return t


# ---- metadata validation ---------------------------------------------------------------------------------

def _read_metadata(path: str) -> tuple[dict, int]:
    """The checked metadata and the digest of its bytes (which save this rank read)."""
    file = os.path.join(path, METADATA)
    if not os.path.isfile(file):
        what = "is not a directory" if not os.path.isdir(path) else f"has no {METADATA}"
        raise CheckpointError(f"checkpoint {path!r} {what}; write one with sbp.save")
    try:
        with open(file, "rb") as f:
            raw = f.read()
        meta = json.loads(raw)
    except OSError as e:
        raise CheckpointError(f"cannot read {file!r}: {e}") from e
    except (ValueError, RecursionError) as e:   # RecursionError: nesting deeper than the parser goes
        raise CheckpointError(f"{file!r} is not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file!r} is not an sbp checkpoint (format {FORMAT!r} expected)")
    if meta.get("version") not in READS:
        raise CheckpointError(f"{file!r} has checkpoint version {meta.get('version')!r}; this sbp reads "
                              f"{' and '.join(map(str, READS))}")
    if meta["version"] == 1:
        meta["data"] = ""   # the files sit beside metadata.json
    elif not isinstance(meta.get("data"), str) or not GENERATION.fullmatch(meta["data"]):
        raise CheckpointError(f"{file!r}: field 'data' is {meta.get('data')!r:.80}, not a data directory name "
                              f"like 'gen-00000001'; the metadata is corrupt or altered")
    for field, kind in (("files", dict), ("tensors", dict), ("values", dict)):
        if not isinstance(meta.get(field), kind):
            raise CheckpointError(f"{file!r}: field {field!r} is missing or not a {kind.__name__}")
    for name, entry in meta["files"].items():
        _check_file(file, name, entry)
    for key, entry in meta["tensors"].items():
        _check_entry(file, key, entry)
    return meta, agreement.digest(hashlib.sha256(raw).hexdigest())


def _check_file(file: str, name: str, entry: Any) -> None:
    """One entry of the "files" table: a plain file name in the checkpoint directory, its SHA-256 and size."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file!r}: 'files' entry {name!r}: {what}; the metadata is corrupt or altered "
                               f"(valid: {{'sha256': 64 hex digits, 'bytes': a non-negative int}})")

    if name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name or \
            (os.altsep and os.altsep in name):
        raise bad("the name is not a file name inside the checkpoint directory")
    if not isinstance(entry, dict):
        raise bad(f"the entry is a {type(entry).__name__}, not an object")
    for field in ("sha256", "bytes"):
        if field not in entry:
            raise bad(f"the entry has no {field!r}")
    digest, size = entry["sha256"], entry["bytes"]
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise bad(f"sha256 {digest!r:.80} is not 64 lowercase hex digits")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise bad(f"bytes {size!r:.80} is not a non-negative int")


def _check_entry(file: str, key: str, entry: Any) -> None:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file!r}: tensor {key!r}: {what}; the metadata is corrupt or altered")

    if not isinstance(entry, dict):
        raise bad("the entry is not an object")
    shape = entry.get("global_shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise bad(f"global_shape {shape!r} is not a list of non-negative ints")
    if not isinstance(entry.get("dtype"), str) or not isinstance(getattr(torch, entry["dtype"], None), torch.dtype):
        raise bad(f"dtype {entry.get('dtype')!r} is not a torch dtype name")
    if entry.get("placements") is not None:
        try:
            mesh_shape = entry["mesh_shape"]
            normalize(parse_placements(entry["placements"]), len(shape), len(mesh_shape))
        except (SbpError, KeyError, TypeError) as e:
            raise bad(f"placements {entry.get('placements')!r} on mesh {entry.get('mesh_shape')!r}: {e}") from None
    blocks = entry.get("blocks")
    if not isinstance(blocks, list):
        raise bad("blocks is not a list")
    parsed = []
    for b in blocks:
        ranges = b.get("block") if isinstance(b, dict) else None
        if not isinstance(b, dict) or not isinstance(b.get("file"), str) or not isinstance(ranges, list) or \
                len(ranges) != len(shape) or not all(isinstance(r, list) and len(r) == 2 and
                                                     all(isinstance(v, int) for v in r) for r in ranges):
            raise bad(f"block entry {b!r} is not {{'file': name, 'block': [[start, stop] per dim]}}")
        if any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(ranges, shape)):
            raise bad(f"block {ranges} lies outside the global shape {tuple(shape)}")
        parsed.append(tuple(tuple(r) for r in ranges))
    total = 1
    for n in shape:
        total *= n
    if _overlap(parsed) or sum(block_numel(b) for b in parsed) != total:
        raise bad(f"its blocks do not tile the global shape {tuple(shape)} exactly")


def _overlap(blocks: list[Block]) -> bool:
    """Whether two of `blocks` share an element. A sweep along the dim where the blocks start at the most
    places, comparing each block with those still open there: a tensor split on one dim over N ranks costs
    O(N log N), where comparing every pair cost O(N^2) per tensor on every loading rank (seconds per tensor
    for a checkpoint of 1024 ranks).

    >>> _overlap([((0, 2), (0, 4)), ((2, 4), (0, 4))]), _overlap([((0, 3), (0, 4)), ((2, 4), (1, 2))])
    (False, True)
    """
    blocks = [b for b in blocks if all(lo < hi for lo, hi in b)]   # an empty block holds nothing
    if len(blocks) < 2:
        return False
    if not blocks[0]:
        return True   # two blocks of a 0-d tensor: both hold its one element
    dim = max(range(len(blocks[0])), key=lambda d: len({b[d][0] for b in blocks}))
    open_: list[Block] = []
    for b in sorted(blocks, key=lambda b: b[dim][0]):
        open_ = [a for a in open_ if a[dim][1] > b[dim][0]]
        if any(intersect(a, b) is not None for a in open_):
            return True
        open_.append(b)
    return False


