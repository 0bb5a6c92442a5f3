"""Shape classes: one search per class of shapes, its plan re-priced for every shape of the class.

The search (`sbp.planning.search`) compares plans by bytes the busiest rank receives, then
collectives, transfers, peak memory, steps. Without a latency term or a topology every one of these
numbers is a sum of block volumes (and ring divisions of them) times the itemsize. A dim whose size is
a multiple of ``M * M`` (``M``: the mesh's rank count) and above 1 (a dim of 1 lets a gather land in
place, whatever ``M``) is cut evenly by every split the search can make,
into pieces that are multiples of ``M``; so are all overlaps of blocks and every ring division of them:
each such number is *linear* in that dim's size (and in the itemsize). Two shapes that differ only in
such dims therefore price every candidate plan in the same proportion, and the search makes the same
choice for both (ties included: its queue order is the order of these numbers). That is the class:

- ``shape_class`` keeps every other dim exactly (uneven sizes, small sizes, zero) and replaces each
  dim divisible by ``M * M`` with `EVEN`; the itemsize is dropped. An empty tensor (all prices 0) is
  one class per mesh, placements and position of its zero dims.
- With ``latency_bytes > 0`` or a topology, prices add a per-call constant to the bytes: not linear,
  so the class is the exact arguments (no sharing; correctness first).

A class's first plan is its *template*; `plan_cached` fills it in for a new shape of the class by
arithmetic (`rescale`: each step's bytes and peak and the lower bound times the ratio of the shapes'
differing dims and itemsizes, the linearity above; a lookup plus a few multiplications). `reprice`
prices the template's steps with the very `Costing.step` the search uses instead (the fallback, should
a ratio not divide). tests/planning/test_classes.py checks that both equal a cold plan, steps, bytes,
peaks and bound, on 2,000 random meshes, shapes and placements, uneven, empty and Partial included.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections import OrderedDict, namedtuple
from functools import lru_cache
from typing import Any, Hashable

from ..values.steps import Plan
from . import search
from .bounds import Bounds
from .cost import Costing
from .states import State

EVEN = -1
"""A dim's entry in a class key for a size divisible by the square of the mesh's rank count."""

CacheInfo = namedtuple("CacheInfo", "hits misses maxsize currsize")


def shape_class(shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: State, dst: State, itemsize: int,
                latency_bytes: int = 0, topology: Any = None) -> Hashable:
    """The class key of normalised plan arguments: equal keys, equal plan steps (see the module docstring).

    >>> from sbp import S, B
    >>> shape_class((8, 100, 64), (2,), (S(2),), (B,), 4) == shape_class((8, 104, 64), (2,), (S(2),), (B,), 2)
    True
    >>> shape_class((8, 101, 64), (2,), (S(2),), (B,), 4)[0]      # 101 is not a multiple of 4: kept
    (-1, 101, -1)
    >>> shape_class((8, 100), (2,), (S(0),), (B,), 4, latency_bytes=64)[0]   # a latency: the exact arguments
    (8, 100)
    """
    if latency_bytes or topology is not None:
        return shape, mesh_shape, src, dst, itemsize, latency_bytes, topology
    if 0 in shape:
        return tuple(0 if n == 0 else EVEN for n in shape), mesh_shape, src, dst
    square = math.prod(mesh_shape) ** 2
    return tuple(EVEN if n % square == 0 and n > 1 else n for n in shape), mesh_shape, src, dst


def rescale(template: Plan, shape: tuple[int, ...], itemsize: int) -> Plan:
    """`template` for another `shape` (and `itemsize`) of its class, by arithmetic: bytes, peaks and the lower
    bound are linear in every dim the shapes differ in (each a multiple of the squared rank count) and in
    the itemsize, so each is scaled by the ratio of those dims' product times the itemsize. Falls back on
    `reprice` where a ratio does not divide (never within a class; the check costs a remainder).

    >>> import sbp
    >>> t = sbp.plan((16, 8), (2,), "S(0)", "B")
    >>> p = rescale(t, (48, 8), 2)
    >>> p.global_shape, [s.kind for s in p.steps], p.bytes_per_rank
    ((48, 8), ['all_gather'], 384)
    >>> p == reprice(t, (48, 8), 2)
    True
    """
    num, den = itemsize, template.itemsize
    for new, old in zip(shape, template.global_shape):
        if new != old:
            num *= new
            den *= old
    if num == den:
        return dataclasses.replace(template, global_shape=shape, itemsize=itemsize)
    steps = []
    for s in template.steps:
        nbytes, rest = divmod(s.bytes * num, den)
        peak, rest2 = divmod(s.peak_bytes * num, den)
        if rest or rest2:
            return reprice(template, shape, itemsize)
        steps.append(dataclasses.replace(s, bytes=nbytes, peak_bytes=peak))
    bound, rest = divmod(template.lower_bound * num, den)
    if rest:
        return reprice(template, shape, itemsize)
    return dataclasses.replace(template, global_shape=shape, itemsize=itemsize, steps=tuple(steps), lower_bound=bound)


def reprice(template: Plan, shape: tuple[int, ...], itemsize: int) -> Plan:
    """`template`'s steps priced for `shape` and `itemsize` with `Costing.step` (and its lower bound anew).

    >>> import sbp
    >>> t = sbp.plan((8, 8), (2,), "S(0)", "B")
    >>> p = reprice(t, (16, 8), 2)
    >>> p.global_shape, [s.kind for s in p.steps], p.bytes_per_rank, p.lower_bound
    ((16, 8), ['all_gather'], 128, 128)
    """
    costing = Costing(shape, template.mesh_shape, itemsize)
    steps = tuple(costing.step(s.kind, s.axes, s.src, s.dst, s.dims, s.op) for s in template.steps)
    bound = Bounds(costing).lower_bound(template.src, template.dst)
    return dataclasses.replace(template, global_shape=shape, itemsize=itemsize, steps=steps, lower_bound=bound)


class ClassMemo:
    """A bounded map from class keys to template plans, least recently used evicted first; reports like an
    `lru_cache` (`cache_info()`, `cache_clear()`), so it sits in `CACHES` beside them.

    >>> memo = ClassMemo(maxsize=1)
    >>> memo.put("a", 1); memo.put("b", 2); memo.get("a"), memo.get("b")
    (None, 2)
    >>> memo.cache_info()
    CacheInfo(hits=1, misses=1, maxsize=1, currsize=1)
    """

    __slots__ = ("_items", "_lock", "maxsize", "hits", "misses")

    def __init__(self, maxsize: int = 1024) -> None:
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.maxsize = maxsize
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Any:
        """The value stored under `key` (None when absent), marked most recently used."""
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
                self._items.move_to_end(key)
            return found

    def put(self, key: Hashable, value: Any) -> None:
        """Store `value` under `key`, evicting the least recently used entry when full."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)

    def cache_info(self) -> CacheInfo:
        """(hits, misses, maxsize, currsize), as `functools.lru_cache` reports them."""
        return CacheInfo(self.hits, self.misses, self.maxsize, len(self._items))

    def cache_clear(self) -> None:
        """Forget every entry and the counts."""
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0


TEMPLATES = ClassMemo(maxsize=1024)
"""Template plans by class key (1,024 classes; a plan of a few steps is a few hundred bytes)."""


@lru_cache(maxsize=4096)
def plan_cached(shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: State, dst: State, itemsize: int,
                latency_bytes: int = 0, topology: Any = None) -> Plan:
    """The plan for checked, normalised arguments (as `sbp.plan` makes them): exact arguments cached here,
    a new shape of a known class re-priced from the class's template, a new class searched.

    >>> from sbp import S, B
    >>> p = plan_cached((8, 100, 64), (2,), (S(2),), (B,), 4)      # a new class: searched
    >>> q = plan_cached((8, 104, 64), (2,), (S(2),), (B,), 4)      # same class: re-priced
    >>> [s.kind for s in q.steps], q.bytes_per_rank == 8 * 104 * 32 * 4
    (['all_gather'], True)
    """
    key = shape_class(shape, mesh_shape, src, dst, itemsize, latency_bytes, topology)
    template = TEMPLATES.get(key)
    if template is not None:
        return rescale(template, shape, itemsize)
    extra = {} if topology is None else {"topology": topology}   # (the argument exists once topologies do)
    found = search.plan_cached(shape, mesh_shape, src, dst, itemsize, latency_bytes, **extra)
    TEMPLATES.put(key, found)
    return found


CACHES = (("classes.plan_cached", plan_cached), ("classes.TEMPLATES", TEMPLATES))
"""The memos of this module, by name (`sbp.planning.clear_caches` clears them)."""
