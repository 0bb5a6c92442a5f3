"""The planner's cost model: bytes received by the busiest rank, peak memory, and the lower bound.

Collectives are priced with ring formulas on the exact (uneven) block sizes from layout maths:
all_gather receives what the rank lacks, reduce_scatter ``(n-1)`` times its output piece, all_reduce
``2(n-1)/n`` of its data; all_to_all and transfers receive exactly the intersections listed by
`sbp.transfer.exchange`. Peak memory is input + output + communication buffers on the busiest rank.
"""
from __future__ import annotations

import math
from typing import Optional

from .layout import split_range, splitters
from .mesh import DeviceMesh
from .placement import Broadcast, Partial, Placement, Split
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
                buffer = n * max(ins)
            case "reduce_scatter":
                recv = (n - 1) * max(outs)
                buffer = n * max(outs)
            case "all_reduce":
                recv = 2 * (n - 1) * max(ins) // n
                buffer = 0
            case "all_to_all" | "transfer":
                # inside a self-contained group every missing piece is held by some member
                recv = buffer = self.lack(s, t)
            case _:  # pragma: no cover
                raise ValueError(kind)
        peak = (max(ins) + max(outs) + buffer) * self.itemsize
        return Step(kind, axes, s, t, dims, op, recv * self.itemsize, peak)

    # ---- lower bound -------------------------------------------------------------------------------
    def lower_bound(self, s: State, d: State) -> int:
        """See `sbp.lower_bound_bytes`."""
        reduce_axes = [a for a in range(len(s)) if isinstance(s[a], Partial) and s[a] != d[a]]
        if not reduce_axes:
            return self.move_bound(s, d)
        op = s[reduce_axes[0]].op
        axes = tuple(a for a in reduce_axes if s[a].op == op)
        best = None
        outcomes = [(Broadcast(), "all_reduce", ())]
        for dim in range(self.ndim):
            spl = splitters(s, dim)
            if not spl or axes[0] > spl[-1]:
                outcomes.append((Split(dim), "reduce_scatter", (dim,)))
        for p, kind, dims in outcomes:
            r = tuple(p if a in axes else s[a] for a in range(len(s)))
            cost = self.step(kind, axes, s, r, dims, op).bytes + self.lower_bound(r, d)
            best = cost if best is None else min(best, cost)
        return best

    def move_bound(self, s: State, d: State) -> int:
        """Exact bound when nothing needs reducing: what each rank lacks of its destination block.

        Partial axes are treated as if already reduced, so for Partial states it is a lower bound.
        """
        key = (s, d)
        if key in self._bound:
            return self._bound[key]
        candidates = [[]]
        for p, q in zip(s, d):
            if isinstance(q, Partial) and not isinstance(p, Partial):
                options = [p, Broadcast()] if p != Broadcast() else [p]
            else:
                options = [q]
            candidates = [c + [o] for c in candidates for o in options]
        best = min((self.lack(s, t) for t in map(tuple, candidates) if self._local_to(t, d)), default=0)
        self._bound[key] = best * self.itemsize
        return best * self.itemsize

    @staticmethod
    def _local_to(t: State, d: State) -> bool:
        """True when `t -> d` needs only local zero-fill moves (S(d) must be its dim's last splitter)."""
        for a, (p, q) in enumerate(zip(t, d)):
            if p != q and isinstance(p, Split) and splitters(t, p.dim)[-1] != a:
                return False
        return True
