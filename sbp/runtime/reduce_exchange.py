"""Running a ``reduce_transfer`` step on this rank: reduce each piece at its owner, then deliver it.

The schedule is `sbp.planning.exchange.reduce_exchange` (pure layout maths, the same one the planner prices).
Two exact exchanges with per-peer sizes on the step's group (messages, unless the communicator's
`exchange_route` is "all_to_all"):

=========  =======================================================================================
phase      this rank
=========  =======================================================================================
1          sends slices of its contribution to the owners that lack them, receives the
           contributions of the blocks it owns, and reduces them (its own one first) into its output
2          sends its reduced blocks to the other members that need them, receives the rest of its
           output from their owners
=========  =======================================================================================

Every element is reduced once, at one rank, so all the copies a target holds are bit-identical. A
phase in which no member of the group receives anything makes no call (every member knows it from
the schedule alone), so the counters see at most two exchanges and exactly the planned bytes.
"""
from __future__ import annotations

import functools

import torch

from ..planning.exchange import Pairs, reduce_exchange
from ..values.layout import Block, block, block_numel, block_shape, relative
from ..values.placement import Partial
from ..values.steps import Step
from .communicator import Communicator, reduce_list


def run_reduce_transfer(step: Step, local: torch.Tensor, global_shape: tuple[int, ...],
                        mesh_shape: tuple[int, ...], coord: tuple[int, ...], comm: Communicator) -> torch.Tensor:
    """This rank's block of `step.dst` from its contribution `local` (its block of `step.src`).

    >>> import sbp, sbp.testing, torch
    >>> from sbp.runtime.executor import execute
    >>> def fn(mesh):   # (p, h) holds contribution p + 1 of row half h; the result is 3 everywhere
    ...     p = sbp.plan((4, 2), mesh, "P, S(0)", "S(0), B")
    ...     out = execute(p, torch.full((2, 2), mesh.coord[0] + 1.0), mesh)
    ...     return p.steps[0].kind, out.tolist()
    >>> sbp.testing.spmd(fn, (2, 2))[1]
    ('reduce_transfer', [[3.0, 3.0], [3.0, 3.0]])
    """
    ex = reduce_exchange(global_shape, mesh_shape, step.src, step.dst, step.axes, coord)
    me = ex.members.index(coord)
    have, want = block(global_shape, mesh_shape, step.src, coord), block(global_shape, mesh_shape, step.dst, coord)
    out = local.new_empty(block_shape(want))
    op = step.op or next(step.src[a].op for a in step.axes if isinstance(step.src[a], Partial))
    # phase 1: contributions to the owners, reduced there
    arrived: dict[Block, list[torch.Tensor]] = {}
    if any(ex.recv1):
        for b, piece in _all_to_all(comm, step.axes, ex.send1[me], ex.recv1[me], len(ex.members), local, have):
            arrived.setdefault(b, []).append(piece)
    for b, holds in ex.owned[me]:
        parts = ([local[relative(b, have)]] if holds else []) + arrived.get(b, [])
        out[relative(b, want)] = parts[0] if len(parts) == 1 else reduce_list(parts, op)
    # phase 2: results from the owners to every other member that needs them
    if any(ex.recv2):
        for b, piece in _all_to_all(comm, step.axes, ex.send2[me], ex.recv2[me], len(ex.members), out, want):
            out[relative(b, want)] = piece
    return out


def _all_to_all(comm: Communicator, axes: tuple[int, ...], send: Pairs, recv: Pairs, n: int, source: torch.Tensor,
                held: Block) -> list[tuple[Block, torch.Tensor]]:
    """One exact exchange: the blocks in `send` cut out of `source` (which holds `held`), one flat message
    per peer (packed when its turn comes); returns the received blocks, shaped, in the order of `recv`."""
    outbox: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for peer, b in send:
        outbox[peer].append(source[relative(b, held)])
    sizes = [0] * n
    for peer, b in recv:
        sizes[peer] += block_numel(b)
    if comm.exchange_route != "all_to_all":  # messages copy no more here: a block in one run goes as it is
        got = {peer: source.new_empty(k) for peer, k in enumerate(sizes) if k}
        comm.send_recv([(peer, functools.partial(_flat, parts)) for peer, parts in enumerate(outbox) if parts],
                       list(got.items()), axes, dtype=source.dtype)
    else:
        empty = source.new_empty(0)
        got = dict(enumerate(comm.all_to_all([_flat(parts) if parts else empty for parts in outbox],
                                             [(k,) for k in sizes], axes)))
    offsets = [0] * n
    out = []
    for peer, b in recv:
        k = block_numel(b)
        out.append((b, got[peer][offsets[peer]:offsets[peer] + k].view(block_shape(b))))
        offsets[peer] += k
    return out


def _flat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The blocks back to back in one contiguous flat tensor (a view of a single contiguous block)."""
    return parts[0].contiguous().view(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])
