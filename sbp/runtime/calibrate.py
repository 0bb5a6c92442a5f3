"""Measure a mesh's network: `calibrate(mesh)` times real collectives per mesh axis and fits the alpha-beta
model of `sbp.Topology` (with its cost per call) by least squares.

Per axis (and for all axes flattened, the widest group the planner uses) every rank runs all_gathers of a
few sizes; a ring all_gather over ``n`` members takes ``n - 1`` rounds and receives ``(n - 1) x piece``
bytes, so ``time = call + (n - 1) x alpha + bytes / beta`` is a line in the received bytes: its slope
gives beta, its intercept ``call + (n - 1) x alpha``. The same with all_to_alls (every member sends a
piece to every other, all posted together) gives ``call + (n - 1) x exchange``. The intercepts of
groups of different sizes part the two (`fit_latencies`: least squares of the relative errors, a
multi-axis group at the pace of its slowest axis, as the planner prices it): the cost of a call
(`Topology.call_us`, the same on every axis; 0 when all groups have one size), per axis alpha and the
latency per peer of exchanges (`Topology.exchange_us`). Each rank keeps the median of a few repeats; the
medians are max-reduced over the mesh so that every rank fits the same numbers and so gets the same
`Topology` (plans stay identical on every rank). `measure` returns the fits with their residuals;
`calibrate` only the topology.
"""
from __future__ import annotations

import itertools
import math
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
    group last (its fit against the model's slowest-link prediction shows how far the model is);
    `intercepts`: per (kind, group) its rounds, its measured µs at no bytes (the line's intercept) and the
    model's (`call_us` + rounds x the per-round latency of its slowest axis), which `fit_latencies` fitted."""

    topology: Topology
    fits: tuple[Fit, ...]
    intercepts: tuple[tuple[str, tuple[int, ...], int, float, float], ...] = ()

    def table(self) -> str:
        """The fits as a text table (axes, members, alpha, beta, residual, measured vs fitted per size),
        then the cost per call and the intercepts it was fitted from against the model's."""
        rows = [f"{'axes':<10}{'kind':<12}{'n':>4}{'alpha us':>10}{'beta GB/s':>11}{'resid':>8}  "
                "measured / fitted us per size"]
        for f in self.fits:
            pts = "  ".join(f"{m:.1f}/{p:.1f}" for m, p in zip(f.measured_us, f.fitted_us))
            rows.append(f"{','.join(map(str, f.axes)):<10}{f.kind:<12}{f.members:>4}{f.alpha_us:>10.2f}"
                        f"{f.beta_gbps:>11.3f}{f.residual:>8.3f}  {pts}")
        if self.topology.call_us is not None:
            pts = "  ".join(f"{kind} {','.join(map(str, axes))}: {i:.1f}/{m:.1f}"
                            for kind, axes, _, i, m in self.intercepts)
            rows.append(f"per call {max(self.topology.call_us):.2f} us; at no bytes, measured / model us: {pts}")
        return "\n".join(rows)


def fit_line(xs: Sequence[float], ys: Sequence[float], relative: bool = False) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` (a, b); a single point gives a line through the origin. With
    `relative` (every y > 0), the squares of the relative residuals ``fitted / y - 1`` are minimised
    (weights ``1 / y²``), so that the small ys (the intercept's, for timings) count as much as the large ones.

    >>> fit_line([0, 1, 2], [1, 3, 5])
    (1.0, 2.0)
    >>> a, b = fit_line([0, 10, 100], [1, 2, 100], relative=True)   # the two small points decide the intercept
    >>> round(a, 3), round(fit_line([0, 10, 100], [1, 2, 100])[0], 3)
    (0.924, -3.401)
    """
    if len(xs) < 2:
        return 0.0, (ys[0] / xs[0] if xs and xs[0] else 0.0)
    ws = [1.0 / (y * y) for y in ys] if relative and all(y > 0 for y in ys) else [1.0] * len(ys)
    total = math.fsum(ws)
    mx = math.fsum(w * x for w, x in zip(ws, xs)) / total
    my = math.fsum(w * y for w, y in zip(ws, ys)) / total
    sxx = math.fsum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    b = math.fsum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def measure(mesh: DeviceMesh, sizes: Sequence[int] = SIZES, repeats: int = 5,
            devices_per_host: Optional[int] = None, name: str = "calibrated") -> Calibration:
    """Time all_gathers and all_to_alls on every axis of the bound `mesh` (all ranks call it) and fit
    alpha and beta (all_gather), the latency per peer of exchanges (all_to_all, `exchange_us`) and the
    cost per call (`call_us`), from groups of several sizes (`fit_topology`).

    `sizes` are bytes per member's piece; `devices_per_host` (optional) marks which axes cross hosts (as
    `Topology.for_mesh` does). Axes of size 1 never communicate: they get alpha 0 and the fastest beta.

    >>> import sbp.testing
    >>> def fn(mesh):
    ...     return measure(mesh, sizes=(256, 4096), repeats=1).topology.ndim
    >>> sbp.testing.spmd(fn, (2, 2))
    [2, 2, 2, 2]
    """
    if not isinstance(mesh, DeviceMesh):
        raise SbpError(f"calibrate needs a bound sbp.DeviceMesh (sbp.init_mesh, or inside sbp.testing.spmd), got "
                       f"{type(mesh).__name__}: {mesh!r}")
    if not isinstance(sizes, (tuple, list)):
        raise SbpError(f"calibrate sizes must be a tuple or list of ints >= 4 (bytes per member's piece), got "
                       f"{sizes!r}")
    if mesh.binding is None:
        raise SbpError("calibrate needs a mesh bound to a communicator (sbp.init_mesh, or inside sbp.testing.spmd); "
                       f"got the plain value {mesh!r}")
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 4 for s in sizes):
        raise SbpError(f"calibrate sizes must be ints >= 4 (bytes per member's piece), got {tuple(sizes)!r}")
    if len(set(sizes)) < 2:   # a latency and a bandwidth are a line through the times: one size fits any
        raise SbpError(f"calibrate sizes must hold at least two different sizes (a latency and a bandwidth are "
                       f"fitted to the times), got {tuple(sizes)!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise SbpError(f"calibrate repeats must be a positive int, got {repeats!r}")
    comm = mesh.binding
    device = "cuda" if mesh.device_type == "cuda" else "cpu"
    groups = groups_of(mesh.shape)
    # every rank times every (kind, group, size); medians in one tensor, max-reduced so every rank fits the same
    medians = torch.zeros(len(KINDS) * len(groups) * len(sizes), dtype=torch.float64, device=device)
    for i, (kind, axes, size) in enumerate(_cases(KINDS, groups, sizes)):
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
    timings = {kg: medians[i * len(sizes):(i + 1) * len(sizes)]
               for i, kg in enumerate((k, g) for k in KINDS for g in groups)}
    return fit_topology(mesh.shape, sizes, timings, devices_per_host, name)


KINDS = ("all_gather", "all_to_all")
"""The collectives `measure` times, on every group of `groups_of`."""


def groups_of(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """The groups `measure` times: every axis of more than one member, then (with two or more of them) all
    of them flattened.

    >>> groups_of((2, 1, 4))
    [(0,), (2,), (0, 2)]
    """
    groups = [(a,) for a, n in enumerate(mesh_shape) if n > 1]
    return groups + [tuple(a for (a,) in groups)] if len(groups) > 1 else groups


def fit_topology(mesh_shape: Sequence[int], sizes: Sequence[int], timings: dict, devices_per_host: Optional[int] = None,
                 name: str = "calibrated") -> Calibration:
    """The `Calibration` of measured `timings`: per (kind in `KINDS`, group of `groups_of(mesh_shape)`), the
    µs of one call per size of `sizes` (bytes per member's piece). Each line in the received bytes gives beta
    (its slope; the all_gather's, per axis) and an intercept; the intercepts of all groups give the cost per
    call and each axis's latency per ring round (all_gather) and per exchange peer (all_to_all):
    `fit_latencies`. `devices_per_host` only marks `spans_hosts`.

    >>> sizes = (1024, 65536)
    >>> def us(n, size, call, per_round):   # call + rounds x latency + received bytes at 1 GB/s
    ...     return call + (n - 1) * (per_round + size / 1000)
    >>> timings = {(k, g): [us(n, s, 3.0, r) for s in sizes] for k, r in (("all_gather", 2.0), ("all_to_all", 1.0))
    ...            for g, n in (((0,), 2), ((1,), 4), ((0, 1), 8))}
    >>> t = fit_topology((2, 4), sizes, timings).topology
    >>> [round(v, 6) for v in t.call_us + t.alpha_us + t.exchange_us + t.beta_gbps]
    [3.0, 3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    """
    groups = groups_of(mesh_shape)
    fits, intercepts = [], {}
    for kind, axes in ((k, g) for k in KINDS for g in groups):
        n = math.prod(mesh_shape[a] for a in axes)
        received = tuple((n - 1) * max(1, s // 4) * 4 for s in sizes)
        ys = tuple(float(v) for v in timings[kind, axes])
        a, b = fit_line(received, ys, relative=True)
        intercepts[kind, axes] = (n - 1, a)
        alpha = max(0.0, a / (n - 1))
        beta = 1e-3 / b if b > 0 else 1e6   # µs per byte -> bytes per ns (GB/s); a flat line: no bandwidth limit
        fitted = tuple((n - 1) * alpha + x * 1e-3 / beta for x in received)
        fits.append(Fit(axes, n, alpha, beta, received, ys, fitted, kind))
    per_axis = {f.axes[0]: f for f in fits if len(f.axes) == 1 and f.kind == "all_gather"}
    fastest = max((f.beta_gbps for f in per_axis.values()), default=1e6)
    ndim = len(mesh_shape)
    beta = tuple(per_axis[a].beta_gbps if a in per_axis else fastest for a in range(ndim))
    spans = None
    if devices_per_host is not None:
        spans = Topology.for_mesh(mesh_shape, devices_per_host, (0.0, 1.0), (0.0, 1.0)).spans_hosts
    call, per = fit_latencies(intercepts)
    alpha = tuple(per.get(("all_gather", a), 0.0) for a in range(ndim))
    peer = tuple(per.get(("all_to_all", a), 0.0) for a in range(ndim))
    topology = Topology(alpha, beta, spans, name, peer, (call,) * ndim)
    points = tuple((kind, axes, r, i, call + r * max(per[kind, a] for a in axes))
                   for (kind, axes), (r, i) in intercepts.items())
    return Calibration(topology, tuple(fits), points)


def fit_latencies(intercepts: dict) -> tuple[float, dict]:
    """The cost per call and the µs per round of every (kind, axis) that best predict the measured
    `intercepts` (per (kind, group axes): (rounds, µs at no bytes)) under the model: a group's intercept is
    ``call + rounds x`` the largest per-round latency of its axes. Weighted least squares on relative
    errors, for each choice of the slowest axis of the multi-axis groups (the one whose solution agrees
    with it and fits best wins); negative values become 0. With one group size only, a call's cost cannot
    be told from its rounds' and is 0 (each group's intercept / rounds is its latency).

    >>> points = {("all_gather", (0,)): (1, 5.0), ("all_gather", (1,)): (3, 9.0), ("all_gather", (0, 1)): (7, 17.0),
    ...           ("all_to_all", (0,)): (1, 4.0), ("all_to_all", (1,)): (3, 6.0), ("all_to_all", (0, 1)): (7, 10.0)}
    >>> call, per = fit_latencies(points)        # 3 µs per call, 2 µs per ring round, 1 µs per exchange peer
    >>> round(call, 6), {k: round(v, 6) for k, v in per.items()}
    (3.0, {('all_gather', 0): 2.0, ('all_gather', 1): 2.0, ('all_to_all', 0): 1.0, ('all_to_all', 1): 1.0})
    """
    if not intercepts:
        return 0.0, {}
    axes = sorted({g[0] for _, g in intercepts if len(g) == 1})
    kinds = sorted({k for k, _ in intercepts})
    unknowns = [(k, a) for k in kinds for a in axes]
    multi = [kg for kg in intercepts if len(kg[1]) > 1]
    with_call = len({r for r, _ in intercepts.values()}) > 1
    top = max(abs(i) for _, i in intercepts.values())
    best = None
    for choice in itertools.product(*(g for _, g in multi)):   # the slowest axis of each multi-axis group
        slowest = dict(zip(multi, choice))
        call, per, loss = _solve(intercepts, unknowns, slowest, with_call, top)
        if call < 0:
            call, per, loss = _solve(intercepts, unknowns, slowest, False, top)
        agrees = all(per[k, slowest[k, g]] >= per[k, a] - 1e-9 * top for k, g in multi for a in g)
        if best is None or (not agrees, loss) < best[0]:
            best = ((not agrees, loss), max(0.0, call), {u: max(0.0, v) for u, v in per.items()})
    return best[1], best[2]


def _solve(intercepts: dict, unknowns: list, slowest: dict, with_call: bool, top: float):
    """Weighted least squares for `fit_latencies` with the slowest axis of each multi-axis group fixed."""
    col = {u: i + with_call for i, u in enumerate(unknowns)}
    rows, rhs = [], []
    for (kind, g), (r, i) in intercepts.items():
        w = 1.0 / max(i, 1e-3 * top, 1e-12)   # relative errors; an intercept at or below 0 weighs as a small one
        row = [0.0] * (len(unknowns) + with_call)
        if with_call:
            row[0] = w
        row[col[kind, slowest.get((kind, g), g[0])]] = r * w
        rows.append(row)
        rhs.append(i * w)
    # the fit is host-side arithmetic (never handed to a collective): on the CPU whatever the mesh's device
    a = torch.tensor(rows, dtype=torch.float64, device="cpu")
    b = torch.tensor(rhs, dtype=torch.float64, device="cpu").unsqueeze(1)
    x = torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1)
    loss = float(((a @ x.unsqueeze(1) - b) ** 2).sum())
    values = x.tolist()
    call = values[0] if with_call else 0.0
    return call, {u: values[col[u]] for u in unknowns}, loss


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
