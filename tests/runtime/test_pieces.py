"""Buffer layouts of collective steps (`sbp.runtime.buffers`): what the executor hands each collective.

Pure tier. Each layout is checked by simulating the collective over every member of a group in plain
torch (gathered buffers, reduce-scatter inputs, all_to_all runs) and rebuilding the result the way the
layout says; the oracle is the global tensor cut by `sbp.values.layout.block`. Pinned cases check that the
layouts avoid the copies they promise (the result is the gathered buffer itself, the local is the
input itself).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import sbp
from sbp.planning.exchange import self_contained
from sbp.runtime.buffers import chain, exchange_layout, gather, group_coords, run_in, scatter
from sbp.values.errors import PlanError
from sbp.values.layout import block, relative

S, B, P = sbp.S, sbp.B, sbp.PartialSum()
SENTINEL = -7  # never a value of `_global` (arange >= 0): padding that leaks into a result shows


def _global(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.int64).view(shape)


def _cut(g: torch.Tensor, shape, mesh_shape, pls, coord) -> torch.Tensor:
    return g[tuple(slice(lo, hi) for lo, hi in block(shape, mesh_shape, pls, coord))]


@st.composite
def steps(draw, src_kinds: tuple[str, ...], dst_kinds: tuple[str, ...], on_axes: tuple[str, ...]):
    """(global shape, mesh shape, src, dst, axes, coord): placements drawn from the kinds (`src` on `axes`
    from `on_axes`), `dst` equal to `src` off `axes`."""
    shape = tuple(draw(st.lists(st.integers(0, 11), min_size=1, max_size=3)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    kinds = {"S": [S(d) for d in range(len(shape))], "B": [B], "P": [P]}
    pick = lambda names: draw(st.sampled_from([p for k in names for p in kinds[k]]))
    axes = tuple(sorted(draw(st.sets(st.integers(0, len(mesh_shape) - 1), min_size=1))))
    src = tuple(pick(on_axes if a in axes else src_kinds) for a in range(len(mesh_shape)))
    dst = tuple(pick(dst_kinds) if a in axes else src[a] for a in range(len(mesh_shape)))
    coord = tuple(draw(st.integers(0, n - 1)) for n in mesh_shape)
    return shape, mesh_shape, src, dst, axes, coord


# ---- all_gather ------------------------------------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(steps(("S", "B"), ("B",), ("S",)))
def test_gather_layout_rebuilds_the_destination_block(case) -> None:
    shape, mesh_shape, src, dst, axes, coord = case
    try:
        lay = gather(shape, mesh_shape, src, dst, axes, coord)
    except PlanError:  # pieces that do not tile the block: no all_gather step has them
        assume(False)
    g = _global(shape)
    buf = torch.full((len(lay.numels) * lay.width,), SENTINEL, dtype=torch.int64)
    for i, member in enumerate(group_coords(mesh_shape, axes, coord)):
        piece = _cut(g, shape, mesh_shape, src, member).reshape(-1)
        assert piece.numel() == lay.numels[i] <= lay.width
        buf[i * lay.width:i * lay.width + piece.numel()] = piece
    if lay.runs is not None:
        got = torch.cat([buf[lo:hi] for lo, hi in lay.runs]).view(lay.shape)
    else:
        got = torch.full(lay.shape, SENTINEL, dtype=torch.int64)
        for where, piece_shape, offset in lay.places:
            got[where] = buf[offset:offset + math.prod(piece_shape)].view(piece_shape)
    want = _cut(g, shape, mesh_shape, dst, coord)
    assert torch.equal(got, want)
    if lay.stack is not None:   # the executors' one copy: the buffer as (members, *piece), dim moved
        assert torch.equal(buf.view(lay.members_shape).movedim(0, lay.stack).reshape(lay.shape), want)


@pytest.mark.parametrize("shape, runs", [((1024, 8), ((0, 8192),)),       # even: the buffer is the result
                                         ((1023, 5), ((0, 5115),)),       # only the last piece short
                                         ((2, 3), ((0, 6),)),             # empty pieces at the end
                                         ((10, 2), ((0, 16), (18, 22)))])  # 3,3,2,2 rows: one join
def test_gather_runs_along_dim_0(shape, runs) -> None:
    assert gather(shape, (4,), (S(0),), (B,), (0,), (1,)).runs == runs


def test_gather_of_columns_places_each_piece() -> None:
    lay = gather((3, 8), (4,), (S(1),), (B,), (0,), (0,))
    assert lay.runs is None and [where for where, _, _ in lay.places][1] == (slice(0, 3), slice(2, 4))
    assert lay.stack == 1   # four equal pieces of 2 columns, side by side in member order


@pytest.mark.parametrize("shape, mesh_shape, src, axes, coord", [
    ((3, 9), (4,), (S(1),), (0,), (0,)),              # 3,2,2,2 columns: unequal
    ((4, 8), (2, 2), (S(1), S(0)), (0, 1), (0, 0)),   # pieces cut along two dims
    ((4, 8), (2, 2), (S(1), S(1)), (1, 0), (0, 0))])  # members in axes order hold columns 0,4,2,6 (x2)
def test_gather_stacks_only_equal_pieces_in_member_order(shape, mesh_shape, src, axes, coord) -> None:
    assert gather(shape, mesh_shape, src, (B,) * len(mesh_shape), axes, coord).stack is None


# ---- reduce_scatter --------------------------------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(steps(("S", "B", "P"), ("S",), ("P",)), st.booleans())
def test_scatter_layout_builds_the_padded_input(case, same_dim) -> None:
    shape, mesh_shape, src, dst, axes, coord = case
    if same_dim:  # a reduce_scatter splits one dim on all its axes
        dst = tuple(dst[axes[0]] if a in axes else dst[a] for a in range(len(dst)))
    try:
        lay = scatter(shape, mesh_shape, src, dst, axes, coord)
    except PlanError:
        assume(False)
    local = _cut(_global(shape), shape, mesh_shape, src, coord)
    n = len(lay.numels)
    if lay.direct:
        inp = local.reshape(-1)
    else:
        inp = torch.full((n * lay.width,), SENTINEL, dtype=torch.int64)
        if lay.runs is not None:
            for at, to, size in lay.runs:
                inp[to:to + size] = local.reshape(-1)[at:at + size]
        else:
            for where, piece_shape, offset in lay.places:
                inp[offset:offset + math.prod(piece_shape)] = local[where].reshape(-1)
        for lo, hi in lay.pads:
            inp[lo:hi] = 0
        if lay.stack is not None:   # the executors' one copy: the local's dim split, the members' axis first
            assert not lay.pads
            assert torch.equal(local.unflatten(lay.stack, (n, -1)).movedim(lay.stack, 0).reshape(-1), inp)
    assert inp.numel() == n * lay.width
    have = block(shape, mesh_shape, src, coord)
    for i, member in enumerate(group_coords(mesh_shape, axes, coord)):
        piece = local[relative(block(shape, mesh_shape, dst, member), have)].reshape(-1)
        chunk = inp[i * lay.width:(i + 1) * lay.width]
        assert torch.equal(chunk[:piece.numel()], piece) and not chunk[piece.numel():].any()
    assert lay.shape == tuple(hi - lo for lo, hi in block(shape, mesh_shape, dst, coord))


@pytest.mark.parametrize("shape, mesh_shape, dst, axes, coord, stack", [
    ((3, 8), (4,), (S(1),), (0,), (1,), 1),               # four equal pieces of 2 columns
    ((2, 3, 8), (2, 2), (P, S(2)), (1,), (1, 0), 2),      # along the last dim, on one axis of two
    ((3, 9), (4,), (S(1),), (0,), (0,), None),            # 3,2,2,2 columns: unequal
    ((4, 8), (2, 2), (S(1), S(1)), (1, 0), (0, 0), None)])  # members in axes order: columns 0,4,2,6 (x2)
def test_scatter_stacks_only_equal_pieces_in_member_order(shape, mesh_shape, dst, axes, coord, stack) -> None:
    assert scatter(shape, mesh_shape, (P,) * len(mesh_shape), dst, axes, coord).stack == stack


def test_scatter_along_dim_0_takes_the_local_as_it_is() -> None:
    assert scatter((8, 3), (4,), (P,), (S(0),), (0,), (2,)).direct
    uneven = scatter((7, 3), (4,), (P,), (S(0),), (0,), (2,))   # 2,2,2,1 rows: one copy, one pad
    assert not uneven.direct and uneven.runs == ((0, 0, 21),) and uneven.pads == ((21, 24),)


# ---- all_to_all / transfer ---------------------------------------------------------------------------
@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(steps(("S", "B"), ("S", "B"), ("S", "B")))
def test_exchange_layout_moves_exactly_the_destination_block(case) -> None:
    shape, mesh_shape, src, dst, axes, coord = case
    assume(self_contained(src, dst, axes))
    g = _global(shape)
    members = group_coords(mesh_shape, axes, coord)
    lays = [exchange_layout(shape, mesh_shape, src, dst, axes, m) for m in members]
    sent = []
    for m, lay in zip(members, lays):
        local = _cut(g, shape, mesh_shape, src, m).contiguous()
        if lay.send_run is not None:
            inp = local.view(-1)[lay.send_run[0]:lay.send_run[1]]
        else:
            inp = torch.full((sum(lay.in_splits),), SENTINEL, dtype=torch.int64)
            for where, piece_shape, offset in lay.sends:
                inp[offset:offset + math.prod(piece_shape)] = local[where].reshape(-1)
        sent.append(inp.split(list(lay.in_splits)))
    for i, (m, lay) in enumerate(zip(members, lays)):
        local = _cut(g, shape, mesh_shape, src, m)
        arrived = [sent[j][i] for j in range(len(members))] if lay.moves else []
        assert [a.numel() for a in arrived] == (list(lay.out_splits) if lay.moves else [])
        out = torch.full(lay.shape, SENTINEL, dtype=torch.int64)
        if arrived and lay.recv_run is not None:
            out.view(-1)[lay.recv_run[0]:lay.recv_run[1]] = torch.cat(arrived)
        elif arrived:
            got = torch.cat(arrived)
            for where, piece_shape, offset in lay.recvs:
                out[where] = got[offset:offset + math.prod(piece_shape)].view(piece_shape)
        if lay.keep is not None:
            out[lay.keep[1]] = local[lay.keep[0]]
        assert torch.equal(out, _cut(g, shape, mesh_shape, dst, m)), (m, lay)


def test_all_to_all_of_rows_to_columns_receives_in_place() -> None:
    lay = exchange_layout((8, 8), (4,), (S(0),), (S(1),), (0,), (1,))
    assert lay.recv_run == (0, 16) and lay.keep is None           # the kept block rides along
    back = exchange_layout((8, 8), (4,), (S(1),), (S(0),), (0,), (0,))
    assert back.send_run == (4, 16) and back.keep is not None     # rows 2..8 go out as they lie


def test_swap_of_whole_blocks_copies_nothing() -> None:
    lay = exchange_layout((4, 4), (2, 2), (S(0), S(1)), (S(1), S(0)), (0, 1), (0, 1))
    assert (lay.send_run, lay.recv_run, lay.keep) == ((0, 4), (0, 4), None)


def test_runs_and_chains() -> None:
    assert run_in(((1, 2), (0, 4)), ((0, 3), (0, 4))) == (4, 8)
    assert run_in(((0, 2), (1, 3)), ((0, 3), (0, 4))) is None
    assert run_in(((0, 0), (1, 3)), ((0, 3), (0, 4))) == (0, 0)
    assert chain([(4, 8), None]) is None and chain([(4, 8), (8, 8), (8, 9)]) == (4, 9)
