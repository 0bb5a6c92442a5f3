"""Cross-mesh plans: move a global tensor between two meshes (other ranks and/or another mesh shape).

Planning is by exact intersections. Each destination rank receives exactly the bytes of its target
block that it does not already hold, from one chosen source holder per piece; when a piece is
replicated (Broadcast axes) the holder with the least load so far sends it, so senders share the
work. Partial sources are either reduced inside the source mesh first (a planned redistribution) or
sent as contributions and reduced at the destination, whichever makes the busiest rank receive less.
Pure: every rank computes the same plan.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

from ..values.errors import MeshError, PlanError
from ..values.layout import Block, block, block_numel, check_global_shape, intersect
from ..values.mesh import DeviceMesh, as_ints
from ..values.placement import Broadcast, Partial, Placement, Split, normalize
from ..values.steps import Plan
from .search import plan_cached


@dataclass(frozen=True, slots=True)
class Piece:
    """One point-to-point piece: `src_rank` sends `block` (global index ranges) to `dst_rank`.

    `part` numbers the Partial contribution the piece belongs to (0 when the source is not Partial).
    """

    src_rank: int
    dst_rank: int
    block: Block
    part: int = 0

    def numel(self) -> int:
        """Elements in the piece."""
        return block_numel(self.block)


@dataclass(frozen=True, slots=True)
class CrossMeshPlan:
    """A cross-mesh redistribution: `pre` (inside the source mesh), `pieces`, then `post` (local moves).

    `mid` are the source-mesh placements after `pre`; `land` the destination-mesh placements the pieces
    build, from which `post` reaches `dst` without communication. `parts` > 1 means the pieces carry
    Partial contributions that the destination reduces with `op`.

    >>> import sbp
    >>> p = sbp.plan_cross_mesh((8, 4), sbp.DeviceMesh((2,), ranks=[0, 1]), "S(0)",
    ...                         sbp.DeviceMesh((2,), ranks=[2, 3]), "S(0)")
    >>> p.bytes_per_rank, p.transfer_bytes, p.lower_bound_total, [(x.src_rank, x.dst_rank) for x in p.pieces]
    (64, 128, 128, [(0, 2), (1, 3)])
    """

    global_shape: tuple[int, ...]
    src_mesh: DeviceMesh
    dst_mesh: DeviceMesh
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    itemsize: int
    pre: Plan
    mid: tuple[Placement, ...]
    pieces: tuple[Piece, ...]
    land: tuple[Placement, ...]
    post: Plan
    parts: int
    op: Optional[str]
    lower_bound: int
    lower_bound_total: int
    by_rank: dict[int, tuple[Piece, ...]] = field(default_factory=dict, compare=False, repr=False)
    """The pieces each world rank sends or receives (its own included), in plan order; others: none."""

    def pieces_of(self, rank: int) -> tuple[Piece, ...]:
        """The pieces `rank` sends or receives (or keeps), in plan order: what it packs and assembles.

        >>> import sbp
        >>> p = sbp.plan_cross_mesh((4,), sbp.DeviceMesh((2,)), "S(0)", sbp.DeviceMesh((2,), ranks=[2, 3]), "S(0)")
        >>> [(x.src_rank, x.dst_rank, x.block) for x in p.pieces_of(3)]
        [(1, 3, ((2, 4),))]
        """
        return self.by_rank.get(rank, ())

    @property
    def received(self) -> dict[int, int]:
        """Bytes each world rank receives in the piece phase."""
        return self._volumes(lambda p: p.dst_rank)

    @property
    def sent(self) -> dict[int, int]:
        """Bytes each world rank sends in the piece phase."""
        return self._volumes(lambda p: p.src_rank)

    def _volumes(self, rank_of) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self.pieces:
            if p.src_rank != p.dst_rank:
                out[rank_of(p)] = out.get(rank_of(p), 0) + p.numel() * self.itemsize
        return out

    @property
    def transfer_bytes(self) -> int:
        """Bytes moved between ranks in the piece phase, summed over destination ranks."""
        return sum(self.received.values())

    @property
    def bytes_per_rank(self) -> int:
        """Bytes the busiest rank receives: the source-side plan plus the piece phase."""
        return self.pre.bytes_per_rank + max(self.received.values(), default=0)

    @property
    def num_collectives(self) -> int:
        """Collectives of the source-side plan plus one exchange when pieces move."""
        return self.pre.num_collectives + int(bool(self.received))

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every world rank that takes part (the union of both meshes), sorted."""
        return tuple(sorted(set(self.src_mesh.ranks) | set(self.dst_mesh.ranks)))

    def __repr__(self) -> str:   # the pieces counted, not listed: a 16k-rank plan has ~10^5 of them
        return (f"CrossMeshPlan(global_shape={self.global_shape}, src_mesh={self.src_mesh!r}, src={self.src}, "
                f"dst_mesh={self.dst_mesh!r}, dst={self.dst}, itemsize={self.itemsize}, "
                f"bytes_per_rank={self.bytes_per_rank}, pieces={len(self.pieces)})")

    def explain(self, limit: Optional[int] = 64) -> str:
        """EXPLAIN-style text: the source-side steps, then one line per sender -> receiver with volumes (the
        first `limit` of them, then one line counting the rest; None: all)."""
        lines = [f"CrossMeshPlan {self.src} on {self.src_mesh!r} -> {self.dst} on {self.dst_mesh!r}  "
                 f"shape={self.global_shape} itemsize={self.itemsize}",
                 f"  bytes/rank={self.bytes_per_rank} (lower bound {self.lower_bound})  "
                 + (f"moved={self.transfer_bytes} (lower bound {self.lower_bound_total})  " if not self.pre.steps
                    else f"moved={self.transfer_bytes} in the send phase (lower bound {self.lower_bound_total} for "
                         f"both phases)  ")
                 + f"collectives={self.num_collectives}"]
        for i, s in enumerate(self.pre.steps, 1):
            lines.append(f"  pre {i}. axes[{','.join(map(str, s.axes))}] {s.kind}{f'({s.op})' if s.op else ''} "
                         f"{s.src} -> {s.dst}  bytes={s.bytes}")
        what = f" ({self.parts} Partial contributions, reduced with {self.op} at the destination)" \
            if self.parts > 1 else ""
        lines.append(f"  send {self.mid} -> {self.land}{what}:")
        volumes: dict[tuple[int, int], int] = {}
        for p in self.pieces:
            if p.src_rank != p.dst_rank:
                key = (p.src_rank, p.dst_rank)
                volumes[key] = volumes.get(key, 0) + p.numel() * self.itemsize
        messages = sorted(volumes.items())
        for (s, d), v in messages[:limit]:
            lines.append(f"    rank {s} -> rank {d}: {v} bytes")
        if limit is not None and len(messages) > limit:
            rest = messages[limit:]
            lines.append(f"    ... {len(rest)} more messages, {sum(v for _, v in rest)} bytes "
                         f"(explain(limit=None) lists them all)")
        if not volumes:
            lines.append("    (nothing moves between ranks)")
        for s in self.post.steps:
            lines.append(f"  post: {s.kind} {s.src} -> {s.dst}")
        return "\n".join(lines)


def plan_cross_mesh(global_shape: Sequence[int], src_mesh: DeviceMesh, src, dst_mesh: DeviceMesh, dst,
                    itemsize: int = 4) -> CrossMeshPlan:
    """Plan moving a tensor from `src` placements on `src_mesh` to `dst` placements on `dst_mesh`.

    Both meshes are pure values whose `ranks` are world ranks (disjoint, overlapping or nested sets).

    >>> import sbp
    >>> a, b = sbp.DeviceMesh((2,), ranks=[0, 1]), sbp.DeviceMesh((2, 2))
    >>> p = sbp.plan_cross_mesh((4, 4), a, "S(0)", b, "S(1), S(0)")
    >>> p.bytes_per_rank == p.lower_bound
    True
    """
    shape = check_global_shape(global_shape)
    for name, m in (("src_mesh", src_mesh), ("dst_mesh", dst_mesh)):
        if not isinstance(m, DeviceMesh):
            raise MeshError(f"{name} must be a sbp.DeviceMesh (with the world ranks it covers), got {type(m).__name__}")
    s = normalize(src, len(shape), src_mesh.ndim)
    d = normalize(dst, len(shape), dst_mesh.ndim)
    size = as_ints((itemsize,))
    if size is None or size[0] < 1:
        raise PlanError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    itemsize = size[0]
    key = lambda m: DeviceMesh(m.shape, m.names, m.ranks, m.device_type)  # drop the binding for caching
    return _cross_cached(shape, key(src_mesh), s, key(dst_mesh), d, itemsize)


@lru_cache(maxsize=1024)
def _cross_cached(shape, src_mesh: DeviceMesh, src, dst_mesh: DeviceMesh, dst, itemsize) -> CrossMeshPlan:
    posts = {land: plan_cached(shape, dst_mesh.shape, land, dst, itemsize, 0) for land in _landings(dst, len(shape))}
    lands = [land for land, post in posts.items() if not post.num_collectives]   # finished locally (B always is)
    if any(isinstance(p, Partial) for p in src):
        # send contributions as they are (reduced at the destination), or reduce inside the source mesh first
        mids = ([src] if len({p.op for p in src if isinstance(p, Partial)}) == 1 else []) \
            + _reduced_states(src, len(shape))
    else:
        mids = [src]
    # Each candidate's figures are known before its pieces are listed (`_costs`): only the cheapest is built.
    pres = [plan_cached(shape, src_mesh.shape, src, mid, itemsize, 0) for mid in mids]
    options = [(_costs(shape, src_mesh, mid, pre, dst_mesh, land, itemsize), i, j)
               for i, (mid, pre) in enumerate(zip(mids, pres)) for j, land in enumerate(lands)]
    _, i, j = min(options)
    return _build(shape, src_mesh, src, mids[i], dst_mesh, lands[j], posts[lands[j]], dst, itemsize, pres[i])


def _costs(shape, src_mesh, mid, pre, dst_mesh, land, itemsize) -> tuple[int, int, int]:
    """(bytes_per_rank, num_collectives, transfer_bytes) of the plan `_build` makes through `mid`, landing as
    `land` (its finish on the destination mesh is local: `_landings`).

    Exact, not an estimate: every destination rank receives its target block once per contribution of one
    replica, less the piece of it that it holds itself (tests compare with the built plans).
    """
    parts = math.prod(n for n, p in zip(src_mesh.shape, mid) if isinstance(p, Partial))
    worst, total = _receptions(shape, src_mesh, mid, dst_mesh, land, parts)
    return pre.bytes_per_rank + worst * itemsize, pre.num_collectives + int(total > 0), total * itemsize


CACHES = (("crossmesh.plan_cross_mesh", _cross_cached),)
"""The memos of this module, by name (`sbp.planning.clear_caches` clears them)."""


def _landings(dst: tuple[Placement, ...], ndim: int) -> list[tuple[Placement, ...]]:
    """Destination placements the pieces may build: `dst` with each Partial axis as Broadcast or as a split of
    some dim, to be made Partial locally after (``S(d) -> P`` keeps each rank's block and fills the rest with
    the op's identity, no bytes): a Broadcast landing sends the whole tensor to every destination rank, a split
    one only its block. Broadcast first (the order breaks ties). A split that another axis splits further
    (``(S(0), S(0)) -> (P, S(0))``) needs a collective to finish: the caller keeps local finishes only."""
    out: list[list[Placement]] = [[]]
    for p in dst:
        options = ([Broadcast()] + [Split(d) for d in range(ndim)]) if isinstance(p, Partial) else [p]
        out = [o + [q] for o in out for q in options]
    return [tuple(o) for o in out]


def _reduced_states(src: tuple[Placement, ...], ndim: int) -> list[tuple[Placement, ...]]:
    """Source-mesh states without Partial: each Partial axis becomes B or a split of a free dim."""
    out = [[]]
    for a, p in enumerate(src):
        if isinstance(p, Partial):
            options = [Broadcast()] + [Split(d) for d in range(ndim)]
        else:
            options = [p]
        out = [o + [q] for o in out for q in options]
    return [tuple(o) for o in out]


def _build(shape, src_mesh, src, mid, dst_mesh, land, post, dst, itemsize, pre) -> CrossMeshPlan:
    parts_axes = [a for a, p in enumerate(mid) if isinstance(p, Partial)]
    op = mid[parts_axes[0]].op if parts_axes else None
    # A Broadcast axis outside (before) a Partial axis holds the same value on each of its coords, but
    # not the same contributions: all contributions of a piece must come from one such replica.
    replica_axes = [a for a, p in enumerate(mid) if isinstance(p, Broadcast) and parts_axes and a < parts_axes[-1]]
    n_replicas = math.prod(src_mesh.shape[a] for a in replica_axes)
    n_parts = math.prod(src_mesh.shape[a] for a in parts_axes)
    sources = _Sources(shape, src_mesh, mid, replica_axes, parts_axes)
    pieces = []
    for i, coord in enumerate(dst_mesh.coords()):
        rank = dst_mesh.rank_of(coord)
        want = block(shape, dst_mesh.shape, land, coord)
        replica = sources.replica_of.get(rank, i % n_replicas)  # own replica when it holds one, else round-robin
        for key, piece in sources.meeting(replica, want):
            if sources.key_of.get(rank) == key:  # this rank already holds that piece of that contribution
                pieces.append(Piece(rank, rank, piece, key[1]))
            else:
                pieces.append(Piece(sources.least_loaded(key, block_numel(piece)), rank, piece, key[1]))
    worst, total = _lower_bounds(shape, src_mesh, src, dst_mesh, land, itemsize)
    by_rank: dict[int, list[Piece]] = {}
    for p in pieces:
        by_rank.setdefault(p.src_rank, []).append(p)
        if p.dst_rank != p.src_rank:
            by_rank.setdefault(p.dst_rank, []).append(p)
    return CrossMeshPlan(shape, src_mesh, dst_mesh, src, dst, itemsize, pre, mid, tuple(pieces), land, post,
                         n_parts, op, worst, total, {r: tuple(ps) for r, ps in by_rank.items()})


class _Sources:
    """The source tiles of one layout, found by the blocks they meet without scanning every tile.

    A key is (replica, contribution, tile); its holders are the source ranks with that tile of that
    contribution (several when Broadcast axes replicate it). Each source rank holds one key, so a sender's
    load changes only through its own key: a heap per key hands out the least-loaded holder, as `min` over
    the holders by (load, rank) would. Each mesh axis splits at most one dim, so the tiles are the product of
    per-dim partitions: the tiles a block meets are the products of the ranges it meets per dim (found by
    bisection), listed in the order the source coords first reach them (the order a scan would give).
    """

    def __init__(self, shape, mesh: DeviceMesh, mid, replica_axes, parts_axes) -> None:
        def index(coord, axes):
            out = 0
            for a in axes:
                out = out * mesh.shape[a] + coord[a]
            return out

        self.replica_of: dict[int, int] = {}
        self.key_of: dict[int, tuple[int, int, Block]] = {}
        holders: dict[tuple[int, int, Block], list[int]] = {}
        for coord in mesh.coords():
            rank = mesh.rank_of(coord)
            self.replica_of[rank] = index(coord, replica_axes)
            key = (self.replica_of[rank], index(coord, parts_axes), block(shape, mesh.shape, mid, coord))
            self.key_of[rank] = key
            holders.setdefault(key, []).append(rank)
        self.order = {key: i for i, key in enumerate(holders)}
        self.heaps = {key: [(0, r) for r in sorted(who)] for key, who in holders.items()}  # sorted: a valid heap
        self.parts = sorted({k[1] for k in holders})
        ranges = [sorted({t[d] for _, _, t in holders if t[d][0] < t[d][1]}) for d in range(len(shape))]
        self.ranges = ranges
        self.starts = [[lo for lo, _ in r] for r in ranges]

    def meeting(self, replica: int, want: Block):
        """(key, piece) for each source tile of `replica` that meets `want`, in first-reached order."""
        per_dim = []
        for (lo, hi), ranges, starts in zip(want, self.ranges, self.starts):
            if lo >= hi:
                return []
            i = max(bisect.bisect_right(starts, lo) - 1, 0)
            met = []
            while i < len(ranges) and ranges[i][0] < hi:
                if ranges[i][1] > lo:
                    met.append(ranges[i])
                i += 1
            if not met:
                return []
            per_dim.append(met)
        found = []
        for tile in itertools.product(*per_dim):
            for part in self.parts:
                key = (replica, part, tile)
                if key in self.order:
                    found.append(key)
        found.sort(key=self.order.__getitem__)
        return [(key, intersect(key[2], want)) for key in found]

    def least_loaded(self, key, numel: int) -> int:
        """The holder of `key` with the least load so far (then the lowest rank); it takes `numel` more."""
        heap = self.heaps[key]
        load, rank = heap[0]
        heapq.heapreplace(heap, (load + numel, rank))
        return rank


def _lower_bounds(shape, src_mesh, src, dst_mesh, land, itemsize) -> tuple[int, int]:
    """Split/Broadcast sources: the most any destination rank lacks of its target block, and the sum
    over destination ranks of what they lack.

    A rank in both meshes already holds its source block; every other byte of its target must arrive.
    Partial sources: every destination rank receives at least its target block once.
    """
    worst, total = _receptions(shape, src_mesh, None if any(isinstance(p, Partial) for p in src) else src,
                               dst_mesh, land, 1)
    return worst * itemsize, total * itemsize


def _receptions(shape, src_mesh, held, dst_mesh, land, copies: int) -> tuple[int, int]:
    """Elements the busiest destination rank receives, and all destination ranks together, when each
    receives `copies` times its block of `land` less the block of `held` (placements on the source mesh;
    None: nothing) it holds itself.
    """
    worst = total = 0
    src_coords = {} if held is None else dict(zip(src_mesh.ranks, src_mesh.coords()))
    for coord in dst_mesh.coords():
        rank = dst_mesh.rank_of(coord)
        want = block(shape, dst_mesh.shape, land, coord)
        lack = copies * block_numel(want)
        if rank in src_coords:
            have = intersect(want, block(shape, src_mesh.shape, held, src_coords[rank]))
            lack -= block_numel(have) if have else 0
        worst, total = max(worst, lack), total + lack
    return worst, total
