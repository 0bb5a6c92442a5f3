"""Soak: 20,000 random redistributions and ops on 4 gloo ranks -- memory, process groups and hangs over a long run.

Not part of CI (minutes of CPU). The 4 ranks are `sbp.testing.spmd`'s gloo workers; the run is cut into
jobs of ``--chunk`` operations, each a random sequence drawn from a seed every rank shares (SPMD), on a
2x2 mesh: `redistribute` between random placements (Split, Broadcast, Partial sum/max; even, uneven,
tiny and empty shapes), `+` of tensors in different layouts, matmul, `sum` over a dim, `softmax`,
`full()`. Every collective runs under a timeout (``--timeout`` s): a hang fails its job with a
`CommError` instead of waiting, and counts as one. Per job each rank reports its resident set size
(RSS, from /proc/self/statm), the number of process groups torch.distributed holds and those sbp made;
results are checked against the logical values (one in 50 operations, `full()` against a replay on
plain tensors). It prints the RSS at start (after the first job: caches warm) and at the end per rank,
the growth, the process-group counts, the hangs, and PASS or FAIL (growth <= 5%, constant groups,
zero hangs, zero wrong results). Bounded in time: ``--max-seconds`` stops it early (reported).

    python benchmarks/soak.py                      # 20,000 operations
    python benchmarks/soak.py --ops 2000           # a quick look
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import time

import torch

import sbp
import sbp.testing

PLACEMENTS = ["S(0), S(1)", "S(1), S(0)", "S(0), S(0)", "B, S(1)", "S(0), B", "B, B", "P(sum), S(0)", "S(1), P(sum)",
              "P(sum), P(sum)", "B, P(max)"]
SHAPES = [(8, 8), (10, 7), (3, 5), (2, 3), (0, 4), (16, 12), (5, 9)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _group_count() -> int:
    import torch.distributed as dist
    world = getattr(dist.distributed_c10d, "_world", None)
    return len(getattr(world, "pg_map", {})) if world is not None else -1


def _value(shape, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64)


def job(mesh, seed: int, ops: int) -> dict:
    """`ops` random operations (the same on every rank); returns this rank's counters."""
    from sbp.runtime.backends.dist import PROCESS_GROUPS

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    wrong = 0
    for i in range(ops):
        shape = rng.choice(SHAPES)
        src, dst = rng.choice(PLACEMENTS), rng.choice(PLACEMENTS)
        if "P(max)" in dst and "P(sum)" in src:
            dst = "B, B"
        t = _value(shape, g)
        x = sbp.distribute(t, mesh, src.replace("P(sum)", "B").replace("P(max)", "B"))
        if "P" in src:
            x = x.redistribute(src)
        kind = rng.randrange(6)
        if kind == 0:
            y, want = x.redistribute(dst), t
        elif kind == 1:
            y, want = x + sbp.distribute(t, mesh, dst.replace("P(sum)", "B").replace("P(max)", "B")), t + t
        elif kind == 2:
            w = _value((shape[1], 4), g)
            y, want = x @ sbp.distribute(w, mesh, "B, S(1)"), t @ w
        elif kind == 3:
            d = rng.randrange(2)
            y, want = x.sum(d), t.sum(d)
        elif kind == 4:
            y, want = x.softmax(-1), t.softmax(-1)
        else:
            y, want = x.redistribute(dst).redistribute(src), t
        if i % 50 == 0 and not torch.allclose(y.full(), want, rtol=1e-9, atol=1e-9):
            wrong += 1
    return {"rss": _rss_bytes(), "groups": _group_count(), "sbp_groups": PROCESS_GROUPS.made, "wrong": wrong}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--chunk", type=int, default=1000, help="operations per job (default 1000)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per collective before it is a hang")
    p.add_argument("--max-seconds", type=float, default=1800.0, help="stop after this long (default 1800)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    done, hangs, reports = 0, 0, []
    for seed in range(-(-args.ops // args.chunk)):
        if time.monotonic() - t0 > args.max_seconds:
            break
        n = min(args.chunk, args.ops - done)
        try:
            reports.append(sbp.testing.spmd(functools.partial(job, seed=seed, ops=n), (2, 2), backend="gloo",
                                            timeout=args.timeout))
        except sbp.testing.SpmdError as e:
            if isinstance(e.__cause__, sbp.CommError):
                hangs += 1
                print(f"job {seed}: {e}", file=sys.stderr)
                continue
            raise
        done += n
        print(f"{done:6d} ops  {time.monotonic() - t0:7.1f} s  RSS rank 0 {reports[-1][0]['rss'] / 2**20:7.1f} MiB  "
              f"groups {reports[-1][0]['groups']}", flush=True)
    elapsed = time.monotonic() - t0
    first, last = reports[0], reports[-1]
    growth = [(b["rss"] - a["rss"]) / a["rss"] for a, b in zip(first, last)]
    groups = sorted({r["groups"] for rep in reports for r in rep})
    sbp_groups = sorted({r["sbp_groups"] for rep in reports for r in rep})
    wrong = sum(r["wrong"] for rep in reports for r in rep)
    print(f"\nsoak: {done} operations ({len(reports)} jobs of <= {args.chunk}) on 4 gloo ranks (2x2) in {elapsed:.0f} s"
          + (" -- stopped by --max-seconds" if done < args.ops else ""))
    print("rank  RSS start (MiB)  RSS end (MiB)  growth")
    for rank, (a, b, gr) in enumerate(zip(first, last, growth)):
        print(f"{rank:4d}  {a['rss'] / 2**20:15.1f}  {b['rss'] / 2**20:13.1f}  {gr * 100:+5.2f}%")
    print(f"process groups (torch.distributed, per job): {groups}; made by sbp: {sbp_groups}")
    print(f"hangs: {hangs}; wrong results: {wrong} (checked one operation in 50)")
    ok = max(growth) <= 0.05 and len(groups) == 1 and len(sbp_groups) == 1 and hangs == 0 and wrong == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
