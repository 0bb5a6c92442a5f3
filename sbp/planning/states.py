"""The planner's states: placements tuples, their edits, and their codes as small ints.

A state is a normalised placements tuple, one placement per mesh axis. The hot loops of the planner
(exact transfers, self-contained groups) work on *split codes*, one int per placement, which compare
and hash faster than placement objects:

=============  =================================================
placement      code
=============  =================================================
``S(d)``       ``d`` (0 and up)
``B``          `BROADCAST_CODE` (-1)
``P(op)``      `partial_code(op)`: below `BROADCAST_CODE`, one per op
=============  =================================================

So ``code > BROADCAST_CODE`` tests for a Split and ``code < BROADCAST_CODE`` for a Partial.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from ..values.placement import REDUCE_OPS, Broadcast, Partial, Placement, Split

State = tuple[Placement, ...]
B = Broadcast()

BROADCAST_CODE = -1
"""The code of ``B``. Codes of ``S(d)`` are above it (``d``), codes of ``P(op)`` below it."""

PARTIAL_CODES = {op: BROADCAST_CODE - 1 - i for i, op in enumerate(REDUCE_OPS)}
"""The code of ``P(op)`` per op: every one below `BROADCAST_CODE`."""


def split_code(p: Placement) -> int:
    """A placement as one int: ``d`` for ``S(d)``, `BROADCAST_CODE` for ``B``, `partial_code` for ``P(op)``.

    >>> from sbp import S, B, Partial
    >>> split_code(S(1)), split_code(B), split_code(Partial("max"))
    (1, -1, -4)
    """
    return p.dim if isinstance(p, Split) else BROADCAST_CODE if isinstance(p, Broadcast) else PARTIAL_CODES[p.op]


def partial_code(op: str) -> int:
    """The code of ``P(op)``.

    >>> partial_code("sum"), partial_code("sum") < BROADCAST_CODE
    (-2, True)
    """
    return PARTIAL_CODES[op]


def pending(s: State, dst: State) -> bool:
    """True while `s` has a Partial axis that `dst` does not keep as it is (a reduction is still due).

    >>> from sbp import S, Partial
    >>> pending((Partial(), S(0)), (S(0), S(0))), pending((Partial(), S(0)), (Partial(), S(1)))
    (True, False)
    """
    for p, q in zip(s, dst):  # (a plain loop: the search asks for every state it reaches)
        if p.__class__ is Partial and p is not q:  # (placements are interned: equal ones are one object)
            return True
    return False


def put(s: State, axes: Sequence[int], p: Placement) -> State:
    """`s` with placement `p` on every axis of `axes`.

    >>> from sbp import S, B
    >>> put((S(0), S(1), S(0)), (0, 2), B)
    (B, S(1), B)
    """
    out = list(s)
    for a in axes:
        out[a] = p
    return tuple(out)


def put_each(s: State, axes: Sequence[int], d: State) -> State:
    """`s` with `d`'s placement on every axis of `axes`.

    >>> from sbp import S, B
    >>> put_each((S(0), S(1)), (1,), (B, B))
    (S(0), B)
    """
    out = list(s)
    for a in axes:
        out[a] = d[a]
    return tuple(out)


@lru_cache(maxsize=64)
def splits(ndim: int) -> tuple[Split, ...]:
    """``(S(0), ..., S(ndim - 1))``, one shared tuple per ndim (indexed by split code).

    >>> splits(2)
    (S(0), S(1))
    """
    return tuple(Split(d) for d in range(ndim))


CACHES = (("states.splits", splits),)
"""The memos of this module, by name (`sbp.planning.clear_caches` clears them)."""
