"""Sharded checkpoints: `save` writes each rank's blocks, `load` reshards them onto any mesh and placements.

A checkpoint is a directory: one file per writing rank (``rank00003.pt``: a `torch.save`d dict of plain
tensors, nothing else, read back with ``torch.load(weights_only=True)``) and ``metadata.json``, which
says, per tensor, the global shape, dtype, mesh shape, placements and which file holds which block
(half-open global index ranges per dim), plus each file's size and SHA-256. Every size and block comes
from layout maths (`sbp.values.layout.block`): every rank knows every other rank's block without talking.

Saving: a Broadcast block is written once (by the first coord holding it, row-major); a `Partial`
tensor is first reduced (redistributed with each `P(op)` replaced by `B`): the checkpoint holds the
logical value, never partial parts. Plain tensors are written once, by the mesh's coord 0.
Loading: each rank intersects its target block with the saved blocks and opens only the files whose
blocks it needs. A shared filesystem is assumed (every rank sees the directory).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterator, Optional

import torch

from ..runtime.backends.base import comm_device
from ..tensor.global_tensor import GlobalTensor, redistribute_raw, sum_holds_value
from ..values.errors import CheckpointError, SbpError
from ..values.layout import Block, block, block_numel, block_shape, intersect, relative
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, normalize, placements as parse_placements

FORMAT = "sbp-checkpoint"
VERSION = 1
METADATA = "metadata.json"
Leaf = Any  # a tensor, or a JSON value (int, float, str, bool, None, lists and dicts of them)


# ---- flattening nested state dicts ---------------------------------------------------------------------

def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """(key, leaf, container, index): nested dicts and lists that hold tensors are walked, keys joined by
    '.'; anything holding no tensor is one JSON leaf (e.g. an optimizer's param_groups entry)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list, tuple)) and _has_tensor(v):
            yield from _flatten(v, key + ".")
        else:
            yield key, v, obj, k


def _leaves(state_dict: Any) -> dict[str, tuple[Any, Any, Any]]:
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"a state_dict must be a dict, got {type(state_dict).__name__}")
    out: dict[str, tuple[Any, Any, Any]] = {}
    for key, leaf, container, index in _flatten(state_dict):
        if key in out:
            raise CheckpointError(f"two entries of the state_dict flatten to the key {key!r}; rename one")
        out[key] = (leaf, container, index)
    return out


def _common_mesh(leaves: dict[str, tuple[Any, Any, Any]], mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
    for key, (leaf, _, _) in leaves.items():
        if isinstance(leaf, GlobalTensor):
            if mesh is None:
                mesh = leaf.mesh
            elif leaf.mesh != mesh:
                raise CheckpointError(f"tensor {key!r} lives on mesh {leaf.mesh!r}, other tensors on {mesh!r}; "
                                      f"save one mesh's tensors per checkpoint")
    return mesh


# ---- save ----------------------------------------------------------------------------------------------

def save(state_dict: dict, path: "str | os.PathLike", *, mesh: Optional[DeviceMesh] = None) -> None:
    """Write `state_dict` (global and plain tensors, nested dicts/lists, JSON values) to the directory `path`.

    An SPMD call: every rank of the tensors' mesh calls it with its own state_dict (same keys, same
    layouts). Pass `mesh` when the state_dict holds no global tensor. Each rank writes only its own
    blocks; the mesh's coord 0 writes the plain tensors and ``metadata.json``. Returns when the whole
    checkpoint is on disk.

    >>> import os, shutil, tempfile, torch, sbp, sbp.testing
    >>> path = tempfile.mkdtemp()
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.arange(12.).view(6, 2), mesh, "S(0)")
    ...     sbp.save({"x": x, "step": 3}, path)
    >>> _ = sbp.testing.spmd(fn, (4,))
    >>> sorted(os.listdir(path))
    ['metadata.json', 'rank00000.pt', 'rank00001.pt', 'rank00002.pt', 'rank00003.pt']
    >>> shutil.rmtree(path)
    """
    path = _path("save", path)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise SbpError(f"save: mesh must be an sbp.DeviceMesh or None, got {type(mesh).__name__}")
    leaves = _leaves(state_dict)
    mesh = _common_mesh(leaves, mesh)
    coord = None if mesh is None else mesh.coord
    if mesh is not None and coord is None:
        return  # outside the mesh: holds nothing, takes part in nothing
    me = 0 if mesh is None else mesh.rank
    first = mesh is None or mesh.index_of(coord) == 0
    shard: dict[str, torch.Tensor] = {}
    tensors: dict[str, dict] = {}
    values: dict[str, Any] = {}
    for key, (leaf, _, _) in leaves.items():
        if isinstance(leaf, GlobalTensor):
            x = _reduced(leaf)
            entry, mine = _describe_global(x, leaf.placements)
            if mine is not None:
                shard[_entry_name(key, mine)] = _host_copy(x._local)
        elif isinstance(leaf, torch.Tensor):
            entry = _describe_plain(leaf, me if mesh is None else mesh.ranks[0])
            if first:
                shard[_entry_name(key, tuple((0, n) for n in leaf.shape))] = _host_copy(leaf)
        else:
            try:
                back = json.loads(json.dumps(leaf))
            except (TypeError, ValueError):
                raise CheckpointError(f"entry {key!r} is a {type(leaf).__name__}, which a checkpoint cannot hold "
                                      f"(valid: tensors, and JSON values: numbers, strings, lists, dicts)") from None
            if not _same_json(leaf, back):
                raise CheckpointError(f"entry {key!r} would not come back as it is from JSON ({leaf!r} reads back "
                                      f"as {back!r}): dict keys must be strings")
            values[key] = leaf
            continue
        tensors[key] = entry
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"save: cannot create the checkpoint directory {path!r}: {e}") from e
    digest = _write(shard, os.path.join(path, _file_name(me))) if shard else None
    files = _gather_digests(digest, mesh)
    if first:
        meta = {"format": FORMAT, "version": VERSION, "torch": torch.__version__, "files": files,
                "tensors": tensors, "values": values}
        tmp = os.path.join(path, f".{METADATA}.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, os.path.join(path, METADATA))
    if mesh is not None:  # nobody returns before metadata.json is there
        host_barrier(mesh)


def host_barrier(mesh: DeviceMesh) -> None:
    """Return only once every rank of `mesh` has reached this call: an all_reduce on the mesh's device whose
    result is read on the host (on NCCL a collective returns once queued; reading it waits for it).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(host_barrier, (2,))
    [None, None]
    """
    comm = mesh.binding
    done = comm.all_reduce(torch.ones(1, device=comm_device(mesh)), tuple(range(mesh.ndim)), "sum")
    if int(done.item()) != mesh.size():
        raise CheckpointError(f"save: the closing barrier counted {int(done.item())} ranks, not the mesh's "
                              f"{mesh.size()}")


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A compact CPU copy of `t` for `torch.save` (which would write a view's whole storage): a device tensor
    is copied straight to the host, never cloned on the device first.

    >>> base = torch.arange(6.)
    >>> _host_copy(base[2:4]).untyped_storage().nbytes()
    8
    """
    t = t.detach()
    return t.to("cpu", copy=True).contiguous() if t.device.type == "cpu" else t.contiguous().to("cpu")


def _reduced(x: GlobalTensor) -> GlobalTensor:
    """`x` without Partial axes: the checkpoint holds reduced values."""
    if not any(isinstance(p, Partial) for p in x.placements):
        return x
    return redistribute_raw(x, tuple(Broadcast() if isinstance(p, Partial) else p for p in x.placements))


def _describe_global(x: GlobalTensor, original) -> tuple[dict, Optional[Block]]:
    """The metadata entry of `x` and this rank's block when this rank writes it (first holder, row-major)."""
    mesh, shape, pls = x.mesh, tuple(x.shape), x.placements
    writers: dict[Block, tuple[int, ...]] = {}
    for c in mesh.coords():
        b = block(shape, mesh.shape, pls, c)
        if block_numel(b) and b not in writers:
            writers[b] = c
    blocks = [{"file": _file_name(mesh.rank_of(c)), "block": [list(r) for r in b]} for b, c in writers.items()]
    mine = block(shape, mesh.shape, pls, mesh.coord)
    entry = {"global_shape": list(shape), "dtype": _dtype_name(x.dtype), "mesh_shape": list(mesh.shape),
             "placements": repr(tuple(original)), "saved_placements": repr(tuple(pls)), "blocks": blocks}
    return entry, (mine if writers.get(mine) == mesh.coord else None)


def _describe_plain(t: torch.Tensor, writer: int) -> dict:
    shape = tuple(t.shape)
    blocks = [{"file": _file_name(writer), "block": [[0, n] for n in shape]}] if t.numel() else []
    return {"global_shape": list(shape), "dtype": _dtype_name(t.dtype), "mesh_shape": None, "placements": None,
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
    torch.save(shard, tmp)
    os.replace(tmp, file)
    return _sha256(file), os.path.getsize(file)


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _gather_digests(digest: Optional[tuple[str, int]], mesh: Optional[DeviceMesh]) -> dict[str, dict]:
    """Every writer's file digest and size, for coord 0's metadata (one all_gather of 5 int64 per rank)."""
    if mesh is None:
        return {} if digest is None else {_file_name(0): {"sha256": digest[0], "bytes": digest[1]}}
    row = torch.zeros(5, dtype=torch.int64, device="cpu")   # built on the host, then moved
    if digest is not None:
        row[:4] = torch.frombuffer(bytearray(bytes.fromhex(digest[0])), dtype=torch.int64)
        row[4] = digest[1] + 1  # 0 means "wrote no file"
    # the collective takes the row on the mesh's device (NCCL: CUDA tensors); the table comes back to the host
    rows = mesh.binding.all_gather(row.to(comm_device(mesh)), tuple(range(mesh.ndim)))
    out = {}
    for rank, r in zip(mesh.ranks, rows):
        r = r.cpu()
        if int(r[4]):
            out[_file_name(rank)] = {"sha256": r[:4].contiguous().numpy().tobytes().hex(), "bytes": int(r[4]) - 1}
    return out


def _path(call: str, path: Any) -> str:
    """`path` as a str; anything but a non-empty str or `os.PathLike` of one is refused.

    >>> _path("save", 5)
    Traceback (most recent call last):
    ...
    sbp.values.errors.CheckpointError: save: path must be a str or os.PathLike naming the checkpoint directory, got int (5)
    """
    if isinstance(path, (str, os.PathLike)):
        found = os.fspath(path)
        if isinstance(found, str) and found:
            return found
        what = repr(found)
    else:
        what = f"{type(path).__name__} ({path!r:.60})"
    raise CheckpointError(f"{call}: path must be a str or os.PathLike naming the checkpoint directory, got {what}")


# ---- load ----------------------------------------------------------------------------------------------

def load(path: "str | os.PathLike", state_dict: dict, *, strict: bool = True) -> dict:
    """Fill `state_dict` in place from the checkpoint at `path`, resharding to its tensors' layouts.

    Each target tensor keeps its mesh, placements and storage (so loading a ``model.state_dict()``
    updates the model's parameters); JSON values are replaced. The checkpoint may come from another
    mesh shape, another number of ranks or other placements. With `strict` (default) the keys must be
    the same; otherwise only the common keys are loaded. Any mismatch or damage raises
    `sbp.CheckpointError` naming the tensor and what differs. Returns `state_dict`.

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
    path = _path("load", path)
    if not isinstance(strict, bool):
        raise SbpError(f"load: strict must be True or False, got {strict!r}")
    meta = _read_metadata(path)
    leaves = _leaves(state_dict)
    saved = set(meta["tensors"]) | set(meta["values"])
    missing, extra = sorted(set(leaves) - saved), sorted(saved - set(leaves))
    if strict and (missing or extra):
        parts = ([f"missing from the checkpoint: {missing}"] if missing else []) + \
                ([f"in the checkpoint but not in the state_dict: {extra}"] if extra else [])
        raise CheckpointError(f"checkpoint {path!r} and the state_dict have different keys: " + "; ".join(parts))
    for key, (leaf, container, index) in leaves.items():   # every refusal before anything is written
        if key in meta["values"] and isinstance(leaf, torch.Tensor):
            raise CheckpointError(f"entry {key!r} is a value in the checkpoint ({meta['values'][key]!r}) but a "
                                  f"tensor in the state_dict")
        if key in meta["values"] and isinstance(container, tuple):
            raise CheckpointError(f"entry {key!r} sits in a tuple of the state_dict, which load cannot fill in "
                                  f"place; make that container a list")
    files = _Files(path, meta)
    for key, (leaf, container, index) in leaves.items():
        if key in meta["values"]:
            container[index] = _like(meta["values"][key], leaf)
        elif key in meta["tensors"]:
            if not isinstance(leaf, torch.Tensor):
                raise CheckpointError(f"entry {key!r} is a tensor in the checkpoint but a {type(leaf).__name__} in "
                                      f"the state_dict")
            _load_tensor(key, meta["tensors"][key], leaf, files)
    return state_dict


def _same_json(value: Any, back: Any) -> bool:
    """Whether `back` (read from JSON) is `value`, tuples read as lists (`_like` restores them) and nan
    equal to itself; dict keys must be the same strings."""
    if isinstance(value, dict):
        return isinstance(back, dict) and list(value) == list(back) and all(
            _same_json(v, back[k]) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return isinstance(back, list) and len(back) == len(value) and all(map(_same_json, value, back))
    if isinstance(value, float) and value != value:
        return isinstance(back, float) and back != back
    return type(value) is type(back) and value == back


def _like(value: Any, template: Any) -> Any:
    """A JSON value read back, with the tuples of the state_dict entry it replaces restored (an optimizer's
    ``betas=(0.9, 0.999)`` stays a tuple)."""
    if isinstance(value, list) and isinstance(template, (list, tuple)):
        items = [_like(v, template[i] if i < len(template) else None) for i, v in enumerate(value)]
        return tuple(items) if isinstance(template, tuple) else items
    if isinstance(value, dict) and isinstance(template, dict):
        return {k: _like(v, template.get(k)) for k, v in value.items()}
    return value


def _load_tensor(key: str, entry: dict, target: torch.Tensor, files: "_Files") -> None:
    shape = tuple(entry["global_shape"])
    if tuple(target.shape) != shape:
        raise CheckpointError(f"tensor {key!r}: global shape {shape} in the checkpoint, {tuple(target.shape)} in "
                              f"the state_dict")
    if _dtype_name(target.dtype) != entry["dtype"]:
        raise CheckpointError(f"tensor {key!r}: dtype {entry['dtype']} in the checkpoint, "
                              f"{_dtype_name(target.dtype)} in the state_dict")
    if isinstance(target, GlobalTensor):
        mesh, coord = target.mesh, target.mesh.coord
        if coord is None:
            return
        local = target._local
        want = block(shape, mesh.shape, target.placements, coord)
        if not sum_holds_value(mesh, target.placements, coord):  # P(sum) holds the value at coord 0 only
            with torch.no_grad():
                local.zero_()
            return
    else:
        local, want = target, tuple((0, n) for n in shape)
    with torch.no_grad():
        for saved in entry["blocks"]:
            b = tuple(tuple(r) for r in saved["block"])
            common = intersect(b, want)
            if common is None:
                continue
            piece = files.block(saved["file"], key, b, entry["dtype"])
            local[relative(common, want)] = piece[relative(common, b)]


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
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint file {file!r} has {size} bytes, metadata.json says {expected['bytes']}: "
                                  f"it is truncated or altered (it holds blocks of tensors {users})")
        if _sha256(file) != expected["sha256"]:
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
        if tuple(t.shape) != block_shape(b) or _dtype_name(t.dtype) != dtype:
            raise CheckpointError(f"tensor {key!r}: file {name!r} holds shape {tuple(t.shape)} {_dtype_name(t.dtype)}, "
                                  f"metadata.json says block {b} (shape {block_shape(b)}) of {dtype}")
        return t


# ---- metadata validation ---------------------------------------------------------------------------------

def _read_metadata(path: str) -> dict:
    file = os.path.join(path, METADATA)
    if not os.path.isfile(file):
        what = "is not a directory" if not os.path.isdir(path) else f"has no {METADATA}"
        raise CheckpointError(f"checkpoint {path!r} {what}; write one with sbp.save")
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file!r} is not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file!r} is not an sbp checkpoint (format {FORMAT!r} expected)")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{file!r} has checkpoint version {meta.get('version')!r}; this sbp reads {VERSION}")
    for field, kind in (("files", dict), ("tensors", dict), ("values", dict)):
        if not isinstance(meta.get(field), kind):
            raise CheckpointError(f"{file!r}: field {field!r} is missing or not a {kind.__name__}")
    for name, entry in meta["files"].items():
        _check_file(file, name, entry)
    for key, entry in meta["tensors"].items():
        _check_entry(file, key, entry)
    return meta


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
    overlap = any(intersect(a, c) is not None for i, a in enumerate(parsed) for c in parsed[i + 1:])
    if overlap or sum(block_numel(b) for b in parsed) != total:
        raise bad(f"its blocks do not tile the global shape {tuple(shape)} exactly")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
