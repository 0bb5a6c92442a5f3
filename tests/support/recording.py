"""A recording stand-in for the torch.distributed calls of sbp's dist backend (tests only).

Inside ``with RecordingDist(device):`` every tensor sbp hands to torch.distributed is logged (collective,
group ranks, dtype, device) and checked against what a CUDA/NCCL run would refuse: a tensor on another
device than the mesh's declared one, or a dtype NCCL has no type for (int16; complex in reduce_scatter,
where torch does not view it as real itself). On gloo both would often pass silently; here they are
`violations`. The real call still runs (on gloo), so results stay checkable.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from sbp.runtime.backends import dist as sbp_dist

# dtypes NCCL has a type for (bool travels as uint8)
NCCL_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool})
# torch.distributed views complex as real itself in these (not in reduce_scatter)
VIEWS_COMPLEX = frozenset({"all_reduce", "all_gather", "all_to_all_single", "isend", "irecv"})


@dataclass(frozen=True)
class Call:
    """One torch.distributed call as this rank made it."""

    name: str
    group: tuple[int, ...]
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]


@dataclass
class RecordingDist:
    """Patch torch.distributed (and sbp's aliases of it) to log and check every call; undo on exit."""

    device: "torch.device | str"
    calls: list[Call] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    _undo: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)

    def _group(self, group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))

    def _note(self, name: str, group, tensors: list[torch.Tensor]) -> None:
        call = Call(name, self._group(group), tuple(str(t.dtype) for t in tensors),
                    tuple(str(t.device) for t in tensors))
        self.calls.append(call)
        for t in tensors:
            if t.device != self.device:
                self.violations.append(f"{name} on ranks {call.group}: tensor on {t.device}, mesh device {self.device}")
            if t.dtype not in NCCL_DTYPES and not (t.dtype.is_complex and name in VIEWS_COMPLEX):
                self.violations.append(f"{name} on ranks {call.group}: dtype {t.dtype} (NCCL has no such type)")

    def _wrap(self, owner, attr: str, name: str, tensors) -> None:
        real = getattr(owner, attr)

        @functools.wraps(real)
        def wrapper(*args, **kwargs):
            found, group = tensors(*args, **kwargs)
            self._note(name, group, found)
            return real(*args, **kwargs)

        self._undo.append((owner, attr, real))
        setattr(owner, attr, wrapper)
        if owner is dist and getattr(c10d, attr, None) is real:   # P2POp checks its op against c10d's own
            self._undo.append((c10d, attr, real))
            setattr(c10d, attr, wrapper)

    def __enter__(self) -> "RecordingDist":
        grp = lambda kw: kw.get("group")
        self._wrap(dist, "all_reduce", "all_reduce", lambda t, *a, **kw: ([t], grp(kw)))
        self._wrap(dist, "all_to_all_single", "all_to_all_single", lambda out, inp, *a, **kw: ([out, inp], grp(kw)))
        self._wrap(dist, "isend", "isend", lambda t, *a, **kw: ([t], grp(kw)))
        self._wrap(dist, "irecv", "irecv", lambda t, *a, **kw: ([t], grp(kw)))
        self._wrap(dist, "barrier", "barrier", lambda *a, **kw: ([], grp(kw)))
        self._wrap(dist, "batch_isend_irecv", "batch_isend_irecv",
                   lambda ops: ([op.tensor for op in ops], ops[0].group if ops else None))
        self._wrap(sbp_dist, "_all_gather_flat", "all_gather", lambda out, inp, **kw: ([out, inp], grp(kw)))
        self._wrap(sbp_dist, "_reduce_scatter_flat", "reduce_scatter", lambda out, inp, **kw: ([out, inp], grp(kw)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, real in reversed(self._undo):
            setattr(owner, attr, real)
        self._undo.clear()


def unmatched_calls(per_rank: list[list[Call]]) -> list[str]:
    """Groups on which the members did not all make the same calls (an NCCL hang): per group, each member's
    sequence of call names must be the same, and every member must make them."""
    by_group: dict[tuple[int, ...], dict[int, list[str]]] = {}
    for rank, calls in enumerate(per_rank):
        for c in calls:
            by_group.setdefault(c.group, {}).setdefault(rank, []).append(c.name)
    out = []
    for group, seqs in sorted(by_group.items()):
        want = seqs.get(group[0])
        for member in group:
            if seqs.get(member) != want:
                out.append(f"group {group}: rank {member} made {seqs.get(member)}, rank {group[0]} made {want}")
    return out
