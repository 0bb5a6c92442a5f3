"""The op handler: key the call, look up (or make) its decision, run it -- the one op path of sbp.

For every ATen op on a `GlobalTensor`, `handle` builds a cache key from the op and its inputs' (placements,
global shape, dtype, mesh shape) -- as one token per tensor, see `tensor_key` and
`sbp.ops.cache.SPEC_TOKENS` -- plus the non-tensor arguments (a non-zero float only by type, so a changing
learning rate reuses the decision; 0.0 and bools kept apart because they promote dtypes differently). A hit
in `sbp.ops.cache.DECISIONS` runs the decision; a miss looks the op up in the rule table: a composite rule
(``_foreach_*``, in-place views) runs the call itself (a ``_foreach_*`` call with autograd off goes there
before any keying: the optimizer's lists are keyed by their parts only when they do not line up), any other
rule -- or none, the fallback -- makes the decision once (`sbp.ops.decide.decide`: rule signatures, planner
prices, cheapest wins). A plain tensor that requires grad gets a hook that turns the global gradient the
rules produce into the plain full gradient (DESIGN: a plain tensor mixed in is Broadcast); which plain
tensors have it is kept in `PLAIN_GRAD_HOOKED`, a weak identity map (nothing is written into the tensor). A
global leaf that requires grad without the leaf rule (``torch.zeros_like(x, requires_grad=True)``: torch
sets the flag in C++, past `GlobalTensor.requires_grad_`) gets it at its first op, when its key is first
made (factories leave their outputs' keys unmade for this).
"""
from __future__ import annotations

import math
from bisect import bisect_left
from functools import lru_cache
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..runtime.symbolic import hint, is_symbolic
from ..tensor.global_tensor import GlobalTensor, ensure_leaf_rule, redistribute_raw
from . import table as rules
from .apply import refuse_mixed_meshes
from .cache import DECISIONS, SPEC_TOKENS, SpecToken
from .decide import SIZE_ARGS, Decision, DecisionClass, decide, size_arguments
from .spec import FLOAT, B
from .symbolic import handle_symbolic, has_symbolic

PLAIN_GRAD_HOOKED = WeakIdKeyDictionary()   # plain tensor -> True once it has the plain-gradient hook
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction   # decisions are pure: no torch function mode sees them
_grad_enabled = torch.is_grad_enabled


# ---- the cache key -------------------------------------------------------------------------------------
def tensor_key(a: GlobalTensor) -> SpecToken:
    """The part of a call's cache key that stands for global tensor `a`: its spec token, remembered in
    ``a._key`` while `a`'s placements and mesh stay the same objects.

    >>> import sbp
    >>> x = GlobalTensor(torch.ones(4), sbp.DeviceMesh((2,)), (sbp.S(0),), (8,))
    >>> tensor_key(x).spec, tensor_key(x) is tensor_key(GlobalTensor(torch.ones(4), x.mesh, (sbp.S(0),), (8,)))
    (((S(0),), (8,), torch.float32, (2,)), True)
    """
    d = a.__dict__   # one lookup, then plain dict reads (hot: every op call keys its tensors)
    cached = d["_key"]
    if cached is not None and cached[0] is d["_placements"] and cached[1] is d["_mesh"]:
        return cached[2]
    found = SPEC_TOKENS.token(a._placements, a.shape, a.dtype, a._mesh.shape)
    d["_key"] = (a._placements, a._mesh, found)
    ensure_leaf_rule(a)   # e.g. zeros_like(x, requires_grad=True): its first op makes its key
    return found


def _key_of(a: Any, leaves: list) -> Any:
    if isinstance(a, torch.Tensor):
        leaves.append(a)
        if isinstance(a, GlobalTensor):
            return tensor_key(a)
        if a.requires_grad and a not in PLAIN_GRAD_HOOKED:
            _plain_grad_hook(a)
        return (a.shape, a.dtype)
    t = type(a)
    if t is float:   # by type only (a learning rate must not miss the cache), but 0.0, inf and nan are special
        return float_key(a)
    if t is bool:    # True == 1 and 0.0 == 0 hash alike, but promote dtypes differently: keep them apart
        return _TRUE if a else _FALSE
    if t is list or t is tuple:
        return tuple([_key_of(x, leaves) for x in a])
    if t is torch.SymFloat or t is torch.SymBool:
        raise TypeError(_SYMBOLIC_SCALAR)
    return a


_FLOAT_ZERO, _TRUE, _FALSE = object(), object(), object()
# torch.compile passes a Python float argument that changes between calls as a SymFloat: it must not key a
# cache (comparing two of them builds a symbolic expression, in a trace the other one may not belong to)
_SYMBOLIC_SCALAR = "a symbolic float or bool (torch.compile) keys no cached decision"


def _collect(a: Any, leaves: list) -> None:
    """The tensors of `a` into `leaves` in `_key_of`'s order, keying nothing (a key may not hash)."""
    if isinstance(a, torch.Tensor):
        leaves.append(a)
        if isinstance(a, GlobalTensor):
            ensure_leaf_rule(a)
        elif a.requires_grad and a not in PLAIN_GRAD_HOOKED:
            _plain_grad_hook(a)
    elif type(a) is list or type(a) is tuple:
        for x in a:
            _collect(x, leaves)


def float_key(value: float) -> Any:
    """A float's part of a cache key: one token for every finite non-zero value (rules see `FLOAT`), its
    own for 0.0 (a Partial may absorb a scalar zero) and the value itself for inf and nan (no Partial
    passes through them).

    >>> float_key(0.5) is float_key(2.0), float_key(0.0) is float_key(-0.0), float_key(float("inf"))
    (True, True, inf)
    """
    if value == 0:
        return _FLOAT_ZERO
    return FLOAT if value - value == 0 else value


# ---- shape classes -----------------------------------------------------------------------------------------
def class_key(func, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...]) -> tuple[tuple, list[int]]:
    """A call's shape-class key and its symbols' values: every size above the mesh's rank count `m` (of a
    tensor, or in a size argument) becomes a symbol, numbered by first appearance and kept with its
    remainder mod `m` (which splits divide it evenly); equal sizes share a symbol, smaller sizes stay.
    The key ends with the symbols' order among themselves and against the other int arguments above `m`
    (`_order`): an output size may be the smaller of two (``x[:, :512]`` clamps at 512 the rows above it,
    not those below), so a class fixes which is larger.
    A symbolic size (``torch.SymInt`` under torch.compile, `sbp.ops.symbolic`) is a symbol of its own (one
    per expression, its remainder its hint's, ordered by its hint), and its value is the SymInt itself.
    Raises TypeError for an unhashable argument (like the exact key).

    >>> import sbp
    >>> x = GlobalTensor(torch.zeros(8, 50, 64), sbp.DeviceMesh((2,)), (sbp.B,), (8, 50, 64))
    >>> key, values = class_key(torch.ops.aten.view.default, (x, [400, 64]), {}, (2,))
    >>> key[2][2], key[3], values
    (((0, 0), (1, 0), (2, 0)), ((3, 0), (2, 0)), [8, 50, 64, 400])
    """
    m = math.prod(mesh_shape)
    symbols: dict[int, int] = {}
    values: list[int] = []
    hints: list[int] = []    # the symbols' values as ints
    bounds: list[int] = []   # the other int arguments above m, by magnitude

    def size(n: Any) -> Any:
        ident = value = n
        if type(n) is not int:
            if is_symbolic(n):   # a symbol whatever its hint
                ident, n = ("symbolic", n.node.expr), hint(n)
            else:
                ident = value = n = int(n)   # a SymInt pinned to a constant
        if n <= m and type(ident) is int:
            return n
        i = symbols.get(ident)
        if i is None:
            i = symbols[ident] = len(values)
            values.append(value)
            hints.append(n)
        return i, n % m

    def pattern(a: Any, sizes: bool) -> Any:
        if isinstance(a, torch.Tensor):
            shape = tuple(map(size, a.shape))
            return (a._placements, a.dtype, shape) if isinstance(a, GlobalTensor) else (a.dtype, shape)
        t = type(a)
        if (t is int or t is torch.SymInt) and sizes:
            return size(a)
        if t is int:
            if a > m or a < -m:
                bounds.append(abs(a))
            return a
        if t is torch.SymInt:   # a symbolic value that is no size
            return ("symbolic", a.node.expr)
        if t is float:
            return float_key(a)
        if t is bool:
            return _TRUE if a else _FALSE
        if t is list or t is tuple:
            return tuple([pattern(x, sizes) for x in a])
        if t is torch.SymFloat or t is torch.SymBool:
            raise TypeError(_SYMBOLIC_SCALAR)
        return a

    sized = _size_positions(func)
    key = [func, tuple(mesh_shape)]
    key += [pattern(a, i in sized) for i, a in enumerate(args)]
    key += [(k, pattern(v, k in SIZE_ARGS)) for k, v in kwargs.items()]
    if len(hints) > 1 or (hints and bounds):
        key.append(("order", _order(hints, bounds)))
    out = tuple(key)
    hash(out)
    return out, values


def _order(sizes: list[int], bounds: list[int]) -> tuple[int, ...]:
    """Where each size falls among `sizes` and `bounds`: twice the number of them below it, plus one where it
    equals a bound. Calls with the same bounds (a class's int arguments are exact) and the same result order
    their sizes and bounds alike.

    >>> _order([5, 13], [9]), _order([13, 17], [9]), _order([9, 13], [9])
    ((0, 4), (2, 4), (1, 2))
    """
    ranked = sorted({*sizes, *bounds})
    below = set(bounds)
    return tuple(2 * bisect_left(ranked, n) + (n in below) for n in sizes)


@lru_cache(maxsize=1024)
def _size_positions(func) -> frozenset[int]:
    """Positions of `func`'s size arguments (`SIZE_ARGS`) in its schema."""
    return frozenset(i for i, _ in size_arguments(func))


def decide_by_class(func, args: tuple, kwargs: dict, leaves: list, mesh) -> Decision:
    """`decide`, through the call's shape class (`class_key`): a generic class (`DecisionClass`) makes the
    decision from its first one; otherwise decide cold, and remember or confirm the class with it.

    >>> import sbp
    >>> mesh = sbp.DeviceMesh((2,))
    >>> def neg(n):
    ...     x = GlobalTensor(torch.zeros(n // 2, 8), mesh, (sbp.S(0),), (n, 8))
    ...     return decide_by_class(torch.ops.aten.neg.default, (x,), {}, [x], mesh)
    >>> DECISIONS.clear(); _ = neg(10), neg(12)              # 10 and 12: two cold decisions, class confirmed
    >>> d = neg(14)                                          # made from the class: no meta kernel
    >>> d.spec.outputs[0].shape, d.choice.outputs
    ((14, 8), ((S(0),),))
    """
    try:
        key, values = class_key(func, args, kwargs, tuple(mesh.shape))
    except TypeError:
        return decide(func, args, kwargs, leaves, mesh)
    record = DECISIONS.class_get(key)
    if record is not None and record.state in ("generic", "priced"):
        return record.instantiate(func, args, kwargs, leaves, mesh, values)
    decision = decide(func, args, kwargs, leaves, mesh)
    if record is None:
        DECISIONS.class_put(key, DecisionClass(decision, values))
    else:
        record.confirm(decision, values, (args, kwargs))
    return decision


def _plain_grad_hook(t: torch.Tensor) -> None:
    """A plain tensor mixed into an op is Broadcast, so its gradient is the full gradient, as a plain
    tensor equal on every rank (DESIGN: Autograd): convert the global gradient the rules produce (with
    `full`, differentiably, in a create_graph backward: a gradient penalty on the plain tensor)."""
    def to_plain(grad: torch.Tensor) -> Optional[torch.Tensor]:
        if isinstance(grad, GlobalTensor):
            if _grad_enabled() and grad.requires_grad:   # create_graph: differentiable again (double backward)
                return grad.full()
            return redistribute_raw(grad, (B,) * grad._mesh.ndim)._local
        return None

    t.register_hook(to_plain)
    PLAIN_GRAD_HOOKED[t] = True


@lru_cache(maxsize=None)
def _has_decomposition(func) -> bool:
    """Whether `func` has a CompositeImplicitAutograd kernel: torch decomposes it at the autograd keys, above
    `GlobalTensor.__torch_dispatch__`, except where those keys are skipped (``torch.inference_mode()``)."""
    try:
        key = torch._C.DispatchKey.CompositeImplicitAutograd
        return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key)
    except (AttributeError, RuntimeError):   # not an OpOverload
        return False


# ---- the handler ---------------------------------------------------------------------------------------------
def handle(func, args: tuple, kwargs: dict) -> Any:
    """The op handler installed with `sbp.tensor.global_tensor.set_op_handler`: look up (or make) the decision, run it.

    `GlobalTensor.__torch_dispatch__` calls it for every ATen op; users call ops, not this.

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.ones(4, 2), mesh, "S(0)")
    ...     y = handle(torch.ops.aten.sum.default, (x,), {})          # what x.sum() does
    ...     return y.placements, y.full().item()
    >>> sbp.testing.spmd(fn, (2,))
    [((P(sum),), 8.0), ((P(sum),), 8.0)]
    """
    if args and type(args[0]) is list and not _grad_enabled():   # a list-taking op (``_foreach_*``), no autograd
        rule = rules.lookup(func)
        if rule is not None and rule.composite is not None:   # its parts are keyed (and cached) one by one:
            out = rule.composite(func, args, kwargs)         # keying the whole lists first would be wasted
            if out is not NotImplemented:
                return out
    leaves: list = []
    try:
        key = [func]
        for a in args:
            if isinstance(a, GlobalTensor):
                leaves.append(a)
                key.append(tensor_key(a))
            else:
                key.append(_key_of(a, leaves))
        if kwargs:
            key.append(tuple([(k, _key_of(v, leaves)) for k, v in kwargs.items()]))
        key = tuple(key)
        decision = DECISIONS.get(key)
    except TypeError:  # an unhashable argument (e.g. a generator, a symbolic size): decide without caching
        key, decision = None, None
        leaves = []
        _collect(args, leaves), _collect(tuple(kwargs.values()), leaves)
        if has_symbolic(args, kwargs, leaves, pinned=True):   # torch.compile with dynamic shapes
            mesh = next(t._mesh for t in leaves if isinstance(t, GlobalTensor))
            with _NO_TORCH_FUNCTION():
                return handle_symbolic(func, args, kwargs, leaves, mesh, class_key)
    if decision is not None:
        return decision.execute(func, args, kwargs, leaves)
    mesh = next((t._mesh for t in leaves if isinstance(t, GlobalTensor)), None)
    if mesh is None:   # torch calls GlobalTensor.__torch_dispatch__ only with a global tensor among the arguments
        raise TypeError(f"sbp.ops.dispatch.handle: {func} was called without a GlobalTensor argument")
    rule = rules.lookup(func)
    if rule is not None and rule.composite is not None:   # its parts are dispatched (and cached) one by one
        out = rule.composite(func, args, kwargs)
        if out is not NotImplemented:
            return out
    if rule is None and _has_decomposition(func):   # a composite op that reached dispatch whole (``aten.linear``
        out = func.decompose(*args, **kwargs)      # under inference_mode): its parts have rules
        if out is not NotImplemented:
            return out
    for t in leaves:   # before deciding: placements are read against the first tensor's mesh
        if isinstance(t, GlobalTensor) and t._mesh is not mesh and t._mesh != mesh:
            refuse_mixed_meshes(func, mesh, t)
    # thread-ranks of one process share decisions: one decides, the others reuse it. Deciding reads tensor
    # properties (shapes, dtypes) and makes meta tensors: under a torch function mode (`sbp.nn.parallelize`'s
    # `SplitBatchMatmul`, a user's) each of those would call the mode, about doubling a decision's time
    with _NO_TORCH_FUNCTION():
        decision = DECISIONS.decide_once(key, decide_by_class, func, args, kwargs, leaves, mesh)  # no closure
    return decision.execute(func, args, kwargs, leaves)
