"""Hypothesis strategies for layouts: mesh shapes, placements and global shapes (incl. zero-size ones).

>>> from hypothesis import given
>>> @given(layouts())
... def test_layout(case):
...     mesh_shape, global_shape, pls = case
...     assert len(pls) == len(mesh_shape)
>>> test_layout()
"""
from __future__ import annotations

from typing import Sequence

from hypothesis import strategies as st

from ..values.errors import SbpError
from ..values.mesh import as_mesh_shape
from ..values.placement import REDUCE_OPS, Broadcast, Partial, Placement, Split

__all__ = ["meshes", "placements", "global_shapes", "layouts"]


def _count(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SbpError(f"{name} must be an int >= {least}, got {value!r}")
    return value


def meshes(*, min_axes: int = 1, max_axes: int = 3, max_axis_size: int = 4, max_size: int = 8) -> st.SearchStrategy:
    """Mesh shapes with `min_axes`..`max_axes` axes of size 1..`max_axis_size`, at most `max_size` ranks.

    Every bound combination the arguments allow can be met (axes of size 1 fit any `max_size`), and every
    drawn shape meets them: the sizes are drawn within what the axes drawn so far leave, never filtered.

    >>> from hypothesis import find
    >>> find(meshes(), lambda shape: len(shape) == 3 and 2 in shape)
    (1, 1, 2)
    >>> find(meshes(min_axes=3, max_axes=3, max_size=1), lambda shape: True)
    (1, 1, 1)
    """
    _count("meshes(min_axes=...)", min_axes, 1)
    _count("meshes(max_axes=...)", max_axes, min_axes)
    _count("meshes(max_axis_size=...)", max_axis_size, 1)
    _count("meshes(max_size=...)", max_size, 1)
    return _meshes(min_axes, max_axes, max_axis_size, max_size)


@st.composite
def _meshes(draw, min_axes: int, max_axes: int, max_axis_size: int, max_size: int) -> tuple[int, ...]:
    # Each axis draws from 1 up to what the product so far leaves (the other axes can always be 1). The axes
    # fill in a drawn order, so no axis is the one that always gets the room first (an order shrinks to
    # 0, 1, ...); the number of axes and every size shrink to their least.
    ndim = draw(st.integers(min_axes, max_axes))
    order = draw(st.permutations(range(ndim)))
    shape = [1] * ndim
    ranks = 1
    for axis in order:
        room = min(max_axis_size, max_size // ranks)
        shape[axis] = draw(st.integers(1, room))
        ranks *= shape[axis]
    return tuple(shape)


def placements(mesh_ndim: int, tensor_ndim: int, *, partial: bool = True,
               ops: Sequence[str] = REDUCE_OPS, negative_dims: bool = False) -> st.SearchStrategy:
    """Placements tuples for a mesh of `mesh_ndim` axes and a tensor of `tensor_ndim` dims.

    Each axis draws `S(d)` (0 <= d < tensor_ndim; with `negative_dims` also -tensor_ndim <= d < 0, the
    spelling a tensor normalises), `B`, or (with `partial`) `P(op)` for op in `ops`.

    >>> from hypothesis import find
    >>> find(placements(2, 2), lambda pls: Split(1) in pls and Partial("max") in pls)
    (S(1), P(max))
    >>> find(placements(1, 3, negative_dims=True), lambda pls: pls[0] == Split(-1))
    (S(-1),)
    """
    _count("placements(mesh_ndim, ...)", mesh_ndim, 1)
    _count("placements(..., tensor_ndim)", tensor_ndim, 0)
    if not isinstance(ops, (tuple, list)) or not all(op in REDUCE_OPS for op in ops):
        raise SbpError(f"placements(ops=...) must be a tuple or list of reduce ops from {REDUCE_OPS}, got {ops!r}")
    if not isinstance(negative_dims, bool):
        raise SbpError(f"placements(negative_dims=...) must be True or False, got {negative_dims!r}")
    one: list[st.SearchStrategy] = [st.just(Broadcast())]
    if tensor_ndim > 0:
        one.append(st.integers(-tensor_ndim if negative_dims else 0, tensor_ndim - 1).map(Split))
    if partial and ops:
        one.append(st.sampled_from(tuple(ops)).map(Partial))
    return st.tuples(*[st.one_of(one)] * mesh_ndim)


def global_shapes(*, min_dims: int = 1, max_dims: int = 3, max_side: int = 9) -> st.SearchStrategy:
    """Global shapes of `min_dims`..`max_dims` dims with sides 0..`max_side` (zero-size and smaller than
    the mesh included).

    >>> from hypothesis import find
    >>> find(global_shapes(), lambda shape: 0 in shape)
    (0,)
    """
    _count("global_shapes(min_dims=...)", min_dims, 0)
    _count("global_shapes(max_dims=...)", max_dims, min_dims)
    _count("global_shapes(max_side=...)", max_side, 0)
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def layouts(draw, *, mesh_shape: "tuple[int, ...] | None" = None, partial: bool = True, min_dims: int = 1,
            max_dims: int = 3, max_side: int = 9, negative_dims: bool = False
            ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...]]:
    """``(mesh_shape, global_shape, placements)`` that fit together; `mesh_shape` fixed or drawn; global shapes
    of `min_dims`..`max_dims` dims (``min_dims=0``: 0-d tensors too); `negative_dims` as `placements`.

    >>> from hypothesis import find
    >>> find(layouts(mesh_shape=(2, 2)), lambda case: len(case[1]) == 2)
    ((2, 2), (0, 0), (B, B))
    >>> find(layouts(mesh_shape=(2,), min_dims=0), lambda case: case[1] == ())
    ((2,), (), (B,))
    """
    mshape = as_mesh_shape(mesh_shape) if mesh_shape is not None else draw(meshes())
    shape = draw(global_shapes(min_dims=min_dims, max_dims=max_dims, max_side=max_side))
    return tuple(mshape), shape, draw(placements(len(mshape), len(shape), partial=partial,
                                                 negative_dims=negative_dims))
