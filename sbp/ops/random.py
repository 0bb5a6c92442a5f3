"""Random ops (ATen tag `nondeterministic_seeded`: `uniform_`, `normal_`, `bernoulli`, dropout, `rand_like`,
...): they have no sharding rule and run on Broadcast (full) inputs, like any fallback, but every rank
draws the same numbers. A seed agreed over the mesh (drawn from the op's generator, or the default one,
then all-gathered from the first rank: one small collective) seeds a fresh generator for the call, so
the Broadcast results agree on every rank and a later cut to the tensor's layout is consistent; the
generators the ranks hold advance as for any random call. On a single device the same op would draw other
numbers: what is reproduced is agreement across ranks, not the single-device values. Inside a compiled
graph no seed can be agreed (a collective on values): each rank draws from its own generator there, so
the draws agree when every rank seeded alike (``torch.manual_seed(s)`` on each, as for DTensor).

>>> import torch, sbp, sbp.testing
>>> def fn(mesh):
...     w = sbp.distribute(torch.zeros(4, 3), mesh, "S(0)")
...     torch.nn.init.normal_(w)                        # a consistent global tensor
...     return torch.equal(w.redistribute("B").to_local(), w.full())
>>> sbp.testing.spmd(fn, (2,))
[True, True]
"""
from __future__ import annotations

import threading
from typing import Any

import torch

from ..runtime.traced import is_tracing
from ..tensor.factories import agreed_seed
from .spec import Call

aten = torch.ops.aten
_DEFAULT_RNG = threading.Lock()   # ranks of the threads backend share the process's default generator


def is_random(func) -> bool:
    """Whether `func` draws random numbers (ATen tag `nondeterministic_seeded`).

    >>> is_random(torch.ops.aten.uniform_.default), is_random(torch.ops.aten.add.Tensor)
    (True, False)
    """
    return torch.Tag.nondeterministic_seeded in func.tags


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
    with _DEFAULT_RNG, torch.random.fork_rng(devices=[device] if cuda else []):   # restored after the call
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        return call.func(*call.args, **call.kwargs)
