"""Random ops (ATen tag `nondeterministic_seeded`: `uniform_`, `normal_`, `bernoulli`, dropout, `rand_like`,
...): they have no sharding rule and run on Broadcast (full) inputs, like any fallback, but every rank
draws the same numbers. A seed agreed over the mesh (drawn from the op's generator, or the default one,
then all-gathered from the first rank: one small collective) seeds a fresh generator for the call, so
the Broadcast results agree on every rank and a later cut to the tensor's layout is consistent; the
generators the ranks hold advance as for any random call. On a single device the same op would draw other
numbers: what is reproduced is agreement across ranks, not the single-device values. Inside a compiled
graph no seed can be agreed (a collective on values): each rank draws from its own generator there, so
the draws agree when every rank seeded alike (``torch.manual_seed(s)`` on each, as for DTensor).

A draw that ignores its input's values (`normal_`, `uniform_`, `bernoulli_(p)`, `rand_like`, ...: the
input only lends its shape and dtype; `draws_over`) gathers nothing: each rank draws the whole tensor into
a fresh one and keeps its own block, with no warning (nothing was gathered). `native_dropout` (what
compiled dropout runs) has a rule (`NATIVE_DROPOUT`) that draws its mask the same way.

>>> import torch, sbp, sbp.testing
>>> def fn(mesh):
...     w = sbp.distribute(torch.zeros(4, 3), mesh, "S(0)")
...     torch.nn.init.normal_(w)                        # a consistent global tensor
...     return torch.equal(w.redistribute("B").to_local(), w.full())
>>> sbp.testing.spmd(fn, (2,))
[True, True]
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..runtime.traced import is_tracing
from ..tensor.factories import DEFAULT_RNG, agreed_seed
from ..tensor.global_tensor import local_from_full
from ..values.placement import Split
from .spec import PSUM, B, Call, OpSpec, Rule, Sig

aten = torch.ops.aten


def is_random(func) -> bool:
    """Whether `func` draws random numbers (ATen tag `nondeterministic_seeded`).

    >>> is_random(torch.ops.aten.uniform_.default), is_random(torch.ops.aten.add.Tensor)
    (True, False)
    """
    return torch.Tag.nondeterministic_seeded in func.tags


def _overloads(*names: str) -> frozenset:
    """The ATen overloads ``"op.overload"`` this torch has (older versions lack some)."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            found.append(op)
    return frozenset(found)


# random ops whose only tensor argument lends its shape, dtype and device, never its values
_DRAWS_OVER = _overloads(
    "uniform_.default", "uniform.default", "normal_.default", "bernoulli_.float", "bernoulli.p",
    "cauchy_.default", "cauchy.default", "exponential_.default", "exponential.default", "geometric_.default",
    "geometric.default", "log_normal_.default", "log_normal.default", "random_.default", "random_.from",
    "random_.to", "rand_like.default", "rand_like.generator", "randn_like.default", "randn_like.generator",
    "randint_like.default", "randint_like.low_dtype", "randint_like.generator", "randint_like.low_generator_dtype")


def draws_over(func) -> bool:
    """Whether `func` is a random op whose result ignores its input's values (it overwrites or draws
    a tensor shaped like it): such an input need not be gathered for the draw, only made.

    >>> draws_over(torch.ops.aten.normal_.default), draws_over(torch.ops.aten.bernoulli.default)
    (True, False)
    """
    return func in _DRAWS_OVER


def agreed_random_run(call: Call) -> Any:
    """Run a random op on this rank's (Broadcast) inputs with a generator every rank seeds alike.

    >>> import sbp
    >>> mesh = sbp.DeviceMesh((1,))
    >>> call = Call(torch.ops.aten.rand_like.default, [torch.zeros(3)], {}, None, None, mesh, (0,))
    >>> agreed_random_run(call).shape
    torch.Size([3])
    """
    if any(is_tracing(a) for a in call.args if isinstance(a, torch.Tensor)):
        # a compiled graph: no collective can agree a seed on values there (the seed would be data the graph
        # cannot branch or seed on). Each rank draws from its own generator, as the graph runs: the draws agree
        # where the ranks seeded alike (torch.manual_seed(s) on every rank), as tensor parallelism needs anyway
        return call.func(*call.args, **call.kwargs)
    takes_generator = any(a.name == "generator" for a in call.func._schema.arguments)
    seed = agreed_seed(call.mesh, call.kwargs.get("generator") if takes_generator else None)
    device = next((a.device for a in call.args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if takes_generator:
        generator = torch.Generator(device=device).manual_seed(seed)
        return call.func(*call.args, **{**call.kwargs, "generator": generator})
    cuda = device.type == "cuda"
    with DEFAULT_RNG, torch.random.fork_rng(devices=[device] if cuda else []):   # restored after the call
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        return call.func(*call.args, **call.kwargs)


# ---- native_dropout: a mask drawn over the input's shape, applied where the input lies -------------------------
def _dropout_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """S(d) -> (S(d), S(d)) and B -> (B, B): the mask is cut like the input; P(sum) -> (P(sum), B): one mask
    scales every part alike; any other Partial is gathered first."""
    p = spec.inputs[0].placements[axis]
    if isinstance(p, Split) or p == B:
        return [Sig((p,), (p, p))]
    return [Sig((PSUM,), (PSUM, B)), Sig((B,), (B, B))]


def _run_dropout(call: Call) -> Any:
    """`native_dropout(x, p, train)` on this rank's block: the keep-mask is drawn for the whole global shape as
    every rank draws it (`agreed_random_run` of ``bernoulli_(1 - p)``; no input gathered), this rank keeps its
    block, and the output is ``x * mask / (1 - p)`` as torch computes it."""
    x, p = call.args[0], call.args[1]
    train = call.args[2] if len(call.args) > 2 else call.kwargs.get("train", True)
    if train is False:
        return call.default()
    keep = 1.0 - p
    over = x.new_empty(call.spec.inputs[0].shape)
    drawn = agreed_random_run(dataclasses.replace(call, func=aten.bernoulli_.float, args=[over, keep], kwargs={}))
    mask = local_from_full(drawn, call.mesh, call.choice.outputs[1])
    return (x * mask).mul_(0.0 if keep == 0 else 1.0 / keep), mask.bool()


NATIVE_DROPOUT = Rule(_dropout_sigs, run=_run_dropout,
                      doc="S(d)->(S(d), S(d)); B->(B, B); P(sum)->(P(sum), B); the mask drawn alike on every rank")
