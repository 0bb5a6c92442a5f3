"""Does the time model predict what gloo does here? Calibrate, then compare predicted and measured time per plan.

Launches gloo ranks on 127.0.0.1 (4 by default). `sbp.calibrate` fits the cost per call and alpha and beta per
axis of the (4,) and (2, 2) meshes; then for every case of benchmarks/redistribute.py (both shapes) the plan
made under the calibrated topology is executed (median over iterations of the slowest rank's time, barrier
before each) and its `plan.time_us` is the prediction. The same for the classic fit of the same measurements
(no cost per call, plain least squares: each axis's intercept / rounds is its alpha, as before `call_us`), the
plans of both timed together.
Prints per case predicted (both models), measured and their ratio, then per model Spearman's rank correlation
over the cases and the median / spread of measured / predicted.

With ``--disagree`` (8 ranks): the (2, 4) change S(0), S(0) -> S(1), B of a 64x64 tensor, where bytes pick one
exact exchange with 7 peers and a time model may pick two ring collectives; the plans of the bytes objective,
the calibrated model and the classic fit are run interleaved and timed, so the table shows which is faster here.

    python benchmarks/validate_model.py [--iters 30] [--disagree]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sbp
from sbp.planning.cost import Costing, Pricing
from sbp.runtime.calibrate import fit_line, measure
from sbp.runtime.executor import execute

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from redistribute import CASES, SHAPES, free_port  # noqa: E402  (the same cases as the redistribution benchmark)


def timed(plan: sbp.Plan, local: torch.Tensor, mesh: sbp.DeviceMesh, iters: int) -> float:
    """Median over iterations of the slowest rank's time (µs) to run `plan`."""
    return timed_together([plan], local, mesh, iters)[0]


def timed_together(plans: list[sbp.Plan], local: torch.Tensor, mesh: sbp.DeviceMesh, iters: int) -> list[float]:
    """Per plan, the median over iterations of the slowest rank's time (µs) to run it; the plans take turns
    within each iteration, so they see the same load."""
    runs: list[list[float]] = [[] for _ in plans]
    for i in range(iters + 3):
        for plan, out in zip(plans, runs):
            dist.barrier()
            t0 = time.perf_counter()
            execute(plan, local, mesh)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= 3:
                out.append(t.item() * 1e6)
    return [statistics.median(r) for r in runs]


def classic(cal) -> sbp.Topology:
    """The topology the same measurements gave before the cost per call: per axis, the plain least-squares
    line of its own group (no relative weights), intercept / rounds as alpha (all_gather) and latency per
    peer (all_to_all), 1 / slope as beta (all_gather); no `call_us`."""
    t = cal.topology
    own = {}
    for f in cal.fits:
        if len(f.axes) == 1:
            a, b = fit_line(f.received, f.measured_us)
            own[f.kind, f.axes[0]] = (max(0.0, a / (f.members - 1)), 1e-3 / b if b > 0 else 1e6)
    fastest = max((own[k][1] for k in own if k[0] == "all_gather"), default=1e6)
    return sbp.Topology(tuple(own.get(("all_gather", a), (0.0,))[0] for a in range(t.ndim)),
                        tuple(own.get(("all_gather", a), (0.0, fastest))[1] for a in range(t.ndim)), t.spans_hosts,
                        "classic", tuple(own.get(("all_to_all", a), (0.0,))[0] for a in range(t.ndim)))


def modeled_us(plan: sbp.Plan, topology: sbp.Topology) -> float:
    """`plan`'s modeled time (µs) under `topology` (the plan may have been made under another)."""
    pricing = Pricing(Costing(plan.global_shape, plan.mesh_shape, plan.itemsize), 0, topology)
    return sum(pricing.time_ns(s) for s in plan.steps) / 1000


def key(plan: sbp.Plan) -> tuple:
    """What `plan` runs (its steps without their modeled times): plans with equal keys are timed once."""
    return tuple((s.kind, s.axes, s.src, s.dst, s.dims, s.op) for s in plan.steps)


def steps_of(plan: sbp.Plan) -> str:
    return "+".join(f"{s.kind}{list(s.axes)}" for s in plan.steps if s.kind != "local") or "-"


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties).

    >>> spearman([1, 2, 3], [10, 30, 20])
    0.5
    """
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def local_of(mesh: sbp.DeviceMesh, shape, pls) -> torch.Tensor:
    return torch.randn(sbp.local_shape(shape, mesh, pls, mesh.coord))


def validate(iters: int) -> None:
    rank = dist.get_rank()
    torch.set_num_threads(1)
    meshes = {(4,): sbp.init_mesh((4,), device_type="cpu"), (2, 2): sbp.init_mesh((2, 2), device_type="cpu")}
    cal = {m: measure(mesh, repeats=7) for m, mesh in meshes.items()}
    old = {m: classic(c) for m, c in cal.items()}
    if rank == 0:
        for m, c in cal.items():
            print(f"calibration of mesh {m} (gloo, 127.0.0.1): {c.topology}\n{c.table()}\nclassic fit: {old[m]}\n")
        print(f"{'model':<8} {'mesh':<5} {'shape':<10} {'change':<26} {'steps':<44} {'predicted us':>12} "
              f"{'measured us':>12} {'meas/pred':>9}")
    pred: dict[str, list[float]] = {"call": [], "classic": []}
    meas: dict[str, list[float]] = {"call": [], "classic": []}
    for shape in SHAPES:
        for mesh_shape, src, dst in CASES:
            mesh = meshes[mesh_shape]
            plans = {"call": sbp.plan(shape, mesh, src, dst, topology=cal[mesh_shape].topology),
                     "classic": sbp.plan(shape, mesh, src, dst, topology=old[mesh_shape])}
            distinct = list({key(p): p for p in plans.values()}.values())
            times = dict(zip(map(key, distinct),
                             timed_together(distinct, local_of(mesh, shape, plans["call"].src), mesh, iters)))
            for model, plan in plans.items():
                m = times[key(plan)]
                pred[model].append(plan.time_us)
                meas[model].append(m)
                if rank == 0:
                    print(f"{model:<8} {'x'.join(map(str, mesh_shape)):<5} {'x'.join(map(str, shape)):<10} "
                          f"{f'[{src}]->[{dst}]':<26} {steps_of(plan):<44} {plan.time_us:12.1f} {m:12.1f} "
                          f"{m / plan.time_us:9.2f}", flush=True)
    if rank == 0:
        print()
        for model in ("classic", "call"):
            ratios = sorted(m / p for m, p in zip(meas[model], pred[model]))
            print(f"{model:<8} Spearman rank correlation (predicted vs measured, {len(ratios)} plans): "
                  f"{spearman(pred[model], meas[model]):.3f}; measured / predicted: median "
                  f"{statistics.median(ratios):.2f}, min {ratios[0]:.2f}, max {ratios[-1]:.2f}")


def disagree(iters: int) -> None:
    rank = dist.get_rank()
    torch.set_num_threads(1)
    mesh = sbp.init_mesh((2, 4), device_type="cpu")
    cal = measure(mesh, repeats=7)
    topo, old = cal.topology, classic(cal)
    shape, src, dst = (64, 64), "S(0), S(0)", "S(1), B"
    plans = {"bytes": sbp.plan(shape, mesh, src, dst), "time": sbp.plan(shape, mesh, src, dst, topology=topo),
             "classic": sbp.plan(shape, mesh, src, dst, topology=old)}
    distinct = list({key(p): p for p in plans.values()}.values())
    local = local_of(mesh, shape, plans["bytes"].src)
    times = dict(zip(map(key, distinct), timed_together(distinct, local, mesh, iters)))
    if rank == 0:
        print(f"calibrated {topo}\n{cal.table()}\nclassic fit {old}")
        print(f"{'objective':<10} {'steps':<40} {'bytes':>7} {'model us':>10} {'classic us':>10} {'measured us':>12}")
        for label, p in plans.items():
            print(f"{label:<10} {steps_of(p):<40} {p.bytes_per_rank:>7} {modeled_us(p, topo):10.1f} "
                  f"{modeled_us(p, old):10.1f} {times[key(p)]:12.1f}")


def _launch(rank: int, port: int, world: int, iters: int, what: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    (disagree if what == "disagree" else validate)(iters)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--disagree", action="store_true")
    args = parser.parse_args()
    world, what = (8, "disagree") if args.disagree else (4, "validate")
    mp.start_processes(_launch, args=(free_port(), world, args.iters, what), nprocs=world, start_method="spawn")
