"""The redistribution planner: the cheapest sequence of moves from one placements tuple to another.

Pure and deterministic: a function of (global_shape, mesh_shape, src, dst, itemsize) only, cached.
The search is A* over placement states; each state is a canonical placements tuple (several axes
splitting one dim nest in axis order). Moves come from `moves()`: per-axis and flattened (several
axes as one group) collectives, exact point-to-point transfers (plain, or reducing Partial axes on
the way: ``reduce_transfer``) and free local moves. The cost of a plan is lexicographic: (busiest
rank's received bytes + latency per collective call, collective calls, point-to-point steps, peak
bytes, steps, then the order moves are generated in).
"""
from __future__ import annotations

import heapq
import itertools
import math
from functools import lru_cache
from typing import Iterator, Sequence

from .cost import Costing
from ..values.errors import PlanError
from ..values.layout import check_global_shape
from ..values.mesh import DeviceMesh, as_mesh_shape
from ..values.placement import Broadcast, Partial, Placement, Split, normalize
from ..values.steps import STEP_KINDS, Plan, Step
from .exchange import contained, reducible, split_code

State = tuple[Placement, ...]
_B = Broadcast()
_POINT_TO_POINT = ("transfer", "reduce_transfer")  # ring collectives win ties against these
_DEFERRED = ("point-to-point moves",)  # a queue entry standing for all of them out of one state
_CALLS = {kind: Step(kind, (), (), ()).calls for kind in STEP_KINDS}


def plan(global_shape: Sequence[int], mesh_shape: "DeviceMesh | Sequence[int]", src, dst, itemsize: int = 4,
         *, latency_bytes: int = 0, dst_mesh: "DeviceMesh | None" = None) -> Plan:
    """Plan the redistribution of a tensor of `global_shape` on a mesh from `src` to `dst` placements.

    `latency_bytes` prices each collective as that many received bytes (0: bytes first, collectives as
    the tie-breaker). Pure and cached: every rank computes the same plan without talking. With
    `dst_mesh` (another `DeviceMesh`: other ranks and/or shape) it returns `sbp.plan_cross_mesh`'s
    `CrossMeshPlan` for moving from `mesh_shape` (then a `DeviceMesh`, or a shape over ranks 0..n-1).

    >>> import sbp
    >>> p = sbp.plan((1024, 1024), (2, 2), "S(0), S(1)", "S(1), S(0)")
    >>> p.bytes_per_rank == sbp.lower_bound_bytes((1024, 1024), (2, 2), "S(0), S(1)", "S(1), S(0)")
    True
    >>> print(sbp.plan((8, 8), (4,), "P", "S(0)").explain())  # doctest: +NORMALIZE_WHITESPACE
    Plan (P(sum),) -> (S(0),)  shape=(8, 8) mesh=(4,) itemsize=4
      bytes/rank=192 (lower bound 192)  collectives=1  peak=576
      1. axes[0] reduce_scatter(sum)  (P(sum),) -> (S(0),) dims=0  bytes=192 peak=576
    """
    if dst_mesh is not None:
        from .crossmesh import plan_cross_mesh
        src_mesh = mesh_shape if isinstance(mesh_shape, DeviceMesh) else DeviceMesh(as_mesh_shape(mesh_shape))
        return plan_cross_mesh(global_shape, src_mesh, src, dst_mesh, dst, itemsize)
    shape, mshape, s, d = _normalize_args(global_shape, mesh_shape, src, dst, itemsize)
    if isinstance(latency_bytes, bool) or not isinstance(latency_bytes, int) or latency_bytes < 0:
        raise PlanError(f"latency_bytes must be a non-negative int, got {latency_bytes!r}")
    return _plan_cached(shape, mshape, s, d, itemsize, latency_bytes)


def lower_bound_bytes(global_shape: Sequence[int], mesh_shape: "DeviceMesh | Sequence[int]", src, dst,
                      itemsize: int = 4) -> int:
    """Bytes the busiest rank must receive for the change `src -> dst`.

    Split/Broadcast sources: the bytes of a rank's destination block that its source block lacks (exact
    intersections, maximised over ranks). Partial sources: the reduction bound, i.e. the cheapest ring
    reduction of the contributors ((q-1)/q of the reduced data for reduce-scatter, 2(q-1)/q for
    all-reduce) plus the exact bound of what is left to move.

    >>> lower_bound_bytes((1024, 1024), (4,), "S(0)", "B")
    3145728
    >>> lower_bound_bytes((1024, 1024), (4,), "P", "B")
    6291456
    """
    shape, mshape, s, d = _normalize_args(global_shape, mesh_shape, src, dst, itemsize)
    return _lower_bound(Costing(shape, mshape, itemsize), s, d)


def _normalize_args(global_shape, mesh_shape, src, dst, itemsize):
    shape = check_global_shape(global_shape)
    mshape = mesh_shape.shape if isinstance(mesh_shape, DeviceMesh) else as_mesh_shape(mesh_shape)
    s = normalize(src, len(shape), len(mshape))
    d = normalize(dst, len(shape), len(mshape))
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise PlanError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    return shape, mshape, s, d


@lru_cache(maxsize=4096)
def _plan_cached(shape, mshape, src, dst, itemsize, latency_bytes) -> Plan:
    costing = Costing(shape, mshape, itemsize)
    cap = 2 * (costing.max_local_bytes(src) + costing.max_local_bytes(dst))
    bound = _lower_bound(costing, src, dst)
    capped: list[bool] = []
    steps = _search(costing, src, dst, latency_bytes, cap, capped=capped)
    price = lambda plan: sum(s.bytes + latency_bytes * s.calls for s in plan)
    if steps is None or (capped and sum(s.bytes for s in steps) > bound):
        # the cap is a preference, bytes come first: a plan above the lower bound, found by a search the
        # cap pruned, is checked against the search without the cap (which still keeps the whole tensor
        # off the ranks) and loses to a plan receiving fewer bytes (a few Partial sources, whose local is
        # full-size already)
        free = _search(costing, src, dst, latency_bytes, None)
        if steps is None or (free is not None and price(free) < price(steps)):
            steps = free
    if steps is None:  # nothing keeps the whole tensor off the ranks: allow it rather than fail
        steps = _search(costing, src, dst, latency_bytes, None, whole_off=False)
    if steps is None:  # pragma: no cover - every pair is reachable by construction
        raise PlanError(f"no plan from {src} to {dst} on mesh {mshape}")
    return Plan(shape, mshape, src, dst, itemsize, tuple(steps), bound)


def _pending(s: State, d: State) -> bool:
    return any(isinstance(p, Partial) and p != q for p, q in zip(s, d))


def _lower_bound(costing: Costing, src: State, dst: State) -> int:
    """Split/Broadcast sources: `Costing.move_bound` (exact). Partial sources: `Costing.reduction_bound`."""
    if not _pending(src, dst):
        return costing.move_bound(src, dst)
    return costing.reduction_bound(src, dst)


def _search(costing: Costing, src: State, dst: State, latency: int, cap: int | None, *,
            whole_off: bool = True, capped: list | None = None) -> list[Step] | None:
    """A* over states with lexicographic cost (bytes + latency, collectives, transfers, peak, steps, then
    move order).

    Among plans equal in bytes and collectives, ring collectives win over point-to-point transfers
    (NCCL and gloo run them as tuned rings), then the smaller peak memory, then fewer steps.

    The heuristic never overestimates: what ranks lack of their destination blocks
    (`Costing.heuristic`), and for states still to be reduced `Costing.reduction_bound`, which holds
    for any schedule. Work is deferred until an entry comes first in the queue: a move is queued
    unpriced under what it costs at least (its collectives, nothing for its bytes) plus its parent's
    heuristic, and a new state under its parent's heuristic less the move's cost (pathmax); most never
    come first. Keys never exceed the cost of a completion, so once the smallest key reaches dst's
    cost, the path found is optimal (among equal ones, the first found).
    """
    def h(state: State) -> tuple[int, int]:
        if _pending(state, dst):
            return costing.reduction_bound(state, dst) + latency, 1
        lack = costing.heuristic(state, dst)
        return lack + latency * (lack > 0), int(lack > 0)

    def least(cost: tuple, kind: str) -> tuple:
        """The cost after a move of `kind` with no bytes and no more peak memory."""
        calls = _CALLS[kind]
        return cost[0] + latency * calls, cost[1] + calls, cost[2] + (kind in _POINT_TO_POINT), cost[3], cost[4] + 1

    # never materialise the whole tensor on a rank in passing (unless an end point holds it already)
    whole = math.prod(costing.shape) * costing.itemsize
    whole_cap = max(costing.max_local_bytes(src), costing.max_local_bytes(dst), whole - 1)
    start = (0, 0, 0, costing.max_local_bytes(src), 0)
    best: dict[State, tuple] = {src: start}
    back: dict[State, tuple[State, Step]] = {}
    # entries: (key, order, cost so far, state, its heuristic or None while only a bound is known,
    #           None or an unpriced move out of the state)
    heap: list = [((0, 0, 0, start[3], 0), 0, start, src, None, None)]
    order = itertools.count(1)  # among equal keys the oldest entry first
    done = None  # best[dst] once reached
    while heap:
        key, _, cost, state, est, move = heapq.heappop(heap)
        if best.get(state) != cost:  # reached more cheaply since (its moves are queued again)
            continue
        if (move is None and state == dst) or (done is not None and key >= done):  # nothing left beats dst
            state, out = dst, []
            while state != src:
                state, step = back[state]
                out.append(step)
            return out[::-1]
        if move is not None and move is not _DEFERRED:  # price the move now
            kind, axes, t, dims, op = move
            old = best.get(t)
            if old is not None and old <= least(cost, kind):
                continue
            step = costing.step(kind, axes, state, t, dims, op)
            if whole_off and step.peak_bytes > whole_cap and t != dst and costing.max_local_bytes(t) > whole_cap:
                continue  # (the new local is part of the peak: a peak within whole_cap needs no lookup)
            if cap is not None and step.peak_bytes > cap:
                if capped is not None and not capped:
                    capped.append(True)   # the cap changed the search: its plan may not be the cheapest
                continue
            coll = step.calls
            new = (cost[0] + step.bytes + latency * coll, cost[1] + coll, cost[2] + (kind in _POINT_TO_POINT),
                   max(cost[3], step.peak_bytes), cost[4] + 1)
            if old is None or new < old:
                best[t] = new
                back[t] = (state, step)
                if t == dst:
                    done = new
                bound = (max(0, est[0] - step.bytes - latency * coll), max(0, est[1] - coll))
                heapq.heappush(heap, ((new[0] + bound[0], new[1] + bound[1], *new[2:4], new[4] + (t != dst)),
                                      next(order), new, t, None, None))
            continue
        if est is None:  # (never for a deferred family: its state was expanded already)
            est = h(state)
            exact = (cost[0] + est[0], cost[1] + est[1], *cost[2:4], cost[4] + 1)  # not dst: one step more
            if exact > key:  # queue it again under its own heuristic
                heapq.heappush(heap, (exact, next(order), cost, state, est, None))
                continue
        if move is _DEFERRED:  # the point-to-point moves out of the state, deferred until now
            family = _point_to_point(costing, state, dst)
        else:
            family = _candidates(costing, state, dst)
            # what any point-to-point move costs at least: one call, one transfer
            key = (cost[0] + max(latency, est[0]), cost[1] + max(1, est[1]), cost[2] + 1, cost[3], cost[4] + 1)
            heapq.heappush(heap, (key, next(order), cost, state, est, _DEFERRED))
        for move in family:  # keyed by what they cost at least: their collectives, and the parent's heuristic
            kind = move[0]
            calls = _CALLS[kind]
            key = (cost[0] + max(latency * calls, est[0]), cost[1] + max(calls, est[1]),
                   cost[2] + (kind in _POINT_TO_POINT), cost[3], cost[4] + 1 + (move[2] != dst))
            heapq.heappush(heap, (key, next(order), cost, state, est, move))
    return None


def moves(costing: Costing, s: State, dst: State) -> Iterator[Step]:
    """Every move out of state `s`, priced, in a fixed order (the search queues them unpriced:
    `_candidates`, then `_point_to_point`).

    The move table (per group of axes A, all members changing the same way):

    ===============  ================  =================  ============================================
    from             to                move               valid when
    ===============  ================  =================  ============================================
    S(d) on A        B                 all_gather         A are the last splitters of d
    P(op) on A       S(d)              reduce_scatter     every axis of A comes after d's splitters
    P(op) on A       B                 all_reduce         always
    S(d) on a        S(e)              all_to_all         a is d's last splitter, after e's splitters
    B on a           S(d)              local (slice)      a comes after d's splitters
    B or S(d) on a   P(op)             local (zero-fill)  for S(d): a is d's last splitter
    S/B on A         S/B               transfer           A holds a self-contained block of the tensor
    P(op), S/B on A  S/B               reduce_transfer    A holds a self-contained block; no Partial
                                                          of another op after A's Partial axes
    ===============  ================  =================  ============================================
    """
    for kind, axes, t, dims, op in itertools.chain(_candidates(costing, s, dst), _point_to_point(costing, s, dst)):
        yield costing.step(kind, axes, s, t, dims, op)


def _candidates(costing: Costing, s: State, dst: State) -> Iterator[tuple]:
    """The collective and local moves of `moves`, unpriced: (kind, axes, new state, dims, op)."""
    ndim, naxes = costing.ndim, len(s)
    spl: list[list[int]] = [[] for _ in range(ndim)]
    by_op: dict[str, list[int]] = {}  # Partial axes per op
    for a, p in enumerate(s):
        if isinstance(p, Split):
            spl[p.dim].append(a)
        elif isinstance(p, Partial):
            by_op.setdefault(p.op, []).append(a)
    pending = _pending(s, dst)
    splits = _splits(ndim)
    # all_gather: the trailing k splitters of a dim become B together (after any reduction: gathering
    # contributions first only grows what the reduction must move).
    for d in range(ndim if not pending else 0):
        for k in range(1, len(spl[d]) + 1):
            axes = tuple(spl[d][-k:])
            yield "all_gather", axes, _put(s, axes, _B), (d,), None
    # reductions over same-op Partial axes, alone or flattened.
    # The logical value nests in axis order, so an axis is reduced only when every Partial axis after
    # it has the same op (inner reductions first).
    for op in ("sum", "min", "max"):
        pax = by_op.get(op)
        if pax is None:
            continue
        others = max((a for o, axes in by_op.items() if o != op for a in axes), default=-1)
        for axes in _subsets(tuple(pax)):
            if others > axes[0]:
                continue
            yield "all_reduce", axes, _put(s, axes, _B), (), op
            for d in range(ndim):
                if not spl[d] or axes[0] > spl[d][-1]:
                    yield "reduce_scatter", axes, _put(s, axes, splits[d]), (d,), op
    last_sum = max(by_op.get("sum", ()), default=-1)
    for a in range(naxes):
        p, q = s[a], dst[a]
        last = isinstance(p, Split) and spl[p.dim][-1] == a
        if last:
            for e in range(ndim):
                if e != p.dim and (not spl[e] or a > spl[e][-1]):
                    yield "all_to_all", (a,), _put(s, (a,), splits[e]), (p.dim, e), None
        if isinstance(p, Broadcast):
            # slicing pays off only towards the target's split there, or before a zero-fill into P
            for d in range(ndim):
                if (not spl[d] or a > spl[d][-1]) and (q == splits[d] or isinstance(q, Partial)):
                    yield "local", (a,), _put(s, (a,), splits[d]), (d,), None
        if (isinstance(p, Broadcast) or last) and isinstance(q, Partial):
            # embedding into min/max's identity must not meet a later sum (int overflow, inf - inf)
            if not (last and q.op != "sum" and last_sum > a):
                yield "local", (a,), _put(s, (a,), q), (), q.op


def _point_to_point(costing: Costing, s: State, dst: State) -> Iterator[tuple]:
    """The point-to-point moves of `moves` (transfers, reduce_transfers), unpriced."""
    if not _pending(s, dst):  # reduce first: moving contributions around costs more than moving results
        yield from _transfers(s, dst, _splits(costing.ndim))
    if any(isinstance(p, Partial) for p in s):
        yield from _reduce_transfers(s, dst)


def _transfers(s: State, dst: State, splits: tuple[Split, ...]) -> Iterator[tuple]:
    """Exact transfers from `s` (nothing to reduce) towards the Split/Broadcast projection of `dst`.
    Targets are enumerated on `split_code`s (ints compare and hash fast)."""
    sc, dc = tuple(map(split_code, s)), tuple(map(split_code, dst))
    choices = []
    # with new Partial target axes, a Split target may be sliced locally after zero-filling (from B)
    later_slice = any(q < -1 and p != q for p, q in zip(sc, dc))
    for p, q in zip(sc, dc):
        if q < -1:
            # a Partial target axis is reached afterwards by a free local move from any S or B
            choices.append((p,) if p < -1 else (p, *(x for x in range(-1, len(splits)) if x != p)))
        elif p < -1:
            choices.append((p,))  # must be reduced by a collective first; rides along unchanged
        else:
            choices.append((q, -1) if later_slice and q >= 0 else (q,))
    kept = tuple(a for a, p in enumerate(sc) if p >= -1)
    for tc in itertools.product(*choices):
        if tc == sc or (later_slice and not _reaches_locally(tc, dc)):  # dst must follow by free local moves
            continue
        axes = tuple(a for a, (p, x) in enumerate(zip(sc, tc)) if p != x)
        for group in (axes, kept):
            if contained(sc, tc, group):
                t = tuple(splits[x] if x >= 0 else _B if x == -1 else p for x, p in zip(tc, s))
                yield "transfer", group, t, (), None
                break


def _reduce_transfers(s: State, dst: State) -> Iterator[tuple]:
    """Two-phase exact reductions (`sbp.planning.exchange.reduce_exchange`): per op, every Partial axis of that
    op whose target is Split/Broadcast (and that no Partial of another op follows) takes its target
    placement, together with the changed Split/Broadcast axes, and also with every Split/Broadcast axis
    (more members share the reductions; and the group may hold a self-contained block only then)."""
    naxes = len(s)
    for op in dict.fromkeys(p.op for p in s if isinstance(p, Partial)):
        pax = [a for a in range(naxes) if s[a] == Partial(op) and not isinstance(dst[a], Partial)
               and not any(isinstance(s[b], Partial) and s[b].op != op for b in range(a + 1, naxes))]
        if not pax:
            continue
        movable = [a for a in range(naxes) if not isinstance(s[a], Partial) and not isinstance(dst[a], Partial)]
        changed = [a for a in movable if s[a] != dst[a]]
        for extra in (changed, movable) if changed != movable else (changed,):
            group = tuple(sorted(pax + extra))
            t = _put_each(s, group, dst)
            if reducible(s, t, group):
                yield "reduce_transfer", group, t, (), op


@lru_cache(maxsize=65536)
def _reaches_locally(t: tuple[int, ...], d: tuple[int, ...]) -> bool:
    """Whether local moves (B -> S(e) after e's splitters, S(e) -> P as e's last splitter, B -> P) turn
    `t` into `d` (both as `split_code`s). Greedy, outermost possible move first: zero-fills only enable
    moves, and slicing the outermost axis first never blocks a slice further in."""
    state, n = list(t), len(t)
    while tuple(state) != d:
        for a in range(n):
            p, q = state[a], d[a]
            if p == q:
                continue
            if p >= 0 and q < -1:  # S(p) -> P: a must be p's last splitter
                ok = p not in state[a + 1:]
            else:  # B -> S(q): a must come after q's splitters; B -> P: always
                ok = p == -1 and (q < -1 or q not in state[a + 1:])
            if ok:  # rescan from axis 0 after every move
                state[a] = q
                break
        else:
            return False
    return True


@lru_cache(maxsize=None)
def _splits(ndim: int) -> tuple[Split, ...]:
    return tuple(Split(d) for d in range(ndim))


def _put(s: State, axes: Sequence[int], p: Placement) -> State:
    out = list(s)
    for a in axes:
        out[a] = p
    return tuple(out)


def _put_each(s: State, axes: Sequence[int], d: State) -> State:
    out = list(s)
    for a in axes:
        out[a] = d[a]
    return tuple(out)


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
