"""Block maths for the planner: what every rank holds of a tensor in a state, and what the busiest one lacks.

Blocks are kept factored: a dim's range at a coord depends only on the coord's digits on the axes splitting
that dim (its *chain*, nested in axis order), so each dim keeps one range per piece of its chain (`spans`),
not one per coord, and an axis splits at most one dim of a state. Sizes and what ranks lack come from
these per-dim pieces: closed forms for even splits, a few probe coords, or per-dim tables over the digits
of the axes involved, joined on the axes that couple dims. The work grows with the pieces of the chains
involved, not with the number of ranks (`work` counts it). `sbp.planning.cost.Costing` prices steps on
top of these; `sbp.planning.bounds` bounds plans with them.
"""
from __future__ import annotations

import itertools
import math
import operator
from typing import Optional, Sequence

import numpy as np

from ..values.layout import split_range
from ..values.placement import Broadcast, Split
from . import fields
from .states import State

LARGE_TABLE = 512
"""Per-dim tables with more entries than this are computed on arrays (`Blocks._table_groups`)."""

_SMALL_JOIN = 64
"""Joins of per-dim tables over more digit combinations of their shared axes than this look each distinct
combination of entries up once (`Blocks._shared_rows`)."""


class PairArrays:
    """Per group of a large table (row-major over its digits), its `_best` pairs when there are at most two:
    the (length, overlap) arrays of the first and of the second pair (the first again where a group has one).
    The array form of `Blocks._table_groups`'s dict, which `Blocks._max_lack_arrays` reads without building the
    dict (for tensors far smaller than the mesh its groups are as many as the ranks)."""

    __slots__ = ("n1", "o1", "n2", "o2")

    def __init__(self, n1: np.ndarray, o1: np.ndarray, n2: np.ndarray, o2: np.ndarray) -> None:
        self.n1, self.o1, self.n2, self.o2 = n1, o1, n2, o2

    @classmethod
    def of(cls, g: np.ndarray, n: np.ndarray, held: np.ndarray, groups: int) -> "Optional[PairArrays]":
        """From each group's pairs, sorted by group, longer first and less held first, one pair per (group,
        length): keep those less held than every longer one in the group (`_best`). None where a group keeps
        more than two, or the sums below could overflow.

        >>> p = PairArrays.of(np.array([0, 0, 0, 1]), np.array([3, 2, 1, 5]), np.array([2, 1, 1, 0]), 2)
        >>> [x.tolist() for x in (p.n1, p.o1, p.n2, p.o2)]
        [[3, 5], [2, 0], [2, 5], [1, 0]]
        """
        big = int(held.max()) + 1 if held.size else 1
        if groups * big >= 1 << 62:
            return None
        shifted = held - g * big   # a running minimum that restarts at each group (later groups lie below)
        low = np.minimum.accumulate(shifted)
        start = np.concatenate(([True], g[1:] != g[:-1]))
        keep = start | (shifted < np.concatenate(([0], low[:-1])))
        g, n, held = g[keep], n[keep], held[keep]
        counts = np.bincount(g, minlength=groups)
        if counts.max(initial=0) > 2 or counts.min(initial=1) < 1:
            return None
        first = np.flatnonzero(np.concatenate(([True], g[1:] != g[:-1])))
        second = np.where(counts == 2, first + 1, first)
        return cls(n[first], held[first], n[second], held[second])

    def options(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The (lengths, overlaps) arrays to choose between per group: one choice where no group has two pairs."""
        if np.array_equal(self.n1, self.n2) and np.array_equal(self.o1, self.o2):
            return [(self.n1, self.o1)]
        return [(self.n1, self.o1), (self.n2, self.o2)]


class Blocks:
    """The blocks of one (global_shape, mesh_shape) in any state, cached per state, per layout (states
    that differ only in Broadcast/Partial axes share their blocks) and per pair of layouts.

    >>> from sbp import S, B
    >>> b = Blocks((8, 8), (2, 2), 4)
    >>> b.lack((S(0), S(1)), (S(1), S(0))), b.total_numel((S(0), B))
    (16, 128)
    """

    __slots__ = ("shape", "mesh_shape", "itemsize", "ndim", "size", "work", "_states",
                 "_layouts", "_dim", "_lack", "_memo", "_tiles", "_tables")

    def __init__(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...], itemsize: int) -> None:
        self.shape = shape
        self.mesh_shape = tuple(mesh_shape)
        self.itemsize = itemsize
        self.ndim = len(shape)
        self.size = math.prod(self.mesh_shape)
        self.work = 0  # pieces, table entries, probes and group members listed: planning work, for tests
        # per (dim, chain): the range of every piece of the chain (row-major over the chain's axes); the
        # very same tuple is shared between states, so comparisons can stop at identity
        self._dim: dict[tuple[int, tuple[int, ...]], tuple[tuple[int, int], ...]] = {}
        self._states: dict[State, tuple] = {}
        self._layouts: dict[tuple, tuple] = {}  # per layout key, see `_state`
        self._lack: dict[tuple[tuple, tuple], int] = {}
        self._memo: dict[tuple, object] = {}  # reduce_transfer prices, group lacks
        self._tiles: dict[tuple, int] = {}  # per (dim, chain, chain): see `Costing.rounds`
        self._tables: dict[tuple, list] = {}  # per (dim, chain, chain): see `_table`

    def max_local_bytes(self, s: State) -> int:
        """The largest local tensor of state `s`, in bytes.

        >>> from sbp import S, B
        >>> Blocks((7, 4), (2,), 4).max_local_bytes((S(0),))
        64
        """
        return self._state(s)[1] * self.itemsize

    def _state(self, s: State) -> tuple:
        """(per dim (pieces, even piece length or None), largest numel, layout key, every dim even) of a
        state, in one lookup. States that split the same dims by the same axes (whatever their Broadcast or Partial
        axes) share one record, found by the layout key: per dim, its chain (a tuple of ints, cheap to
        hash). A dim split evenly needs no list of its pieces: they are all ``length / pieces`` long."""
        out = self._states.get(s)
        if out is None:
            spl: list[list[int]] = [[] for _ in range(self.ndim)]
            for a, p in enumerate(s):
                if p.__class__ is Split:  # (placements are interned, final classes)
                    spl[p.dim].append(a)
            layout = tuple(map(tuple, spl))
            out = self._layouts.get(layout)
            if out is None:
                dims, largest, mesh, shape = [], 1, self.mesh_shape, self.shape
                for d, chain in enumerate(layout):
                    n = 1
                    for a in chain:
                        n *= mesh[a]
                    even = shape[d] // n if shape[d] % n == 0 else None
                    dims.append((n, even))
                    # the dims' pieces vary on disjoint axes: the largest block is the product of the largest
                    largest *= even if even is not None else self._longest(d, chain, None)
                out = self._layouts[layout] = (tuple(dims), largest, layout,
                                               all(even is not None for _, even in dims))
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
            if math.prod(self.mesh_shape[a] for a in chain) > LARGE_TABLE:
                lo, hi = self._spans_array(d, chain)
                out = self._dim[key] = tuple(zip(lo.tolist(), hi.tolist()))
                return out
            # nested balanced splits, one level per splitting axis (axis order: outermost first)
            spans = [(0, self.shape[d])]
            for a in chain:
                n = self.mesh_shape[a]
                spans = [split_range(lo, hi, n, i) for lo, hi in spans for i in range(n)]
            self.work += len(spans)
            out = self._dim[key] = tuple(spans)
        return out

    def total_numel(self, s: State) -> int:
        """Local elements summed over all ranks, from the pieces: each dim's pieces add up to its length,
        repeated over the ranks off its chain.

        >>> from sbp import S, B
        >>> Blocks((7, 5), (2, 3), 4).total_numel((S(0), B))
        105
        """
        dims = self._state(s)[0]
        out = self.size
        for length, (n, _) in zip(self.shape, dims):
            out = out // n * length
        return out

    def layout_key(self, s: State) -> tuple:
        """Per dim, the axes splitting it: states with the same key hold the same blocks everywhere.

        >>> from sbp import S, B, Partial
        >>> c = Blocks((8, 8), (2, 2), 4)
        >>> c.layout_key((S(1), B)), c.layout_key((S(1), Partial())) is c.layout_key((S(1), B))
        (((), (0,)), True)
        """
        return self._state(s)[2]

    def lack(self, s: State, t: State, weight: int = 1) -> int:
        """Elements of its `t` block that the busiest rank does not hold in `s`; with a `weight` ``w``,
        the most ``w * |t block| - |t block held in s|`` over ranks (what a rank receives when each of
        its target elements arrives ``w`` times but for the one it holds: a reduce_transfer with ``w``
        contributions, see `sbp.planning.cost.Costing.reduce_transfer_recv`).

        Per dim, a table over the digits of the axes of both chains gives (target length, overlap);
        dims coupled by an axis (splitting one dim in `s`, another in `t`) are joined on that axis'
        digit, every other choice is free, so only the best (longest, least overlapping) pairs of each
        dim are kept (`_best`).

        >>> from sbp import S, B
        >>> c = Blocks((8, 8), (2, 2), 4)
        >>> c.lack((S(0), S(1)), (S(1), S(0))), c.lack((S(0), S(1)), (S(1), S(0)), weight=2)
        (16, 32)
        """
        states = self._states
        return self._lack_of(states.get(s) or self._state(s), states.get(t) or self._state(t), weight)

    def _lack_of(self, have: tuple, want: tuple, weight: int) -> int:
        """`lack` on the `_state` records of the two states."""
        have_dims, _, have_layout, have_even = have
        want_dims, want_largest, want_layout, want_even = want
        key = (have_layout, want_layout, weight)
        out = self._lack.get(key)
        if out is None:
            if have_layout == want_layout:
                out = (weight - 1) * want_largest  # same splitters everywhere: the same blocks
            elif have_even and want_even:
                out = self._even_lack(have_layout, want_layout, have_dims, want_dims, want_largest, weight)
            elif not self._diverging(have_layout, want_layout):
                out = self._nested_lack(have_layout, want_layout, weight)
            elif self._misses(have_layout, want_layout, want_largest):
                out = weight * want_largest
            else:
                out = self._max_lack(have_layout, want_layout, weight)
            self._lack[key] = out
        return out

    def _even_lack(self, have: tuple, want: tuple, have_dims: tuple, want_dims: tuple, largest: int,
                   weight: int) -> int:
        """`lack` when every dim is split evenly in both states: pieces lie on uniform grids. A dim whose
        chains diverge (neither is a prefix of the other, axes of size 1 aside) has a rank whose pieces
        miss each other (first part of one axis against the last part of another); such a rank lacks
        its whole block, and the other dims do not constrain it (their pieces all have one length).
        Otherwise each dim's overlap is the shorter piece everywhere. No work per piece or per rank."""
        if largest == 0:
            return 0
        common, mesh, ones = 1, self.mesh_shape, 1 in self.mesh_shape
        for p, q, (_, hl), (_, wl) in zip(have, want, have_dims, want_dims):
            if ones:
                p = tuple(a for a in p if mesh[a] > 1)
                q = tuple(a for a in q if mesh[a] > 1)
            k = min(len(p), len(q))
            if p[:k] != q[:k]:
                return weight * largest
            common *= hl if hl < wl else wl
        return weight * largest - common

    def _diverging(self, have: tuple, want: tuple) -> bool:
        """Whether some dim's chains diverge: neither is a prefix of the other (axes of size 1 aside)."""
        mesh, ones = self.mesh_shape, 1 in self.mesh_shape
        for p, q in zip(have, want):
            if ones:
                p = tuple(a for a in p if mesh[a] > 1)
                q = tuple(a for a in q if mesh[a] > 1)
            k = min(len(p), len(q))
            if p[:k] != q[:k]:
                return True
        return False

    def _nested_lack(self, have: tuple, want: tuple, weight: int) -> int:
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
        values = {a: sorted(set(r)) for a, r in reps.items()}
        # per dim, (length, overlap) depends on the digits of its chains' axes alone: a table over their
        # representative digits, joined with the other dims' on the axes they share (as `_max_lack`)
        dims = [sorted(set(p) | set(q)) for p, q in zip(have, want)]
        shared = shared_axes(dims)
        per_dim = []
        for d, (p, q, axes) in enumerate(zip(have, want, dims)):
            where = [axes.index(a) for a in shared if a in axes]
            groups: dict[tuple, list] = {}
            for digits in itertools.product(*(values[a] for a in axes)):
                at = dict(zip(axes, digits)).__getitem__
                (hl, hh), (wl, wh) = self._piece(d, p, at), self._piece(d, q, at)
                groups.setdefault(tuple(digits[i] for i in where), []).append(
                    (wh - wl, max(0, min(hh, wh) - max(hl, wl))))
                self.work += 1
            per_dim.append(([shared.index(axes[i]) for i in where], {k: _best(v) for k, v in groups.items()}))
        combos = list(itertools.product(*(values[a] for a in shared)))
        self.work += len(combos)
        return self._join_best(_rows(combos, per_dim), weight)

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

    def _max_lack(self, have: tuple, want: tuple, weight: int, free: tuple[int, ...] = ()) -> int:
        """The most ``weight * N - O`` over coords, N a target block's size and O what is held of it: by
        one rank, or with `free` axes, by the ranks that differ from it only there (`_table`)."""
        shared, per_dim, values = self._joined_tables(have, want, free, _best, arrays=True)
        in_arrays = any(isinstance(table, PairArrays) for _, table in per_dim)
        if in_arrays or math.prod(len(self._digit_list(a, values)) for a in shared) > LARGE_TABLE:
            out = self._max_lack_arrays(shared, per_dim, weight, values)
            if out is not None:
                return out
        if in_arrays:
            shared, per_dim, values = self._joined_tables(have, want, free, _best)
        return self._join_best(self._shared_rows(shared, per_dim, values=values), weight)

    def _digit_list(self, a: int, values: Optional[dict]) -> Sequence[int]:
        """The digits of axis `a` a join enumerates (increasing): all, or those `values` names (`_digit_values`)."""
        return values[a] if values is not None and a in values else range(self.mesh_shape[a])

    def _shared_rows(self, shared: tuple[int, ...], per_dim: list, default=None, values: Optional[dict] = None):
        """Per digit combination of the `shared` axes, each dim's entry in its table (`per_dim`: positions in
        `shared` and the table keyed by the digits there; `default` where it has none). Over more than
        `_SMALL_JOIN` combinations, each distinct row once (tables take few distinct values): per dim an array
        of entry numbers over its digits, broadcast over all of them, and the distinct rows. `values`: the digits
        each axis takes (`_digit_values`)."""
        lists = [self._digit_list(a, values) for a in shared]
        sizes = [len(x) for x in lists]
        if math.prod(sizes) <= _SMALL_JOIN:
            return _rows(self._shared_digits(shared, values), per_dim, default)
        numbers: dict = {}
        entries, columns = [], []
        places = [{v: k for k, v in enumerate(x)} for x in lists]
        for pos, table in per_dim:   # (`pos` in increasing order: the table's axes in shared order)
            number = np.full([sizes[i] for i in pos], -1, dtype=np.int64)
            for digits, entry in table.items():
                key = frozenset(entry) if isinstance(entry, (set, frozenset)) else tuple(entry)
                k = numbers.get(key)
                if k is None:
                    k = numbers[key] = len(entries)
                    entries.append(entry)
                number[tuple(places[i][x] for i, x in zip(pos, digits))] = k
            shape = [sizes[i] if i in pos else 1 for i in range(len(shared))]
            columns.append(np.broadcast_to(number.reshape(shape), sizes).ravel())
        self.work += math.prod(sizes)
        entries.append(default)   # (number -1: no entry)
        rows = np.stack(columns, axis=1)[first_rows(columns)]
        return [[entries[k] for k in row] for row in rows.tolist()]

    @staticmethod
    def _join_best(rows, weight: int) -> int:
        """The most ``weight * N - O`` over `rows`: per digit combination of the shared axes, each dim's best
        (length, overlap) pairs (`_shared_rows` of `_joined_tables`'s result)."""
        out = 0
        for row in rows:
            pairs = [(1, 1)]
            for options in row:
                if len(pairs) == 1 and len(options) == 1:  # (even pieces: one best pair per group)
                    (n, o), (m, p) = pairs[0], options[0]
                    pairs = [(n * m, o * p)]
                else:
                    pairs = _best([(n * m, o * p) for n, o in pairs for m, p in options])
            out = max(out, max(weight * n - o for n, o in pairs))
        return out

    def _max_lack_arrays(self, shared: tuple[int, ...], per_dim: list, weight: int,
                         values: Optional[dict] = None) -> Optional[int]:
        """`_max_lack`'s loop over the digits of the `shared` axes, on arrays: per dim and shared digits, at most
        two best pairs (a dim's pieces have two lengths at most: nested balanced splits of one length), every
        choice of one per dim tried. None where a group has more pairs or the products could overflow."""
        top = max(1, weight) * math.prod(max(1, n) for n in self.shape)
        if top >= 1 << 62:
            return None
        lists = [np.asarray(self._digit_list(a, values), dtype=np.int64) for a in shared]
        sizes = [len(x) for x in lists]
        options = []   # per dim: two (lengths, overlaps) arrays over the shared digits, broadcastable
        for pos, best in per_dim:
            grid = [sizes[i] for i in pos]
            shape = [sizes[i] if i in pos else 1 for i in range(len(shared))]
            if isinstance(best, PairArrays):   # (its groups run over every digit, row-major in shared order)
                if values is not None and any(a in values for a in shared):
                    return None
                options.append([(n.reshape(shape), o.reshape(shape)) for n, o in best.options()])
                continue
            if len(best) != math.prod(grid) or any(len(v) > 2 for v in best.values()):
                return None
            keys = np.array(list(best), dtype=np.int64).reshape(len(best), len(pos))
            places = tuple(np.searchsorted(lists[i], keys[:, m]) for m, i in enumerate(pos))   # digits' places
            index = np.ravel_multi_index(places, grid) if pos else np.zeros(len(best), dtype=np.int64)
            dim = []
            for c in range(1 + any(len(v) == 2 for v in best.values())):
                n, o = np.empty(len(best), dtype=np.int64), np.empty(len(best), dtype=np.int64)
                n[index] = [v[min(c, len(v) - 1)][0] for v in best.values()]
                o[index] = [v[min(c, len(v) - 1)][1] for v in best.values()]
                dim.append((n.reshape(shape), o.reshape(shape)))
            options.append(dim)
        self.work += math.prod(sizes)
        out = 0
        for choice in itertools.product(*options):
            n = o = np.ones((), dtype=np.int64)
            for m, p in choice:
                n, o = n * m, o * p
            out = max(out, int((weight * n - o).max()))
        return out

    def _max_per_rank(self, have: tuple, want: tuple, value) -> int:
        """The most ``value(lengths, overlaps)`` over coords (per dim, the length of the rank's target
        piece and how much of it the rank holds), for any `value`: per dim, every distinct pair."""
        shared, per_dim, values = self._joined_tables(have, want, (), lambda pairs: sorted(set(pairs)))
        out = 0
        for row in self._shared_rows(shared, per_dim, values=values):
            for pairs in itertools.product(*row):
                out = max(out, value(tuple(n for n, _ in pairs), tuple(o for _, o in pairs)))
        return out

    def _joined_tables(self, have: tuple, want: tuple, free: tuple[int, ...], keep, arrays: bool = False) -> tuple:
        """Per dim, its `_table` grouped by the digits of the axes it shares with other dims, each group
        reduced by `keep`; the shared axes; and the digits each axis takes (`_digit_values`: None for all).
        Dims that share no axis are chosen freely. With `arrays` (and `keep` `_best`), a large table's groups
        may come as `PairArrays` (for `_max_lack_arrays`) instead of a dict."""
        dims = [tuple(sorted((set(p) | set(q)) - set(free))) for p, q in zip(have, want)]
        shared = shared_axes(dims)
        values = self._digit_values([(have[d], want[d], tuple(a for a in have[d] if a in free), d)
                                     for d in range(len(dims))], sorted(set().union(*dims)))
        per_dim = []
        for d, axes in enumerate(dims):
            where = [axes.index(a) for a in shared if a in axes]
            free_d = tuple(a for a in have[d] if a in free)
            groups = self._even_groups(d, have[d], want[d], free_d, tuple(axes[i] for i in where), values)
            if groups is None and math.prod(self.mesh_shape[a] for a in axes) > LARGE_TABLE:
                groups = None if not (arrays and keep is _best) else \
                    self._table_groups(d, have[d], want[d], free_d, axes, where, True, arrays=True)
                if groups is None:
                    groups = self._table_groups(d, have[d], want[d], free_d, axes, where, keep is _best)
                per_dim.append(([shared.index(axes[i]) for i in where], groups))
                continue
            if groups is None:
                groups = {}
                kept = _picker(where)
                for digits, n, o in self._table(d, have[d], want[d], free_d):
                    k = kept(digits)
                    if k in groups:
                        groups[k].append((n, o))
                    else:
                        groups[k] = [(n, o)]
            per_dim.append(([shared.index(axes[i]) for i in where], {k: keep(v) for k, v in groups.items()}))
        return shared, per_dim, values

    def _digit_values(self, chains: list[tuple], axes: list[int]) -> Optional[dict]:
        """The digits each of `axes` must take in a join of per-dim tables (None: all of them), given per dim
        its (source chain, target chain, free axes, dim) as `_even_groups` compares them. When every dim splits
        evenly and its chains nest aligned, a table entry depends on the digits only through equalities: the coarser
        chain's piece index is the finer one's divided by the ratio, and where every chain's digit boundaries
        (the products of the sizes after each axis) divide one another, each digit is a run of *fields* and
        the comparisons are field for field (`sbp.planning.fields`). Any digits are then matched, equality for
        equality, by digits whose every field is below the size of its group of compared fields (the values
        used in a group renumbered in order), and what a piece holds does not depend on the values: the join
        over those digits alone meets every case, whatever the axis sizes."""
        if max((self.mesh_shape[a] for a in axes), default=1) <= fields.SMALL:
            return None
        relations = []
        for have, want, free, d in chains:
            if self._even_cover(d, have, want, free) is None:
                return None   # (`_even_groups` has no table there: `_table` lists every digit)
            nh, nw = self.group_size(have), self.group_size(want)
            fine, coarse = (have, want) if nh >= nw else (want, have)
            relations.append((fine, coarse, max(nh, nw) // min(nh, nw)))
        return fields.compared_digits(relations, self.mesh_shape, axes)

    def _table_groups(self, d: int, have: tuple[int, ...], want: tuple[int, ...], free: tuple[int, ...],
                      axes: tuple[int, ...], where: list[int], best: bool, arrays: bool = False):
        """`_table`'s (target length, overlap) pairs grouped by the digits at positions `where` of `axes`, each
        group reduced to `_best` (`best`) or to its distinct pairs in order: the same as grouping `_table`, computed
        on arrays for large tables (one entry per digit combination of `axes`, as many as the ranks they span).
        With `arrays` (and `best`): the groups as `PairArrays`, in row-major order of their digits; None where a
        group keeps more than two pairs."""
        key = ("groups", d, have, want, free, tuple(where), best, arrays)
        if key in self._memo:
            return self._memo[key]
        mesh = self.mesh_shape
        hlo, hhi = self._spans_array(d, have)
        wlo, whi = self._spans_array(d, want)
        sizes = [mesh[a] for a in axes]
        hstride, wstride = _strides(have, mesh), _strides(want, mesh)
        i = j = g = np.zeros((), dtype=np.int64)
        kept, gstride = {}, 1
        for k in reversed(range(len(axes))):   # every digit combination, row-major over `axes`
            a = axes[k]
            digit = digit_grid(sizes, k)
            if a in wstride:
                j = j + digit * wstride[a]
            if a in hstride:
                i = i + digit * hstride[a]
            if k in where:
                g = g + digit * gstride
                gstride *= sizes[k]
                kept[k] = digit
        i, j, g = (np.broadcast_to(x, sizes).ravel() for x in (i, j, g))
        lo, hi = wlo[j], whi[j]
        held = np.zeros_like(lo)
        for extra in itertools.product(*(range(mesh[a]) for a in free)):
            at = i + sum(x * hstride[a] for x, a in zip(extra, free))
            held += np.clip(np.minimum(hhi[at], hi) - np.maximum(hlo[at], lo), 0, None)
        self.work += lo.size * max(1, math.prod(mesh[a] for a in free))
        n = hi - lo
        # per group, its pairs longer first, less held first: the first of each (group, length) is the least
        # held of that length; `_best` keeps no other, the distinct pairs all
        order = np.lexsort((held, -n, g))
        g, n, held = g[order], n[order], held[order]
        step = (g[1:] != g[:-1]) | (n[1:] != n[:-1])
        first = np.concatenate(([True], step if best else step | (held[1:] != held[:-1])))
        if arrays:
            out = PairArrays.of(g[first], n[first], held[first], math.prod(sizes[k] for k in where))
            self._memo[key] = out
            return out
        out = {}
        order = order[first]
        keys = zip(*(np.broadcast_to(kept[k], sizes).ravel()[order].tolist() for k in where)) if where else \
            itertools.repeat(())
        for k, length, o in zip(keys, n[first].tolist(), held[first].tolist()):
            pairs = out.get(k)
            if pairs is None:
                out[k] = [(length, o)]
            elif not best or o < pairs[-1][1]:
                pairs.append((length, o))
        if not best:
            out = {k: sorted(v) for k, v in out.items()}
        self._memo[key] = out
        return out

    def _spans_array(self, d: int, chain: tuple[int, ...]) -> tuple:
        """`_spans` as two arrays (starts, ends), built level by level on arrays."""
        key = ("spans", d, chain)
        out = self._memo.get(key)
        if out is None:
            lo, hi = np.zeros(1, dtype=np.int64), np.full(1, self.shape[d], dtype=np.int64)
            for a in chain:
                n = self.mesh_shape[a]
                base, extra = np.divmod(hi - lo, n)
                part = np.arange(n, dtype=np.int64)
                lo = (lo[:, None] + part * base[:, None] + np.minimum(part, extra[:, None])).ravel()
                hi = lo + (np.repeat(base, n) + (np.tile(part, len(base)) < np.repeat(extra, n)))
            self.work += lo.size
            out = self._memo[key] = (lo, hi)
        return out

    def _even_groups(self, d: int, have: tuple[int, ...], want: tuple[int, ...], free: tuple[int, ...],
                     kept: tuple[int, ...], values: Optional[dict] = None) -> Optional[dict]:
        """`_table`'s (target length, overlap) pairs grouped by the digits of the `kept` axes, when dim `d`
        splits evenly in both chains and one grid nests in the other, aligned (a target piece inside one source
        piece, or covering the run of source pieces `_covering` describes); else None. What the source pieces
        off `free` hold of a target piece is then all of it, a fixed count of whole pieces, or nothing, with no
        work per piece or per free digit; the digits of the other axes of `have` alone are not enumerated: such
        an axis only decides whether a target piece meets the source pieces, and its digit can be chosen to
        match the one the target spells, or (on more than one digit) not to."""
        mesh, length = self.mesh_shape, self.shape[d]
        nh, nw = math.prod(mesh[a] for a in have), math.prod(mesh[a] for a in want)
        cover = self._even_cover(d, have, want, free)
        if cover is None:
            return None
        front, part, u, back = cover
        if nh >= nw:
            held = length // nh * math.prod(mesh[a] for a in back if a in free) * (u if part in free else 1)
        else:
            held = length // nw
        spelled = [a for a in front if a not in free]   # compared with the digits the target spells
        axes = tuple(sorted(set(kept) | set(want)))
        where = {a: k for k, a in enumerate(axes)}
        loose = any(mesh[a] > 1 for a in spelled if a not in where) or (
            part is not None and part not in free and part not in where and mesh[part] > u)
        n, out = length // nw, {}
        if math.prod(len(self._digit_list(a, values)) for a in axes) > LARGE_TABLE:
            return self._even_groups_arrays(axes, want, kept, front, part, u, free, nh, nw, n, held, loose, values)
        for digits in itertools.product(*(self._digit_list(a, values) for a in axes)):
            j = 0
            for a in want:
                j = j * mesh[a] + digits[where[a]]
            k = j if nh >= nw else j // (nw // nh)
            meets = True
            if part is not None:
                k, c = divmod(k, mesh[part] // u)
                if part not in free and part in where and not c * u <= digits[where[part]] < (c + 1) * u:
                    meets = False
            for a in reversed(front):
                k, digit = divmod(k, mesh[a])
                if a in where and a not in free and digits[where[a]] != digit:
                    meets = False
            pairs = out.setdefault(tuple(digits[where[a]] for a in kept), [])
            if meets:
                pairs.append((n, held))
            if loose or not meets:
                pairs.append((n, 0))
        self.work += math.prod(len(self._digit_list(a, values)) for a in axes)
        return out

    def _even_cover(self, d: int, have: tuple[int, ...], want: tuple[int, ...], free: tuple[int, ...]):
        """Where `_even_groups` has a table for dim `d` (both chains split it evenly, one grid nests in the
        other, aligned, no free axis in `want`): how a target piece lies on the source digits, (front, part, u,
        back) as `_covering` gives it when the source pieces are finer (``(have, None, 1, ())`` when coarser);
        else None."""
        length, nh, nw = self.shape[d], self.group_size(have), self.group_size(want)
        if length % nh or length % nw or (nh % nw and nw % nh) or any(a in want for a in free):
            return None
        return self._covering(have, nh // nw) if nh >= nw else (have, None, 1, ())

    def _even_groups_arrays(self, axes: tuple[int, ...], want: tuple[int, ...], kept: tuple[int, ...],
                            front: tuple[int, ...], part: Optional[int], u: int, free: tuple[int, ...], nh: int,
                            nw: int, n: int, held: int, loose: bool, values: Optional[dict] = None) -> dict:
        """`_even_groups`' loop over the digits of `axes` on arrays (large tables): whether each target piece
        meets the source pieces off the free axes, then per digits of the `kept` axes the pairs that occur."""
        mesh = self.mesh_shape
        lists = [np.asarray(self._digit_list(a, values), dtype=np.int64) for a in axes]
        sizes = [len(x) for x in lists]
        place = lambda a: digit_grid(sizes, axes.index(a))  # noqa: E731
        digit = lambda a: lists[axes.index(a)][place(a)]  # noqa: E731
        j = np.zeros((), dtype=np.int64)
        for a in want:
            j = j * mesh[a] + digit(a)
        k = j if nh >= nw else j // (nw // nh)
        meets = np.ones((), dtype=bool)
        if part is not None:
            k, c = np.divmod(k, mesh[part] // u)
            if part not in free and part in axes:
                meets = meets & (c * u <= digit(part)) & (digit(part) < (c + 1) * u)
        for a in reversed(front):
            k, d = np.divmod(k, mesh[a])
            if a in axes and a not in free:
                meets = meets & (digit(a) == d)
        meets = np.broadcast_to(meets, sizes).ravel()
        self.work += meets.size
        group = np.zeros(meets.size, dtype=np.int64)
        for a in kept:
            group = group * sizes[axes.index(a)] + np.broadcast_to(place(a), sizes).ravel()
        size = math.prod(sizes[axes.index(a)] for a in kept)
        some = np.bincount(group[meets], minlength=size) > 0
        missed = np.bincount(group[~meets], minlength=size) > 0
        return {digits: ([(n, held)] if hit else []) + ([(n, 0)] if loose or miss else [])   # (groups row-major)
                for digits, hit, miss in zip(itertools.product(*(self._digit_list(a, values) for a in kept)),
                                             some.tolist(), missed.tolist())}

    def _shared_digits(self, shared: tuple[int, ...], values: Optional[dict] = None) -> list[tuple[int, ...]]:
        combos = list(itertools.product(*(self._digit_list(a, values) for a in shared)))
        self.work += len(combos)
        return combos

    def _table(self, d: int, have: tuple[int, ...], want: tuple[int, ...], free: tuple[int, ...] = ()) -> list:
        """(digits on the axes of both chains but `free` (sorted), target length, overlap) for dim `d`, over
        every digit combination of those axes; the overlap is summed over the digits of the `free` axes
        of `have` (the pieces they tell apart are disjoint)."""
        key = (d, have, want, free)
        out = self._tables.get(key)
        if out is None:
            mesh = self.mesh_shape
            hs, ws = self._spans(d, have), self._spans(d, want)
            axes = tuple(sorted((set(have) | set(want)) - set(free)))
            # a piece's index in its chain is the sum of digit x stride over the chain's axes (row-major)
            hstride, wstride = _strides(have, mesh), _strides(want, mesh)
            wterms = [(k, wstride[a]) for k, a in enumerate(axes) if a in wstride]
            hterms = [(k, hstride[a]) for k, a in enumerate(axes) if a in hstride]
            # the free axes' digits add one offset each to the index of the source piece
            loose = [sum(x * hstride[a] for x, a in zip(extra, free))
                     for extra in itertools.product(*(range(mesh[a]) for a in free))]
            out = []
            for digits in itertools.product(*(range(mesh[a]) for a in axes)):
                j = i = 0
                for k, stride in wterms:
                    j += digits[k] * stride
                for k, stride in hterms:
                    i += digits[k] * stride
                wl, wh = ws[j]
                held = 0
                for extra in loose:
                    hl, hh = hs[i + extra]
                    if hh > wl and hl < wh:
                        held += (hh if hh < wh else wh) - (hl if hl > wl else wl)
                out.append((digits, wh - wl, held))
            self.work += len(out) * len(loose)
            self._tables[key] = out
        return out

    def _covering(self, chain: tuple[int, ...], r: int) -> Optional[tuple]:
        """How ``r`` consecutive pieces of `chain` (the ``j``-th run of them, ``r`` dividing their count)
        lie on its digits, when aligned: (front, part, u, back) with every digit of the `back` axes (the
        last ones), ``u`` digits ``c u .. c u + u - 1`` of axis `part` (None when ``u`` is 1), and on the
        `front` axes the digits ``j // (size(part) / u)`` spells, ``c`` its remainder. None when the run
        is not such a product of digit ranges."""
        mesh, lead = self.mesh_shape, len(chain)
        while lead and r > 1 and r % mesh[chain[lead - 1]] == 0:
            lead -= 1
            r //= mesh[chain[lead]]
        if r == 1:
            return chain[:lead], None, 1, chain[lead:]
        if lead == 0 or mesh[chain[lead - 1]] % r:
            return None
        return chain[:lead - 1], chain[lead - 1], r, chain[lead:]

    def group_lack(self, s: State, t: State, free: tuple[int, ...]) -> int:
        """The most elements of a `t` block that no rank of its group holds in `s`, a group being the
        ranks that differ only on the `free` axes (which must not split any dim in `t`).

        >>> from sbp import S, B, Partial
        >>> c = Blocks((8, 8), (2, 2), 4)
        >>> c.group_lack((S(0), S(1)), (B, Partial()), (1,)), c.group_lack((S(0), S(1)), (B, Partial()), (0,))
        (32, 32)
        """
        have_layout, want_layout = self.layout_key(s), self.layout_key(t)
        if any(a in free for chain in want_layout for a in chain if self.mesh_shape[a] > 1):
            raise ValueError(f"group_lack: free axes {free} must not split a dim of the target {t}")
        key = ("group_lack", have_layout, want_layout, free)
        out = self._memo.get(key)
        if out is None:
            if all(a in free for chain in have_layout for a in chain[next(
                    (k for k, a in enumerate(chain) if a in free), len(chain)):]):
                # free axes last in their chains: the group's pieces of a dim together are the piece of the
                # chain without them, so the group holds one rank's block of `s` with those axes Broadcast
                out = self.lack(tuple(Broadcast() if a in free else p for a, p in enumerate(s)), t)
            else:
                out = self._max_lack(have_layout, want_layout, 1, free)
            self._memo[key] = out
        return out


def _rows(combos, per_dim: list, default=None):
    """Per digit combination in `combos`, each table's entry at its positions (`per_dim`: positions and table;
    `default` where it has none)."""
    for x in combos:
        yield [table.get(tuple(x[i] for i in pos), default) for pos, table in per_dim]


def _best(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs (length, overlap) no other pair beats on both (longer and less overlapping): for positive
    factors, the largest ``N - O`` over products is reached among these."""
    out: list[tuple[int, int]] = []
    for n, o in sorted(set(pairs), key=lambda p: (-p[0], p[1])):
        if not out or o < out[-1][1]:
            out.append((n, o))
    return out


def _strides(chain: tuple[int, ...], mesh: tuple[int, ...]) -> dict[int, int]:
    """Per axis of `chain`, what one step of its digit adds to a piece's row-major index in the chain."""
    out, stride = {}, 1
    for a in reversed(chain):
        out[a] = stride
        stride *= mesh[a]
    return out


def _picker(where: list[int]):
    """A function taking the items at positions `where` of a tuple, as a tuple (`operator.itemgetter`
    returns a bare item for one position)."""
    if not where:
        return lambda digits: ()
    if len(where) == 1:
        k = where[0]
        return lambda digits: (digits[k],)
    return operator.itemgetter(*where)


def shared_axes(axes_per_table) -> tuple[int, ...]:
    """The axes that more than one of the tables' axis lists name (sorted): what per-dim tables are joined on.

    >>> shared_axes([(0, 1), (1, 2), (2,)])
    (1, 2)
    """
    seen: dict[int, int] = {}
    for axes in axes_per_table:
        for a in axes:
            seen[a] = seen.get(a, 0) + 1
    return tuple(a for a in sorted(seen) if seen[a] > 1)


def first_rows(columns: list[np.ndarray]) -> np.ndarray:
    """The index of the first of each distinct row of these equal-length columns, ordered by row (lexicographic):
    `np.unique` over rows, with 1-d sorts only (the row form loads `numpy.ma`, tens of ms on a cold call).

    >>> first_rows([np.array([2, 1, 2, 1]), np.array([5, 7, 5, 6])]).tolist()
    [3, 1, 0]
    """
    key = np.zeros(len(columns[0]) if columns else 1, dtype=np.int64)
    for column in columns:   # (renumbered densely at each step: the combined number stays below the row count)
        values, dense = np.unique(column, return_inverse=True)
        key = np.unique(key, return_inverse=True)[1] * len(values) + dense
    return np.unique(key, return_index=True)[1]


def digit_grid(sizes: list[int], k: int, step: int = 1) -> np.ndarray:
    """The digits ``0, step, 2 step, ...`` of axis `k` of a grid of these `sizes` (each the count of digits taken),
    shaped to broadcast along that axis: every digit combination at once, row-major.

    >>> digit_grid([2, 3], 1).tolist(), digit_grid([2, 3], 0, step=4).tolist()
    ([[0, 1, 2]], [[0], [4]])
    """
    return (np.arange(sizes[k], dtype=np.int64) * step).reshape([-1 if m == k else 1 for m in range(len(sizes))])
