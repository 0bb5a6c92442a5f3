"""The direct path: Python operators on global tensors that skip torch's dispatcher when nothing on it acts.

``x + y``, ``x @ w`` or ``x.sum()`` on global tensors normally travel through torch's dispatcher --
argument parsing, the autograd layer, the Python dispatch key -- before the op handler
(`sbp.ops.dispatch.handle`) sees ``aten.add.Tensor(x, y)``; that trip costs more than the op on an 8x8
local tensor. When nothing on the way would act -- no tensor autograd must record, no dispatch or
function mode, no autocast (`direct_ok`) -- the methods installed here look up the handler's cached
decision for the call themselves. A decision that runs the op unchanged on the local tensors
(`Decision.fast`: nothing moves, nothing written, one output) runs it with the same torch method on the
locals and wraps the result; everything else (a cache miss, a rule with its own computation, a plain
tensor operand, keyword arguments, a rank outside the mesh) goes to the handler with exactly the call
the dispatcher would have made, or to torch's own method. Same decisions, same results, less overhead
(docs/operators.md, "Dispatch overhead").

The in-place ``add_ sub_ mul_ div_`` (a global tensor or a Python number; ``alpha=`` for ``add_`` and
``sub_``) take it with autograd off -- what an optimizer's per-tensor update runs, three of them per
parameter for SGD with momentum: a decision that writes the first input in its own layout and moves nothing
(`Decision.fast_inplace`) runs the same torch method on the locals and bumps the global tensor's version
counter, as the dispatcher's in-place kernel does; anything else goes torch's own way.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..tensor.global_tensor import GlobalTensor, get_op_handler, note_local_write
from .apply import mesh_coord
from .cache import DECISIONS
from .dispatch import float_key, handle, tensor_key

_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_autocast = torch._C._is_any_autocast_enabled
_decision_of = DECISIONS.get   # the cache's own dict lookup (DECISIONS.clear() empties that same dict)
_bump = torch._C._increment_version   # (a tuple of tensors; inference tensors are left alone)


def direct_ok(*tensors: torch.Tensor) -> bool:
    """Whether an op on these global tensors may skip torch's dispatcher: nothing on its way would act
    (no tensor that autograd must record, no dispatch or function mode, no autocast) and the op handler
    plugged into `GlobalTensor.__torch_dispatch__` is `sbp.ops.dispatch.handle`.

    >>> import sbp; sbp.load_torch_layers()              # installs sbp.ops.dispatch.handle
    >>> x = GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,))
    >>> direct_ok(x), direct_ok(x.requires_grad_())
    (True, False)
    >>> with torch.no_grad():
    ...     direct_ok(x)
    True
    """
    if _grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return False
    return _quiet()


_NOTHING, _MISS = object(), object()


def _direct(op, local_method: Callable, a: GlobalTensor, b: Any) -> Any:
    """``op(a)`` or ``op(a, b)`` for a global `a` and a global or Python-number `b` (`_NOTHING`: unary),
    after `direct_ok`: a cached fast decision runs `local_method` on the locals, another cached decision
    goes to the handler; `_MISS` when the call has no decision yet (the caller knows what to do then)."""
    kind = type(b)
    if kind is GlobalTensor:
        decision = _decision_of((op, tensor_key(a), tensor_key(b)))
    elif b is _NOTHING:
        decision = _decision_of((op, tensor_key(a)))
    else:
        decision = _decision_of((op, tensor_key(a), float_key(b) if kind is float else b))
    if decision is None:
        return _MISS
    mesh = a._mesh
    if not decision.fast or (kind is GlobalTensor and b._mesh is not mesh) or mesh_coord(mesh) is None:
        return handle(op, (a,) if b is _NOTHING else (a, b), {})
    if b is _NOTHING:
        local = local_method(a._local)
    else:
        local = local_method(a._local, b._local if kind is GlobalTensor else b)
    return decision.wrap_output(0, local, mesh)


def _quiet() -> bool:
    """No mode or autocast would act, and `handle` is the plugged-in op handler (`set_op_handler`)."""
    return (not _dispatch_modes() and not _function_modes() and not _autocast()
            and get_op_handler() is handle)


def _binary(name: str, op) -> Callable:
    slow = getattr(torch.Tensor, name)

    def method(self, other, *args, **kwargs):
        if not args and not kwargs:
            kind = type(other)
            if kind is GlobalTensor:
                if (not _grad_enabled() or not (self.requires_grad or other.requires_grad)) and _quiet():
                    out = _direct(op, slow, self, other)
                    return handle(op, (self, other), {}) if out is _MISS else out
            elif (kind is float or kind is int) and (not _grad_enabled() or not self.requires_grad) and _quiet():
                out = _direct(op, slow, self, other)
                return handle(op, (self, other), {}) if out is _MISS else out
        return slow(self, other, *args, **kwargs)   # alpha=, rounding_mode=, plain tensors: torch's own way

    return _named(method, name)


def _inplace(name: str, op) -> Callable:
    slow = getattr(torch.Tensor, name)
    takes_alpha = name in ("add_", "sub_")

    def method(self, other, *args, **kwargs):
        kind = type(other)
        if (not args and not _grad_enabled() and (kind is GlobalTensor or kind is float or kind is int)
                and (not kwargs or (takes_alpha and len(kwargs) == 1 and type(kwargs.get("alpha")) in (float, int)))
                and _quiet() and not self.is_inference()):
            done = _direct_inplace(op, slow, self, other, kwargs.get("alpha", 1))
            if done is not _MISS:
                return done
        return slow(self, other, *args, **kwargs)   # torch's own way (and, on a miss, the decision is made)

    return _named(method, name)


_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)   # sbp.ops.through.own_copies


def _direct_inplace(op, local_method: Callable, a: GlobalTensor, b: Any, alpha: Any) -> Any:
    """``a.op_(b, alpha=alpha)`` with autograd off, by a cached decision that writes `a` in its own layout
    and moves nothing (`Decision.fast_inplace`): the op on the locals, `a`'s version counter bumped as the
    dispatcher's in-place kernel would (saved-tensor checks and `parallelize`'s reuse of a conversion read
    it); `_MISS` for anything else. The key is the one `sbp.ops.dispatch.handle` makes for the dispatcher's
    call, which leaves out an ``alpha`` equal to its default (the int 1)."""
    kind = type(b)
    key_b = tensor_key(b) if kind is GlobalTensor else float_key(b) if kind is float else b
    if type(alpha) is int and alpha == 1:
        decision = _decision_of((op, tensor_key(a), key_b))
    else:
        decision = _decision_of((op, tensor_key(a), key_b, (("alpha", float_key(alpha) if type(alpha) is float
                                                                else alpha),)))
    if decision is None or not decision.fast_inplace:
        return _MISS
    mesh = a._mesh
    notes = a._notes
    if (kind is GlobalTensor and b._mesh is not mesh) or mesh_coord(mesh) is None or (
            notes is not None and (notes.detached or (notes.view is not None and notes.view[0] in _RESHAPES))):
        return _MISS   # the handler's way: mixed meshes, writes into detached views and into reshape's copies
    other = b._local if kind is GlobalTensor else b
    if type(alpha) is int and alpha == 1:
        local_method(a._local, other)
    else:
        local_method(a._local, other, alpha=alpha)
    local = a._local   # the local's counter too, as `note_local_write` (a kept reduction missed `x.data` writes)
    _bump((a, local) if type(local) is torch.Tensor else (a,))
    if notes is not None and notes.view is not None:
        note_local_write(a)   # (and a view's bases)
    return a


def _matmul(name: str) -> Callable:
    slow, mm = getattr(torch.Tensor, name), torch.ops.aten.mm.default

    def method(self, other, *args, **kwargs):
        if (not args and not kwargs and type(other) is GlobalTensor
                and (not _grad_enabled() or not (self.requires_grad or other.requires_grad)) and _quiet()):
            out = _direct(mm, slow, self, other)
            if out is not _MISS:   # a cached mm decision exists only for 2-d operands (its key has the shapes)
                return out
            if self.dim() == 2 and other.dim() == 2:
                return handle(mm, (self, other), {})
        return slow(self, other, *args, **kwargs)

    return _named(method, name)


def _reduction(name: str, op) -> Callable:
    slow = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        if not args and not kwargs and (not _grad_enabled() or not self.requires_grad) and _quiet():
            out = _direct(op, slow, self, _NOTHING)
            return handle(op, (self,), {}) if out is _MISS else out
        return slow(self, *args, **kwargs)

    return _named(method, name)


def _named(method: Callable, name: str) -> Callable:
    method.__name__ = method.__qualname__ = name
    if name.endswith("_"):   # in place
        method.__doc__ = (f"As `torch.Tensor.{name}`; on global tensors with autograd off (an optimizer's step) "
                          f"it skips torch's dispatcher (`sbp.ops.direct`).\n\n"
                          f"Example (every rank, e.g. in ``sbp.testing.spmd(fn, (2,))``)::\n\n"
                          f"    x = sbp.distribute(torch.arange(4.).view(2, 2), mesh, \"S(0)\")\n"
                          f"    with torch.no_grad():\n"
                          f"        x.{name}(2.0)   # x.full() equals torch.arange(4.).view(2, 2).{name}(2.0)\n")
        return method
    call = {"sum": "x.sum()", "mean": "x.mean()", "matmul": "x.matmul(x)", "mm": "x.mm(x)",
            "__matmul__": "x @ x", "__add__": "x + x", "__sub__": "x - x", "__mul__": "x * x",
            "__truediv__": "x / x"}.get(name, f"x.{name}(x)")
    method.__doc__ = (f"As `torch.Tensor.{name}`; on global tensors that autograd need not record it skips "
                      f"torch's dispatcher (`sbp.ops.direct`).\n\n"
                      f"Example (every rank, e.g. in ``sbp.testing.spmd(fn, (2,))``)::\n\n"
                      f"    x = sbp.distribute(torch.arange(4.).view(2, 2), mesh, \"S(0)\")\n"
                      f"    ({call}).full()   # equals the same op on torch.arange(4.).view(2, 2)\n")
    return method


def install() -> None:
    """Install the direct-path methods on `GlobalTensor` (importing `sbp.ops` does it once).

    >>> install()
    >>> GlobalTensor.__add__.__doc__.startswith("As `torch.Tensor.__add__`")
    True
    """
    aten = torch.ops.aten
    for name, op in (("__add__", aten.add.Tensor), ("add", aten.add.Tensor), ("__sub__", aten.sub.Tensor),
                     ("sub", aten.sub.Tensor), ("__mul__", aten.mul.Tensor), ("mul", aten.mul.Tensor),
                     ("__truediv__", aten.div.Tensor), ("div", aten.div.Tensor)):
        setattr(GlobalTensor, name, _binary(name, op))
    for name, op in (("add_", aten.add_.Tensor), ("sub_", aten.sub_.Tensor), ("mul_", aten.mul_.Tensor),
                     ("div_", aten.div_.Tensor)):
        setattr(GlobalTensor, name, _inplace(name, op))
    for name in ("__matmul__", "matmul", "mm"):
        setattr(GlobalTensor, name, _matmul(name))
    for name, op in (("sum", aten.sum.default), ("mean", aten.mean.default)):
        setattr(GlobalTensor, name, _reduction(name, op))
