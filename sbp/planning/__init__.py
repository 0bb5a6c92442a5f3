"""Planning: from a change of placements to the cheapest plan, in pure Python (no torch).

Modules, each importing only those before it: `states` (placements tuples and their int codes),
`exchange` (exact point-to-point schedules), `cost` (step prices), `bounds` (lower bounds), `moves` (the
move table), `search` (A* over states), `classes` (shape classes: one search per class of shapes),
`crossmesh` (plans between meshes), `api` (`plan`, `lower_bound_bytes`, and `clear_caches` /
`cache_info` for every planning memo).

>>> import sbp.planning
>>> sbp.planning.plan((8, 8), (2,), "S(0)", "B").bytes_per_rank
128
>>> sbp.planning.clear_caches()
"""
from .api import cache_info, clear_caches, lower_bound_bytes, plan

__all__ = ["cache_info", "clear_caches", "lower_bound_bytes", "plan"]
