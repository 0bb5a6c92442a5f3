"""Planning at scale: the factored block maths of `sbp.planning.cost.Costing` against per-coord brute force,
and planning work that does not grow with the number of ranks where the layout is symmetric.

Symmetric here means every dim is split evenly (its length divisible by the product of the mesh axes
splitting it) in the source and the target: then no rank differs from another but by a translation, and
the planner prices Split/Broadcast changes from per-dim piece lengths with no work per rank or per piece.
Work is counted by `Costing.work` (pieces, table entries, probe coords and per-coord entries computed),
never by wall-clock time.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest

import sbp
from sbp.planning.bounds import Bounds
from sbp.planning.cost import Costing
from sbp.planning.search import find_steps
from sbp.values.layout import block, block_numel, intersect


def _brute(shape, mesh, s, t):
    lack = largest = total = 0
    for coord in itertools.product(*map(range, mesh)):
        have, want = block(shape, mesh, s, coord), block(shape, mesh, t, coord)
        both = intersect(have, want)
        lack = max(lack, block_numel(want) - (block_numel(both) if both else 0))
        largest = max(largest, block_numel(have))
        total += block_numel(have)
    return lack, largest, total


def test_factored_sizes_equal_per_coord_brute_force():
    rng = random.Random(18)
    checked = 0
    while checked < 1500:
        mesh = tuple(rng.choice([1, 2, 3, 4, 5]) for _ in range(rng.choice([1, 2, 3, 4])))
        if math.prod(mesh) > 120:
            continue
        nd = rng.choice([1, 2, 3])
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 12, 16, 30]) for _ in range(nd))
        one = [sbp.B] + [sbp.S(d) for d in range(nd)]
        s, t = (tuple(rng.choice(one) for _ in mesh) for _ in range(2))
        c = Costing(shape, mesh, 4)
        lack, largest, total = _brute(shape, mesh, s, t)
        assert (c.lack(s, t), c.max_local_bytes(s), c.total_numel(s)) == (lack, 4 * largest, total), (shape, mesh, s, t)
        checked += 1


def _work(shape, mesh, src, dst) -> tuple[int, list]:
    costing = Costing(shape, mesh, 4)
    s, d = sbp.placements(src), sbp.placements(dst)
    steps = find_steps(costing, s, d, 0, None, bounds=Bounds(costing))
    return costing.work, [(st.kind, st.axes) for st in steps]


SYMMETRIC = [("S(0), S(1), B", "B, S(0), S(1)"), ("S(0), S(0), S(1)", "S(1), B, S(0)"),
             ("S(1), B, S(0)", "S(0), S(1), B"), ("B, S(0), B", "S(1), S(1), S(0)")]


@pytest.mark.parametrize("src, dst", SYMMETRIC)
def test_work_does_not_grow_with_ranks_on_symmetric_layouts(src, dst):
    # 65536 rows split even 16,384 ways: every state the search visits is symmetric on both meshes
    small, small_steps = _work((65536, 65536), (4, 16, 16), src, dst)     # 1,024 ranks
    large, large_steps = _work((65536, 65536), (16, 32, 32), src, dst)    # 16,384 ranks
    assert large == small
    assert small_steps == large_steps
    # 4096 rows: states splitting a dim 16,384 ways are uneven (empty blocks); the probes stay a few dozen
    assert _work((4096, 4096), (16, 32, 32), src, dst)[0] <= 64


def test_work_counter_counts_uneven_layouts():
    # (not symmetric: 4099 rows over 16 x 32 pieces) the counter sees the per-piece work, which grows
    small, _ = _work((4099, 4096), (4, 16, 16), "S(0), S(0), B", "B, S(1), S(0)")
    large, _ = _work((4099, 4096), (16, 32, 32), "S(0), S(0), B", "B, S(1), S(0)")
    assert 0 < small < large


@pytest.mark.parametrize("mesh", [(16, 32, 32), (4, 4, 32, 32)])
def test_split_broadcast_plans_at_16k_ranks_reach_the_lower_bound(mesh):
    rng = random.Random(3)
    one = [sbp.B, sbp.S(0), sbp.S(1)]
    states = list(itertools.product(one, repeat=len(mesh)))
    for s, d in rng.sample([(s, d) for s in states for d in states if s != d], 25):
        p = sbp.plan((4096, 4096), mesh, s, d)
        assert p.bytes_per_rank == p.lower_bound, (s, d)
