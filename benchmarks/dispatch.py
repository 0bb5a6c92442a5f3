"""Per-op dispatch overhead of sbp global tensors vs DTensor vs plain torch, on 8x8 float32 tensors.

Every rank of a gloo world (1 rank by default, ``--ranks 4`` for four processes) builds the same inputs
as an sbp `GlobalTensor` and as a DTensor on a torch `DeviceMesh` over the same ranks, and times, in
the same process and interleaved, ``x + y`` (both S(0)/Shard(0)), ``x @ w`` (w B/Replicate), ``x.sum()``
and a no-op redistribute (S(0) -> S(0)), then ``x + y`` and ``x @ w`` again with inputs that require grad
(autograd records the op). None of these communicates, so the time above plain torch on the local
tensors is pure dispatch overhead. Rank 0 prints one row per op (best of ``--repeats`` runs of
``--iters`` calls, microseconds per call) and the ratio of sbp's overhead to DTensor's. The "floor"
column is a do-nothing Python wrapper subclass (unwrap, run, rewrap): the least a call through torch's
dispatcher into a Python `__torch_dispatch__` can cost (DTensor's own dispatch runs in C++ in torch
2.13). sbp's Python operators skip that trip when autograd need not record the op (`sbp.ops.direct`),
so its rows without autograd can go below the floor; the autograd rows cannot.

    python benchmarks/dispatch.py            # 1 rank
    python benchmarks/dispatch.py --ranks 4  # 4 gloo processes
"""
from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


class Floor(torch.Tensor):
    """The cheapest possible Python wrapper subclass: unwrap, run the op, rewrap (no rules, no layouts).
    Its overhead is the floor for any `__torch_dispatch__` tensor subclass, sbp included."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, requires_grad: bool = False) -> "Floor":
        out = torch.Tensor._make_wrapper_subclass(cls, local.shape, strides=local.stride(), dtype=local.dtype,
                                                  device=local.device, requires_grad=requires_grad)
        out._local = local
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = [a._local if isinstance(a, Floor) else a for a in args]
        out = func(*unwrap, **(kwargs or {}))
        return Floor(out) if isinstance(out, torch.Tensor) else out


def _cases(n: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import sbp

    mesh = sbp.init_mesh((n,), device_type="cpu")
    dmesh = init_device_mesh("cpu", (n,))
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(8, 8, generator=g) for _ in range(3))
    x, y, w = sbp.distribute(a, mesh, "S(0)"), sbp.distribute(b, mesh, "S(0)"), sbp.distribute(c, mesh, "B")
    dx, dy = distribute_tensor(a, dmesh, [Shard(0)]), distribute_tensor(b, dmesh, [Shard(0)])
    dw = distribute_tensor(c, dmesh, [Replicate()])
    lx, ly, lw = x.to_local(), y.to_local(), w.to_local()
    fx, fy, fw = Floor(lx), Floor(ly), Floor(lw)
    shard = [Shard(0)]
    xg, yg, wg = (t.detach().requires_grad_() for t in (x, y, w))
    dxg, dyg, dwg = (t.detach().requires_grad_() for t in (dx, dy, dw))
    fxg, fyg, fwg = Floor(lx, True), Floor(ly, True), Floor(lw, True)
    lxg, lyg, lwg = (t.detach().requires_grad_() for t in (lx, ly, lw))
    return {
        "add": (lambda: lx + ly, lambda: x + y, lambda: dx + dy, lambda: fx + fy),
        "mm": (lambda: lx @ lw, lambda: x @ w, lambda: dx @ dw, lambda: fx @ fw),
        "sum": (lambda: lx.sum(), lambda: x.sum(), lambda: dx.sum(), lambda: fx.sum()),
        "redistribute (no-op)": (lambda: lx, lambda: x.redistribute("S(0)"),
                                 lambda: dx.redistribute(dmesh, shard), lambda: fx),
        "add, autograd": (lambda: lxg + lyg, lambda: xg + yg, lambda: dxg + dyg, lambda: fxg + fyg),
        "mm, autograd": (lambda: lxg @ lwg, lambda: xg @ wg, lambda: dxg @ dwg, lambda: fxg @ fwg),
    }


def _worker(rank: int, world: int, port: int, iters: int, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cases = _cases(world)
        rows = {}
        for name, fns in cases.items():
            for fn in fns:                       # warm up: caches, first-call imports
                _time(fn, 200)
            best = [float("inf")] * len(fns)
            for _ in range(repeats):             # interleaved, so load changes hit every column alike
                for i, fn in enumerate(fns):
                    best[i] = min(best[i], _time(fn, iters))
            rows[name] = best
        if rank == 0:
            queue.put(rows)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ranks: int = 1, iters: int = 2000, repeats: int = 7) -> dict[str, list[float]]:
    """Time the cases on `ranks` gloo processes; return {op: [torch, sbp, DTensor, floor] in us} from rank 0."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, ranks, port, iters, repeats, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    return rows


def report(rows: dict[str, list[float]], ranks: int) -> str:
    """The table: per-call times and the overhead (time above plain torch) of sbp and DTensor."""
    head = (f"dispatch overhead on 8x8 float32, {ranks}-rank gloo mesh (us per call, best of runs)\n"
            f"{'op':<22}{'torch':>7}{'sbp':>7}{'DTensor':>8}{'floor':>7}{'sbp ovh':>9}{'DT ovh':>8}{'floor ovh':>10}"
            f"{'sbp/DT':>8}")
    lines = [head]
    for name, (plain, ours, theirs, floor) in rows.items():
        o, t, f = ours - plain, theirs - plain, floor - plain
        lines.append(f"{name:<22}{plain:>7.2f}{ours:>7.2f}{theirs:>8.2f}{floor:>7.2f}{o:>9.2f}{t:>8.2f}{f:>10.2f}"
                     f"{o / t:>8.2f}")
    lines.append("ovh = time above plain torch on the local tensors (autograd rows: plain torch records too).")
    lines.append("target: sbp/DT <= 0.50. floor = the cheapest Python __torch_dispatch__ wrapper (unwrap, op,")
    lines.append("rewrap); sbp's operators skip the dispatcher when autograd need not record (sbp.ops.direct).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1, help="gloo processes (default 1)")
    parser.add_argument("--iters", type=int, default=2000, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per op and implementation")
    args = parser.parse_args()
    print(report(run(args.ranks, args.iters, args.repeats), args.ranks))


if __name__ == "__main__":
    main()
