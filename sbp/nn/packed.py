"""Packed (fused) `nn.Linear` weights split per part: the parameter held unfolded, the module run on local tensors.

`sbp.nn.Packed` describes the layout (``(out, in)`` -> ``(parts, out // parts, in)`` laid out `S(1)`, ...); this
module does the work for `sbp.nn.parallelize`: `unfold` makes the global parameter from the full fused one,
and `install` hooks the module so that its forward computes on this rank's local blocks:

- before the forward, the input becomes a plain local tensor (colwise: the full value on the tp axis, whose
  gradient is this rank's partial sum, `P(sum)`; rowwise: the plain input as it comes, this rank's slice of
  each part), and each packed parameter is swapped for its local block, flattened back to the fused layout
  (``to_local()``: its gradient lands in the global parameter's block); a rowwise bias is left out;
- after it (also when the forward raises), the global parameters are put back; a colwise output is returned
  local, a rowwise output (this rank's partial sum) becomes `P(sum)`, is all_reduced to `B` and gets the
  bias added once.

>>> import copy, torch, sbp, sbp.testing
>>> sbp.load_torch_layers()
>>> _ = torch.manual_seed(0)
>>> fused = torch.nn.Sequential(torch.nn.Linear(4, 6))         # gate_up: 3 gate rows, then 3 up rows
>>> def fn(mesh):
...     up = sbp.nn.parallelize(copy.deepcopy(fused), mesh, {"0": sbp.nn.Packed()})[0]
...     return tuple(up.weight.shape), up.weight.placements, tuple(up(torch.ones(1, 4)).shape)
>>> sbp.testing.spmd(fn, (2,))     # rank 0: gate rows 0-1 and up rows 0-1; rank 1: gate row 2 and up row 2
[((2, 3, 4), (S(1),), (1, 4)), ((2, 3, 4), (S(1),), (1, 2))]
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..tensor.construct import from_local
from ..tensor.global_tensor import GlobalTensor
from ..values.errors import SbpError
from ..values.placement import Broadcast, Partial, Split, normalize
from .styles import Packed


def unfold(param: torch.Tensor, style: Packed, name: str, path: str) -> Optional[torch.Tensor]:
    """The full fused parameter with its packed dim unfolded into ``(parts, length // parts)``; None when the
    style does not pack `name`. Refuses a packed dim that the parts do not divide.

    >>> unfold(torch.arange(6.).view(6, 1), Packed(parts=2), "weight", "fc").shape
    torch.Size([2, 3, 1])
    """
    dim = style.unfolded_dim(name)
    if dim is None:
        return None
    if dim >= param.ndim:
        raise SbpError(f"packed parameter {path!r} of shape {tuple(param.shape)} has no dim {dim} to unfold "
                       f"({style.along} packing of {name!r})")
    length = param.shape[dim]
    if length % style.parts:
        raise SbpError(f"packed parameter {path!r}: dim {dim} of length {length} does not hold {style.parts} equal "
                       f"parts (valid: a length divisible by parts={style.parts})")
    return param.detach().unflatten(dim, (style.parts, length // style.parts))


def install(module: nn.Module, style: Packed, ctx: Any, from_full: Callable) -> None:
    """Hook `module` (an `nn.Linear` whose parameters `parallelize` has laid out by `style`) to compute on
    its local blocks; `ctx` is parallelize's context (mesh, tp axis, batch lengths), `from_full(t, ctx)` its
    conversion of a plain full tensor (differentiable: the plain tensor's gradient is the full one)."""
    saved: dict[str, Any] = {}

    def pre(mod: nn.Module, args: tuple) -> Optional[tuple]:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        x = _local_input(args[0], style, mod, ctx, from_full)
        for name, p in list(mod._parameters.items()):
            if isinstance(p, GlobalTensor):
                saved[name] = p
                dim = style.unfolded_dim(name)
                if dim is not None:   # each dp rank's gradient is its batch's part: P(sum) on the dp axes
                    grad_pls = tuple(Partial() if a in ctx.dp_axes else q for a, q in enumerate(p.placements))
                    mod._parameters[name] = p.to_local(grad_placements=grad_pls).flatten(dim, dim + 1)
                else:   # rowwise bias (B): added once, to the reduced output, not to every rank's partial sum
                    mod._parameters[name] = None
        return (x,) + tuple(args[1:])

    def post(mod: nn.Module, args: tuple, out: Any) -> Any:
        for name, p in saved.items():
            mod._parameters[name] = p
        bias = saved.get("bias") if style.unfolded_dim("bias") is None else None
        saved.clear()
        if style.along == "rowwise" and isinstance(out, torch.Tensor) and not isinstance(out, GlobalTensor):
            out = _reduced_output(out, ctx)
            return out if bias is None else out + bias
        return out

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)


def _local_input(x: torch.Tensor, style: Packed, module: nn.Module, ctx: Any, from_full: Callable) -> torch.Tensor:
    """Colwise: the full value on the tp axis as a plain tensor whose gradient is this rank's partial sum.
    Rowwise: the plain input is already this rank's slice of each part."""
    if style.along == "rowwise":
        if isinstance(x, GlobalTensor):
            raise SbpError(f"a packed rowwise {type(module).__name__} takes its input as this rank's slice of every "
                           f"part (a plain local tensor, what a packed colwise module returns), got a global tensor "
                           f"with placements {x.placements}; valid: the local output of a 'packed_colwise' module")
        return x
    if not isinstance(x, GlobalTensor):
        x = from_full(x, ctx)
    want = ctx.with_tp(x.placements, Broadcast(), x.ndim)
    if x.placements != want:
        x = x.redistribute(want)
    if x.ndim and any(isinstance(x.placements[a], Split) and x.placements[a].dim == 0 for a in ctx.dp_axes):
        ctx.batch_lengths[x.local_shape[0]] = x.shape[0]
    return x.to_local(grad_placements=ctx.with_tp(x.placements, Partial(), x.ndim))


def _reduced_output(out: torch.Tensor, ctx: Any) -> GlobalTensor:
    """This rank's partial sum of the output, all_reduced to `B` on the tp axis (the batch stays as it is)."""
    pls = normalize(ctx.input_placements(Partial(), out.ndim), out.ndim, ctx.mesh.ndim)
    shape: Optional[tuple[int, ...]] = tuple(out.shape)
    if out.ndim and ctx.dp_axes:   # the batch's global length as recorded, else inferred (one small all_gather)
        n = ctx.batch_lengths.get(out.shape[0])
        shape = (n,) + shape[1:] if n is not None else None
    y = from_local(out, ctx.mesh, pls, global_shape=shape)
    return y.redistribute(ctx.with_tp(pls, Broadcast(), out.ndim))
