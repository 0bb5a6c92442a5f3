"""Layout maths, in one place: which block of the global tensor each coord holds.

Every other module (distribute, full, the planner's lower bound, the executor's transfer sizes) calls
these functions. Splits are balanced (the first ``L % n`` parts get one element more, as
``numpy.array_split``); several axes splitting one dim nest in axis order (axis 0 splits first).
Broadcast and Partial axes do not change the block.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

from .errors import ShapeError
from .mesh import DeviceMesh, as_ints, as_mesh_shape, bad_coord
from .placement import Placement, Split, normalize

Block = tuple[tuple[int, int], ...]  # one half-open (start, stop) per dim


def split_sizes(length: int, parts: int) -> tuple[int, ...]:
    """Balanced sizes of `length` split into `parts`.

    >>> split_sizes(10, 4)
    (3, 3, 2, 2)
    >>> split_sizes(2, 4)
    (1, 1, 0, 0)
    """
    base, extra = divmod(length, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def split_range(start: int, stop: int, parts: int, index: int) -> tuple[int, int]:
    """The `index`-th balanced part of the half-open range [start, stop).

    >>> split_range(0, 10, 4, 2)
    (6, 8)
    """
    base, extra = divmod(stop - start, parts)
    lo = start + index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def check_global_shape(global_shape: Sequence[int]) -> tuple[int, ...]:
    """Validate a global shape (a sequence of non-negative ints, e.g. a `torch.Size`).

    >>> check_global_shape([3, 0])
    (3, 0)
    """
    try:
        shape = as_ints(global_shape)
        ok = shape is not None and all(n >= 0 for n in shape) and \
            not isinstance(global_shape, (set, frozenset, dict))   # unordered: no shape
    except TypeError:   # no sequence
        ok = False
    if not ok:
        raise ShapeError(f"global_shape must be a sequence of non-negative ints, got {global_shape!r}")
    if math.prod(shape) > _MAX_ELEMENTS or any(n > _MAX_ELEMENTS for n in shape):
        raise ShapeError(f"global_shape {shape} has more than 2**63 - 1 elements (or a dim that large): no tensor "
                         f"holds it (torch counts elements in int64)")
    return shape


_MAX_ELEMENTS = 2**63 - 1


@lru_cache(maxsize=65536)
def block(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], pls: tuple[Placement, ...],
          coord: tuple[int, ...]) -> Block:
    """The half-open range per dim held at `coord`; `pls` must already be normalised.

    >>> block((10, 4), (2, 2), (Split(0), Split(0)), (1, 0))
    ((5, 8), (0, 4))
    """
    ranges = [(0, n) for n in global_shape]
    for axis, p in enumerate(pls):
        if isinstance(p, Split):
            lo, hi = ranges[p.dim]
            ranges[p.dim] = split_range(lo, hi, mesh_shape[axis], coord[axis])
    return tuple(ranges)


def _prepare(global_shape, mesh, pls, coord):
    shape = check_global_shape(global_shape)
    mesh_shape = as_mesh_shape(mesh)
    pls = normalize(pls, len(shape), len(mesh_shape))
    try:
        ints = as_ints(coord)
        ok = ints is not None and len(ints) == len(mesh_shape) and all(0 <= c < n for c, n in zip(ints, mesh_shape))
    except TypeError:   # no sequence
        ok = False
    if not ok:
        raise ShapeError(bad_coord(coord, mesh_shape))
    return shape, mesh_shape, pls, ints


def local_slices(global_shape: Sequence[int], mesh: "DeviceMesh | Sequence[int]", placements,
                 coord: Sequence[int]) -> tuple[slice, ...]:
    """The slice of the global tensor held at `coord`, one `slice` per dim.

    >>> local_slices((10, 4), (4,), "S(0)", (3,))
    (slice(8, 10, None), slice(0, 4, None))
    >>> local_slices((10,), (2, 2), "S(0), S(0)", (1, 1))
    (slice(8, 10, None),)
    """
    return tuple(slice(lo, hi) for lo, hi in block(*_prepare(global_shape, mesh, placements, coord)))


def local_shape(global_shape: Sequence[int], mesh: "DeviceMesh | Sequence[int]", placements,
                coord: Sequence[int]) -> tuple[int, ...]:
    """The local shape at `coord`.

    Per-rank table for 10 rows over a 2x2 mesh with ``(S(0), S(0))`` (nested: 5,5 then 3,2):

    >>> [local_shape((10,), (2, 2), "S(0), S(0)", c)[0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    [3, 2, 3, 2]
    """
    return tuple(hi - lo for lo, hi in block(*_prepare(global_shape, mesh, placements, coord)))


def global_offset(global_shape: Sequence[int], mesh: "DeviceMesh | Sequence[int]", placements,
                  coord: Sequence[int]) -> tuple[int, ...]:
    """The global index of the local tensor's first element at `coord`, per dim.

    >>> global_offset((10, 6), (2, 2), "S(0), S(1)", (1, 1))
    (5, 3)
    """
    return tuple(lo for lo, _ in block(*_prepare(global_shape, mesh, placements, coord)))


def block_shape(b: Block) -> tuple[int, ...]:
    """Shape of a block."""
    return tuple(hi - lo for lo, hi in b)


def block_numel(b: Block) -> int:
    """Number of elements of a block."""
    n = 1
    for lo, hi in b:
        n *= hi - lo
    return n


def intersect(a: Block, b: Block) -> Block | None:
    """The intersection of two blocks, or None when it is empty.

    >>> intersect(((0, 4), (0, 4)), ((2, 6), (1, 3)))
    ((2, 4), (1, 3))
    """
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(inner: Block, outer: Block) -> tuple[slice, ...]:
    """Slices that select `inner` out of a local tensor holding `outer`."""
    return tuple(slice(ilo - olo, ihi - olo) for (ilo, ihi), (olo, _) in zip(inner, outer))


def splitters(pls: Sequence[Placement], dim: int) -> tuple[int, ...]:
    """The mesh axes that split `dim`, in nesting order.

    >>> splitters((Split(0), Split(1), Split(0)), 0)
    (0, 2)
    """
    return tuple(a for a, p in enumerate(pls) if isinstance(p, Split) and p.dim == dim)
