"""The redistribution planner: the cheapest sequence of moves from one placements tuple to another.

Pure and deterministic: a function of (global_shape, mesh_shape, src, dst, itemsize) only, cached.
The search is Dijkstra over placement states; each state is a canonical placements tuple (several
axes splitting one dim nest in axis order). Moves come from `moves()`: per-axis and flattened
(several axes as one group) collectives, exact point-to-point transfers and free local moves.
The cost of a plan is lexicographic: (busiest rank's received bytes + latency per collective,
number of collectives, number of point-to-point transfers, peak bytes, then the order moves are
generated in).
"""
from __future__ import annotations

import heapq
import itertools
import math
from functools import lru_cache
from typing import Iterator, Sequence

from .cost import Costing
from .errors import PlanError
from .layout import check_global_shape, splitters
from .mesh import DeviceMesh, as_mesh_shape
from .placement import Broadcast, Partial, Placement, Split, normalize
from .steps import Plan, Step
from .transfer import self_contained

State = tuple[Placement, ...]


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
    steps = _search(costing, src, dst, latency_bytes, cap)
    if steps is None:  # no plan within the memory cap: allow more memory rather than fail
        steps = _search(costing, src, dst, latency_bytes, None)
    if steps is None:  # pragma: no cover - every pair is reachable by construction
        raise PlanError(f"no plan from {src} to {dst} on mesh {mshape}")
    return Plan(shape, mshape, src, dst, itemsize, tuple(steps), _lower_bound(costing, src, dst))


def _pending(s: State, d: State) -> bool:
    return any(isinstance(p, Partial) and p != q for p, q in zip(s, d))


def _lower_bound(costing: Costing, src: State, dst: State) -> int:
    """Split/Broadcast sources: `Costing.move_bound` (exact). Partial sources: `Costing.reduction_bound`."""
    if not _pending(src, dst):
        return costing.move_bound(src, dst)
    return costing.reduction_bound(src, dst)


def _search(costing: Costing, src: State, dst: State, latency: int, cap: int | None) -> list[Step] | None:
    """A* over states with lexicographic cost (bytes + latency, collectives, transfers, peak, move order).

    Among plans equal in bytes and collectives, ring collectives win over point-to-point transfers
    (NCCL and gloo run them as tuned rings), then the smaller peak memory.

    The heuristic never overestimates: what ranks lack of their destination blocks
    (`Costing.heuristic`), and for states still to be reduced `Costing.reduction_bound`, which holds
    for any schedule. So the first time `dst` is popped its path is optimal.
    """
    def h(state: State) -> tuple[int, int]:
        if _pending(state, dst):
            return costing.reduction_bound(state, dst) + latency, 1
        lack = costing.heuristic(state, dst)
        return lack + latency * (lack > 0), int(lack > 0)

    # never materialise the whole tensor on a rank in passing (unless an end point holds it already)
    whole = math.prod(costing.shape) * costing.itemsize
    whole_cap = max(costing.max_local_bytes(src), costing.max_local_bytes(dst), whole - 1)
    start = (0, 0, 0, costing.max_local_bytes(src))
    best: dict[State, tuple] = {src: start}
    h0 = h(src)
    heap: list = [((h0[0], h0[1], 0, start[3]), 0, start, src)]
    back: dict[State, tuple[State, Step]] = {}
    counter = itertools.count(1)
    while heap:
        _, _, cost, state = heapq.heappop(heap)
        if best.get(state) != cost:
            continue
        if state == dst:
            out = []
            while state != src:
                state, step = back[state]
                out.append(step)
            return out[::-1]
        for step in moves(costing, state, dst):
            if cap is not None and (step.peak_bytes > cap or (step.dst != dst and
                                                             costing.max_local_bytes(step.dst) > whole_cap)):
                continue
            coll = int(step.is_collective)
            new = (cost[0] + step.bytes + latency * coll, cost[1] + coll, cost[2] + (step.kind == "transfer"),
                   max(cost[3], step.peak_bytes))
            old = best.get(step.dst)
            if old is None or new < old:
                best[step.dst] = new
                back[step.dst] = (state, step)
                est = h(step.dst)
                heapq.heappush(heap, ((new[0] + est[0], new[1] + est[1], new[2], new[3]), next(counter), new, step.dst))
    return None


def moves(costing: Costing, s: State, dst: State) -> Iterator[Step]:
    """Every move out of state `s`, in a fixed order (the final tie-breaker).

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
    ===============  ================  =================  ============================================
    """
    ndim, naxes = costing.ndim, len(s)
    spl = [splitters(s, d) for d in range(ndim)]
    # all_gather: the trailing k splitters of a dim become B together (after any reduction: gathering
    # contributions first only grows what the reduction must move).
    for d in range(ndim if not _pending(s, dst) else 0):
        for k in range(1, len(spl[d]) + 1):
            axes = spl[d][-k:]
            yield costing.step("all_gather", axes, s, _put(s, axes, Broadcast()), dims=(d,))
    # reductions over same-op Partial axes, alone or flattened.
    # The logical value nests in axis order, so an axis is reduced only when every Partial axis after
    # it has the same op (inner reductions first).
    for op in ("sum", "min", "max"):
        pax = tuple(a for a in range(naxes) if s[a] == Partial(op))
        for axes in _subsets(pax):
            if any(isinstance(s[b], Partial) and s[b].op != op for b in range(axes[0] + 1, naxes)):
                continue
            yield costing.step("all_reduce", axes, s, _put(s, axes, Broadcast()), op=op)
            for d in range(ndim):
                if not spl[d] or axes[0] > spl[d][-1]:
                    yield costing.step("reduce_scatter", axes, s, _put(s, axes, Split(d)), dims=(d,), op=op)
    for a in range(naxes):
        p = s[a]
        last = isinstance(p, Split) and spl[p.dim][-1] == a
        if last:
            for e in range(ndim):
                if e != p.dim and (not spl[e] or a > spl[e][-1]):
                    yield costing.step("all_to_all", (a,), s, _put(s, (a,), Split(e)), dims=(p.dim, e))
        if isinstance(p, Broadcast):
            # slicing pays off only towards the target's split there, or before a zero-fill into P
            for d in range(ndim):
                if (not spl[d] or a > spl[d][-1]) and (dst[a] == Split(d) or isinstance(dst[a], Partial)):
                    yield costing.step("local", (a,), s, _put(s, (a,), Split(d)), dims=(d,))
        if (isinstance(p, Broadcast) or last) and isinstance(dst[a], Partial):
            # embedding into min/max's identity must not meet a later sum (int overflow, inf - inf)
            if not (last and dst[a].op != "sum" and any(s[b] == Partial("sum") for b in range(a + 1, naxes))):
                yield costing.step("local", (a,), s, _put(s, (a,), dst[a]), op=dst[a].op)
    yield from _transfers(costing, s, dst)


def _transfers(costing: Costing, s: State, dst: State) -> Iterator[Step]:
    """Exact transfers from `s` towards the Split/Broadcast projection of `dst`."""
    if _pending(s, dst):  # reduce first: moving contributions around costs more than moving results
        return
    choices = []
    # with new Partial target axes, a Split target may be sliced locally after zero-filling (from B)
    later_slice = any(isinstance(q, Partial) and p != q for p, q in zip(s, dst))
    for a, (p, q) in enumerate(zip(s, dst)):
        if isinstance(q, Partial):
            # a Partial target axis is reached afterwards by a free local move from any S or B
            options = (p, Broadcast(), *(Split(e) for e in range(costing.ndim)))
            choices.append((p,) if isinstance(p, Partial) else tuple(dict.fromkeys(options)))
        elif isinstance(p, Partial):
            choices.append((p,))  # must be reduced by a collective first; rides along unchanged
        else:
            choices.append((q, Broadcast()) if later_slice and isinstance(q, Split) else (q,))
    targets = [t for t in itertools.product(*choices) if t != s]
    if later_slice:
        # only targets from which dst follows by free local moves, and of those the cheapest
        targets = [t for t in targets if _reaches_locally(t, dst)]
        least = min((costing.lack(s, t) for t in targets), default=0)
        targets = [t for t in targets if costing.lack(s, t) == least]
    for t in targets:
        axes = tuple(a for a in range(len(s)) if s[a] != t[a])
        for group in (axes, tuple(a for a in range(len(s)) if not isinstance(s[a], Partial))):
            if self_contained(s, t, group):
                yield costing.step("transfer", group, s, t)
                break


def _reaches_locally(t: State, d: State) -> bool:
    """Whether local moves (B -> S(e) after e's splitters, S(e) -> P as e's last splitter, B -> P) turn
    `t` into `d`. Greedy, outermost possible move first: zero-fills only enable moves, and slicing the
    outermost axis first never blocks a slice further in."""
    state = list(t)
    progress = True
    while progress and tuple(state) != d:
        progress = False
        for a, (p, q) in enumerate(zip(state, d)):
            if p == q:
                continue
            if isinstance(p, Broadcast) and isinstance(q, Split):
                spl = splitters(state, q.dim)
                ok = not spl or a > spl[-1]
            elif isinstance(q, Partial) and isinstance(p, Split):
                ok = splitters(state, p.dim)[-1] == a
            else:
                ok = isinstance(p, Broadcast) and isinstance(q, Partial)
            if ok:  # rescan from axis 0 after every move
                state[a] = q
                progress = True
                break
    return tuple(state) == d


def _put(s: State, axes: Sequence[int], p: Placement) -> State:
    out = list(s)
    for a in axes:
        out[a] = p
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
