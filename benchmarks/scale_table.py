"""sbp's plans against DTensor's greedy plans on meshes of 64 to 16,384 ranks, 8 GPUs per host (docs/scale.md).

For each mesh and change: sbp plans with a topology (`sbp.Topology.preset(PRESET, mesh, 8)`, time objective);
DTensor's default (greedy) planner is asked for its plan by its own code
(``torch.distributed.tensor._redistribute._gen_transform_infos_non_cached``) on a fake process group (no
processes), and its steps are priced by sbp's cost model under the same topology: bytes the busiest rank
receives (`sbp.planning.cost.Costing`), collectives, and modeled time (ring rounds x alpha + bytes / beta of the
step's axis). Shapes are even, so DTensor's torch.chunk layout equals sbp's balanced one. Also sbp's cold
planning time (CPU, every memo cleared). Prints a markdown table; ``--svg FILE`` writes a plot of modeled
time (log scale) per mesh size.

    python benchmarks/scale_table.py [--preset dgx-h100] [--svg docs/scale.svg]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.tensor import Partial as DPartial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
from torch.testing._internal.distributed.fake_pg import FakeStore

import sbp
import sbp.planning
from sbp.planning.cost import Costing

MESHES = [(8, 8), (4, 4, 8), (2, 8, 8, 8), (4, 16, 8, 8), (8, 16, 16, 8)]   # 64 .. 16,384 ranks, 8 per host (last axis)
SHAPE = (8192, 8192)
CHANGES = [  # (name, src, dst) on the first three mesh axes; later axes stay B
    ("S(0) to S(1) on all axes", "S(0)", "S(1)"),
    ("gather a 2-axis split", "S(0), S(0)", "B, B"),
    ("swap dims across axes", "S(0), S(1)", "S(1), S(0)"),
    ("reduce the host axis to S(1)", "S(0), ..., P", "S(0), ..., S(1)"),
]


def states(mesh: tuple[int, ...], src: str, dst: str) -> tuple[tuple, tuple]:
    """The change on every axis (one placement given) or on the leading axes (the rest B)."""
    n = len(mesh)
    if "..." in src:   # first axis, B in the middle, last axis
        first, last = (sbp.placements(x.replace(", ...", "")) for x in (src, dst))
        return ((first[0],) + (sbp.B,) * (n - 2) + (first[1],), (last[0],) + (sbp.B,) * (n - 2) + (last[1],))
    s, d = sbp.placements(src), sbp.placements(dst)
    fill = lambda p: p * n if len(p) == 1 else p + (sbp.B,) * (n - len(p))
    return fill(s), fill(d)


def to_dtensor(pls) -> tuple:
    return tuple(Shard(p.dim) if isinstance(p, sbp.Split) else DPartial("sum") if isinstance(p, sbp.Partial)
                 else Replicate() for p in pls)


def from_dtensor(p):
    return sbp.S(p.dim) if p.is_shard() else sbp.Partial() if p.is_partial() else sbp.B


def dtensor_steps(mesh_obj, shape, src, dst) -> list[tuple[int, object, object]]:
    meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), torch.float32)
    infos = _gen_transform_infos_non_cached(DTensorSpec(mesh_obj, to_dtensor(src), meta),
                                            DTensorSpec(mesh_obj, to_dtensor(dst), meta))
    return [(i.mesh_dim, from_dtensor(i.src_dst_placements[0]), from_dtensor(i.src_dst_placements[1])) for i in infos]


def price_dtensor(shape, mesh, src, steps, topology) -> tuple[int, int, float]:
    """(bytes, collectives, modeled µs) of DTensor's steps, each priced by sbp's formulas on its axis."""
    c = Costing(shape, mesh, 4)
    state, total, calls, ns = tuple(src), 0, 0, 0
    for axis, _, to in steps:
        new = tuple(to if a == axis else p for a, p in enumerate(state))
        n = mesh[axis]
        before = state[axis]
        if isinstance(before, sbp.Partial):
            if isinstance(to, sbp.Split):
                recv, rounds = (n - 1) * c.max_local_bytes(new) // 4, n - 1
            else:
                m = c.max_local_bytes(state) // 4
                recv, rounds = -(-m // n) * (n - 2) + m, 2 * (n - 1)
        elif isinstance(before, sbp.Split):
            recv, rounds = c.lack(state, new), n - 1   # all_gather or all_to_all: what the rank lacks
        else:
            recv, rounds = 0, 0                        # B -> S or B -> P: local
        if rounds:
            calls += 1
            total += recv * 4
            ns += topology.time_ns((axis,), rounds, recv * 4)
        state = new
    return total, calls, ns / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="dgx-h100")
    ap.add_argument("--svg", default=None)
    args = ap.parse_args()
    world = max(math.prod(m) for m in MESHES)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    rows = []
    for mesh in MESHES:
        topo = sbp.Topology.preset(args.preset, mesh, devices_per_host=8)
        tmesh = TorchMesh("cpu", torch.arange(math.prod(mesh)).reshape(mesh))
        for name, s_text, d_text in CHANGES:
            src, dst = states(mesh, s_text, d_text)
            sbp.planning.clear_caches()
            t0 = time.process_time()
            p = sbp.plan(SHAPE, mesh, src, dst, topology=topo)
            ms = (time.process_time() - t0) * 1e3
            dbytes, dcalls, dus = price_dtensor(SHAPE, mesh, src, dtensor_steps(tmesh, SHAPE, src, dst), topo)
            rows.append((mesh, name, p, ms, dbytes, dcalls, dus))
            print(f"  {mesh} {name}: planned in {ms:.1f} ms", file=sys.stderr, flush=True)
    dist.destroy_process_group()
    print(f"shape {SHAPE} fp32, topology preset {args.preset!r}, 8 devices per host (the last mesh axis); "
          f"bytes: the busiest rank's, MiB; time: modeled µs")
    print("| mesh | ranks | change | sbp MiB | DTensor MiB | sbp calls | DTensor calls | sbp µs | DTensor µs | "
          "DTensor / sbp time | sbp planning ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mesh, name, p, ms, dbytes, dcalls, dus in rows:
        print(f"| {'x'.join(map(str, mesh))} | {math.prod(mesh)} | {name} | {p.bytes_per_rank / 2**20:.2f} | "
              f"{dbytes / 2**20:.2f} | {p.num_collectives} | {dcalls} | {p.time_us:.1f} | {dus:.1f} | "
              f"{dus / p.time_us:.2f}x | {ms:.2f} |")
    if args.svg:
        write_svg(args.svg, rows)
        print(f"wrote {args.svg}")


def write_svg(path: str, rows) -> None:
    """A small line plot, by hand (no plotting library needed): modeled time per change, sbp solid,
    DTensor dashed, log scales on both axes."""
    names = list(dict.fromkeys(r[1] for r in rows))
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    ranks = sorted({math.prod(r[0]) for r in rows})
    times = [t for r in rows for t in (r[2].time_us, r[6]) if t > 0]
    lo, hi = math.log10(min(times)) - 0.1, math.log10(max(times)) + 0.1
    W, H, L, R, T, B = 720, 420, 70, 230, 20, 50
    x = lambda n: L + (math.log2(n) - math.log2(ranks[0])) / (math.log2(ranks[-1]) - math.log2(ranks[0])) * (W - L - R)
    y = lambda t: T + (hi - math.log10(t)) / (hi - lo) * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 10}" text-anchor="middle">ranks (8 per host)</text>',
           f'<text x="15" y="{(T + H - B) / 2}" transform="rotate(-90 15 {(T + H - B) / 2})" '
           f'text-anchor="middle">modeled time, µs (log)</text>']
    for n in ranks:
        out.append(f'<text x="{x(n):.1f}" y="{H - B + 16}" text-anchor="middle">{n}</text>')
    for e in range(math.ceil(lo), math.floor(hi) + 1):
        out.append(f'<text x="{L - 6}" y="{y(10 ** e) + 4:.1f}" text-anchor="end">{10 ** e:g}</text>')
        out.append(f'<line x1="{L}" y1="{y(10 ** e):.1f}" x2="{W - R}" y2="{y(10 ** e):.1f}" stroke="#ddd"/>')
    for k, name in enumerate(names):
        pts = sorted((math.prod(r[0]), r[2].time_us, r[6]) for r in rows if r[1] == name)
        for which, dash in ((1, ""), (2, ' stroke-dasharray="5,4"')):
            line = " ".join(f"{x(n):.1f},{y(p[which]):.1f}" for n, *_ in pts for p in [(n, *_)] if p[which] > 0)
            out.append(f'<polyline fill="none" stroke="{colors[k % 4]}" stroke-width="2"{dash} points="{line}"/>')
        out.append(f'<text x="{W - R + 10}" y="{T + 20 + 18 * k}" fill="{colors[k % 4]}">{name}</text>')
    out.append(f'<text x="{W - R + 10}" y="{T + 20 + 18 * len(names) + 10}">solid: sbp, dashed: DTensor</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
