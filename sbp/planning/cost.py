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

`Pricing` turns a priced step into the search's objective: without a topology exactly the bytes
objective (received bytes + `latency_bytes` per call); with a `sbp.Topology`, the modeled time of the
busiest rank in ns (`Costing.rounds` x alpha + bytes / beta of the slowest link the step crosses), the
bytes objective breaking ties.
"""
from __future__ import annotations

import bisect
import itertools
import math
from typing import Optional

from ..values.layout import split_range
from ..values.mesh import DeviceMesh
from ..values.placement import Partial, Split
from ..values.steps import Step
from ..values.topology import Topology
from .exchange import reduce_recv_elems
from .states import State


class Costing:
    """Prices moves for one (global_shape, mesh_shape, itemsize); caches block sizes per state.

    Blocks are kept factored: a dim's range at a coord depends only on the coord's digits on the axes
    splitting that dim (its *chain*, nested in axis order), so each dim keeps one range per piece of
    its chain (`spans`), not one per coord, and an axis splits at most one dim of a state. Sizes, what
    ranks lack and step prices are computed from these per-dim pieces; the work grows with the pieces
    of the chains involved, not with the number of ranks (`work` counts it). Per-coord lists
    (`ranges`, `numels`, `boxes`) are built only on request (reduce_transfer prices, Partial bounds).

    >>> from sbp import S, B
    >>> c = Costing((8, 8), (4,), 4)
    >>> c.step("all_gather", (0,), (S(0),), (B,), dims=(0,)).bytes
    192
    """

    __slots__ = ("shape", "mesh_shape", "itemsize", "ndim", "size", "work", "_mesh", "_coords", "_states",
                 "_layouts", "_dim", "_leaf", "_lack", "_memo", "_tiles", "_tables")

    def __init__(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int) -> None:
        self.shape = shape
        self.mesh_shape = tuple(mesh_shape)
        self.itemsize = itemsize
        self.ndim = len(shape)
        self.size = math.prod(self.mesh_shape)
        self.work = 0  # pieces, table entries, probes and per-coord entries computed: planning work, for tests
        self._mesh: Optional[DeviceMesh] = None
        self._coords: Optional[list[tuple[int, ...]]] = None
        # per (dim, chain): the range of every piece of the chain (row-major over the chain's axes); the
        # very same tuple is shared between states, so comparisons can stop at identity
        self._dim: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, int], ...]] = {}
        self._leaf: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._states: dict[State, tuple] = {}
        self._layouts: dict[tuple, tuple] = {}  # per layout key, see `_state`
        self._lack: dict[tuple[tuple, tuple], int] = {}
        self._memo: dict[tuple, object] = {}  # reduce_transfer prices, boxes, groups, per-coord lists
        self._tiles: dict[tuple, int] = {}  # per (dim, chain, chain): see `rounds`
        self._tables: dict[tuple, list] = {}  # per (dim, chain, chain): see `_table`

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh as a value (built on first use)."""
        if self._mesh is None:
            self._mesh = DeviceMesh(self.mesh_shape)
        return self._mesh

    @property
    def coords(self) -> list[tuple[int, ...]]:
        """Every coord, row-major (built on first use: only per-coord prices need it)."""
        if self._coords is None:
            self._coords = self.mesh.coords()
            self.work += self.size
        return self._coords

    def _state(self, s: State) -> tuple:
        """(per dim (pieces, even piece length or None), largest numel, layout key) of a state, in one
        lookup. States that split the same dims by the same axes (whatever their Broadcast or Partial
        axes) share one record, found by the layout key: per dim, its chain (a tuple of ints, cheap to
        hash). A dim split evenly needs no list of its pieces: they are all ``length / pieces`` long."""
        out = self._states.get(s)
        if out is None:
            spl: list[list[int]] = [[] for _ in range(self.ndim)]
            for a, p in enumerate(s):
                if isinstance(p, Split):
                    spl[p.dim].append(a)
            layout = tuple(map(tuple, spl))
            out = self._layouts.get(layout)
            if out is None:
                dims = []
                for d, chain in enumerate(layout):
                    n = math.prod(self.mesh_shape[a] for a in chain)
                    dims.append((n, self.shape[d] // n if self.shape[d] % n == 0 else None))
                # the dims' pieces vary on disjoint axes: the largest block is the product of the largest pieces
                largest = math.prod(self._longest(d, chain, even)
                                    for d, (chain, (_, even)) in enumerate(zip(layout, dims)))
                out = self._layouts[layout] = (tuple(dims), largest, layout)
            self._states[s] = out
        return out

    def _longest(self, d: int, chain: tuple[int, ...], even: Optional[int]) -> int:
        """The longest piece: the first at every level of balanced splits."""
        if even is not None:
            return even
        lo, hi = self._piece(d, chain, lambda a: 0)
        return hi - lo

    def _piece(self, d: int, chain: tuple[int, ...], digit) -> tuple[int, int]:
        """The range of dim `d` held where each axis `a` of `chain` has coord ``digit(a)``."""
        lo, hi = 0, self.shape[d]
        for a in chain:
            lo, hi = split_range(lo, hi, self.mesh_shape[a], digit(a))
        return lo, hi

    def _spans(self, d: int, chain: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The range of every piece of dim `d` split by `chain` (row-major over the chain's axes)."""
        key = (d, chain)
        out = self._dim.get(key)
        if out is None:
            # nested balanced splits, one level per splitting axis (axis order: outermost first)
            spans = [(0, self.shape[d])]
            for a in chain:
                n = self.mesh_shape[a]
                spans = [split_range(lo, hi, n, i) for lo, hi in spans for i in range(n)]
            self.work += len(spans)
            out = self._dim[key] = tuple(spans)
        return out

    def ranges(self, s: State) -> tuple:
        """Per dim, the (start, stop) range held at every coord (row-major); same maths as `layout.block`.
        Built on request (one entry per rank)."""
        layout = self.layout_key(s)
        key = ("ranges", layout)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = tuple(tuple(map(self._spans(d, chain).__getitem__, self._leaves(chain)))
                                          for d, chain in enumerate(layout))
        return out

    def _leaves(self, axes: tuple[int, ...]) -> tuple[int, ...]:
        """Per coord, its row-major index over `axes` alone."""
        out = self._leaf.get(axes)
        if out is None:
            mesh_shape, rows = self.mesh_shape, []
            for c in self.coords:
                k = 0
                for a in axes:
                    k = k * mesh_shape[a] + c[a]
                rows.append(k)
            self.work += len(rows)
            out = self._leaf[axes] = tuple(rows)
        return out

    def numels(self, s: State) -> tuple[int, ...]:
        """Local element count at every coord (row-major). Built on request (one entry per rank)."""
        key = ("numels", self.layout_key(s))
        out = self._memo.get(key)
        if out is None:
            per_dim = self.ranges(s)
            if not per_dim:
                out = (1,) * self.size
            else:
                out = tuple(hi - lo for lo, hi in per_dim[0])
                for per_coord in per_dim[1:]:
                    out = tuple(n * (hi - lo) for n, (lo, hi) in zip(out, per_coord))
            self._memo[key] = out
        return out

    def total_numel(self, s: State) -> int:
        """Local elements summed over all ranks, from the pieces: each dim's pieces add up to its length,
        repeated over the ranks off its chain.

        >>> from sbp import S, B
        >>> Costing((7, 5), (2, 3), 4).total_numel((S(0), B))
        105
        """
        dims, _, _ = self._state(s)
        out = self.size
        for length, (n, _) in zip(self.shape, dims):
            out = out // n * length
        return out

    def layout_key(self, s: State) -> tuple:
        """Per dim, the axes splitting it: states with the same key hold the same blocks everywhere.

        >>> from sbp import S, B, Partial
        >>> c = Costing((8, 8), (2, 2), 4)
        >>> c.layout_key((S(1), B)), c.layout_key((S(1), Partial())) is c.layout_key((S(1), B))
        (((), (0,)), True)
        """
        return self._state(s)[2]

    def lack(self, s: State, t: State) -> int:
        """Elements of its `t` block that the busiest rank does not hold in `s`.

        Per dim, a table over the digits of the axes of both chains gives (target length, overlap);
        dims coupled by an axis (splitting one dim in `s`, another in `t`) are joined on that axis'
        digit, every other choice is free, so only the best (longest, least overlapping) pairs of each
        dim are kept (`_best`).

        >>> from sbp import S, B
        >>> Costing((8, 8), (2, 2), 4).lack((S(0), S(1)), (S(1), S(0)))
        16
        """
        have_dims, _, have_layout = self._state(s)
        want_dims, want_largest, want_layout = self._state(t)
        key = (have_layout, want_layout)
        out = self._lack.get(key)
        if out is None:
            if have_layout == want_layout:
                out = 0  # same splitters everywhere: the same blocks
            elif all(e is not None for _, e in have_dims + want_dims):
                out = self._even_lack(have_layout, want_layout, have_dims, want_dims, want_largest)
            elif not self._diverging(have_layout, want_layout):
                out = self._nested_lack(have_layout, want_layout)
            elif self._misses(have_layout, want_layout, want_largest):
                out = want_largest
            else:
                out = self._max_lack(have_layout, want_layout)
            self._lack[key] = out
        return out

    def _even_lack(self, have: tuple, want: tuple, have_dims: tuple, want_dims: tuple, largest: int) -> int:
        """`lack` when every dim is split evenly in both states: pieces lie on uniform grids. A dim whose
        chains diverge (neither is a prefix of the other, axes of size 1 aside) has a rank whose pieces
        miss each other (first part of one axis against the last part of another); such a rank lacks
        its whole block, and the other dims do not constrain it (their pieces all have one length).
        Otherwise each dim's overlap is the shorter piece everywhere. No work per piece or per rank."""
        if largest == 0:
            return 0
        common = 1
        for p, q, (_, hl), (_, wl) in zip(have, want, have_dims, want_dims):
            p = tuple(a for a in p if self.mesh_shape[a] > 1)
            q = tuple(a for a in q if self.mesh_shape[a] > 1)
            k = min(len(p), len(q))
            if p[:k] != q[:k]:
                return largest
            common *= min(hl, wl)
        return largest - common

    def _diverging(self, have: tuple, want: tuple) -> bool:
        """Whether some dim's chains diverge: neither is a prefix of the other (axes of size 1 aside)."""
        for p, q in zip(have, want):
            p = tuple(a for a in p if self.mesh_shape[a] > 1)
            q = tuple(a for a in q if self.mesh_shape[a] > 1)
            k = min(len(p), len(q))
            if p[:k] != q[:k]:
                return True
        return False

    def _nested_lack(self, have: tuple, want: tuple) -> int:
        """`lack` when no dim's chains diverge: in every dim one piece nests in the other, so overlaps
        are lengths, and lengths depend on a coord only through classes of its digits. After a dim is
        split into ``K`` pieces every piece has ``L // K`` or ``L // K + 1`` elements, so the next split
        in ``n`` gives the first ``m % n`` parts one element more, for ``m`` one of those two lengths:
        the digits of an axis fall into at most five intervals between those boundaries (over its two
        chains), and one coord per combination of intervals covers every case."""
        reps: dict[int, list[int]] = {}
        for chains in (have, want):
            for d, chain in enumerate(chains):
                k = 1
                for a in chain:
                    n = self.mesh_shape[a]
                    m = self.shape[d] // k
                    reps.setdefault(a, [0]).extend(e for e in (m % n, (m + 1) % n) if e > 0)
                    k *= n
        axes = tuple(reps)
        combos = list(itertools.product(*(sorted(set(reps[a])) for a in axes)))
        self.work += len(combos)
        out = 0
        for digits in combos:
            at = dict(zip(axes, digits)).__getitem__
            n = o = 1
            for d, (p, q) in enumerate(zip(have, want)):
                (hl, hh), (wl, wh) = self._piece(d, p, at), self._piece(d, q, at)
                n *= wh - wl
                o *= max(0, min(hh, wh) - max(hl, wl))
            out = max(out, n - o)
        return out

    def _misses(self, have: tuple, want: tuple, largest: int) -> bool:
        """Whether a probe coord finds a rank that holds none of a largest target block: every axis of the
        chains at its first or last coord (first and last parts of two diverging splits miss each other;
        first parts are the longest). Then `lack` is the largest target block, found with at most
        ``2 ** axes`` probes and no work per piece."""
        mesh = self.mesh_shape
        axes = sorted({a for chains in (have, want) for c in chains for a in c if mesh[a] > 1})
        for ends in itertools.product(*((0, mesh[a] - 1) for a in axes)):
            at = dict(zip(axes, ends)).get
            digit = lambda a: at(a, 0)
            self.work += 1
            n = o = 1
            for d, (p, q) in enumerate(zip(have, want)):
                (hl, hh), (wl, wh) = self._piece(d, p, digit), self._piece(d, q, digit)
                n *= wh - wl
                o *= max(0, min(hh, wh) - max(hl, wl))
            if n == largest and o == 0:
                return True
        return False

    def _max_lack(self, have: tuple, want: tuple) -> int:
        dims = [(d, tuple(sorted(set(p) | set(q)))) for d, (p, q) in enumerate(zip(have, want))]
        seen: dict[int, int] = {}
        for _, axes in dims:
            for a in axes:
                seen[a] = seen.get(a, 0) + 1
        shared = tuple(a for a in sorted(seen) if seen[a] > 1)
        # per dim: best (length, overlap) pairs per digits on its shared axes
        per_dim = []
        for d, axes in dims:
            table = self._table(d, have[d], want[d])
            where = [axes.index(a) for a in shared if a in axes]
            groups: dict[tuple, list] = {}
            for digits, n, o in table:
                groups.setdefault(tuple(digits[i] for i in where), []).append((n, o))
            per_dim.append(([shared.index(axes[i]) for i in where], {k: _best(v) for k, v in groups.items()}))
        if not shared:
            combos: list[tuple[int, ...]] = [()]
        else:
            combos = list(itertools.product(*(range(self.mesh_shape[a]) for a in shared)))
        self.work += len(combos)
        out = 0
        for x in combos:
            pairs = [(1, 1)]
            for pos, best in per_dim:
                pairs = _best([(n * m, o * p) for n, o in pairs for m, p in best[tuple(x[i] for i in pos)]])
            out = max(out, max(n - o for n, o in pairs))
        return out

    def _table(self, d: int, have: tuple[int, ...], want: tuple[int, ...]) -> list:
        """(digits on the axes of both chains (sorted), target length, overlap) for dim `d`, over every
        digit combination of those axes."""
        key = (d, have, want)
        out = self._tables.get(key)
        if out is None:
            hs, ws = self._spans(d, have), self._spans(d, want)
            axes = tuple(sorted(set(have) | set(want)))
            out = []
            for digits in itertools.product(*(range(self.mesh_shape[a]) for a in axes)):
                i = j = 0
                for a in have:
                    i = i * self.mesh_shape[a] + digits[axes.index(a)]
                for a in want:
                    j = j * self.mesh_shape[a] + digits[axes.index(a)]
                (hl, hh), (wl, wh) = hs[i], ws[j]
                out.append((digits, wh - wl, max(0, min(hh, wh) - max(hl, wl))))
            self.work += len(out)
            self._tables[key] = out
        return out

    def _gathers_in_place(self, s: State, t: State, dim: int) -> bool:
        dims, _, _ = self._state(s)
        if not (all(even is not None for _, even in dims) or any(even == 0 for _, even in dims)):
            return False  # local sizes differ between ranks (a dim not split evenly has unequal pieces)
        tdims, _, tlayout = self._state(t)
        return all(self._longest(e, tlayout[e], tdims[e][1]) <= 1 for e in range(dim))

    def max_local_bytes(self, s: State) -> int:
        """The largest local tensor of state `s`, in bytes."""
        return self._state(s)[1] * self.itemsize

    def group_size(self, axes: tuple[int, ...]) -> int:
        """Number of ranks in one group along `axes`."""
        return math.prod(self.mesh_shape[a] for a in axes)

    def step(self, kind: str, axes: tuple[int, ...], s: State, t: State, dims: tuple[int, ...] = (),
             op: Optional[str] = None) -> Step:
        """The step of a move of `kind` from `s` to `t` on `axes`, priced: the bytes the busiest rank
        receives and its peak memory (the per-kind formulas `sbp.planning.moves.MOVES` lists).

        >>> from sbp import S, B
        >>> Costing((8, 8), (4,), 4).step("all_to_all", (0,), (S(0),), (S(1),), dims=(0, 1)).bytes
        48
        """
        _, max_in, _ = self._state(s)
        _, max_out, _ = self._state(t)
        match kind:
            case "local":
                recv, buffer = 0, 0
            case "all_gather":
                recv = self._gather_recv(s, t, dims[0])
                # equal pieces gathered along the outermost dim land in the output itself
                buffer = 0 if self._gathers_in_place(s, t, dims[0]) else max_out
            case "reduce_scatter":
                recv = (self.group_size(axes) - 1) * max_out
                buffer = max_in  # the input cut into the members' pieces
            case "all_reduce":
                # ring: reduce_scatter then all_gather of balanced pieces; the rank with the
                # largest piece receives (n - 1) pieces of its size plus everything else once
                # (increasing in the piece: the largest decides)
                n = self.group_size(axes)
                recv = -(-max_in // n) * (n - 2) + max_in if n > 1 else 0
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

    def _gather_recv(self, s: State, t: State, d: int) -> int:
        """The most elements a rank gains in an all_gather of dim `d`: only `d`'s pieces change, and the
        other dims' pieces vary on other axes, so the largest of them multiply the largest gain."""
        in_dims, _, in_layout = self._state(s)
        out_dims, _, out_layout = self._state(t)
        if in_dims[d][1] is not None and out_dims[d][1] is not None:
            gain = out_dims[d][1] - in_dims[d][1]
        else:
            inner = math.prod(self.mesh_shape[a] for a in in_layout[d][len(out_layout[d]):])
            ins, outs = self._spans(d, in_layout[d]), self._spans(d, out_layout[d])
            gain = max(outs[i // inner][1] - outs[i // inner][0] - (hi - lo) for i, (lo, hi) in enumerate(ins))
        rest = math.prod(self._longest(e, chain, even) for e, (chain, (_, even)) in enumerate(zip(in_layout, in_dims))
                         if e != d)
        return gain * rest

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
            if all(even is not None for _, even in self._state(s)[0] + self._state(t)[0]):
                outside = []  # even splits: every group is a translate of the first, with the same schedule
            for members in self.groups_across(axes):
                where = tuple(self.coords[members[0]][a] for a in outside)
                if where not in seen:
                    seen.add(where)
                    self.work += len(members)
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
            self.work += len(self.coords)
            out = self._memo[key] = list(groups.values())
        return out

    def boxes(self, s: State) -> list[tuple[tuple[int, int], ...]]:
        """Per coord, its block as one (start, stop) per dim (distinct blocks of a state are disjoint).

        >>> from sbp import S, B
        >>> Costing((8,), (2, 2), 4).boxes((S(0), B))
        [((0, 4),), ((0, 4),), ((4, 8),), ((4, 8),)]
        """
        key = ("boxes", self.layout_key(s))
        out = self._memo.get(key)
        if out is None:
            per_dim = self.ranges(s)
            out = self._memo[key] = list(zip(*per_dim)) if per_dim else [()] * self.size
        return out



    def rounds(self, step: Step) -> int:
        """Message rounds of a step on the busiest rank, for the alpha term of the time model: ``n - 1``
        for ring all_gather / reduce_scatter and for all_to_all over `n` members, ``2 (n - 1)`` for
        all_reduce; a transfer receives from at most as many peers as source tiles its target block
        meets (its own left out), a reduce_transfer that plus ``q - 1`` contributions per slab.

        >>> from sbp import S, B
        >>> c = Costing((8, 8), (2, 4), 4)
        >>> c.rounds(c.step("all_gather", (1,), (B, S(0)), (B, B), dims=(0,)))
        3
        >>> c.rounds(c.step("transfer", (0, 1), (S(0), S(1)), (S(1), S(0))))   # 2 column tiles: 1 peer
        1
        """
        if step.kind == "local" or (step.bytes == 0 and step.kind in ("transfer", "reduce_transfer")):
            return 0
        n = self.group_size(step.axes)
        match step.kind:
            case "all_reduce":
                return 2 * (n - 1)
            case "transfer":
                return min(n - 1, max(1, self._tiles_met(step.src, step.dst) - 1))
            case "reduce_transfer":
                q = self.group_size(tuple(a for a in step.axes if isinstance(step.src[a], Partial)))
                return min(n - 1, q - 1 + max(0, self._tiles_met(step.src, step.dst) - 1))
            case _:
                return n - 1

    def _tiles_met(self, s: State, t: State) -> int:
        """The most source tiles of `s` one target block of `t` meets: per dim, the most distinct
        source ranges one target range meets, multiplied over dims (an upper bound)."""
        out = 1
        (hdims, _, hlayout), (wdims, _, wlayout) = self._state(s), self._state(t)
        for d, ((hn, he), (wn, we)) in enumerate(zip(hdims, wdims)):
            key = (d, hlayout[d], wlayout[d])
            met = self._tiles.get(key)
            if met is None:
                if hlayout[d] == wlayout[d]:
                    met = 1
                elif he is not None and we is not None:  # uniform grids
                    met = hn // wn if hn % wn == 0 else 1 if wn % hn == 0 else min(hn, hn // wn + 2)
                else:
                    have, want = self._spans(d, hlayout[d]), self._spans(d, wlayout[d])
                    # the pieces of a dim tile it in order: count those a target range meets by bisection
                    pieces = [p for p in have if p[1] > p[0]]
                    los, his = [lo for lo, _ in pieces], [hi for _, hi in pieces]
                    met = max((bisect.bisect_left(los, wh) - bisect.bisect_right(his, wl)
                               for wl, wh in set(want) if wh > wl), default=1)
                self._tiles[key] = met
            out *= met
        return out


class Pricing:
    """The search's objective for one `Costing`: `price` of a step, `least` of a move before it is priced,
    `estimate` from a lower bound in bytes; each a pair (primary, secondary) that the search adds up.

    Without a topology: (bytes + `latency_bytes` x calls, 0), the bytes objective. With one: (modeled
    time in ns, bytes + `latency_bytes` x calls), so time decides and bytes break ties.

    >>> from sbp import S, B
    >>> c = Costing((8, 8), (2,), 4)
    >>> step = c.step("all_gather", (0,), (S(0),), (B,), dims=(0,))
    >>> Pricing(c, 0).price(step), Pricing(c, 0, Topology((1.0,), (8.0,))).price(step)
    ((128, 0), (1016, 128))
    """

    __slots__ = ("costing", "latency", "topology")

    def __init__(self, costing: Costing, latency_bytes: int, topology: Optional[Topology] = None) -> None:
        self.costing, self.latency, self.topology = costing, latency_bytes, topology

    def time_ns(self, step: Step) -> int:
        """Modeled time of `step` (needs a topology): `Costing.rounds` x alpha + bytes / beta, slowest link.

        >>> from sbp import S, B
        >>> c = Costing((8, 8), (2,), 4)
        >>> Pricing(c, 0, Topology((1.0,), (8.0,))).time_ns(c.step("all_gather", (0,), (S(0),), (B,), dims=(0,)))
        1016
        """
        return self.topology.time_ns(step.axes, self.costing.rounds(step), step.bytes)

    def price(self, step: Step) -> tuple[int, int]:
        """(primary, secondary) of a priced step."""
        weighted = step.bytes + self.latency * step.calls
        return (weighted, 0) if self.topology is None else (self.time_ns(step), weighted)

    def least(self, calls: int) -> tuple[int, int]:
        """What a move of `calls` calls costs at least before it is priced (nothing for bytes or rounds)."""
        return (self.latency * calls, 0) if self.topology is None else (0, self.latency * calls)

    def estimate(self, nbytes: int, calls: int) -> tuple[int, int]:
        """A lower bound of what is left when the busiest rank must still receive `nbytes` in `calls`
        calls at least: over the fastest link, one round per call (when bytes move: a step that moves
        nothing may take no round)."""
        weighted = nbytes + self.latency * calls
        if self.topology is None:
            return weighted, 0
        return self.topology.bound_ns(nbytes, calls if nbytes > 0 else 0), weighted

    def total(self, steps) -> tuple[int, int]:
        """The objective of a list of steps (the sum of their prices)."""
        prices = [self.price(s) for s in steps]
        return sum(p for p, _ in prices), sum(q for _, q in prices)


def _best(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs (length, overlap) no other pair beats on both (longer and less overlapping): for positive
    factors, the largest ``N - O`` over products is reached among these."""
    out: list[tuple[int, int]] = []
    for n, o in sorted(set(pairs), key=lambda p: (-p[0], p[1])):
        if not out or o < out[-1][1]:
            out.append((n, o))
    return out
