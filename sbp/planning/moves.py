"""The planner's move set as one table, `MOVES`: each kind of move, when it applies, how it prices and runs.

A move changes the placements on one group of mesh axes A (flattened row-major when several), all
members of the group changing the same way. The *splitters* of dim d are the axes with ``S(d)`` in
axis order; several axes splitting d nest (axis 0 outermost), so only the last splitters of d can undo
their split by their group alone.

Each row's `generate` lists its moves out of a state as unpriced candidates ``(kind, axes, new state,
dims, op)``; `Costing.step` prices a candidate by its step kind (the formula in the row's `prices`) and
the executor runs the step of that kind (`runs`). The search (`sbp.planning.search`) breaks ties between
equal plans by the order moves are generated in: the rows' order, and within a run of rows with the same
`scope` the scope's loop outermost (for each reduction group: its all_reduce, then its reduce_scatters).

To add a move: a generator here, a row in `MOVES` (its place sets the tie order), a step kind in
`sbp.values.steps` with its price in `Costing.step`, and its run in the executor.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator, Optional

from ..values.placement import REDUCE_OPS, Broadcast, Partial, Split
from ..values.steps import STEP_KINDS, Step
from .cost import Costing
from .exchange import contained, reducible
from .states import BROADCAST_CODE, B, State, pending, put, put_each, split_code, splits

Candidate = tuple[str, tuple[int, ...], State, tuple[int, ...], Optional[str]]  # kind, axes, new state, dims, op
SCOPES = ("state", "reduction group", "axis")


@dataclass(frozen=True, slots=True)
class Move:
    """One row of the move table.

    `kind` is the `Step` kind it becomes (`Costing.step` prices it, the executor runs it); `change`,
    `valid_when`, `prices` and `runs` say it in words. `generate` appends the row's candidates out of a
    state to a list `out`; `scope` says what it is called for: once per state (``generate(origin,
    out)``), per group of same-op Partial axes that may reduce together (``generate(origin, out, op,
    axes)``), or per mesh axis (``generate(origin, out, axis)``). A per-axis row is called only for an
    axis whose placement kind is in `from_kinds` and whose target's is in `to_kinds` (the single-axis
    transition table; `generate` checks the rest). Point-to-point moves lose ties to
    ring collectives, and the search lists them only when they come first in its queue (their targets
    take the longest to list).

    >>> MOVES[0].name, MOVES[0].change, MOVES[0].valid_when
    ('all_gather', 'S(d) on A -> B', 'A are the last splitters of d; nothing left to reduce')
    """

    name: str
    kind: str
    change: str
    valid_when: str
    prices: str
    runs: str
    scope: str
    point_to_point: bool
    generate: Callable[..., None]
    from_kinds: tuple[type, ...] = (Split, Broadcast, Partial)
    to_kinds: tuple[type, ...] = (Split, Broadcast, Partial)

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS or self.scope not in SCOPES:
            raise ValueError(f"move {self.name!r}: kind must be one of {STEP_KINDS}, scope one of {SCOPES}")


class _Origin:
    """The state moves start from, with what every generator reads of it (computed once per state)."""

    __slots__ = ("s", "dst", "ndim", "splitters", "last", "by_op", "pending", "splits", "direct_fills", "mesh",
                 "subgroups")

    def __init__(self, ndim: int, s: State, dst: State, direct_fills: bool = False,
                 mesh: tuple[int, ...] = (), subgroups: bool = False) -> None:
        self.s, self.dst, self.ndim, self.direct_fills, self.mesh = s, dst, ndim, direct_fills, mesh
        self.subgroups = subgroups
        self.splitters: list[list[int]] = [[] for _ in range(ndim)]  # per dim, its splitters in axis order
        # per dim, its last splitter (-1: none): a new split of d on axis a nests inside when a > last[d]
        self.last = [-1] * ndim
        self.by_op: dict[str, list[int]] = {}  # Partial axes per op
        for a, p in enumerate(s):
            kind = p.__class__  # (placements are interned, final classes)
            if kind is Split:
                self.splitters[p.dim].append(a)
                self.last[p.dim] = a
            elif kind is Partial:
                self.by_op.setdefault(p.op, []).append(a)
        self.pending = pending(s, dst)
        self.splits = splits(ndim)


# ---- generators, one per row: each appends its candidates to `out`, in generation order ------------------------
def _all_gathers(o: _Origin, out: list[Candidate]) -> None:
    """The trailing k splitters of a dim become B together (after any reduction: gathering
    contributions first only grows what the reduction must move)."""
    if not o.pending:
        for d, spl in enumerate(o.splitters):
            for k in range(1, len(spl) + 1):
                axes = tuple(spl[-k:])
                out.append(("all_gather", axes, put(o.s, axes, B), (d,), None))


def _reduction_groups(o: _Origin) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Same-op Partial axes that may reduce together (`_subsets`). The logical value nests in axis
    order, so an axis is reduced only when every Partial axis after it has the same op (inner first);
    an axis of one member holds one contribution, already the reduced value: it neither waits for nor
    holds back the others."""
    if not o.by_op:
        return
    mesh = o.mesh
    for op in REDUCE_OPS:
        pax = o.by_op.get(op)
        if pax is None:
            continue
        others = max((a for x, axes in o.by_op.items() if x != op for a in axes if not mesh or mesh[a] > 1),
                     default=-1)
        for axes in _subsets(tuple(pax)):
            if others < next((a for a in axes if not mesh or mesh[a] > 1), others + 1):
                yield op, axes


def _all_reduces(o: _Origin, out: list[Candidate], op: str, axes: tuple[int, ...]) -> None:
    out.append(("all_reduce", axes, put(o.s, axes, B), (), op))


def _reduce_scatters(o: _Origin, out: list[Candidate], op: str, axes: tuple[int, ...]) -> None:
    for d in range(o.ndim):
        if axes[0] > o.last[d]:
            out.append(("reduce_scatter", axes, put(o.s, axes, o.splits[d]), (d,), op))


def _all_to_alls(o: _Origin, out: list[Candidate], a: int) -> None:
    """(Called for Split axes.)"""
    d = o.s[a].dim
    if o.last[d] == a:
        for e in range(o.ndim):
            if e != d and a > o.last[e]:
                out.append(("all_to_all", (a,), put(o.s, (a,), o.splits[e]), (d, e), None))


def _slices(o: _Origin, out: list[Candidate], a: int) -> None:
    """(Called for Broadcast axes with a Split or Partial target.) Slicing pays off only towards the
    target's split there, or before a zero-fill into P (not with `direct_fills`: ``B -> P`` directly)."""
    q = o.dst[a]
    for d in range(o.ndim):
        if a > o.last[d] and (q == o.splits[d] or (isinstance(q, Partial) and not o.direct_fills)):
            out.append(("local", (a,), put(o.s, (a,), o.splits[d]), (d,), None))


def _zero_fills(o: _Origin, out: list[Candidate], a: int) -> None:
    """(Called for Split or Broadcast axes with a Partial target.) Embedding into min/max's identity
    must not meet a later sum (int overflow, inf - inf)."""
    p, q = o.s[a], o.dst[a]
    if isinstance(p, Broadcast) or (o.last[p.dim] == a
                                    and (q.op == "sum" or max(o.by_op.get("sum", ()), default=-1) < a)):
        out.append(("local", (a,), put(o.s, (a,), q), (), q.op))


def _transfers(o: _Origin, out: list[Candidate]) -> None:
    """Exact transfers towards the Split/Broadcast projection of `dst`, over the changed axes (else over
    every non-Partial axis) when that group is self-contained. Only with nothing left to reduce (moving
    contributions around costs more than moving results). Enumerated on split codes (fast ints)."""
    if o.pending:
        return
    s, n = o.s, o.ndim
    sc, dc = tuple(map(split_code, s)), tuple(map(split_code, o.dst))
    choices = []
    # with new Partial target axes, a Split target may be sliced locally after zero-filling (from B)
    later_slice = any(q < BROADCAST_CODE and p != q for p, q in zip(sc, dc))
    for p, q in zip(sc, dc):
        if q < BROADCAST_CODE:  # a Partial target is reached afterwards by a free local move from S or B
            choices.append((p,) if p < BROADCAST_CODE else (p, *(x for x in range(BROADCAST_CODE, n) if x != p)))
        elif p < BROADCAST_CODE:
            choices.append((p,))  # must be reduced by a collective first; rides along unchanged
        else:
            choices.append((q, BROADCAST_CODE) if later_slice and q > BROADCAST_CODE else (q,))
    kept = tuple(a for a, p in enumerate(sc) if p >= BROADCAST_CODE)
    for tc in itertools.product(*choices):
        if tc == sc or (later_slice and not _reaches_locally(tc, dc)):  # dst must follow by free local moves
            continue
        axes = tuple(a for a, (p, x) in enumerate(zip(sc, tc)) if p != x)
        for group in (axes, kept):
            if contained(sc, tc, group):
                t = tuple(o.splits[x] if x > BROADCAST_CODE else B if x == BROADCAST_CODE else p
                          for x, p in zip(tc, s))
                out.append(("transfer", group, t, (), None))
                break
    if o.subgroups:
        _subgroup_transfers(o, sc, dc, out)


def _subgroup_transfers(o: _Origin, sc: tuple[int, ...], dc: tuple[int, ...], out: list[Candidate]) -> None:
    """(Under a topology only.) Transfers to intermediate layouts: for each group U of the axes whose
    Split/Broadcast target differs (`_subsets`: every one for up to 3 such axes, else the runs of
    consecutive ones), U takes dst's placement and every other axis keeps its own, over the smallest
    self-contained group holding U (`_contained_closure`). Bytes never gain from them (one transfer to
    dst meets the lower bound), but time charges a round per peer, and two transfers over small groups
    can meet far fewer peers than one over many."""
    changed = tuple(a for a, (p, q) in enumerate(zip(sc, dc)) if q >= BROADCAST_CODE and p != q)
    if not changed:
        return
    s, seen = o.s, {(c[1], c[2]) for c in out}
    for fix in _subsets(changed):
        tc = tuple(q if a in fix else p for a, (p, q) in enumerate(zip(sc, dc)))
        group = _contained_closure(sc, tc, fix)
        if group is None:
            continue
        t = tuple(o.splits[x] if x > BROADCAST_CODE else B if x == BROADCAST_CODE else p for x, p in zip(tc, s))
        if (group, t) not in seen:
            seen.add((group, t))
            out.append(("transfer", group, t, (), None))


def _contained_closure(sc: tuple[int, ...], tc: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The smallest group holding `axes` that is self-contained in both states (`contained`): an outside
    splitter of a dim after an inside one joins the group, until none is left; None when a Partial axis
    would join.

    >>> _contained_closure((1, 1, 0), (1, 0, 0), (1,)), _contained_closure((0, 0), (-1, -2), (0,))
    ((1, 2), None)
    """
    group = set(axes)
    grown = True
    while grown:
        grown = False
        for state in (sc, tc):
            inside: set[int] = set()
            for a, d in enumerate(state):
                if a in group:
                    if d < BROADCAST_CODE:
                        return None
                    if d > BROADCAST_CODE:
                        inside.add(d)
                elif d in inside:
                    group.add(a)
                    grown = True
    return tuple(sorted(group))


def _reduce_transfers(o: _Origin, out: list[Candidate]) -> None:
    """Per op, every Partial axis of that op whose target is Split/Broadcast (and that no Partial of
    another op follows) takes its target, together with the changed Split/Broadcast axes, and also
    with every Split/Broadcast axis (more members share the reductions; and the group may hold a
    self-contained block only then)."""
    s, dst = o.s, o.dst
    naxes = len(s)
    for op in o.by_op:  # (in axis order of first appearance)
        mine = Partial(op)
        pax = [a for a in range(naxes) if s[a] is mine and not isinstance(dst[a], Partial)
               and not any(isinstance(s[b], Partial) and s[b] is not mine for b in range(a + 1, naxes))]
        if not pax:
            continue
        movable = [a for a in range(naxes) if not isinstance(s[a], Partial) and not isinstance(dst[a], Partial)]
        changed = [a for a in movable if s[a] != dst[a]]
        for extra in (changed, movable) if changed != movable else (changed,):
            group = tuple(sorted(pax + extra))
            t = put_each(s, group, dst)
            if reducible(s, t, group):
                out.append(("reduce_transfer", group, t, (), op))


# ---- the table ------------------------------------------------------------------------------------------------
ALL_KINDS = (Split, Broadcast, Partial)

MOVES: tuple[Move, ...] = (
    Move(name="all_gather", kind="all_gather", change="S(d) on A -> B",
         valid_when="A are the last splitters of d; nothing left to reduce",
         prices="max over ranks of (output - input) elements", runs="one all_gather over A",
         scope="state", point_to_point=False, generate=_all_gathers),
    Move(name="all_reduce", kind="all_reduce", change="P(op) on A -> B",
         valid_when="A are same-op Partial axes; no Partial of another op after them",
         prices="2 (n - 1) / n of the data (ring)", runs="one all_reduce over A",
         scope="reduction group", point_to_point=False, generate=_all_reduces),
    Move(name="reduce_scatter", kind="reduce_scatter", change="P(op) on A -> S(d)",
         valid_when="as all_reduce, and every axis of A comes after d's splitters",
         prices="(n - 1) x the largest output piece", runs="one reduce_scatter over A",
         scope="reduction group", point_to_point=False, generate=_reduce_scatters),
    Move(name="all_to_all", kind="all_to_all", change="S(d) on a -> S(e)",
         valid_when="a is d's last splitter and comes after e's splitters",
         prices="the part of its new block a rank lacks (exact intersections)", runs="one all_to_all over a",
         scope="axis", point_to_point=False, generate=_all_to_alls, from_kinds=(Split,)),
    Move(name="local slice", kind="local", change="B on a -> S(d)",
         valid_when="a comes after d's splitters; dst has S(d) or a Partial on a",
         prices="nothing", runs="each rank keeps its piece",
         scope="axis", point_to_point=False, generate=_slices, from_kinds=(Broadcast,), to_kinds=(Split, Partial)),
    Move(name="local zero-fill", kind="local", change="B or S(d) on a -> P(op)",
         valid_when="dst has P(op) on a; for S(d): a is d's last splitter, and op is sum or no P(sum) comes after a",
         prices="nothing", runs="B: keep (coord 0 for sum) or zero; S: embed into the op's identity",
         scope="axis", point_to_point=False, generate=_zero_fills, from_kinds=(Broadcast, Split),
         to_kinds=(Partial,)),
    Move(name="transfer", kind="transfer", change="S/B on A -> S/B",
         valid_when="nothing left to reduce; A holds a self-contained block in both states",
         prices="the part of its new block a rank lacks (exact intersections)",
         runs="exact point-to-point exchange (`sbp.planning.exchange.exchange`)",
         scope="state", point_to_point=True, generate=_transfers),
    Move(name="reduce_transfer", kind="reduce_transfer", change="P(op), S/B on A -> S/B",
         valid_when="A's Partial axes share one op, no Partial of another op after them; A holds a "
                    "self-contained block",
         prices="contributions of the slabs a rank owns, less its own, plus the other slabs of its block",
         runs="two exact exchanges (`sbp.planning.exchange.reduce_exchange`)",
         scope="state", point_to_point=True, generate=_reduce_transfers),
)
POINT_TO_POINT_KINDS = frozenset(m.kind for m in MOVES if m.point_to_point)


def _runs(point_to_point: bool) -> tuple[tuple[str, tuple[Callable, ...], dict], ...]:
    """The rows of one family, in table order, as runs of consecutive rows with the same scope: (scope,
    generators, and for the axis scope the generators per (source kind, target kind) on the axis)."""
    runs: list[tuple[str, list[Move]]] = []
    for move in MOVES:
        if move.point_to_point == point_to_point:
            if runs and runs[-1][0] == move.scope:
                runs[-1][1].append(move)
            else:
                runs.append((move.scope, [move]))
    return tuple((scope, tuple(m.generate for m in rows),
                  {(p, q): tuple(m.generate for m in rows if p in m.from_kinds and q in m.to_kinds)
                   for p in ALL_KINDS for q in ALL_KINDS})
                 for scope, rows in runs)


_RING_AND_LOCAL, _POINT_TO_POINT = _runs(False), _runs(True)


def candidates(costing: Costing, s: State, dst: State, *, point_to_point: bool = False,
               direct_fills: bool = False, subgroups: bool = False) -> list[Candidate]:
    """The unpriced moves out of `s` towards `dst`, in generation order: the collectives and local
    moves, or (`point_to_point=True`) the transfers and reduce_transfers. With `direct_fills` a
    Broadcast axis with a Partial target is zero-filled, never sliced first; with `subgroups` (the search
    under a topology) also transfers to intermediate layouts on subgroups of axes (`_subgroup_transfers`).

    >>> from sbp import S, B
    >>> [c[0] for c in candidates(Costing((8, 8), (2,), 4), (S(0),), (B,))]
    ['all_gather', 'all_to_all']
    >>> [c[0] for c in candidates(Costing((8, 8), (2,), 4), (S(0),), (B,), point_to_point=True)]
    ['transfer']
    """
    o = _Origin(costing.ndim, s, dst, direct_fills, costing.mesh_shape, subgroups)
    out: list[Candidate] = []
    for scope, gens, per_kinds in _POINT_TO_POINT if point_to_point else _RING_AND_LOCAL:
        match scope:
            case "state":
                for gen in gens:
                    gen(o, out)
            case "reduction group":
                for op, axes in _reduction_groups(o):
                    for gen in gens:
                        gen(o, out, op, axes)
            case "axis":
                for a, (p, q) in enumerate(zip(s, dst)):
                    for gen in per_kinds[p.__class__, q.__class__]:
                        gen(o, out, a)
    return out


def priced_moves(costing: Costing, s: State, dst: State) -> Iterator[Step]:
    """Every move out of state `s`, priced, in generation order (collectives and local moves, then
    point-to-point moves; the search queues them unpriced, `candidates`).

    >>> from sbp import S, B
    >>> [(m.kind, m.bytes) for m in priced_moves(Costing((8, 8), (2,), 4), (S(0),), (B,))]
    [('all_gather', 128), ('all_to_all', 64), ('transfer', 128)]
    """
    for p2p in (False, True):
        for kind, axes, t, dims, op in candidates(costing, s, dst, point_to_point=p2p):
            yield costing.step(kind, axes, s, t, dims, op)


def table() -> str:
    """`MOVES` as a markdown table (docs/planner.md shows it).

    >>> print(table().splitlines()[0])
    | move | change | valid when | busiest rank receives | runs as |
    >>> table().splitlines()[2].split(" | ")[:2]
    ['| all_gather', 'S(d) on A -> B']
    """
    rows = ["| move | change | valid when | busiest rank receives | runs as |", "|---|---|---|---|---|"]
    rows += [f"| {m.name} | {m.change} | {m.valid_when} | {m.prices} | {m.runs} |" for m in MOVES]
    return "\n".join(rows)


def reaches_locally(s: State, dst: State) -> bool:
    """Whether local moves alone (slices, zero-fills; no communication) turn state `s` into `dst`.

    >>> from sbp import S, B, Partial
    >>> reaches_locally((B, S(0)), (Partial("sum"), S(0))), reaches_locally((S(0),), (B,))
    (True, False)
    """
    return _reaches_locally(tuple(map(split_code, s)), tuple(map(split_code, dst)))


@lru_cache(maxsize=65536)
def _reaches_locally(t: tuple[int, ...], d: tuple[int, ...]) -> bool:
    """Whether local moves (B -> S(e) after e's splitters, S(e) -> P as e's last splitter, B -> P) turn
    `t` into `d` (both as split codes). Greedy, outermost possible move first: zero-fills only enable
    moves, and slicing the outermost axis first never blocks a slice further in."""
    state, n = list(t), len(t)
    while tuple(state) != d:
        for a in range(n):
            p, q = state[a], d[a]
            if p == q:
                continue
            if p > BROADCAST_CODE and q < BROADCAST_CODE:  # S(p) -> P: a must be p's last splitter
                ok = p not in state[a + 1:]
            else:  # B -> S(q): a must come after q's splitters; B -> P: always
                ok = p == BROADCAST_CODE and (q < BROADCAST_CODE or q not in state[a + 1:])
            if ok:  # rescan from axis 0 after every move
                state[a] = q
                break
        else:
            return False
    return True


def _subsets(axes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Groups of axes to reduce together: every subset for up to 3 axes, else the runs of consecutive
    ones (2**n subsets would make planning on deep meshes exponential)."""
    if len(axes) <= 3:
        for k in range(1, len(axes) + 1):
            yield from itertools.combinations(axes, k)
        return
    for i in range(len(axes)):
        for j in range(i + 1, len(axes) + 1):
            yield axes[i:j]


CACHES = (("moves.reaches_locally", _reaches_locally),)
"""The memos of this module, by name (`sbp.planning.clear_caches` clears them)."""
