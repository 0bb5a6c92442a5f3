"""`x[index] = value` where the index narrows a split dim: every rank writes the part of the region that
lies in its own block, in place, with no communication (the value is broadcast to the region's shape
first; a global value is gathered with `full()`).

torch runs ``x[1:3] = v`` as a view (``aten.slice``) and a write into it (``copy_`` / ``fill_``). Slicing a
split dim cannot stay a view of the local block (the slice's blocks are not balanced splits), so that
route would write into a copy and is refused; this module writes the blocks directly instead. Basic
indices only -- ints, slices with a positive step, ``None`` and ``...``; tensor, list and bool indices
keep torch's route. On a `P(sum)` axis the rank at coord 0 writes the value and the others write zeros
(the value stays the sum); on `P(max|min)` and `B` axes every rank writes it. When the tensor or the value
requires grad, the write is an autograd function (`sbp.tensor.autograd.write_blocks_autograd`), as torch's
in-place writes are.

>>> import torch, sbp, sbp.testing
>>> def fn(mesh):
...     x = sbp.distribute(torch.zeros(4, 3), mesh, "S(0)")
...     x[1:3, 0] = torch.tensor([5., 6.])
...     return x.to_local().tolist()
>>> sbp.testing.spmd(fn, (2,))
[[[0.0, 0.0, 0.0], [5.0, 0.0, 0.0]], [[6.0, 0.0, 0.0], [0.0, 0.0, 0.0]]]
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch

from ..values.errors import DTypeError, SbpError, ShapeError, torch_alike
from ..values.layout import block, splitters
from ..values.placement import Partial


def basic_entries(index: Any, ndim: int) -> Optional[tuple]:
    """`index` as ints, slices and ``None`` with ``...`` expanded and every dim named; None when the index
    is not basic (a tensor, list or bool), a slice step is not positive, or it names too many dims.

    >>> basic_entries((1, ...), 3)
    (1, slice(None, None, None), slice(None, None, None))
    >>> basic_entries(torch.tensor([1]), 2) is None
    True
    """
    items = index if isinstance(index, tuple) else (index,)
    out: list = []
    for item in items:
        if item is None or item is Ellipsis:
            out.append(item)
        elif isinstance(item, slice):
            parts = (item.start, item.stop, item.step)
            if any(p is not None and (isinstance(p, bool) or not isinstance(p, int)) for p in parts):
                return None
            if item.step is not None and item.step <= 0:
                return None
            out.append(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            out.append(item)
        else:
            return None
    named = sum(1 for e in out if e is not None and e is not Ellipsis)
    if out.count(Ellipsis) > 1 or named > ndim:
        return None
    fill = [slice(None)] * (ndim - named)
    if Ellipsis in out:
        at = out.index(Ellipsis)
        out[at:at + 1] = fill
    else:
        out += fill
    return tuple(out)


def narrows_a_split_dim(x, entries: tuple) -> bool:
    """Whether some dim the index narrows (an int, or a slice that is not the whole dim) is split."""
    dim = 0
    for e in entries:
        if e is None:
            continue
        n = x.shape[dim]
        whole = isinstance(e, slice) and e.indices(n) == (0, n, 1)
        if not whole and splitters(x._placements, dim):
            return True
        dim += 1
    return False


def refuse_shared_memory(x, what: str) -> None:
    """Refuse `what` into global tensor `x` whose local's elements share memory (an ``expand``): sbp writes
    blocks of the local, which torch refuses there (its raw "more than one element of the written-to tensor
    refers to a single memory location"). The same on every rank: the locals are expanded alike."""
    if torch._debug_has_internal_overlap(x._local) == 1:
        raise SbpError(f"{what} a global tensor whose elements share memory (an expand: global shape "
                       f"{tuple(x.shape)}, placements {x._placements}) is not supported: write into the tensor "
                       f"before the expand, or .clone() the expanded tensor first")


def write_blocks(x, index: Any, entries: tuple, value: Any) -> None:
    """Write `value` into the region `entries` of global tensor `x`: each rank its own block's part."""
    shape = tuple(x.shape)
    try:
        region = torch.empty(shape, device="meta")[entries].shape
    except IndexError as e:
        raise index_error(x, index, e) from e
    coord = x._mesh.coord
    if coord is None:
        return   # outside the mesh: no block (and no part in gathering a global value)
    v = _value(value, x, region, index)
    local_entries, value_entries = _local_entries(entries, shape, block(shape, x._mesh.shape, x._placements, coord))
    refuse_shared_memory(x, "writing into part of")
    if local_entries is not None:   # (else the region misses this rank's block)
        writes = all(c == 0 for c, p in zip(coord, x._placements) if isinstance(p, Partial) and p.op == "sum")
        part = v[value_entries] if writes else v.new_zeros(()).expand(v[value_entries].shape)
        with torch.no_grad():
            x._local[local_entries] = part
    # the wrapper was written, on every rank alike: saved-tensor checks see it, and so does the check of a kept
    # reduction (before, only the ranks whose block the region met counted the write: they dropped x's kept
    # P(sum) reduction and moved x exactly, the others reused it, and the ranks ran different collectives);
    # its local's counter too, on every rank, as `global_tensor.note_local_write` does: a write through
    # ``x.data`` (another wrapper, with a counter of its own, around the same local) reaches only the local's
    torch.autograd.graph.increment_version(x)
    if type(x._local) is torch.Tensor and not x._local.is_inference():
        torch.autograd.graph.increment_version(x._local)


def _value(value: Any, x, region: torch.Size, index: Any) -> torch.Tensor:
    """The value as a plain tensor of the region's shape (torch's broadcasting; leading 1s dropped)."""
    if isinstance(value, type(x)):   # a global value (x is a GlobalTensor)
        v = value.full()
    elif isinstance(value, torch.Tensor):
        v = value
    else:
        try:
            v = torch.as_tensor(value, dtype=x.dtype)
        except (TypeError, RuntimeError, ValueError, OverflowError) as e:
            raise DTypeError(f"x[...] = {value!r}: the value does not convert to the tensor's dtype {x.dtype} "
                             f"(global shape {tuple(x.shape)}): {e}") from None
    v = v.to(device=x._local.device, dtype=x.dtype)
    while v.ndim > len(region) and v.shape[0] == 1:
        v = v[0]
    try:
        return v.expand(region)
    except RuntimeError as e:
        raise index_error(x, index, IndexError(f"shape mismatch: value of shape {tuple(v.shape)} cannot be "
                                                f"broadcast to the indexed shape {tuple(region)} ({e})")) from None


def _local_entries(entries: tuple, shape: tuple[int, ...], blk) -> tuple[Optional[tuple], tuple]:
    """This block's part of the region: the index into the local block and into the region's value
    (None for the local index when the region misses the block)."""
    local, of_value = [], []
    dim = 0
    for e in entries:
        if e is None:
            local.append(None)
            of_value.append(slice(None))
            continue
        lo, hi = blk[dim]
        n = shape[dim]
        dim += 1
        if isinstance(e, int):
            i = operator.index(e) % n if n else e
            if not lo <= i < hi:
                return None, ()
            local.append(i - lo)
            continue
        start, stop, step = e.indices(n)
        count = len(range(start, stop, step))
        k0 = max(0, math.ceil((lo - start) / step))
        k1 = min(count, max(0, math.ceil((hi - start) / step)))
        if k1 <= k0:
            return None, ()
        first = start + k0 * step
        local.append(slice(first - lo, first + (k1 - k0 - 1) * step - lo + 1, step))
        of_value.append(slice(k0, k1))
    return tuple(local), tuple(of_value)


def index_error(x: torch.Tensor, index: Any, e: IndexError) -> ShapeError:
    """`ShapeError` for an index torch refused (out of bounds, too many indices), naming the global layout;
    it is also an `IndexError`, as torch's error is.

    >>> import sbp
    >>> x = sbp.GlobalTensor(torch.zeros(2, 4), sbp.DeviceMesh((2,)), (sbp.S(0),), (4, 4))
    >>> print(index_error(x, (slice(1, None), 10), IndexError("index 10 is out of bounds")))
    x[1:, 10] on global shape (4, 4) with placements (S(0),): index 10 is out of bounds
    """
    def text(i: Any) -> str:
        if isinstance(i, slice):
            parts = ["" if v is None else str(v) for v in (i.start, i.stop, i.step)]
            return ":".join(parts[:2] if i.step is None else parts)
        if i is Ellipsis:
            return "..."
        if isinstance(i, torch.Tensor):
            return f"<{_dtype_name(i.dtype)} tensor of shape {tuple(i.shape)}>"
        return repr(i)

    items = index if isinstance(index, tuple) else (index,)
    return torch_alike(ShapeError, f"x[{', '.join(text(i) for i in items)}] on global shape {tuple(x.shape)} with "
                       f"placements {x._placements}: {e}", IndexError)   # also an IndexError, as torch's


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
