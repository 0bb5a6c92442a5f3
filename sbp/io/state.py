"""What every checkpoint format shares: flattening state dicts to dotted keys, the blocks each rank holds
and writes, Partial reduction before saving, filling a target tensor's block, and the host barrier.

The sbp format (`sbp.io.checkpoint`), DCP (`sbp.io.dcp`) and safetensors (`sbp.io.safetensors`) all see a
state dict the same way: nested dicts and lists holding tensors are walked, keys joined by ``.``
(``optim.state.0.exp_avg``, the names DCP gives the same nesting); anything holding no tensor is one
JSON leaf (an optimizer's ``param_groups``).
"""
from __future__ import annotations

import collections
import errno
import json
import os
import re
import shutil
from contextlib import contextmanager
from typing import Any, Iterator, NoReturn, Optional

import torch

from ..runtime.agreement import agree, digest, mesh_gather
from ..runtime.backends.base import comm_device
from ..tensor.global_tensor import GlobalTensor, redistribute_raw, sum_holds_value
from ..values.errors import CheckpointError, RankMismatchError
from ..values.layout import Block, block, block_numel
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: saves are not serialised (see `save_lock`)
    fcntl = None

Leaf = Any  # a tensor, or a JSON value (int, float, str, bool, None, lists and dicts of them)

GENERATION = re.compile(r"gen-(\d{8})")   # a save's data directory (the sbp format's and DCP's)
# the commit files a save of another format removes: `sbp.load` prefers metadata.json, then .metadata, then
# model.safetensors, so a safetensors file (perhaps a transformers model's own) never hides a newer save
COMMITS = {"sbp": "metadata.json", "dcp": ".metadata"}
# besides generation directories, what saves write and a later save may remove once it has committed:
# version-1 sbp rank files, DCP data files written flat (by DTensor code, or sbp before generations), temporaries
SAVE_DATA = re.compile(r"rank\d{5}\.pt(\.tmp)?|__\d+_\d+\.distcp|\.metadata(\.json)?\.tmp|model\.safetensors\.tmp")
MESSAGE_BYTES = 2048   # per rank in the gather that tells every rank why a save or load failed (only when one did)
SAVE_LOCK = ".sbp-save.lock"   # held (flock) by a save's coord 0 while the save runs; removed when it ends


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
    """`leaf` if JSON gives it back unchanged (tuples read back as lists; a namedtuple or a ``torch.Size``
    as a list too, which `like` rebuilds in the state dict's type), else a `CheckpointError` naming the
    first part that would change and its type.

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


def json_values(found: dict) -> tuple[dict, Optional[CheckpointError]]:
    """The JSON values among a state dict's leaves (`leaves`), or the first refusal: a save carries it in its
    first collective, so no rank raises alone while the others wait.

    >>> json_values({"epoch": (3, None, None), "cfg": ({1: "a"}, None, None)})[1] is not None
    True
    """
    try:
        return {key: json_value(key, leaf) for key, (leaf, _, _) in found.items()
                if not isinstance(leaf, torch.Tensor)}, None
    except CheckpointError as e:
        return {}, e


JSON_TYPES = "JSON values: None, bool, int, float, str, and lists and dicts of them with str keys"
SEQUENCES = "list, tuple, a namedtuple or torch.Size (rebuilt in the type the loading state_dict holds)"


def _is_namedtuple(kind: type) -> bool:
    """Whether `kind` is a namedtuple class (``collections.namedtuple`` or ``typing.NamedTuple``).

    >>> import collections; _is_namedtuple(collections.namedtuple("Cfg", "hidden")), _is_namedtuple(tuple)
    (True, False)
    """
    return issubclass(kind, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_make")


def _kept_sequence(kind: type) -> bool:
    """Whether a list or tuple of type `kind` comes back as such: plain ones, and the tuple types `like`
    rebuilds from the loading state dict (a namedtuple, ``torch.Size``)."""
    return kind in (list, tuple, torch.Size) or _is_namedtuple(kind)


def _type_name(v: Any) -> str:
    kind = type(v)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _not_json(value: Any) -> str:
    """Why JSON would not give `value` back as it is: its first part whose type is not JSON's own (a numpy
    scalar or an IntEnum is written as a number and reads back as a plain int or float; a tuple subclass
    other than a namedtuple or ``torch.Size`` as a plain list), and where it is inside `value`.

    >>> _not_json([0.1, {"lr": 0.1, 3: "a"}])
    'at [1]: dict key 3 is a int: dict keys must be strings'
    """
    pending: list[tuple[Any, str]] = [(value, "")]
    while pending:
        v, path = pending.pop()
        at = f"at {path}: " if path else ""
        if isinstance(v, (list, tuple)) and not _kept_sequence(type(v)):
            base = "tuple" if isinstance(v, tuple) else "list"
            return (f"{at}{v!r:.80} is a {_type_name(v)}, a {base} subclass that reads back as a plain list (valid "
                    f"sequences: {SEQUENCES})")
        if isinstance(v, dict) and type(v) not in (dict, collections.OrderedDict):
            return (f"{at}{v!r:.80} is a {_type_name(v)}, a dict subclass that reads back as a plain dict (valid "
                    f"mappings: dict, OrderedDict)")
        if isinstance(v, dict):
            bad = [k for k in v if type(k) is not str]
            if bad:
                return f"{at}dict key {bad[0]!r} is a {type(bad[0]).__name__}: dict keys must be strings"
            pending.extend(reversed([(x, f"{path}[{k!r}]") for k, x in v.items()]))
        elif isinstance(v, (list, tuple)):
            pending.extend(reversed([(x, f"{path}[{i}]") for i, x in enumerate(v)]))
        elif v is not None and type(v) not in (bool, int, float, str):
            return f"{at}{v!r:.80} is a {_type_name(v)}, not a JSON type (valid: {JSON_TYPES})"
    return f"JSON cannot write it (valid: {JSON_TYPES})"


def _same_json(value: Any, back: Any) -> bool:
    """Whether `back` (read from JSON) is `value`, tuples read as lists (`like` restores them) and nan
    equal to itself; dict keys must be the same strings."""
    if isinstance(value, dict):   # (a Counter, a defaultdict would read back as plain dicts)
        return type(value) in (dict, collections.OrderedDict) and isinstance(back, dict) and \
            list(value) == list(back) and all(
            _same_json(v, back[k]) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return _kept_sequence(type(value)) and isinstance(back, list) and len(back) == len(value) and \
            all(map(_same_json, value, back))
    if isinstance(value, float) and value != value:
        return isinstance(back, float) and back != back
    return type(value) is type(back) and value == back


def like(key: str, value: Any, template: Any) -> Any:
    """A JSON value read back for entry `key`, rebuilt in the types of the state_dict entry it replaces: a
    list where the entry has a tuple comes back a tuple (an optimizer's ``betas=(0.9, 0.999)``), a
    namedtuple or a ``torch.Size`` as that type. The type comes from the loading state dict, never from
    the file (nothing is imported); a list that type cannot take is a `CheckpointError`.

    >>> like("betas", [0.9, 0.99], (0.0, 0.0))
    (0.9, 0.99)
    >>> like("shape", [4, 2], torch.Size([0, 0]))
    torch.Size([4, 2])
    """
    if isinstance(value, list) and isinstance(template, (list, tuple)):
        items = [like(key, v, template[i] if i < len(template) else None) for i, v in enumerate(value)]
        return items if isinstance(template, list) else _rebuilt(key, type(template), items)
    if isinstance(value, dict) and isinstance(template, dict):
        return {k: like(key, v, template.get(k)) for k, v in value.items()}
    return value


def _rebuilt(key: str, kind: type, items: list) -> tuple:
    """`items` as a `kind` (tuple, a namedtuple or torch.Size: the type the loading state dict holds)."""
    if kind is tuple:
        return tuple(items)
    if kind is torch.Size:
        if all(type(n) is int for n in items):
            return torch.Size(items)
        why = "a torch.Size holds ints"
    elif _is_namedtuple(kind):
        if len(items) == len(kind._fields):
            return kind._make(items)
        why = f"its fields are {kind._fields}"
    else:
        why = f"load rebuilds no other tuple subclass (valid: {SEQUENCES})"
    raise CheckpointError(f"entry {key!r}: the checkpoint holds {items!r:.80} where the state_dict holds a "
                          f"{kind.__module__}.{kind.__qualname__}, which cannot be rebuilt from it: {why}")


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


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def _unheld_kind(t: torch.Tensor, dtensor: bool) -> Optional[str]:
    """What makes `t` (not a global tensor) a tensor no checkpoint format here holds or fills, or None."""
    if _is_dtensor(t):
        return None if dtensor else ("a torch DTensor, which this format does not hold: make it an sbp global "
                                     "tensor (sbp.from_dtensor), or use format='dcp', which holds DTensors")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return (f"a {_type_name(t)}, a tensor subclass checkpoints do not hold (valid: sbp global tensors, "
                f"plain dense tensors, nn.Parameter)")
    if t.is_nested:
        return "a nested tensor, which checkpoints do not hold"
    if t.layout != torch.strided:
        return f"a tensor of layout {t.layout}, which checkpoints do not hold (make it dense: .to_dense())"
    if t.is_quantized:
        return "a quantized tensor, which checkpoints do not hold (save its dequantize() or int_repr())"
    return None


def unsaved_tensors(found: dict[str, tuple[Any, Any, Any]], *, dtensor: bool = False) -> Optional[CheckpointError]:
    """The refusal of the first tensor among a state dict's leaves (`leaves`) that a save cannot write so that
    it loads back: a nested, sparse or quantized tensor, a tensor subclass (a torch DTensor unless `dtensor`:
    the sbp and safetensors formats would write one rank's shard as the whole tensor), one on the meta device
    (no data). None when every tensor can be saved. A save carries it in its first collective, like
    `json_values`' refusals: every rank raises, nothing is written.

    >>> unsaved_tensors(leaves({"w": torch.ones(2)})) is None
    True
    >>> print(unsaved_tensors(leaves({"s": torch.eye(2).to_sparse()})))
    tensor 's' is a tensor of layout torch.sparse_coo, which checkpoints do not hold (make it dense: .to_dense())
    """
    for key, (leaf, _, _) in found.items():
        if not isinstance(leaf, torch.Tensor):
            continue
        if isinstance(leaf, GlobalTensor):
            why = None
            local = leaf._local if leaf.mesh.coord is not None else None
        else:
            why, local = _unheld_kind(leaf, dtensor), leaf
        if why is None and local is not None and local.is_meta:
            why = ("on the meta device: it has no data to save (a model built on the meta device needs to_empty "
                   "and its init first)")
        if why is not None:
            return CheckpointError(f"tensor {key!r} is {why}")
    return None


def check_target(key: str, target: torch.Tensor, *, dtensor: bool = False) -> None:
    """Refuse, before a load writes anything, a state_dict tensor the load could not fill in place: one on
    the meta device (no storage: writes into it are no-ops, so the load would return having loaded
    nothing), one whose elements share memory (an ``expand``: torch refuses the write), an inference
    tensor outside ``torch.inference_mode()`` (likewise), a nested, sparse or quantized tensor or a tensor
    subclass (a torch DTensor unless `dtensor`: DCP fills those itself). Each would otherwise fail or load
    nothing only after other keys were written. A global tensor is checked by this rank's local tensor
    (none outside its mesh).

    >>> check_target("w", torch.zeros(2))
    >>> check_target("w", torch.empty(2, device="meta"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.values.errors.CheckpointError: tensor 'w': the state_dict's tensor is on the meta device (no storage), ...
    """
    if isinstance(target, GlobalTensor):
        if target.mesh.coord is None:
            return
        target = target._local
    else:
        why = _unheld_kind(target, dtensor)
        if why is not None:
            raise CheckpointError(f"tensor {key!r}: the state_dict's tensor is {why}")
        if _is_dtensor(target):
            return   # (DCP fills its local tensor itself)
    if target.is_meta:
        raise CheckpointError(f"tensor {key!r}: the state_dict's tensor is on the meta device (no storage), so "
                              f"sbp.load could not fill it in place and would load nothing into it; give it "
                              f"storage first (model.to_empty(device=...)), then take the state_dict and load")
    if torch._debug_has_internal_overlap(target) == 1:   # torch refuses writes there
        raise CheckpointError(f"tensor {key!r}: the state_dict's tensor shares memory between its elements (an "
                              f"expand); sbp.load writes into it in place: give it a tensor of its own (.clone())")
    if target.is_inference() and not torch.is_inference_mode_enabled():
        raise CheckpointError(f"tensor {key!r}: the state_dict's tensor is an inference tensor (made under "
                              f"torch.inference_mode()), which torch lets nothing write in place outside "
                              f"inference mode; load inside torch.inference_mode(), or make the tensor outside it")


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


def _save_fields(found: dict[str, tuple[Any, Any, Any]], path: str) -> dict[str, Any]:
    """What every rank of a save must pass alike: the path, the keys, the tensors' layouts, the JSON values.
    The keys' order counts (a save reduces `Partial` tensors in it, one collective each); the JSON values
    are compared with each dict's items in key order (`_in_key_order`): no collective depends on it."""
    layouts, values = {}, {}
    for key, (leaf, _, _) in found.items():
        if isinstance(leaf, torch.Tensor):
            where = repr(tuple(leaf.placements)) if isinstance(leaf, GlobalTensor) else "plain"
            layouts[key] = (tuple(leaf.shape), dtype_name(leaf.dtype), where)
        else:
            values[key] = leaf
    return {"path": path, "keys": list(found), "tensor layouts": layouts, "JSON values": _in_key_order(values)}


def _in_key_order(value: Any) -> Any:
    """`value` with the items of every dict in it in key order: equal dicts built in another order (from a set
    of strings, whose order each process's hash seed changes) compare equal across ranks.

    >>> _in_key_order({"b": [{"y": 1, "x": 2}], "a": 0})
    {'a': 0, 'b': [{'x': 2, 'y': 1}]}
    """
    if isinstance(value, dict):
        return {k: _in_key_order(value[k]) for k in sorted(value, key=repr)}
    if type(value) in (list, tuple):
        return type(value)(_in_key_order(v) for v in value)
    return value


def save_digest(found: dict[str, tuple[Any, Any, Any]], path: str) -> int:
    """A 56-bit digest of a save's path, keys, tensor layouts and JSON values (an int64 for a collective).

    >>> one = leaves({"step": 1})
    >>> save_digest(one, "a") == save_digest(one, "a") != save_digest(one, "b")
    True
    """
    return digest(_save_fields(found, path))


def refuse_disagreement(mesh: DeviceMesh, found: dict[str, tuple[Any, Any, Any]], path: str) -> None:
    """Every rank of `mesh` has seen that the ranks' `save_digest`s differ: one all_gather of one digest per
    field (and one of their texts) names the ranks and what differs, in the `sbp.RankMismatchError` every
    rank raises."""
    gather, members = mesh_gather(mesh)
    agree(gather, members, "save", _save_fields(found, path), device=comm_device(mesh))
    raise RankMismatchError("save: the ranks' calls differ (every rank must pass the same path, keys, layouts "
                            "and JSON values; SPMD)")   # pragma: no cover - agree named them and raised


def agree_save(mesh: Optional[DeviceMesh], found: dict[str, tuple[Any, Any, Any]], path: str, n: int,
               failed: bool = False) -> tuple[int, bool]:
    """(the largest `n` any rank of `mesh` passes, whether any rank passes `failed`) -- `(n, failed)` without
    a mesh -- in one all_reduce of 4 int64, a save's first collective, that also checks that every rank
    saves to the same path the same keys, tensor layouts and JSON values: the ranks' `save_digest` and its
    negation ride along, so the maximum gives its maximum and minimum. Where they differ, every rank sees
    it and `refuse_disagreement` names the ranks. A rank that refuses its save before this still joins it,
    so the others learn of it instead of waiting (`raise_together`).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: agree_save(mesh, leaves({"step": 1}), "ckpt", mesh.rank * 10), (3,))
    [(20, False), (20, False), (20, False)]
    >>> sbp.testing.spmd(lambda mesh: agree_save(mesh, leaves({"step": mesh.rank}), "ckpt", 0), (2,))
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.testing.spmd.SpmdError: ... disagree on JSON values ...: {'step': 0} on ranks [0]; {'step': 1} on ranks [1]
    """
    if mesh is None:
        return n, failed
    d = 0 if failed else save_digest(found, path)   # (a rank that failed may hold what the digest cannot take)
    row = torch.tensor([n, d, -d, int(failed)], dtype=torch.int64, device=comm_device(mesh))
    top, high, low, failures = mesh.binding.all_reduce(row, tuple(range(mesh.ndim)), "max").tolist()
    if high != -low and not failures:   # a failure is reported first: its digest stood for nothing
        refuse_disagreement(mesh, found, path)
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
    for mesh in failing:
        messages |= _messages(mesh, error)
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


def _messages(mesh: DeviceMesh, error: Optional[BaseException]) -> dict[int, str]:
    """{rank: "<type>: <message>"} of the ranks of `mesh` that pass an `error`: one all_gather of
    `MESSAGE_BYTES` per rank, made only once every rank knows that some rank failed."""
    gather, members = mesh_gather(mesh)
    text = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:MESSAGE_BYTES]
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device="cpu")   # built on the host, then moved
    if text:
        buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    out = {}
    for rank, got in zip(members, gather(buf.to(comm_device(mesh)))):
        message = bytes(got.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
        if message:   # a failing rank's message is never empty: "<type>: <text>"
            out[rank] = message
    return out


def raise_together(mesh: Optional[DeviceMesh], path: str, error: Optional[BaseException]) -> NoReturn:
    """Every rank of `mesh` has learnt from a save's first collective that some rank refused the save
    before writing anything (a value JSON would change, a dtype the format cannot hold, a directory coord
    0 cannot lock): the refusing ranks raise their own error, the others a `CheckpointError` naming the
    first refusing rank and its message (an all_gather of the messages, only now).

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     error = CheckpointError("entry 'best' is bad") if mesh.rank == 1 else None
    ...     if agree_save(mesh, {}, "ckpt", 0, error is not None)[1]:
    ...         raise_together(mesh, "ckpt", error)
    >>> sbp.testing.spmd(fn, (3,))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sbp.testing.spmd.SpmdError: rank 0 of 3 raised CheckpointError: save of 'ckpt' failed on rank 1 ...
    """
    messages = {} if mesh is None else _messages(mesh, error)
    if error is not None:
        raise error
    failed = sorted(messages)
    which = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {failed}"
    raise CheckpointError(f"save of {path!r} failed on {which} before anything was written (the previous "
                          f"checkpoint is unchanged); rank {failed[0]}: {messages[failed[0]]}")


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
    """The highest generation number among the ``gen-*`` data directories in `path` (0 when none). Where
    `path` exists but cannot be listed (EIO; a directory with write but no read permission), the generation
    its commit files name (read by name, as `sbp.load` reads them): a save never picks the committed
    checkpoint's own data directory, whose files it would replace.

    >>> import tempfile; last_generation(tempfile.mkdtemp())
    0
    """
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    except OSError:
        names = []
        for commit in COMMITS.values():   # metadata.json names "gen-N"; DCP's .metadata "gen-N/__0_0.distcp"
            try:
                with open(os.path.join(path, commit), "rb") as f:
                    names += [m.decode() for m in re.findall(rb"gen-\d{8}", f.read())]
            except OSError:
                pass
    return max((int(m.group(1)) for m in map(GENERATION.fullmatch, names) if m), default=0)


@contextmanager
def save_lock(directory: str, hold: bool) -> Iterator[Optional[CheckpointError]]:
    """One save at a time per directory. Where `hold` (the save's coord 0, which commits), the body runs
    holding an exclusive `flock` on ``directory/.sbp-save.lock`` (the directory is made if needed), and
    the file is removed when the body ends. Yields None, or the `CheckpointError` that refuses this save
    -- another save (another job) holds the lock, or the directory cannot be made -- which the caller
    carries in its first collective so that every rank raises (`raise_together`) before anything is
    written. The lock dies with its process: a killed save leaves nothing that blocks the next one.
    Where the filesystem has no locks, saves are not serialised.

    >>> import os, tempfile
    >>> path = tempfile.mkdtemp()
    >>> with save_lock(path, True) as first:
    ...     with save_lock(path, True) as second:
    ...         pass
    >>> first is None, str(second).startswith("save: another save into"), os.listdir(path)
    (True, True, [])
    """
    fd, error = None, None
    if hold:
        try:
            fd = _lock(directory)
        except CheckpointError as e:
            error = e
    try:
        yield error
    finally:
        if fd is not None:   # removed while still held: no other save can have locked this file meanwhile
            _remove(os.path.join(directory, SAVE_LOCK))
            os.close(fd)


def _lock(directory: str) -> Optional[int]:
    """The descriptor of ``directory/.sbp-save.lock``, locked; None where the filesystem has no locks."""
    file = os.path.join(directory, SAVE_LOCK)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"save: cannot create the checkpoint directory {directory!r}: {e}") from e
    if fcntl is None:  # pragma: no cover
        return None
    while True:
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(f"save: cannot create {file!r}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"save: another save into {directory!r} is in progress (its coord 0 holds "
                                      f"{SAVE_LOCK}); saves into one directory must not overlap: save again once "
                                      f"it is done, or into another directory") from None
            return None   # (ENOLCK, EOPNOTSUPP...): a filesystem without locks
        try:
            current = os.path.samestat(os.fstat(fd), os.stat(file))
        except OSError:
            current = False
        if current:
            return fd
        os.close(fd)   # its holder removed the file after this open: lock the file there now


def retire_others(path: str, kept: str, data: Optional[str] = None) -> None:
    """After a save of format `kept` committed in directory `path`: remove the other formats' commit files
    in `COMMITS` (so the newest save is what `sbp.load` reads), then the data no commit names any more --
    ``gen-*`` directories but `data`, and the files in `SAVE_DATA`. Only names saves write are touched;
    anything else in the directory is left alone. The save is committed when this runs: a removal or a
    listing that fails is skipped, never raised (a save reporting failure after its commit, while the other
    ranks wait at its closing barrier), and the next save removes what is left.

    >>> import os, tempfile
    >>> path = tempfile.mkdtemp()
    >>> for name in (".metadata", "__0_0.distcp", "metadata.json", "notes.txt"):
    ...     open(os.path.join(path, name), "w").close()
    >>> retire_others(path, "safetensors"); sorted(os.listdir(path))
    ['notes.txt']
    """
    if any([_remove(os.path.join(path, name)) for kind, name in COMMITS.items() if kind != kept]):
        fsync_dir(path)   # the older commit is gone for good before its data goes
    try:
        names = os.listdir(path)
    except OSError:   # (EIO, EACCES...): the leftovers stay until a later save can list them
        return
    for name in names:
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
