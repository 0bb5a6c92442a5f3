"""`_foreach_*` ops (what torch.optim runs with ``foreach=True``): the pointwise rule, index by index.

``_foreach_op(lists..., scalars...)`` is the pointwise op ``op(lists[0][i], lists[1][i], ..., scalar_i)``
for every index i, so its rule is the pointwise rule of that op, applied per index. When every index
already lines up -- all tensors of an index are global tensors with the same placements (no Partial)
and the same shape, which is what an optimizer sees for its parameters, gradients and states -- the
foreach op runs once on the local lists (one fused local call, no redistribution). Otherwise each index
is dispatched as its own pointwise op (``aten.add_``, ``aten.addcdiv_``, ...), which redistributes as
that op's rule says; an in-place op without an in-place form (``_foreach_maximum_``) computes
out of place and copies back. The foreach ops that reduce each tensor to one value (``_foreach_norm``,
``_foreach_max``: what ``clip_grad_norm_(foreach=True)`` runs) are not pointwise: each tensor goes
through the reduction's own rule (a norm over a split dim is a Partial, reduced where needed).

The rule table finds every ``_foreach_*`` overload by name (`is_foreach`) and gives it `FOREACH`, a
composite rule running `foreach`.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any, Optional

import torch

from ..runtime.executor import redistribute_local
from ..runtime.pending import PendingTensor
from ..tensor.global_tensor import GlobalTensor
from ..values.placement import Broadcast, Partial
from .spec import Rule, no_signatures

aten = torch.ops.aten


def is_foreach(func) -> bool:
    """Whether `func` is a ``_foreach_*`` op.

    >>> is_foreach(torch.ops.aten._foreach_add_.List), is_foreach(torch.ops.aten.add_.Tensor)
    (True, False)
    """
    return func._schema.name.startswith("aten::_foreach_")


def _base(func) -> tuple[Optional[Any], bool]:
    """The per-tensor op packet (``aten.add_`` for ``_foreach_add_``) and whether it must copy back."""
    name = func._schema.name.split("::")[-1][len("_foreach_"):]
    packet = getattr(aten, name, None)
    if packet is None and name.endswith("_"):
        return getattr(aten, name[:-1], None), True
    return packet, False


def _per_index(func, args: tuple, kwargs: dict) -> tuple[int, list[tuple[list, dict]]]:
    """The arguments of the per-tensor op for every index."""
    schema = func._schema.arguments
    values = list(args) + [kwargs[a.name] for a in schema[len(args):] if a.name in kwargs]
    names = [a.name for a in schema[:len(values)]]
    types = [str(a.type) for a in schema[:len(values)]]
    n = next(len(v) for v, kind in zip(values, types) if kind.startswith("List["))
    keyword_value = func._schema.name.split("::")[-1].rstrip("_") in ("_foreach_addcdiv", "_foreach_addcmul")
    calls = []
    for i in range(n):
        pos, kw = [], {}
        for name, kind, value in zip(names, types, values):
            if kind.startswith("List["):
                item = value[i]
            elif kind == "Tensor" and name == "scalars":   # a 1-d tensor of per-index scalars
                item = value[i].item()
            else:
                item = value
            if name in kwargs:
                kw[name] = item
            else:
                pos.append(item)
        if keyword_value and len(pos) == 4:  # the scalar is addcdiv's / addcmul's keyword-only `value`
            kw["value"] = pos.pop()
        calls.append((pos, kw))
    return n, calls


_PLACEMENTS, _SHAPE, _MESH, _LOCAL = (attrgetter(name) for name in ("_placements", "shape", "_mesh", "_local"))


def _lined_up(func, args: tuple) -> bool:
    """Every index: global tensors only, one mesh, equal placements without Partial, equal shapes.
    (Checked list by list with C-level maps, not index by index: an optimizer step runs ~10 foreach ops
    over every parameter, and this check is all sbp adds to each.)"""
    lists = []
    for a in args:
        if isinstance(a, GlobalTensor):
            return False   # a global 0-d operand: let the per-index rule place it
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            lists.append(a)
    if not lists:
        return True
    first = lists[0]
    kinds: set = set()
    for lst in lists:
        if len(lst) != len(first):
            return False
        kinds.update(map(type, lst))
    if not all(issubclass(kind, GlobalTensor) for kind in kinds):
        return False
    placements = list(map(_PLACEMENTS, first))
    for pls in dict(zip(map(id, placements), placements)).values():
        if any(isinstance(p, Partial) for p in pls):
            return False
    shapes = list(map(_SHAPE, first))
    for lst in lists[1:]:
        if list(map(_PLACEMENTS, lst)) != placements or list(map(_SHAPE, lst)) != shapes:
            return False
    meshes: dict = {}
    for lst in lists:
        found = list(map(_MESH, lst))
        meshes.update(zip(map(id, found), found))
    return len(meshes) == 1 or all(m == first[0]._mesh for m in meshes.values())


def _locals(items: Any) -> list:
    """The local tensors of a list of global tensors (one still on its way -- a queued gradient reduction
    -- is waited for once, here, and kept: the optimizer's later foreach ops read the value directly)."""
    out = list(map(_LOCAL, items))
    if PendingTensor in set(map(type, out)):
        out = [t.wait()._local if isinstance(local, PendingTensor) else local for t, local in zip(items, out)]
    return out


def _local_args(args: tuple, kwargs: dict) -> tuple[list, dict]:
    """The call with every global tensor replaced by its local (`_lined_up` held: lists are all global)."""
    def loc(v: Any) -> Any:
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], GlobalTensor):
            return _locals(v)
        return v
    return [loc(a) for a in args], {k: loc(v) for k, v in kwargs.items()}


# foreach ops that reduce each tensor to one value (not pointwise): run as that reduction per tensor
_REDUCING = {
    "_foreach_norm": lambda t, ord=2, dtype=None: torch.linalg.vector_norm(t, ord, dtype=dtype),
    "_foreach_max": lambda t: torch.amax(t),
}


def foreach(func, args: tuple, kwargs: dict) -> Any:
    """Run a ``_foreach_*`` op on global tensors (see the module docstring).

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     xs = [sbp.distribute(torch.ones(4), mesh, "S(0)"), sbp.distribute(torch.ones(3), mesh, "B")]
    ...     torch._foreach_mul_(xs, 3.0)                              # one fused local call
    ...     return [x.full().tolist() for x in xs]
    >>> sbp.testing.spmd(fn, (2,))[0]
    [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
    """
    reduce = _REDUCING.get(func._schema.name.split("::")[-1])
    if reduce is not None:   # one value per tensor: the reduction's own rule, tensor by tensor
        return [reduce(t, *args[1:], **kwargs) for t in args[0]]
    packet, copy_back = _base(func)
    if packet is None:   # no per-tensor op (e.g. _foreach_powsum): not known to be pointwise, so the fallback
        return NotImplemented
    if func._schema.name.endswith("_"):   # in place on the first list: as torch's per-tensor kernels, bump
        # the tensors' version counters (the whole list reaches here at once, past each tensor's own bump)
        torch._C._increment_version([t for t in args[0] if isinstance(t, GlobalTensor)])
    if _lined_up(func, args):
        largs, lkwargs = _local_args(args, kwargs)
        out = func(*largs, **lkwargs)
        if out is None or (isinstance(out, (list, tuple)) and len(out) == 0):
            return out
        like = args[0]
        return [GlobalTensor(o, t._mesh, t._placements, tuple(t.shape)) for o, t in zip(out, like)]
    n, calls = _per_index(func, args, kwargs)
    results = []
    for pos, kw in calls:
        out = packet(*pos, **kw)
        if copy_back:
            pos[0].copy_(out)
            out = pos[0]
        results.append(out)
    returns = func._schema.returns
    return results if returns and str(returns[0].type).startswith("List[") else None


FOREACH = Rule(no_signatures, composite=foreach,
               doc="the pointwise rule per list index; one fused local call when every index lines up")

# the fused optimizer kernels (``torch.optim.Adam(..., fused=True)``): element-wise updates of the parameters
# and their states, index by index, with the step counts as plain tensors
_FUSED = frozenset({"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_", "aten::_fused_adagrad_"})


def is_fused_optimizer(func) -> bool:
    """Whether `func` is one of torch's fused optimizer kernels (``_fused_adamw_``, ...).

    >>> is_fused_optimizer(torch.ops.aten._fused_adamw_.default), is_fused_optimizer(torch.ops.aten.add_.Tensor)
    (True, False)
    """
    return func._schema.name in _FUSED


def fused_optimizer(func, args: tuple, kwargs: dict) -> Any:
    """Run a fused optimizer kernel on the local tensors when its global lists line up (`_lined_up`: the
    parameters, gradients and states of every index share one layout without Partial); the plain lists (the
    step counts, one 0-d tensor per parameter, the same on every rank) pass as they are. Else the fallback.

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     w = torch.nn.Parameter(sbp.distribute(torch.ones(4), mesh, "S(0)"))
    ...     w.grad = sbp.distribute(torch.ones(4), mesh, "S(0)")
    ...     torch.optim.SGD([w], lr=0.5, fused=True).step()          # one _fused_sgd_ on the local blocks
    ...     return w.full().tolist()
    >>> sbp.testing.spmd(fn, (2,))[0]
    [0.5, 0.5, 0.5, 0.5]
    """
    lists = tuple(a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], GlobalTensor))
    loose = [a for a in (*args, *kwargs.values()) if isinstance(a, GlobalTensor)]
    if loose or not lists or not _lined_up(func, lists):
        return NotImplemented
    writes = [arg.alias_info is not None and arg.alias_info.is_write for arg in func._schema.arguments]
    torch._C._increment_version([t for w, a in zip(writes, args) if w and isinstance(a, (list, tuple))
                                 for t in a if isinstance(t, GlobalTensor)])   # the wrappers' counters too
    largs, lkwargs = _local_args(args, kwargs)
    # the kernels read every list with the first's strides (torch's autograd lays a gradient out as its
    # parameter; sbp's locals may differ, a transposed gradient block): contiguous copies, written back after
    back = []
    for k, lst in enumerate(largs):
        if isinstance(lst, list) and lst and isinstance(args[k][0], GlobalTensor) and \
                not all(t.is_contiguous() for t in lst):
            largs[k] = [t if t.is_contiguous() else t.contiguous() for t in lst]
            if writes[k]:
                back.append((lst, largs[k]))
    out = func(*largs, **lkwargs)
    for originals, used in back:
        for t, u in zip(originals, used):
            if u is not t:
                t.copy_(u)
    return out


FUSED = Rule(no_signatures, composite=fused_optimizer,
             doc="one local call when the parameters, gradients and states line up")


def unscale(func, args: tuple, kwargs: dict) -> Any:
    """``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``, what
    ``torch.amp.GradScaler.unscale_`` runs: each rank unscales and checks its own blocks in one local call,
    then `found_inf` (a plain tensor, one per rank) takes its max over the mesh axes that split a gradient
    (one all_reduce of one element per mesh of the list), so every rank skips or takes the step alike. A
    Partial gradient (a partial sum may be finite where the sum is not) or a global `found_inf` / `inv_scale`
    takes the fallback.

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     g = sbp.distribute(torch.tensor([2.0, 4.0, float("inf"), 8.0]), mesh, "S(0)")
    ...     found = torch.zeros(1)
    ...     torch._amp_foreach_non_finite_check_and_unscale_([g], found, torch.tensor(0.5))
    ...     return found.item(), g.to_local().tolist()
    >>> sbp.testing.spmd(fn, (2,))    # rank 0's block is finite; the step is skipped on both ranks
    [(1.0, [1.0, 2.0]), (1.0, [inf, 4.0])]
    """
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args), **kwargs)
    grads, found_inf, inv_scale = bound["self"], bound["found_inf"], bound["inv_scale"]
    if isinstance(found_inf, GlobalTensor) or isinstance(inv_scale, GlobalTensor) or any(
            isinstance(t, GlobalTensor) and any(isinstance(p, Partial) for p in t._placements) for t in grads):
        return NotImplemented
    torch._C._increment_version([t for t in grads if isinstance(t, GlobalTensor)])
    func(_locals_of(grads), found_inf, inv_scale)
    meshes: dict[int, tuple[Any, set[int]]] = {}   # id(mesh) -> (mesh, the axes that split a gradient on it)
    for t in grads:
        if isinstance(t, GlobalTensor):
            axes = meshes.setdefault(id(t._mesh), (t._mesh, set()))[1]
            axes.update(a for a, p in enumerate(t._placements) if not isinstance(p, Broadcast))
    for mesh, axes in meshes.values():   # in the list's order: the same on every rank
        if axes:
            src = tuple(Partial("max") if a in axes else Broadcast() for a in range(mesh.ndim))
            agreed = redistribute_local(found_inf, mesh, tuple(found_inf.shape), src, (Broadcast(),) * mesh.ndim)
            found_inf.copy_(agreed)


def _locals_of(items: list) -> list:
    """`items` with each global tensor replaced by its local (`_locals`), plain tensors as they are."""
    globals_ = [t for t in items if isinstance(t, GlobalTensor)]
    it = iter(_locals(globals_))
    return [next(it) if isinstance(t, GlobalTensor) else t for t in items]


UNSCALE = Rule(no_signatures, composite=unscale,
               doc="one local call; found_inf's max over the axes that split a gradient (one all_reduce per mesh)")
