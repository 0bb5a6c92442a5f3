"""The redistribution search: the cheapest sequence of moves from one placements tuple to another.

Pure and deterministic: a function of (global_shape, mesh_shape, src, dst, itemsize, latency_bytes,
topology) only, cached (`plan_cached`; `sbp.plan` in `sbp.planning.api` checks the arguments and calls it). The
search is A* over placement states (canonical placements tuples); the moves out of a state are the
rows of `sbp.planning.moves.MOVES`, priced by `sbp.planning.cost.Costing`, and the heuristic is
`sbp.planning.bounds.Bounds`. The cost of a plan is lexicographic: (busiest rank's received bytes +
latency per collective call, collective calls, point-to-point steps, peak bytes, steps, then the order
moves are generated in); with a topology the modeled time of the busiest rank comes first
(`sbp.planning.cost.Pricing`).
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import replace
from functools import lru_cache
from typing import Optional

from ..values.errors import PlanError
from ..values.placement import Broadcast
from ..values.steps import STEP_CALLS, Plan, Step
from ..values.topology import Topology
from .bounds import Bounds
from .cost import Costing, Pricing
from .moves import POINT_TO_POINT_KINDS, candidates, reaches_locally
from .states import State, pending

_B = Broadcast()
_DEFERRED = ("point-to-point moves",)  # a queue entry standing for all of them out of one state


@lru_cache(maxsize=4096)
def plan_cached(shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: State, dst: State, itemsize: int,
                latency_bytes: int, topology: Optional[Topology] = None) -> Plan:
    """The cheapest plan for checked, normalised arguments (as `sbp.plan` makes them), cached.

    With a `topology` the objective is the modeled time (`sbp.planning.cost.Pricing`), bytes the
    tie-breaker, and every step carries its modeled time.

    >>> from sbp import S, B
    >>> p = plan_cached((8, 8), (2,), (S(0),), (B,), 4, 0)
    >>> [s.kind for s in p.steps], p.bytes_per_rank, p.lower_bound
    (['all_gather'], 128, 128)
    """
    if 1 in mesh_shape:
        # on an axis of size 1 every placement is the whole (sub)tensor -- one part, one piece -- so the locals
        # of S(d), B and P there are the same: planned as B, no step runs for a change there (DTensor skips
        # such mesh dims too); the plan keeps the placements asked for
        plain = tuple(tuple(_B if n == 1 else p for p, n in zip(pls, mesh_shape)) for pls in (src, dst))
        if plain != (src, dst):
            inner = plan_cached(shape, mesh_shape, *plain, itemsize, latency_bytes, topology)
            return replace(inner, src=src, dst=dst)
    costing = Costing(shape, mesh_shape, itemsize)
    bounds = Bounds(costing)
    pricing = Pricing(costing, latency_bytes, topology)
    cap = 2 * (costing.max_local_bytes(src) + costing.max_local_bytes(dst))
    bound = bounds.lower_bound(src, dst)
    capped: list[bool] = []
    steps = None
    if reaches_locally(src, dst):
        # a change with no communication takes the direct conversions where they keep the whole tensor off
        # the ranks (DESIGN.md: B -> P(sum) keeps the value on coord 0 and zeros elsewhere, B -> P(min|max)
        # keeps it everywhere), though slicing first would model a smaller peak
        direct = find_steps(costing, src, dst, latency_bytes, cap, bounds=bounds, pricing=pricing, direct_fills=True)
        if direct is not None and all(s.kind == "local" for s in direct):
            steps = direct
    if steps is None:
        steps = find_steps(costing, src, dst, latency_bytes, cap, bounds=bounds, capped=capped, pricing=pricing)
    if steps is None or (capped and pricing.above_bound(steps, bound)):
        # the cap is a preference, the objective comes first: a plan above the lower bound (bytes; with a
        # topology its time form), found by a search the cap pruned, is checked against the search without
        # the cap (which still keeps the whole tensor off the ranks) and loses to a cheaper plan (bytes: a
        # few Partial sources, whose local is full-size already; time: also a gather that cuts the peers)
        free = find_steps(costing, src, dst, latency_bytes, None, bounds=bounds, pricing=pricing)
        if steps is None or (free is not None and pricing.total(free) < pricing.total(steps)):
            steps = free
    if steps is None:  # nothing keeps the whole tensor off the ranks: allow it rather than fail
        steps = find_steps(costing, src, dst, latency_bytes, None, bounds=bounds, whole_off=False, pricing=pricing)
    if steps is None:  # pragma: no cover - every pair is reachable by construction
        raise PlanError(f"no plan from {src} to {dst} on mesh {mesh_shape}")
    if topology is not None:
        steps = [replace(s, time_ns=pricing.time_ns(s)) for s in steps]
    return Plan(shape, mesh_shape, src, dst, itemsize, tuple(steps), bound, topology)


CACHES = (("search.plan_cached", plan_cached),)
"""The memos of this module, by name (`sbp.planning.clear_caches` clears them)."""


def find_steps(costing: Costing, src: State, dst: State, latency: int, cap: int | None, *,
               bounds: Bounds | None = None, whole_off: bool = True, capped: list | None = None,
               pricing: Pricing | None = None, direct_fills: bool = False) -> list[Step] | None:
    """The cheapest steps from `src` to `dst` (None when none is found): A* over states with
    lexicographic cost (the objective's primary and secondary parts (`Pricing`), collectives,
    transfers, peak, steps, then move order). Without a topology the primary part is bytes + latency
    per call and the secondary is 0; with one, modeled time, then bytes + latency.

    `latency` prices each collective call as that many bytes (`pricing`, when given, must use it);
    steps whose peak exceeds `cap` bytes are left out (None: no cap), and so, with `whole_off`, are
    states in the middle of a plan that hold the whole tensor (unless an end point does); `capped` gets
    one entry when the cap left a step out. `bounds` (of the same `costing`) may be shared between searches.
    `direct_fills` leaves out slicing a Broadcast axis before zero-filling it into Partial.

    Among plans equal in bytes and collectives, ring collectives win over point-to-point transfers
    (NCCL and gloo run them as tuned rings), then the smaller peak memory, then fewer steps.

    The heuristic never overestimates: what ranks lack of their destination blocks
    (`Bounds.heuristic`), and for states still to be reduced `Bounds.reduction`, which holds
    for any schedule (priced by `Pricing.estimate`: over the fastest link with a topology). Work is
    deferred until an entry comes first in the queue: a move is queued unpriced under what it costs at
    least (its collectives, nothing for its bytes) plus its parent's heuristic, and a new state under
    its parent's heuristic less the move's cost (pathmax); most never come first. Keys never exceed the
    cost of a completion, so once the smallest key reaches dst's cost, the path found is optimal (among
    equal ones, the first found).

    >>> from sbp import S, B
    >>> [(s.kind, s.bytes) for s in find_steps(Costing((8, 8), (2,), 4), (S(0),), (B,), 0, None)]
    [('all_gather', 128)]
    """
    bounds = Bounds(costing) if bounds is None else bounds
    pricing = Pricing(costing, latency) if pricing is None else pricing
    estimate, least_of = pricing.estimate, pricing.least
    subgroups = pricing.topology is not None  # transfers to intermediate layouts pay off only in time

    def h(state: State) -> tuple[int, int, int]:
        if pending(state, dst):
            return (*estimate(bounds.reduction(state, dst), 1), 1)
        lack = bounds.heuristic(state, dst)
        return (*estimate(lack, int(lack > 0)), int(lack > 0))

    # never materialise the whole tensor on a rank in passing (unless an end point holds it already)
    whole = math.prod(costing.shape) * costing.itemsize
    whole_cap = max(costing.max_local_bytes(src), costing.max_local_bytes(dst), whole - 1)
    # costs: (primary, secondary, calls, point-to-point steps, peak bytes, steps)
    start = (0, 0, 0, 0, costing.max_local_bytes(src), 0)
    best: dict[State, tuple] = {src: start}
    back: dict[State, tuple[State, tuple]] = {}  # per state: the state before it and the fields of its Step
    # entries: (key, order, cost so far, state, its heuristic or None while only a bound is known,
    #           None or an unpriced move out of the state)
    heap: list = [(start, 0, start, src, None, None)]
    order = itertools.count(1)  # among equal keys the oldest entry first
    done = None  # best[dst] once reached
    leasts = {calls: least_of(calls) for calls in set(STEP_CALLS.values())}  # per number of calls
    p2p_least = leasts[1]
    push, pop = heapq.heappush, heapq.heappop
    while heap:
        key, _, cost, state, est, move = pop(heap)
        if best.get(state) != cost:  # reached more cheaply since (its moves are queued again)
            continue
        if (move is None and state == dst) or (done is not None and key >= done):  # nothing left beats dst
            state, out = dst, []
            while state != src:
                state, fields = back[state]
                out.append(Step(*fields))
            return out[::-1]
        if move is not None and move is not _DEFERRED:  # price the move now
            kind, axes, t, dims, op = move
            old = best.get(t)
            if old is not None:  # no better than `old` even at no bytes and no more peak memory: skip
                calls = STEP_CALLS[kind]
                lp, ls = leasts[calls]
                if old <= (cost[0] + lp, cost[1] + ls, cost[2] + calls, cost[3] + (kind in POINT_TO_POINT_KINDS),
                           cost[4], cost[5] + 1):
                    continue
            nbytes, peak = costing.price_move(kind, axes, state, t, dims)  # (a Step only for the plan found)
            if whole_off and peak > whole_cap and t != dst and costing.max_local_bytes(t) > whole_cap:
                continue  # (the new local is part of the peak: a peak within whole_cap needs no lookup)
            if cap is not None and peak > cap:
                if capped is not None and not capped:
                    capped.append(True)   # the cap changed the search: its plan may not be the cheapest
                continue
            coll = STEP_CALLS[kind]
            sp, ss = pricing.price_of(kind, axes, state, t, dims, op, nbytes, peak)
            new = (cost[0] + sp, cost[1] + ss, cost[2] + coll, cost[3] + (kind in POINT_TO_POINT_KINDS),
                   max(cost[4], peak), cost[5] + 1)
            if old is None or new < old:
                best[t] = new
                back[t] = (state, (kind, axes, state, t, dims, op, nbytes, peak))
                if t == dst:
                    done = new
                push(heap, ((new[0] + max(0, est[0] - sp), new[1] + max(0, est[1] - ss),
                                       new[2] + max(0, est[2] - coll), *new[3:5], new[5] + (t != dst)),
                            next(order), new, t, None, None))
            continue
        if est is None:  # (never for a deferred family: its state was expanded already)
            est = h(state)
            exact = (cost[0] + est[0], cost[1] + est[1], cost[2] + est[2], *cost[3:5], cost[5] + 1)  # not dst
            if exact > key:  # queue it again under its own heuristic
                push(heap, (exact, next(order), cost, state, est, None))
                continue
        if move is _DEFERRED:  # the point-to-point moves out of the state, deferred until now
            family = candidates(costing, state, dst, point_to_point=True, subgroups=subgroups)
        else:
            family = candidates(costing, state, dst, direct_fills=direct_fills)
            # what any point-to-point move costs at least: one call, one transfer
            key = (cost[0] + max(p2p_least[0], est[0]), cost[1] + max(p2p_least[1], est[1]),
                   cost[2] + max(1, est[2]), cost[3] + 1, cost[4], cost[5] + 1)
            push(heap, (key, next(order), cost, state, est, _DEFERRED))
        # each move keyed by what it costs at least: its calls, and the parent's heuristic (one family is all
        # point-to-point or none; the key's head depends on the move only through its number of calls)
        heads: dict[int, tuple] = {}
        p2p, steps = cost[3] + (move is _DEFERRED), cost[5] + 1
        for move in family:
            calls = STEP_CALLS[move[0]]
            head = heads.get(calls)
            if head is None:
                lp, ls = leasts[calls]
                head = heads[calls] = (cost[0] + max(lp, est[0]), cost[1] + max(ls, est[1]),
                                       cost[2] + max(calls, est[2]), p2p, cost[4])
            push(heap, ((*head, steps + (move[2] != dst)), next(order), cost, state, est, move))
    return None
