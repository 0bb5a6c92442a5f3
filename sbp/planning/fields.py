"""Digit fields: which digits of the mesh axes a join of per-dim tables must enumerate.

A per-dim table of the planner (`sbp.planning.blocks.Blocks._even_groups`) compares, for every digit
combination of some mesh axes, the digits of a dim's *finer* chain of axes with the piece index of its
*coarser* chain: on an even split, the coarse index is the fine one divided by the ratio ``r`` of their
piece counts. Write the fine index in mixed radix: axis ``a`` of a chain holds the positions
``[p, p * size)`` of it, ``p`` the product of the sizes after ``a`` (times ``r`` for the coarse chain).
When all these boundaries divide one another, each digit is a run of *fields* (the stretches between
boundaries) and the division compares field with field, no carries: a table entry depends on the digits
only through which compared fields are equal.

Then values do not matter, equalities do: in any digit combination, the values one group of compared
fields takes can be renumbered 0, 1, 2, ... in order without changing an equality, so every case is met
with each field below the size of its group (a field compared with nothing stays 0). Per axis that is a few
digits however large the axis: the planning work no longer grows with the mesh (`compared_digits`).
"""
from __future__ import annotations

import itertools
from typing import Optional

SMALL = 2
"""When no axis has more digits than this, `compared_digits` does not look for fewer (the tables are small,
and looking costs more than it saves)."""

Relation = tuple[tuple[int, ...], tuple[int, ...], int]   # (fine chain, coarse chain, ratio of piece counts)


def compared_digits(relations: list[Relation], mesh: tuple[int, ...], axes) -> Optional[dict[int, tuple]]:
    """Per axis of `axes`, the digits (increasing) that meet every case of tables comparing the chains of
    `relations` (fine chain, coarse chain, piece-count ratio ``r``: a fine piece lies in coarse piece
    ``i // r``); None when some boundaries do not divide one another (the comparisons carry), when the
    digits would be all of them anyway, or when no axis has more than `SMALL` digits.

    >>> compared_digits([((2,), (1,), 1), ((1,), (2,), 1)], (16, 32, 32), [1, 2])   # (S(0), S(1)) vs (S(1), S(0))
    {1: (0, 1), 2: (0, 1)}
    >>> compared_digits([((1,), (0,), 2)], (16, 32, 32), [0, 1])   # 32 pieces in 16: axis 1's low bit is free
    {0: (0, 1), 1: (0, 2)}
    >>> compared_digits([((0, 1), (2, 3), 1)], (3, 2, 2, 3), [0, 1, 2, 3]) is None   # 3 x 2 against 2 x 3
    True
    """
    if max((mesh[a] for a in axes), default=1) <= SMALL:
        return None
    splits: dict[int, set[int]] = {a: set() for a in range(len(mesh))}   # per axis, field boundaries inside
    pairs = []   # (axis, start, end) ~ (axis, start, end): digit weights of two compared stretches
    for fine, coarse, r in relations:
        mine, theirs = _spans(fine, mesh, 1), _spans(coarse, mesh, r)
        bounds = sorted({b for _, p, q in mine + theirs for b in (p, q)} | {r})
        if any(b % a for a, b in zip(bounds, bounds[1:])):
            return None
        for a, p, q in mine + theirs:
            splits[a].update(b // p for b in bounds if p < b < q)
        for lo, hi in zip(bounds, bounds[1:]):
            if lo < r:
                continue   # (below the ratio: fine positions only, compared with nothing)
            here = [[(a, lo // p, hi // p) for a, p, q in side if p <= lo and hi <= q] for side in (mine, theirs)]
            if all(here) and here[0][0] != here[1][0]:
                pairs.append((here[0][0], here[1][0]))
    changed = True
    while changed:   # a field boundary inside one side of a comparison is one of the other side too
        changed = False
        for (a, lo, hi), (b, lo2, hi2) in pairs:
            inner = {w // lo for w in splits[a] if lo < w < hi} | {w // lo2 for w in splits[b] if lo2 < w < hi2}
            for axis, start in ((a, lo), (b, lo2)):
                new = {start * w for w in inner} - splits[axis]
                if new:
                    splits[axis] |= new
                    changed = True
    fields: dict[tuple[int, int], int] = {}   # (axis, field's weight) -> field size
    for a, inside in splits.items():
        cuts = sorted(inside | {1, mesh[a]})
        if any(mesh[a] % w or y % w for w, y in zip(cuts, cuts[1:])):
            return None
        fields.update({(a, w): y // w for w, y in zip(cuts, cuts[1:])})
    parent = {f: f for f in fields}

    def root(f):
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    for (a, lo, hi), (b, lo2, hi2) in pairs:   # align the two stretches' fields, one for one
        for (x, w) in [f for f in fields if f[0] == a and lo <= f[1] < hi]:
            other = (b, w // lo * lo2)
            if fields.get(other) != fields[(x, w)]:   # pragma: no cover - the boundaries were made to agree
                return None
            parent[root((x, w))] = root(other)
    group = {}
    for f in fields:
        group[root(f)] = group.get(root(f), 0) + 1
    out, shrinks = {}, False
    for a in axes:
        own = sorted((w, size) for (x, w), size in fields.items() if x == a)
        ranges = [range(min(size, group[root((a, w))])) for w, size in own]   # (a lone field: 0 only)
        digits = tuple(sorted(sum(v * w for v, (w, _) in zip(combo, own)) for combo in itertools.product(*ranges)))
        shrinks = shrinks or len(digits) < mesh[a]
        out[a] = digits
    return out if shrinks else None


def _spans(chain: tuple[int, ...], mesh: tuple[int, ...], scale: int) -> list[tuple[int, int, int]]:
    """(axis, first position, end position) of each axis of `chain` (axes of size 1 aside) in a piece index
    of the finer chain, the chain's own index counted in units of `scale`."""
    out, p = [], scale
    for a in reversed(chain):
        if mesh[a] > 1:
            out.append((a, p, p * mesh[a]))
            p *= mesh[a]
    return out[::-1]
