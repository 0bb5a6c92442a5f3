"""Measure a mesh's network: `calibrate(mesh)` times real collectives per mesh axis and fits the alpha-beta
model of `sbp.Topology` by least squares.

Per axis (and for all axes flattened, the widest group the planner uses) every rank runs all_gathers of a
few sizes; a ring all_gather over ``n`` members takes ``n - 1`` rounds and receives ``(n - 1) x piece``
bytes, so ``time = (n - 1) x alpha + bytes / beta`` is a line in the received bytes: its intercept gives
alpha, its slope beta. The same with all_to_alls (every member sends a piece to every other, all posted
together) gives the latency per peer of exchanges, `Topology.exchange_us`. Each rank keeps the median
of a few repeats; the medians are max-reduced over the mesh so that every rank fits the same numbers and
so gets the same `Topology` (plans stay identical on every rank). `measure` returns the fits with their
residuals; `calibrate` only the topology.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..values.errors import SbpError
from ..values.mesh import DeviceMesh
from ..values.topology import Topology

SIZES = (1 << 12, 1 << 16, 1 << 19, 1 << 21)
"""Default bytes per member's piece (float32), from latency-bound to bandwidth-bound."""


@dataclass(frozen=True, slots=True)
class Fit:
    """The least-squares line of one group of axes and one collective (`kind`: all_gather or all_to_all):
    per size, the received bytes, the measured and the fitted time (µs); `alpha_us` = intercept / rounds
    (peers, for all_to_all), `beta_gbps` = 1 / slope (bytes per ns)."""

    axes: tuple[int, ...]
    members: int
    alpha_us: float
    beta_gbps: float
    received: tuple[int, ...]
    measured_us: tuple[float, ...]
    fitted_us: tuple[float, ...]
    kind: str = "all_gather"

    @property
    def residual(self) -> float:
        """Root mean square of the relative residuals (fitted / measured - 1).

        >>> Fit((0,), 2, 1.0, 1.0, (1000,), (2.0,), (2.2,)).residual
        0.1
        """
        errs = [(f / m - 1) ** 2 for f, m in zip(self.fitted_us, self.measured_us) if m > 0]
        return round((sum(errs) / max(1, len(errs))) ** 0.5, 12)


@dataclass(frozen=True, slots=True)
class Calibration:
    """What `measure` found: the fitted `topology` (one alpha/beta per axis) and every `Fit`, the flattened
    group last (its fit against the model's slowest-link prediction shows how far the model is)."""

    topology: Topology
    fits: tuple[Fit, ...]

    def table(self) -> str:
        """The fits as a text table (axes, members, alpha, beta, residual, measured vs fitted per size)."""
        rows = [f"{'axes':<10}{'kind':<12}{'n':>4}{'alpha us':>10}{'beta GB/s':>11}{'resid':>8}  "
                "measured / fitted us per size"]
        for f in self.fits:
            pts = "  ".join(f"{m:.1f}/{p:.1f}" for m, p in zip(f.measured_us, f.fitted_us))
            rows.append(f"{','.join(map(str, f.axes)):<10}{f.kind:<12}{f.members:>4}{f.alpha_us:>10.2f}"
                        f"{f.beta_gbps:>11.3f}{f.residual:>8.3f}  {pts}")
        return "\n".join(rows)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` (a, b); a single point gives a line through the origin.

    >>> fit_line([0, 1, 2], [1, 3, 5])
    (1.0, 2.0)
    """
    if len(xs) < 2:
        return 0.0, (ys[0] / xs[0] if xs and xs[0] else 0.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def measure(mesh: DeviceMesh, sizes: Sequence[int] = SIZES, repeats: int = 5,
            devices_per_host: Optional[int] = None, name: str = "calibrated") -> Calibration:
    """Time all_gathers and all_to_alls on every axis of the bound `mesh` (all ranks call it) and fit
    alpha and beta (all_gather) and the latency per peer of exchanges (all_to_all, `exchange_us`).

    `sizes` are bytes per member's piece; `devices_per_host` (optional) marks which axes cross hosts (as
    `Topology.for_mesh` does). Axes of size 1 never communicate: they get alpha 0 and the fastest beta.

    >>> import sbp.testing
    >>> def fn(mesh):
    ...     return measure(mesh, sizes=(256, 4096), repeats=1).topology.ndim
    >>> sbp.testing.spmd(fn, (2, 2))
    [2, 2, 2, 2]
    """
    if mesh.binding is None:
        raise SbpError("calibrate needs a mesh bound to a communicator (sbp.init_mesh, or inside sbp.testing.spmd); "
                       f"got the plain value {mesh!r}")
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in sizes):
        raise SbpError(f"calibrate sizes must be ints >= 4 (bytes per member's piece), got {tuple(sizes)!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise SbpError(f"calibrate repeats must be a positive int, got {repeats!r}")
    comm = mesh.binding
    device = "cuda" if mesh.device_type == "cuda" else "cpu"
    groups = [(a,) for a in range(mesh.ndim) if mesh.shape[a] > 1]
    if len(groups) > 1:
        groups.append(tuple(a for (a,) in groups))
    # every rank times every (kind, group, size); medians in one tensor, max-reduced so every rank fits the same
    kinds = ("all_gather", "all_to_all")
    medians = torch.zeros(len(kinds) * len(groups) * len(sizes), dtype=torch.float64, device=device)
    for i, (kind, axes, size) in enumerate(_cases(kinds, groups, sizes)):
        run = _collective(comm, kind, axes, max(1, size // 4), device)
        run()  # warm up (connections, buffers)
        runs = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            runs.append((time.perf_counter() - t0) * 1e6)
        medians[i] = statistics.median(runs)
    medians = comm.all_reduce(medians, tuple(range(mesh.ndim)), "max").cpu().tolist()
    fits = []
    for i, (kind, axes) in enumerate((k, g) for k in kinds for g in groups):
        n = 1
        for a in axes:
            n *= mesh.shape[a]
        received = tuple((n - 1) * max(1, s // 4) * 4 for s in sizes)
        ys = tuple(float(v) for v in medians[i * len(sizes):(i + 1) * len(sizes)])
        a, b = fit_line(received, ys)
        alpha = max(0.0, a / (n - 1))
        beta = 1e-3 / b if b > 0 else 1e6   # µs per byte -> bytes per ns (GB/s); a flat line: no bandwidth limit
        fitted = tuple((n - 1) * alpha + x * 1e-3 / beta for x in received)
        fits.append(Fit(axes, n, alpha, beta, received, ys, fitted, kind))
    per_axis = {f.axes[0]: f for f in fits if len(f.axes) == 1 and f.kind == "all_gather"}
    per_peer = {f.axes[0]: f for f in fits if len(f.axes) == 1 and f.kind == "all_to_all"}
    fastest = max((f.beta_gbps for f in per_axis.values()), default=1e6)
    alpha = tuple(per_axis[a].alpha_us if a in per_axis else 0.0 for a in range(mesh.ndim))
    beta = tuple(per_axis[a].beta_gbps if a in per_axis else fastest for a in range(mesh.ndim))
    peer = tuple(per_peer[a].alpha_us if a in per_peer else 0.0 for a in range(mesh.ndim))
    spans = None
    if devices_per_host is not None:
        spans = Topology.for_mesh(mesh.shape, devices_per_host, (0.0, 1.0), (0.0, 1.0)).spans_hosts
    return Calibration(Topology(alpha, beta, spans, name, peer), tuple(fits))


def _cases(kinds: Sequence[str], groups: Sequence[tuple[int, ...]], sizes: Sequence[int]):
    return [(k, g, s) for k in kinds for g in groups for s in sizes]


def _collective(comm, kind: str, axes: tuple[int, ...], numel: int, device: str):
    """A call of `kind` on the group along `axes`, each member sending `numel` floats to every other (all_to_all)
    or to all (all_gather)."""
    if kind == "all_gather":
        piece = torch.ones(numel, dtype=torch.float32, device=device)
        return lambda: comm.all_gather(piece, axes)
    n = len(comm.members(axes))
    inp = torch.ones(n * numel, dtype=torch.float32, device=device)
    out = torch.empty_like(inp)
    return lambda: comm.all_to_all_single(out, inp, (numel,) * n, (numel,) * n, axes)


def calibrate(mesh: DeviceMesh, sizes: Sequence[int] = SIZES, repeats: int = 5,
              devices_per_host: Optional[int] = None) -> Topology:
    """The `sbp.Topology` of the bound `mesh`, measured (`measure`; every rank calls it and gets the same).

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     t = sbp.calibrate(mesh, sizes=(256, 4096), repeats=1)
    ...     return sbp.plan((64, 64), mesh, "S(0), S(1)", "B, B", topology=t).time_us > 0
    >>> sbp.testing.spmd(fn, (2, 2))
    [True, True, True, True]
    """
    return measure(mesh, sizes, repeats, devices_per_host).topology


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
