"""safetensors interop: `sbp.save(..., format="safetensors")` writes one consolidated ``model.safetensors``
holding the logical tensors; `sbp.load` reads one (or a transformers-style index and its shards) into any
layout.

The format is a little-endian u64 header length, a JSON header (per tensor: dtype, shape, the byte range
of its row-major data) and the data. Every rank computes the whole header from the state dict alone
(global shapes and dtypes), so nothing but barriers is exchanged:

- saving, coord 0 writes the header into ``model.safetensors.tmp`` and sizes the file; each rank then
  writes its own blocks (each distinct block once, by its first holder; `Partial` tensors reduced first)
  at their byte offsets, one write per contiguous run; coord 0 renames the file into place once every
  rank is done -- one atomic rename, so a crash leaves the previous file whole. JSON values go into the
  header's ``__metadata__`` (``"sbp.values"``), next to ``"format": "pt"`` that transformers expects.
  The barriers carry failure flags: a rank that cannot write makes every rank raise at once.
- loading, each rank opens each file once and reads through that descriptor the header and then only
  the byte ranges of its target blocks (a save replacing the file meanwhile cannot shift them).

The file is the plain safetensors format: `safetensors.torch.load_file` reads it, and a transformers
model's state dict saved this way (with ``config.save_pretrained`` beside it) loads with
``from_pretrained`` on one process.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from typing import Any, Optional

import torch

from ..runtime import agreement
from ..tensor.global_tensor import GlobalTensor
from ..values.errors import CheckpointError, RankMismatchError
from ..values.layout import Block, block, block_numel, block_shape
from ..values.mesh import DeviceMesh
from .state import (
    agree_loaded,
    agree_save,
    check_target,
    check_tuple_slot,
    common_mesh,
    fsync_dir,
    host_barrier,
    host_copy,
    json_value,
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

FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
NAMES = (FILE, INDEX)
VALUES = "sbp.values"
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
FROM_CODE = {code: dtype for dtype, code in DTYPES.items()}


def save_safetensors(state_dict: dict, path: str, *, mesh: Optional[DeviceMesh] = None) -> None:
    """`sbp.save(state_dict, path, format="safetensors")`: `path` is the file (``*.safetensors``) or a
    directory that gets ``model.safetensors``.

    >>> import os, shutil, tempfile, torch, sbp, sbp.testing
    >>> from safetensors.torch import load_file
    >>> path = tempfile.mkdtemp()
    >>> def fn(mesh):
    ...     sbp.save({"w": sbp.distribute(torch.arange(6.).view(2, 3), mesh, "S(1)")}, path, format="safetensors")
    >>> _ = sbp.testing.spmd(fn, (2,))
    >>> load_file(os.path.join(path, "model.safetensors"))["w"].tolist()
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    >>> shutil.rmtree(path)
    """
    file = path if path.endswith(".safetensors") else os.path.join(path, FILE)
    found = leaves(state_dict)
    mesh = common_mesh(found, mesh)
    if mesh is not None and mesh.coord is None:
        return
    first = mesh is None or mesh.index_of(mesh.coord) == 0
    try:   # every refusal before the first collective, which carries it: no rank waits for a rank that left
        refused = unsaved_tensors(found)
        if refused is not None:
            raise refused
        header, values, offset = _header(found)
    except CheckpointError as e:
        header, values, offset, refused = {}, {}, 0, e
    header["__metadata__"] = {"format": "pt", VALUES: json.dumps(values)}
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)            # the data starts 8-byte aligned
    start = 8 + len(data)
    tmp = file + ".tmp"
    with save_lock(os.path.dirname(file) or ".", first and refused is None) as locked:   # one save at a time
        error = refused or locked
        if first and error is None:
            try:
                with open(tmp, "wb") as f:
                    f.write(struct.pack("<Q", len(data)) + data)
                    f.truncate(start + offset)
            except OSError as e:
                error = CheckpointError(f"save: cannot write {tmp!r}: {e} (the previous {file!r} is unchanged)")
        # the file exists, sized, before anyone writes into it; the same all_reduce checks that the ranks save
        # the same keys, layouts and values, and tells every rank if one refused the save or coord 0 could not
        # create the file
        made = first and refused is None and locked is None   # coord 0 opened the temporary file
        try:
            failed = agree_save(mesh, found, path, 0, error is not None)[1]
        except RankMismatchError:   # the ranks' calls differ: every rank raises, nothing is written
            if made:
                _remove_tmp(tmp)
            raise
        if failed:
            if made:
                _remove_tmp(tmp)
            raise_together(mesh, file, error)
        _write_blocks(found, header, path, file, tmp, start, mesh, first)


def _header(found: dict) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The safetensors header of the state dict's tensors (dtype, shape, byte range), its JSON values and
    the data's length; a `CheckpointError` for what the format cannot hold."""
    header: dict[str, Any] = {}
    values: dict[str, Any] = {}
    offset = 0
    for key, (leaf, _, _) in found.items():
        if key == "__metadata__":
            raise CheckpointError(f"entry {key!r}: safetensors reserves the name '__metadata__' for the file's "
                                  f"own metadata (sbp keeps the JSON values there); rename the entry")
        if not isinstance(leaf, torch.Tensor):
            values[key] = json_value(key, leaf)
            continue
        if leaf.dtype not in DTYPES:
            raise CheckpointError(f"tensor {key!r} has dtype {leaf.dtype}, which safetensors cannot hold "
                                  f"(valid: {', '.join(str(d).removeprefix('torch.') for d in DTYPES)})")
        nbytes = math.prod(leaf.shape) * leaf.element_size()
        header[key] = {"dtype": DTYPES[leaf.dtype], "shape": list(leaf.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return header, values, offset


def _write_blocks(found: dict, header: dict[str, Any], path: str, file: str, tmp: str, start: int,
                  mesh: Optional[DeviceMesh], first: bool) -> None:
    """Every rank writes its blocks into `tmp` (each distinct block once, by its first holder; `Partial`
    tensors reduced first), then coord 0 renames it over `file`; a barrier after each step carries failures."""
    pieces: list[tuple[int, tuple[int, ...], int, Block, torch.Tensor]] = []   # (offset, shape, itemsize, block, local)
    for key, (leaf, _, _) in found.items():
        if not isinstance(leaf, torch.Tensor):
            continue
        base, shape = header[key]["data_offsets"][0], tuple(leaf.shape)
        if isinstance(leaf, GlobalTensor):
            x = reduced(leaf)   # a collective: every rank makes it, also after a failed copy
            mine = block(shape, x.mesh.shape, x.placements, x.mesh.coord)
            if writers(x).get(mine) == x.mesh.coord:
                pieces.append((base, shape, leaf.element_size(), mine, x._local))
        elif first and leaf.numel():
            pieces.append((base, shape, leaf.element_size(), tuple((0, n) for n in shape), leaf))
    error = None
    if pieces:
        try:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                for base, shape, itemsize, b, local in pieces:
                    raw = host_copy(local).reshape(-1).view(torch.uint8).numpy()
                    for at, (lo, hi) in _runs(shape, b, itemsize):
                        os.pwrite(fd, raw[lo:hi].tobytes(), start + base + at)
                os.fsync(fd)
            finally:
                os.close(fd)
        except Exception as e:  # noqa: BLE001 - whatever failed (disk, memory), every rank must learn of it
            error = CheckpointError(f"save: cannot write this rank's blocks into {tmp!r}: {type(e).__name__}: {e} "
                                    f"(the previous {file!r} is unchanged)")
            error.__cause__ = e
    if _failed_anywhere(mesh, error):
        _fail(file, tmp, first, error, "a rank could not write its blocks")
    if first:
        try:
            os.replace(tmp, file)             # the switch: the old file stays whole until here
        except Exception as e:  # noqa: BLE001 - the others wait at the barrier below: they must learn of it
            error = CheckpointError(f"save: cannot commit {file!r}: {e} (the previous {file!r} is unchanged)")
            error.__cause__ = e
        else:
            fsync_dir(os.path.dirname(file) or ".")
            if file != path:                  # saved into a directory: the newest save is what loads
                retire_others(path, "safetensors")
    if _failed_anywhere(mesh, error):         # nobody returns before the file is in place
        _fail(file, tmp, first, error, "coord 0 could not commit the file")


def _failed_anywhere(mesh: Optional[DeviceMesh], error: Optional[CheckpointError]) -> bool:
    """Whether a rank of `mesh` failed its step (`error`): a host barrier that also counts the failures."""
    return error is not None if mesh is None else bool(host_barrier(mesh, error is not None))


def _fail(file: str, tmp: str, first: bool, error: Optional[CheckpointError], what: str) -> None:
    """Every rank has learnt that a step of the save failed: coord 0 removes the temporary file, then the
    failing ranks raise their own error and the others one saying `what` failed."""
    if first:
        _remove_tmp(tmp)
    if error is not None:
        raise error
    raise CheckpointError(f"save of {file!r} failed: {what}; nothing was committed (the previous file is "
                          f"unchanged)")


def _remove_tmp(tmp: str) -> None:
    try:
        os.remove(tmp)
    except OSError:
        pass


def _runs(shape: tuple[int, ...], b: Block, itemsize: int):
    """(byte offset in the tensor's row-major data, (start, stop) bytes in the block's own data) for each
    contiguous run of block `b`: the dims after the last partly covered one are whole, so a run spans them.

    >>> list(_runs((4, 6), ((1, 3), (2, 4)), 1))      # rows 1-2, columns 2-3: two runs of 2
    [(8, (0, 2)), (14, (2, 4))]
    >>> list(_runs((4, 6), ((1, 3), (0, 6)), 1))      # whole rows: one run
    [(6, (0, 12))]
    """
    if block_numel(b) == 0:
        return
    ndim = len(shape)
    cut = ndim   # dims cut..ndim-1 are covered whole
    while cut > 0 and b[cut - 1] == (0, shape[cut - 1]):
        cut -= 1
    inner = math.prod(shape[cut:]) if cut < ndim else 1
    if cut == 0:
        yield 0, (0, inner * itemsize)
        return
    run_dim = cut - 1
    run = (b[run_dim][1] - b[run_dim][0]) * inner
    strides = [math.prod(shape[d + 1:]) for d in range(ndim)]
    outer = [range(lo, hi) for lo, hi in b[:run_dim]]
    done = 0
    for idx in _product(outer):
        at = sum(i * strides[d] for d, i in enumerate(idx)) + b[run_dim][0] * strides[run_dim]
        yield at * itemsize, (done * itemsize, (done + run) * itemsize)
        done += run


def _product(ranges):
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


# ---- load ----------------------------------------------------------------------------------------------

def load_safetensors(path: str, state_dict: dict, *, strict: bool = True) -> dict:
    """`sbp.load` of a safetensors file (or a directory with ``model.safetensors``, or a transformers index
    and its shards): each rank reads only the byte ranges of its target blocks.

    >>> import shutil, tempfile, torch, sbp, sbp.testing
    >>> from safetensors.torch import save_file
    >>> path = tempfile.mkdtemp()
    >>> save_file({"w": torch.arange(10.)}, f"{path}/model.safetensors")
    >>> def fn(mesh):
    ...     state = {"w": sbp.zeros((10,), mesh, "S(0)")}
    ...     sbp.load(path, state)
    ...     return state["w"].to_local().tolist()
    >>> sbp.testing.spmd(fn, (4,))
    [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    >>> shutil.rmtree(path)
    """
    found = leaves(state_dict)
    meshes = target_meshes(found)
    fds: dict[str, int] = {}   # each file opened once: a save that replaces it meanwhile cannot mix into the reads
    try:
        try:
            entries, values, read = _check(path, found, strict, fds)   # every check before the first write
            # and every read: an I/O error on one rank fails the load on every rank, nothing written
            pieces = {key: _read_block(entries[key], leaf, fds) for key, (leaf, _, _) in found.items()
                      if key in entries and key not in values}
            error = None
        except Exception as e:  # noqa: BLE001 - whatever failed, every rank must learn of it, then all raise
            values, pieces, read, error = {}, {}, 0, e
        agree_loaded(meshes, path, error, read)   # one all_reduce: all ranks raise (a failure, mixed saves) or none
        for key, (leaf, container, index) in found.items():
            if key in values:
                container[index] = values[key]   # (rebuilt in the state dict's types by the checks)
            elif key in pieces:
                local, _ = target_block(leaf)    # (zeroes a P(sum) target away from coord 0)
                if pieces[key] is not None:
                    with torch.no_grad():
                        local.copy_(pieces[key])
    finally:
        for fd in fds.values():
            os.close(fd)
    return state_dict


def _check(path: str, found: dict, strict: bool, fds: dict[str, int]) -> tuple[dict[str, tuple], dict[str, Any], int]:
    """The headers of every file involved (opened into `fds`), checked against the state dict (keys, shapes,
    dtypes), the JSON values rebuilt in the state dict's types (`like`), and the digest of what was read
    (`_read_headers`)."""
    entries, values, read = _read_headers(path, fds)
    saved = set(entries) | set(values)
    missing, extra = missing_keys(found, saved), sorted(saved - set(found))
    if strict and (missing or extra):
        parts = ([f"missing from the checkpoint: {missing}"] if missing else []) + \
                ([f"in the checkpoint but not in the state_dict: {extra}"] if extra else [])
        raise CheckpointError(f"safetensors checkpoint {path!r} and the state_dict have different keys: "
                              + "; ".join(parts))
    for key, (leaf, container, _) in found.items():   # every refusal before anything is written
        if key in values and isinstance(leaf, torch.Tensor):
            raise CheckpointError(f"entry {key!r} is a value in the checkpoint ({values[key]!r}) but a tensor in "
                                  f"the state_dict")
        if key in values:
            check_tuple_slot(key, container)
            values[key] = like(key, values[key], leaf)
        if key in entries:
            if not isinstance(leaf, torch.Tensor):
                raise CheckpointError(f"entry {key!r} is a tensor in the checkpoint but a {type(leaf).__name__} in "
                                      f"the state_dict")
            check_target(key, leaf)
            file, _, dtype, shape, _ = entries[key]
            if tuple(leaf.shape) != shape:
                raise CheckpointError(f"tensor {key!r}: global shape {shape} in {file!r}, {tuple(leaf.shape)} in the "
                                      f"state_dict")
            if leaf.dtype != dtype:
                raise CheckpointError(f"tensor {key!r}: dtype {dtype} in {file!r}, {leaf.dtype} in the state_dict")
    return entries, values, read


def _read_block(entry, target: torch.Tensor, fds: dict[str, int]) -> Optional[torch.Tensor]:
    """This rank's block of the tensor `entry` describes, read from its file (nothing written); None where the
    rank fills nothing or an empty block."""
    file, start, dtype, shape, (lo, _) = entry
    local, want = target_block(target, zero=False)
    if local is None or block_numel(want) == 0:
        return None
    itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
    buf = bytearray(block_numel(want) * itemsize)
    view = memoryview(buf)
    for at, (a, b) in _runs(shape, want, itemsize):
        try:
            got = os.pread(fds[file], b - a, start + lo + at)
        except OSError as e:
            raise CheckpointError(f"cannot read {file!r}: {e}") from e
        if len(got) != b - a:
            raise CheckpointError(f"{file!r} ends before the data of a tensor it lists: it is truncated")
        view[a:b] = got
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(block_shape(want))


def _read_headers(path: str, fds: dict[str, int]) -> tuple[dict[str, tuple], dict[str, Any], int]:
    """{key: (file, data start, dtype, shape, (begin, end))}, the JSON values, and a digest of each file's
    header and modification time (which save this rank read, for `agree_loaded`), from every file involved;
    each is opened into `fds` {file: descriptor}, which the tensor reads use too."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isfile(os.path.join(path, FILE)):
        files = [os.path.join(path, FILE)]
    else:
        index = os.path.join(path, INDEX)
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({os.path.join(path, os.path.basename(name)) for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{index!r} is not a safetensors index ({e}); the checkpoint is corrupt") from e
    entries: dict[str, tuple] = {}
    values: dict[str, Any] = {}
    read = hashlib.sha256()
    for file in files:
        try:
            fds[file] = os.open(file, os.O_RDONLY)
            stat = os.fstat(fds[file])
        except OSError as e:
            raise CheckpointError(f"cannot read {file!r}: {e}") from e
        start, header, raw = _read_header(file, fds[file], stat.st_size)
        read.update(f"{file}\0{stat.st_mtime_ns}\0{stat.st_size}\0".encode() + raw)
        meta = header.pop("__metadata__", None) or {}
        if isinstance(meta, dict) and VALUES in meta:
            try:
                values |= json.loads(meta[VALUES])
            except (TypeError, ValueError, RecursionError) as e:   # RecursionError: nested too deep to parse
                raise CheckpointError(f"{file!r}: __metadata__ {VALUES!r} is not JSON ({e})") from e
        for key, e in header.items():
            entries[key] = (file, start, *_check_entry(file, key, e, stat.st_size - start))
    return entries, values, agreement.digest(read.hexdigest())


def _read_header(file: str, fd: int, size: int) -> tuple[int, dict, bytes]:
    """(where the data starts, the header, its bytes) of the safetensors file open as `fd`, `size` bytes."""
    try:
        head = os.pread(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise CheckpointError(f"{file!r} is not a safetensors file (header length {n}); it is corrupt or "
                                  f"truncated")
        raw = os.pread(fd, n, 8)
        header = json.loads(raw)
    except OSError as e:
        raise CheckpointError(f"cannot read {file!r}: {e}") from e
    except (ValueError, RecursionError) as e:   # RecursionError: nested deeper than the parser goes
        raise CheckpointError(f"{file!r}: the safetensors header is not JSON ({e}); it is corrupt") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file!r}: the safetensors header is not an object; it is corrupt")
    return 8 + n, header, raw


def _check_entry(file: str, key: str, e: Any, size: int) -> tuple[torch.dtype, tuple[int, ...], tuple[int, int]]:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{file!r}: tensor {key!r}: {what}; the file is corrupt or altered")

    if not isinstance(e, dict):
        raise bad("the entry is not an object")
    dtype = FROM_CODE.get(e.get("dtype"))
    if dtype is None:
        raise bad(f"dtype {e.get('dtype')!r} is not one sbp reads (valid: {', '.join(FROM_CODE)})")
    shape, offsets = e.get("shape"), e.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in offsets):
        raise bad(f"data_offsets {offsets!r} is not [begin, end]")
    lo, hi = offsets
    itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
    if not 0 <= lo <= hi <= size or hi - lo != math.prod(shape) * itemsize:
        raise bad(f"data_offsets {offsets} do not hold {math.prod(shape)} elements of {dtype} inside the "
                  f"{size} data bytes")
    return dtype, tuple(shape), (lo, hi)
