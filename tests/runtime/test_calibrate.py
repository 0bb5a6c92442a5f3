"""`sbp.calibrate`: a fitted topology, the same on every rank, usable by the planner; the least-squares fit itself.

Threads tier (fast) and one gloo run (real process groups). Timings are never asserted, only what the fit
must satisfy whatever the machine: finite, alpha >= 0, beta > 0, one entry per axis, equal on every rank,
and the fitted line through the measured points.
"""
from __future__ import annotations

import functools
import math

import pytest

import sbp
import sbp.testing
from sbp.runtime.calibrate import Fit, fit_line, measure


def _calibrated(mesh):
    cal = measure(mesh, sizes=(256, 4096, 65536), repeats=2)
    t = cal.topology
    plan = sbp.plan((64, 64), mesh, "S(0), S(1)", "B, B", topology=t)
    return t.to_json(), [(f.kind, f.axes, f.members, len(f.measured_us)) for f in cal.fits], plan.time_us


def _check(results, mesh_shape):
    topologies = {r[0] for r in results}
    assert len(topologies) == 1   # max-reduced medians: every rank fits the same numbers
    t = sbp.Topology.from_json(topologies.pop())
    assert t.ndim == len(mesh_shape)
    assert all(math.isfinite(a) and a >= 0 for a in t.alpha_us) and all(b > 0 for b in t.beta_gbps)
    # the latency per peer of exchanges, fitted from all_to_alls
    assert t.exchange_us is not None and len(t.exchange_us) == len(mesh_shape)
    assert all(math.isfinite(a) and a >= 0 for a in t.exchange_us)
    axes = [(a,) for a in range(len(mesh_shape))]
    axes += [tuple(range(len(mesh_shape)))] if len(mesh_shape) > 1 else []
    assert results[0][1] == [(kind, ax, math.prod(mesh_shape[a] for a in ax), 3)
                             for kind in ("all_gather", "all_to_all") for ax in axes]
    assert all(r[2] > 0 for r in results)


def test_calibrate_threads_gives_one_topology_for_all_ranks():
    _check(sbp.testing.spmd(_calibrated, (2, 2)), (2, 2))


@pytest.mark.gloo
def test_calibrate_gloo_gives_one_topology_for_all_ranks():
    _check(functools.partial(sbp.testing.spmd, backend="gloo", timeout=120)(_calibrated, (2, 2)), (2, 2))


def test_fit_line_recovers_alpha_and_beta():
    # 3 rounds of 5 µs and 2 GB/s (0.0005 µs per byte)
    xs = [1_000.0, 10_000.0, 100_000.0]
    a, b = fit_line(xs, [15 + 0.0005 * x for x in xs])
    assert a == pytest.approx(15) and 1e-3 / b == pytest.approx(2.0)
    assert Fit((0,), 4, 5.0, 2.0, (1000,), (15.5,), (15.5,)).residual == 0


def test_calibrate_needs_a_bound_mesh_and_sane_sizes():
    with pytest.raises(sbp.SbpError, match="bound to a communicator"):
        sbp.calibrate(sbp.DeviceMesh((2,)))
    with pytest.raises(sbp.SbpError, match="sizes must be ints >= 4"):
        sbp.testing.spmd(lambda mesh: sbp.calibrate(mesh, sizes=(2,)), (2,))
