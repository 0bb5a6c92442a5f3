"""The planning entry points: `sbp.plan`, `sbp.lower_bound_bytes`, and the planning caches' one clear.

Checks and normalises the arguments, then calls the shape-class memo (`sbp.planning.classes`, in front
of the search `sbp.planning.search`) or, for a plan to another mesh, `sbp.planning.crossmesh`. Every
memo of planning is listed in `CACHES`, bounded, and cleared by `clear_caches` (`cache_info` reports
their sizes).
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..values.errors import PlanError
from ..values.layout import block, check_global_shape
from ..values.mesh import DeviceMesh, as_ints, as_mesh_shape
from ..values.placement import normalize
from ..values.steps import Plan
from ..values.topology import Topology
from . import classes, crossmesh, exchange, moves, search, states
from .bounds import Bounds
from .cost import Costing
from .crossmesh import CrossMeshPlan, plan_cross_mesh

CACHES: tuple[tuple[str, Callable], ...] = (
    *classes.CACHES, *search.CACHES, *crossmesh.CACHES, *exchange.CACHES, *moves.CACHES, *states.CACHES,
    ("values.layout.block", block),  # the layout memo the schedules and cross-mesh plans are built from
)
"""Every memo planning keeps, by name: each an `lru_cache` with a bound."""


def plan(global_shape: Sequence[int], mesh_shape: "DeviceMesh | Sequence[int]", src, dst, itemsize: int = 4,
         *, latency_bytes: int = 0, topology: "Topology | None" = None,
         dst_mesh: "DeviceMesh | None" = None) -> "Plan | CrossMeshPlan":
    """Plan the redistribution of a tensor of `global_shape` on a mesh from `src` to `dst` placements.

    `latency_bytes` prices each collective as that many received bytes (0: bytes first, collectives as
    the tie-breaker). With a `topology` (an `sbp.Topology` with one entry per mesh axis) the plan
    minimises the busiest rank's modeled time instead, bytes breaking ties (`Plan.time_us`). Pure and
    cached: every rank computes the same plan without talking. With `dst_mesh` (another `DeviceMesh`:
    other ranks and/or shape) it returns `sbp.plan_cross_mesh`'s `CrossMeshPlan` for moving from
    `mesh_shape` (then a `DeviceMesh`, or a shape over ranks 0..n-1), priced in bytes: `topology` and
    `latency_bytes` are then refused.

    >>> import sbp
    >>> p = sbp.plan((1024, 1024), (2, 2), "S(0), S(1)", "S(1), S(0)")
    >>> p.bytes_per_rank == sbp.lower_bound_bytes((1024, 1024), (2, 2), "S(0), S(1)", "S(1), S(0)")
    True
    >>> print(sbp.plan((8, 8), (4,), "P", "S(0)").explain())  # doctest: +NORMALIZE_WHITESPACE
    Plan (P(sum),) -> (S(0),)  shape=(8, 8) mesh=(4,) itemsize=4
      bytes/rank=192 (lower bound 192)  collectives=1  peak=576
      1. axes[0] reduce_scatter(sum)  (P(sum),) -> (S(0),) dims=0  bytes=192 peak=576
    """
    latency = as_ints((latency_bytes,))
    if latency is None or latency[0] < 0:
        raise PlanError(f"latency_bytes must be a non-negative int, got {latency_bytes!r}")
    latency_bytes = latency[0]
    if dst_mesh is not None:
        if topology is not None or latency_bytes:
            raise PlanError("a cross-mesh plan (dst_mesh=) is priced in bytes only: topology= and latency_bytes= "
                            "apply to plans on one mesh")
        src_mesh = mesh_shape if isinstance(mesh_shape, DeviceMesh) else DeviceMesh(as_mesh_shape(mesh_shape))
        return plan_cross_mesh(global_shape, src_mesh, src, dst_mesh, dst, itemsize)
    shape, mshape, s, d, itemsize = _normalize_args(global_shape, mesh_shape, src, dst, itemsize)
    if topology is not None:
        if not isinstance(topology, Topology):
            raise PlanError(f"topology must be an sbp.Topology (or None), got {type(topology).__name__}: "
                            f"{topology!r}")
        topology.check(mshape)
    return classes.plan_cached(shape, mshape, s, d, itemsize, latency_bytes, topology)  # shape classes first


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
    shape, mshape, s, d, itemsize = _normalize_args(global_shape, mesh_shape, src, dst, itemsize)
    return Bounds(Costing(shape, mshape, itemsize)).lower_bound(s, d)


def _normalize_args(global_shape, mesh_shape, src, dst, itemsize):
    shape = check_global_shape(global_shape)
    mshape = mesh_shape.shape if isinstance(mesh_shape, DeviceMesh) else as_mesh_shape(mesh_shape)
    s = normalize(src, len(shape), len(mshape))
    d = normalize(dst, len(shape), len(mshape))
    size = as_ints((itemsize,))
    if size is None or size[0] < 1:
        hint = f" (a dtype's is {itemsize!r}.itemsize)" if type(itemsize).__name__ == "dtype" else ""
        raise PlanError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}{hint}")
    return shape, mshape, s, d, size[0]


def clear_caches() -> None:
    """Empty every planning memo (`CACHES`: plans, cross-mesh plans, exchange schedules, helpers, and
    the layout blocks they read). Plans are pure, so this only costs time: the next calls plan cold.

    >>> import sbp
    >>> _ = sbp.plan((8, 8), (2,), "S(0)", "B")
    >>> clear_caches(); cache_info()["search.plan_cached"].currsize
    0
    """
    for _, cached in CACHES:
        cached.cache_clear()


def cache_info() -> dict[str, tuple[int, int, int, int]]:
    """Every planning memo's `functools` cache info (hits, misses, maxsize, currsize), by name.

    >>> import sbp
    >>> clear_caches(); _ = [sbp.plan((8, 8), (2,), "S(0)", "B") for _ in range(2)]
    >>> info = cache_info()["classes.plan_cached"]
    >>> info.hits, info.misses, info.maxsize
    (1, 1, 4096)
    """
    return {name: cached.cache_info() for name, cached in CACHES}
