"""The network as a pure value: per mesh axis a latency (alpha, µs per message round) and a bandwidth
(beta, GB/s), and whether the axis's groups cross host boundaries; optionally a separate latency per peer
for exchanges (all_to_all, transfers, reduce_transfers), whose messages to different peers are posted
together rather than passed round a ring; optionally a fixed cost per collective call, whatever its group size.

`sbp.plan(..., topology=...)` prices a step as ``calls x call + rounds x alpha + bytes / beta`` of the
slowest link the step crosses (the largest call cost and alpha, the smallest beta over its axes of size > 1:
`traffic_axes`): the alpha-beta model, with a per-call term (0 unless `call_us` is given). Presets are
named by hardware (`PRESETS`, values from the public sources cited in docs/scale.md); `Topology.for_mesh`
places a mesh on hosts of ``devices_per_host`` devices (row-major, innermost axes first) and gives the axes
whose groups all lie inside a host the intra-host link, the others the inter-host link. `sbp.calibrate`
measures one. Saved and loaded as JSON (`to_json`, `from_json`).

>>> t = Topology.preset("dgx-h100", (4, 8))
>>> t.spans_hosts, t.beta_gbps
((True, False), (50.0, 450.0))
>>> Topology.from_json(t.to_json()) == t
True
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import PlanError
from .mesh import DeviceMesh, as_ints

# name -> (intra-host alpha µs, beta GB/s, inter-host alpha µs, beta GB/s); sources in docs/scale.md
PRESETS: dict[str, tuple[float, float, float, float]] = {
    # DTensor's own graph-planner model (torch/distributed/tensor/_collective_utils.py, MeshTopoInfo)
    "dtensor": (0.6, 87.7, 2.7, 87.7 * 0.22),
    # NVLink 4 (900 GB/s both ways per GPU) and 8x ConnectX-7 NDR 400 Gb/s (one per GPU)
    "dgx-h100": (0.6, 450.0, 2.7, 50.0),
    # NVLink 3 (600 GB/s both ways per GPU) and 8x ConnectX-6 HDR 200 Gb/s (one per GPU)
    "dgx-a100": (0.6, 300.0, 2.7, 25.0),
}
"""Hardware presets: intra-host (alpha µs, beta GB/s) then inter-host (alpha µs, beta GB/s)."""

MAX_LATENCY_US = 1e12
"""The largest latency a topology takes (µs; about 11 days), so that modeled times stay finite numbers."""
MIN_BANDWIDTH_GBPS = 1e-9
"""The smallest bandwidth a topology takes (GB/s: one byte per second), for the same reason."""


@dataclass(frozen=True, slots=True)
class Topology:
    """Per mesh axis: `latency_us` (alpha: µs per message round), `bandwidth_gbps` (beta: GB/s, i.e. bytes
    per ns) and `spans_hosts` (the axis's groups cross host boundaries); `exchange_us` (µs per peer of an
    exchange: all_to_all, transfer, reduce_transfer), None when it equals the latency; `call_us` (µs per
    collective call, whatever its group size: the fixed cost of entering and finishing a call), None for
    none. Frozen, hashable, compared by value; `alpha_us` and `beta_gbps` are the model's names for the
    first two.

    >>> Topology(latency_us=(1.0, 5.0), bandwidth_gbps=(200.0, 25.0)).alpha_us
    (1.0, 5.0)

    >>> t = Topology((1.0, 5.0), (200.0, 25.0))
    >>> t.link((0,)), t.link((0, 1))          # the slowest link a step over both axes crosses
    ((1.0, 200.0), (5.0, 25.0))
    >>> t.time_ns((1,), rounds=3, nbytes=25_000)   # 3 x 5 µs + 25,000 B / 25 GB/s
    16000
    >>> Topology((1.0, 5.0), (200.0, 25.0), call_us=(10.0, 30.0)).time_ns((1,), rounds=3, nbytes=25_000)
    46000
    """

    latency_us: tuple[float, ...]
    bandwidth_gbps: tuple[float, ...]
    spans_hosts: tuple[bool, ...] | None = None
    name: str = "custom"
    exchange_us: tuple[float, ...] | None = None
    call_us: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        alpha = _numbers(self.latency_us, "latency_us")
        beta = _numbers(self.bandwidth_gbps, "bandwidth_gbps")
        if not alpha:
            raise PlanError("a topology needs at least one mesh axis; got latency_us=()")
        if len(alpha) != len(beta):
            raise PlanError(f"a topology needs one latency and one bandwidth per mesh axis; got {len(alpha)} "
                            f"latency_us {alpha} and {len(beta)} bandwidth_gbps {beta}")
        if any(not 0 <= a <= MAX_LATENCY_US for a in alpha):
            raise PlanError(f"topology latency_us must be finite, >= 0 and <= {MAX_LATENCY_US:g} (µs per message "
                            f"round), got {alpha}")
        if any(b < MIN_BANDWIDTH_GBPS for b in beta):
            raise PlanError(f"topology bandwidth_gbps must be finite and > 0 (GB/s; at least {MIN_BANDWIDTH_GBPS:g}), "
                            f"got {beta}")
        spans = (False,) * len(alpha) if self.spans_hosts is None else self.spans_hosts
        try:
            spans = tuple(spans)
        except TypeError:
            raise PlanError(f"topology spans_hosts must be one bool per axis, got {self.spans_hosts!r}") from None
        if len(spans) != len(alpha) or any(not isinstance(s, bool) for s in spans):
            raise PlanError(f"topology spans_hosts must be one bool per axis ({len(alpha)}), got {spans}")
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"topology name must be a non-empty string, got {self.name!r}")
        for field, unit in (("exchange_us", "µs per peer of an exchange"), ("call_us", "µs per collective call")):
            given = getattr(self, field)
            if given is not None:  # optional per-axis latencies: one number >= 0 per axis
                values = _numbers(given, field)
                if len(values) != len(alpha) or any(not 0 <= v <= MAX_LATENCY_US for v in values):
                    raise PlanError(f"topology {field} must be one finite number >= 0 and <= {MAX_LATENCY_US:g} "
                                    f"per mesh axis ({len(alpha)}; {unit}) or None, got {values}")
                object.__setattr__(self, field, values)
        object.__setattr__(self, "latency_us", alpha)
        object.__setattr__(self, "bandwidth_gbps", beta)
        object.__setattr__(self, "spans_hosts", spans)

    @property
    def alpha_us(self) -> tuple[float, ...]:
        """`latency_us` under the model's name (alpha: µs per message round, per axis)."""
        return self.latency_us

    @property
    def beta_gbps(self) -> tuple[float, ...]:
        """`bandwidth_gbps` under the model's name (beta: GB/s, per axis)."""
        return self.bandwidth_gbps

    @property
    def ndim(self) -> int:
        """Number of mesh axes described.

        >>> Topology((1.0,), (10.0,)).ndim
        1
        """
        return len(self.alpha_us)

    # ---- building ----------------------------------------------------------------------------------
    @classmethod
    def for_mesh(cls, mesh_shape: Sequence[int], devices_per_host: int, intra: tuple[float, float],
                 inter: tuple[float, float], name: str = "custom") -> "Topology":
        """Place a mesh of `mesh_shape` on hosts of `devices_per_host` (row-major: the innermost axes fill a
        host first, as torch does): an axis whose groups all stay inside a host gets `intra` (alpha µs, beta
        GB/s), one with a group that crosses hosts gets `inter`. An axis of size > 1 is inside a host
        exactly when `devices_per_host` is a multiple of the product of its size and the later axes' sizes
        (its groups then tile the hosts), or the whole mesh fits on one host; an axis of size 1 always is.

        >>> Topology.for_mesh((2, 4, 8), 8, (1.0, 300.0), (5.0, 25.0)).spans_hosts
        (True, True, False)
        >>> Topology.for_mesh((8, 3), 8, (1.0, 300.0), (5.0, 25.0)).spans_hosts   # ranks 6, 7, 8 cross hosts
        (True, True)
        """
        shape = _shape(mesh_shape)
        per_host = as_ints((devices_per_host,))
        if per_host is None or per_host[0] < 1:
            raise PlanError(f"devices_per_host must be a positive int, got {devices_per_host!r}")
        devices_per_host = per_host[0]
        one_host = math.prod(shape) <= devices_per_host
        spans, inner = [], 1
        for n in reversed(shape):
            inner *= n   # a group of this axis lies in one block of `inner` consecutive ranks, and reaches across it
            spans.append(n > 1 and not one_host and devices_per_host % inner != 0)
        spans.reverse()
        links = {}
        for what, link in (("intra", intra), ("inter", inter)):
            links[what] = _numbers(link, what, "a pair (latency µs, bandwidth GB/s)")
            if len(links[what]) != 2:
                raise PlanError(f"topology {what} must be a pair (latency µs, bandwidth GB/s), got {link!r}")
        alpha = tuple(links["inter" if s else "intra"][0] for s in spans)
        beta = tuple(links["inter" if s else "intra"][1] for s in spans)
        return cls(alpha, beta, tuple(spans), name)

    @classmethod
    def preset(cls, name: str, mesh_shape: Sequence[int], devices_per_host: int = 8) -> "Topology":
        """A hardware preset (`PRESETS`) laid over `mesh_shape` with `devices_per_host` per host.

        >>> Topology.preset("dtensor", (2, 8)).alpha_us
        (2.7, 0.6)
        """
        if not isinstance(name, str) or name not in PRESETS:
            raise PlanError(f"unknown topology preset {name!r} (valid: {', '.join(sorted(PRESETS))})")
        ia, ib, xa, xb = PRESETS[name]
        return cls.for_mesh(mesh_shape, devices_per_host, (ia, ib), (xa, xb), name)

    # ---- the model ---------------------------------------------------------------------------------
    def link(self, axes: Sequence[int], exchange: bool = False) -> tuple[float, float]:
        """(alpha µs, beta GB/s) of the slowest link a step over `axes` crosses (no axes: the fastest);
        with `exchange`, the latency is the per-peer one of exchanges (`exchange_us`).

        >>> Topology((1.0, 5.0), (200.0, 25.0)).link(())
        (1.0, 200.0)
        >>> Topology((1.0, 5.0), (200.0, 25.0), exchange_us=(0.5, 2.0)).link((0, 1), exchange=True)
        (2.0, 25.0)
        """
        alpha = self.exchange_us if exchange and self.exchange_us is not None else self.alpha_us
        if not axes:
            return min(alpha), max(self.beta_gbps)
        return max(alpha[a] for a in axes), min(self.beta_gbps[a] for a in axes)

    def call_cost_us(self, axes: Sequence[int]) -> float:
        """µs per collective call over `axes`: the largest `call_us` of its axes (no axes: the smallest),
        0 without `call_us`.

        >>> Topology((1.0, 1.0), (1.0, 1.0), call_us=(3.0, 8.0)).call_cost_us((0, 1))
        8.0
        >>> Topology((1.0,), (1.0,)).call_cost_us((0,))
        0.0
        """
        if self.call_us is None:
            return 0.0
        return max(self.call_us[a] for a in axes) if axes else min(self.call_us)

    def time_ns(self, axes: Sequence[int], rounds: int, nbytes: int, exchange: bool = False, calls: int = 1) -> int:
        """Modeled time of one step, in whole ns (rounded up): ``calls x call + rounds x alpha + nbytes / beta``
        of the slowest link over `axes` (1 GB/s moves one byte per ns; call: `call_cost_us`); for an
        `exchange` (rounds: its peers), alpha is `exchange_us`. A step with no rounds and no bytes is free.
        `axes` are the axes the step's traffic crosses: the planner leaves out its axes of size 1.

        >>> Topology((2.0,), (10.0,)).time_ns((0,), 1, 1001)
        2101
        >>> Topology((2.0,), (10.0,), exchange_us=(0.5,)).time_ns((0,), 3, 0, exchange=True)
        1500
        >>> Topology((2.0,), (10.0,), call_us=(4.0,)).time_ns((0,), 1, 1001, calls=2)   # 2 calls x 4 µs more
        10101
        """
        if rounds <= 0 and nbytes <= 0:
            return 0
        alpha, beta = self.link(axes, exchange)
        return math.ceil((calls * self.call_cost_us(axes) + rounds * alpha) * 1000.0 + nbytes / beta)

    def bound_ns(self, nbytes: int, rounds: int, axes: Sequence[int] | None = None) -> int:
        """A lower bound on the time of any steps that receive `nbytes` at the busiest rank over at least
        `rounds` rounds: the fastest link of `axes` (None or none: every axis; the planner passes the axes
        of size > 1, the only ones traffic crosses), rounded down; with `call_us`, one call of the cheapest
        such axis when there is a round (a round is in some call; one call may hold all of them).

        >>> Topology((2.0, 1.0), (10.0, 100.0)).bound_ns(1000, 1)
        1010
        >>> Topology((2.0, 1.0), (10.0, 100.0), call_us=(5.0, 3.0)).bound_ns(1000, 2)   # + 1 call x 3 µs
        5010
        >>> Topology((2.0, 1.0), (10.0, 100.0)).bound_ns(1000, 1, axes=(0,))   # axis 1 has size 1: no traffic
        2100
        """
        if nbytes <= 0 and rounds <= 0:
            return 0
        axes = tuple(axes) if axes else tuple(range(self.ndim))
        alpha = min(self.alpha_us[a] for a in axes)
        if self.exchange_us is not None:
            alpha = min(alpha, min(self.exchange_us[a] for a in axes))
        call = min(self.call_us[a] for a in axes) if self.call_us is not None and rounds > 0 else 0.0
        return math.floor((call + rounds * alpha) * 1000.0 + nbytes / max(self.beta_gbps[a] for a in axes))

    def check(self, mesh_shape: Sequence[int]) -> "Topology":
        """This topology when it describes `mesh_shape` (one entry per axis), else a `PlanError`.

        >>> Topology((1.0,), (1.0,)).check((2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        sbp.values.errors.PlanError: topology 'custom' describes 1 mesh axes but the mesh (2, 2) has 2; ...
        """
        if len(mesh_shape) != self.ndim:
            raise PlanError(f"topology {self.name!r} describes {self.ndim} mesh axes but the mesh "
                            f"{tuple(mesh_shape)} has {len(mesh_shape)}; give one latency/bandwidth per axis")
        return self

    # ---- JSON --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: the name and one record per axis (`exchange_us`, `call_us` in it when set).

        >>> Topology((1.0,), (2.0,)).to_dict()
        {'name': 'custom', 'axes': [{'latency_us': 1.0, 'bandwidth_gbps': 2.0, 'spans_hosts': False}]}
        """
        axes = [{"latency_us": a, "bandwidth_gbps": b, "spans_hosts": s}
                for a, b, s in zip(self.alpha_us, self.beta_gbps, self.spans_hosts)]
        for field in ("exchange_us", "call_us"):
            if getattr(self, field) is not None:
                for rec, e in zip(axes, getattr(self, field)):
                    rec[field] = e
        return {"name": self.name, "axes": axes}

    @classmethod
    def from_dict(cls, data: Any) -> "Topology":
        """The topology of `to_dict`'s data (an axis's latency and bandwidth also under the model's names
        `alpha_us`, `beta_gbps`); missing or malformed fields are a `PlanError` naming them.

        >>> Topology.from_dict({"axes": [{"latency_us": 1, "bandwidth_gbps": 2}]}).bandwidth_gbps
        (2.0,)
        """
        if not isinstance(data, dict) or not isinstance(data.get("axes"), list):
            raise PlanError(f"a topology is a JSON object with an 'axes' list (one record per mesh axis with "
                            f"latency_us, bandwidth_gbps and optionally spans_hosts, exchange_us, call_us), got "
                            f"{str(data)[:200]!r}")
        unknown = sorted(set(data) - {"name", "axes"})
        if unknown:   # a misspelt field would be dropped silently
            raise PlanError(f"topology has unknown fields {unknown} (valid: 'name', 'axes')")
        alpha, beta, spans, peer, call = [], [], [], [], []
        for i, rec in enumerate(data["axes"]):
            if isinstance(rec, dict):
                unknown = sorted(set(rec) - set(_AXIS_FIELDS))
                twice = [pair for pair in (("latency_us", "alpha_us"), ("bandwidth_gbps", "beta_gbps"))
                         if set(pair) <= set(rec)]
                if unknown or twice:
                    raise PlanError(f"topology axis {i}: " + (f"unknown fields {unknown} (valid: "
                                    f"{', '.join(_AXIS_FIELDS)})" if unknown else
                                    f"{twice[0][0]!r} and {twice[0][1]!r} name one value: give one of them"))
            a = rec.get("latency_us", rec.get("alpha_us")) if isinstance(rec, dict) else None
            b = rec.get("bandwidth_gbps", rec.get("beta_gbps")) if isinstance(rec, dict) else None
            if a is None or b is None:
                raise PlanError(f"topology axis {i} must be an object with 'latency_us' and 'bandwidth_gbps', "
                                f"got {rec!r}")
            alpha.append(a)
            beta.append(b)
            spans.append(rec.get("spans_hosts", False))
            peer.append(rec.get("exchange_us"))
            call.append(rec.get("call_us"))
        for field, values in (("exchange_us", peer), ("call_us", call)):
            if any(e is None for e in values) and any(e is not None for e in values):
                raise PlanError(f"topology {field} must be given on every axis or on none, got {values}")
        return cls(tuple(alpha), tuple(beta), tuple(spans), data.get("name", "custom"),
                   None if peer and peer[0] is None else tuple(peer), None if call and call[0] is None else tuple(call))

    def to_json(self) -> str:
        """The topology as a JSON text (`from_json` reads it back).

        >>> Topology((1.0,), (2.0,), name="lab").to_json()[:16]
        '{"name": "lab", '
        """
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        """The topology of a JSON text written by `to_json`.

        >>> Topology.from_json('{"axes": [{"latency_us": 3, "bandwidth_gbps": 4}]}').latency_us
        (3.0,)
        """
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError) as e:   # (RecursionError: nested too deep)
            raise PlanError(f"a topology must be JSON text ({e}), got {str(text)[:200]!r}") from None
        return cls.from_dict(data)


def traffic_axes(mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The mesh axes that traffic can cross: those of size > 1. Along an axis of size 1 a group has one
    member, so nothing crosses its link and a step's time and the time bound leave it out.

    >>> traffic_axes((4, 1, 8))
    (0, 2)
    """
    return tuple(a for a, n in enumerate(mesh_shape) if n > 1)


_AXIS_FIELDS = ("latency_us", "bandwidth_gbps", "spans_hosts", "exchange_us", "call_us", "alpha_us", "beta_gbps")


def _numbers(values: Any, what: str, each: str = "one per mesh axis") -> tuple[float, ...]:
    try:
        out = tuple(values)
    except TypeError:
        raise PlanError(f"topology {what} must be a sequence of numbers, {each}, got {values!r}") from None
    try:
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in out):
            raise OverflowError
    except OverflowError:   # (also: an int too large for a float)
        raise PlanError(f"topology {what} must be finite numbers, {each}, got "
                        f"{str(out)[:200]}") from None
    return tuple(float(v) for v in out)


def _shape(mesh_shape: "DeviceMesh | Sequence[int]") -> tuple[int, ...]:
    if isinstance(mesh_shape, DeviceMesh):
        return mesh_shape.shape
    try:
        shape = as_ints(tuple(mesh_shape))
    except TypeError:
        raise PlanError(f"a mesh shape is a tuple of positive ints, got {mesh_shape!r}") from None
    if not shape or any(n < 1 for n in shape):
        raise PlanError(f"a mesh shape is a non-empty tuple of positive ints, got {mesh_shape!r}")
    return shape

