"""How fast is planning? sbp's planner vs DTensor's, cold and cached, on a 2x2x2 mesh; sbp alone, cold, on
meshes of 1,024 to 16,384 ranks (3 and 4 axes).

Cold: every cache is cleared before each call (sbp: `sbp.planning.clear_caches()`, every planning memo,
the plan cache included; DTensor: its planner instances and `_gen_transform_infos`). Cached: the same call repeated.
Pairs are a fixed random sample of src/dst placements (Split/Broadcast only, and with Partial). DTensor
runs on a fake process group (no processes); its DTensorSpecs are built outside the timed region, while
sbp's time includes parsing and normalising the placements. DTensor's greedy planner is its default;
the graph-based one is ``use_graph_based_transform=True``.

Times are CPU time of this process (`time.process_time_ns`), so that other work on a shared machine
does not inflate them.

    python benchmarks/plan_speed.py [--samples 200] [--shape 1024x1024] [--repeat 5] [--large-samples 20]
                                    [--uneven-shape 1000x1000]

The large rows run twice: with `--shape`, and with `--uneven-shape` (1000 rows split 1,024 to 16,384 ways:
uneven pieces, many empty, where no closed form of the even layouts applies).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import math
import random
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.tensor import Partial as DPartial, Replicate, Shard, _redistribute as R
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.testing._internal.distributed.fake_pg import FakeStore

import sbp
import sbp.planning

MESH = (2, 2, 2)
LARGE = ((8, 16, 8), (16, 16, 16), (16, 32, 32), (4, 4, 8, 8), (4, 8, 8, 16), (4, 4, 32, 32))


def sample_pairs(ndim: int, partial: bool, count: int, seed: int, naxes: int = len(MESH)) -> list[tuple[tuple, tuple]]:
    """A fixed random sample of (src, dst) placements (src != dst); DTensor's placement names alongside."""
    one = [sbp.B] + [sbp.S(d) for d in range(ndim)] + ([sbp.Partial("sum")] if partial else [])
    states = list(itertools.product(one, repeat=naxes))
    pairs = [(s, d) for s in states for d in states if s != d]
    if partial:  # keep pairs that involve a Partial
        pairs = [(s, d) for s, d in pairs if any(isinstance(p, sbp.Partial) for p in s + d)]
    rng = random.Random(seed)
    return rng.sample(pairs, min(count, len(pairs)))


def to_dtensor(pls: tuple) -> tuple:
    return tuple(Shard(p.dim) if isinstance(p, sbp.Split) else DPartial("sum") if isinstance(p, sbp.Partial)
                 else Replicate() for p in pls)


def timed(fn: Callable[[], object], before: Callable[[], None], repeat: int) -> float:
    """Best of `repeat` runs of fn (µs), `before` run untimed ahead of each."""
    best = float("inf")
    for _ in range(repeat):
        before()
        t0 = time.process_time_ns()
        fn()
        best = min(best, time.process_time_ns() - t0)
    return best / 1000


def clear_sbp() -> None:
    """Every planning memo: plans, exchange schedules, helpers, layout blocks (`sbp.planning.clear_caches`)."""
    sbp.planning.clear_caches()


def clear_dtensor() -> None:
    R.clear_redistribute_planner_cache()
    R._gen_transform_infos.cache_clear()


def nothing() -> None:
    pass


def summary(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--shape", default="1024x1024")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--large-samples", type=int, default=20, help="pairs per large mesh (0: skip those rows)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per large row at most (pairs past it skipped)")
    ap.add_argument("--uneven-shape", default="1000x1000",
                    help="the large rows again with this shape, which no mesh axis divides evenly ('' to skip)")
    args = ap.parse_args()
    shape = tuple(int(n) for n in args.shape.split("x"))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    mesh = TorchMesh("cpu", torch.arange(8).reshape(MESH))
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), torch.float32)

    rows = []
    for label, partial in (("Split/Broadcast", False), ("with Partial", True)):
        pairs = sample_pairs(len(shape), partial, args.samples, seed=0)
        specs = [(DTensorSpec(mesh, to_dtensor(s), meta), DTensorSpec(mesh, to_dtensor(d), meta)) for s, d in pairs]
        cols = {name: [] for name in ("sbp cold", "sbp cached", "greedy cold", "greedy cached", "graph cold")}
        for (s, d), (ds, dd) in zip(pairs, specs):
            cols["sbp cold"].append(timed(lambda: sbp.plan(shape, MESH, s, d), clear_sbp, args.repeat))
            cols["sbp cached"].append(timed(lambda: sbp.plan(shape, MESH, s, d), nothing, args.repeat))
            cols["greedy cold"].append(timed(lambda: R._gen_transform_infos_non_cached(ds, dd), clear_dtensor,
                                             args.repeat))
            R._gen_transform_infos(ds, dd)
            cols["greedy cached"].append(timed(lambda: R._gen_transform_infos(ds, dd), nothing, args.repeat))
            cols["graph cold"].append(timed(
                lambda: R._gen_transform_infos_non_cached(ds, dd, use_graph_based_transform=True), clear_dtensor,
                args.repeat))
        rows.append((label, len(pairs), {k: summary(v) for k, v in cols.items()}))
    dist.destroy_process_group()

    print(f"planning time, mesh {MESH}, shape {shape}, best of {args.repeat} per pair; median / p90 in µs")
    head = f"{'pairs':<20}{'n':>5}" + "".join(f"{k:>20}" for k in rows[0][2]) + f"{'greedy/sbp':>12}{'graph/sbp':>11}"
    print(head)
    print("-" * len(head))
    for label, n, stats in rows:
        cells = "".join(f"{m:>10.1f} /{p:>7.1f}" + " " for m, p in stats.values())
        ratio_greedy = stats["greedy cold"][0] / stats["sbp cold"][0]
        ratio_graph = stats["graph cold"][0] / stats["sbp cold"][0]
        print(f"{label:<20}{n:>5}{cells}{ratio_greedy:>11.2f}x{ratio_graph:>10.2f}x")
    print("ratios: DTensor cold median / sbp cold median (above 1: sbp plans faster)")
    class_rows(shape, args.samples, args.repeat)
    if args.large_samples:
        large_rows(shape, args.large_samples, args.budget)
        if args.uneven_shape:
            large_rows(tuple(int(n) for n in args.uneven_shape.split("x")), args.large_samples, args.budget)


def large_rows(shape: tuple[int, ...], samples: int, budget: float) -> None:
    """sbp alone, cold (every planning memo cleared before each call, one call per pair), on large meshes."""
    print(f"\nsbp cold planning on large meshes, shape {shape}, one call per pair; median / p90 / max in ms")
    head = f"{'mesh':<16}{'ranks':>7}  {'pairs':<18}{'n':>4}{'median':>10}{'p90':>10}{'max':>10}{'at bound':>10}"
    print(head)
    print("-" * len(head))
    for mesh in LARGE:
        for label, partial in (("Split/Broadcast", False), ("with Partial", True)):
            pairs = sample_pairs(len(shape), partial, samples, seed=1, naxes=len(mesh))
            times, at_bound, start = [], 0, time.process_time()
            for s, d in pairs:
                if time.process_time() - start > budget:
                    break
                sbp.planning.clear_caches()
                gc.collect()   # the previous pair's garbage, outside the timed call
                t0 = time.process_time_ns()
                p = sbp.plan(shape, mesh, s, d)
                times.append((time.process_time_ns() - t0) / 1e6)
                at_bound += p.bytes_per_rank == p.lower_bound
            med, p90 = summary(times)
            print(f"{'x'.join(map(str, mesh)):<16}{math.prod(mesh):>7}  {label:<18}{len(times):>4}{med:>10.2f}"
                  f"{p90:>10.2f}{max(times):>10.2f}{at_bound:>7}/{len(times)}")


# ---- shape classes (issue #22): a new shape whose class is known vs a new class -----------------------------
def class_rows(shape: tuple[int, ...], samples: int, repeat: int) -> None:
    """sbp.plan for a shape never planned: "new class" searches (every memo cleared first; what every new
    shape cost before shape classes), "new shape, known class" fills in the class's template
    (`sbp.planning.classes`): each of `repeat` calls plans another shape of the class (the first dim plus a
    multiple of 64, the square of the 8 ranks), so no exact memo helps."""
    print(f"\nnew shapes, mesh {MESH}, shape {shape} and shapes of its class; median / p90 in µs "
          f"(best of {repeat} shapes per pair for a known class)")
    head = f"{'pairs':<20}{'n':>5}{'new class':>20}{'known class':>20}{'speed-up':>10}"
    print(head)
    print("-" * len(head))
    for label, partial in (("Split/Broadcast", False), ("with Partial", True)):
        pairs = sample_pairs(len(shape), partial, samples, seed=0)
        cold, known = [], []
        for s, d in pairs:
            cold.append(timed(lambda: sbp.plan(shape, MESH, s, d), clear_sbp, repeat))
            sbp.planning.clear_caches()
            sbp.plan(shape, MESH, s, d)    # the class's template
            others = iter([(shape[0] + 64 * k, *shape[1:]) for k in range(1, repeat + 1)])
            known.append(timed(lambda: sbp.plan(next(others), MESH, s, d), nothing, repeat))
        (cm, cp), (km, kp) = summary(cold), summary(known)
        print(f"{label:<20}{len(pairs):>5}{cm:>12.1f} /{cp:>6.1f}{km:>12.1f} /{kp:>6.1f}{cm / km:>9.1f}x")
    print("new class: a search (before shape classes, every new shape); known class: lookup plus arithmetic")


if __name__ == "__main__":
    main()
