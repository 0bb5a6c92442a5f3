"""The one error hierarchy of sbp: every user mistake raises a subclass of `SbpError`.

Messages state the rule, the offending values and what would be valid. `sbp.FallbackWarning` (an op ran
without a sharding rule) is a warning, not an error: it is a `UserWarning` outside this hierarchy.

>>> import sbp
>>> issubclass(sbp.ShapeError, sbp.SbpError), issubclass(sbp.FallbackWarning, sbp.SbpError)
(True, False)
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
    """A placement (or a placements tuple) is malformed or does not fit a tensor / mesh.

    >>> import sbp
    >>> sbp.placements("P(avg)")
    Traceback (most recent call last):
    ...
    sbp.values.errors.PlacementError: cannot parse placement 'P(avg)': Partial op 'avg' is not one of ('sum', 'min', 'max')
    """


class MeshError(SbpError):
    """A mesh shape, axis name, rank list or world size is invalid.

    >>> import sbp
    >>> sbp.DeviceMesh((2, 2), names=("tp", "tp"))
    Traceback (most recent call last):
    ...
    sbp.values.errors.MeshError: mesh axis names must be unique, got ('tp', 'tp') (duplicated: tp)
    """


class ShapeError(SbpError):
    """A global or local shape is invalid or inconsistent with the layout.

    >>> import sbp
    >>> sbp.local_shape((4,), (2,), "S(0)", None)
    Traceback (most recent call last):
    ...
    sbp.values.errors.ShapeError: coord None is not in a mesh of shape (2,) (a coord is a tuple of 1 int, one per axis)
    """


class PlanError(SbpError):
    """A redistribution cannot be planned (e.g. an unreachable state), or a planner argument is invalid.

    >>> import sbp
    >>> sbp.plan((4,), (2,), "S(0)", "B", 0)
    Traceback (most recent call last):
    ...
    sbp.values.errors.PlanError: itemsize must be a positive int (bytes per element), got 0
    """


class CommError(SbpError):
    """A collective failed or timed out; names the collective and the mesh axes.

    >>> import sbp, sbp.testing, torch
    >>> def stall(mesh):                   # rank 1 never joins rank 0's all_reduce
    ...     if mesh.rank == 0:
    ...         mesh.binding.all_reduce(torch.ones(1), (0,), "sum")
    >>> sbp.testing.spmd(stall, (2,), timeout=0.1)
    Traceback (most recent call last):
    ...
    sbp.testing.spmd.SpmdError: rank 0 of 2 raised CommError: all_reduce(sum) on axes (0,) timed out after 0.1 s on rank 0: group [0, 1] is waiting for ranks [1] (call #0 on this group)
    """


class RankMismatchError(SbpError):
    """Ranks passed different values (placements, shapes, dtypes) to the same call.

    >>> import sbp, sbp.testing, torch
    >>> sbp.testing.spmd(lambda mesh: sbp.from_local(torch.ones(2), mesh, ("S(0)", "B")[mesh.rank]), (2,))
    Traceback (most recent call last):
    ...
    sbp.testing.spmd.SpmdError: rank 0 of 2 raised RankMismatchError: from_local: ranks disagree on placements (every rank must pass the same; SPMD): (S(0),) on ranks [0]; (B,) on ranks [1]
    """


class CheckpointError(SbpError):
    """A checkpoint is corrupt or does not match the state it is loaded into, or its path is not a path.

    >>> import sbp, torch
    >>> sbp.save({"a": torch.ones(1)}, 5)
    Traceback (most recent call last):
    ...
    sbp.values.errors.CheckpointError: save: path must be a str or os.PathLike naming the checkpoint directory, got int (5)
    """


class UnsupportedOpError(SbpError):
    """An operator has no sharding rule and `sbp.strict()` is active.

    >>> import sbp, sbp.testing, torch
    >>> def fn(mesh):
    ...     with sbp.strict():
    ...         return torch.kthvalue(sbp.distribute(torch.arange(8.0), mesh, "S(0)"), 1, 0)
    >>> sbp.testing.spmd(fn, (2,))
    Traceback (most recent call last):
    ...
    sbp.testing.spmd.SpmdError: rank 0 of 2 raised UnsupportedOpError: sbp.strict(): no sharding rule for aten.kthvalue.default (input placements: (S(0),)); add a rule (docs/operators.md) or leave strict() to run it on Broadcast inputs
    """


class DTypeError(SbpError):
    """A dtype is not a torch dtype, is not supported by a call, or cannot hold a value (never truncated).

    >>> import sbp, torch
    >>> sbp.full((2,), 300, dtype=torch.uint8)
    Traceback (most recent call last):
    ...
    sbp.values.errors.DTypeError: full: fill_value 300 cannot be represented as torch.uint8 (out of range 0..255); pass a value the dtype holds exactly or another dtype
    """


# ---- errors torch raises too: the same sbp class, also an instance of torch's builtin class ---------------
_TORCH_CLASSES = (IndexError, RuntimeError)
_ALIKE: dict = {}


def torch_alike(kind: type, message: str, torch_error: "BaseException | type") -> SbpError:
    """``kind(message)`` that is also an instance of the builtin class torch raises for the same input
    (`IndexError` for an index out of range, `RuntimeError` for sizes that do not fit): code written for
    plain tensors or DTensor (``except IndexError``) catches sbp's error too, and ``except sbp.ShapeError``
    still does. The class keeps `kind`'s name (tracebacks read ``ShapeError``); it pickles (`sbp.testing`
    sends errors between processes). Any other `torch_error` gives a plain ``kind(message)``.

    >>> e = torch_alike(ShapeError, "x[7] on global shape (4,): index 7 is out of bounds", IndexError("..."))
    >>> isinstance(e, ShapeError), isinstance(e, IndexError), type(e).__name__
    (True, True, 'ShapeError')
    >>> import pickle
    >>> isinstance(pickle.loads(pickle.dumps(e)), IndexError)
    True
    """
    torch_class = torch_error if isinstance(torch_error, type) else type(torch_error)
    base = next((c for c in _TORCH_CLASSES if issubclass(torch_class, c)), None)
    if base is None or issubclass(kind, base):
        return kind(message)
    cls = _ALIKE.get((kind, base))
    if cls is None:
        cls = type(kind.__name__, (kind, base), {
            "__module__": kind.__module__, "__qualname__": kind.__qualname__, "__reduce__": _reduce_alike,
            "__doc__": f"{kind.__name__} that is also the {base.__name__} torch raises for the same input."})
        _ALIKE[(kind, base)] = cls
    return cls(message)


def _reduce_alike(self: SbpError) -> tuple:
    kind, base = type(self).__bases__
    return _rebuild_alike, (kind, base, self.args), self.__dict__ or None


def _rebuild_alike(kind: type, base: type, args: tuple) -> SbpError:
    return torch_alike(kind, args[0], base) if len(args) == 1 else kind(*args)
