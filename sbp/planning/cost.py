"""The planner's prices: what one step makes the busiest rank receive, and its peak memory.

Collectives are priced with ring formulas on the exact (uneven) block sizes from layout maths:
all_gather receives what the rank lacks, reduce_scatter ``(n-1)`` times its output piece, all_reduce
``2(n-1)/n`` of its data; all_to_all and transfers receive exactly the intersections listed by
`sbp.planning.exchange.exchange`, reduce_transfers both phases of `sbp.planning.exchange.reduce_exchange`. Peak memory
is input + output + communication buffers on the busiest rank, counted in logical elements: the
padding that makes uneven pieces equal (less than one slab per member) is not counted.

Everything is cached per `Costing` (one plan's search): the block maths (`sbp.planning.blocks.Blocks`, its
base: block ranges per dim and splitting axes, per state, per layout, and what ranks lack per pair of
layouts) and the prices of reduce_transfers. Lower bounds, built on the same blocks, are
`sbp.planning.bounds`.

`Pricing` turns a priced step into the search's objective: without a topology exactly the bytes
objective (received bytes + `latency_bytes` per call); with a `sbp.Topology`, the modeled time of the
busiest rank in ns (calls x `call_us` + `Costing.rounds` x alpha + bytes / beta of the slowest link the step
crosses), the bytes objective breaking ties.
"""
from __future__ import annotations

import bisect
import itertools
import math
from typing import Optional

import numpy as np

from ..values.placement import Partial, Split
from ..values.steps import STEP_CALLS, Step
from ..values.topology import Topology, traffic_axes
from . import fields
from .blocks import LARGE_TABLE, Blocks, digit_grid, first_rows, shared_axes
from .exchange import complete_grid, reduce_recv_max, reduce_recv_max_tiles, slab_numel
from .states import State

_SMALL_GROUP = 64
"""A reduce_transfer group of at most this many members is priced from its members' blocks listed one by one;
larger ones from arrays (`Costing._group_tiles`), their target tiles told apart only where they may price
differently when there are more than this many (`_distinct_tiles`)."""

_HELD_KEY = 1 << 18
"""`_distinct_tiles` compares tiles when their count times the most source pieces one holds is at most this
(one row per held piece, padded to the most)."""

EXCHANGE_KINDS = frozenset({"all_to_all", "transfer", "reduce_transfer"})
"""Steps whose messages to different peers are posted together (`sbp.Topology.exchange_us` prices them)."""


class Costing(Blocks):
    """Prices moves for one (global_shape, mesh_shape, itemsize), on the factored blocks of `Blocks`:
    step prices are computed from per-dim pieces, so the work grows with the pieces of the chains
    involved, not with the number of ranks (`work` counts it). Partial prices use the same per-dim tables
    (`lack` with a weight, `group_lack`); only a reduce_transfer whose members share target blocks they do
    not hold between them lists one group's blocks member by member (`reduce_transfer_recv`).

    >>> from sbp import S, B
    >>> c = Costing((8, 8), (4,), 4)
    >>> c.step("all_gather", (0,), (S(0),), (B,), dims=(0,)).bytes
    192
    """

    __slots__ = ()

    def _gathers_in_place(self, rs: tuple, rt: tuple, dim: int) -> bool:
        """Whether equal pieces gathered along dim `dim` land in the output itself (every dim before it
        whole or of length 1 in the output); `rs`, `rt`: the `_state` records of input and output."""
        if not (rs[3] or any(even == 0 for _, even in rs[0])):
            return False  # local sizes differ between ranks (a dim not split evenly has unequal pieces)
        tdims, tlayout = rt[0], rt[2]
        return all(self._longest(e, tlayout[e], tdims[e][1]) <= 1 for e in range(dim))

    def group_size(self, axes: tuple[int, ...]) -> int:
        """Number of ranks in one group along `axes`."""
        n, mesh = 1, self.mesh_shape
        for a in axes:
            n *= mesh[a]
        return n

    def step(self, kind: str, axes: tuple[int, ...], s: State, t: State, dims: tuple[int, ...] = (),
             op: Optional[str] = None) -> Step:
        """The step of a move of `kind` from `s` to `t` on `axes`, priced: the bytes the busiest rank
        receives and its peak memory (the per-kind formulas `sbp.planning.moves.MOVES` lists).

        >>> from sbp import S, B
        >>> Costing((8, 8), (4,), 4).step("all_to_all", (0,), (S(0),), (S(1),), dims=(0, 1)).bytes
        48
        """
        return Step(kind, axes, s, t, dims, op, *self.price_move(kind, axes, s, t, dims))

    def price_move(self, kind: str, axes: tuple[int, ...], s: State, t: State, dims: tuple[int, ...] = ()
                   ) -> tuple[int, int]:
        """(bytes the busiest rank receives, peak bytes) of the move `step` would make, without making the
        `Step` (the search prices many moves and keeps few).

        >>> from sbp import S, B
        >>> Costing((8, 8), (4,), 4).price_move("all_gather", (0,), (S(0),), (B,), dims=(0,))
        (192, 320)
        """
        states = self._states  # (the records are looked up once per move)
        rs = states.get(s) or self._state(s)
        rt = states.get(t) or self._state(t)
        max_in, max_out = rs[1], rt[1]
        if kind == "local":
            recv = buffer = 0
        elif kind == "all_gather":
            recv = self._gather_recv(rs, rt, dims[0])
            # equal pieces gathered along the outermost dim land in the output itself
            buffer = 0 if self._gathers_in_place(rs, rt, dims[0]) else max_out
        elif kind == "all_to_all" or kind == "transfer":
            # inside a self-contained group every missing piece is held by some member
            recv = buffer = self._lack_of(rs, rt, 1)
        elif kind == "reduce_scatter":
            recv = (self.group_size(axes) - 1) * max_out
            buffer = max_in  # the input cut into the members' pieces
        elif kind == "all_reduce":
            # ring: reduce_scatter then all_gather of balanced pieces; the rank with the
            # largest piece receives (n - 1) pieces of its size plus everything else once
            # (increasing in the piece: the largest decides)
            n = self.group_size(axes)
            recv = -(-max_in // n) * (n - 2) + max_in if n > 1 else 0
            buffer = 0
        elif kind == "reduce_transfer":
            # contributions arrive at the owners, then results at the other members that need them
            recv = buffer = self.reduce_transfer_recv(s, t, axes)
        else:  # pragma: no cover
            raise ValueError(kind)
        itemsize = self.itemsize
        return recv * itemsize, (max_in + max_out + buffer) * itemsize

    def _gather_recv(self, rs: tuple, rt: tuple, d: int) -> int:
        """The most elements a rank gains in an all_gather of dim `d` (`rs`, `rt`: the `_state` records of
        input and output): only `d`'s pieces change, and the other dims' pieces vary on other axes, so the
        largest of them multiply the largest gain."""
        in_dims, in_layout = rs[0], rs[2]
        out_dims, out_layout = rt[0], rt[2]
        if in_dims[d][1] is not None and out_dims[d][1] is not None:
            gain = out_dims[d][1] - in_dims[d][1]
        else:
            # an output piece of length L is cut by the gathered axes (`inner` pieces, balanced at every
            # level) into pieces of at least L // inner (nested floors compose), and L - L // inner grows
            # with L: the longest output piece gains most
            inner = math.prod(self.mesh_shape[a] for a in in_layout[d][len(out_layout[d]):])
            longest = self._longest(d, out_layout[d], out_dims[d][1])
            gain = longest - longest // inner
        rest = math.prod(self._longest(e, chain, even) for e, (chain, (_, even)) in enumerate(zip(in_layout, in_dims))
                         if e != d)
        return gain * rest

    def reduce_transfer_recv(self, s: State, t: State, axes: tuple[int, ...]) -> int:
        """Elements the busiest rank receives in a ``reduce_transfer`` over `axes` (both phases), from
        the slabs of the schedule the executor runs (`sbp.planning.exchange.reduce_recv_max`).

        Groups that hold the same blocks have the same schedule, so each distinct one is priced once.
        """
        key = ("reduce_transfer", s, t, axes)
        out = self._memo.get(key)
        if out is None:
            if self._state(s)[3] and self._state(t)[3]:
                out = self._reduce_recv_even(s, t, axes)
            if out is None:
                out = self._reduce_recv_closed(s, t, axes)
            self._memo[key] = out
        if out is None:
            q = self.group_size(tuple(a for a in axes if isinstance(s[a], Partial)))
            # groups hold the same blocks when they agree on the axes splitting a dim outside the group
            outside = [a for a, p in enumerate(s) if a not in axes and isinstance(p, Split)]
            if self._state(s)[3] and self._state(t)[3]:
                outside = []  # even splits: every group is a translate of the first, with the same schedule
            have, want = self.layout_key(s), self.layout_key(t)
            out = 0
            for fixed in self._distinct_groups(have, want, axes, outside):
                self.work += self.group_size(axes)
                if self.group_size(axes) > _SMALL_GROUP:
                    out = max(out, reduce_recv_max_tiles(*self._group_tiles(have, want, axes, fixed), q))
                else:   # (a few members: listed one by one, cheaper than arrays)
                    members = self._group_coords(axes, fixed)
                    out = max(out, reduce_recv_max([self._block_at(have, c) for c in members],
                                                   [self._block_at(want, c) for c in members], q))
            self._memo[key] = out
        return out

    def _distinct_groups(self, have: tuple, want: tuple, axes: tuple[int, ...],
                         outside: list[int]) -> list[dict[int, int]]:
        """One group (its digits on the `outside` axes) per distinct reduce_transfer schedule: the groups
        along `axes` that differ on the `outside` axes (each in one dim's chains) hold, per dim, the pieces
        at a fixed offset in both chains; two groups whose pieces per dim are translates of each other (the
        same lengths and overlaps, member by member) have the same schedule and price. Per dim, the digits
        of its outside axes are tried and grouped by the pieces' ranges relative to the first one, so the
        groups priced are the product of the distinct ones per dim, not one per digit combination.

        >>> from sbp import S, Partial
        >>> c = Costing((10, 8), (2, 3), 4)   # 10 rows in pieces of 5 / 4 and 3 / 2, 2, 1, 2, 2, 1
        >>> len(c._distinct_groups(*[c.layout_key(x) for x in ((S(0), Partial()), (S(0), S(0)))], (1,), [0]))
        1
        """
        mesh, per_dim = self.mesh_shape, []
        for d, (schain, tchain) in enumerate(zip(have, want)):
            mine = [a for a in outside if a in schain or a in tchain]
            if not mine:
                continue
            sspans, tspans = self._spans(d, schain), self._spans(d, tchain)

            def offsets(chain: tuple[int, ...], digits: dict) -> list[int]:
                # each member's piece index along `chain`, from its digits (group axes) and `digits`
                ks = [0]
                for a in chain:
                    ks = [k * mesh[a] + i for k in ks for i in (range(mesh[a]) if a in axes else (digits[a],))]
                return ks

            kinds: dict[tuple, dict[int, int]] = {}
            for where in itertools.product(*(range(mesh[a]) for a in mine)):
                digits = dict(zip(mine, where))
                ranges = [sspans[k] for k in offsets(schain, digits)] + [tspans[k] for k in offsets(tchain, digits)]
                base = min(lo for lo, _ in ranges)
                self.work += len(ranges)
                kinds.setdefault(tuple((lo - base, hi - base) for lo, hi in ranges), digits)
            per_dim.append(list(kinds.values()))
        return [{a: x for part in parts for a, x in part.items()} for parts in itertools.product(*per_dim)]

    def _group_coords(self, axes: tuple[int, ...], fixed: dict[int, int]) -> list[tuple[int, ...]]:
        """The coords of the group along `axes` whose other coords are `fixed` (0 where not given), in
        row-major order."""
        ranges = [range(n) if a in axes else (fixed.get(a, 0),) for a, n in enumerate(self.mesh_shape)]
        return list(itertools.product(*ranges))

    def _block_at(self, layout: tuple, coord: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The block (one range per dim) held at `coord` by states of this layout key."""
        out = []
        for d, chain in enumerate(layout):
            k = 0
            for a in chain:
                k = k * self.mesh_shape[a] + coord[a]
            out.append(self._spans(d, chain)[k])
        return tuple(out)

    def _group_tiles(self, have: tuple, want: tuple, axes: tuple[int, ...], fixed: dict[int, int]) -> tuple:
        """The arguments of `sbp.planning.exchange.reduce_recv_max_tiles` for the group along `axes` whose other
        coords are `fixed` (0 where not given), members in row-major order, states of layout keys `have` and
        `want`: the distinct source tiles, and per target tile its needers' count and, per source tile they
        hold that meets the tile, the lengths of the piece they share, the first one's position among them and
        their count. On arrays, per member: its piece index per dim from its digits on the dim's chain, tiles
        told apart by those indices."""
        mesh, axes = self.mesh_shape, tuple(sorted(axes))
        sizes = [mesh[a] for a in axes]
        members = math.prod(sizes)

        def tiles(layout: tuple) -> tuple:
            # (per dim the chain's ranges, per dim the members' piece indices, a member of each tile, the
            # members' tile numbers)
            spans, index, number, radix = [], [], np.zeros(members, dtype=np.int64), 1
            for d, chain in enumerate(layout):
                k = np.zeros((), dtype=np.int64)
                for a in chain:
                    k = k * mesh[a] + (digit_grid(sizes, axes.index(a)) if a in axes else fixed.get(a, 0))
                spans.append(self._spans(d, chain))
                index.append(np.broadcast_to(k, sizes).ravel())
                if radix * len(spans[-1]) >= 2 ** 62:   # renumber the tiles so far before the product overflows
                    number = np.unique(number, return_inverse=True)[1]
                    radix = int(number.max(initial=0)) + 1
                number, radix = number * len(spans[-1]) + index[-1], radix * len(spans[-1])
            _, first, number = np.unique(number, return_index=True, return_inverse=True)
            return spans, np.stack(index) if index else np.zeros((0, members), dtype=np.int64), first, number

        def memo_tiles(layout: tuple) -> tuple:   # (the target side recurs across the search's moves)
            key = ("group tiles", layout, axes, tuple(sorted(fixed.items())))
            out = self._memo.get(key)
            if out is None:
                out = self._memo[key] = tiles(layout)
            return out

        sspans, sindex, sfirst, src = memo_tiles(have)
        tspans, tindex, tfirst, dst = memo_tiles(want)

        def blocks(spans: list, index: np.ndarray, at: np.ndarray) -> list:   # the blocks of members `at`
            if not spans:
                return [()] * len(at)
            return list(zip(*([s[k] for k in index[d, at].tolist()] for d, s in enumerate(spans))))

        order = np.argsort(dst, kind="stable")       # members by target tile, in member order within each
        need = np.bincount(dst)
        pos = np.empty(members, dtype=np.int64)
        pos[order] = np.arange(members) - (np.cumsum(need) - need)[dst[order]]
        _, at, count = np.unique(dst * len(sfirst) + src, return_index=True, return_counts=True)
        # per (target tile, source tile held by a needer): the piece they share, per dim; kept where not empty
        lengths = []
        for d, (schain, tchain) in enumerate(zip(have, want)):
            (slo, shi), (tlo, thi) = self._spans_array(d, schain), self._spans_array(d, tchain)
            i, j = sindex[d, at], tindex[d, at]
            lengths.append(np.minimum(shi[i], thi[j]) - np.maximum(slo[i], tlo[j]))
        meets = np.all(np.stack(lengths) > 0, axis=0) if lengths else np.ones(len(at), dtype=bool)
        at = at[meets]
        rows = np.stack([x[meets] for x in lengths] + [pos[at], count[meets]], axis=1)
        by = np.lexsort((pos[at], dst[at]))          # per target tile, its held pieces by first needer
        rows, tile_of = rows[by], dst[at][by]
        bounds = np.searchsorted(tile_of, np.arange(len(tfirst) + 1))
        sranges, tranges = [], []
        for d, (schain, tchain) in enumerate(zip(have, want)):
            (slo, shi), (tlo, thi) = self._spans_array(d, schain), self._spans_array(d, tchain)
            sranges.append((slo[sindex[d, sfirst]], shi[sindex[d, sfirst]]))
            tranges.append((tlo[tindex[d, tfirst]], thi[tindex[d, tfirst]]))
        cuts = _complete_cuts(sranges)
        keep = _distinct_tiles(cuts, tranges, need, rows, bounds) if cuts is not None else None
        chosen = range(len(tfirst)) if keep is None else keep.tolist()
        need_list, bounds = need.tolist(), bounds.tolist()
        sources = complete_grid([list(map(tuple, c.tolist())) for c in cuts]) if cuts is not None else \
            blocks(sspans, sindex, sfirst)
        return sources, [
            (tile, need_list[c], tuple(map(tuple, rows[bounds[c]:bounds[c + 1]].tolist())))
                         for c, tile in zip(chosen, blocks(tspans, tindex, tfirst[chosen]))]

    def _reduce_recv_closed(self, s: State, t: State, axes: tuple[int, ...]) -> Optional[int]:
        """`reduce_transfer_recv` from per-dim tables, with no per-rank schedule, in the two common cases
        (else None). A member of the group receives its target block ``T`` but the slabs it owns, and
        ``q - holds`` contributions of each slab it owns.

        - Every member needs its own target block (no group axis is Broadcast in `t`): it owns every
          slab of ``T``, so it receives ``q |T| - |T held|`` (a weighted `lack`).
        - The members that share ``T`` (differing on its Broadcast axes) hold all of it between them:
          each owns one balanced slab of what it holds of ``T``, shared with the ``h`` members holding
          the same block, so the busiest receives ``|T| + (q - 2)`` times the first (largest) slab.
        """
        q = self.group_size(tuple(a for a in axes if isinstance(s[a], Partial)))
        shared = tuple(a for a in axes if self.mesh_shape[a] > 1 and not isinstance(t[a], Split))
        if not shared:
            return self.lack(s, t, weight=q)
        if q < 2 or self.group_lack(s, t, shared) > 0:
            return None
        h = math.prod(self.mesh_shape[a] for a in shared if not isinstance(s[a], Split))
        value = lambda lengths, overlaps: math.prod(lengths) + (q - 2) * _first_slab(overlaps, h)
        return self._max_per_rank(self.layout_key(s), self.layout_key(t), value)

    def _reduce_recv_even(self, s: State, t: State, axes: tuple[int, ...]) -> Optional[int]:
        """`reduce_transfer_recv` when every dim is split evenly in `s` and `t` and, inside the group, each
        dim's source and target grids nest (one piece count divides the other); else None. No work per
        member: every group is a translate of the first, and inside it every piece of a target tile ``T``
        has one shape ``P`` (per dim the shorter of a source and a target piece).

        The axes of the group Split in `t` (*fixed*) choose ``T``; its ``n`` needers differ on the others,
        in row-major order. A source tile is held by a needer when its digits on the fixed axes are
        ``T``'s: a condition per axis, so per dim, of the ``m`` pieces of ``T`` (``m`` the product over
        dims), ``H`` are held, and the first needer whose source piece meets ``T`` sits at a position that
        adds up over dims. Per dim a table over the digits of the fixed axes of both chains gives both;
        dims are joined on the axes they share. With ``q`` contributions and ``h`` needers per held tile,
        the busiest receives ``|T|`` plus ``(q-1) U slab(P, n, k)`` for its slabs of the ``U = m - H``
        pieces no needer holds (``k`` its position) plus ``(q-2) slab(P, h, 0)`` when it holds a piece: the
        larger of the first needer's and the first holder's sum (`sbp.planning.exchange.reduce_recv_max`).
        """
        q = self.group_size(tuple(a for a in axes if isinstance(s[a], Partial)))
        if q < 2:
            return None
        if 0 in self.shape:
            return 0
        (sdims, _, slayout, _), (tdims, tlargest, tlayout, _) = self._state(s), self._state(t)
        fixed = tuple(a for a in axes if isinstance(t[a], Split))
        needers = tuple(a for a in axes if a not in fixed)
        chains = [(tuple(a for a in schain if a in axes), tuple(a for a in tchain if a in axes))
                  for schain, tchain in zip(slayout, tlayout)]
        shape, per_dim, tables = [], [], []
        values = self._holds_values(chains)
        for e, (cs, ct) in enumerate(chains):
            ns, nt = self.group_size(cs), self.group_size(ct)
            if ns % nt and nt % ns:
                return None
            shape.append(min(sdims[e][1], tdims[e][1]))
            per_dim.append(ns // nt if ns >= nt else 1)
            elsewhere = frozenset(a for f, (c, d) in enumerate(chains) if f != e for a in c + d)
            tables.append(self._even_holds(cs, ct, fixed, needers, elsewhere, values))
        nneed = self.group_size(needers)
        h = self.group_size(tuple(a for a in needers if not isinstance(s[a], Split)))
        lengths, m = tuple(shape), math.prod(per_dim)
        first = slab_numel(lengths, nneed, 0)
        own = (q - 2) * slab_numel(lengths, h, 0)
        best = 0
        for held, pos in self._join_options(tables, values):
            if held == 0:
                value = (q - 1) * m * first
            else:
                value = max((q - 1) * (m - held) * first,
                            (q - 1) * (m - held) * slab_numel(lengths, nneed, pos) + own)
            best = max(best, value)
        return tlargest + best

    def _holds_values(self, chains: list[tuple]) -> Optional[dict]:
        """The digits `_reduce_recv_even`'s tables must take per axis (None: all): a dim's chains in the group
        compare as a finer and a coarser one (`sbp.planning.fields.compared_digits`). What a needer holds
        depends on the digits through equalities only, and its position grows with them, so the digits
        that keep every equality with the least values meet the busiest member."""
        axes = sorted({a for pair in chains for c in pair for a in c})
        if max((self.mesh_shape[a] for a in axes), default=1) <= fields.SMALL:
            return None
        relations = []
        for cs, ct in chains:
            ns, nt = self.group_size(cs), self.group_size(ct)
            if (ns % nt and nt % ns) or (ns >= nt and self._covering(cs, ns // nt) is None):
                return None   # (`_even_holds` lists pieces one by one)
            relations.append((cs, ct, ns // nt) if ns >= nt else (ct, cs, nt // ns))
        return fields.compared_digits(relations, self.mesh_shape, axes)

    def _even_holds(self, cs: tuple[int, ...], ct: tuple[int, ...], fixed: tuple[int, ...], needers: tuple[int, ...],
                    elsewhere: frozenset, values: Optional[dict] = None) -> tuple[tuple, dict]:
        """For one dim of `_reduce_recv_even` (source chain `cs` and target chain `ct` inside the group):
        the fixed axes of both chains and, per digits of them, the set of (pieces of ``T`` held by some
        needer, the least position a needer holding one adds from its digits on the `needers` axes of
        `cs`). Axes of `ct` that neither `cs` nor another dim (`elsewhere`) names only move ``T`` along
        the dim: when none is named, the table is over the fixed axes of `cs` only, each entry the options
        of every ``T`` along the dim; otherwise such an axis is left out where it cannot change which
        source piece holds ``T``, or enumerated one digit per distinct source piece."""
        private = not any(a in cs or a in elsewhere for a in ct)
        key = ("even_holds", cs, ct, fixed, needers, frozenset(a for a in cs + ct if a in elsewhere),
               values and tuple((a, values[a]) for a in sorted(set(cs + ct)) if a in values))
        out = self._memo.get(key)
        if out is not None:
            return out
        mesh = self.mesh_shape
        keys = tuple(sorted(a for a in set(cs + ct) if a in fixed))
        stride = {a: math.prod(mesh[b] for b in needers if b > a) for a in needers}
        ns, nt = self.group_size(cs), self.group_size(ct)
        cover = self._covering(cs, ns // nt) if ns >= nt else ()
        table: dict[tuple, set] = {}
        if private and cover is not None:
            # T moves along the dim over every run of source pieces (ns >= nt) or every source piece: the
            # first needer's digits can be 0 wherever they are not fixed; T elsewhere holds nothing
            front, part, u, back = cover or (cs, None, 1, ())
            keys = tuple(sorted(a for a in cs if a in fixed))
            held = (u if part is not None and part not in fixed else 1) * math.prod(
                mesh[a] for a in back if a not in fixed)
            spelled = [a for a in front if a in fixed] + ([part] if part in fixed else [])
            misses = any(mesh[a] > (u if a == part else 1) for a in spelled)
            options = {(held, 0), (0, 0)} if misses else {(held, 0)}
            table = {digits: options for digits in itertools.product(*(self._digit_list(a, values) for a in keys))}
            self.work += len(table)
            out = self._memo[key] = (keys, table)
            return out
        if cover is None:  # not aligned: piece by piece
            for i in range(ns):
                digits, k = {}, i
                for a in reversed(cs):
                    k, digits[a] = divmod(k, mesh[a])
                pos = sum(digits[a] * stride[a] for a in cs if a in stride)
                at, k = dict(digits), i // (ns // nt)
                for a in reversed(ct):
                    k, at[a] = divmod(k, mesh[a])
                if any(at[a] != digits[a] for a in cs if a in ct):
                    continue  # the target piece's digits on an axis of both chains differ: not this piece
                kk = tuple(at[a] for a in keys)
                held, least = table.get(kk, (0, pos))
                table[kk] = (held + 1, min(least, pos))
            table = {kk: {table[kk]} if kk in table else {(0, 0)}
                     for kk in itertools.product(*(range(mesh[a]) for a in keys))}
            self.work += ns + len(table)
        else:  # per target digits: the held pieces are a product of digit ranges
            front, part, u, back = cover or (cs, None, 1, ())
            spread = math.prod(mesh[a] for a in back if a not in fixed)
            steps, loose = {}, set()
            inner = self._covering(ct, nt // ns) if not cover else None
            if inner is not None:
                # T inside one source piece: of the target digits no other dim names, the last ones do not
                # change which piece (and one of both chains there matches the piece's digit or not, as T
                # moves: `loose`), and the partly spelled one counts by its run of u
                back_t = [a for a in inner[3] if a not in elsewhere]
                loose = {a for a in back_t if a in cs}
                keys = tuple(a for a in keys if a not in back_t)
                if inner[1] not in cs and inner[1] not in elsewhere:
                    steps[inner[1]] = inner[2]
            where = {a: k for k, a in enumerate(keys)}
            lists = {a: [v for v in self._digit_list(a, values) if v % steps.get(a, 1) == 0] for a in keys}
            if math.prod(len(x) for x in lists.values()) > LARGE_TABLE:
                out = self._even_holds_arrays(keys, lists, elsewhere, ct, cover, (front, part, u, spread),
                                              fixed, loose, stride, nt // ns if not cover else 1)
                self._memo[key] = out
                return out
            for digits in itertools.product(*(lists[a] for a in keys)):
                j = 0
                for a in ct:
                    j = j * mesh[a] + (digits[where[a]] if a in where else 0)
                held, pos, k, misses = spread, 0, j if cover else j // (nt // ns), False
                if part is not None:
                    k, c = divmod(k, mesh[part] // u)
                    if part not in fixed:
                        held, pos = held * u, c * u * stride[part]
                    elif part in loose:
                        misses = mesh[part] > u
                    elif not c * u <= digits[where[part]] < (c + 1) * u:
                        table[digits] = {(0, 0)}
                        continue
                for a in reversed(front):
                    k, digit = divmod(k, mesh[a])
                    if a not in fixed:
                        pos += digit * stride[a]
                    elif a in loose:
                        misses = misses or mesh[a] > 1
                    elif digits[where[a]] != digit:
                        table[digits] = {(0, 0)}
                        break
                else:
                    table[digits] = {(held, pos), (0, 0)} if misses else {(held, pos)}
            self.work += len(table)
        out = self._memo[key] = (keys, table)
        return out

    def _even_holds_arrays(self, keys: tuple[int, ...], lists: dict, elsewhere: frozenset,
                           ct: tuple[int, ...], cover, cut: tuple, fixed: tuple[int, ...], loose: set,
                           stride: dict, r: int) -> tuple[tuple, dict]:
        """`_even_holds`' table per target digits, on arrays, for large ones: every digit combination of `keys`
        (the digits `lists[a]` names) at once, then the options unioned over the digits of the axes no other dim
        names (their digits are never joined on: `_join_options` would union them) and reduced to the pairs
        no other beats (per group, the least position of a holder; nothing held where some combination
        misses). `cut`: (front, part, u, spread) of the source chain's covering; `r`: target pieces per
        source piece (1 when the target tile covers source pieces)."""
        mesh = self.mesh_shape
        front, part, u, spread = cut
        grid = [len(lists[a]) for a in keys]
        arrays = [np.asarray(lists[a], dtype=np.int64) for a in keys]
        place = lambda a: digit_grid(grid, keys.index(a))  # noqa: E731
        digit = lambda a: arrays[keys.index(a)][place(a)]  # noqa: E731
        j = np.zeros((), dtype=np.int64)
        for a in ct:
            j = j * mesh[a] + (digit(a) if a in keys else 0)
        k = j if cover else j // r
        held, pos = spread, np.zeros((), dtype=np.int64)
        dead = np.zeros((), dtype=bool)
        misses = False
        if part is not None:
            k, c = np.divmod(k, mesh[part] // u)
            if part not in fixed:
                held, pos = held * u, pos + c * u * stride[part]
            elif part in loose:
                misses = mesh[part] > u
            else:
                dead = dead | (digit(part) < c * u) | (digit(part) >= (c + 1) * u)
        for a in reversed(front):
            k, d = np.divmod(k, mesh[a])
            if a not in fixed:
                pos = pos + d * stride[a]
            elif a in loose:
                misses = misses or mesh[a] > 1
            else:
                dead = dead | (digit(a) != d)
        dead, pos = np.broadcast_to(dead, grid).ravel(), np.broadcast_to(pos, grid).ravel()
        self.work += dead.size
        kept = tuple(a for a in keys if a in elsewhere)
        group = np.zeros(dead.size, dtype=np.int64)
        for a in kept:
            group = group * grid[keys.index(a)] + np.broadcast_to(place(a), grid).ravel()
        size = math.prod(grid[keys.index(a)] for a in kept)
        alive = ~dead
        least = np.full(size, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(least, group[alive], pos[alive])
        some_dead = np.bincount(group[dead], minlength=size) > 0
        table: dict[tuple, set] = {}
        for digits, p, no in zip(itertools.product(*(lists[a] for a in kept)),
                                 least.tolist(), some_dead.tolist()):   # (groups row-major over `kept`)
            options = set() if p == np.iinfo(np.int64).max else {(held, p)}
            if no or misses or not options:
                options.add((0, 0))
            table[digits] = options
        return kept, table

    def _join_options(self, tables: list[tuple[tuple, dict]], values: Optional[dict] = None) -> set[tuple[int, int]]:
        """Every (pieces held, least position of a needer holding one) a target tile can have, from the
        per-dim tables of `_even_holds` joined on the axes several
        dims' tables share: held pieces multiply, positions add; dominated pairs (more held, a later
        position) are dropped. `values`: the digits the tables were built on (`_holds_values`)."""
        shared = shared_axes(keys for keys, _ in tables)
        grouped = []
        for keys, table in tables:
            where = [keys.index(a) for a in shared if a in keys]
            groups: dict[tuple, set] = {}
            for digits, options in table.items():
                groups.setdefault(tuple(digits[i] for i in where), set()).update(options)
            grouped.append(([shared.index(keys[i]) for i in where], groups))
        out: set[tuple[int, int]] = set()
        for row in self._shared_rows(shared, grouped, default={(0, 0)}, values=values):
            combos = {(1, 0)}
            for options in row:
                combos = _pareto({(n * k, p + r) if n * k else (0, 0) for n, p in combos for k, r in options})
            out.update(combos)
        return out

    def rounds(self, step: Step) -> int:
        """Message rounds of a step on the busiest rank, for the alpha term of the time model: ``n - 1``
        for ring all_gather / reduce_scatter and for all_to_all over `n` members, ``2 (n - 1)`` for
        all_reduce; a transfer receives from at most as many peers as source tiles its target block
        meets (its own left out where every rank holds some of its target), a reduce_transfer that plus
        ``q - 1`` contributions per slab; one at least for a step that moves bytes.

        >>> from sbp import S, B
        >>> c = Costing((8, 8), (2, 4), 4)
        >>> c.rounds(c.step("all_gather", (1,), (B, S(0)), (B, B), dims=(0,)))
        3
        >>> c.rounds(c.step("transfer", (0, 1), (S(0), S(1)), (S(1), S(0))))   # rank (0, 2) holds none of its block
        2
        """
        if step.kind == "local" or (step.bytes == 0 and step.kind in ("transfer", "reduce_transfer")):
            return 0
        n = self.group_size(step.axes)
        match step.kind:
            case "all_reduce":
                return 2 * (n - 1)
            case "transfer":
                return min(n - 1, max(1, self._peers(step.src, step.dst)))
            case "reduce_transfer":
                q = self.group_size(tuple(a for a in step.axes if isinstance(step.src[a], Partial)))
                return min(n - 1, max(1, q - 1 + self._peers(step.src, step.dst)))
            case _:
                return n - 1

    def _peers(self, s: State, t: State) -> int:
        """The most peers a rank fetches pieces of its `t` block from: the source tiles that block meets
        (`_tiles_met`), less its own where every rank provably holds some of its own (nonempty) target block:
        when the most any rank lacks is below the smallest nonempty target block."""
        layout = self.layout_key(t)
        key = ("smallest", layout)
        smallest = self._memo.get(key)
        if smallest is None:
            smallest = self._memo[key] = math.prod(
                min((hi - lo for lo, hi in self._spans(d, chain) if hi > lo), default=0)
                for d, chain in enumerate(layout))
        met = self._tiles_met(s, t)
        return met - 1 if self.lack(s, t) < smallest else met

    def _tiles_met(self, s: State, t: State) -> int:
        """The most source tiles of `s` one target block of `t` meets: per dim, the most distinct
        source ranges one target range meets, multiplied over dims (an upper bound)."""
        out = 1
        (hdims, _, hlayout, _), (wdims, _, wlayout, _) = self._state(s), self._state(t)
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

    __slots__ = ("costing", "latency", "topology", "_traffic")

    def __init__(self, costing: Costing, latency_bytes: int, topology: Optional[Topology] = None) -> None:
        self.costing, self.latency, self.topology = costing, latency_bytes, topology
        self._traffic = traffic_axes(costing.mesh_shape)

    def time_ns(self, step: Step) -> int:
        """Modeled time of `step` (needs a topology): `Step.calls` x call cost + `Costing.rounds` x alpha +
        bytes / beta, slowest link of its axes of size > 1 (`sbp.Topology.time_ns`; the call cost is 0
        without `call_us`): a group has one member along an axis of size 1, so no traffic crosses its link.

        >>> from sbp import S, B
        >>> c = Costing((8, 8), (2,), 4)
        >>> step = c.step("all_gather", (0,), (S(0),), (B,), dims=(0,))
        >>> Pricing(c, 0, Topology((1.0,), (8.0,))).time_ns(step)
        1016
        >>> Pricing(c, 0, Topology((1.0,), (8.0,), call_us=(5.0,))).time_ns(step)   # one call: 5 µs more
        6016
        """
        axes = tuple(a for a in step.axes if a in self._traffic)
        return self.topology.time_ns(axes, self.costing.rounds(step), step.bytes, step.kind in EXCHANGE_KINDS,
                                     step.calls)

    def price(self, step: Step) -> tuple[int, int]:
        """(primary, secondary) of a priced step."""
        weighted = step.bytes + self.latency * step.calls
        return (weighted, 0) if self.topology is None else (self.time_ns(step), weighted)

    def price_of(self, kind: str, axes: tuple[int, ...], s: State, t: State, dims: tuple[int, ...],
                 op: Optional[str], nbytes: int, peak: int) -> tuple[int, int]:
        """`price` of the step a move makes, from its priced bytes and peak (`Costing.price_move`); the
        `Step` is made only when a topology needs it.

        >>> from sbp import S, B
        >>> c = Costing((8, 8), (2,), 4)
        >>> Pricing(c, 10).price_of("all_gather", (0,), (S(0),), (B,), (0,), None, 128, 384)
        (138, 0)
        """
        if self.topology is None:
            return nbytes + self.latency * STEP_CALLS[kind], 0
        return self.price(Step(kind, axes, s, t, dims, op, nbytes, peak))

    def least(self, calls: int) -> tuple[int, int]:
        """What a move of `calls` calls costs at least before it is priced (nothing for bytes or rounds)."""
        return (self.latency * calls, 0) if self.topology is None else (0, self.latency * calls)

    def estimate(self, nbytes: int, calls: int) -> tuple[int, int]:
        """A lower bound of what is left when the busiest rank must still receive `nbytes` in `calls`
        calls at least: over the fastest link, one round per call (when bytes move: a step that moves
        nothing may take no round), and the cheapest call cost once (`sbp.Topology.bound_ns`)."""
        weighted = nbytes + self.latency * calls
        if self.topology is None:
            return weighted, 0
        return self.topology.bound_ns(nbytes, calls if nbytes > 0 else 0, self._traffic), weighted

    def above_bound(self, steps, bound: int) -> bool:
        """Whether `steps` cost more than the lower bound `bound` (bytes) allows under this objective: more
        bytes than `bound` without a topology; with one, more time than `bound`'s time form (`estimate`,
        as `sbp.Plan.lower_bound_time_us`). The search reruns without the memory cap only then.

        >>> from sbp import S, B
        >>> c = Costing((8, 8), (2,), 4)
        >>> steps = [c.step("all_gather", (0,), (S(0),), (B,), dims=(0,))]
        >>> Pricing(c, 0).above_bound(steps, 128), Pricing(c, 0, Topology((1.0,), (8.0,))).above_bound(steps, 128)
        (False, False)
        """
        if self.topology is None:
            return sum(s.bytes for s in steps) > bound
        return self.total(steps)[0] > self.estimate(bound, int(bound > 0))[0]

    def total(self, steps) -> tuple[int, int]:
        """The objective of a list of steps (the sum of their prices)."""
        prices = [self.price(s) for s in steps]
        return sum(p for p, _ in prices), sum(q for _, q in prices)


def _complete_cuts(sources: list[tuple]) -> Optional[list[np.ndarray]]:
    """Per dim the distinct ranges (rows (lo, hi), sorted) of a group's source tiles (`sources[d]`: their
    ranges along dim `d`, (lo, hi) arrays), when every combination of them is a tile; else None."""
    if not sources or not len(sources[0][0]):
        return None
    cuts = [np.stack([lo, hi], axis=1)[first_rows([lo, hi])] for lo, hi in sources]
    if len(first_rows([x for pair in sources for x in pair])) != math.prod(len(c) for c in cuts):
        return None
    return cuts


def _distinct_tiles(cuts: list[np.ndarray], tiles: list[tuple], need: np.ndarray, rows: np.ndarray,
                    bounds: np.ndarray) -> Optional[np.ndarray]:
    """Of a group's target tiles (`tiles[d]`: their ranges along dim `d`, (lo, hi) arrays; `need` their
    needers; `rows[bounds[c]:bounds[c + 1]]` tile ``c``'s held pieces as `Costing._group_tiles` lists them),
    one per class that `sbp.planning.exchange.reduce_recv_max_tiles` prices alike: per dim the same pieces
    cut by the source ranges (`cuts[d]`, of a complete grid: `_complete_cuts`; counted as the number met,
    the first and last lengths, and the lengths between counted per value), the same needers and held
    pieces. The first tile of each class, in order; None when there are few tiles, too many held pieces to
    compare (`_HELD_KEY`) or many distinct source lengths. Classes are found by a hash of each tile's key
    and checked against the key itself (exact: on a collision, by the keys)."""
    ntiles, per = len(need), np.diff(bounds)
    if ntiles <= _SMALL_GROUP or ntiles * per.max(initial=0) > _HELD_KEY:
        return None
    columns = [need, per]
    for cut, (lo, hi) in zip(cuts, tiles):
        cut = cut[cut[:, 1] > cut[:, 0]]                # the non-empty source ranges, in order, disjoint
        a, b = cut[:, 0], cut[:, 1]
        values, which = np.unique(b - a, return_inverse=True)
        if len(values) > 8:
            return None
        first = np.searchsorted(b, lo, side="right")    # the source ranges met: first .. stop - 1
        n = np.maximum(np.searchsorted(a, hi, side="left") - first, 0)
        last = np.minimum(first + np.maximum(n - 1, 0), len(a) - 1)
        at = np.minimum(first, len(a) - 1)
        if len(a):
            head = np.where(n > 0, np.minimum(hi, b[at]) - np.maximum(lo, a[at]), 0)
            tail = np.where(n > 1, np.minimum(hi, b[last]) - np.maximum(lo, a[last]), 0)
        else:
            head = tail = np.zeros(ntiles, dtype=np.int64)
        prefix = np.zeros((len(a) + 1, len(values)), dtype=np.int64)
        if len(a):
            prefix[1:] = np.cumsum(np.eye(len(values), dtype=np.int64)[which], axis=0)
        middle = np.where((n > 2)[:, None], prefix[np.maximum(last, 0)] - prefix[np.minimum(first + 1, len(a))], 0)
        columns += [n, head, tail, *middle.T]
    width = rows.shape[1]
    held = np.full((ntiles, int(per.max(initial=0)) * width), -1, dtype=np.int64)
    tile_of = np.repeat(np.arange(ntiles), per)
    slot = (np.arange(len(rows)) - bounds[:-1][tile_of]) * width
    for w in range(width):
        held[tile_of, slot + w] = rows[:, w]
    key = np.column_stack(columns + [held]).astype(np.int64)
    with np.errstate(over="ignore"):
        _, first, inverse = np.unique((key * _hash_weights(key.shape[1])).sum(axis=1), return_index=True,
                                      return_inverse=True)
    if not np.array_equal(key, key[first[inverse]]):   # a hash collision: by the keys themselves
        first = first_rows(list(key.T))
    return np.sort(first)


def _hash_weights(n: int) -> np.ndarray:
    """`n` fixed odd 62-bit weights (multiples of the golden ratio's 64-bit fraction): a row's weighted sum,
    wrapping, hashes it the same on every rank."""
    return np.array([(0x9E3779B97F4A7C15 * (k + 1)) % (1 << 62) | 1 for k in range(n)], dtype=np.int64)


def _pareto(pairs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The (held, position) pairs no other pair beats on both (fewer held, an earlier position); a pair
    with nothing held is kept apart (its position does not count)."""
    out, least = {(0, 0)} if any(n == 0 for n, _ in pairs) else set(), None
    for n, p in sorted(p for p in pairs if p[0]):
        if least is None or p < least:
            out.add((n, p))
            least = p
    return out


def _first_slab(lengths: tuple[int, ...], parts: int) -> int:
    """Elements of the first (largest) of `parts` balanced slabs of a piece with these per-dim lengths,
    cut as `sbp.planning.exchange` cuts it (its outermost dim long enough, else its longest one); 0 for
    an empty piece."""
    if 0 in lengths:
        return 0
    if parts == 1 or not lengths:
        return math.prod(lengths)
    d = next((d for d, n in enumerate(lengths) if n >= parts), lengths.index(max(lengths)))
    return math.prod(lengths) // lengths[d] * -(-lengths[d] // parts)
