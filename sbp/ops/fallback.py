"""The default dispatch of `GlobalTensor`: layout-preserving ops run on the local tensor, the rest falls back.

`sbp.ops` plugs its rule table in front of this (`sbp.tensor.global_tensor.set_op_handler`) and lands here for the ops
it declines. The rules are a table (op -> rule); a rule returns `NotImplemented` when its layout
condition fails, and the op then runs on the full tensors (`fallback`), Broadcast out, with a one-time
`FallbackWarning` naming the op.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..values.errors import SbpError
from ..values.placement import Broadcast, Partial, Placement
from ..tensor.global_tensor import (FallbackWarning, GlobalTensor, full_local, grad_placements, local_from_full, redistribute_raw,
                     sum_holds_value)

aten = torch.ops.aten


def default_dispatch(func, args: tuple, kwargs: dict) -> Any:
    """Layout-preserving ops (detach, alias, clone, `_to_copy`, add, copy_, `*_like`) run on the local
    tensor; every other op runs on full tensors (`fallback`).

    >>> import sbp
    >>> x = GlobalTensor(torch.ones(2, 3), sbp.DeviceMesh((2,)), (sbp.S(0),), (4, 3))
    >>> default_dispatch(aten.detach.default, (x,), {})
    GlobalTensor(shape=(4, 3), placements=(S(0),), mesh=(2,))
    """
    rule = _RULES.get(func)
    if rule is not None:
        out = rule(func, args, kwargs)
        if out is not NotImplemented:
            return out
    return fallback(func, args, kwargs)


def fallback(func, args: tuple, kwargs: dict) -> Any:
    """Run `func` on the full tensors of its GlobalTensor arguments and return Broadcast GlobalTensors.

    Warns once per op (`FallbackWarning`). In-place and out= arguments are written back into their own
    layout, so `x.mul_(2)` still updates `x`'s local tensor.

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.arange(4.), mesh, "S(0)")
    ...     y = fallback(aten.cumsum.default, (x, 0), {})      # warns: FallbackWarning
    ...     return y.placements, y.to_local().tolist()
    >>> with warnings.catch_warnings():                       # warnings are global: filter around spmd
    ...     warnings.simplefilter("ignore", FallbackWarning)
    ...     out = sbp.testing.spmd(fn, (2,))
    >>> out[1]
    ((B,), [0.0, 1.0, 3.0, 6.0])
    """
    flat, spec = tree_flatten((args, kwargs))
    globals_ = [a for a in flat if isinstance(a, GlobalTensor)]
    mesh = globals_[0]._mesh
    for g in globals_:
        if g._mesh != mesh:
            raise SbpError(f"{func} mixes global tensors on different meshes ({mesh!r} and {g._mesh!r}); "
                           f"redistribute them onto one mesh first")
    warnings.warn(f"sbp: no sharding rule for {func}; it ran on the full (Broadcast) tensors", FallbackWarning,
                  stacklevel=1)  # one location: the default filter shows it once per op
    full = [full_local(a) if isinstance(a, GlobalTensor) else a for a in flat]
    fargs, fkwargs = tree_unflatten(full, spec)
    out = func(*fargs, **fkwargs)
    originals = {id(f): g for f, g in zip(full, flat) if isinstance(g, GlobalTensor)}
    for index, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            target = fargs[index] if index < len(fargs) else fkwargs.get(arg.name)
            for t in (target if isinstance(target, (list, tuple)) else [target]):
                g = originals.get(id(t))
                if g is not None:
                    g._local.copy_(local_from_full(t, g._mesh, g._placements))

    def wrap(t):
        if id(t) in originals:
            return originals[id(t)]
        if isinstance(t, torch.Tensor):
            return GlobalTensor(t, mesh, (Broadcast(),) * mesh.ndim, tuple(t.shape))
        return t

    return tree_map(wrap, out)


# ---- the layout-preserving rules of default_dispatch ---------------------------------------------------
def _same_layout(func, args, kwargs):
    """Unary ops that act element-wise on the local tensor and keep the layout."""
    x = args[0]
    local = func(x._local, *args[1:], **kwargs)
    return GlobalTensor(local, x._mesh, x._placements, tuple(x.shape))


def _to_copy(func, args, kwargs):
    x = args[0]
    dtype = kwargs.get("dtype")
    sums = any(isinstance(p, Partial) and p.op == "sum" for p in x._placements)
    if sums and dtype is not None and dtype != x.dtype and not (x.dtype.is_floating_point and dtype.is_floating_point):
        return NotImplemented  # casting P(sum) parts to an integer type would not sum to the cast value
    return _same_layout(func, args, kwargs)


def _add(func, args, kwargs):
    """`a + alpha * b` on locals once both share one layout; gradient accumulation relies on it. A `b` in
    another layout is redistributed to `a`'s (to `b`'s when `a` has `P(min|max)` parts, which do not add)."""
    a, b = args[0], args[1]
    if not (isinstance(a, GlobalTensor) and isinstance(b, GlobalTensor)) or a.shape != b.shape:
        return NotImplemented
    if a._mesh != b._mesh:
        return NotImplemented
    target = a._placements if _adds(a._placements) or func is aten.add_.Tensor else b._placements
    if not _adds(target):
        target = grad_placements(target)
    if func is aten.add_.Tensor and target != a._placements:
        return NotImplemented  # in place keeps a's layout; P(min|max) parts cannot be added to
    la = redistribute_raw(a, target)._local if a._placements != target else a._local
    lb = redistribute_raw(b, target)._local if b._placements != target else b._local
    local = func(la, lb, *args[2:], **kwargs)
    if func is aten.add_.Tensor:
        return a
    return GlobalTensor(local, a._mesh, target, tuple(a.shape))


def _adds(pls: tuple[Placement, ...]) -> bool:
    """Whether adding locals adds the logical values (no `P(min|max)` axis)."""
    return not any(isinstance(p, Partial) and p.op != "sum" for p in pls)


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, GlobalTensor) or tuple(src.shape) != tuple(dst.shape):
        return NotImplemented
    if isinstance(src, GlobalTensor):
        if src._mesh != dst._mesh:
            return NotImplemented
        dst._local.copy_(redistribute_raw(src, dst._placements)._local)
    else:  # a plain tensor is the full value on every rank (Broadcast)
        dst._local.copy_(local_from_full(src, dst._mesh, dst._placements))
    return dst


def _fill_like(value_of: Callable[[tuple], Any]):
    """`*_like` factories: the value sits where `sum_holds_value`, zeros elsewhere (exact for `P(sum)`)."""
    def rule(func, args, kwargs):
        x = args[0]
        value = value_of(args)
        coord = x._mesh.coord
        if coord is not None and not sum_holds_value(x._mesh, x._placements, coord):
            value = 0
        local = aten.full_like.default(x._local, value, **kwargs)
        return GlobalTensor(local, x._mesh, x._placements, tuple(x.shape))
    return rule


_RULES: dict[Any, Callable] = {
    aten.detach.default: _same_layout,
    aten.alias.default: _same_layout,
    aten.clone.default: _same_layout,
    aten.zeros_like.default: _same_layout,
    aten.empty_like.default: _same_layout,
    aten._to_copy.default: _to_copy,
    aten.add.Tensor: _add,
    aten.add_.Tensor: _add,
    aten.copy_.default: _copy_,
    aten.ones_like.default: _fill_like(lambda args: 1),
    aten.full_like.default: _fill_like(lambda args: args[1]),
}
