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
from sbp.runtime.calibrate import KINDS, Fit, fit_latencies, fit_line, fit_topology, groups_of, measure


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
    # the cost per call, fitted from all_to_alls over groups of 2 and 4 members: one value on every axis
    assert t.call_us is not None and len(t.call_us) == len(mesh_shape) and len(set(t.call_us)) == 1
    assert all(math.isfinite(c) and c >= 0 for c in t.call_us)
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


def test_fit_line_relative_weights_every_point_alike():
    # an exact line is found whatever the weights; off the line, relative weights keep the small points close
    xs = [1_000.0, 10_000.0, 100_000.0, 1_000_000.0]
    exact = [7 + 0.001 * x for x in xs]
    assert fit_line(xs, exact, relative=True) == pytest.approx(fit_line(xs, exact))
    noisy = exact[:3] + [exact[3] * 1.5]   # the largest timing 50% slow (a loaded machine)
    rel, plain = fit_line(xs, noisy, relative=True), fit_line(xs, noisy)
    assert abs(rel[0] - 7) < abs(plain[0] - 7)


def _timings(mesh_shape, sizes, call, ring, peer, beta, spans=None):
    """µs per (kind, group, size) of the model: call + rounds x latency of the group's slowest axis + bytes / beta."""
    out = {}
    for kind in KINDS:
        for g in groups_of(mesh_shape):
            n = math.prod(mesh_shape[a] for a in g)
            per = max((ring if kind == "all_gather" else peer)[a] for a in g)
            out[kind, g] = [call + (n - 1) * (per + (s // 4 * 4) * 1e-3 / min(beta[a] for a in g)) for s in sizes]
    return out


@pytest.mark.parametrize("mesh_shape", [(2, 4), (2, 2, 2), (4, 2)])
def test_fit_recovers_the_call_cost_and_the_latencies_of_a_known_network(mesh_shape):
    sizes = (4096, 65536, 1 << 20)
    ndim = len(mesh_shape)
    cal = fit_topology(mesh_shape, sizes, _timings(mesh_shape, sizes, 3000.0, [2500.0] * ndim, [1000.0] * ndim,
                                                   [0.1] * ndim))
    t = cal.topology
    assert t.call_us == pytest.approx((3000.0,) * ndim)
    assert t.alpha_us == pytest.approx((2500.0,) * ndim) and t.exchange_us == pytest.approx((1000.0,) * ndim)
    assert t.beta_gbps == pytest.approx((0.1,) * ndim)
    assert [(k, r) for k, _, r, _, _ in cal.intercepts] == [
        (k, r) for k in KINDS for r in [mesh_shape[a] - 1 for a in range(ndim)] + [math.prod(mesh_shape) - 1]]
    assert all(measured == pytest.approx(model) for *_, measured, model in cal.intercepts)
    assert "per call 3000.00 us" in cal.table()
    # the classic fit of the same timings folds the call into each group's rounds
    assert [f.alpha_us for f in cal.fits if f.kind == "all_gather" and len(f.axes) == 1] == pytest.approx(
        [2500.0 + 3000.0 / (n - 1) for n in mesh_shape])


def test_fit_of_one_axis_has_no_call_cost_to_tell_apart():
    sizes = (4096, 65536, 1 << 20)
    t = fit_topology((4,), sizes, _timings((4,), sizes, 3000.0, [2500.0], [1000.0], [0.1])).topology
    assert t.call_us == (0.0,)
    assert t.alpha_us == pytest.approx((2500.0 + 1000.0,)) and t.exchange_us == pytest.approx((1000.0 + 1000.0,))


@pytest.mark.parametrize("slow", [0, 1])
def test_fit_prices_the_flattened_group_at_its_slowest_axis(slow):
    # one axis crosses hosts (ring rounds of 20 ms, 9 ms per exchange peer), the other stays inside (2 ms, 1 ms):
    # the flattened group runs at the slow axis's pace, and the fast axis keeps its own latency
    sizes = (4096, 65536, 1 << 20)
    ring, peer = [2000.0, 2000.0], [1000.0, 1000.0]
    ring[slow], peer[slow] = 20_000.0, 9000.0
    timings = _timings((2, 4), sizes, 3000.0, ring, peer, [0.1, 0.1])
    for t in (fit_topology((2, 4), sizes, timings).topology, fit_topology((2, 4), sizes, timings, 4).topology):
        assert t.alpha_us == pytest.approx(tuple(ring)) and t.exchange_us == pytest.approx(tuple(peer))
        assert t.call_us == pytest.approx((3000.0,) * 2)
    assert fit_topology((2, 4), sizes, timings, devices_per_host=4).topology.spans_hosts == (True, False)


def test_fit_latencies_never_gives_negative_values():
    # intercepts falling with the group size (noise of a loaded machine): no negative call cost or latency
    falling = {("all_to_all", (0,)): (1, 9.0), ("all_to_all", (1,)): (3, 4.0), ("all_to_all", (0, 1)): (7, 2.0),
               ("all_gather", (0,)): (1, 30.0), ("all_gather", (1,)): (3, -5.0), ("all_gather", (0, 1)): (7, 1.0)}
    call, per = fit_latencies(falling)
    assert math.isfinite(call) and call >= 0 and all(math.isfinite(v) and v >= 0 for v in per.values())
    assert set(per) == {(k, a) for k in KINDS for a in (0, 1)}
    # rising steeply: the intercept of the line would be below 0, so no call cost, latencies through 0
    call, per = fit_latencies({("all_to_all", (0,)): (1, 1.0), ("all_to_all", (1,)): (3, 10.0),
                               ("all_to_all", (0, 1)): (7, 30.0)})
    assert call == 0.0 and per[("all_to_all", 1)] == pytest.approx(per[("all_to_all", 0)] * 10.0 / 3.0, rel=0.5)
    assert fit_latencies({}) == (0.0, {})


def test_calibrate_needs_a_bound_mesh_and_sane_sizes():
    with pytest.raises(sbp.SbpError, match="bound to a communicator"):
        sbp.calibrate(sbp.DeviceMesh((2,)))
    with pytest.raises(sbp.SbpError, match="sizes must be ints >= 4"):
        sbp.testing.spmd(lambda mesh: sbp.calibrate(mesh, sizes=(2,)), (2,))
    for sizes in [(1024,), (4096, 4096)]:   # (one size gave latency 0 and ~0.002 GB/s; two equal, 1e6 GB/s)
        with pytest.raises(sbp.SbpError, match=r"at least two different sizes .* got \(" + str(sizes[0])):
            sbp.testing.spmd(lambda mesh, s=sizes: sbp.calibrate(mesh, sizes=s), (2,))
