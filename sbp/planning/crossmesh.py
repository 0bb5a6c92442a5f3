"""Cross-mesh plans: move a global tensor between two meshes (other ranks and/or another mesh shape).

Planning is by exact intersections. Each destination rank receives exactly the bytes of its target
block that it does not already hold, from one chosen source holder per piece; when a piece is
replicated (Broadcast axes) the holder with the least load so far sends it, so senders share the
work. Partial sources are either reduced inside the source mesh first (a planned redistribution) or
sent as contributions and reduced at the destination, whichever makes the busiest rank receive less.
Pure: every rank computes the same plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

from ..values.errors import MeshError, PlanError
from ..values.layout import Block, block, block_numel, check_global_shape, intersect
from ..values.mesh import DeviceMesh
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

    def explain(self) -> str:
        """EXPLAIN-style text: the source-side steps, then one line per sender -> receiver with volumes."""
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
        for (s, d), v in sorted(volumes.items()):
            lines.append(f"    rank {s} -> rank {d}: {v} bytes")
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
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise PlanError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    key = lambda m: DeviceMesh(m.shape, m.names, m.ranks, m.device_type)  # drop the binding for caching
    return _cross_cached(shape, key(src_mesh), s, key(dst_mesh), d, itemsize)


@lru_cache(maxsize=1024)
def _cross_cached(shape, src_mesh: DeviceMesh, src, dst_mesh: DeviceMesh, dst, itemsize) -> CrossMeshPlan:
    land, post_needed = _landing(dst)
    post = plan_cached(shape, dst_mesh.shape, land, dst, itemsize, 0)
    candidates = []
    if any(isinstance(p, Partial) for p in src):
        ops = {p.op for p in src if isinstance(p, Partial)}
        if len(ops) == 1:  # send contributions as they are, reduce at the destination
            candidates.append(_build(shape, src_mesh, src, src, dst_mesh, land, post, dst, itemsize,
                                     plan_cached(shape, src_mesh.shape, src, src, itemsize, 0)))
        for mid in _reduced_states(src, len(shape)):
            pre = plan_cached(shape, src_mesh.shape, src, mid, itemsize, 0)
            candidates.append(_build(shape, src_mesh, src, mid, dst_mesh, land, post, dst, itemsize, pre))
    else:
        candidates.append(_build(shape, src_mesh, src, src, dst_mesh, land, post, dst, itemsize,
                                 plan_cached(shape, src_mesh.shape, src, src, itemsize, 0)))
    return min(candidates, key=lambda p: (p.bytes_per_rank, p.num_collectives, p.transfer_bytes))


CACHES = (("crossmesh.plan_cross_mesh", _cross_cached),)
"""The memos of this module, by name (`sbp.planning.clear_caches` clears them)."""


def _landing(dst: tuple[Placement, ...]) -> tuple[tuple[Placement, ...], bool]:
    """Destination placements the pieces build: `dst` with Partial axes as Broadcast (made P locally)."""
    land = tuple(Broadcast() if isinstance(p, Partial) else p for p in dst)
    return land, land != dst


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

    def index(coord, axes):
        out = 0
        for a in axes:
            out = out * src_mesh.shape[a] + coord[a]
        return out

    # holders[(replica, part, tile)] -> world ranks holding that tile of that contribution
    holders: dict[tuple[int, int, Block], list[int]] = {}
    replica_of: dict[int, int] = {}
    for coord in src_mesh.coords():
        rank = src_mesh.rank_of(coord)
        replica_of[rank] = index(coord, replica_axes)
        key = (replica_of[rank], index(coord, parts_axes), block(shape, src_mesh.shape, mid, coord))
        holders.setdefault(key, []).append(rank)
    load: dict[int, int] = {}
    pieces = []
    for i, coord in enumerate(dst_mesh.coords()):
        rank = dst_mesh.rank_of(coord)
        want = block(shape, dst_mesh.shape, land, coord)
        replica = replica_of.get(rank, i % n_replicas)  # own replica when it holds one, else round-robin
        for (rep, part, tile), who in holders.items():
            piece = intersect(tile, want) if rep == replica else None
            if piece is None:
                continue
            if rank in who:  # this rank already holds that piece of that contribution
                pieces.append(Piece(rank, rank, piece, part))
                continue
            sender = min(who, key=lambda r: (load.get(r, 0), r))
            load[sender] = load.get(sender, 0) + block_numel(piece)
            pieces.append(Piece(sender, rank, piece, part))
    worst, total = _lower_bounds(shape, src_mesh, src, dst_mesh, land, itemsize)
    return CrossMeshPlan(shape, src_mesh, dst_mesh, src, dst, itemsize, pre, mid, tuple(pieces), land, post,
                         n_parts, op, worst, total)


def _lower_bounds(shape, src_mesh, src, dst_mesh, land, itemsize) -> tuple[int, int]:
    """Split/Broadcast sources: the most any destination rank lacks of its target block, and the sum
    over destination ranks of what they lack.

    A rank in both meshes already holds its source block; every other byte of its target must arrive.
    Partial sources: every destination rank receives at least its target block once (or what it lacks
    of it when it holds a contribution).
    """
    worst = total = 0
    for coord in dst_mesh.coords():
        rank = dst_mesh.rank_of(coord)
        want = block(shape, dst_mesh.shape, land, coord)
        have = None
        if rank in src_mesh.ranks and not any(isinstance(p, Partial) for p in src):
            have = intersect(want, block(shape, src_mesh.shape, src, src_mesh.coord_of(rank)))
        lack = block_numel(want) - (block_numel(have) if have else 0)
        worst, total = max(worst, lack), total + lack
    return worst * itemsize, total * itemsize
