"""Executor work per call at scale: the time one rank spends building the buffer layouts of one exchange step
on a mesh of 4,096 ranks, simulated for that rank alone (no processes): `exchange_layout` (the all_to_all
route) and `p2p_layout` (the messages route), cold (every memo cleared). Also the group-wide route decision
`messages_copy_nothing`, which looks at every member's messages.

CPU time of this process (`time.process_time`).

    python benchmarks/layout_scale.py [--mesh 16x16x16] [--shape 4096x4096]
"""
from __future__ import annotations

import argparse
import time

import sbp
import sbp.planning
from sbp.runtime import buffers, caches

CHANGES = [("S(0), S(1), B", "S(1), S(0), B"), ("S(0), S(0), S(1)", "S(1), B, S(0)"),
           ("B, S(0), S(1)", "S(0), S(1), B"), ("S(1), B, S(0)", "B, S(0), S(1)")]


def cold(fn) -> float:
    caches.clear_caches()
    sbp.planning.clear_caches()
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="16x16x16")
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--decision", action="store_true", help="also time the group-wide route decision")
    args = ap.parse_args()
    mesh = tuple(int(n) for n in args.mesh.split("x"))
    shape = tuple(int(n) for n in args.shape.split("x"))
    coord = tuple(n // 2 - 1 if n > 1 else 0 for n in mesh)
    print(f"buffer layouts of one step for coord {coord} of mesh {mesh} ({sbp.DeviceMesh(mesh).size()} ranks), "
          f"shape {shape}; cold, ms of CPU")
    head = f"{'change':<34}{'step':<24}{'peers':>6}{'exchange_layout':>17}{'p2p_layout':>12}"
    head += f"{'route decision':>16}" if args.decision else ""
    print(head)
    print("-" * len(head))
    for src, dst in CHANGES:
        plan = sbp.plan(shape, mesh, src, dst)
        for step in plan.steps:
            if step.kind not in ("all_to_all", "transfer"):
                continue
            where = (shape, mesh, step.src, step.dst, step.axes, coord)
            t_ex = cold(lambda: buffers.exchange_layout(*where))
            t_p2p = cold(lambda: buffers.p2p_layout(*where))
            peers = len(buffers.p2p_layout(*where).recvs)
            row = f"{src + ' -> ' + dst:<34}{step.kind + ' axes ' + ','.join(map(str, step.axes)):<24}{peers:>6}"
            row += f"{t_ex:>17.2f}{t_p2p:>12.2f}"
            if args.decision:
                row += f"{cold(lambda: buffers.messages_copy_nothing(*where)):>16.1f}"
            print(row)


if __name__ == "__main__":
    main()
