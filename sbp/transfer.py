"""Exact point-to-point exchanges: who sends which block to whom when a group changes layout.

For a change between two Split/Broadcast states on the group along `axes`, every member receives
exactly the part of its destination block that its source block lacks. Pieces replicated on several
members (Broadcast axes) are taken from a holder chosen round-robin, so senders share the load.
Pure: the planner uses it for exact byte counts and the executor for buffer sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .errors import PlanError
from .layout import Block, block, block_numel, intersect, splitters
from .mesh import DeviceMesh
from .placement import Broadcast, Placement, Split


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


def self_contained(src: tuple[Placement, ...], dst: tuple[Placement, ...], axes: tuple[int, ...]) -> bool:
    """True when the group along `axes` holds one contiguous block in both states (and no Partial axis
    is in the group): per dim, every splitter outside the group comes before every splitter inside it.

    >>> from sbp import S, B
    >>> self_contained((S(0), S(0)), (B, S(0)), (0,)), self_contained((S(0), S(0)), (B, S(0)), (0, 1))
    (False, True)
    """
    if any(not isinstance(state[a], (Split, Broadcast)) for state in (src, dst) for a in axes):
        return False
    for state in (src, dst):
        for d in {p.dim for p in state if isinstance(p, Split)}:
            spl = splitters(state, d)
            inside = [a for a in spl if a in axes]
            outside = [a for a in spl if a not in axes]
            if inside and outside and max(outside) > min(inside):
                return False
    return True


def _group(mesh: DeviceMesh, axes: tuple[int, ...], coord: tuple[int, ...]) -> tuple[int, ...]:
    rank = mesh.rank_of(coord)
    for g in mesh.groups(axes):
        if rank in g:
            return g
    raise AssertionError("coord not in mesh")  # pragma: no cover
