"""What every checkpoint format shares: flattening state dicts to dotted keys, the blocks each rank holds
and writes, Partial reduction before saving, filling a target tensor's block, and the host barrier.

The sbp format (`sbp.io.checkpoint`), DCP (`sbp.io.dcp`) and safetensors (`sbp.io.safetensors`) all see a
state dict the same way: nested dicts and lists holding tensors are walked, keys joined by ``.``
(``optim.state.0.exp_avg``, the names DCP gives the same nesting); anything holding no tensor is one
JSON leaf (an optimizer's ``param_groups``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Iterator, Optional

import torch

from ..runtime.agreement import agree, digest, mesh_gather
from ..runtime.backends.base import comm_device
from ..tensor.global_tensor import GlobalTensor, redistribute_raw, sum_holds_value
from ..values.errors import CheckpointError, RankMismatchError
from ..values.layout import Block, block, block_numel
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial

Leaf = Any  # a tensor, or a JSON value (int, float, str, bool, None, lists and dicts of them)

GENERATION = re.compile(r"gen-(\d{8})")   # a save's data directory (the sbp format's and DCP's)
# the commit files a save of another format removes: `sbp.load` prefers metadata.json, then .metadata, then
# model.safetensors, so a safetensors file (perhaps a transformers model's own) never hides a newer save
COMMITS = {"sbp": "metadata.json", "dcp": ".metadata"}
# besides generation directories, what saves write and a later save may remove once it has committed:
# version-1 sbp rank files, DCP data files written flat (by DTensor code, or sbp before generations), temporaries
SAVE_DATA = re.compile(r"rank\d{5}\.pt(\.tmp)?|__\d+_\d+\.distcp|\.metadata(\.json)?\.tmp|model\.safetensors\.tmp")
MESSAGE_BYTES = 2048   # per rank in the gather that tells every rank why a load failed (only when one did)


# ---- flattening nested state dicts ---------------------------------------------------------------------

def has_tensor(obj: Any) -> bool:
    """Whether `obj` (a leaf, or nested dicts/lists/tuples) holds a tensor anywhere.

    >>> has_tensor({"a": [1, {"b": torch.ones(1)}]}), has_tensor({"lr": 0.1})
    (True, False)
    """
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_tensor(v) for v in obj)
    return False


def _flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, (dict, list, tuple)) and has_tensor(v):
            yield from _flatten(v, key + ".")
        else:
            yield key, v, obj, k


def leaves(state_dict: Any) -> dict[str, tuple[Any, Any, Any]]:
    """{dotted key: (leaf, container, index)}: containers holding tensors are walked, anything else is a leaf
    (``container[index] = ...`` replaces the leaf in place).

    >>> sorted(leaves({"model": {"w": torch.ones(1)}, "optim": {"state": {0: {"m": torch.ones(1)}},
    ...                                                          "param_groups": [{"lr": 0.1}]}}))
    ['model.w', 'optim.param_groups', 'optim.state.0.m']
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"a state_dict must be a dict, got {type(state_dict).__name__}")
    out: dict[str, tuple[Any, Any, Any]] = {}
    for key, leaf, container, index in _flatten(state_dict):
        if key in out:
            raise CheckpointError(f"two entries of the state_dict flatten to the key {key!r}; rename one")
        out[key] = (leaf, container, index)
    return out


def common_mesh(found: dict[str, tuple[Any, Any, Any]], mesh: Optional[DeviceMesh]) -> Optional[DeviceMesh]:
    """The one mesh of the global tensors among `found` (from `leaves`), or `mesh` when they hold none.

    >>> common_mesh(leaves({"w": torch.ones(1)}), None) is None
    True
    """
    for key, (leaf, _, _) in found.items():
        if isinstance(leaf, GlobalTensor):
            if mesh is None:
                mesh = leaf.mesh
            elif leaf.mesh != mesh:
                raise CheckpointError(f"tensor {key!r} lives on mesh {leaf.mesh!r}, other tensors on {mesh!r}; "
                                      f"save one mesh's tensors per checkpoint")
    return mesh


def missing_keys(found: dict[str, tuple[Any, Any, Any]], saved: set) -> list[str]:
    """The state dict's keys the checkpoint lacks, less those whose tensor shares its memory with one the
    checkpoint has: tied parameters (an embedding and its LM head), which transformers writes once and a load
    of the other key fills.

    >>> import torch
    >>> w = torch.ones(2)
    >>> missing_keys(leaves({"emb": w, "head": w.detach(), "b": torch.ones(1)}), {"emb"})
    ['b']
    """
    def memory(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.numel() == 0:
            return None
        t = leaf._local if isinstance(leaf, GlobalTensor) else leaf
        try:
            return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype
        except RuntimeError:   # (a tensor with no storage of its own: never an alias)
            return None
    held = {memory(found[k][0]) for k in found if k in saved} - {None}
    lacking = ((k, memory(found[k][0])) for k in set(found) - saved)
    return sorted(k for k, m in lacking if m is None or m not in held)


def json_value(key: str, leaf: Any) -> Any:
    """`leaf` if JSON gives it back unchanged (tuples read back as lists), else a `CheckpointError` naming
    the first part that would change and its type.

    >>> json_value("cfg", {1: "a"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.values.errors.CheckpointError: entry 'cfg' would not come back ... ({1: 'a'} reads back as {'1': 'a'}): ...
    """
    try:
        back = json.loads(json.dumps(leaf))
    except (TypeError, ValueError, RecursionError):   # not JSON, circular, or nested too deep
        if not isinstance(leaf, (dict, list, tuple)):
            raise CheckpointError(f"entry {key!r} is a {type(leaf).__name__}, which a checkpoint cannot hold "
                                  f"(valid: tensors, and {JSON_TYPES})") from None
        raise CheckpointError(f"entry {key!r} cannot be held by a checkpoint: {_not_json(leaf)}") from None
    if not _same_json(leaf, back):
        raise CheckpointError(f"entry {key!r} would not come back as it is from JSON ({leaf!r:.200} reads back "
                              f"as {back!r:.200}): {_not_json(leaf)}")
    return leaf


JSON_TYPES = "JSON values: None, bool, int, float, str, and lists and dicts of them with str keys"


def _not_json(value: Any) -> str:
    """Why JSON would not give `value` back as it is: its first part whose type is not JSON's own (a numpy
    scalar or an IntEnum is written as a number and reads back as a plain int or float).

    >>> _not_json([0.1, {"lr": 0.1, 3: "a"}])
    'dict key 3 is a int: dict keys must be strings'
    """
    pending = [value]
    while pending:
        v = pending.pop()
        if isinstance(v, (dict, list, tuple)):
            if isinstance(v, dict):
                bad = [k for k in v if type(k) is not str]
                if bad:
                    return f"dict key {bad[0]!r} is a {type(bad[0]).__name__}: dict keys must be strings"
            pending.extend(reversed(list(v.values() if isinstance(v, dict) else v)))
        elif v is not None and type(v) not in (bool, int, float, str):
            kind = type(v).__qualname__ if type(v).__module__ == "builtins" else \
                f"{type(v).__module__}.{type(v).__qualname__}"
            return f"{v!r:.80} is a {kind}, not a JSON type (valid: {JSON_TYPES})"
    return f"JSON cannot write it (valid: {JSON_TYPES})"


def _same_json(value: Any, back: Any) -> bool:
    """Whether `back` (read from JSON) is `value`, tuples read as lists (`like` restores them) and nan
    equal to itself; dict keys must be the same strings."""
    if isinstance(value, dict):
        return isinstance(back, dict) and list(value) == list(back) and all(
            _same_json(v, back[k]) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return isinstance(back, list) and len(back) == len(value) and all(map(_same_json, value, back))
    if isinstance(value, float) and value != value:
        return isinstance(back, float) and back != back
    return type(value) is type(back) and value == back


def like(value: Any, template: Any) -> Any:
    """A JSON value read back, with the tuples of the state_dict entry it replaces restored (an optimizer's
    ``betas=(0.9, 0.999)`` stays a tuple).

    >>> like([0.9, 0.99], (0.0, 0.0))
    (0.9, 0.99)
    """
    if isinstance(value, list) and isinstance(template, (list, tuple)):
        items = [like(v, template[i] if i < len(template) else None) for i, v in enumerate(value)]
        return tuple(items) if isinstance(template, tuple) else items
    if isinstance(value, dict) and isinstance(template, dict):
        return {k: like(v, template.get(k)) for k, v in value.items()}
    return value


def check_tuple_slot(key: str, container: Any) -> None:
    """Loading replaces JSON values in their container: a tuple cannot be filled in place."""
    if isinstance(container, tuple):
        raise CheckpointError(f"entry {key!r} sits in a tuple of the state_dict, which load cannot fill in "
                              f"place; make that container a list")


# ---- blocks -----------------------------------------------------------------------------------------

def reduced(x: GlobalTensor) -> GlobalTensor:
    """`x` without Partial axes (each `P(op)` made `B`, a collective): checkpoints hold reduced values.

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     return reduced(sbp.from_local(torch.ones(2), mesh, "P(sum)", global_shape=(2,))).to_local().tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [[2.0, 2.0], [2.0, 2.0]]
    """
    if not any(isinstance(p, Partial) for p in x.placements):
        return x
    return redistribute_raw(x, tuple(Broadcast() if isinstance(p, Partial) else p for p in x.placements))


def writers(x: GlobalTensor) -> dict[Block, tuple[int, ...]]:
    """{block: the coord that writes it}: each distinct non-empty block once, by its first holder (row-major).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: writers(sbp.zeros((4,), mesh, "S(0), B")), (2, 2))[0]
    {((0, 2),): (0, 0), ((2, 4),): (1, 0)}
    """
    mesh, shape, pls = x.mesh, tuple(x.shape), x.placements
    out: dict[Block, tuple[int, ...]] = {}
    for c in mesh.coords():
        b = block(shape, mesh.shape, pls, c)
        if block_numel(b) and b not in out:
            out[b] = c
    return out


def target_block(target: torch.Tensor, *, zero: bool = True) -> tuple[Optional[torch.Tensor], Optional[Block]]:
    """(the local tensor to fill, its block of the global tensor) for a load target; (None, None) when this
    rank fills nothing (outside the mesh; a `P(sum)` axis away from coord 0: its local is zeroed here,
    unless `zero` is False -- the checks before the first write change nothing).

    >>> target_block(torch.zeros(2, 3))[1]
    ((0, 2), (0, 3))
    """
    if not isinstance(target, GlobalTensor):
        return target, tuple((0, n) for n in target.shape)
    mesh, coord = target.mesh, target.mesh.coord
    if coord is None:
        return None, None
    if not sum_holds_value(mesh, target.placements, coord):  # P(sum) holds the value at coord 0 only
        if zero:
            with torch.no_grad():
                target._local.zero_()
        return None, None
    return target._local, block(tuple(target.shape), mesh.shape, target.placements, coord)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A compact CPU copy of `t` for writing (`torch.save` would write a view's whole storage): a device
    tensor is copied straight to the host, never cloned on the device first.

    >>> base = torch.arange(6.)
    >>> host_copy(base[2:4]).untyped_storage().nbytes()
    8
    """
    t = t.detach()
    return t.to("cpu", copy=True).contiguous() if t.device.type == "cpu" else t.contiguous().to("cpu")


def host_barrier(mesh: DeviceMesh, failed: bool = False) -> int:
    """Return only once every rank of `mesh` has reached this call: an all_reduce on the mesh's device whose
    result is read on the host (on NCCL a collective returns once queued; reading it waits for it). The same
    all_reduce counts the ranks that pass `failed` (a save step that failed there): the count is returned,
    so every rank can raise at once instead of waiting for a rank that will never come.

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: host_barrier(mesh, failed=mesh.rank == 1), (3,))
    [1, 1, 1]
    """
    comm = mesh.binding
    row = torch.tensor([1, int(failed)], dtype=torch.int64, device=comm_device(mesh))
    done, failures = comm.all_reduce(row, tuple(range(mesh.ndim)), "sum").tolist()
    if done != mesh.size():
        raise CheckpointError(f"save: the closing barrier counted {done} ranks, not the mesh's {mesh.size()}")
    return failures


def agree_max(mesh: Optional[DeviceMesh], n: int) -> int:
    """The largest `n` any rank of `mesh` passes (one all_reduce of one int64; `n` itself without a mesh).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: agree_max(mesh, mesh.rank * 10), (3,))
    [20, 20, 20]
    """
    if mesh is None:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=comm_device(mesh))
    return int(mesh.binding.all_reduce(t, tuple(range(mesh.ndim)), "max").item())


def _save_fields(found: dict[str, tuple[Any, Any, Any]]) -> dict[str, Any]:
    """What every rank of a save must pass alike: the keys, the tensors' layouts, the JSON values."""
    layouts, values = {}, {}
    for key, (leaf, _, _) in found.items():
        if isinstance(leaf, torch.Tensor):
            where = repr(tuple(leaf.placements)) if isinstance(leaf, GlobalTensor) else "plain"
            layouts[key] = (tuple(leaf.shape), dtype_name(leaf.dtype), where)
        else:
            values[key] = leaf
    return {"keys": list(found), "tensor layouts": layouts, "JSON values": values}


def save_digest(found: dict[str, tuple[Any, Any, Any]]) -> int:
    """A 56-bit digest of a save's keys, tensor layouts and JSON values (an int64 for a collective).

    >>> save_digest(leaves({"step": 1})) == save_digest(leaves({"step": 1})) != save_digest(leaves({"step": 2}))
    True
    """
    return digest(_save_fields(found))


def refuse_disagreement(mesh: DeviceMesh, found: dict[str, tuple[Any, Any, Any]]) -> None:
    """Every rank of `mesh` has seen that the ranks' `save_digest`s differ: one all_gather of one digest per
    field (and one of their texts) names the ranks and what differs, in the `sbp.RankMismatchError` every
    rank raises."""
    gather, members = mesh_gather(mesh)
    agree(gather, members, "save", _save_fields(found), device=comm_device(mesh))
    raise RankMismatchError("save: the ranks' state_dicts differ (every rank must pass the same keys, layouts "
                            "and JSON values; SPMD)")   # pragma: no cover - agree named them and raised


def agree_save(mesh: Optional[DeviceMesh], found: dict[str, tuple[Any, Any, Any]], n: int,
               failed: bool = False) -> tuple[int, bool]:
    """(the largest `n` any rank of `mesh` passes, whether any rank passes `failed`) -- `(n, failed)` without
    a mesh -- in one all_reduce of 4 int64 that also checks that every rank saves the same keys, tensor
    layouts and JSON values: the ranks' `save_digest` and its negation ride along, so the maximum gives its
    maximum and minimum. Where they differ, every rank sees it and `refuse_disagreement` names the ranks.

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: agree_save(mesh, leaves({"step": 1}), mesh.rank * 10), (3,))
    [(20, False), (20, False), (20, False)]
    >>> sbp.testing.spmd(lambda mesh: agree_save(mesh, leaves({"step": mesh.rank}), 0), (2,))
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.testing.spmd.SpmdError: ... disagree on JSON values ...: {'step': 0} on ranks [0]; {'step': 1} on ranks [1]
    """
    if mesh is None:
        return n, failed
    d = save_digest(found)
    row = torch.tensor([n, d, -d, int(failed)], dtype=torch.int64, device=comm_device(mesh))
    top, high, low, failures = mesh.binding.all_reduce(row, tuple(range(mesh.ndim)), "max").tolist()
    if high != -low:
        refuse_disagreement(mesh, found)
    return top, bool(failures)


def target_meshes(found: dict[str, tuple[Any, Any, Any]]) -> list[DeviceMesh]:
    """The distinct meshes of the global tensors among `found` (from `leaves`), in key order: the meshes a
    load agrees over (a state dict being loaded may span several).

    >>> target_meshes(leaves({"w": torch.ones(1)}))
    []
    """
    out: list[DeviceMesh] = []
    for leaf, _, _ in found.values():
        if isinstance(leaf, GlobalTensor) and leaf.mesh not in out:
            out.append(leaf.mesh)
    return out


def agree_loaded(meshes: "DeviceMesh | list[DeviceMesh] | None", path: str, error: Optional[BaseException],
                 read: int = 0) -> None:
    """After a load's checks and before its first write: every rank learns whether any rank of its meshes
    failed its checks (one all_reduce of 3 int64 per mesh) and then all raise together -- a failing
    rank its own error, the others a `CheckpointError` naming the failing ranks with the first one's
    message (an all_gather of the messages, only then). The same all_reduce compares `read`, a digest of
    what each rank read (`digest` of the metadata's SHA-256): ranks that read different saves (another job
    committed between their reads) all raise, so a load never mixes two saves. Without a mesh (plain
    state dicts) a rank just raises its own error.

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     agree_loaded(mesh, "ckpt", CheckpointError("file 'x' is corrupt") if mesh.rank == 1 else None)
    >>> sbp.testing.spmd(fn, (3,))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.testing.spmd.SpmdError: rank 0 of 3 raised CheckpointError: load of 'ckpt' failed on rank 1 ...
    """
    meshes = [] if meshes is None else [meshes] if isinstance(meshes, DeviceMesh) else meshes
    joined = [mesh for mesh in meshes if mesh.coord is not None]
    failing = []   # the meshes where some rank failed: every member of a mesh finds the same
    mixed = False
    for mesh in joined:
        row = torch.tensor([int(error is not None), read, -read], dtype=torch.int64, device=comm_device(mesh))
        failed, high, low = mesh.binding.all_reduce(row, tuple(range(mesh.ndim)), "max").tolist()
        if failed:
            failing.append(mesh)
        mixed = mixed or high != -low
    messages: dict[int, str] = {}
    text = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:MESSAGE_BYTES]
    for mesh in failing:
        gather, members = mesh_gather(mesh)
        buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device="cpu")   # built on the host, then moved
        if text:
            buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        for rank, got in zip(members, gather(buf.to(comm_device(mesh)))):
            message = bytes(got.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
            if message:   # a failing rank's message is never empty: "<type>: <text>"
                messages[rank] = message
    if error is not None:
        raise error
    if mixed and not messages:
        raise CheckpointError(f"load of {path!r}: the ranks read different saves (another save committed during "
                              f"the load; no rank's state_dict was changed); load again once the save is done")
    if messages:
        failed = sorted(messages)
        which = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
        raise CheckpointError(f"load of {path!r} failed on {which} (no rank's state_dict was changed); "
                              f"rank {failed[0]}: {messages[failed[0]]}")


# ---- files ----------------------------------------------------------------------------------------------

def as_path(call: str, path: Any) -> str:
    """`path` as a str; anything but a non-empty str or `os.PathLike` of one is refused.

    >>> as_path("save", 5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.values.errors.CheckpointError: save: path must be a str or os.PathLike naming the ..., got int (5)
    """
    if isinstance(path, (str, os.PathLike)):
        found = os.fspath(path)
        if isinstance(found, str) and found:
            return found
        what = repr(found)
    else:
        what = f"{type(path).__name__} ({path!r:.60})"
    raise CheckpointError(f"{call}: path must be a str or os.PathLike naming the checkpoint directory, got {what}")


def last_generation(path: str) -> int:
    """The highest generation number among the ``gen-*`` data directories in `path` (0 when none).

    >>> import tempfile; last_generation(tempfile.mkdtemp())
    0
    """
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    return max((int(m.group(1)) for m in map(GENERATION.fullmatch, names) if m), default=0)


def retire_others(path: str, kept: str, data: Optional[str] = None) -> None:
    """After a save of format `kept` committed in directory `path`: remove the other formats' commit files
    in `COMMITS` (so the newest save is what `sbp.load` reads), then the data no commit names any more --
    ``gen-*`` directories but `data`, and the files in `SAVE_DATA`. Only names saves write are touched;
    anything else in the directory is left alone.

    >>> import os, tempfile
    >>> path = tempfile.mkdtemp()
    >>> for name in (".metadata", "__0_0.distcp", "metadata.json", "notes.txt"):
    ...     open(os.path.join(path, name), "w").close()
    >>> retire_others(path, "safetensors"); sorted(os.listdir(path))
    ['notes.txt']
    """
    if any([_remove(os.path.join(path, name)) for kind, name in COMMITS.items() if kind != kept]):
        fsync_dir(path)   # the older commit is gone for good before its data goes
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name != data and GENERATION.fullmatch(name) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif SAVE_DATA.fullmatch(name):
            _remove(full)


def _remove(file: str) -> bool:
    """Remove `file` if it is there; whether it was removed."""
    try:
        if os.path.isfile(file):
            os.remove(file)
            return True
    except OSError:
        pass
    return False


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory `path` durable (a no-op where directories cannot be opened).

    >>> import tempfile; fsync_dir(tempfile.gettempdir())
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def dtype_name(dtype: torch.dtype) -> str:
    """torch's dtype name without the prefix.

    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    """
    return str(dtype).removeprefix("torch.")
