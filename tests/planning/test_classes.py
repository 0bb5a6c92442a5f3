"""Shape classes: a plan re-priced from its class's template equals a cold plan, steps and bytes."""
from __future__ import annotations

import math
import random

import pytest

import sbp
import sbp.planning
from sbp.planning import classes, search
from sbp.values.errors import SbpError
from sbp.values.placement import B, Partial, Split, normalize

MESHES = ((1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (2, 2, 2), (4, 2))
CASES = 2000


def _placements(rng: random.Random, ndim: int, naxes: int) -> tuple:
    one = [B] * 3 + [Split(d) for d in range(ndim)] * 2 + [Partial("sum")] * 2 + [Partial("max")]
    return tuple(rng.choice(one) for _ in range(naxes))


def _dim(rng: random.Random, square: int) -> int:
    """A size of one of the class's edges: an even multiple of the square, uneven, small or zero."""
    match rng.randrange(8):
        case 0 | 1 | 2:
            return square * rng.randint(1, 6)
        case 3:
            return 0
        case 4:
            return rng.randint(1, 3)
        case _:
            return rng.randint(1, 3 * square + 3)


def _same_class_pair(rng: random.Random):
    """(mesh, src, dst, shape a, shape b, itemsizes) with a and b different shapes of one class."""
    mesh = rng.choice(MESHES)
    square = math.prod(mesh) ** 2
    ndim = rng.randint(1, 3)
    while True:
        a = tuple(_dim(rng, square) for _ in range(ndim))
        empty = 0 in a
        b = tuple(n if n == 0 or not (empty or (n % square == 0 and n > 1))
                  else (rng.randint(1, 40) if empty else square * rng.randint(1 + (square == 1), 6)) for n in a)
        if a != b:
            break
    while True:
        try:
            src = normalize(_placements(rng, ndim, len(mesh)), ndim, len(mesh))
            dst = normalize(_placements(rng, ndim, len(mesh)), ndim, len(mesh))
        except SbpError:   # e.g. a P(sum) after a P(max) on a later axis: not a value
            continue
        return mesh, src, dst, a, b, rng.choice((1, 2, 4)), rng.choice((1, 2, 4, 8))


def test_class_cached_plans_equal_cold_plans():
    """2,000 random (mesh, shape, src, dst) pairs of shapes sharing a class, uneven, empty and Partial among
    them: the second shape's plan, re-priced from the first's template, equals the cold search's plan."""
    rng = random.Random(22)
    kinds = {"uneven": 0, "empty": 0, "partial": 0, "steps": 0}
    for _ in range(CASES):
        mesh, src, dst, a, b, size_a, size_b = _same_class_pair(rng)
        classes.TEMPLATES.cache_clear()
        classes.plan_cached.cache_clear()
        first = classes.plan_cached(a, mesh, src, dst, size_a, 0)
        hits = classes.TEMPLATES.cache_info().hits
        cached = classes.plan_cached(b, mesh, src, dst, size_b, 0)
        assert classes.TEMPLATES.cache_info().hits == hits + 1   # re-priced from the template
        cold = search.plan_cached.__wrapped__(b, mesh, src, dst, size_b, 0)
        assert cached == cold, (mesh, src, dst, a, b, first.steps, cached.steps, cold.steps)
        assert classes.reprice(first, b, size_b) == cold
        kinds["uneven"] += any(n % math.prod(mesh) for n in b)
        kinds["empty"] += 0 in b
        kinds["partial"] += any(isinstance(p, Partial) for p in src + dst)
        kinds["steps"] += len(cold.steps) > 1
    assert min(kinds.values()) >= 100, kinds   # each edge is met many times


def test_shape_class_keeps_what_prices_depend_on():
    s0, b = (Split(0),), (B,)
    key = classes.shape_class
    assert key((16, 8), (2,), s0, b, 4) == key((32, 12), (2,), s0, b, 2)      # both multiples of 4
    assert key((16, 8), (2,), s0, b, 4) != key((18, 8), (2,), s0, b, 4)       # 18 over 2 even, not over 4
    assert key((0, 8), (2,), s0, b, 4) == key((0, 5), (2,), s0, b, 4)         # empty: nothing is priced
    assert key((0, 8), (2,), s0, b, 4) != key((8, 0), (2,), s0, b, 4)
    assert key((16, 8), (2,), s0, b, 4, 64) != key((32, 8), (2,), s0, b, 4, 64)   # latency: exact
    assert key((16, 8), (2,), s0, b, 4, 0, "topology") != key((32, 8), (2,), s0, b, 4, 0, "topology")


def test_sbp_plan_goes_through_the_class_memo():
    sbp.planning.clear_caches()
    info = sbp.planning.cache_info
    first = sbp.plan((8, 64, 16), (2, 2, 2), "S(0), S(1), B", "B, S(1), S(2)")
    again = sbp.plan((8, 128, 16), (2, 2, 2), "S(0), S(1), B", "B, S(1), S(2)")   # 64 | 128: same class
    assert info()["classes.TEMPLATES"].hits == 1 and info()["search.plan_cached"].misses == 1
    assert [s.kind for s in again.steps] == [s.kind for s in first.steps]
    assert again.bytes_per_rank == 2 * first.bytes_per_rank
    sbp.planning.clear_caches()
    assert info()["classes.TEMPLATES"].currsize == 0 and info()["classes.plan_cached"].currsize == 0


def test_class_memo_is_bounded():
    memo = classes.ClassMemo(maxsize=3)
    for i in range(5):
        memo.put(i, str(i))
    assert memo.get(0) is None and memo.get(4) == "4"      # the oldest went first
    memo.get(2)
    memo.put(5, "5")                                       # 3 was the least recently used
    assert memo.get(3) is None and memo.get(2) == "2"
    assert memo.cache_info().currsize == 3 and memo.cache_info().maxsize == 3


@pytest.mark.parametrize("latency", [0, 256])
def test_latency_classes_never_share(latency):
    """With a latency term a per-call constant joins the bytes: every shape is its own class."""
    sbp.planning.clear_caches()
    for n in (64, 128, 192):
        sbp.plan((n, 8), (2,), "P", "B", latency_bytes=latency)
    assert classes.TEMPLATES.cache_info().hits == (2 if latency == 0 else 0)
