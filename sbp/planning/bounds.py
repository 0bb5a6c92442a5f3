"""Lower bounds: what the busiest rank must receive, for `sbp.lower_bound_bytes` and the search's heuristic.

Built on a `Costing`'s blocks (the same layout maths that prices the steps), never on its prices: a bound
holds for any schedule, not only for the moves the planner has. Three bounds, each cached per `Bounds`
(one plan's search):

- `Bounds.move`: nothing left to reduce. Split/Broadcast targets: exactly what each rank lacks of its
  block; Partial targets: per group of ranks that differ only on the target's Partial axes, what no
  member holds, shared out over the group.
- `Bounds.reduction`: Partial axes still to reduce: a counting bound on the contributions that must meet.
- `Bounds.heuristic`: the search's cheap estimate for states with nothing to reduce.
"""
from __future__ import annotations

import math

from ..values.placement import Partial
from .cost import Costing
from .states import State, pending


class Bounds:
    """Lower bounds, in bytes, for one `Costing`'s (global_shape, mesh_shape, itemsize).

    >>> from sbp import S, B, Partial
    >>> bounds = Bounds(Costing((1024, 1024), (4,), 4))
    >>> bounds.lower_bound((S(0),), (B,)), bounds.lower_bound((Partial(),), (B,))
    (3145728, 6291456)
    """

    __slots__ = ("costing", "_memo")

    def __init__(self, costing: Costing) -> None:
        self.costing = costing
        self._memo: dict[tuple, object] = {}

    def lower_bound(self, src: State, dst: State) -> int:
        """Bytes the busiest rank must receive for `src -> dst`: `move` when nothing needs reducing,
        else `reduction`.

        >>> from sbp import S, Partial
        >>> Bounds(Costing((8, 8), (2,), 4)).lower_bound((Partial(),), (S(0),))
        128
        """
        return self.reduction(src, dst) if pending(src, dst) else self.move(src, dst)

    def reduction(self, s: State, d: State) -> int:
        """A bound for Partial sources that holds for any schedule, in bytes.

        Per element, the q contributions of the axes still to reduce need q - 1 receptions to meet,
        and the result m - 1 more to reach the m ranks whose final block holds it (m = 1 when the
        target is Partial too, whose ranks may hold zeros). The busiest rank receives at least the
        total over the ranks' count; a rank whose target block still has other contributors receives
        at least that block. Both `P -> S` ((q-1)/q) and `P -> B` (2(q-1)/q) meet it with one ring
        collective.

        >>> from sbp import S, B, Partial
        >>> b = Bounds(Costing((8, 8), (4,), 4))
        >>> b.reduction((Partial(),), (S(0),)), b.reduction((Partial(),), (B,))
        (192, 384)
        """
        key = ("reduce", s, d)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = self._reduction(s, d)
        return out

    def _reduction(self, s: State, d: State) -> int:
        costing = self.costing
        q = groups = 1  # ranks along the axes still to reduce, and along the kept Partial axes
        for n, p, y in zip(costing.mesh_shape, s, d):
            if isinstance(p, Partial):
                if p == y:
                    groups *= n
                else:
                    q *= n
        if q == 1:   # the axes to reduce have size 1: nothing meets, the parts are the values already
            return self.move(s, d)
        total_elems = math.prod(costing.shape) * groups
        if self._partial_axes(d):
            # Partial targets (new or kept axes): contributions may be re-split, ranks may hold zeros
            traffic, per_rank = total_elems * (q - 1), 0
        else:
            traffic = total_elems * (q - 2) + costing.total_numel(d)
            per_rank = costing.max_local_bytes(d) // costing.itemsize
        floor = -(-traffic // costing.size)
        return max(self.move(s, d), max(floor, per_rank) * costing.itemsize)

    def heuristic(self, s: State, d: State) -> int:
        """A cheap bound for the search (never above the true cost) when nothing needs reducing: what
        ranks lack of their `d` blocks; targets with new Partial axes get `move`'s per-group bound (a
        zero-filled rank needs nothing).

        >>> from sbp import S, B
        >>> Bounds(Costing((8, 8), (2,), 4)).heuristic((S(0),), (B,))
        128
        """
        for p, q in zip(s, d):
            if q.__class__ is Partial and p is not q:  # (placements are interned: equal ones are one object)
                return self.move(s, d)
        return self.costing.lack(s, d) * self.costing.itemsize

    def move(self, s: State, d: State) -> int:
        """What the busiest rank must receive when nothing needs reducing (Partial source axes are
        treated as already reduced, so for Partial states it is a lower bound).

        Split/Broadcast targets: exactly what each rank lacks of its block (a transfer achieves it).
        Partial targets: a rank may hold zeros or any share of a contribution, so per group of ranks
        that differ only on the target's Partial axes, what no member holds of the group's block must
        arrive at one of them: the busiest receives at least that, divided by the group's size.

        >>> from sbp import S, B, Partial
        >>> b = Bounds(Costing((8, 8), (2, 2), 4))
        >>> b.move((S(0), S(1)), (S(1), S(0))), b.move((B, B), (S(0), Partial()))
        (64, 0)
        """
        costing = self.costing
        key = ("move", costing.layout_key(s), d)  # blocks are all that matter: one entry per layout of s
        out = self._memo.get(key)
        if out is not None:
            return out
        new = self._partial_axes(d)
        if not new:
            best = costing.lack(s, d)
        else:
            # per group (ranks differing only on the new Partial axes), what none of them holds arrives
            # at one of them: shared out, the busiest receives at least its share
            best = -(-costing.group_lack(s, d, new) // costing.group_size(new))
        self._memo[key] = best * costing.itemsize
        return best * costing.itemsize

    def _partial_axes(self, d: State) -> tuple[int, ...]:
        key = ("partial", d)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = tuple(a for a, y in enumerate(d) if isinstance(y, Partial))
        return out
