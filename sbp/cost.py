"""The planner's cost model: bytes received by the busiest rank, peak memory, and the lower bound.

Collectives are priced with ring formulas on the exact (uneven) block sizes from layout maths:
all_gather receives what the rank lacks, reduce_scatter ``(n-1)`` times its output piece, all_reduce
``2(n-1)/n`` of its data; all_to_all and transfers receive exactly the intersections listed by
`sbp.transfer.exchange`. Peak memory is input + output + communication buffers on the busiest rank,
counted in logical elements: the padding that makes uneven pieces equal (less than one slab per
member) is not counted.
"""
from __future__ import annotations

import math
from typing import Optional

from .layout import split_range, splitters
from .mesh import DeviceMesh
from .placement import Partial, Placement
from .steps import Step

State = tuple[Placement, ...]


class Costing:
    """Prices moves for one (global_shape, mesh_shape, itemsize); caches block sizes per state.

    >>> from sbp import S, B
    >>> c = Costing((8, 8), (4,), 4)
    >>> c.step("all_gather", (0,), (S(0),), (B,), dims=(0,)).bytes
    192
    """

    __slots__ = ("shape", "mesh", "itemsize", "ndim", "coords", "_ranges", "_dim", "_numels", "_lack",
                 "_bound")

    def __init__(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int) -> None:
        self.shape = shape
        self.mesh = DeviceMesh(mesh_shape)
        self.itemsize = itemsize
        self.ndim = len(shape)
        self.coords = self.mesh.coords()
        # Blocks are products of per-dim ranges; a dim's ranges depend only on the axes splitting it,
        # so they are cached per (dim, splitters) and shared between states.
        self._dim: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, int], ...]] = {}
        self._ranges: dict[State, tuple] = {}
        self._numels: dict[State, tuple[int, ...]] = {}
        self._lack: dict[tuple[State, State], int] = {}
        self._bound: dict[tuple[State, State], int] = {}

    def ranges(self, s: State) -> tuple:
        """Per dim, the (start, stop) range held at every coord (row-major); same maths as `layout.block`."""
        out = self._ranges.get(s)
        if out is None:
            out = tuple(self._dim_ranges(d, splitters(s, d)) for d in range(self.ndim))
            self._ranges[s] = out
        return out

    def _dim_ranges(self, d: int, axes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        key = (d, axes)
        out = self._dim.get(key)
        if out is None:
            mesh_shape, length = self.mesh.shape, self.shape[d]
            rows = []
            for c in self.coords:
                lo, hi = 0, length
                for a in axes:
                    lo, hi = split_range(lo, hi, mesh_shape[a], c[a])
                rows.append((lo, hi))
            out = self._dim[key] = tuple(rows)
        return out

    def numels(self, s: State) -> tuple[int, ...]:
        """Local element count at every coord (row-major)."""
        out = self._numels.get(s)
        if out is None:
            counts = [1] * len(self.coords)
            for per_coord in self.ranges(s):
                counts = [n * (hi - lo) for n, (lo, hi) in zip(counts, per_coord)]
            out = self._numels[s] = tuple(counts)
        return out

    def lack(self, s: State, t: State) -> int:
        """Elements of its `t` block that the busiest rank does not hold in `s`."""
        key = (s, t)
        out = self._lack.get(key)
        if out is None:
            common = [1] * len(self.coords)
            for have, want in zip(self.ranges(s), self.ranges(t)):
                common = [n * max(0, min(wh, hh) - max(wl, hl)) for n, (hl, hh), (wl, wh) in zip(common, have, want)]
            out = self._lack[key] = max(n - c for n, c in zip(self.numels(t), common))
        return out

    def _gathers_in_place(self, s: State, t: State, dim: int) -> bool:
        ins = self.numels(s)
        if len(set(ins)) > 1:
            return False
        return all(hi - lo <= 1 for per_coord in self.ranges(t)[:dim] for lo, hi in per_coord)

    def max_local_bytes(self, s: State) -> int:
        """The largest local tensor of state `s`, in bytes."""
        return max(self.numels(s)) * self.itemsize

    def group_size(self, axes: tuple[int, ...]) -> int:
        """Number of ranks in one group along `axes`."""
        return math.prod(self.mesh.shape[a] for a in axes)

    def step(self, kind: str, axes: tuple[int, ...], s: State, t: State, dims: tuple[int, ...] = (),
             op: Optional[str] = None) -> Step:
        """A priced step."""
        n = self.group_size(axes)
        ins, outs = self.numels(s), self.numels(t)
        match kind:
            case "local":
                recv, buffer = 0, 0
            case "all_gather":
                recv = max(o - i for i, o in zip(ins, outs))
                # equal pieces gathered along the outermost dim land in the output itself
                buffer = 0 if self._gathers_in_place(s, t, dims[0]) else max(outs)
            case "reduce_scatter":
                recv = (n - 1) * max(outs)
                buffer = max(ins)  # the input cut into the members' pieces
            case "all_reduce":
                # ring: reduce_scatter then all_gather of balanced pieces; the rank with the
                # largest piece receives (n - 1) pieces of its size plus everything else once
                recv = max(-(-m // n) * (n - 2) + m for m in ins) if n > 1 else 0
                buffer = 0
            case "all_to_all" | "transfer":
                # inside a self-contained group every missing piece is held by some member
                recv = buffer = self.lack(s, t)
            case _:  # pragma: no cover
                raise ValueError(kind)
        peak = (max(ins) + max(outs) + buffer) * self.itemsize
        return Step(kind, axes, s, t, dims, op, recv * self.itemsize, peak)

    # ---- lower bound -------------------------------------------------------------------------------
    def reduction_bound(self, s: State, d: State) -> int:
        key = ("reduce", s, d)
        out = self._bound.get(key)
        if out is None:
            out = self._bound[key] = self._reduction_bound(s, d)
        return out

    def _reduction_bound(self, s: State, d: State) -> int:
        """A bound for Partial sources that holds for any schedule, counted in elements.

        Per element, the q contributions of the axes still to reduce need q - 1 receptions to meet,
        and the result m - 1 more to reach the m ranks whose final block holds it (m = 1 when the
        target is Partial too, whose ranks may hold zeros). The busiest rank receives at least the
        total over the ranks' count; a rank whose target block still has other contributors receives
        at least that block. Both `P -> S` ((q-1)/q) and `P -> B` (2(q-1)/q) meet it with one ring
        collective.
        """
        pending = [a for a in range(len(s)) if isinstance(s[a], Partial) and s[a] != d[a]]
        kept = [a for a in range(len(s)) if isinstance(s[a], Partial) and s[a] == d[a]]
        q = math.prod(self.mesh.shape[a] for a in pending)
        groups = math.prod(self.mesh.shape[a] for a in kept)
        total_elems = math.prod(self.shape) * groups
        if any(isinstance(y, Partial) for y in d):
            # Partial targets (new or kept axes): contributions may be re-split, ranks may hold zeros
            traffic, per_rank = total_elems * (q - 1), 0
        else:
            traffic = total_elems * (q - 2) + sum(self.numels(d))
            per_rank = max(self.numels(d))
        floor = -(-traffic // len(self.coords))
        return max(self.move_bound(s, d), max(floor, per_rank) * self.itemsize)

    def heuristic(self, s: State, d: State) -> int:
        """A cheap bound for the search (never above the true cost): what ranks lack of their `d` blocks.

        Targets with new Partial axes get `move_bound`'s per-group bound: a zero-filled rank needs nothing.
        """
        if any(isinstance(q, Partial) and p != q for p, q in zip(s, d)):
            return self.move_bound(s, d)  # the per-group bound (zero-filled ranks need nothing)
        return self.lack(s, d) * self.itemsize

    def move_bound(self, s: State, d: State) -> int:
        """What the busiest rank must receive when nothing needs reducing (Partial source axes are
        treated as already reduced, so for Partial states it is a lower bound).

        Split/Broadcast targets: exactly what each rank lacks of its block (a transfer achieves it).
        Partial targets: a rank may hold zeros or any share of a contribution, so per group of ranks
        that differ only on the target's Partial axes, what no member holds of the group's block must
        arrive at one of them: the busiest receives at least that, divided by the group's size.
        """
        key = (s, d)
        if key in self._bound:
            return self._bound[key]
        new = [a for a, y in enumerate(d) if isinstance(y, Partial)]
        if not new or s == d:
            best = self.lack(s, d)
        else:
            have, want = self._boxes(s), self._boxes(d)
            best = 0
            for members in self._groups_across(tuple(new)):
                target = want[members[0]]
                held = sum(_overlap(target, b) for b in {have[i] for i in members})
                lack = _overlap(target, target) - held
                best = max(best, -(-lack // len(members)))
        self._bound[key] = best * self.itemsize
        return best * self.itemsize

    def _groups_across(self, axes: tuple[int, ...]) -> list[list[int]]:
        """Coord indices grouped by their coords off `axes` (the members of each group differ on `axes`)."""
        key = ("groups", axes)
        out = self._bound.get(key)
        if out is None:
            groups: dict[tuple[int, ...], list[int]] = {}
            for i, c in enumerate(self.coords):
                groups.setdefault(tuple(v for a, v in enumerate(c) if a not in axes), []).append(i)
            out = self._bound[key] = list(groups.values())
        return out

    def _boxes(self, s: State) -> list[tuple[tuple[int, int], ...]]:
        """Per coord, its block as one (start, stop) per dim (distinct blocks of a state are disjoint)."""
        key = ("boxes", s)
        out = self._bound.get(key)
        if out is None:
            per_dim = self.ranges(s)
            out = self._bound[key] = list(zip(*per_dim)) if per_dim else [()] * len(self.coords)
        return out


def _overlap(a, b) -> int:
    n = 1
    for (alo, ahi), (blo, bhi) in zip(a, b):
        lo = alo if alo > blo else blo
        hi = ahi if ahi < bhi else bhi
        if hi <= lo:
            return 0
        n *= hi - lo
    return n
