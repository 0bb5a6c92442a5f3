"""Running a decision: lay the inputs out, run the rule's local computation, wrap the local results.

A `Decision` is made once per cache key (`sbp.ops.decide.decide`) and executed for every call with that
key. The common case -- nothing to move, nothing written, one output, the op itself runs locally --
takes a short path. In-place results computed in another layout are written back into the original's
layout; a view whose local tensor could not alias its base is flagged, and writing into it raises
instead of silently missing the base.
"""
from __future__ import annotations

import itertools
import sys
import warnings
from typing import Any, Optional

import torch

from ..values.errors import SbpError, UnsupportedOpError
from ..values.mesh import DeviceMesh
from ..tensor.global_tensor import FallbackWarning, GlobalTensor, contiguous_strides, empty_outside, local_from_full, redistribute_raw
from .spec import B, Call, Choice, OpSpec, default_run
from .strict import _STRICT

CACHE_SIZE = 8192   # spec tokens (and decisions, see sbp.ops.dispatch) kept before a table is cleared


# ---- spec tokens: what a global tensor contributes to a cache key ---------------------------------------
# A global tensor's part of the key is a token object standing for (placements, global shape, dtype,
# mesh shape), cached on the tensor (with the placements and mesh objects it was computed for) so that a
# call's key hashes by identity instead of hashing placement dataclasses; outputs of ops get theirs from
# the decision that made them. Tokens are unique objects (never equal to a scalar argument), and a
# token is never reused for another spec, so clearing the table can only cost a recomputation.
class _SpecToken:
    __slots__ = ("spec",)

    def __init__(self, spec: tuple) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"<spec {self.spec}>"


_SPEC_TOKENS: dict[tuple, _SpecToken] = {}


def spec_token(placements: tuple, shape: tuple, dtype: torch.dtype, mesh_shape: tuple) -> _SpecToken:
    """The token standing for one global tensor spec in cache keys (the same object for equal specs).

    >>> from sbp import S
    >>> spec_token((S(0),), (4, 4), torch.float32, (2,)) is spec_token((S(0),), (4, 4), torch.float32, (2,))
    True
    """
    key = (placements, tuple(shape), dtype, mesh_shape)
    found = _SPEC_TOKENS.get(key)
    if found is None:
        if len(_SPEC_TOKENS) >= CACHE_SIZE:
            _SPEC_TOKENS.clear()
        found = _SPEC_TOKENS[key] = _SpecToken(key)
    return found


def _paths(args: tuple, kwargs: dict) -> list[tuple]:
    """Where each tensor sits: (position,) / (position, index) in args, or (name,) / (name, index)."""
    out = []
    for where, value in itertools.chain(enumerate(args), kwargs.items()):
        if isinstance(value, torch.Tensor):
            out.append((where,))
        elif isinstance(value, (list, tuple)):
            out.extend((where, j) for j, v in enumerate(value) if isinstance(v, torch.Tensor))
    return out


def _substitute(args: tuple, kwargs: dict, paths: list[tuple], locals_: list) -> tuple[list, dict]:
    largs, lkwargs = list(args), dict(kwargs) if kwargs else {}
    copied: set = set()
    for path, local in zip(paths, locals_):
        where = path[0]
        target = largs if isinstance(where, int) else lkwargs
        if len(path) == 1:
            target[where] = local
        else:
            if where not in copied:
                target[where] = list(target[where])
                copied.add(where)
            target[where][path[1]] = local
    return largs, lkwargs


def _user_stacklevel() -> int:
    """The `warnings.warn` stacklevel, from its caller, of the first frame outside sbp: the user's line
    (an op may be reached through sbp frames such as `GlobalTensor.__getitem__`)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "sbp":
        frame, level = frame.f_back, level + 1
    return level


# ---- decisions -----------------------------------------------------------------------------------------
class Decision:
    """How to run one (op, input specs): input targets, output placements and shapes, the local run.

    Made once per cache key by `decide`; `execute` runs it for a call with those specs."""

    __slots__ = ("spec", "choice", "targets", "run", "paths", "out_shapes", "out_strides", "out_keys", "aliases",
                 "writes", "fallback", "warned", "first", "fast", "view")

    def __init__(self, spec: OpSpec, choice: Choice, run, paths: list[tuple], writes: list[tuple[int, Optional[int]]],
                 fallback: bool = False) -> None:
        self.spec = spec
        self.choice = choice
        self.run = run
        self.paths = paths
        self.writes = writes          # (input index, output slot or None) for every input the op writes
        self.aliases = {k: i for i, k in writes if k is not None}
        self.fallback = fallback
        self.warned = False
        self.first = next(i for i, m in enumerate(spec.inputs) if m.is_global)
        # None where the input is used as it is (a plain tensor counts as Broadcast)
        self.targets = tuple(None if tgt == meta.placements else tgt
                             for tgt, meta in zip(choice.inputs, spec.inputs))
        self.out_shapes = [None if o is None else o.shape for o in spec.outputs]
        self.out_strides = [None if o is None else contiguous_strides(o.shape) for o in spec.outputs]
        # a factory's output may be made a leaf that requires grad (zeros_like(x, requires_grad=True)):
        # its key is left to its first op, which also gives it the leaf rule (`sbp.ops.dispatch`)
        factory = spec.func._schema.name.split("::")[-1] in FACTORIES
        self.out_keys = [None if o is None or k in self.aliases or factory else
                         spec_token(choice.outputs[k], o.shape, o.dtype, spec.mesh_shape)
                         for k, o in enumerate(spec.outputs)]
        # the common case: nothing moves, nothing is written, one output, the op itself runs locally
        returns = spec.func._schema.returns
        self.view = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        self.fast = (not fallback and not writes and run is default_run and len(spec.outputs) == 1
                     and len(returns) == 1 and str(returns[0].type) == "Tensor" and all(t is None for t in self.targets)
                     and all(len(p) == 1 and isinstance(p[0], int) for p in paths))

    def execute(self, func, args: tuple, kwargs: dict, leaves: list) -> Any:
        mesh = leaves[self.first]._mesh
        if self.fast:
            largs = list(args)
            for (pos,), t in zip(self.paths, leaves):
                if isinstance(t, GlobalTensor):
                    if t._mesh is not mesh and t._mesh != mesh:
                        _mixed(func, mesh, t)
                    largs[pos] = t._local
            if _coord(mesh) is None:
                return self._wrap_outside(mesh, leaves)
            out = self._new(0, func(*largs, **kwargs), mesh)
            if self.view:
                d = out.__dict__
                d["_sbp_view"] = (func, args, kwargs, None)   # its logical strides, worked out if asked
                if leaves[0].__dict__.get("_sbp_detached"):
                    d["_sbp_detached"] = True   # a view of a detached view is detached too
            return out
        if self.fallback:
            self._complain()
        for i, _ in self.writes:
            if leaves[i].__dict__.get("_sbp_detached"):
                raise SbpError(f"{func} writes into a view of a global tensor that could not stay a view of its "
                               f"base's local block (the base was laid out anew for the view: placements "
                               f"{self.spec.inputs[i].placements}); the write would not reach the base. "
                               f"Write into the base, or .clone() the view first")
        coord = _coord(mesh)
        locals_ = []
        for t, target in zip(leaves, self.targets):
            if isinstance(t, GlobalTensor):
                if t._mesh is not mesh and t._mesh != mesh:
                    _mixed(func, mesh, t)
                locals_.append(t._local if target is None else redistribute_raw(t, target)._local)
            else:
                locals_.append(t if target is None or coord is None else local_from_full(t, mesh, target))
        if coord is None and self.spec.outputs:  # outside the mesh: empty tensors, nothing to compute
            return self._wrap_outside(mesh, leaves)
        largs, lkwargs = _substitute(args, kwargs, self.paths, locals_)
        result = self.run(Call(func, largs, lkwargs, self.spec, self.choice, mesh, coord))
        for i, k in self.writes:
            self._write_back(i, k, leaves, locals_, mesh)
        out = self._wrap(result, mesh, leaves)
        if self.view:
            _mark_detached(out, leaves[0])
            _note_views(out, func, args, kwargs)
        return out

    def _new(self, k: int, local: torch.Tensor, mesh: DeviceMesh) -> GlobalTensor:
        pls = self.choice.outputs[k]
        out = _wrap_global(local, mesh, pls, self.out_shapes[k], self.out_strides[k])
        if self.out_keys[k] is not None:
            out.__dict__["_sbp_key"] = (pls, mesh, self.out_keys[k])
        return out

    def _complain(self) -> None:
        pls = ", ".join(repr(m.placements) if m.is_global else "plain" for m in self.spec.inputs)
        if _STRICT.get():
            raise UnsupportedOpError(
                f"sbp.strict(): no sharding rule for {self.spec.func} (input placements: {pls}); "
                f"add a rule (docs/operators.md) or leave strict() to run it on Broadcast inputs")
        if not self.warned:
            self.warned = True
            warnings.warn(f"sbp: no sharding rule for {self.spec.func} with input placements {pls}; it ran on "
                          f"Broadcast (full) inputs. sbp.strict() makes this an error.", FallbackWarning,
                          stacklevel=_user_stacklevel())

    def _write_back(self, i: int, k: Optional[int], leaves: list, locals_: list, mesh: DeviceMesh) -> None:
        """An input the op wrote: if it was computed in another layout, copy the result into the original."""
        layout = self.choice.outputs[k] if k is not None and k < len(self.choice.outputs) else self.choice.inputs[i]
        original = leaves[i]
        current = self.spec.inputs[i].placements
        if self.targets[i] is None and layout == current:
            return  # written in place, in its own layout
        result = GlobalTensor(locals_[i], mesh, layout, self.spec.inputs[i].shape)
        if isinstance(original, GlobalTensor):
            original._local.copy_(redistribute_raw(result, current)._local)
        else:
            original.copy_(redistribute_raw(result, (B,) * mesh.ndim)._local)

    def _wrap(self, result: Any, mesh: DeviceMesh, leaves: list) -> Any:
        if isinstance(result, torch.Tensor):
            return self._wrap_one(0, result, mesh, leaves)
        if isinstance(result, (tuple, list)):
            out = [self._wrap_one(k, r, mesh, leaves) if isinstance(r, torch.Tensor) else r
                   for k, r in enumerate(result)]
            return tuple(out) if isinstance(result, tuple) else out
        return result

    def _wrap_one(self, k: int, local: torch.Tensor, mesh: DeviceMesh, leaves: list) -> Any:
        source = self.aliases.get(k)
        if source is not None:
            return leaves[source]
        if k < len(self.out_shapes) and self.out_shapes[k] is not None:
            return self._new(k, local, mesh)
        return GlobalTensor(local, mesh, (B,) * mesh.ndim, tuple(local.shape))   # shape from the local result

    def _wrap_outside(self, mesh: DeviceMesh, leaves: list) -> Any:
        device = next(t.device for t in leaves if isinstance(t, GlobalTensor))
        outs = []
        for k, meta in enumerate(self.spec.outputs):
            if meta is None:
                outs.append(None)
            elif k in self.aliases:
                outs.append(leaves[self.aliases[k]])
            else:
                outs.append(GlobalTensor(empty_outside(meta.ndim, meta.dtype, device), mesh,
                                         self.choice.outputs[k], meta.shape))
        returns = self.spec.func._schema.returns
        if len(returns) == 1 and str(returns[0].type) == "Tensor":
            return outs[0]
        return outs if len(returns) == 1 else tuple(outs)


def _note_views(out: Any, func, args: tuple, kwargs: dict) -> None:
    """Record how each global output of a view op was made (`sbp.tensor.global_tensor.logical_strides` replays it)."""
    many = isinstance(out, (list, tuple))
    for k, t in enumerate(out if many else [out]):
        if isinstance(t, GlobalTensor) and t is not args[0]:
            t.__dict__["_sbp_view"] = (func, args, kwargs, k if many else None)


FACTORIES = frozenset(("zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
                       "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided"))


def _mark_detached(out: Any, base: Any) -> None:
    """Flag view outputs whose local tensor does not alias the base's (redistributed or copied first):
    an in-place op on them would not reach the base, so `execute` refuses it."""
    if not isinstance(base, GlobalTensor):
        return
    detached = base.__dict__.get("_sbp_detached", False)
    ptr = base._local.untyped_storage().data_ptr()
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(t, GlobalTensor) and t is not base and (
                detached or (t._local.numel() and t._local.untyped_storage().data_ptr() != ptr)):
            t.__dict__["_sbp_detached"] = True


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


def _wrap_by_constructor(local, mesh, pls, shape, strides) -> GlobalTensor:
    return GlobalTensor(local, mesh, pls, shape)


def _wrap_direct(local, mesh, pls, shape, strides) -> GlobalTensor:
    """`GlobalTensor(local, mesh, pls, shape)` with the strides computed once per decision, not per call
    (and not passed at all for a strided local: the wrapper's default strides are the contiguous ones)."""
    if local.layout is _STRIDED:
        out = _make_wrapper(GlobalTensor, shape, dtype=local.dtype, device=local.device)
    else:
        out = _make_wrapper(GlobalTensor, shape, strides=strides, dtype=local.dtype, device=local.device,
                            layout=local.layout)
    d = out.__dict__
    d["_local"] = local
    d["_mesh"] = mesh
    d["_placements"] = pls
    return out


def _pick_wrapper():
    """Use `_wrap_direct` only while it builds exactly what the GlobalTensor constructor builds."""
    local, mesh, pls = torch.zeros(2, 3), DeviceMesh((1,)), (B,)
    want, got = GlobalTensor(local, mesh, pls, (2, 3)), _wrap_direct(local, mesh, pls, (2, 3), contiguous_strides((2, 3)))
    same = (vars(want).keys() == vars(got).keys() and want.stride() == got.stride()
            and want.requires_grad == got.requires_grad and type(want) is type(got))
    return _wrap_direct if same else _wrap_by_constructor


def _mixed(func, mesh: DeviceMesh, t: GlobalTensor) -> None:
    raise SbpError(f"{func} mixes global tensors on different meshes ({mesh!r} and {t._mesh!r}); "
                   f"redistribute them onto one mesh first")


def _coord(mesh: DeviceMesh) -> Optional[tuple[int, ...]]:
    binding = mesh.binding
    coord = getattr(binding, "coord", _MISSING)
    return mesh.coord if coord is _MISSING else coord


_MISSING = object()


_wrap_global = _pick_wrapper()
