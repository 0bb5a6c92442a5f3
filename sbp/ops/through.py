"""Writes into views that could not stay views: the write goes on into the base.

A view of a global tensor is a view of its local block where the layout allows (`x.t()`, `x[:, 1:]` on
`S(0)`); where it does not -- a slice of a split dim, a reshape that regroups uneven blocks -- the view was
laid out anew and holds its own local tensor (it is *detached*, `TensorNotes.detached`). An in-place op on
such a view writes the view's local, and then the base the view was made from: the region the view covers,
each rank its own block's part (`sbp.tensor.setitem.write_blocks`), with no communication for slices and
selects (the written view's value is gathered once) and a gather of the base for any other view op. A
base that is itself a detached view passes the write on to its own base.

This is what autograd's in-place machinery needs too: backward of an in-place op on a view writes the
incoming gradient's slice in place (`CopySlices`), and that gradient may be split where the slice is.

Other detached views of the same base are not refreshed: they are copies taken when they were made
(docs/operators.md, "Writes into views laid out anew").

>>> import torch, sbp, sbp.testing
>>> def fn(mesh):
...     x = sbp.distribute(torch.zeros(5), mesh, "S(0)")
...     x[1:4].add_(1)          # a slice of the split dim: laid out anew, then written through
...     return x.full().tolist()
>>> sbp.testing.spmd(fn, (2,))[0]
[0.0, 1.0, 1.0, 1.0, 0.0]
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..runtime.traced import is_tracing, untraced
from ..tensor.global_tensor import GlobalTensor, contiguous_strides, full_local, meta_like
from ..tensor.setitem import write_blocks
from ..values.errors import SbpError

aten = torch.ops.aten

# view ops whose output is a region of the base named by a basic index (ints and slices): written without
# gathering the base
_REGIONS = {aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
            aten.alias.default}
# views of the whole base in another dtype: the base's value from the view's (`func(value, base dtype)`)
_RETYPED = {aten.view_as_complex.default: lambda v, dtype: torch.view_as_real(v),
            aten.view_as_real.default: lambda v, dtype: torch.view_as_complex(v.contiguous()),
            aten.view.dtype: lambda v, dtype: v.contiguous().view(dtype)}


def can_write_through(view: GlobalTensor) -> bool:
    """Whether a write into the detached `view` can go on into its base (the view op is known, and the base
    is a global tensor that can take it, in turn), or need not (torch would have copied: see `_a_copy`)."""
    made = view._notes.view if view._notes is not None else None
    if made is None:
        return False
    func, args, _, _ = made
    base = args[0]
    if not isinstance(base, GlobalTensor):
        return False
    if _a_copy(made):
        return True
    if func not in _REGIONS and func not in _RETYPED and _element_map(made) is None:
        return False
    return not (base._notes is not None and base._notes.detached) or can_write_through(base)


def _a_copy(made: tuple) -> bool:
    """Whether on one device the op made a copy, not a view: torch's ``reshape`` of a tensor whose strides
    admit no view (``x.t().reshape(-1)``) copies, but the wrapper's contiguous strides made it call
    ``aten.view`` here. A write into such a tensor stays in it, as in torch."""
    func, args, kwargs, _ = made
    if func not in (aten.view.default, aten._unsafe_view.default):
        return False
    try:
        func(meta_like(args[0]), *args[1:], **kwargs)
    except RuntimeError:
        return True
    return False


def own_copies(func, leaves: list, writes: list) -> None:
    """Before an in-place op: a written tensor that ``reshape`` copied on one device (`_a_copy`: the wrapper's
    contiguous strides made reshape call ``aten.view``) gets a local of its own, so the write stays in it, as
    in torch (before, where its local was a view of its base's, ``x.t().reshape(-1).mul_(3)`` on an `S(1)`
    `x` wrote into `x`). Under autograd such a write is refused: torch tracks the tensor as a view of its
    base and would replay the view on the gradient in the backward, where it is a copy, and the write's
    gradient would be lost (``x.grad`` 1 for 3)."""
    for i, _ in writes:
        t = leaves[i]
        if not (isinstance(t, GlobalTensor) and t._notes is not None and t._notes.view is not None
                and _a_copy(t._notes.view)):
            continue
        if t._is_view() and torch.is_grad_enabled() and any(isinstance(u, torch.Tensor) and u.requires_grad
                                                             for u in leaves):
            raise SbpError(f"{func} writes in place, with autograd recording, into a tensor that reshape copied "
                           f"(on one device its input's strides admit no view, e.g. x.t().reshape(-1)) but that "
                           f"autograd tracks as a view of its base here: the write's gradient would be lost. "
                           f"Call .contiguous() before the reshape, or .clone() its result, then write")
        t.__dict__["_local"] = t._local.clone()
        t._notes.view, t._notes.detached, t._notes.strides = None, False, contiguous_strides(tuple(t.shape))


def write_through(view: GlobalTensor) -> None:
    """Write the detached `view`'s value (its local already written) into the region of its base it was made
    from, and on into the base's base where that is detached too. Every rank calls it (SPMD)."""
    if _a_copy(view._notes.view):
        return
    func, args, kwargs, k = view._notes.view
    base = args[0]
    entries = _region(func, args, kwargs, k, base.ndim)
    if entries is not None:
        write_blocks(base, entries, entries, full_local(view))
    elif func in _RETYPED:   # the whole base, in its own dtype
        entries = (slice(None),) * base.ndim
        write_blocks(base, entries, entries, _RETYPED[func](full_local(view), base.dtype).reshape(base.shape))
    else:
        index = _element_map(view._notes.view)
        whole = full_local(base).reshape(-1).clone()
        if is_tracing(whole):   # a constant of the graph
            with untraced():
                values = index.tolist()
            index = torch.tensor(values, dtype=torch.int64)
        whole[index.reshape(-1)] = full_local(view).reshape(-1)
        entries = (slice(None),) * base.ndim
        write_blocks(base, entries, entries, whole.view(base.shape))
    if base._notes is not None and base._notes.detached:
        write_through(base)


def _region(func, args: tuple, kwargs: dict, k: Optional[int], ndim: int) -> Optional[tuple]:
    """The basic index (one entry per dim) of the base region a slice-like view op's output `k` covers."""
    if func not in _REGIONS:
        return None
    bound = func._schema.arguments
    values = {a.name: a.default_value for a in bound if a.has_default_value()}
    values.update({a.name: v for a, v in zip(bound, args)})
    values.update(kwargs)
    entries: list[Any] = [slice(None)] * ndim
    if func is aten.alias.default:
        return tuple(entries)
    dim = values["dim"] % ndim
    if func is aten.slice.Tensor:
        entries[dim] = slice(values["start"], values["end"], values["step"])
    elif func is aten.select.int:
        entries[dim] = values["index"]
    elif func is aten.unbind.int:
        entries[dim] = k
    else:
        length = args[0].shape[dim]
        sizes = values["split_sizes"] if func is aten.split_with_sizes.default else \
            [min(values["split_size"], length - s) for s in range(0, length, values["split_size"])]
        start = sum(sizes[:k])
        entries[dim] = slice(start, start + sizes[k])
    return tuple(entries)


def _element_map(made: tuple) -> Optional[torch.Tensor]:
    """For any other view op: the base's flat element index of each of the view's elements (the op replayed
    on the base's indices); None where that is not a one-to-one view of the base's elements (a dtype view,
    an expand: torch refuses writes into overlapping views too)."""
    func, args, kwargs, k = made
    base = args[0]
    with untraced():   # (also in a compiled graph, where the index becomes a constant of the graph)
        try:
            out = func(torch.arange(base.numel()).view(tuple(base.shape)), *args[1:], **kwargs)
        except (RuntimeError, TypeError, ValueError):
            return None
        out = out[k] if k is not None else out
        if not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or out.numel() != out.unique().numel():
            return None
    return out


def refuse_write(func, view: GlobalTensor, placements: tuple) -> SbpError:
    """The error for a write into a detached view that cannot go on into its base."""
    return SbpError(f"{func} writes into a view of a global tensor that could not stay a view of its base's "
                    f"local block (the base was laid out anew for the view: placements {placements}), and the "
                    f"view op has no way back into the base; the write would not reach the base. Write into the "
                    f"base, or .clone() the view first")
