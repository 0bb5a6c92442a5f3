"""Layout maths: which block of the global tensor each coord holds, and exact point-to-point exchanges.

Pure tier. Oracles: `numpy.array_split` for balanced sizes, numpy coverage counts for tiling, and the
nested logical-value definition of DESIGN.md (axis 0 outermost) for reassembly.
"""
from __future__ import annotations

import doctest
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sbp
from sbp.planning.exchange import exchange
from sbp.values.layout import (
    block,
    block_numel,
    block_shape,
    check_global_shape,
    intersect,
    relative,
    split_range,
    split_sizes,
    splitters,
)
from sbp.values.placement import normalize
from tests.support.repo import DOCS

S, B = sbp.S, sbp.B
PSUM, PMIN, PMAX = sbp.PartialSum(), sbp.PartialMin(), sbp.PartialMax()


# ---- strategies ------------------------------------------------------------------------------------
@st.composite
def layouts(draw, partial: bool = True, max_len: int = 13):
    """(global_shape, mesh_shape, placements, normalised placements): 0-3 dims of 0..max_len, 1-3 axes of 1..4."""
    global_shape = tuple(draw(st.lists(st.integers(0, max_len), min_size=0, max_size=3)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = len(global_shape)
    others = [B, PSUM, PMIN, PMAX] if partial else [B]
    splits = [S(d) for d in range(-ndim, ndim)]
    choice = st.one_of(st.sampled_from(splits), st.sampled_from(others)) if splits else st.sampled_from(others)
    pls = tuple(draw(choice) for _ in mesh_shape)
    return global_shape, mesh_shape, pls, normalize(pls, ndim, len(mesh_shape))


def coords_of(mesh_shape):
    return list(itertools.product(*(range(n) for n in mesh_shape)))


# ---- pinned tables ---------------------------------------------------------------------------------
# (global_shape, mesh_shape, placements, [local_shape per coord, row-major], [global_offset per coord])
TABLE = [
    ((10,), (4,), "S(0)", [(3,), (3,), (2,), (2,)], [(0,), (3,), (6,), (8,)]),
    ((10,), (2, 2), "S(0), S(0)", [(3,), (2,), (3,), (2,)], [(0,), (3,), (5,), (8,)]),
    ((2,), (4,), "S(0)", [(1,), (1,), (0,), (0,)], [(0,), (1,), (2,), (2,)]),
    ((0,), (3,), "S(0)", [(0,), (0,), (0,)], [(0,), (0,), (0,)]),
    ((0, 5), (2,), "S(1)", [(0, 3), (0, 2)], [(0, 0), (0, 3)]),
    ((3, 3), (4,), "S(-1)", [(3, 1), (3, 1), (3, 1), (3, 0)], [(0, 0), (0, 1), (0, 2), (0, 3)]),
    ((7,), (2, 3), "S(0), S(0)", [(2,), (1,), (1,), (1,), (1,), (1,)], [(0,), (2,), (3,), (4,), (5,), (6,)]),
    ((10, 6), (2, 2), "S(0), S(1)", [(5, 3)] * 4, [(0, 0), (0, 3), (5, 0), (5, 3)]),
    ((5, 7), (2, 3), "S(1), S(0)", [(2, 4), (2, 4), (1, 4), (2, 3), (2, 3), (1, 3)],
     [(0, 0), (2, 0), (4, 0), (0, 4), (2, 4), (4, 4)]),
    ((5, 4), (2, 2), "B, S(1)", [(5, 2), (5, 2), (5, 2), (5, 2)], [(0, 0), (0, 2), (0, 0), (0, 2)]),
    ((5, 4), (2, 2), "P(sum), S(-1)", [(5, 2), (5, 2), (5, 2), (5, 2)], [(0, 0), (0, 2), (0, 0), (0, 2)]),
    ((6,), (3,), "P(max)", [(6,)] * 3, [(0,)] * 3),
    ((), (2,), "B", [(), ()], [(), ()]),
    ((), (2, 2), "P(min), B", [()] * 4, [()] * 4),
]


@pytest.mark.parametrize("global_shape, mesh_shape, pls, shapes, offsets", TABLE)
def test_layout_table(global_shape, mesh_shape, pls, shapes, offsets):
    coords = coords_of(mesh_shape)
    assert [sbp.local_shape(global_shape, mesh_shape, pls, c) for c in coords] == shapes
    assert [sbp.global_offset(global_shape, mesh_shape, pls, c) for c in coords] == offsets
    mesh = sbp.DeviceMesh(mesh_shape)  # a mesh value works wherever a mesh shape does
    assert [sbp.local_shape(global_shape, mesh, sbp.placements(pls), c) for c in coords] == shapes


def test_local_slices_pinned():
    assert [sbp.local_slices((10,), (4,), "S(0)", (c,)) for c in range(4)] == [
        (slice(0, 3),), (slice(3, 6),), (slice(6, 8),), (slice(8, 10),)]
    assert [sbp.local_slices((10,), (2, 2), "S(0), S(0)", c) for c in coords_of((2, 2))] == [
        (slice(0, 3),), (slice(3, 5),), (slice(5, 8),), (slice(8, 10),)]
    assert sbp.local_slices((4, 6), (2, 3), "S(1), S(1)", (1, 2)) == (slice(0, 4), slice(5, 6))
    assert sbp.local_slices((), (3,), "B", (2,)) == ()


def test_layout_accepts_mixed_inputs():
    assert sbp.local_shape([np.int64(10)], "2x2", [S(0), "S(0)"], [1, 0]) == (3,)
    assert sbp.local_shape((10,), sbp.DeviceMesh((2, 2), ranks=[4, 5, 6, 7]), "S(0),B", (1, 1)) == (5,)


@pytest.mark.parametrize("call, error, message", [
    (lambda: sbp.local_shape((3, -1), (2,), "B", (0,)), sbp.ShapeError,
     "global_shape must be a sequence of non-negative ints, got (3, -1)"),
    (lambda: sbp.local_shape(5, (2,), "B", (0,)), sbp.ShapeError,
     "global_shape must be a sequence of non-negative ints, got 5"),
    (lambda: sbp.local_shape((True, 2), (2,), "B", (0,)), sbp.ShapeError,
     "global_shape must be a sequence of non-negative ints, got (True, 2)"),
    (lambda: sbp.local_slices((3,), (2,), "B", (2,)), sbp.ShapeError, "coord (2,) is not in a mesh of shape (2,)"),
    (lambda: sbp.local_slices((3,), (2,), "B", (0, 0)), sbp.ShapeError,
     "coord (0, 0) is not in a mesh of shape (2,)"),
    (lambda: sbp.global_offset((3,), (2, 2), "B", (0, 0)), sbp.PlacementError,
     "placements (B,) give 1 placement(s) but the mesh has 2 axes (need exactly one placement per mesh axis)"),
    (lambda: sbp.local_shape((3,), (2,), "S(1)", (0,)), sbp.PlacementError,
     "S(1) is out of range for a 1-d tensor (valid: -1..0)"),
    (lambda: sbp.local_shape((3, 3), (2, 2), "S(2), B", (0, 0)), sbp.PlacementError,
     "S(2) is out of range for a 2-d tensor (valid: -2..1)"),
    (lambda: sbp.local_shape((3,), (2, 0), "B, B", (0, 0)), sbp.MeshError,
     "mesh shape must be a non-empty tuple of positive ints, got (2, 0)"),
])
def test_layout_errors(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


def test_check_global_shape():
    assert check_global_shape([3, 0]) == (3, 0)
    assert check_global_shape(()) == ()
    assert check_global_shape((np.int32(2),)) == (2,)


# ---- properties ------------------------------------------------------------------------------------
@pytest.mark.slow
@given(layouts())
@settings(max_examples=200, deadline=None)
def test_replica_groups_tile_exactly_once(case):
    """For every fixed coord on the Broadcast/Partial axes, the Split axes' blocks cover each element once."""
    global_shape, mesh_shape, pls, norm = case
    split_axes = [a for a, p in enumerate(norm) if isinstance(p, sbp.Split)]
    other_axes = [a for a in range(len(mesh_shape)) if a not in split_axes]
    for fixed in itertools.product(*(range(mesh_shape[a]) for a in other_axes)):
        counts = np.zeros(global_shape, dtype=np.int64)
        for sub in itertools.product(*(range(mesh_shape[a]) for a in split_axes)):
            coord = [0] * len(mesh_shape)
            for a, c in zip(other_axes, fixed):
                coord[a] = c
            for a, c in zip(split_axes, sub):
                coord[a] = c
            counts[sbp.local_slices(global_shape, mesh_shape, pls, coord)] += 1
        assert (counts == 1).all()


@pytest.mark.slow
@given(layouts())
@settings(max_examples=200, deadline=None)
def test_slices_match_nested_array_split(case):
    """Each dim's slice is what nested `numpy.array_split` gives, axes in order (axis 0 splits first)."""
    global_shape, mesh_shape, pls, norm = case
    for coord in coords_of(mesh_shape):
        slices = sbp.local_slices(global_shape, mesh_shape, pls, coord)
        assert len(slices) == len(global_shape)
        assert sbp.local_shape(global_shape, mesh_shape, pls, coord) == tuple(s.stop - s.start for s in slices)
        assert sbp.global_offset(global_shape, mesh_shape, pls, coord) == tuple(s.start for s in slices)
        for d, (sl, length) in enumerate(zip(slices, global_shape)):
            assert sl.step is None and 0 <= sl.start <= sl.stop <= length
            index = np.arange(length)
            for a in splitters(norm, d):
                index = np.array_split(index, mesh_shape[a])[coord[a]]
            assert sl.stop - sl.start == len(index)
            if len(index):
                assert (sl.start, sl.stop) == (index[0], index[-1] + 1)


@pytest.mark.slow
@given(layouts())
@settings(max_examples=200, deadline=None)
def test_logical_value_reassembles(case):
    """DESIGN's logical value, nested in axis order: S(d) concatenates along d, B / P coords all hold the
    same block (for layout purposes). Reassembling the per-coord slices gives back the global tensor."""
    global_shape, mesh_shape, pls, norm = case
    full = np.arange(math.prod(global_shape)).reshape(global_shape)

    def assemble(prefix: tuple[int, ...]) -> np.ndarray:
        axis = len(prefix)
        if axis == len(mesh_shape):
            return full[sbp.local_slices(global_shape, mesh_shape, pls, prefix) + (...,)]
        parts = [assemble(prefix + (c,)) for c in range(mesh_shape[axis])]
        match norm[axis]:
            case sbp.Split(dim=d):
                return np.concatenate(parts, axis=d)
            case _:
                assert all(np.array_equal(parts[0], p) for p in parts)
                return parts[0]

    assert np.array_equal(assemble(()), full)


@pytest.mark.slow
@given(layouts(), st.data())
@settings(max_examples=200, deadline=None)
def test_broadcast_and_partial_axes_do_not_change_the_slice(case, data):
    global_shape, mesh_shape, pls, norm = case
    keep = [a for a, p in enumerate(norm) if isinstance(p, sbp.Split)]
    if not keep:  # no split at all: every coord holds the whole tensor
        for coord in coords_of(mesh_shape):
            assert sbp.local_slices(global_shape, mesh_shape, pls, coord) == tuple(slice(0, n) for n in global_shape)
        return
    swap = data.draw(st.lists(st.sampled_from([B, PSUM, PMIN, PMAX]), min_size=len(mesh_shape),
                              max_size=len(mesh_shape)))
    swapped = tuple(p if a in keep else swap[a] for a, p in enumerate(pls))
    dropped_shape = tuple(mesh_shape[a] for a in keep)
    dropped = tuple(pls[a] for a in keep)
    for coord in coords_of(mesh_shape):
        sl = sbp.local_slices(global_shape, mesh_shape, pls, coord)
        assert sbp.local_slices(global_shape, mesh_shape, swapped, coord) == sl  # B <-> P(op) on an axis
        assert sbp.local_slices(global_shape, dropped_shape, dropped, tuple(coord[a] for a in keep)) == sl


# ---- split_sizes / split_range ---------------------------------------------------------------------
@pytest.mark.parametrize("length, parts, sizes", [
    (10, 4, (3, 3, 2, 2)), (2, 4, (1, 1, 0, 0)), (0, 3, (0, 0, 0)), (8, 4, (2, 2, 2, 2)), (5, 1, (5,)),
    (7, 3, (3, 2, 2)), (1, 1, (1,)),
])
def test_split_sizes_table(length, parts, sizes):
    assert split_sizes(length, parts) == sizes


@given(st.integers(0, 200), st.integers(1, 17))
@settings(max_examples=200, deadline=None)
def test_split_sizes_is_array_split(length, parts):
    sizes = split_sizes(length, parts)
    assert sizes == tuple(len(p) for p in np.array_split(np.arange(length), parts))
    assert sum(sizes) == length and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1
    assert list(sizes) == sorted(sizes, reverse=True)  # larger parts first
    assert (0 in sizes) == (length < parts)  # parts are empty only when length < parts


@given(st.integers(0, 50), st.integers(0, 60), st.integers(1, 9))
@settings(max_examples=200, deadline=None)
def test_split_range_tiles(start, length, parts):
    stop = start + length
    ranges = [split_range(start, stop, parts, i) for i in range(parts)]
    assert ranges[0][0] == start and ranges[-1][1] == stop
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert tuple(hi - lo for lo, hi in ranges) == split_sizes(length, parts)


def test_split_range_pinned():
    assert [split_range(0, 10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [split_range(5, 8, 2, i) for i in range(2)] == [(5, 7), (7, 8)]
    assert [split_range(0, 2, 4, i) for i in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


# ---- blocks ----------------------------------------------------------------------------------------
blocks_1d = st.tuples(st.integers(0, 8), st.integers(0, 8)).map(lambda t: (min(t), max(t)))


@pytest.mark.slow
@given(st.integers(0, 3).flatmap(lambda n: st.tuples(st.lists(blocks_1d, min_size=n, max_size=n),
                                                     st.lists(blocks_1d, min_size=n, max_size=n))))
@settings(max_examples=200, deadline=None)
def test_intersect_matches_masks(case):
    a, b = (tuple(x) for x in case)
    ndim = len(a)

    def mask(blk):
        m = np.zeros((8,) * ndim, dtype=bool)
        m[tuple(slice(lo, hi) for lo, hi in blk)] = True
        return m

    both = mask(a) & mask(b)
    got = intersect(a, b)
    assert got == intersect(b, a)
    if not both.any():
        assert got is None
    else:
        assert got is not None
        assert np.array_equal(mask(got), both)
        assert block_numel(got) == both.sum()
        assert block_shape(got) == tuple(hi - lo for lo, hi in got)


def test_intersect_pinned():
    assert intersect(((0, 4), (0, 4)), ((2, 6), (1, 3))) == ((2, 4), (1, 3))
    assert intersect(((0, 3),), ((3, 6),)) is None  # touching half-open ranges do not overlap
    assert intersect(((0, 3), (0, 0)), ((0, 3), (0, 0))) is None  # empty blocks have no intersection
    assert intersect((), ()) == ()  # a 0-d block is the one scalar
    assert relative(((2, 4), (1, 3)), ((2, 6), (0, 4))) == (slice(0, 2), slice(1, 3))
    assert block_numel(((0, 3), (1, 5))) == 12 and block_numel(()) == 1
    assert block((10, 4), (2, 2), (S(0), S(0)), (1, 0)) == ((5, 8), (0, 4))
    assert splitters((S(0), S(1), S(0)), 0) == (0, 2) and splitters((B, PSUM), 0) == ()


# ---- exact point-to-point exchanges ----------------------------------------------------------------
@st.composite
def exchanges(draw, whole_mesh: bool = False):
    """A Split/Broadcast change on the group along `axes` (placements on the other axes unchanged)."""
    global_shape, mesh_shape, src, nsrc = draw(layouts(partial=False, max_len=9))
    ndim = len(global_shape)
    axes = tuple(range(len(mesh_shape))) if whole_mesh else tuple(sorted(
        draw(st.sets(st.integers(0, len(mesh_shape) - 1), min_size=1))))
    choice = st.sampled_from([B] + [S(d) for d in range(ndim)])
    ndst = tuple(draw(choice) if a in axes else p for a, p in enumerate(nsrc))
    coord = draw(st.sampled_from(coords_of(mesh_shape)))
    return global_shape, mesh_shape, nsrc, ndst, axes, coord


def group_is_self_contained(src, dst, axes) -> bool:
    """True when every member's dst block lies inside the union of the group's src blocks: no axis outside
    the group splits a dim after (inside) a group axis that splits that dim in src or dst."""
    for a, p in enumerate(src):
        if a in axes or not isinstance(p, sbp.Split):
            continue
        if any(g < a and (src[g] == p or dst[g] == p) for g in axes):
            return False
    return True


def check_exchange(global_shape, mesh_shape, src, dst, axes, coord):
    ex = exchange(global_shape, mesh_shape, src, dst, axes, coord)
    mesh = sbp.DeviceMesh(mesh_shape)
    group = next(g for g in mesh.groups(axes) if mesh.rank_of(coord) in g)
    assert ex.members == tuple(mesh.coord_of(r) for r in group)
    src_blocks = [block(global_shape, mesh_shape, src, m) for m in ex.members]
    dst_blocks = [block(global_shape, mesh_shape, dst, m) for m in ex.members]
    covered = np.zeros(global_shape, dtype=bool)  # what the group holds before the exchange
    for b in src_blocks:
        covered[tuple(slice(lo, hi) for lo, hi in b)] = True
    full = np.arange(math.prod(global_shape)).reshape(global_shape)
    sent = sorted((peer, i, piece) for peer, pairs in enumerate(ex.send) for i, piece in pairs)
    received = sorted((peer, i, piece) for i, pairs in enumerate(ex.recv) for peer, piece in pairs)
    assert sent == received  # what is sent is exactly what is received
    for i, (own, want) in enumerate(zip(src_blocks, dst_blocks)):
        assert ex.keep[i] == intersect(own, want)
        assert [p for p, _ in ex.recv[i]] == sorted(p for p, _ in ex.recv[i])
        assert [p for p, _ in ex.send[i]] == sorted(p for p, _ in ex.send[i])
        got = np.zeros(global_shape, dtype=np.int64)
        result = np.full(global_shape, -1, dtype=full.dtype)
        for piece in ([ex.keep[i]] if ex.keep[i] is not None else []):
            got[tuple(slice(lo, hi) for lo, hi in piece)] += 1
        for peer, piece in ex.recv[i]:
            assert peer != i
            assert intersect(piece, src_blocks[peer]) == piece  # the peer holds what it sends
            assert intersect(piece, want) == piece  # nothing outside the dst block is received
            got[tuple(slice(lo, hi) for lo, hi in piece)] += 1
        for piece in [ex.keep[i]] + [p for _, p in ex.recv[i]]:
            if piece is not None:
                sl = tuple(slice(lo, hi) for lo, hi in piece)
                result[sl] = full[sl]
        want_mask = np.zeros(global_shape, dtype=bool)
        want_mask[tuple(slice(lo, hi) for lo, hi in want)] = True
        assert got.max(initial=0) <= 1  # no element arrives twice, nor one already held
        assert np.array_equal(got == 1, want_mask & covered)
        own_numel = 0 if ex.keep[i] is None else block_numel(ex.keep[i])
        n_recv = sum(block_numel(p) for _, p in ex.recv[i])
        assert n_recv == int((want_mask & covered).sum()) - own_numel
        if group_is_self_contained(src, dst, axes):
            assert n_recv == block_numel(want) - own_numel  # exactly |dst| - |dst ∩ own src|
            sl = tuple(slice(lo, hi) for lo, hi in want)
            assert np.array_equal(result[sl], full[sl])  # the member can build its dst block
    assert ex.max_recv_elems == max(sum(block_numel(p) for _, p in r) for r in ex.recv)


@pytest.mark.slow
@given(exchanges(whole_mesh=True))
@settings(max_examples=200, deadline=None)
def test_exchange_whole_mesh(case):
    check_exchange(*case)


@pytest.mark.slow
@given(exchanges())
@settings(max_examples=200, deadline=None)
def test_exchange_sub_groups(case):
    global_shape, mesh_shape, src, dst, axes, coord = case
    if group_is_self_contained(src, dst, axes):
        check_exchange(*case)
    else:  # a group that does not hold one contiguous block is refused, never scheduled incompletely
        with pytest.raises(sbp.PlanError, match="contiguous block"):
            exchange(*case)


def test_exchange_pinned():
    ex = exchange((4,), (2,), (S(0),), (B,), (0,), (0,))
    assert ex.members == ((0,), (1,))
    assert ex.recv == (((1, ((2, 4),)),), ((0, ((0, 2),)),))
    assert ex.send == (((1, ((0, 2),)),), ((0, ((2, 4),)),))
    assert ex.keep == (((0, 2),), ((2, 4),))
    # 10 rows, S(0) -> nested S(0) on a 4-rank group: 3,3,2,2 -> same sizes, nothing moves.
    same = exchange((10,), (2, 2), (S(0), S(0)), (S(0), S(0)), (0, 1), (0, 0))
    assert same.max_recv_elems == 0
    # S(0) -> S(1) on 2 ranks (an all_to_all as a transfer): each receives a quarter.
    a2a = exchange((4, 4), (2,), (S(0),), (S(1),), (0,), (1,))
    assert a2a.recv == (((1, ((2, 4), (0, 2))),), ((0, ((0, 2), (2, 4))),))
    assert a2a.max_recv_elems == 4
    # Broadcast holders share the sending: (B, S(0)) -> (S(0), B) over 2x2, each piece from a different holder.
    shared = exchange((8,), (2, 2), (B, S(0)), (S(0), B), (0, 1), (0, 0))
    assert [len(r) for r in shared.recv] == [0, 1, 1, 0]
    assert [len(s) for s in shared.send] == [0, 1, 1, 0]
    assert shared.recv[1][0][0] == 2 and shared.recv[2][0][0] == 1


# ---- docs ------------------------------------------------------------------------------------------
def test_concepts_doc_examples():
    """The runnable snippets of docs/concepts.md stay true."""
    path = DOCS / "concepts.md"
    if not path.exists():
        pytest.skip("docs/concepts.md not present")
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.NORMALIZE_WHITESPACE,
                              globs={"sbp": sbp})
    assert result.attempted > 0
    assert result.failed == 0
