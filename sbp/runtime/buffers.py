"""Buffer layouts of one collective step on one coord: where each member's piece lies in the flat buffers
the collective reads and writes, so that the executor copies only what the collective cannot take as is.

Pure layout maths on top of `sbp.values.layout` and `sbp.planning.exchange`, cached per (step fields, coord): the
executor asks once per plan and coord, then only slices and copies. Flat offsets are row-major element
offsets into a contiguous tensor holding a block.

- all_gather (`gather`): every member's piece is padded to the largest (`width`) in the gathered buffer.
  When the pieces are consecutive runs of the result in member order, the result is a view of that
  buffer (`runs` of length 1: even pieces, or only the last non-empty piece shorter) or one concatenation
  of its `runs`; otherwise each piece is copied to its `place`.
- reduce_scatter (`scatter`): the input is the local, flat, when the members' pieces are equal runs of it
  in member order (`direct`); otherwise pieces are copied into a padded buffer.
- all_to_all / transfer (`exchange_layout`): the send (receive) buffer is a flat range of the local
  (result) when the blocks line up in member order; a rank's own kept part goes through the collective
  only when that saves a copy.
- the same as point-to-point messages (`p2p_layout`, for communicators with `send_recv`): one message
  per peer and direction, sent from a flat range of the local and received into a flat range of the
  result wherever the block is one run there; only the others are packed or unpacked.

>>> from sbp import S, B
>>> g = gather((1023, 1021), (4,), (S(0),), (B,), (0,), (0,))
>>> g.width, g.numels, g.runs      # only the last piece is short: the result is a prefix of the buffer
(261376, (261376, 261376, 261376, 260355), ((0, 1044483),))
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

from ..planning.cost import Costing
from ..planning.exchange import exchange, exchange_at
from ..values.errors import PlanError
from ..values.layout import Block, block, block_numel, block_shape, relative
from ..values.placement import Placement, Split

Run = tuple[int, int]  # half-open flat range [start, stop) of a contiguous tensor
Place = tuple[tuple[slice, ...], tuple[int, ...], int]  # slices of a block, their shape, flat buffer offset


@dataclass(frozen=True, slots=True)
class Gather:
    """all_gather on one coord: gathered buffer of `width` elements per member (member order); the result
    (shape `shape`) is the concatenation of the buffer's `runs`, or, when `runs` is None, every member's
    piece copied to its `places` entry (slices of the result, piece shape, buffer offset). `stack`: the dim
    along which equal pieces lie side by side in member order, or None; the buffer viewed as
    (members, *piece), its first axis moved next to that dim and merged with it, is then the result."""

    shape: tuple[int, ...]
    width: int
    numels: tuple[int, ...]
    runs: tuple[Run, ...] | None
    places: tuple[Place, ...]
    stack: int | None = None

    @property
    def members_shape(self) -> tuple[int, ...]:
        """With `stack`: the buffer's shape as (members, *piece).

        >>> from sbp import S, B
        >>> gather((2, 4), (2,), (S(1),), (B,), (0,), (0,)).members_shape
        (2, 2, 2)
        """
        n, d = len(self.numels), self.stack
        return (n,) + self.shape[:d] + (self.shape[d] // n,) + self.shape[d + 1:]


@dataclass(frozen=True, slots=True)
class Scatter:
    """reduce_scatter on one coord: an input of `width` elements per member (member order). `direct`: the
    contiguous local read flat is that input as it is. Otherwise `runs` ((local start, buffer start,
    length) copies of the flat local) or, when `runs` is None, `places` (slices of the local, shape,
    buffer offset) fill a buffer whose `pads` ranges are zeroed. `stack`: the dim along which equal
    pieces lie side by side in member order, or None; the local with that dim split into (members,
    piece) and the members' axis moved first is then the input, read flat. The result is the first
    ``numels[index]`` elements of the output, shaped `shape`."""

    index: int
    shape: tuple[int, ...]
    width: int
    numels: tuple[int, ...]
    direct: bool
    runs: tuple[tuple[int, int, int], ...] | None
    places: tuple[Place, ...]
    pads: tuple[Run, ...]
    stack: int | None = None


@dataclass(frozen=True, slots=True)
class ExchangeLayout:
    """all_to_all / transfer on one coord. `in_splits` / `out_splits`: elements sent to / received from
    each member (member order). The send buffer is `send_run` of the contiguous flat local when it is
    not None, else `sends` packed; the receive buffer is `recv_run` of the flat result when not None,
    else received apart and copied to `recvs` (slices of the result, shape, buffer offset). `keep`
    (slices of the local, slices of the result) is copied locally; None when the collective carries it
    or nothing is kept. `moves`: some member of the group receives something (else no call at all)."""

    shape: tuple[int, ...]
    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]
    send_run: Run | None
    sends: tuple[Place, ...]
    recv_run: Run | None
    recvs: tuple[Place, ...]
    keep: tuple[tuple[slice, ...], tuple[slice, ...]] | None
    moves: bool


@dataclass(frozen=True, slots=True)
class P2PLayout:
    """all_to_all / transfer as messages on one coord. `sends`: (peer, `run` of the contiguous flat local
    or None, slices of the local) per peer, starting with the member after this one so that the group's
    first messages go to different ranks; `recvs`: (peer, `run` of the flat result or None, slices of the
    result, block shape) in member order. `keep` (slices of the local, slices of the result) is copied
    locally; `moves`: some member of the group receives something (else no call at all)."""

    shape: tuple[int, ...]
    sends: tuple[tuple[int, Run | None, tuple[slice, ...]], ...]
    recvs: tuple[tuple[int, Run | None, tuple[slice, ...], tuple[int, ...]], ...]
    keep: tuple[tuple[slice, ...], tuple[slice, ...]] | None
    moves: bool
    copies: int  # elements packed and unpacked (blocks that are not one run of the local / result)


def group_coords(mesh_shape: tuple[int, ...], axes: tuple[int, ...],
                 coord: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Coords of the group along `axes` through `coord`, row-major over `axes` (the member order).

    >>> group_coords((2, 2), (1,), (1, 0))
    ((1, 0), (1, 1))
    """
    out = []
    for sub in itertools.product(*(range(mesh_shape[a]) for a in axes)):
        c = list(coord)
        for a, i in zip(axes, sub):
            c[a] = i
        out.append(tuple(c))
    return tuple(out)


def run_in(inner: Block, outer: Block) -> Run | None:
    """The flat range of `inner` inside a row-major tensor holding `outer`, or None when not one run.

    >>> run_in(((2, 4), (0, 3)), ((0, 4), (0, 3))), run_in(((0, 4), (0, 2)), ((0, 4), (0, 3)))
    ((6, 12), None)
    """
    if block_numel(inner) == 0:
        return 0, 0
    sizes = [hi - lo for lo, hi in inner]
    full = [ohi - olo for olo, ohi in outer]
    partial = [d for d in range(len(full)) if sizes[d] != full[d]]
    last = partial[-1] if partial else -1
    if any(sizes[d] != 1 for d in range(last)):
        return None
    start, stride = 0, 1
    for d in reversed(range(len(full))):
        start += (inner[d][0] - outer[d][0]) * stride
        stride *= full[d]
    return start, start + block_numel(inner)


def chain(runs: list[Run | None]) -> Run | None:
    """The one range that `runs` cover back to back in order (empty runs skipped), or None.

    >>> chain([(0, 4), (4, 4), (4, 9)]), chain([(0, 4), (5, 9)]), chain([])
    ((0, 9), None, (0, 0))
    """
    found = [r for r in runs if r is None or r[1] > r[0]]
    if any(r is None for r in found):
        return None
    if not found:
        return 0, 0
    if any(a[1] != b[0] for a, b in zip(found, found[1:])):
        return None
    return found[0][0], found[-1][1]


def _merge(runs: list[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for lo, hi in runs:
        if hi == lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def _check_tiling(pieces: list[Block], whole: Block, kind: str, src, dst, axes) -> None:
    """The members' pieces must lie inside `whole` and add up to it (a mismatch is a planner bug)."""
    if sum(map(block_numel, pieces)) != block_numel(whole) or any(
            not olo <= lo <= hi <= ohi for p in pieces for (lo, hi), (olo, ohi) in zip(p, whole)):
        raise PlanError(f"{kind} on mesh axes {axes}, {src} -> {dst}: the members' pieces {pieces} do not tile "
                        f"the block {whole}")


def _places(blocks: list[Block], outer: Block, offsets: list[int]) -> tuple[Place, ...]:
    return tuple((relative(b, outer), block_shape(b), off) for b, off in zip(blocks, offsets) if block_numel(b))


@lru_cache(maxsize=4096)
def gather(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
           dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> Gather:
    """The all_gather layout (`S -> B` on `axes`) at `coord`; see `Gather`.

    >>> from sbp import S, B
    >>> gather((10,), (4,), (S(0),), (B,), (0,), (1,)).runs      # pieces 3,3,2,2: two runs to join
    ((0, 8), (9, 11))
    >>> lay = gather((2, 4), (2,), (S(1),), (B,), (0,), (0,))  # columns: placed one by one, or stacked
    >>> lay.runs is None, lay.stack
    (True, 1)
    >>> gather((2, 5), (2,), (S(1),), (B,), (0,), (0,)).stack is None   # pieces of 3 and 2 columns
    True
    """
    pieces = [block(global_shape, mesh_shape, src, c) for c in group_coords(mesh_shape, axes, coord)]
    want = block(global_shape, mesh_shape, dst, coord)
    _check_tiling(pieces, want, "all_gather", src, dst, axes)
    numels = tuple(block_numel(p) for p in pieces)
    width = max(numels)
    in_order = chain([run_in(p, want) for p in pieces]) == (0, block_numel(want))
    runs = (_merge([(i * width, i * width + n) for i, n in enumerate(numels)]) or ((0, 0),)) if in_order else None
    offsets = [i * width for i in range(len(pieces))]
    stack = None if runs is not None else _stack_dim(pieces, want)
    return Gather(block_shape(want), width, numels, runs, _places(pieces, want, offsets), stack)


def _stack_dim(pieces: list[Block], want: Block) -> int | None:
    """The one dim along which `pieces` (member order; they tile `want`, `_check_tiling`) cut `want` into
    equal consecutive parts, or None."""
    dims = {d for p in pieces for d, (r, w) in enumerate(zip(p, want)) if r != w}
    if len(dims) != 1:
        return None
    d, = dims
    size, lo = pieces[0][d][1] - pieces[0][d][0], want[d][0]
    return d if all(p[d] == (lo + i * size, lo + (i + 1) * size) for i, p in enumerate(pieces)) else None


@lru_cache(maxsize=4096)
def scatter(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
            dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> Scatter:
    """The reduce_scatter layout (`P -> S` on `axes`) at `coord`; see `Scatter`.

    >>> from sbp import S, Partial
    >>> scatter((8, 2), (4,), (Partial(),), (S(0),), (0,), (0,)).direct
    True
    >>> scatter((7, 2), (4,), (Partial(),), (S(0),), (0,), (0,)).runs   # 2,2,2,1 rows: one copy, one pad
    ((0, 0, 14),)
    >>> scatter((2, 4), (2,), (Partial(),), (S(1),), (0,), (0,)).stack   # columns: members side by side
    1
    """
    members = group_coords(mesh_shape, axes, coord)
    have = block(global_shape, mesh_shape, src, coord)
    pieces = [block(global_shape, mesh_shape, dst, c) for c in members]
    _check_tiling(pieces, have, "reduce_scatter", src, dst, axes)
    numels = tuple(block_numel(p) for p in pieces)
    width = max(numels)
    spans = [run_in(p, have) for p in pieces]
    in_order = chain(spans) == (0, block_numel(have))
    direct = in_order and len(set(numels)) == 1
    runs = None
    if in_order and not direct:
        moves: list[tuple[int, int, int]] = []
        for i, (span, n) in enumerate(zip(spans, numels)):
            if n == 0:
                continue
            if moves and moves[-1][0] + moves[-1][2] == span[0] and moves[-1][1] + moves[-1][2] == i * width:
                moves[-1] = (moves[-1][0], moves[-1][1], moves[-1][2] + n)
            else:
                moves.append((span[0], i * width, n))
        runs = tuple(moves)
    pads = _merge([(i * width + n, (i + 1) * width) for i, n in enumerate(numels)]) if not direct else ()
    me = members.index(coord)
    offsets = [i * width for i in range(len(pieces))]
    stack = None if direct or runs is not None else _stack_dim(pieces, have)
    return Scatter(me, block_shape(pieces[me]), width, numels, direct, runs, _places(pieces, have, offsets), pads,
                   stack)


@lru_cache(maxsize=4096)
def exchange_layout(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
                    dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> ExchangeLayout:
    """The all_to_all / transfer layout at `coord`; see `ExchangeLayout`.

    The rank's kept part rides in the collective (a local copy inside it) when that lets the send or
    receive buffer be the local or the result itself and so saves more copying than it adds.

    >>> from sbp import S
    >>> ex = exchange_layout((8, 8), (4,), (S(0),), (S(1),), (0,), (1,))
    >>> ex.recv_run, ex.send_run, ex.keep     # rows land in place; columns are packed, the kept one too
    ((0, 16), None, None)
    """
    ex = exchange_at(global_shape, mesh_shape, src, dst, axes, coord)
    me = ex.me
    have, want = block(global_shape, mesh_shape, src, coord), block(global_shape, mesh_shape, dst, coord)
    moves = group_moves(global_shape, mesh_shape, src, dst, axes, coord)
    options = [_exchange_option(ex.send, ex.recv, ex.size, me, ex.keep, have, want, carry)
               for carry in ((False, True) if moves and ex.keep is not None else (False,))]
    _, layout = min(options, key=lambda o: o[0])  # the first of equals: the kept part stays out
    return ExchangeLayout(block_shape(want), *layout, moves=moves)


def _exchange_option(send, recv, n: int, me: int, keep: Block | None, have: Block, want: Block, carry_keep: bool):
    """(elements copied on the way of the collective, layout fields) with or without the kept part carried:
    packing and unpacking count, and the kept part only when carried (a local copy inside the call; left
    out, it is copied while the call is in flight)."""
    def in_member_order(pairs) -> list[tuple[int, Block]]:
        out = list(pairs)   # (sorted by peer already)
        if carry_keep:
            out.append((me, keep))
            out.sort(key=lambda pb: pb[0])   # stable: the kept part after anything else for this member
        return out

    def splits(pairs) -> tuple[int, ...]:
        out = [0] * n   # (the collective needs one count per member; only the peers' are filled in)
        for peer, b in pairs:
            out[peer] += block_numel(b)
        return tuple(out)

    sending, receiving = in_member_order(send), in_member_order(recv)
    in_splits, out_splits = splits(sending), splits(receiving)
    flat_send = [b for _, b in sending]
    flat_recv = [b for _, b in receiving]
    send_run = chain([run_in(b, have) for b in flat_send])
    recv_run = chain([run_in(b, want) for b in flat_recv])
    offsets = lambda blocks: list(itertools.accumulate((block_numel(b) for b in blocks), initial=0))[:-1]
    kept = block_numel(keep) if carry_keep else 0
    cost = (0 if send_run else sum(in_splits)) + (0 if recv_run else sum(out_splits)) + kept
    local_keep = None if carry_keep or keep is None else (relative(keep, have), relative(keep, want))
    return cost, (in_splits, out_splits, send_run, _places(flat_send, have, offsets(flat_send)), recv_run,
                  _places(flat_recv, want, offsets(flat_recv)), local_keep)


@lru_cache(maxsize=4096)
def p2p_layout(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
               dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> P2PLayout:
    """The all_to_all / transfer messages at `coord`; see `P2PLayout`. A pair of members exchanges at most
    one block each way (`sbp.planning.exchange.exchange`: a member holds one source block).

    >>> from sbp import S, B
    >>> lay = p2p_layout((8, 8), (4,), (S(0),), (S(1),), (0,), (1,))
    >>> [(peer, run) for peer, run, _ in lay.sends]     # columns of the local: packed when sent
    [(2, None), (3, None), (0, None)]
    >>> [(peer, run) for peer, run, _, _ in lay.recvs]  # rows of the result: received in place
    [(0, (0, 4)), (2, (8, 12)), (3, (12, 16))]
    """
    ex = exchange_at(global_shape, mesh_shape, src, dst, axes, coord)
    me, n = ex.me, ex.size
    have, want = block(global_shape, mesh_shape, src, coord), block(global_shape, mesh_shape, dst, coord)
    sends = sorted(((peer, b) for peer, b in ex.send if block_numel(b)), key=lambda pb: (pb[0] - me) % n)
    recvs = [(peer, b) for peer, b in ex.recv if block_numel(b)]
    for what, pairs in (("sends", sends), ("receives", recvs)):
        if len({peer for peer, _ in pairs}) != len(pairs):
            raise PlanError(f"exchange on mesh axes {axes}, {src} -> {dst}: coord {coord} {what} two blocks with "
                            f"one peer: {pairs}")
    keep = ex.keep
    sends_at = tuple((peer, run_in(b, have), relative(b, have)) for peer, b in sends)
    recvs_at = tuple((peer, run_in(b, want), relative(b, want), block_shape(b)) for peer, b in recvs)
    copies = sum(block_numel(b) for (_, b), (_, run, _) in zip(sends, sends_at) if run is None) + \
        sum(block_numel(b) for (_, b), (_, run, _, _) in zip(recvs, recvs_at) if run is None)
    return P2PLayout(block_shape(want), sends_at, recvs_at,
                     None if keep is None or not block_numel(keep) else (relative(keep, have), relative(keep, want)),
                     group_moves(global_shape, mesh_shape, src, dst, axes, coord), copies)


@lru_cache(maxsize=4096)
def group_moves(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
                dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> bool:
    """Whether some member of the group through `coord` receives anything (else the step makes no call).
    Split evenly everywhere, every group is a translate of every other: the planner's `lack` over the mesh
    answers with no work per rank; otherwise the group's whole schedule does.

    >>> from sbp import S, B
    >>> group_moves((8, 8), (2, 2), (S(0), B), (S(0), S(1)), (1,), (0, 0))      # a slice: nobody receives
    False
    >>> group_moves((8, 8), (2, 2), (S(0), S(1)), (S(0), B), (1,), (0, 0))
    True
    """
    if _even(global_shape, mesh_shape, src) and _even(global_shape, mesh_shape, dst):
        return Costing(global_shape, mesh_shape, 1).lack(src, dst) > 0
    return exchange(global_shape, mesh_shape, src, dst, axes, coord).max_recv_elems > 0


def _even(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], pls: tuple[Placement, ...]) -> bool:
    pieces = [1] * len(global_shape)
    for a, p in enumerate(pls):
        if isinstance(p, Split):
            pieces[p.dim] *= mesh_shape[a]
    return all(n % k == 0 for n, k in zip(global_shape, pieces))


@lru_cache(maxsize=4096)
def messages_copy_nothing(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
                          dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> bool:
    """Whether the group through `coord` should exchange by messages rather than one all_to_all_single:
    yes when no member's messages need packing or unpacking (every block is one run of the local it
    leaves and of the result it enters). Every member computes the same answer, so the group takes
    one route.

    Measured on gloo (`docs/execution.md`): zero-copy messages beat the collective, most where one
    block goes to two peers (the collective's buffer holds it twice) or members have nothing to move
    (they take no part); once blocks must be packed, the one collective is faster even when the
    messages would copy fewer elements.

    >>> from sbp import S, B
    >>> messages_copy_nothing((8, 8), (4,), (S(0),), (S(1),), (0,), (0,))             # columns are packed
    False
    >>> messages_copy_nothing((8, 8), (2, 2), (S(0), S(0)), (B, S(0)), (0, 1), (0, 0))  # rows to two peers
    True
    """
    where = (global_shape, mesh_shape, src, dst, axes)
    return not any(p2p_layout(*where, c).copies for c in group_coords(mesh_shape, axes, coord))
