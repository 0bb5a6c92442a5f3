"""A tour of redistribution: one global tensor moved through several layouts on a 2x2 mesh of CPU ranks.

For each change the script prints the plan (rank 0; `plan.explain()` reads like a database EXPLAIN),
runs it, and checks every rank's local tensor against the slice of the full tensor it must hold
(Partial layouts: against the reduction of the ranks' contributions, computed with one more move).

    python examples/redistribute.py                                  # launches 4 gloo ranks itself
    torchrun --standalone --nproc-per-node 4 examples/redistribute.py

Without torchrun's environment the script picks a free port on 127.0.0.1 and spawns one process per
rank; each then calls `sbp.init_mesh`, which reads MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE.
"""
from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed
import torch.multiprocessing as mp

import sbp
from sbp.runtime.executor import redistribute_local

WORLD = 4
# (from, to): even and uneven splits, a transpose of shards, gathers, reductions, Partial round trips
TOUR = [
    ("S(0), S(1)", "S(1), S(0)"),   # one exact point-to-point exchange
    ("S(1), S(0)", "S(0), S(0)"),
    ("S(0), S(0)", "B, S(0)"),       # note the nested uneven rows: 10 over 2x2 is 3,2,3,2
    ("B, S(0)", "B, B"),
    ("B, B", "P(sum), S(1)"),        # free: zero-fill and slice, no communication
    ("P(sum), S(1)", "S(0), B"),     # reduce_scatter, then gather
    ("S(0), B", "P(max), P(max)"),
    ("P(max), P(max)", "S(1), S(1)"),
]


def main() -> None:
    mesh = sbp.init_mesh((2, 2), names=("dp", "tp"), device_type="cpu")
    rank = mesh.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    full = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)  # same on every rank; 10 rows: uneven
    say(f"mesh {mesh}, global tensor {tuple(full.shape)}\n")

    x = sbp.distribute(full, mesh, TOUR[0][0])
    for src, dst in TOUR:
        plan = sbp.plan(full.shape, mesh, src, dst, itemsize=full.element_size())
        say(plan.explain())
        x = x.redistribute(dst)
        _check(full, x, mesh)
        say(f"  -> ok on rank 0: local {tuple(x.to_local().shape)} of {tuple(x.shape)}\n")

    # the same without the tensor class: plain local tensors through the executor
    local = full[sbp.local_slices(full.shape, mesh, "S(0), S(1)", mesh.coord)]
    back = redistribute_local(local, mesh, full.shape, "S(0), S(1)", "B, B")
    assert torch.equal(back, full), f"rank {rank}: raw-local round trip differs"
    counters = mesh.binding.counters
    say(f"raw-local API: ok; rank 0 received {counters.received} bytes in {len(counters.calls)} collectives")
    print(f"rank {rank}: all {len(TOUR)} layouts checked")
    torch.distributed.barrier()   # tear down together: no rank closes its connections under the others
    torch.distributed.destroy_process_group()


def _check(full: torch.Tensor, x, mesh: sbp.DeviceMesh) -> None:
    """Split/Broadcast layouts: the local is exactly its slice. Partial ones: reduce, then compare."""
    if any(isinstance(p, sbp.Partial) for p in x.placements):
        whole = x.redistribute(["B"] * mesh.ndim).to_local()
    else:
        whole = full[sbp.local_slices(full.shape, mesh, x.placements, mesh.coord)]
        assert torch.equal(x.to_local(), whole), f"rank {mesh.rank}: {x.placements} local differs"
        return
    assert torch.equal(whole, full), f"rank {mesh.rank}: {x.placements} does not reduce to the tensor"


def _launch(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    main()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        main()
    else:
        mp.start_processes(_launch, args=(_free_port(),), nprocs=WORLD, start_method="spawn")
        sys.exit(0)
