"""Bucketed data-parallel gradients: one all_reduce per bucket of parameters instead of one per parameter.

A parameter replicated (`B`) on the data-parallel axes gets a `P(sum)` gradient there when the batch is
split on them; the leaf rule reduces each such gradient by its own all_reduce. `bucket_gradients` (and
``parallelize(..., dp_bucket_bytes=...)``) groups the parameters, in module order, into buckets of about
`bucket_bytes`; in backward each bucket's gradients are flattened into one buffer and reduced by one
all_reduce over the data-parallel axes (queued: it runs while backward goes on, `sbp.runtime.pending`),
then handed to the leaves already `B` there, so the leaf rule has nothing left to do.

The mechanism: during the root module's forward every bucketed parameter is replaced in its module by the
output of an identity autograd function over the whole bucket, whose backward receives the bucket's
gradients together (restored after forward).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..runtime import pending
from ..tensor.autograd import differentiable_once
from ..tensor.global_tensor import GlobalTensor, redistribute_raw
from ..values.errors import SbpError
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial


class _Bucket:
    """Parameters (with where they sit) whose gradients are reduced together."""

    def __init__(self, mesh: DeviceMesh, axes: tuple[int, ...]) -> None:
        self.mesh, self.axes = mesh, axes
        self.places: list[tuple[nn.Module, str]] = []   # every module slot holding one of the parameters
        self.originals: list[torch.Tensor] = []         # the parameter in each slot
        self.params: list[torch.Tensor] = []

    def reduce(self, grads: tuple[Optional[torch.Tensor], ...]) -> tuple[Optional[torch.Tensor], ...]:
        locals_, wants = [], []
        for p, g in zip(self.params, grads):
            want = tuple(Partial("sum") if a in self.axes else (Broadcast() if isinstance(q, Partial) else q)
                         for a, q in enumerate(p.placements))
            if g is None:
                locals_.append(None)
            else:
                if not isinstance(g, GlobalTensor):   # a plain gradient: the full value on every rank
                    return tuple(grads)
                if g.placements != want:
                    g = redistribute_raw(g, want)
                locals_.append(pending.ready(g._local))
            wants.append(want)
        live = [t for t in locals_ if t is not None]
        if not live:
            return tuple(grads)
        flat = torch.cat([t.reshape(-1) for t in live])
        comm = self.mesh.binding
        done = pending.submit(comm, lambda: comm.all_reduce(flat, self.axes, "sum", inplace=True), tuple(flat.shape),
                              flat.dtype, flat.device)
        out, offset = [], 0
        for p, t in zip(self.params, locals_):
            if t is None:
                out.append(None)
                continue
            shape, lo, n = tuple(t.shape), offset, t.numel()
            offset += n
            local = done.then(lambda v, lo=lo, n=n, shape=shape: v[lo:lo + n].view(shape), shape)
            out.append(GlobalTensor(local, self.mesh, p.placements, tuple(p.shape)))
        return tuple(out)


class _BucketIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bucket: _Bucket, *params: torch.Tensor):  # type: ignore[override]
        ctx.bucket = bucket
        return tuple(GlobalTensor(p._local, p._mesh, p._placements, tuple(p.shape)) for p in params)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):  # type: ignore[override]
        return (None,) + differentiable_once(ctx.bucket.reduce(grads), grads,
                                             "sbp.nn.parallelize's bucketed gradient reduction (dp_bucket_bytes)")


def check_bucket_bytes(bucket_bytes: Any) -> None:
    """`dp_bucket_bytes` is a positive int (checked by `parallelize` also where the mesh has no dp axis).

    >>> check_bucket_bytes(-1)
    Traceback (most recent call last):
    ...
    sbp.values.errors.SbpError: dp_bucket_bytes must be a positive number of bytes, got -1
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise SbpError(f"dp_bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")


def bucket_gradients(module: nn.Module, mesh: DeviceMesh, axes: tuple[int, ...], bucket_bytes: int) -> list[int]:
    """Reduce the gradients of `module`'s parameters that are `B` on mesh `axes` in buckets of about
    `bucket_bytes` (one all_reduce each); returns the number of parameters per bucket.

    >>> import torch, sbp, sbp.testing
    >>> sbp.load_torch_layers()
    >>> def fn(mesh):
    ...     m = sbp.nn.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), mesh,
    ...                            {"0": "colwise", "1": "rowwise"}, tp_axis="tp", dp_bucket_bytes=1 << 20)
    ...     m(torch.ones(2, 4)).sum().backward()
    ...     _ = [p.grad.wait() for p in m.parameters()]   # the bucket's all_reduce runs behind backward
    ...     return sum(c.collective == "all_reduce" and c.axes == (0,) for c in mesh.binding.counters.calls)
    >>> sbp.testing.spmd(fn, (2, 2), names=("dp", "tp"))[0]    # one for the four parameters' gradients
    1
    """
    check_bucket_bytes(bucket_bytes)
    buckets: list[_Bucket] = []
    size, seen = 0, set()
    for owner in module.modules():
        for name, p in owner.named_parameters(recurse=False):
            if not (isinstance(p, GlobalTensor) and p.requires_grad) or id(p) in seen:
                continue
            if not all(isinstance(p.placements[a], Broadcast) for a in axes):
                continue
            seen.add(id(p))
            nbytes = p.to_local().numel() * p.element_size()
            if not buckets or size + nbytes > bucket_bytes:
                buckets.append(_Bucket(mesh, axes))
                size = 0
            buckets[-1].params.append(p)
            size += nbytes
    for b in buckets:   # every module slot holding a bucketed parameter (tied ones: each slot)
        ids = {id(p) for p in b.params}
        b.places = [(owner, name) for owner in module.modules() for name, p in owner._parameters.items()
                    if p is not None and id(p) in ids]
        b.originals = [owner._parameters[name] for owner, name in b.places]

    def pre(mod: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for b in buckets:
            outs = dict(zip(map(id, b.params), _BucketIdentity.apply(b, *b.params)))
            for (owner, name), p in zip(b.places, b.originals):
                owner._parameters[name] = outs[id(p)]

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        for b in buckets:
            for (owner, name), p in zip(b.places, b.originals):
                owner._parameters[name] = p

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)
    return [len(b.params) for b in buckets]
