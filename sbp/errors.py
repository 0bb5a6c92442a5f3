"""The one error hierarchy of sbp: every user mistake raises a subclass of `SbpError`.

Messages state the rule, the offending values and what would be valid.
"""
from __future__ import annotations


class SbpError(ValueError):
    """Base class of every error sbp raises for bad input or disagreeing ranks.

    >>> import sbp
    >>> try:
    ...     sbp.placements("Q")
    ... except sbp.SbpError as e:
    ...     print(type(e).__name__)
    PlacementError
    """


class PlacementError(SbpError):
    """A placement (or a placements tuple) is malformed or does not fit a tensor / mesh."""


class MeshError(SbpError):
    """A mesh shape, axis name, rank list or world size is invalid."""


class ShapeError(SbpError):
    """A global or local shape is invalid or inconsistent with the layout."""


class PlanError(SbpError):
    """A redistribution cannot be planned (e.g. an unreachable state)."""


class CommError(SbpError):
    """A collective failed or timed out; names the collective and the mesh axes."""


class RankMismatchError(SbpError):
    """Ranks passed different values (placements, shapes, dtypes) to the same call."""


class CheckpointError(SbpError):
    """A checkpoint is corrupt or does not match the state it is loaded into."""


class UnsupportedOpError(SbpError):
    """An operator has no sharding rule and `sbp.strict()` is active."""


class DTypeError(SbpError):
    """A dtype is not a torch dtype, is not supported by a call, or cannot hold a value (never truncated)."""
