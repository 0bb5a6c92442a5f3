"""Tensor-parallel layers on plain local tensors: what `parallelize`'s hooks do inside a `fully_shard` unit that
computes on this rank's share of the batch (`fully_shard`'s `local_batch`, see docs/fsdp.md).

There the unit binds its gathered parameters as plain tensors (a tensor-parallel parameter: this rank's piece
on the tp axis) and its inputs are this rank's share of the batch, Broadcast on the tp axis -- the plain
tensors FSDP2 + `parallelize_module` compute on. A `Colwise` layer computes its output features from the whole
input: Megatron's `f`, identity forward, and backward the input's gradient (this rank's part of a sum over the
tp axis) all-reduced; its output is its local piece (gathered first where its output placement is `B`). A
`Rowwise` layer computes its partial sums from its local input features and reduces them (Megatron's `g`: one
all_reduce), its bias added after. Every collective is a planned redistribution of the local tensor on the tp
axis (`sbp.runtime.executor.redistribute_local`), the same the global layers make.

`SplitTracker` is the check `fully_shard` adds for such a unit on its first forward, beside comparing the
outputs: a parameter Broadcast on the tp axis (a norm's weight, a rowwise bias) and the unit's inputs must
only meet values that are Broadcast on the tp axis too (the residual stream, a reduced output), never the local
pieces between a colwise and a rowwise layer -- there their local gradient would be one rank's part of a sum,
which plain tensors cannot say.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..runtime.executor import redistribute_local
from ..tensor.global_tensor import mesh_description, mesh_of, placements_text
from ..values.errors import SbpError
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, Split, normalize
from .styles import Colwise, Rowwise


def on_tp(mesh: DeviceMesh, tp_axis: int, tp: Placement) -> tuple[Placement, ...]:
    """`tp` on the tp axis, `B` on the others: a plain local tensor as seen from the tp axis alone (its other
    axes' layout -- the batch split on dp -- is left as it is by a move on the tp axis).

    >>> on_tp(DeviceMesh((2, 2)), 1, Partial())
    (B, P(sum))
    """
    return tuple(tp if a == tp_axis else Broadcast() for a in range(mesh.ndim))


class _TpMove(torch.autograd.Function):
    """A plain local tensor moved on the tp axis from `src` to `dst` (placements on the whole mesh, `B` off the
    tp axis); its gradient moved from `grad_src` to `grad_dst`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh: DeviceMesh, shape: tuple[int, ...],  # type: ignore[override]
                src: tuple, dst: tuple, grad_src: tuple, grad_dst: tuple) -> torch.Tensor:
        ctx.mesh, ctx.shape, ctx.moves = mesh, shape, (src, dst, grad_src, grad_dst)
        return x.view_as(x) if src == dst else redistribute_local(x, mesh, shape, src, dst)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        src, dst, grad_src, grad_dst = ctx.moves
        if torch.is_grad_enabled() and grad.requires_grad:   # create_graph: the gradient's move is a move again
            return (_TpMove.apply(grad, ctx.mesh, ctx.shape, grad_src, grad_dst, src, dst),) + (None,) * 6
        if grad_src != grad_dst:
            grad = redistribute_local(grad, ctx.mesh, ctx.shape, grad_src, grad_dst)
        return grad, None, None, None, None, None, None


def _moved_described(x: torch.Tensor, mesh: tuple, shape: tuple[int, ...], moves: str) -> torch.Tensor:
    """`_TpMove` with its mesh and placements as constants a compiled graph's opaque call takes (a
    `mesh_description`; the four placements as text, joined by ``;``)."""
    pls = [normalize(m, len(shape), len(mesh[0])) for m in moves.split(";")]
    return _TpMove.apply(x, mesh_of(mesh), shape, *pls)


# under torch.compile one opaque call that AOTAutograd traces (its collectives: functional ones in the graph);
# dynamo itself would break the graph in the executor's eager bookkeeping
_compiled_move = torch._dynamo.nonstrict_trace(_moved_described)


def _move(x: torch.Tensor, mesh: DeviceMesh, shape: tuple[int, ...], src: tuple, dst: tuple, grad_src: tuple,
          grad_dst: tuple) -> torch.Tensor:
    if torch.compiler.is_compiling():
        moves = ";".join(placements_text(p) for p in (src, dst, grad_src, grad_dst))
        return _compiled_move(x, mesh_description(mesh), tuple(int(n) for n in shape), moves)
    return _TpMove.apply(x, mesh, shape, src, dst, grad_src, grad_dst)


def reduce_grad(x: torch.Tensor, mesh: DeviceMesh, tp_axis: int) -> torch.Tensor:
    """Megatron's `f` on a plain local tensor Broadcast on the tp axis: identity forward; backward, the gradient
    (this rank's part of a sum, `P(sum)` on tp) all-reduced to `B`.

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = torch.ones(2, requires_grad=True)
    ...     (reduce_grad(x, mesh, 0) * (mesh.coord[0] + 1)).sum().backward()   # rank c's part: c + 1
    ...     return x.grad.tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [[3.0, 3.0], [3.0, 3.0]]
    """
    b, p = on_tp(mesh, tp_axis, Broadcast()), on_tp(mesh, tp_axis, Partial())
    out = _move(x, mesh, tuple(x.shape), b, b, p, b)
    note(out, BOUNDARY)
    return out


def move(x: torch.Tensor, mesh: DeviceMesh, tp_axis: int, shape: tuple[int, ...], src: Placement,
         dst: Placement) -> torch.Tensor:
    """A plain local tensor laid out `src` on the tp axis moved to `dst` (`shape`: its global shape seen from
    the tp axis); its gradient, the gradient of a `dst` value, moved back to what a `src` value's gradient is
    (a Partial's gradient is `B`: each rank's part contributes to the sum).

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     part = torch.full((2,), mesh.coord[0] + 1.0)                # P(sum): 1 on rank 0, 2 on rank 1
    ...     return move(part, mesh, 0, (2,), Partial(), Broadcast()).tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [[3.0, 3.0], [3.0, 3.0]]
    """
    grad = lambda p: Broadcast() if isinstance(p, Partial) else p  # noqa: E731
    out = _move(x, mesh, shape, on_tp(mesh, tp_axis, src), on_tp(mesh, tp_axis, dst),
                on_tp(mesh, tp_axis, grad(dst)), on_tp(mesh, tp_axis, grad(src)))
    note(out, REPLICATED if isinstance(dst, Broadcast) else SPLIT)
    return out


# ---- the check on the first forward --------------------------------------------------------------------

SPLIT, REPLICATED, BOUNDARY = "split", "replicated", "boundary"
_ACTIVE = threading.local()   # .tracker: this thread's active SplitTracker (thread ranks each have their own)


def note(t: torch.Tensor, kind: str) -> None:
    """Tell the active `SplitTracker` (if any) what `t` holds: a piece that differs along the tp axis
    (`SPLIT`), a value Broadcast on it that may carry a gradient (`REPLICATED`), or a colwise layer's input
    after `reduce_grad` (`BOUNDARY`: it may meet the layer's pieces, its gradient is reduced)."""
    if torch.compiler.is_compiling():   # (the check runs eagerly: no tracker in a compiled graph)
        return
    tracker = getattr(_ACTIVE, "tracker", None)
    if tracker is not None:
        tracker.mark(t, kind)


class SplitTracker(TorchFunctionMode):
    """While active, follows which plain tensors hold tp-axis pieces (`SPLIT`: from the split parameters, through
    every op) and which hold values Broadcast on tp that may carry a gradient (`REPLICATED`: from the unit's
    inputs and Broadcast parameters); an op mixing the two sets `bad` (its name). The hooks of `parallelize`
    mark their outputs (`note`): a reduced rowwise output is `REPLICATED` again, a colwise layer's input after
    `reduce_grad` a `BOUNDARY`.

    >>> w, x = torch.ones(2), torch.ones(2)
    >>> with SplitTracker(split=[w], replicated=[x]) as t:
    ...     y = (w * 2) + x
    >>> t.bad
    'add'
    """

    def __init__(self, split=(), replicated=()) -> None:
        super().__init__()
        self.kinds: dict[int, tuple[str, Any]] = {}
        self.bad: Optional[str] = None
        for kind, ts in ((SPLIT, split), (REPLICATED, replicated)):
            for t in ts:
                self.mark(t, kind)

    def mark(self, t: Any, kind: str) -> None:
        if isinstance(t, torch.Tensor):
            self.kinds[id(t)] = (kind, t)   # the tensor itself kept alive: its id is not reused in the check

    def kind(self, t: Any) -> Optional[str]:
        seen = self.kinds.get(id(t)) if isinstance(t, torch.Tensor) else None
        return seen[0] if seen is not None and seen[1] is t else None

    def __enter__(self):
        self.outer = getattr(_ACTIVE, "tracker", None)
        _ACTIVE.tracker = self
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.tracker = self.outer
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kinds = {self.kind(t) for t in tree_flatten((args, kwargs))[0]}
        out = func(*args, **kwargs)
        if SPLIT in kinds and REPLICATED in kinds and self.bad is None:
            self.bad = getattr(func, "__name__", str(func))
        kind = SPLIT if SPLIT in kinds else REPLICATED if REPLICATED in kinds else None
        if kind is not None:
            for t in tree_flatten(out)[0]:
                self.mark(t, kind)
        return out


# the module attribute holding the style `parallelize` gave it (it travels when the model is saved or copied):
# a fully_shard unit computes on local shares only where every styled module in it is a Colwise or Rowwise
# layer (`local_styles`)
STYLE = "_sbp_style"


def local_styles(modules) -> bool:
    """Whether every module among `modules` that `parallelize` styled can compute on plain local tensors: a
    `Colwise` or `Rowwise` layer (not packed, sequence-parallel, embedding, replicated or all-reduce ones).

    >>> local_styles([torch.nn.Linear(2, 2)])     # not styled: its parameters' placements say what it is
    True
    """
    return all(type(m.__dict__[STYLE]) in (Colwise, Rowwise) for m in modules if STYLE in m.__dict__)


def split_params(compute: tuple[Placement, ...]) -> bool:
    """Whether a parameter with these gathered placements is split along some mesh axis (a tp piece).

    >>> split_params((Broadcast(), Split(0))), split_params((Broadcast(), Broadcast()))
    (True, False)
    """
    return any(isinstance(p, Split) for p in compute)


def refuse(module: Any, why: str) -> SbpError:
    """The error a tensor-parallel layer raises where it cannot compute on plain local tensors (the unit's
    first-forward check then keeps it on global tensors)."""
    return SbpError(f"{type(module).__name__} cannot compute on plain local tensors inside a fully_shard unit: "
                    f"{why}")

