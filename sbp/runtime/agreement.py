"""Do the ranks agree? `sbp.debug()` and the agreement checks behind it.

sbp is SPMD: every rank makes the same calls with the same placements, global shapes and dtypes. Ranks
that disagree are caught in two ways:

* **always, where it is free**: a call that communicates anyway carries a digest of its arguments in the
  same collective (`from_local` inferring the global shape; `distribute(..., src=r)`), so a mismatch is
  a `RankMismatchError` instead of a hang or garbage;
* **on every call under** ``with sbp.debug():`` (or ``SBP_DEBUG=1`` in the environment):
  `distribute`, `from_local`, `redistribute` (same mesh and cross-mesh, including the redistributions
  inside operators and backward passes) first all-gather a small signature -- dtype, global shape,
  placements, mesh and a hash of the plan (``plan.to_dict()``) -- and every rank raises the same
  `RankMismatchError` naming the disagreeing ranks and their values.

The public context manager is ``sbp.debug``; this module is ``sbp.runtime.agreement``.
The switch is a `ContextVar` (no global flag): it holds for the current thread or task. The threads
backend of `sbp.testing.spmd` copies the caller's context into each rank; the gloo backend sends the
setting along with the job. Every rank must agree on the switch itself (set ``SBP_DEBUG=1`` for all).

A check is one all_gather of one int64 per field (a 56-bit digest of the value's repr). Only when
digests differ -- which every rank sees in the same gathered table -- a second all_gather carries the
values' text, so the message can name them.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..values.errors import RankMismatchError, SbpError

_DEBUG: ContextVar[Optional[bool]] = ContextVar("sbp_debug", default=None)
TEXT_BYTES = 240  # per field and rank in the second (mismatch-only) gather; longer values are cut with "..."

Gather = Callable[[torch.Tensor], list[torch.Tensor]]  # every member's tensor, in member order


@contextmanager
def debug(enabled: bool = True) -> Iterator[None]:
    """Check on every call that all ranks pass the same placements, shapes and dtypes and plan alike.

    Inside the block, `distribute`, `from_local` and every redistribution all-gather a small signature
    first and raise `sbp.RankMismatchError` naming the ranks that differ. ``SBP_DEBUG=1`` turns it on for
    a whole run; ``sbp.debug(False)`` turns it off inside a block.

    >>> import sbp, sbp.testing, torch
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.ones(4), mesh, "S(0)")
    ...     return x.redistribute("B" if mesh.rank == 0 else "S(0)")   # rank 1 disagrees
    >>> with sbp.debug():
    ...     sbp.testing.spmd(fn, (2,))
    Traceback (most recent call last):
    ...
    sbp.testing.spmd.SpmdError: rank 0 of 2 raised RankMismatchError: redistribute: ranks disagree on dst placements (every rank must pass the same; SPMD): (B,) on ranks [0]; (S(0),) on ranks [1]
    """
    if not isinstance(enabled, bool):
        raise SbpError(f"sbp.debug(enabled) takes a bool, got {enabled!r}")
    token = _DEBUG.set(enabled)
    try:
        with backward_on_this_thread(enabled):
            yield
    finally:
        _DEBUG.reset(token)


def backward_on_this_thread(enabled: bool = True) -> "torch.autograd.set_multithreading_enabled | nullcontext":
    """While `enabled`: autograd runs every backward node on the thread that called ``backward()`` (for
    CUDA it otherwise uses a worker thread per device, where this thread's `ContextVar` switches --
    `sbp.debug()`, `sbp.strict()` -- are not set, so their checks would be silently off in backward).
    One GPU per process has one such worker anyway: nothing runs in parallel that would not otherwise.

    >>> with backward_on_this_thread():
    ...     torch.autograd.is_multithreading_enabled()
    False
    """
    return torch.autograd.set_multithreading_enabled(False) if enabled else nullcontext()


def is_enabled() -> bool:
    """Whether debug checks run here: the innermost `sbp.debug(...)`, else ``SBP_DEBUG`` (1/true/yes).

    >>> with debug():
    ...     is_enabled()
    True
    """
    value = _DEBUG.get()
    if value is not None:
        return value
    env = _environ_get(_ENV_KEY)  # hot path (every redistribute): usually unset
    if env is None:
        return False
    if isinstance(env, bytes):
        env = os.fsdecode(env)
    return env.strip().lower() in ("1", "true", "yes", "on")


# os.environ's own table read directly (a plain dict lookup; os.environ.get re-encodes the key per call).
# It is the table os.environ[...] = ... and monkeypatch.setenv update, so a change is still seen at once.
try:
    _environ_get, _ENV_KEY = os.environ._data.get, os.environ.encodekey("SBP_DEBUG")
except AttributeError:  # pragma: no cover - another os.environ implementation: use the public way
    _environ_get, _ENV_KEY = os.environ.get, "SBP_DEBUG"


def digest(value: Any) -> int:
    """A 56-bit digest of ``repr(value)`` (fits an int64; equal on every rank for equal values).

    >>> digest((1, 2)) == digest((1, 2)), digest("S(0)") == digest("B")
    (True, False)
    """
    text = value if isinstance(value, str) else repr(value)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


@lru_cache(maxsize=1024)
def plan_signature(plan: Any) -> str:
    """A short text naming a plan by a hash of ``plan.to_dict()`` (what every rank must compute alike).

    >>> import sbp
    >>> plan_signature(sbp.plan((4,), (2,), "S(0)", "B"))[:5]
    'plan '
    """
    # a cross-mesh plan has no to_dict; its EXPLAIN text lists every step and every piece's route
    data = (json.dumps(plan.to_dict(), sort_keys=True) if hasattr(plan, "to_dict") else
            plan.explain(limit=None)).encode()
    steps = len(plan.steps) if hasattr(plan, "steps") else len(plan.pieces)
    return f"plan {hashlib.blake2b(data, digest_size=7).hexdigest()} ({steps} {'steps' if hasattr(plan, 'steps') else 'pieces'})"


def mesh_gather(mesh: Any) -> tuple[Gather, tuple[int, ...]]:
    """The all_gather over every axis of a bound mesh (this rank inside it), and the member ranks.

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     gather, members = mesh_gather(mesh)
    ...     return members, [t.item() for t in gather(torch.tensor([mesh.rank * 10]))]
    >>> sbp.testing.spmd(fn, (2,))[1]
    ((0, 1), [0, 10])
    """
    axes = tuple(range(mesh.ndim))
    comm = mesh.binding
    return (lambda t: comm.all_gather(t, axes)), tuple(comm.members(axes))


def peer_gather(comm: Any, ranks: Sequence[int]) -> Gather:
    """An all_gather among arbitrary world `ranks` (this rank one of them) built on `comm.exchange`
    (point-to-point; used across the two meshes of a cross-mesh move, which share no process group).

    >>> import sbp, sbp.testing
    >>> def fn(world):
    ...     if world.rank == 1:
    ...         return None                                   # not among the ranks: takes no part
    ...     gather = peer_gather(world.binding, [0, 2, 3])
    ...     return [t.item() for t in gather(torch.tensor([world.rank]))]
    >>> sbp.testing.spmd(fn, (4,))
    [[0, 2, 3], None, [0, 2, 3], [0, 2, 3]]
    """
    ranks = tuple(sorted(ranks))

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        others = [r for r in ranks if r != comm.rank]
        got = comm.exchange(ranks, {r: [t] for r in others}, {r: [tuple(t.shape)] for r in others},
                            dtype=t.dtype, device=t.device)
        return [t if r == comm.rank else got[r][0] for r in ranks]

    return gather


def agree(gather: Gather, members: Sequence[int], what: str, fields: dict[str, Any],
          payload: Sequence[int] = (), device: "torch.device | str" = "cpu") -> list[list[int]]:
    """All-gather one digest per field plus `payload`; raise `RankMismatchError` when ranks differ.

    `members` are the world ranks in the gather's member order. Every member must call it with the same
    field names and payload length. Returns every member's payload (for checks that ride along on a
    collective the call needs anyway, e.g. `from_local`'s local shapes).

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     gather, members = mesh_gather(mesh)
    ...     return agree(gather, members, "demo", {"dtype": torch.float32}, payload=[mesh.rank])
    >>> sbp.testing.spmd(fn, (2,))[0]
    [[0], [1]]
    """
    names = list(fields)
    row = [digest(fields[n]) for n in names] + [int(v) for v in payload]
    table = [t.tolist() for t in gather(torch.tensor(row, dtype=torch.int64, device=device))]
    bad = [i for i, _ in enumerate(names) if len({r[i] for r in table}) > 1]
    if any(names[i] != "plan" for i in bad):  # different arguments explain a different plan: name them only
        bad = [i for i in bad if names[i] != "plan"]
    if bad:
        texts = _gather_texts(gather, [fields[names[i]] for i in bad], device)
        raise RankMismatchError(f"{what}: " + " | ".join(
            _describe(names[i], [t[k] for t in texts], members) for k, i in enumerate(bad)))
    return [r[len(names):] for r in table]


def mismatch(what: str, field: str, values: Sequence[Any], members: Sequence[int]) -> RankMismatchError:
    """The error for ranks whose `values` (one per member, member order) differ.

    >>> print(mismatch("distribute", "src", [0, 0, 1], [0, 1, 2]))
    distribute: ranks disagree on src (every rank must pass the same; SPMD): 0 on ranks [0, 1]; 1 on ranks [2]
    """
    return RankMismatchError(f"{what}: " + _describe(field, [_text(v) for v in values], members))


def _describe(field: str, values: Sequence[str], members: Sequence[int]) -> str:
    by_value: dict[str, list[int]] = {}
    for value, rank in zip(values, members):
        by_value.setdefault(value, []).append(rank)
    groups = sorted(by_value.items(), key=lambda kv: kv[1][0])
    return (f"ranks disagree on {field} (every rank must pass the same; SPMD): "
            + "; ".join(f"{value} on ranks {ranks}" for value, ranks in groups))


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    raw = text.encode()
    if len(raw) > TEXT_BYTES:
        raw = raw[:TEXT_BYTES - 3].decode(errors="ignore").encode() + b"..."
    return raw.decode()


def _gather_texts(gather: Gather, values: list[Any], device) -> list[list[str]]:
    buf = bytearray()
    for v in values:
        raw = _text(v).encode()
        buf += raw + b"\0" * (TEXT_BYTES - len(raw))
    rows = gather(torch.tensor(list(buf), dtype=torch.uint8, device=device))
    out = []
    for row in rows:
        data = bytes(row.cpu().tolist())
        out.append([data[k * TEXT_BYTES:(k + 1) * TEXT_BYTES].rstrip(b"\0").decode(errors="replace")
                    for k in range(len(values))])
    return out
