"""Placements: how a tensor sits on one mesh axis (`S(d)`, `B`, `P(op)`), and parsing of their repr.

Placements are immutable values. Dims may be negative until the placement meets a tensor
(`normalize`), where they are checked against the tensor's ndim.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Union

from .errors import PlacementError

REDUCE_OPS = ("sum", "min", "max")


class _Kind:
    """What kind of placement a placement is, as methods (sbp's names, and DTensor's for ported code:
    `is_shard` = `is_split`, `is_replicate` = `is_broadcast`); `isinstance` answers the same.

    >>> Split(1).is_split(), Split(1).is_split(0), B.is_broadcast(), Partial("max").is_partial("max")
    (True, False, True, True)
    >>> Split(0).is_shard(dim=0), B.is_replicate(), B.is_partial()
    (True, True, False)
    """

    __slots__ = ()

    def is_split(self, dim: "int | None" = None) -> bool:
        """A `Split`, along `dim` when one is given (the normalised dim a tensor reports)."""
        return type(self) is Split and (dim is None or self.dim == dim)

    def is_broadcast(self) -> bool:
        """The `Broadcast` placement."""
        return type(self) is Broadcast

    def is_partial(self, op: "str | None" = None) -> bool:
        """A `Partial`, of reduction `op` when one is given."""
        return type(self) is Partial and (op is None or self.op == op)

    def is_shard(self, dim: "int | None" = None) -> bool:
        """DTensor's spelling of `is_split`."""
        return self.is_split(dim)

    def is_replicate(self) -> bool:
        """DTensor's spelling of `is_broadcast`."""
        return self.is_broadcast()


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Split(_Kind):
    """`S(dim)`: the logical tensor is the concatenation along `dim` of the coords' local tensors.

    Placements are interned values: equal placements are the same object (``Split(0) is Split(0)``), so
    they compare and hash by identity, at C speed (placements key the planner's and dispatch's caches).

    >>> Split(0), Split(0) is Split(0), Split(0) == Split(1)
    (S(0), True, False)
    """

    dim: int

    def __new__(cls, dim: int) -> "Split":
        if type(dim) is int:
            found = _SPLITS.get(dim)
            if found is not None:
                return found
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise PlacementError(f"Split dim must be an int, got {dim!r} ({type(dim).__name__})")
        dim = int(dim)  # (an int subclass, e.g. an IntEnum member, is kept as its plain int)
        out = object.__new__(cls)
        object.__setattr__(out, "dim", dim)
        return _SPLITS.setdefault(dim, out)

    def __repr__(self) -> str:
        return f"S({self.dim})"

    def __reduce__(self) -> tuple:  # pickles as a call of the class (loads under torch.load(weights_only=True))
        return Split, (self.dim,)


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Broadcast(_Kind):
    """`B`: every coord holds the whole (sub)tensor. One object (``Broadcast() is B``).

    >>> Broadcast(), Broadcast() is Broadcast()
    (B, True)
    """

    def __new__(cls) -> "Broadcast":
        return _BROADCAST

    def __repr__(self) -> str:
        return "B"

    def __reduce__(self) -> tuple:
        return Broadcast, ()


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Partial(_Kind):
    """`P(op)`: the logical tensor is the element-wise `op` reduction over the coords' local tensors.
    One object per op (``Partial() is Partial("sum")``).

    >>> Partial("max"), Partial() is Partial("sum")
    (P(max), True)
    """

    op: str = "sum"

    def __new__(cls, op: str = "sum") -> "Partial":
        found = _PARTIALS.get(op) if type(op) is str else None
        if found is None:
            raise PlacementError(f"Partial op must be one of {REDUCE_OPS}, got {op!r}")
        return found

    def __repr__(self) -> str:
        return f"P({self.op})"

    def __reduce__(self) -> tuple:
        return Partial, (self.op,)


_SPLITS: dict[int, Split] = {}
_BROADCAST = object.__new__(Broadcast)
_PARTIALS: dict[str, Partial] = {}
for _op in REDUCE_OPS:
    _PARTIALS[_op] = object.__new__(Partial)
    object.__setattr__(_PARTIALS[_op], "op", _op)
del _op

Placement = Union[Split, Broadcast, Partial]
"""Any one placement on one mesh axis: a `Split`, `Broadcast` or `Partial` value.

A type alias (the union of the three classes, not a base class they inherit from); it works in
annotations and in `isinstance`.

>>> isinstance(S(0), Placement), isinstance(Partial("max"), Placement), isinstance("S(0)", Placement)
(True, True, False)
"""

S = Split
B = Broadcast()


def PartialSum() -> Partial:
    """`P(sum)`; equal to `Partial("sum")`.

    >>> PartialSum() == Partial("sum")
    True
    """
    return Partial("sum")


def PartialMin() -> Partial:
    """`P(min)`; equal to `Partial("min")`.

    >>> PartialMin()
    P(min)
    """
    return Partial("min")


def PartialMax() -> Partial:
    """`P(max)`; equal to `Partial("max")`.

    >>> PartialMax()
    P(max)
    """
    return Partial("max")


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<split>S)\s*(?:\(\s*(?P<dim1>[+-]?\d+)\s*\)|(?P<dim2>[+-]?\d+))
      | (?P<bcast>B|R)
      | (?P<partial>P)\s*(?:\(\s*(?P<op>[a-z]+)\s*\))?
    )\s*$""",
    re.VERBOSE,
)
_ACCEPTED = "S(d) or Sd for an int d, B, P, P(sum), P(min), P(max); comma separated, optional ( )"


def parse_placement(text: str) -> Placement:
    """Parse one placement from its repr form.

    >>> parse_placement("S(1)"), parse_placement("S-1"), parse_placement("P(max)")
    (S(1), S(-1), P(max))
    """
    match = _TOKEN.match(text)
    if match is None:
        raise PlacementError(f"cannot parse placement {text.strip()!r}; accepted: {_ACCEPTED}")
    if match["split"]:
        return Split(int(match["dim1"] if match["dim1"] is not None else match["dim2"]))
    if match["bcast"]:
        return B
    op = match["op"] or "sum"
    if op not in REDUCE_OPS:
        raise PlacementError(f"cannot parse placement {text.strip()!r}: Partial op {op!r} is not one of {REDUCE_OPS}")
    return Partial(op)


def placements(spec: "str | Placement | Iterable[Placement | str]") -> tuple[Placement, ...]:
    """Turn a string like ``"S(0), B"`` (or objects, or a mix) into a placements tuple.

    It is the inverse of the tuple's repr.

    >>> placements("S(0), B") == (S(0), B)
    True
    >>> placements(repr((S(1), Partial("min"))))
    (S(1), P(min))
    """
    if isinstance(spec, (Split, Broadcast, Partial)):
        return (spec,)
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("(") and text.endswith(")"):
            inner = text[1:-1]
            # "(S(0), B)" is a tuple; "P(max)" or "S(0)" alone are not wrapped tuples.
            if _balanced(inner):
                text = inner
        parts = [p for p in text.split(",")]
        if parts and not parts[-1].strip():
            parts = parts[:-1]  # a tuple repr with one element ends in ","
        if not parts:
            return ()
        return tuple(parse_placement(p) for p in parts)
    if isinstance(spec, (set, frozenset, dict)):
        raise PlacementError(f"placements must be in mesh-axis order (a tuple or list, one per axis), got a "
                             f"{type(spec).__name__}, which has no order: {spec!r}")
    try:
        items = list(spec)
    except TypeError:
        raise PlacementError(
            f"placements must be a string, a placement or an iterable of placements, got {type(spec).__name__}"
        ) from None
    out = []
    for item in items:
        if isinstance(item, (Split, Broadcast, Partial)):
            out.append(item)
        elif isinstance(item, str):
            out.append(parse_placement(item))
        else:
            raise PlacementError(f"{item!r} is not a placement; accepted: {_ACCEPTED} or sbp.Split/Broadcast/Partial")
    return tuple(out)


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            return False
    return depth == 0


def normalize(pls: "str | Iterable[Placement | str]", ndim: int, mesh_ndim: int,
              cache: bool = True) -> tuple[Placement, ...]:
    """Check placements against a tensor's ndim and a mesh's ndim and make split dims non-negative.
    ``cache=False`` skips the cache of common spellings: for code torch.compile's dynamo traces (it would
    step around the cache with a warning).

    >>> normalize("S(-1), B", ndim=2, mesh_ndim=2), normalize(("S(-1)", B), ndim=2, mesh_ndim=2, cache=False)
    ((S(1), B), (S(1), B))
    """
    if cache and isinstance(pls, (tuple, str)):   # the common spellings: parsed and checked once, then cached
        try:
            return _normalize_cached(pls, ndim, mesh_ndim)
        except TypeError:  # unhashable entries: validated (and refused) below
            pass
    return _normalize(pls, ndim, mesh_ndim)


@lru_cache(maxsize=4096)
def _normalize_cached(pls: tuple, ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    return _normalize(pls, ndim, mesh_ndim)


def _normalize(pls, ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    pls = placements(pls)
    if len(pls) != mesh_ndim:
        raise PlacementError(
            f"placements {placements_repr(pls)} give {len(pls)} placement(s) but the mesh has {mesh_ndim} axes "
            f"(need exactly one placement per mesh axis)"
        )
    out = []
    for p in pls:
        if isinstance(p, Split):
            if not -ndim <= p.dim < ndim:
                valid = f"{-ndim}..{ndim - 1}" if ndim else "none: a 0-d tensor cannot be split"
                raise PlacementError(f"{p!r} is out of range for a {ndim}-d tensor (valid: {valid})")
            p = Split(p.dim % ndim)
        out.append(p)
    return tuple(out)


def placements_repr(pls: "tuple[Placement, ...]") -> str:
    """``repr(pls)`` of a placements tuple, written out so that code torch.compile's dynamo traces prints
    the placements too (dynamo's own repr of such a tuple names its internal variables).

    >>> placements_repr((Split(0),)), placements_repr((Split(0), B))
    ('(S(0),)', '(S(0), B)')
    """
    return "(" + ", ".join([repr(p) for p in pls]) + ("," if len(pls) == 1 else "") + ")"


def is_partial(p: Placement) -> bool:
    """True for `P(op)`.

    >>> is_partial(Partial()), is_partial(B)
    (True, False)
    """
    return isinstance(p, Partial)
