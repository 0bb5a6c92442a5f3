"""Redistribution speed and traffic: sbp against DTensor (torch.distributed.tensor), same processes, same run.

4 gloo ranks on 127.0.0.1 (the script launches them; or run it under
``torchrun --standalone --nproc-per-node 4 benchmarks/redistribute.py``), a 1024x1024 fp32 tensor and an
uneven 1023x1021 one, each case on a mesh of (4,) or (2, 2). Per case it prints:

- ``sbp ms`` / ``DT ms``: median over iterations of the slowest rank's wall time (barrier before each);
- ``ratio``: sbp / DTensor time (below 1: sbp is faster), the median over iterations of the two
  times measured in the same iteration (paired, so drift of the machine's load cancels out; the
  ratio columns below are paired the same way);
- ``sbp B/rank``: the plan's bytes for the busiest rank (`plan.bytes_per_rank`), and ``counted`` the
  bytes its communicator really saw the busiest rank receive (logical, without padding);
- ``DT B/rank``: what DTensor's collectives delivered to the busiest rank, counted by a
  `TorchDispatchMode` that sees every functional collective DTensor issues (`_c10d_functional.*`,
  `_dtensor.shard_dim_alltoall`; `CommDebugMode` counts calls only) and prices it with the same
  conventions as sbp's counters: all_gather receives the others' pieces, reduce_scatter (n-1) x its
  output, all_reduce 2 (n-1)/n of the tensor, all_to_all what the peers send;
- ``sbp/coll``: for plans of one collective step, sbp's time over the time of the raw collective
  that step names, called alone on ready buffers of the step's exact sizes (the same process group):
  all_gather -> `all_gather_into_tensor`, reduce_scatter -> `reduce_scatter_tensor`, all_reduce ->
  `all_reduce` in place, all_to_all / transfer -> one `all_to_all_single` with the per-peer sizes.
  It is built from the plan, not from what sbp does, so a route that beats the textbook collective
  shows below 1 (on gloo sbp runs reduce_scatter as all_to_all + a local fold, and exchanges as
  isend/irecv). Above 1 is all sbp adds: copies the route needs (all_reduce works in place, so the
  caller's tensor is copied first; strided blocks are packed), allocating the result, Python;
- ``sbp/hand``: sbp's time over the same step written by hand in plain torch (`_by_hand`): the raw
  collective into newly allocated memory plus the copies the two layouts force on the rank -- the
  copy of an all_reduce's input (the caller's tensor must not change), padding to one piece length,
  packing blocks that are not one run of the local (one copy each), unpacking blocks that are not
  one run of the result, copying the kept block. This is sbp's own overhead (planning lookups,
  checks, counting, Python); ``sbp/coll`` divided by ``sbp/hand`` (the hand-written step over the bare
  call) is what the forced copies and the new memory cost. Its result is
  checked against sbp's;
- ``own us``: sbp's time minus the hand-written step's, in µs per call, with every torch.distributed call
  stubbed out (`own_us`; ranks take turns, the largest difference over ranks): what sbp does outside
  the collective that the hand-written step does not. Below 0: sbp copies less (zero-copy messages);
- ``sbp calls``: the torch.distributed functions sbp called (``+`` joins several kinds).

The timings (sbp, DTensor, the raw calls) are interleaved iteration by iteration, in rotating order,
so load from other processes on the machine hits them alike.

Timings on a shared 2-core machine are noisy; the byte columns are exact.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import socket
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import sbp
from sbp.runtime.executor import redistribute_local

WORLD = 4
CASES = [((4,), "S(0)", "B"), ((4,), "S(0)", "S(1)"), ((4,), "P", "B"), ((4,), "P", "S(0)"),
         ((4,), "S(1)", "B"), ((4,), "P", "S(1)"),
         ((2, 2), "S(0), S(1)", "S(1), S(0)"), ((2, 2), "S(0), S(0)", "S(1), S(1)"),
         ((2, 2), "S(0), S(0)", "B, S(0)"), ((2, 2), "S(0), B", "B, S(0)"), ((2, 2), "P, P", "B, B")]
SHAPES = [(1024, 1024), (1023, 1021)]


# ---- counting DTensor's traffic -------------------------------------------------------------------

class CountBytes(TorchDispatchMode):
    """Received bytes of every functional collective issued under it (this rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.received = 0
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        short = name.split(".")[-1]
        size = lambda t: t.numel() * t.element_size()
        if "_c10d_functional" in name or "_dtensor" in name:
            if short == "all_gather_into_tensor":
                self._add(short, size(out) - size(args[0]))
            elif short == "reduce_scatter_tensor":
                self._add(short, (args[2] - 1) * size(out))
            elif short == "all_reduce":
                n = _group_size(args[2])
                self._add(short, 2 * (n - 1) * size(args[0]) // n)
            elif short == "all_to_all_single":
                me = _group_rank(args[3])
                own = args[1][me] if args[1] else out.shape[0] // _group_size(args[3])
                self._add(short, size(out) - own * size(out) // max(out.shape[0], 1) if out.numel() else 0)
            elif short == "shard_dim_alltoall":
                n = _group_size(args[3])
                self._add(short, size(out) * (n - 1) // n)
        return out

    def _add(self, name: str, nbytes: int) -> None:
        self.calls.append(name)
        self.received += nbytes


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def _group_size(name: str) -> int:
    return dist.get_world_size(_group(name))


def _group_rank(name: str) -> int:
    return dist.get_group_rank(_group(name), dist.get_rank())


# ---- timing ---------------------------------------------------------------------------------------

def timed(fns: dict[str, Callable[[], object]], iters: int, warmup: int = 3) -> dict[str, list[float]]:
    """Per-iteration wall time of the slowest rank (seconds) of each function; the functions take turns
    within every iteration (the order rotates), each after a barrier."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    mine = {name: [] for name in names}
    for i in range(iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            mine[name].append(time.perf_counter() - t0)
    times = torch.tensor([mine[name] for name in names], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return dict(zip(names, times.tolist()))


def busiest(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _sync(t: torch.Tensor) -> torch.Tensor:
    wait = getattr(t, "wait", None)
    return wait() if callable(wait) else t


# ---- one case -------------------------------------------------------------------------------------

def run_case(mesh: sbp.DeviceMesh, tmesh, shape, src: str, dst: str, iters: int) -> dict:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    src_pl, dst_pl = sbp.placements(src), sbp.placements(dst)
    partial = any(isinstance(p, sbp.Partial) for p in src_pl)
    to_torch = lambda pls: [Shard(p.dim) if isinstance(p, sbp.Split) else
                            Partial() if isinstance(p, sbp.Partial) else Replicate() for p in pls]

    # sbp: this rank's block (Partial: every rank contributes the block, so the value is 4x; timing only)
    plan = sbp.plan(shape, mesh, src_pl, dst_pl, itemsize=4)
    local = full[sbp.local_slices(shape, mesh, [sbp.B if isinstance(p, sbp.Partial) else p for p in src_pl],
                                  mesh.coord)].contiguous()
    counters = mesh.binding.counters
    counters.reset()
    calls: list[str] = []
    out = _noting_calls(calls, lambda: redistribute_local(local, mesh, shape, src_pl, dst_pl))
    counted = busiest(counters.received)
    if not partial:
        assert torch.equal(out, full[sbp.local_slices(shape, mesh, dst_pl, mesh.coord)]), (src, dst, shape)

    # DTensor on the same processes
    if partial:
        dlocal = full[tuple(slice(0, n) for n in shape)].clone()
        x = DTensor.from_local(dlocal, tmesh, to_torch(src_pl), run_check=False, shape=full.shape,
                               stride=full.stride())
    else:
        from torch.distributed.tensor import distribute_tensor
        x = distribute_tensor(full, tmesh, to_torch(src_pl))
    target = to_torch(dst_pl)
    run_dt = lambda: _sync(x.redistribute(tmesh, target).to_local())
    with CountBytes() as counter:
        run_dt()
    dt_bytes = busiest(counter.received)

    fns = {"sbp": lambda: redistribute_local(local, mesh, shape, src_pl, dst_pl), "dt": run_dt}
    collective = [s for s in plan.steps if s.is_collective]
    if len(collective) == 1 and plan.num_collectives == 1:
        step = collective[0]
        fns["coll"] = _raw_collective(step, plan, mesh, local)
        # the collective's input: local steps before it only narrow the block (a view of the local)
        step_local = local if partial else full[sbp.local_slices(shape, mesh, step.src, mesh.coord)]
        fns["hand"] = _by_hand(step, plan, mesh, step_local)
        if partial:  # every rank contributed the whole block; gloo may sum in another order than sbp
            assert torch.allclose(fns["hand"](), out), ("the hand-written step disagrees with sbp", src, dst, shape)
        else:
            want = full[sbp.local_slices(shape, mesh, step.dst, mesh.coord)]
            assert torch.equal(fns["hand"](), want), ("the hand-written step is wrong", src, dst, shape)
    own = own_us(fns["sbp"], fns["hand"]) if "hand" in fns else None
    times = timed(fns, iters)
    median_ms = lambda name: statistics.median(times[name]) * 1e3 if name in times else None
    # paired: sbp and the other ran in the same iteration, one right after the other
    paired = lambda name: statistics.median(a / b for a, b in zip(times["sbp"], times[name])) if name in times \
        else None
    return {"sbp_ms": median_ms("sbp"), "dt_ms": median_ms("dt"), "plan_bytes": plan.bytes_per_rank,
            "counted": counted, "dt_bytes": dt_bytes, "vs_dt": paired("dt"), "vs_coll": paired("coll"),
            "vs_hand": paired("hand"), "own_us": own,
            "steps": " + ".join(s.kind for s in plan.steps if s.is_collective), "dt_calls": "+".join(counter.calls),
            "sbp_calls": _union_over_ranks(calls)}


def _entry_points():
    """(module, attribute, label) of every torch.distributed function sbp's gloo communicator calls."""
    import sbp.runtime.backends.dist as backend

    return [(backend, "_all_gather_flat", "all_gather_into_tensor"),
            (backend, "_reduce_scatter_flat", "reduce_scatter_tensor"), (dist, "all_reduce", "all_reduce"),
            (dist, "all_to_all_single", "all_to_all_single"), (dist, "isend", "isend"), (dist, "irecv", "irecv")]


def _patched(fn: Callable[[], object], wrap: Callable[[Callable, str], Callable]) -> object:
    """Run `fn` with every entry point replaced by ``wrap(original, label)``."""
    saved = [(module, name, getattr(module, name), label) for module, name, label in _entry_points()]
    for module, name, f, label in saved:
        setattr(module, name, wrap(f, label))
    try:
        return fn()
    finally:
        for module, name, f, _ in saved:
            setattr(module, name, f)


def _noting_calls(sink: list[str], fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Run `fn`, noting the name of every torch.distributed function sbp's communicator calls."""
    def noting(f, label):
        def call(*args, **kwargs):
            sink.append(label)
            return f(*args, **kwargs)
        return call
    return _patched(fn, noting)


class _Done:
    """A finished `Work`."""

    def wait(self, *args) -> bool:
        return True


def own_us(sbp_fn: Callable[[], object], hand_fn: Callable[[], object], number: int = 50) -> float:
    """sbp's own time per call over the hand-written step's, in µs, with every torch.distributed call
    replaced by one that returns at once (so only the work around the collective is left: copies,
    allocation, and for sbp its look-ups, checks and counting). Best of 5 runs of `number` calls each;
    ranks measure one after another, so they do not share the cores meanwhile."""
    import timeit

    def measure() -> dict[str, float]:
        best = {}
        for name, fn in (("sbp", sbp_fn), ("hand", hand_fn)):
            fn()
            best[name] = min(timeit.repeat(fn, number=number, repeat=5)) / number
        return best

    mine = 0.0
    for turn in range(dist.get_world_size()):
        dist.barrier()
        if turn == dist.get_rank():
            best = _patched(measure, lambda _f, _label: lambda *args, **kwargs: _Done())
            mine = (best["sbp"] - best["hand"]) * 1e6
    dist.barrier()
    t = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _union_over_ranks(names: list[str]) -> str:
    """The names every rank noted, joined (a rank with nothing to move makes no call)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(set(names)))
    return "+".join(sorted(set().union(*every))) or "-"


def _raw_collective(step: sbp.Step, plan: sbp.Plan, mesh: sbp.DeviceMesh,
                    local: torch.Tensor) -> Callable[[], None]:
    """The raw torch.distributed collective `step` names, on ready buffers of its exact sizes for this rank
    (its group's process group): a lower bound for anything that carries the step out."""
    import sbp.runtime.backends.dist as backend
    from sbp.runtime.buffers import exchange_layout, gather, scatter

    pg, where = _step_group(step, plan, mesh)
    new = lambda n: torch.randn(n, generator=torch.Generator().manual_seed(1))
    match step.kind:
        case "all_gather":
            lay = gather(*where)
            inp, out = new(lay.width), new(len(lay.numels) * lay.width)
            return lambda: backend._all_gather_flat(out, inp, group=pg)
        case "reduce_scatter":
            lay = scatter(*where)
            inp, out = new(len(lay.numels) * lay.width), new(lay.width)
            return lambda: backend._reduce_scatter_flat(out, inp, group=pg)
        case "all_reduce":
            out = local.clone()
            return lambda: dist.all_reduce(out, group=pg)
        case "all_to_all" | "transfer":
            lay = exchange_layout(*where)
            inp, out = new(sum(lay.in_splits)), new(sum(lay.out_splits))
            return lambda: dist.all_to_all_single(out, inp, list(lay.out_splits), list(lay.in_splits), group=pg)
    raise ValueError(f"no raw collective for a {step.kind} step")


def _by_hand(step: sbp.Step, plan: sbp.Plan, mesh: sbp.DeviceMesh, local: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The step written by hand in plain torch: the same raw collective into new memory, plus the copies
    the two layouts force on this rank and nothing else -- the input of an all_reduce copied (the
    caller's tensor is not to change), pieces padded to one length for all_gather_into_tensor /
    reduce_scatter_tensor, blocks that are not one run of the local packed (`torch.cat`), blocks
    that are not one run of the result unpacked, this rank's kept block copied over. Its block lists
    come from `sbp.runtime.buffers`; the code is what a user would write around the bare call. Returns this
    rank's result, which the caller checks against sbp's."""
    import sbp.runtime.backends.dist as backend
    from sbp.runtime.buffers import exchange_layout, gather, scatter

    pg, where = _step_group(step, plan, mesh)
    match step.kind:
        case "all_gather":
            lay = gather(*where)

            def run() -> torch.Tensor:
                flat = local.reshape(-1)
                if flat.numel() < lay.width:
                    flat = torch.cat([flat, flat.new_zeros(lay.width - flat.numel())])
                buf = local.new_empty(len(lay.numels) * lay.width)
                backend._all_gather_flat(buf, flat, group=pg)
                if lay.runs is not None and len(lay.runs) == 1:
                    return buf[lay.runs[0][0]:lay.runs[0][1]].view(lay.shape)
                if lay.runs is not None:
                    return torch.cat([buf[lo:hi] for lo, hi in lay.runs]).view(lay.shape)
                out = local.new_empty(lay.shape)
                for at, shape, offset in lay.places:
                    out[at] = buf[offset:offset + math.prod(shape)].view(shape)
                return out
        case "reduce_scatter":
            lay = scatter(*where)

            def run() -> torch.Tensor:
                if lay.direct:
                    inp = local.reshape(-1)
                else:
                    inp = local.new_zeros(len(lay.numels) * lay.width)
                    for at, shape, offset in lay.places:
                        inp[offset:offset + math.prod(shape)].view(shape).copy_(local[at])
                out = local.new_empty(lay.width)
                backend._reduce_scatter_flat(out, inp, group=pg)
                return out[:lay.numels[lay.index]].view(lay.shape)
        case "all_reduce":
            def run() -> torch.Tensor:
                out = local.clone()
                dist.all_reduce(out, group=pg)
                return out
        case "all_to_all" | "transfer":
            lay = exchange_layout(*where)

            def run() -> torch.Tensor:
                if lay.send_run is not None:
                    inp = local.reshape(-1)[lay.send_run[0]:lay.send_run[1]]
                else:
                    inp = local.new_empty(sum(lay.in_splits))
                    for at, shape, offset in lay.sends:
                        inp[offset:offset + math.prod(shape)].view(shape).copy_(local[at])
                out = local.new_empty(lay.shape)
                got = (out.view(-1)[lay.recv_run[0]:lay.recv_run[1]] if lay.recv_run is not None
                       else local.new_empty(sum(lay.out_splits)))
                dist.all_to_all_single(got, inp, list(lay.out_splits), list(lay.in_splits), group=pg)
                if lay.recv_run is None:
                    for at, shape, offset in lay.recvs:
                        out[at] = got[offset:offset + math.prod(shape)].view(shape)
                if lay.keep is not None:
                    out[lay.keep[1]] = local[lay.keep[0]]
                return out
        case _:
            raise ValueError(f"no hand-written form of a {step.kind} step")
    return run


def _step_group(step: sbp.Step, plan: sbp.Plan, mesh: sbp.DeviceMesh):
    """The process group of `step`'s group through this rank, and the arguments of `sbp.runtime.buffers` layouts."""
    comm = mesh.binding
    pg, _ = comm._group(comm.members(step.axes))
    return pg, (plan.global_shape, plan.mesh_shape, step.src, step.dst, step.axes, mesh.coord)


def main(iters: int, only: str | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    # DTensor warns (per rank) about its CPU all_to_all fallback and sequential gathers; the table shows it
    for name in ("torch.distributed", "torch.distributed.tensor._redistribute", "torch._logging"):
        logging.getLogger(name).setLevel(logging.ERROR)
    meshes = {(4,): sbp.init_mesh((4,), device_type="cpu"), (2, 2): sbp.init_mesh((2, 2), device_type="cpu")}
    tmeshes = {(4,): init_device_mesh("cpu", (4,)), (2, 2): init_device_mesh("cpu", (2, 2))}
    rank = dist.get_rank()
    if rank == 0:
        print(f"torch {torch.__version__}, {WORLD} gloo ranks, fp32, median of {iters} iterations\n")
        print(f"{'mesh':<5} {'shape':<10} {'change':<26} {'sbp ms':>7} {'DT ms':>7} {'ratio':>6} "
              f"{'sbp B/rank':>11} {'counted':>9} {'DT B/rank':>10} {'sbp/coll':>8} {'sbp/hand':>8} {'own us':>6}  "
              f"sbp step: sbp calls | DTensor collectives")
    results = []
    for shape in SHAPES:
        for mesh_shape, src, dst in CASES:
            if only is not None and not re.search(only, f"{'x'.join(map(str, mesh_shape))} [{src}]->[{dst}]"):
                continue
            r = run_case(meshes[mesh_shape], tmeshes[mesh_shape], shape, src, dst, iters)
            results.append(r)
            if rank == 0:
                mesh_txt = "x".join(map(str, mesh_shape))
                coll = f"{r['vs_coll']:.2f}" if r["vs_coll"] else "-"
                hand = f"{r['vs_hand']:.2f}" if r["vs_hand"] else "-"
                own = f"{r['own_us']:.0f}" if r["own_us"] is not None else "-"
                print(f"{mesh_txt:<5} {'x'.join(map(str, shape)):<10} {f'[{src}]->[{dst}]':<26} "
                      f"{r['sbp_ms']:7.2f} {r['dt_ms']:7.2f} {r['vs_dt']:6.2f} "
                      f"{r['plan_bytes']:11d} {r['counted']:9d} {r['dt_bytes']:10d} {coll:>8} {hand:>8} {own:>6}  "
                      f"{r['steps']}: {r['sbp_calls']} | {r['dt_calls']}", flush=True)
    if rank == 0:
        print(summary(results))
    dist.barrier()
    dist.destroy_process_group()


def summary(results: list[dict]) -> str:
    """How many cases meet the targets: sbp no slower than DTensor, and within 10% of the raw collective
    where the plan is one collective: of the bare call on ready buffers, and of the step written by hand.

    >>> summary([{"vs_dt": 0.5, "vs_coll": 1.2, "vs_hand": 1.0}, {"vs_dt": 1.5, "vs_coll": None, "vs_hand": None}])
    'sbp <= DTensor: 1 of 2; sbp/coll <= 1.10: 0 of 1; sbp/hand <= 1.10: 1 of 1'
    """
    single = [r for r in results if r["vs_coll"]]
    within = lambda key: sum(r[key] <= 1.10 for r in single)
    return (f"sbp <= DTensor: {sum(r['vs_dt'] <= 1 for r in results)} of {len(results)}; "
            f"sbp/coll <= 1.10: {within('vs_coll')} of {len(single)}; sbp/hand <= 1.10: {within('vs_hand')} of "
            f"{len(single)}")


def _launch(rank: int, port: int, iters: int, only: str | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    main(iters, only)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=60, help="timed iterations per case (default 60)")
    parser.add_argument("--only", help="run only the cases whose 'mesh change' matches this regular expression, "
                        "e.g. '^4 .*S\\(1\\)\\]$' (the (4,) mesh, to S(1))")
    args = parser.parse_args()
    if "RANK" in os.environ:
        main(args.iters, args.only)
    else:
        mp.start_processes(_launch, args=(free_port(), args.iters, args.only), nprocs=WORLD, start_method="spawn")
        sys.exit(0)
