"""Exact point-to-point exchanges: who sends which block to whom when a group changes layout.

For a change between two Split/Broadcast states on the group along `axes`, every member receives
exactly the part of its destination block that its source block lacks. Pieces replicated on several
members (Broadcast axes) are taken from a holder chosen round-robin, so senders share the load.

`reduce_exchange` is the two-phase version for groups with Partial axes (a ``reduce_transfer``
step): each piece of the target is reduced at one owner, a member that needs it, then sent from there
to the other members that need it.
Pure: the planner uses both for exact byte counts and the executor for buffer sizes.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Optional

from ..values.errors import PlanError
from ..values.layout import Block, block, block_numel, intersect, split_range
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, Split
from .states import BROADCAST_CODE, split_code


@dataclass(frozen=True, slots=True)
class Exchange:
    """The exchange schedule of one group.

    `members` are mesh coords, row-major over `axes`. `recv[i]` lists ``(peer, block)`` pairs that member
    `i` receives (peer indices into `members`, global blocks), `send[i]` the ``(peer, block)`` pairs it sends,
    both ordered by peer. `keep[i]` is the part of the destination block member `i` already holds.
    """

    members: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[tuple[int, Block], ...], ...]
    send: tuple[tuple[tuple[int, Block], ...], ...]
    keep: tuple[Block | None, ...]

    @property
    def max_recv_elems(self) -> int:
        """Elements received by the busiest member."""
        return max((sum(block_numel(b) for _, b in r) for r in self.recv), default=0)


@lru_cache(maxsize=65536)
def exchange(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
             dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> Exchange:
    """The schedule for the group along `axes` that contains `coord` (placements normalised, no Partial).

    >>> from sbp import S, B
    >>> ex = exchange((4,), (2,), (S(0),), (B,), (0,), (0,))
    >>> ex.recv
    (((1, ((2, 4),)),), ((0, ((0, 2),)),))
    """
    if not self_contained(src, dst, axes):
        raise PlanError(f"an exchange on mesh axes {axes} cannot turn {src} into {dst}: the group does not "
                        f"hold one contiguous block (a Partial axis in it, or an axis outside it splitting a "
                        f"dim after one inside it)")
    mesh = DeviceMesh(mesh_shape)
    members = []
    for rank in _group(mesh, axes, coord):
        members.append(mesh.coord_of(rank))
    src_blocks = [block(global_shape, mesh_shape, src, m) for m in members]
    dst_blocks = [block(global_shape, mesh_shape, dst, m) for m in members]
    holders: dict[Block, list[int]] = {}
    for i, b in enumerate(src_blocks):
        holders.setdefault(b, []).append(i)
    recv: list[list[tuple[int, Block]]] = [[] for _ in members]
    send: list[list[tuple[int, Block]]] = [[] for _ in members]
    keep = []
    for i, want in enumerate(dst_blocks):
        own = src_blocks[i]
        keep.append(intersect(own, want))
        for tile, who in holders.items():
            if tile == own:
                continue
            piece = intersect(tile, want)
            if piece is None:
                continue
            peer = who[i % len(who)]
            recv[i].append((peer, piece))
            send[peer].append((i, piece))
    order = lambda pairs: tuple(sorted(pairs, key=lambda pb: pb[0]))
    return Exchange(tuple(members), tuple(order(r) for r in recv), tuple(order(s) for s in send), tuple(keep))


@dataclass(frozen=True, slots=True)
class ExchangeAt:
    """One member's part of `exchange`'s schedule: the group's size, the member's index `me`, what it
    receives (`recv`) and sends (`send`) as ``(peer, block)`` pairs ordered by peer, and `keep`."""

    size: int
    me: int
    recv: tuple[tuple[int, Block], ...]
    send: tuple[tuple[int, Block], ...]
    keep: Block | None


@lru_cache(maxsize=65536)
def exchange_at(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
                dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> ExchangeAt:
    """`exchange`'s schedule seen from `coord` alone, equal to its entries for `coord`, with work that
    grows with the member's peers, not with the group: the source tiles meeting its target block are
    found per dim by walking the splits and dropping ranges that miss it, and a tile's holder is picked
    by arithmetic on the member index (members are row-major over `axes`; the holders of a tile differ
    on the group's Broadcast axes only).

    >>> from sbp import S, B
    >>> ex = exchange((8, 8), (2, 4), (S(0), S(1)), (S(1), S(0)), (0, 1), (1, 2))
    >>> at = exchange_at((8, 8), (2, 4), (S(0), S(1)), (S(1), S(0)), (0, 1), (1, 2))
    >>> (at.recv, at.send, at.keep) == (ex.recv[at.me], ex.send[at.me], ex.keep[at.me])
    True
    """
    if not self_contained(src, dst, axes):
        raise PlanError(f"an exchange on mesh axes {axes} cannot turn {src} into {dst}: the group does not "
                        f"hold one contiguous block (a Partial axis in it, or an axis outside it splitting a "
                        f"dim after one inside it)")
    index = lambda c: _row_major(c, axes, mesh_shape)
    me = index(coord)
    have, want = block(global_shape, mesh_shape, src, coord), block(global_shape, mesh_shape, dst, coord)
    free_src = [a for a in axes if not isinstance(src[a], Split)]
    free_dst = [a for a in axes if not isinstance(dst[a], Split)]
    n_src = math.prod(mesh_shape[a] for a in free_src)
    recv = []
    for digits, tile in _tiles_meeting(global_shape, mesh_shape, src, axes, coord, want):
        if tile == have:
            continue
        peer = dict(digits)
        k = me % n_src
        for a in reversed(free_src):
            k, peer[a] = divmod(k, mesh_shape[a])
        recv.append((index(tuple(peer.get(a, c) for a, c in enumerate(coord))), intersect(tile, want)))
    me_among = 0  # my place among my tile's holders
    for a in free_src:
        me_among = me_among * mesh_shape[a] + coord[a]
    send = []
    for digits, tile in _tiles_meeting(global_shape, mesh_shape, dst, axes, coord, have):
        for rest in itertools.product(*(range(mesh_shape[a]) for a in free_dst)):
            other = dict(digits)
            other.update(zip(free_dst, rest))
            c = tuple(other.get(a, x) for a, x in enumerate(coord))
            j = index(c)
            if j % n_src == me_among and block(global_shape, mesh_shape, src, c) != have:
                send.append((j, intersect(have, tile)))
    by_peer = lambda pairs: tuple(sorted(pairs, key=lambda pb: pb[0]))
    return ExchangeAt(math.prod(mesh_shape[a] for a in axes), me, by_peer(recv), by_peer(send), intersect(have, want))


def _row_major(coord: tuple[int, ...], axes: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    k = 0
    for a in axes:
        k = k * mesh_shape[a] + coord[a]
    return k


def _tiles_meeting(global_shape, mesh_shape, pls, axes, coord, target: Block):
    """(digits on the group axes splitting a dim, block) of every block of `pls` held in the group through
    `coord` that meets `target` (non-empty intersection), walking each dim's splits and pruning."""
    if any(hi <= lo for lo, hi in target):
        return
    per_dim = []
    for d, (tlo, thi) in enumerate(target):
        options = [((), 0, global_shape[d])]   # (digits so far, lo, hi)
        for a, p in enumerate(pls):
            if not (isinstance(p, Split) and p.dim == d):
                continue
            n = mesh_shape[a]
            grown = []
            for digits, lo, hi in options:
                for i in (range(n) if a in axes else (coord[a],)):
                    clo, chi = split_range(lo, hi, n, i)
                    if clo < chi and clo < thi and tlo < chi:
                        grown.append((digits + ((a, i),) if a in axes else digits, clo, chi))
            options = grown
        per_dim.append([o for o in options if o[1] < o[2] and o[1] < thi and tlo < o[2]])
    for combo in itertools.product(*per_dim):
        yield tuple(x for digits, _, _ in combo for x in digits), tuple((lo, hi) for _, lo, hi in combo)


Pairs = tuple[tuple[int, Block], ...]  # (peer, block) pairs, ordered by peer


@dataclass(frozen=True, slots=True)
class ReduceExchange:
    """The two-phase schedule of one group of a ``reduce_transfer`` step.

    `members` are mesh coords, row-major over `axes`. Every piece of the target is reduced at one
    owner: `owned[i]` lists the blocks member `i` reduces, each with whether its own contribution is
    part of it. Phase 1: member `i` receives the contributions of its owned blocks that it lacks
    (`recv1[i]`, one block per contribution, equal to an owned block) and sends `send1[i]` out of its
    source block. Phase 2: it receives the reduced blocks it needs from their owners (`recv2[i]`) and
    sends its reduced blocks to the other members that need them (`send2[i]`). For one (sender,
    receiver) pair the send and receive lists are in the same order.
    """

    members: tuple[tuple[int, ...], ...]
    owned: tuple[tuple[tuple[Block, bool], ...], ...]
    recv1: tuple[Pairs, ...]
    send1: tuple[Pairs, ...]
    recv2: tuple[Pairs, ...]
    send2: tuple[Pairs, ...]

    def recv_elems(self, i: int) -> int:
        """Elements member `i` receives over both phases."""
        return sum(block_numel(b) for _, b in self.recv1[i] + self.recv2[i])

    @property
    def max_recv_elems(self) -> int:
        """Elements received by the busiest member, both phases together."""
        return max(self.recv_elems(i) for i in range(len(self.members)))


@lru_cache(maxsize=65536)
def reduce_exchange(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Placement, ...],
                    dst: tuple[Placement, ...], axes: tuple[int, ...], coord: tuple[int, ...]) -> ReduceExchange:
    """The reduce-then-deliver schedule for the group along `axes` that contains `coord`.

    `src` has same-op Partial axes in the group (its other group axes Split/Broadcast), `dst` only
    Split/Broadcast there (`reducible`). A destination tile (the block a set of members need) is cut
    by the source tiles into pieces; each piece is shared out in balanced slabs among the members
    that need it and already hold one contribution of it (or, when none does, all that need it).
    The owner of a slab receives the contributions it lacks (one per Partial coord, all from its own
    replica of the Broadcast axes before a Partial axis), reduces them, and sends the result to every
    other member that needs it. A member so receives, per slab it owns,
    ``q - 1`` contributions (``q`` without its own), and every other slab of its block once.

    Per-rank table, 2x2 mesh, 4 rows, ``(P, S(0)) -> (S(0), B)`` (member = (p, h) holds contribution
    p of row half h and needs row half p of the result):

    >>> from sbp import S, B, Partial
    >>> ex = reduce_exchange((4,), (2, 2), (Partial(), S(0)), (S(0), B), (0, 1), (0, 0))
    >>> ex.owned[0]        # (0, 0) reduces rows 0-1, its own contribution included
    ((((0, 2),), True),)
    >>> ex.recv1[0]        # ... receiving contribution 1 of them from member 2 = (1, 0)
    ((2, ((0, 2),)),)
    >>> ex.recv2[1]        # (0, 1) receives the reduced rows 0-1 from their owner (0, 0)
    ((0, ((0, 2),)),)
    >>> [ex.recv_elems(i) for i in range(4)]
    [2, 2, 2, 2]
    """
    if not reducible(src, dst, axes):
        raise PlanError(f"a reduce_transfer on mesh axes {axes} cannot turn {src} into {dst}: it needs "
                        f"same-op Partial axes in the group, Split/Broadcast targets there, no Partial axis "
                        f"of another op after them, and a group that holds one contiguous block")
    mesh = DeviceMesh(mesh_shape)
    members = [mesh.coord_of(r) for r in _group(mesh, axes, coord)]
    lists = reduce_schedule(members, [block(global_shape, mesh_shape, src, m) for m in members],
                            [block(global_shape, mesh_shape, dst, m) for m in members], *contributions(src, axes))
    order = lambda pairs: tuple(tuple(sorted(p, key=lambda pb: pb[0])) for p in pairs)
    return ReduceExchange(tuple(members), tuple(map(tuple, lists[0])), *map(order, lists[1:]))


def contributions(src: tuple[Placement, ...], axes: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The group's Partial axes (a member's coords there name its contribution) and its Broadcast axes
    before the last of them. Replicas along those agree only once reduced, so one element's
    contributions must all come from one replica of them (later Broadcast replicas are exact copies)."""
    pax = [a for a in axes if isinstance(src[a], Partial)]
    return pax, [a for a in axes if isinstance(src[a], Broadcast) and a < pax[-1]]


def reduce_schedule(members: list[tuple[int, ...]], src_blocks: list[Block], dst_blocks: list[Block],
                    pax: list[int], outer: list[int]) -> tuple[list[list], ...]:
    """The lists of `ReduceExchange` (owned, recv1, send1, recv2, send2; unsorted) for one group, from
    its members' coords and blocks."""
    holders: dict[Block, dict[tuple[int, ...], dict[tuple[int, ...], list[int]]]] = {}  # tile, replica, contribution
    for i, (m, b) in enumerate(zip(members, src_blocks)):
        replicas = holders.setdefault(b, {}).setdefault(tuple(m[a] for a in outer), {})
        replicas.setdefault(tuple(m[a] for a in pax), []).append(i)
    n = len(members)
    owned: list[list[tuple[Block, bool]]] = [[] for _ in range(n)]
    recv1, send1, recv2, send2 = ([[] for _ in range(n)] for _ in range(4))
    for need, o, slab, source in _slab_owners(src_blocks, dst_blocks):
        holds = src_blocks[o] == source
        owned[o].append((slab, holds))
        replicas = holders[source]
        replica = replicas[tuple(members[o][a] for a in outer)] if holds else list(replicas.values())[o % len(replicas)]
        for who in replica.values():  # one list of holders per contribution
            if holds and o in who:
                continue
            peer = who[o % len(who)]
            recv1[o].append((peer, slab))
            send1[peer].append((o, slab))
        for i in need:
            if i != o:
                recv2[i].append((o, slab))
                send2[o].append((i, slab))
    return owned, recv1, send1, recv2, send2


def reduce_recv_max(src_blocks: list[Block], dst_blocks: list[Block], contributions: int) -> int:
    """Elements the busiest member receives in `reduce_schedule` (both phases), from sizes alone.

    A member receives its target tile but the slabs it owns, and per slab it owns every contribution
    but the one it holds. Per tile, what decides is how many members need it and, per source tile its
    needers hold that meets it, the shape of their piece, the first such needer's position and their
    count (`reduce_recv_max_tiles`).

    >>> reduce_recv_max([((0, 2),), ((2, 4),)] * 2, [((0, 2),)] * 2 + [((2, 4),)] * 2, 2)
    2
    """
    tiles = []
    for tile, need in _needers(dst_blocks).items():
        held: dict[Block, list[int]] = {}   # source held by a needer: [first needer's position, needers]
        for pos, i in enumerate(need):
            b = src_blocks[i]
            if b in held:
                held[b][1] += 1
            else:
                held[b] = [pos, 1]
        own = []
        for b, (first, n) in held.items():
            shape = tuple(min(hi, c) - max(lo, a) for (lo, hi), (a, c) in zip(tile, b))
            if all(k > 0 for k in shape):
                own.append(shape + (first, n))
        tiles.append((tile, len(need), tuple(own)))
    return reduce_recv_max_tiles(src_blocks, tiles, contributions)


def reduce_recv_max_tiles(sources: list[Block], tiles, contributions: int) -> int:
    """`reduce_recv_max` from its tiles: (tile, members needing it, per source tile held by one of them that
    meets the tile, in the order of their first needers: its piece's per-dim lengths followed by the first
    needer's position and the needers' count, one tuple); `sources`: the members' source tiles (repeats
    allowed), or a `complete_grid` of them.

    Slabs are balanced, so their sizes never grow along the owners' order: the busiest member of a tile is
    the first holder of some source tile (its own slab the first one), or the first member (of the slabs
    no member holds), so per tile only those are priced. The pieces of a tile are counted by shape, per dim
    (`_SourceGrid.length_counts`) less the held ones; tiles with the same counts, needers and held pieces
    have the same answer, computed once. With one contribution (owning a slab lowers what a member
    receives), the busiest is a needer holding no piece of the tile, or the last needer of some source.

    >>> reduce_recv_max_tiles([((0, 2),), ((2, 4),)], [(((0, 2),), 2, ((2, 0, 1),))], 2)
    2
    """
    q, best = contributions, 0
    grid = sources if isinstance(sources, _SourceGrid) else _SourceGrid(sources)
    done: set[tuple] = set()
    for tile, nneed, own in tiles:
        if grid.complete:
            per_dim = tuple(grid.length_counts(d, r) for d, r in enumerate(tile))
            key = (per_dim, nneed, own)
            if key in done:
                continue
            done.add(key)
            counts: dict[tuple[int, ...], int] = {(): 1}
            total = 1
            for length, by_length in per_dim:   # every combination of one source range per dim is a piece
                total *= length
                counts = {shape + (n,): c * k for shape, c in counts.items() for n, k in by_length}
        else:
            counts, total = {}, 0
            for _, piece in grid.pieces(tile, grid.met(tile)):
                shape = tuple(hi - lo for lo, hi in piece)
                counts[shape] = counts.get(shape, 0) + 1
                total += math.prod(shape)
        for row in own:   # the held pieces are no slabs to receive
            counts[row[:-2]] -= 1
        if q < 2:
            if sum(row[-1] for row in own) < nneed:   # some needer holds none of the tile: receives it all
                best = max(best, total)
            else:
                best = max(best, total - min(slab_numel(row[:-2], row[-1], row[-1] - 1) for row in own))
            continue
        first_own = {row[-2]: row for row in own}
        # a slab of each piece at position k: `small`, or `big` for k below `rem` (`_slab_split`): per position
        # the smalls' sum plus the extras of the shapes whose `rem` exceeds it
        smalls, extras = 0, []
        for shape, n in counts.items():
            if n:
                small, big, rem = _slab_split(shape, nneed)
                smalls += n * small
                if rem:
                    extras.append((rem, n * (big - small)))
        extras.sort()
        rems, after = [r for r, _ in extras], list(itertools.accumulate(e for _, e in reversed(extras)))[::-1] + [0]
        for pos in {0} | set(first_own):
            recv = total + (smalls + after[bisect.bisect_right(rems, pos)]) * (q - 1)
            row = first_own.get(pos)
            if row is not None:  # its slab of the piece it holds, shared with the needers holding the same block
                recv += slab_numel(row[:-2], row[-1], 0) * (q - 2)
            best = max(best, recv)
    return best


def slab_numel(lengths: tuple[int, ...], parts: int, k: int) -> int:
    """Elements of slab `k` of `_slabs` (a piece of these per-dim lengths cut into `parts`), without
    building the slabs."""
    if parts == 1 or not lengths:
        return math.prod(lengths) if k == 0 else 0
    small, big, rem = _slab_split(lengths, parts)
    return big if k < rem else small


def _slab_split(lengths: tuple[int, ...], parts: int) -> tuple[int, int, int]:
    """The slabs of `_slabs` (a piece of these per-dim lengths cut into `parts`, parts >= 1) by size: each of
    the first ``rem`` holds ``big`` elements, the others ``small`` (for one part: the piece, ``rem`` 0)."""
    if parts == 1 or not lengths:
        return math.prod(lengths), math.prod(lengths), 0
    d = next((d for d, n in enumerate(lengths) if n >= parts), lengths.index(max(lengths)))
    n = lengths[d]
    if not n:
        return 0, 0, 0
    unit = math.prod(lengths) // n
    return unit * (n // parts), unit * (n // parts + 1), n % parts


def complete_grid(cuts: list[list[tuple[int, int]]]):
    """The source tiles of a group given as their per-dim ranges (sorted, distinct) when every combination of
    them is a tile (a complete grid), for `reduce_recv_max_tiles` in place of the tiles listed: nothing per
    tile is built.

    >>> reduce_recv_max_tiles(complete_grid([[(0, 2), (2, 4)]]), [(((0, 2),), 2, ((2, 0, 1),))], 2)
    2
    """
    return _SourceGrid([], cuts)


def _needers(dst_blocks: list[Block]) -> dict[Block, list[int]]:
    """Per destination tile, the members needing it (in member order)."""
    out: dict[Block, list[int]] = {}
    for i, b in enumerate(dst_blocks):
        out.setdefault(b, []).append(i)
    return out


class _SourceGrid:
    """The distinct source tiles of a group. They are disjoint and tile the group's block as a grid (per
    dim, a partition), so the tiles a destination tile meets are found per dim by bisection, not by
    trying every tile; `complete` when every combination of per-dim ranges is a tile."""

    def __init__(self, src_blocks: list[Block], cuts: Optional[list] = None) -> None:
        self.sources = list(dict.fromkeys(src_blocks))
        self.ndim = len(self.sources[0]) if self.sources else len(cuts or ())
        if cuts is None:
            cuts = [sorted({b[d] for b in self.sources}) for d in range(self.ndim)]
        self.cuts = cuts   # per dim, in order
        self.his = [[hi for _, hi in c] for c in self.cuts]
        self.complete = self.ndim > 0 and (not self.sources or len(self.sources) == math.prod(map(len, self.cuts)))
        self._order: Optional[dict] = None
        self._met_memo: dict[tuple, list] = {}
        self._counts: dict[tuple, tuple] = {}

    def met(self, tile: Block) -> list[list[tuple[int, int]]]:
        """Per dim, the non-empty source ranges that `tile`'s range meets."""
        return [self._met(d, r) for d, r in enumerate(tile)]

    def length_counts(self, d: int, r: tuple[int, int]) -> tuple[int, tuple[tuple[int, int], ...]]:
        """For range `r` of dim `d`: its length covered by source ranges, and its pieces counted by length
        ((length, count) pairs, in order)."""
        key = (d, r)
        out = self._counts.get(key)
        if out is None:
            lo, hi = r
            counts: dict[int, int] = {}
            for a, c in self._met(d, r):
                n = (hi if hi < c else c) - (lo if lo > a else a)
                counts[n] = counts.get(n, 0) + 1
            out = self._counts[key] = (sum(n * k for n, k in counts.items()), tuple(sorted(counts.items())))
        return out

    def _met(self, d: int, r: tuple[int, int]) -> list[tuple[int, int]]:
        out = self._met_memo.get((d, r))
        if out is None:
            lo, hi = r
            c = self.cuts[d]
            k = bisect.bisect_right(self.his[d], lo)
            out = []
            while k < len(c) and c[k][0] < hi:
                if c[k][1] > c[k][0] and c[k][1] > lo:
                    out.append(c[k])
                k += 1
            self._met_memo[(d, r)] = out
        return out

    def pieces(self, tile: Block, per_dim: list) -> list[tuple[Block, Block]]:
        """The (source tile, non-empty piece) pairs `tile` is cut into, in the sources' first appearance."""
        order = self._order
        if order is None:   # (built on first use: complete grids never need it)
            order = self._order = {b: k for k, b in enumerate(self.sources)}
        hits = [src for src in itertools.product(*per_dim) if src in order] if self.ndim else self.sources
        out = []
        for source in sorted(hits, key=order.__getitem__):
            piece = tuple((max(a, b), min(c, e)) for (a, c), (b, e) in zip(tile, source))
            if all(hi > lo for lo, hi in piece):
                out.append((source, piece))
        return out


def _slab_owners(src_blocks: list[Block], dst_blocks: list[Block]) -> Iterator[tuple[list[int], int, Block, Block]]:
    """(members needing it, owner, slab, the source tile holding it) for every slab:
    each destination tile is cut by the source tiles into pieces, and each piece into balanced slabs,
    one per member that needs it and holds a contribution of it (or, when none does, that needs it)."""
    holders: dict[Block, set[int]] = {}
    for i, b in enumerate(src_blocks):
        holders.setdefault(b, set()).add(i)
    grid = _SourceGrid(src_blocks)
    for tile, need in _needers(dst_blocks).items():
        for source, piece in grid.pieces(tile, grid.met(tile)):
            held = holders[source]
            owners = [i for i in need if i in held] or need
            if len(owners) == 1:
                yield need, owners[0], piece, source
                continue
            for o, slab in zip(owners, _slabs(piece, len(owners))):
                if slab is not None:
                    yield need, o, slab, source


def reducible(src: tuple[Placement, ...], dst: tuple[Placement, ...], axes: tuple[int, ...]) -> bool:
    """True when a ``reduce_transfer`` on `axes` can turn `src` into `dst`: the group's Partial axes
    (at least one) share one op and no Partial axis of another op comes after them; every group axis
    ends Split/Broadcast; other axes keep their placement; and the group holds one contiguous block
    (`self_contained`, a Partial axis counting as Broadcast).

    >>> from sbp import S, B, Partial
    >>> reducible((Partial(), S(0)), (S(0), B), (0, 1)), reducible((Partial(), Partial("max")), (B, B), (0, 1))
    (True, False)
    """
    pax = [a for a in axes if isinstance(src[a], Partial)]
    if not pax or len({src[a] for a in pax}) > 1:
        return False
    if any(src[a] != dst[a] for a in range(len(src)) if a not in axes):
        return False
    if any(isinstance(src[b], Partial) and src[b] != src[pax[0]] for b in range(pax[0] + 1, len(src))):
        return False
    flat = tuple(Broadcast() if a in pax else p for a, p in enumerate(src))
    return self_contained(flat, dst, axes)


def _slabs(piece: Block, parts: int) -> list[Block | None]:
    """`piece` cut into `parts` balanced slabs along its outermost dim long enough (else its longest
    one); None for an empty slab. A 0-d piece (one element) is not cut."""
    if parts == 1 or not piece:
        return [piece] + [None] * (parts - 1)
    lengths = [hi - lo for lo, hi in piece]
    d = next((d for d, n in enumerate(lengths) if n >= parts), lengths.index(max(lengths)))
    out = []
    for k in range(parts):
        lo, hi = split_range(piece[d][0], piece[d][1], parts, k)
        out.append(piece[:d] + ((lo, hi),) + piece[d + 1:] if hi > lo else None)
    return out


def self_contained(src: tuple[Placement, ...], dst: tuple[Placement, ...], axes: tuple[int, ...]) -> bool:
    """True when the group along `axes` holds one contiguous block in both states (and no Partial axis
    is in the group): per dim, every splitter outside the group comes before every splitter inside it.

    >>> from sbp import S, B
    >>> self_contained((S(0), S(0)), (B, S(0)), (0,)), self_contained((S(0), S(0)), (B, S(0)), (0, 1))
    (False, True)
    """
    return contained(tuple(map(split_code, src)), tuple(map(split_code, dst)), axes)


def contained(src: tuple[int, ...], dst: tuple[int, ...], axes: tuple[int, ...]) -> bool:
    """`self_contained` on `split_code`s (the planner's hot loop works on them).

    >>> contained((0, 0), (BROADCAST_CODE, 0), (0,)), contained((0, 0), (BROADCAST_CODE, 0), (0, 1))
    (False, True)
    """
    for state in (src, dst):
        inside: set[int] = set()  # dims split in the group so far
        for a, d in enumerate(state):
            if a in axes:
                if d > BROADCAST_CODE:  # S(d)
                    inside.add(d)
                elif d < BROADCAST_CODE:  # a Partial axis in the group
                    return False
            elif d in inside:  # an outside splitter after an inside one
                return False
    return True


CACHES = (("exchange.exchange", exchange), ("exchange.exchange_at", exchange_at),
          ("exchange.reduce_exchange", reduce_exchange))
"""The memos of this module, by name (`sbp.planning.clear_caches` clears them)."""


def _group(mesh: DeviceMesh, axes: tuple[int, ...], coord: tuple[int, ...]) -> tuple[int, ...]:
    rank = mesh.rank_of(coord)
    for g in mesh.groups(axes):
        if rank in g:
            return g
    raise AssertionError("coord not in mesh")  # pragma: no cover
