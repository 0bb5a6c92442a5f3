"""Differentiable conversions of global tensors: redistribute, full, to_local and from_local; and the
recorded block write of ``x[index] = value`` (`write_blocks_autograd`).

Redistribution does not change the logical tensor, so its gradient is the incoming gradient laid out
again: the backward of ``src -> dst`` redistributes the gradient (whatever placements it arrives with)
to `gt.grad_placements(src)`, which is `src` with every `P(op)` replaced by `B` -- the gradient of a
Partial value is Broadcast, since each local contributes to the logical value. Backward passes run
planned redistributions through the same executor as forward ones; nothing gathers everything.

Duality per mesh axis (forward placements -> placements of its gradient):

=============  ==================  ==========================================================
forward        gradient            backward communication of ``redistribute(src -> dst)``
=============  ==================  ==========================================================
``S(d)``       ``S(d)``            planned ``grad(dst) -> S(d)``
``B``          ``B``               planned ``grad(dst) -> B``
``P(op)``      ``B``               planned ``grad(dst) -> B`` (none when the grad is already B)
=============  ==================  ==========================================================
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..runtime.crossmesh import redistribute_cross as run_cross_mesh
from ..runtime.pending import is_pending
from ..runtime.traced import is_tracing
from ..values.errors import PlacementError
from ..values.layout import block, block_shape
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, Split, normalize
from . import global_tensor as gt  # GlobalTensor's methods call this module: the one allowed cycle
from .setitem import write_blocks

if TYPE_CHECKING:
    from .global_tensor import GlobalTensor


def _as_global(grad: torch.Tensor, mesh: DeviceMesh, global_shape: tuple[int, ...],
               like: tuple[Placement, ...]) -> GlobalTensor:
    """A gradient as a GlobalTensor; a plain gradient is the full value on every rank (Broadcast),
    differentiably so in a create_graph backward (`from_full`)."""
    if isinstance(grad, gt.GlobalTensor):
        return grad
    if torch.is_grad_enabled() and grad.requires_grad:
        return _FromFull.apply(grad, mesh, like, global_shape)
    return gt.GlobalTensor(gt.local_from_full(grad, mesh, like), mesh, like, global_shape)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, dst: tuple[Placement, ...],  # type: ignore[override]
                async_op: bool = False) -> GlobalTensor:
        ctx.src = x._placements
        ctx.mesh = x._mesh
        ctx.global_shape = tuple(x.shape)
        ctx.async_op = async_op   # an asynchronous forward has an asynchronous backward
        out = gt.redistribute_raw(x, dst, async_op)
        return _not_aliasing(out, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        want = gt.grad_placements(ctx.src)
        g = _as_global(grad, ctx.mesh, ctx.global_shape, want)
        return redistribute(g, want, ctx.async_op), None, None


class _RedistributeCross(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, mesh: DeviceMesh, dst: tuple[Placement, ...]) -> GlobalTensor:  # type: ignore[override]
        ctx.src, ctx.src_mesh, ctx.dst_mesh = x._placements, x._mesh, mesh
        ctx.global_shape = tuple(x.shape)
        local = run_cross_mesh(x._local, x._mesh, ctx.global_shape, x._placements, mesh, dst)
        return _not_aliasing(gt.GlobalTensor(local, mesh, dst, ctx.global_shape), x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        g = _as_global(grad, ctx.dst_mesh, ctx.global_shape, (Broadcast(),) * ctx.dst_mesh.ndim)
        return redistribute_cross(g, ctx.src_mesh, gt.grad_placements(ctx.src)), None, None


def _not_aliasing(out: GlobalTensor, x: GlobalTensor) -> GlobalTensor:
    """`out`, or a copy of it where its local shares memory with `x`'s: a plan that only slices or keeps
    (B -> S(0), B -> P) would hand back a view of the source, and a write into the result would change
    the source on some ranks only. `redistribute` returns a new tensor, as DTensor's does."""
    mine = out._local
    if is_pending(mine):  # queued work copies a result that would alias its source (no waiting here)
        return out
    if is_tracing(mine):  # traced tensors have no address; a copy of a fresh buffer is free to a compiler
        return gt.GlobalTensor(mine.clone(), out._mesh, out._placements, tuple(out.shape)) if mine.numel() else out
    if mine.numel() and mine.untyped_storage().data_ptr() == x._local.untyped_storage().data_ptr():
        return gt.GlobalTensor(mine.clone(), out._mesh, out._placements, tuple(out.shape))
    return out


class _Full(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.src = x._placements
        ctx.mesh = x._mesh
        ctx.global_shape = tuple(x.shape)
        return _full_local(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # the plain gradient is Broadcast (every rank computed the same loss); B -> S/B is a local slice
        want = gt.grad_placements(ctx.src)
        if isinstance(grad, gt.GlobalTensor):  # pragma: no cover - full() returns a plain tensor
            return redistribute(grad, want)
        return _as_global(grad, ctx.mesh, ctx.global_shape, want)   # (differentiable again under create_graph)


def _full_local(x: GlobalTensor) -> torch.Tensor:
    """The whole logical tensor of `x` as this rank's plain tensor (no autograd): `_Full`'s forward."""
    if x.ndim == 0 and x._mesh.coord is None:
        # outside the mesh: no value, but a 0-d tensor, so that the SPMD step `loss.full().backward()`
        # runs here too (and this rank takes its part in the backward of a cross-mesh move)
        return x._local.new_full((), float("nan") if x.dtype.is_floating_point or x.dtype.is_complex else 0)
    out = gt.redistribute_raw(x, (Broadcast(),) * x._mesh.ndim)._local
    # already Broadcast: not x's own local tensor, which autograd would give this node as its grad_fn
    return out.view_as(out) if out is x._local else out


class _FromFull(torch.autograd.Function):
    """A plain full value, equal on every rank, as a global tensor laid out as `pls` (a local slice, no
    communication): the inverse of `_Full`, and its backward in a create_graph backward. The plain tensor's
    gradient is the whole gradient on every rank (`full` of it: differentiable again under create_graph)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh: DeviceMesh, pls: tuple[Placement, ...],  # type: ignore[override]
                global_shape: tuple[int, ...]) -> GlobalTensor:
        # a normal `t` in inference mode (compiled under inference_mode: torch's detach of a traced tensor)
        normal = torch.inference_mode(False) if gt.normal_in_inference_mode(t) else contextlib.nullcontext()
        with normal:
            return gt.GlobalTensor(gt.local_from_full(t.detach(), mesh, pls), mesh, pls, global_shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if isinstance(grad, gt.GlobalTensor):
            grad = _Full.apply(grad) if torch.is_grad_enabled() and grad.requires_grad else _full_local(grad)
        return grad, None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor, grad_pls: tuple[Placement, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh = x._mesh
        ctx.global_shape = tuple(x.shape)
        ctx.grad_pls = grad_pls
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if torch.is_grad_enabled() and grad.requires_grad:   # create_graph: differentiable again (double backward)
            # the local gradients are parts of the logical gradient where grad_pls is Partial: the gradient
            # of a sum with respect to each part is the whole incoming gradient, `B` there
            return _FromLocal.apply(grad, ctx.mesh, ctx.grad_pls, ctx.global_shape,
                                    gt.grad_placements(ctx.grad_pls)), None
        return gt.GlobalTensor(grad, ctx.mesh, ctx.grad_pls, ctx.global_shape), None


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, mesh: DeviceMesh, pls: tuple[Placement, ...],  # type: ignore[override]
                global_shape: tuple[int, ...], grad_pls: Optional[tuple[Placement, ...]]) -> GlobalTensor:
        ctx.mesh = mesh
        ctx.pls, ctx.grad_pls = pls, grad_pls   # (the default layout is worked out in backward, if one runs)
        ctx.global_shape = global_shape
        return gt.GlobalTensor(local.view_as(local), mesh, pls, global_shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        want = gt.grad_placements(ctx.pls) if ctx.grad_pls is None else ctx.grad_pls
        g = _as_global(grad, ctx.mesh, ctx.global_shape, want)
        if torch.is_grad_enabled() and g.requires_grad:   # create_graph: differentiable again (double backward)
            # the local gradient's own gradient is laid out as the forward's local was: a `B` local is a copy
            # each rank computed alike (counts once), a `P` local one rank's own part (its gradients add up)
            return to_local(redistribute(g, want), _sum_parts(ctx.pls)), None, None, None, None
        return redistribute(g, want).to_local(), None, None, None, None


def redistribute(x: GlobalTensor, dst: tuple[Placement, ...], async_op: bool = False) -> GlobalTensor:
    """Differentiable redistribution to normalised placements `dst` (the body of `x.redistribute`);
    with `async_op` the collectives of forward and backward run queued (`sbp.runtime.pending`).

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.ones(4), mesh, "S(0)", requires_grad=True)
    ...     redistribute(x, (sbp.B,)).to_local().sum().backward()    # each rank's loss: its B copy
    ...     return x.grad.placements, x.grad.to_local().tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [((S(0),), [1.0, 1.0]), ((S(0),), [1.0, 1.0])]
    """
    return _Redistribute.apply(x, dst, async_op)


def redistribute_cross(x: GlobalTensor, mesh: DeviceMesh, dst: tuple[Placement, ...]) -> GlobalTensor:
    """Differentiable move to another mesh (other ranks and/or shape); every rank of both meshes calls it.

    >>> import torch, sbp, sbp.testing
    >>> def fn(world):
    ...     a = world.binding.bind(sbp.DeviceMesh((2,), ranks=(0, 1)))
    ...     b = world.binding.bind(sbp.DeviceMesh((2,), ranks=(2, 3)))
    ...     x = sbp.distribute(torch.arange(4.), a, "S(0)")
    ...     return redistribute_cross(x, b, (sbp.S(0),)).to_local().tolist()
    >>> sbp.testing.spmd(fn, (4,))
    [[], [], [0.0, 1.0], [2.0, 3.0]]
    """
    return _RedistributeCross.apply(x, mesh, dst)


def full(x: GlobalTensor) -> torch.Tensor:
    """Differentiable `x.full()`; its backward cuts the Broadcast gradient locally (no communication).

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.arange(4.), mesh, "S(0)", requires_grad=True)
    ...     (full(x) ** 2).sum().backward()
    ...     return x.grad.to_local().tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [[0.0, 2.0], [4.0, 6.0]]
    """
    return _Full.apply(x)


def from_full_autograd(t: torch.Tensor, mesh: DeviceMesh, pls: tuple[Placement, ...]) -> GlobalTensor:
    """Differentiable: plain `t`, the whole value on every rank, as a global tensor laid out as `pls`
    (normalised placements; a local slice, no communication). The gradient of `t` is the whole gradient,
    equal on every rank (one planned redistribution to all-`B`; `full` of it in a create_graph backward).

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     t = torch.arange(4.).requires_grad_()
    ...     x = from_full_autograd(t, mesh, (sbp.S(0),))
    ...     (x * x).sum().full().backward()
    ...     return x.to_local().tolist(), t.grad.tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [([0.0, 1.0], [0.0, 2.0, 4.0, 6.0]), ([2.0, 3.0], [0.0, 2.0, 4.0, 6.0])]
    """
    return _FromFull.apply(t, mesh, pls, tuple(t.shape))


def to_local(x: GlobalTensor, grad_pls=None, *, check: bool = True) -> torch.Tensor:
    """Differentiable `x.to_local()`; the local gradient gets `grad_pls` (default: `x`'s placements with
    `P(op)` as `P(sum)`: each rank's local gradient is one part of the logical gradient). Given
    `grad_pls` must give the local tensor's shape on every coord (`check_grad_placements`; `check=False`
    for normalised placements that do by construction, e.g. under symbolic sizes, which the check's cached
    layout maths cannot take).

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.ones(2), mesh, "P(sum)", requires_grad=True)
    ...     to_local(x).sum().backward()     # two P(sum) parts of gradient 1 each: logical gradient 2,
    ...     return x.grad.placements, x.grad.to_local().tolist()    # a Partial leaf's .grad is B
    >>> sbp.testing.spmd(fn, (2,))
    [((B,), [2.0, 2.0]), ((B,), [2.0, 2.0])]
    """
    if grad_pls is None:
        grad_pls = _sum_parts(x._placements)
    elif check:
        grad_pls = normalize(grad_pls, x.ndim, x._mesh.ndim)
        check_grad_placements(tuple(x.shape), x._mesh.shape, x._placements, grad_pls)
    return _ToLocal.apply(x, grad_pls)


def check_grad_placements(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], pls: tuple[Placement, ...],
                          grad_pls: tuple[Placement, ...]) -> None:
    """Refuse `to_local(grad_placements=...)` whose layout would not give the local gradient the local
    tensor's shape on every coord (pure layout maths: every rank decides the same). Raises
    `PlacementError` naming the first coord that differs and the placements that would be valid.

    >>> import sbp
    >>> check_grad_placements((4,), (2,), (sbp.S(0),), (sbp.S(0),))        # fine: returns None
    >>> check_grad_placements((4,), (2,), (sbp.S(0),), (sbp.PartialSum(),))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
      ...
    sbp.values.errors.PlacementError: to_local(grad_placements=(P(sum),)) on global shape (4,) ... the \
gradient's local shape at coord (0,) would be (4,), but the local tensor's is (2,) (valid: (S(0),))
    """
    bad = _first_shape_mismatch(global_shape, mesh_shape, pls, grad_pls)
    if bad is None:
        return
    coord, want, got = bad
    valid = _same_shape_layouts(global_shape, mesh_shape, pls)
    raise PlacementError(f"to_local(grad_placements={_fmt(grad_pls)}) on global shape {global_shape} with placements "
                         f"{_fmt(pls)} on mesh {mesh_shape}: the gradient's local shape at coord {coord} would be "
                         f"{got}, but the local tensor's is {want} (valid: {valid})")


@functools.lru_cache(maxsize=1024)
def _first_shape_mismatch(global_shape, mesh_shape, pls, grad_pls):
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        want = block_shape(block(global_shape, mesh_shape, pls, coord))
        got = block_shape(block(global_shape, mesh_shape, grad_pls, coord))
        if want != got:
            return coord, want, got
    return None


def _same_shape_layouts(global_shape, mesh_shape, pls, limit: int = 6) -> str:
    """Up to `limit` placements (Split, B, P(sum) per axis) giving every coord the shape `pls` gives."""
    per_axis = [Broadcast(), Partial("sum")] + [Split(d) for d in range(len(global_shape))]
    found = []
    if len(per_axis) ** len(mesh_shape) * math.prod(mesh_shape) <= 50_000:
        for cand in itertools.product(per_axis, repeat=len(mesh_shape)):
            if _first_shape_mismatch(global_shape, mesh_shape, pls, cand) is None:
                found.append(_fmt(cand))
    else:
        found.append(_fmt(pls))
    more = ", ..." if len(found) > limit else ""
    return ", ".join(found[:limit]) + more


def _fmt(pls: tuple[Placement, ...]) -> str:
    return "(" + ", ".join(map(repr, pls)) + ("," if len(pls) == 1 else "") + ")"


def differentiable_once(outputs: tuple, grads: tuple, what: str) -> tuple:
    """An autograd Function's backward `outputs`, computed without a graph (raw collectives): under
    ``create_graph`` (grad mode on, an incoming gradient in `grads` that requires grad) each tensor among them
    is made to require grad through a node that raises when it is differentiated, naming `what` -- a
    second-order gradient through it would otherwise be silently wrong (a gradient penalty's term dropped).
    First-order values are unchanged. Elsewhere `outputs` as they are.

    >>> x = torch.ones(2, requires_grad=True)
    >>> g, = differentiable_once((torch.ones(2),), (x * 1,), "an example's reduction")
    >>> g.sum().backward()   # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: a second-order gradient through an example's reduction: the gradients it gives ...
    """
    if not torch.is_grad_enabled() or not any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads):
        return outputs
    live = [k for k, t in enumerate(outputs) if isinstance(t, torch.Tensor)]
    if not live:
        return outputs
    message = (f"a second-order gradient through {what}: the gradients it gives under create_graph=True carry "
               "no graph (gradient penalties and Hessian-vector products through it are not supported)")
    made = []
    for k in live:
        t = outputs[k].detach()
        t.requires_grad = True
        made.append(t)
    wrapped = torch._C._functions.DelayedError(message.encode(), len(made))(*made)
    out = list(outputs)
    for k, t in zip(live, wrapped if isinstance(wrapped, (tuple, list)) else (wrapped,)):
        out[k] = t
    return tuple(out)


def from_local_autograd(local: torch.Tensor, mesh: DeviceMesh, pls: tuple[Placement, ...],
                        global_shape: tuple[int, ...], grad_pls: Optional[tuple[Placement, ...]] = None
                        ) -> GlobalTensor:
    """Differentiable wrapping of a local tensor (checked arguments); see `sbp.from_local`. The local
    gradient is the global gradient laid out as `grad_pls`, normalised placements (default: `pls` with
    Partial as Broadcast); e.g. `P(sum)` where the value is `B` leaves the gradient's reduction to later.

    >>> import torch, sbp
    >>> local = torch.ones(2, requires_grad=True)
    >>> x = from_local_autograd(local, sbp.DeviceMesh((2,)), (sbp.S(0),), (4,))
    >>> x, x.requires_grad
    (GlobalTensor(shape=(4,), placements=(S(0),), mesh=(2,), grad_fn=<_FromLocalBackward>), True)
    """
    return _FromLocal.apply(local, mesh, pls, global_shape, grad_pls)


class _LeafGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor) -> GlobalTensor:  # type: ignore[override]
        ctx.mesh, ctx.want, ctx.global_shape = x._mesh, gt.grad_placements(x._placements), tuple(x.shape)
        return gt.GlobalTensor(x._local.view_as(x._local), x._mesh, x._placements, tuple(x.shape))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if not isinstance(grad, gt.GlobalTensor):
            return gt.GlobalTensor(gt.local_from_full(grad, ctx.mesh, ctx.want), ctx.mesh, ctx.want, ctx.global_shape)
        if grad._placements == ctx.want:
            return grad
        return gt.redistribute_raw(grad, ctx.want)


def leaf_grad(x: GlobalTensor) -> GlobalTensor:
    """`x` unchanged (a view), whose gradient is laid out as the leaf rule lays out a leaf's `.grad`
    (`gt.grad_placements(x.placements)`) in the backward pass itself. Used on parameters inside a compiled
    region (`sbp.nn.parallelize`): the gradient's redistribution then is part of the compiled backward
    graph (functional collectives a compiler may schedule), and the leaf's hook finds nothing to do.

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     w = sbp.distribute(torch.ones(4), mesh, "B", requires_grad=True)
    ...     x = sbp.distribute(torch.arange(4.), mesh, "S(0)")
    ...     g = torch.autograd.grad((leaf_grad(w) * x).sum().full(), w)[0]   # w * x: S(0), a B leaf
    ...     return g.placements, g.to_local().tolist()
    >>> sbp.testing.spmd(fn, (2,))[0]
    ((B,), [0.0, 1.0, 2.0, 3.0])
    """
    return _LeafGrad.apply(x)


def _sum_parts(pls: tuple[Placement, ...]) -> tuple[Placement, ...]:
    return tuple(Partial("sum") if isinstance(p, Partial) else p for p in pls)


def write_blocks_autograd(x: GlobalTensor, index: Any, entries: tuple, value: Any) -> None:
    """`write_blocks` that autograd records, for a tensor or a value that requires grad: `x`'s history is
    rebased onto the write (as torch's in-place ops do; a leaf that requires grad is refused, as in torch).
    Backward gives `x`'s input the incoming gradient with the region zeroed, and the value the region's
    gradient summed to the value's shape: laid out as the value's gradient placements for a global value,
    the full gradient (equal on every rank) for a plain one.

    >>> import torch, sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.ones(4), mesh, "S(0)", requires_grad=True)
    ...     v = torch.tensor(3.0, requires_grad=True)
    ...     y = x * 2
    ...     y[1:3] = v               # GlobalTensor.__setitem__ calls write_blocks_autograd here
    ...     (y * y).sum().full().backward()
    ...     return x.grad.full().tolist(), v.grad.item()
    >>> sbp.testing.spmd(fn, (2,))[0]
    ([8.0, 0.0, 0.0, 8.0], 12.0)
    """
    _Write.apply(x, value, index, entries)


class _Write(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, value: Any, index: Any, entries: tuple):  # type: ignore[override]
        write_blocks(x, index, entries, value)
        ctx.mark_dirty(x)
        ctx.index = index
        ctx.value_meta = (tuple(value.shape), value.dtype, value.device, type(value) is type(x),
                          getattr(value, "_placements", None), getattr(value, "_mesh", None)) \
            if isinstance(value, torch.Tensor) else None
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        grad_x = grad_value = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.clone()
            grad_x[ctx.index] = 0
        if ctx.value_meta is not None and ctx.needs_input_grad[1]:
            grad_value = _value_grad(grad, ctx.index, *ctx.value_meta)
        return grad_x, grad_value, None, None


def _value_grad(grad, index: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                is_global: bool, pls, mesh):
    """The value's gradient: the region's gradient (a plain full tensor on every rank) summed over the
    dims the value was broadcast along, as a plain tensor or laid out as a global value's gradient."""
    region = grad[index]
    g = region.full() if isinstance(region, gt.GlobalTensor) else region
    if isinstance(grad, gt.GlobalTensor) and grad._mesh.coord is None:   # outside the mesh: no part of the region
        g = torch.zeros(tuple(region.shape), dtype=g.dtype, device=g.device)
    stripped = list(shape)
    while len(stripped) > g.ndim and stripped[0] == 1:
        stripped.pop(0)
    g = g.sum_to_size(stripped).reshape(shape).to(dtype=dtype)
    if not is_global:
        return g.to(device)
    want = gt.grad_placements(pls)
    return gt.GlobalTensor(gt.local_from_full(g, mesh, want), mesh, want, shape)
