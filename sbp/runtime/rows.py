"""Moving runs of rows between two tilings of one row range: the exchange behind a view whose split rows do
not fall where the output's split puts them (`sbp.ops.views`: ``(B, T, C) -> (B*T, C)`` with B split
unevenly).

Each member of a group holds one contiguous run of rows before (`have`) and one after (`want`); both
lists tile the same range in member order. A member sends every other member the overlap of its own
run before with theirs after, and keeps its own overlap. Eagerly only the non-empty messages travel
(point-to-point); in a traced graph it is one functional ``all_to_all_single`` whose split sizes may be
symbolic (`torch.sym_max` / `torch.sym_min`: no guard is recorded), so one graph serves every size of a
symbolic dim that the runs are made of.

>>> import sbp, sbp.testing, torch
>>> def fn(mesh):   # rows 0-2 on member 0 and 3-4 on member 1 become 0-1 and 2-4
...     have, want = [(0, 3), (3, 5)], [(0, 2), (2, 5)]
...     lo, hi = have[mesh.coord[0]]
...     return move_rows(torch.arange(5)[lo:hi], have, want, mesh.coord[0], (0,), mesh).tolist()
>>> sbp.testing.spmd(fn, (2,))
[[0, 1], [2, 3, 4]]
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..values.mesh import DeviceMesh
from . import traced

Run = tuple  # (start, stop): ints, or SymInts under torch.compile with dynamic shapes


def _overlap(a: Run, b: Run, tracing: bool) -> tuple:
    """(start, length) of the overlap of run `a` with run `b`; where they do not meet, length 0 at a start
    inside `a` (a narrow of `a`'s rows there is valid, also for symbolic sizes)."""
    lo, hi = (torch.sym_max, torch.sym_min) if tracing else (max, min)
    start = hi(lo(a[0], b[0]), a[1])
    return start, lo(hi(a[1], b[1]) - start, 0)


def move_rows(local: torch.Tensor, have: Sequence[Run], want: Sequence[Run], me: int, axes: tuple[int, ...],
              mesh: DeviceMesh) -> torch.Tensor:
    """This member's rows of the `want` tiling from its rows (`local`, along dim 0) of the `have` tiling;
    `have` / `want` list every member's run in member order (`DeviceMesh` row-major order along `axes`).
    The result is a new tensor on every member (never a view of `local`). See the module's example."""
    tracing = traced.is_tracing(local)
    mine, target = have[me], want[me]
    sends = [_overlap(mine, w, tracing) for w in want]              # to each member: (global start, length)
    recvs = [_overlap(target, h, tracing) for h in have]            # from each member
    comm = mesh.binding
    # the result has the length of this member's run (under compile an expression as simple as its block's;
    # a concatenation of the pieces would have the sum of their lengths as its size, which later views of
    # the block cannot follow)
    out = local.new_empty((target[1] - target[0],) + tuple(local.shape[1:]))
    if tracing:
        name, _, order = traced.group_name(comm, axes)
        if list(order) == sorted(order):
            # group ranks in member order: the overlaps tile this member's run before (and after) in that
            # order, so the run goes as it is and what arrives is the run after, with no cut or concatenation
            # (each op traced costs tens of milliseconds of compile time with symbolic sizes)
            got = traced.all_to_all_rows(local, [recvs[m][1] for m in order], [sends[m][1] for m in order], name)
            return out.copy_(got)
        parts = [local.narrow(0, sends[m][0] - mine[0], sends[m][1]) for m in order]
        got = traced.all_to_all_rows(torch.cat(parts), [recvs[m][1] for m in order],
                                     [sends[m][1] for m in order], name)
        at = 0
        for m in order:   # pieces arrive in group-rank order
            out.narrow(0, recvs[m][0] - target[0], recvs[m][1]).copy_(got.narrow(0, at, recvs[m][1]))
            at = at + recvs[m][1]
        return out
    messages, inbox = [], []
    for m, ((s_start, s_len), (r_start, r_len)) in enumerate(zip(sends, recvs)):
        if m == me:
            if s_len:
                at = s_start - mine[0]
                out[r_start - target[0]:r_start - target[0] + r_len] = local[at:at + s_len]
            continue
        if s_len:
            messages.append((m, local[s_start - mine[0]:s_start - mine[0] + s_len].contiguous()))
        if r_len:
            inbox.append((m, out[r_start - target[0]:r_start - target[0] + r_len]))
    comm.send_recv(messages, inbox, axes, dtype=out.dtype)   # every member calls it, also one with nothing to move
    return out


__all__ = ["move_rows"]
