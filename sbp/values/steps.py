"""Plan values: the frozen records a planner produces and an executor runs.

A `Step` changes the placements on `axes` (one group, flattened row-major when several axes) from
`src` to `dst`. The executor derives everything else (per-rank blocks, per-peer sizes) from the step,
the global shape and layout maths, so a step carries no rank-dependent data.

Step kinds:

========================  =====================================================================
kind                      meaning (on the group along `axes`)
========================  =====================================================================
``local``                 no communication: slice (``B -> S``), keep/zero (``B -> P``),
                          embed into the op's identity (``S -> P``)
``all_gather``            ``S(dims[0]) -> B`` on every axis of `axes`
``reduce_scatter``        ``P(op) -> S(dims[0])`` on every axis of `axes`
``all_reduce``            ``P(op) -> B`` on every axis of `axes`
``all_to_all``            ``S(dims[0]) -> S(dims[1])`` on one axis
``transfer``              exact point-to-point: any Split/Broadcast state -> any Split/Broadcast
                          state on the group; each rank receives exactly the bytes it lacks
``reduce_transfer``       exact point-to-point in two phases: same-op ``P(op)`` axes (and
                          Split/Broadcast axes) of the group -> Split/Broadcast; each piece of
                          the target is reduced at one member that needs it (phase 1), then
                          sent from there to the others that need it (phase 2)
========================  =====================================================================
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .placement import Placement
from .topology import Topology, traffic_axes

STEP_KINDS = ("local", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "transfer", "reduce_transfer")

STEP_CALLS = {kind: 0 if kind == "local" else 2 if kind == "reduce_transfer" else 1 for kind in STEP_KINDS}
"""Communication calls a step of each kind makes at most (`Step.calls`): none for ``local``, two for
``reduce_transfer`` (contributions to the owners, then results from them), one for every other kind."""


@dataclass(frozen=True, slots=True)
class Step:
    """One move of a plan.

    `bytes` is what the busiest rank of the step receives; `peak_bytes` the largest per-rank working
    memory while the step runs (input + output + communication buffers); `time_ns` its modeled time
    under the plan's topology (None: planned without one).

    >>> from sbp import S, B
    >>> Step("all_gather", (0,), (S(0),), (B,), dims=(0,), bytes=96)
    Step(all_gather, axes=(0,), (S(0),) -> (B,), dims=(0,), bytes=96)
    """

    kind: str
    axes: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    dims: tuple[int, ...] = ()
    op: Optional[str] = None
    bytes: int = 0
    peak_bytes: int = 0
    time_ns: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; valid: {STEP_KINDS}")

    @property
    def is_collective(self) -> bool:
        """True for every kind that communicates.

        >>> Step("local", (0,), (), ()).is_collective, Step("all_gather", (0,), (), ()).is_collective
        (False, True)
        """
        return self.kind != "local"

    @property
    def calls(self) -> int:
        """Communication calls the step makes at most: none for ``local``, two for ``reduce_transfer``
        (contributions to the owners, then results from them), one for every other kind.

        >>> Step("reduce_transfer", (0,), (), ()).calls, Step("all_reduce", (0,), (), ()).calls
        (2, 1)
        """
        return STEP_CALLS[self.kind]

    def to_dict(self) -> dict:
        """The step as plain JSON-ready data (`calls` as in `Step.calls`).

        >>> Step("reduce_transfer", (0, 1), (), (), op="sum", bytes=8).to_dict()["calls"]
        2
        """
        out = {"kind": self.kind, "axes": list(self.axes), "src": _fmt(self.src), "dst": _fmt(self.dst),
               "dims": list(self.dims), "op": self.op, "bytes": self.bytes, "peak_bytes": self.peak_bytes,
               "calls": self.calls}
        if self.time_ns is not None:
            out["time_us"] = self.time_ns / 1000
        return out

    def __repr__(self) -> str:
        extra = f", dims={self.dims}" if self.dims else ""
        extra += f", op={self.op}" if self.op else ""
        return f"Step({self.kind}, axes={self.axes}, {self.src} -> {self.dst}{extra}, bytes={self.bytes})"


@dataclass(frozen=True, slots=True)
class Plan:
    """A redistribution plan: the steps that turn `src` placements into `dst` placements.

    >>> import sbp
    >>> p = sbp.plan((8, 8), (2,), "S(0)", "B")
    >>> p.bytes_per_rank, p.num_collectives
    (128, 1)
    """

    global_shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    itemsize: int
    steps: tuple[Step, ...]
    lower_bound: int = 0
    topology: Optional[Topology] = None

    @property
    def time_us(self) -> Optional[float]:
        """Modeled time of the busiest rank under `topology`, summed over steps, in µs (None without one).

        >>> import sbp
        >>> t = sbp.Topology((1.0,), (8.0,))
        >>> sbp.plan((8, 8), (2,), "S(0)", "B", topology=t).time_us   # 1 round x 1 µs + 128 B / 8 GB/s
        1.016
        >>> sbp.plan((8, 8), (2,), "S(0)", "B").time_us is None
        True
        """
        if self.topology is None:
            return None
        return sum(s.time_ns or 0 for s in self.steps) / 1000

    @property
    def lower_bound_time_us(self) -> Optional[float]:
        """A lower bound on `time_us` (None without a topology): the lower bound's bytes over the fastest
        link of the mesh axes of size > 1, plus one round of the lowest latency when anything moves.

        >>> import sbp
        >>> sbp.plan((8, 8), (2,), "S(0)", "B", topology=sbp.Topology((1.0,), (8.0,))).lower_bound_time_us
        1.016
        """
        if self.topology is None:
            return None
        return self.topology.bound_ns(self.lower_bound, int(self.lower_bound > 0), traffic_axes(self.mesh_shape)) / 1000

    @property
    def bytes_per_rank(self) -> int:
        """Bytes the busiest rank receives, summed over steps.

        >>> import sbp
        >>> p = sbp.plan((8, 8), (2, 2), "P(sum), S(0)", "S(1), B")
        >>> [s.bytes for s in p.steps], p.bytes_per_rank
        ([64, 64], 128)
        """
        return sum(s.bytes for s in self.steps)

    @property
    def num_collectives(self) -> int:
        """Number of communication calls (`Step.calls`: a ``reduce_transfer`` makes two).

        >>> import sbp
        >>> sbp.plan((8, 8), (2, 2), "P(sum), S(0)", "S(1), B").num_collectives
        2
        """
        return sum(s.calls for s in self.steps)

    @property
    def peak_bytes(self) -> int:
        """Largest per-rank working memory of any step (at least the src and dst local blocks).

        >>> import sbp
        >>> sbp.plan((8, 8), (2,), "S(0)", "B").peak_bytes     # a 128-byte block in, 256 bytes out
        384
        """
        return max((s.peak_bytes for s in self.steps), default=0)

    def explain(self) -> str:
        """EXPLAIN-style text: a header, then one line per step with axes, collective, dims and bytes.

        >>> import sbp
        >>> print(sbp.plan((8, 8), (2,), "S(0)", "B").explain())
        Plan (S(0),) -> (B,)  shape=(8, 8) mesh=(2,) itemsize=4
          bytes/rank=128 (lower bound 128)  collectives=1  peak=384
          1. axes[0] all_gather           (S(0),) -> (B,) dims=0  bytes=128 peak=384
        """
        head = (f"Plan {_fmt(self.src)} -> {_fmt(self.dst)}  shape={tuple(self.global_shape)} "
                f"mesh={tuple(self.mesh_shape)} itemsize={self.itemsize}\n"
                f"  bytes/rank={self.bytes_per_rank} (lower bound {self.lower_bound})  "
                f"collectives={self.num_collectives}  peak={self.peak_bytes}")
        if self.topology is not None:
            head += (f"\n  time={self.time_us:.3f}us (lower bound {self.lower_bound_time_us:.3f}us)  "
                     f"topology={self.topology.name}")
        if not self.steps:
            return head + "\n  (no steps: layouts already agree)"
        lines = [head]
        for i, s in enumerate(self.steps, 1):
            axes = ",".join(str(a) for a in s.axes)
            what = s.kind + (f"({s.op})" if s.op else "")
            dims = "" if not s.dims else " dims=" + ",".join(str(d) for d in s.dims)
            lines.append(f"  {i}. axes[{axes}] {what:<20} {_fmt(s.src)} -> {_fmt(s.dst)}{dims}  "
                         f"bytes={s.bytes} peak={s.peak_bytes}"
                         + ("" if s.time_ns is None else f" time={s.time_ns / 1000:.3f}us"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The plan as plain JSON-ready data.

        >>> import sbp
        >>> d = sbp.plan((8, 8), (2,), "S(0)", "B").to_dict()
        >>> d["src"], d["dst"], d["bytes_per_rank"], [s["kind"] for s in d["steps"]]
        ('(S(0),)', '(B,)', 128, ['all_gather'])
        """
        return {
            "global_shape": list(self.global_shape),
            "mesh_shape": list(self.mesh_shape),
            "src": _fmt(self.src),
            "dst": _fmt(self.dst),
            "itemsize": self.itemsize,
            "steps": [s.to_dict() for s in self.steps],
            "bytes_per_rank": self.bytes_per_rank,
            "lower_bound_bytes": self.lower_bound,
            "num_collectives": self.num_collectives,
            "peak_bytes": self.peak_bytes,
        } | ({} if self.topology is None else {"time_us": self.time_us, "topology": self.topology.to_dict()})


def _fmt(pls: tuple[Placement, ...]) -> str:
    return repr(tuple(pls))
