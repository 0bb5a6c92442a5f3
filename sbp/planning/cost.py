"""The planner's prices: what one step makes the busiest rank receive, and its peak memory.

Collectives are priced with ring formulas on the exact (uneven) block sizes from layout maths:
all_gather receives what the rank lacks, reduce_scatter ``(n-1)`` times its output piece, all_reduce
``2(n-1)/n`` of its data; all_to_all and transfers receive exactly the intersections listed by
`sbp.planning.exchange.exchange`, reduce_transfers both phases of `sbp.planning.exchange.reduce_exchange`. Peak memory
is input + output + communication buffers on the busiest rank, counted in logical elements: the
padding that makes uneven pieces equal (less than one slab per member) is not counted.

Everything is cached per `Costing` (one plan's search): block ranges per dim and splitting axes,
per state, per layout (states that differ only in Broadcast/Partial axes share their blocks), and
per pair of layouts for what ranks lack. Lower bounds, built on the same blocks, are
`sbp.planning.bounds`.
"""
from __future__ import annotations

import math
from typing import Optional

from ..values.layout import split_range
from ..values.mesh import DeviceMesh
from ..values.placement import Partial, Split
from ..values.steps import Step
from .exchange import reduce_recv_elems
from .states import State


class Costing:
    """Prices moves for one (global_shape, mesh_shape, itemsize); caches block sizes per state.

    >>> from sbp import S, B
    >>> c = Costing((8, 8), (4,), 4)
    >>> c.step("all_gather", (0,), (S(0),), (B,), dims=(0,)).bytes
    192
    """

    __slots__ = ("shape", "mesh", "itemsize", "ndim", "coords", "_states", "_layouts", "_dim", "_leaf", "_overlap",
                 "_lack", "_memo")

    def __init__(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int) -> None:
        self.shape = shape
        self.mesh = DeviceMesh(mesh_shape)
        self.itemsize = itemsize
        self.ndim = len(shape)
        self.coords = self.mesh.coords()
        # Blocks are products of per-dim ranges; a dim's ranges depend only on the axes splitting it,
        # so they are cached per (dim, splitters) and shared between states (the very same tuple, so
        # comparisons can stop at identity).
        self._dim: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, int], ...]] = {}
        self._leaf: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._overlap: dict[tuple[int, int], list[int]] = {}
        self._states: dict[State, tuple] = {}
        self._layouts: dict[tuple, tuple] = {}  # per layout key, see `_state`
        self._lack: dict[tuple[tuple, tuple], int] = {}
        self._memo: dict[tuple, object] = {}  # reduce_transfer prices, boxes, groups

    def _state(self, s: State) -> tuple:
        """(ranges, numels, largest numel, layout key) of a state, in one lookup. States that split the
        same dims by the same axes (whatever their Broadcast or Partial axes) share one record, found
        by the layout key: a tuple of ints, cheap to hash."""
        out = self._states.get(s)
        if out is None:
            spl: list[list[int]] = [[] for _ in range(self.ndim)]
            for a, p in enumerate(s):
                if isinstance(p, Split):
                    spl[p.dim].append(a)
            layout = tuple(map(tuple, spl))
            out = self._layouts.get(layout)
            if out is None:
                per_dim = tuple(self._dim_ranges(d, axes) for d, axes in enumerate(layout))
                if not per_dim:
                    numels = (1,) * len(self.coords)
                else:
                    numels = tuple(hi - lo for lo, hi in per_dim[0])
                    for per_coord in per_dim[1:]:
                        numels = tuple(n * (hi - lo) for n, (lo, hi) in zip(numels, per_coord))
                out = self._layouts[layout] = (per_dim, numels, max(numels), layout)
            self._states[s] = out
        return out

    def ranges(self, s: State) -> tuple:
        """Per dim, the (start, stop) range held at every coord (row-major); same maths as `layout.block`."""
        return self._state(s)[0]

    def _dim_ranges(self, d: int, axes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        key = (d, axes)
        out = self._dim.get(key)
        if out is None:
            # nested balanced splits, one level per splitting axis, then each coord's leaf
            spans = [(0, self.shape[d])]
            for a in axes:
                n = self.mesh.shape[a]
                spans = [split_range(lo, hi, n, i) for lo, hi in spans for i in range(n)]
            out = self._dim[key] = tuple(spans[k] for k in self._leaves(axes))
        return out

    def _leaves(self, axes: tuple[int, ...]) -> tuple[int, ...]:
        """Per coord, its row-major index over `axes` alone."""
        out = self._leaf.get(axes)
        if out is None:
            mesh_shape, rows = self.mesh.shape, []
            for c in self.coords:
                k = 0
                for a in axes:
                    k = k * mesh_shape[a] + c[a]
                rows.append(k)
            out = self._leaf[axes] = tuple(rows)
        return out

    def numels(self, s: State) -> tuple[int, ...]:
        """Local element count at every coord (row-major)."""
        return self._state(s)[1]

    def layout_key(self, s: State) -> tuple:
        """Per dim, the axes splitting it: states with the same key hold the same blocks everywhere.

        >>> from sbp import S, B, Partial
        >>> c = Costing((8, 8), (2, 2), 4)
        >>> c.layout_key((S(1), B)), c.layout_key((S(1), Partial())) is c.layout_key((S(1), B))
        (((), (0,)), True)
        """
        return self._state(s)[3]

    def lack(self, s: State, t: State) -> int:
        """Elements of its `t` block that the busiest rank does not hold in `s`."""
        have_ranges, _, _, have_layout = self._state(s)
        want_ranges, numels, _, want_layout = self._state(t)
        key = (have_layout, want_layout)
        out = self._lack.get(key)
        if out is None:
            if all(have is want for have, want in zip(have_ranges, want_ranges)):
                out = 0  # same splitters everywhere: the same blocks
            else:
                common = None  # per coord, the product over the dims so far of have & want
                for have, want in zip(have_ranges, want_ranges):
                    part = self._overlaps(have, want)
                    common = part if common is None else [n * c for n, c in zip(common, part)]
                out = max(n - c for n, c in zip(numels, common))
            self._lack[key] = out
        return out

    def _overlaps(self, have: tuple, want: tuple) -> list[int]:
        """Per coord, the length of have & want along one dim. Many pairs of states share a dim's pair
        of range tuples, which are cached objects: keyed by identity, the lookup hashes two ints."""
        key = (id(have), id(want))
        out = self._overlap.get(key)
        if out is None:
            if have is want:  # same splitters: the blocks agree along this dim
                out = [hi - lo for lo, hi in want]
            else:
                out = [max(0, (wh if wh < hh else hh) - (wl if wl > hl else hl))
                       for (hl, hh), (wl, wh) in zip(have, want)]
            self._overlap[key] = out
        return out

    def _gathers_in_place(self, s: State, t: State, dim: int) -> bool:
        ins = self.numels(s)
        if len(set(ins)) > 1:
            return False
        return all(hi - lo <= 1 for per_coord in self.ranges(t)[:dim] for lo, hi in per_coord)

    def max_local_bytes(self, s: State) -> int:
        """The largest local tensor of state `s`, in bytes."""
        return self._state(s)[2] * self.itemsize

    def group_size(self, axes: tuple[int, ...]) -> int:
        """Number of ranks in one group along `axes`."""
        return math.prod(self.mesh.shape[a] for a in axes)

    def step(self, kind: str, axes: tuple[int, ...], s: State, t: State, dims: tuple[int, ...] = (),
             op: Optional[str] = None) -> Step:
        """The step of a move of `kind` from `s` to `t` on `axes`, priced: the bytes the busiest rank
        receives and its peak memory (the per-kind formulas `sbp.planning.moves.MOVES` lists).

        >>> from sbp import S, B
        >>> Costing((8, 8), (4,), 4).step("all_to_all", (0,), (S(0),), (S(1),), dims=(0, 1)).bytes
        48
        """
        _, ins, max_in, _ = self._state(s)
        _, outs, max_out, _ = self._state(t)
        match kind:
            case "local":
                recv, buffer = 0, 0
            case "all_gather":
                recv = max(o - i for i, o in zip(ins, outs))
                # equal pieces gathered along the outermost dim land in the output itself
                buffer = 0 if self._gathers_in_place(s, t, dims[0]) else max_out
            case "reduce_scatter":
                recv = (self.group_size(axes) - 1) * max_out
                buffer = max_in  # the input cut into the members' pieces
            case "all_reduce":
                # ring: reduce_scatter then all_gather of balanced pieces; the rank with the
                # largest piece receives (n - 1) pieces of its size plus everything else once
                n = self.group_size(axes)
                recv = max(-(-m // n) * (n - 2) + m for m in ins) if n > 1 else 0
                buffer = 0
            case "all_to_all" | "transfer":
                # inside a self-contained group every missing piece is held by some member
                recv = buffer = self.lack(s, t)
            case "reduce_transfer":
                # contributions arrive at the owners, then results at the other members that need them
                recv = buffer = self.reduce_transfer_recv(s, t, axes)
            case _:  # pragma: no cover
                raise ValueError(kind)
        peak = (max_in + max_out + buffer) * self.itemsize
        return Step(kind, axes, s, t, dims, op, recv * self.itemsize, peak)

    def reduce_transfer_recv(self, s: State, t: State, axes: tuple[int, ...]) -> int:
        """Elements the busiest rank receives in a ``reduce_transfer`` over `axes` (both phases), from
        the slabs of the schedule the executor runs (`sbp.planning.exchange.reduce_recv_elems`).

        Groups that hold the same blocks have the same schedule, so each distinct one is priced once.
        """
        key = ("reduce_transfer", s, t, axes)
        out = self._memo.get(key)
        if out is None:
            have, want = self.boxes(s), self.boxes(t)
            q = self.group_size(tuple(a for a in axes if isinstance(s[a], Partial)))
            # groups hold the same blocks when they agree on the axes splitting a dim outside the group
            outside = [a for a, p in enumerate(s) if a not in axes and isinstance(p, Split)]
            seen, out = set(), 0
            for members in self.groups_across(axes):
                where = tuple(self.coords[members[0]][a] for a in outside)
                if where not in seen:
                    seen.add(where)
                    out = max(out, *reduce_recv_elems([have[i] for i in members], [want[i] for i in members], q))
            self._memo[key] = out
        return out

    def groups_across(self, axes: tuple[int, ...]) -> list[list[int]]:
        """Coord indices grouped by their coords off `axes` (the members of each group differ on `axes`).

        >>> Costing((8,), (2, 2), 4).groups_across((1,))
        [[0, 1], [2, 3]]
        """
        key = ("groups", axes)
        out = self._memo.get(key)
        if out is None:
            groups: dict[tuple[int, ...], list[int]] = {}
            for i, c in enumerate(self.coords):
                groups.setdefault(tuple(v for a, v in enumerate(c) if a not in axes), []).append(i)
            out = self._memo[key] = list(groups.values())
        return out

    def boxes(self, s: State) -> list[tuple[tuple[int, int], ...]]:
        """Per coord, its block as one (start, stop) per dim (distinct blocks of a state are disjoint).

        >>> from sbp import S, B
        >>> Costing((8,), (2, 2), 4).boxes((S(0), B))
        [((0, 4),), ((0, 4),), ((4, 8),), ((4, 8),)]
        """
        per_dim, _, _, layout = self._state(s)
        key = ("boxes", layout)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = list(zip(*per_dim)) if per_dim else [()] * len(self.coords)
        return out

