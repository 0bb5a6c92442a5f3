"""Does the time model predict what gloo does here? Calibrate, then compare predicted and measured time per plan.

Launches gloo ranks on 127.0.0.1 (4 by default). `sbp.calibrate` fits alpha and beta per axis of the (4,) and
(2, 2) meshes; then for every case of benchmarks/redistribute.py (both shapes) the plan made under the
calibrated topology is executed (median over iterations of the slowest rank's time, barrier before each) and
its `plan.time_us` is the prediction. Prints per case predicted, measured and their ratio, then Spearman's rank
correlation over the cases and the median / spread of measured / predicted.

With ``--disagree`` (8 ranks): the (2, 4) change S(0), S(0) -> S(1), B of a 64x64 tensor, where bytes pick one
exact exchange with 7 peers and time (under the calibrated topology) two ring collectives; both plans are run
and timed, so the table shows which is faster here.

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
from sbp.runtime.calibrate import measure
from sbp.runtime.executor import execute

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from redistribute import CASES, SHAPES, free_port  # noqa: E402  (the same cases as the redistribution benchmark)


def timed(plan: sbp.Plan, local: torch.Tensor, mesh: sbp.DeviceMesh, iters: int) -> float:
    """Median over iterations of the slowest rank's time (µs) to run `plan`."""
    runs = []
    for i in range(iters + 3):
        dist.barrier()
        t0 = time.perf_counter()
        execute(plan, local, mesh)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 3:
            runs.append(t.item() * 1e6)
    return statistics.median(runs)


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
    if rank == 0:
        for m, c in cal.items():
            print(f"calibration of mesh {m} (gloo, 127.0.0.1): {c.topology}\n{c.table()}\n")
        print(f"{'mesh':<5} {'shape':<10} {'change':<26} {'steps':<34} {'predicted us':>12} {'measured us':>12} "
              f"{'meas/pred':>9}")
    pred, meas = [], []
    for shape in SHAPES:
        for mesh_shape, src, dst in CASES:
            mesh = meshes[mesh_shape]
            plan = sbp.plan(shape, mesh, src, dst, topology=cal[mesh_shape].topology)
            m = timed(plan, local_of(mesh, shape, plan.src), mesh, iters)
            pred.append(plan.time_us)
            meas.append(m)
            if rank == 0:
                steps = "+".join(f"{s.kind}{list(s.axes)}" for s in plan.steps if s.kind != "local") or "-"
                print(f"{'x'.join(map(str, mesh_shape)):<5} {'x'.join(map(str, shape)):<10} "
                      f"{f'[{src}]->[{dst}]':<26} {steps:<34} {plan.time_us:12.1f} {m:12.1f} {m / plan.time_us:9.2f}",
                      flush=True)
    if rank == 0:
        ratios = sorted(m / p for m, p in zip(meas, pred))
        print(f"\nSpearman rank correlation (predicted vs measured, {len(pred)} plans): {spearman(pred, meas):.3f}")
        print(f"measured / predicted: median {statistics.median(ratios):.2f}, min {ratios[0]:.2f}, "
              f"max {ratios[-1]:.2f}")


def disagree(iters: int) -> None:
    rank = dist.get_rank()
    torch.set_num_threads(1)
    mesh = sbp.init_mesh((2, 4), device_type="cpu")
    topo = measure(mesh, repeats=7).topology
    shape, src, dst = (64, 64), "S(0), S(0)", "S(1), B"
    by_bytes = sbp.plan(shape, mesh, src, dst)
    by_time = sbp.plan(shape, mesh, src, dst, topology=topo)
    local = local_of(mesh, shape, by_bytes.src)
    rows = [(label, p, timed(p, local, mesh, iters)) for label, p in (("bytes", by_bytes), ("time", by_time))]
    if rank == 0:
        print(f"calibrated {topo}")
        print(f"{'objective':<10} {'steps':<40} {'bytes':>7} {'measured us':>12}")
        for label, p, m in rows:
            steps = "+".join(f"{s.kind}{list(s.axes)}" for s in p.steps if s.kind != "local")
            print(f"{label:<10} {steps:<40} {p.bytes_per_rank:>7} {m:12.1f}")


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
