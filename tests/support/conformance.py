"""The conformance case table every backend must pass, and the code that runs and checks a case.

A case is (mesh shape, src placements, dst placements); each runs over the global shapes in `SHAPES`
(tests/support/cases.py, the table the tiers share) and the `VARIANTS` (dtype, contiguity). Source
locals are cut from a known global tensor; Partial sources get *real* per-rank contributions (random
parts whose nested sum/min/max is the global). Values are small integers, so every dtype (bfloat16 too)
reduces exactly and results compare with `torch.equal`. The check rebuilds the logical tensor from all
ranks' results by the definition (concatenate Split axes, require equal Broadcast replicas, reduce
Partial axes) and compares it with the global; every rank's shape must be its layout shape. Traffic: the
busiest rank's received bytes per step, counted at the communicator, must equal the plan's per-step
figure.

`run_cases` runs on every rank (module level, so gloo workers can unpickle it); `check_case` runs in
the test process on the per-rank results.
"""
from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

import sbp
from sbp.runtime.communicator import reduce_list
from sbp.runtime.executor import execute_step, redistribute_local
from sbp.values.placement import Broadcast, Partial, Split
from tests.support.cases import HAND_SHAPES, MESH_1D, MESH_2D, MESH_3D, SHAPES, SHAPES_8_RANKS

PLACEMENTS_1D = ("S(0)", "S(1)", "B", "P(sum)", "P(min)", "P(max)")
PLACEMENTS_2D = ("S(0)", "S(1)", "B", "P(sum)")
# (dtype, strided local); the first variant runs step by step and has its traffic checked
VARIANTS = (("float32", False), ("float32", True), ("int32", False), ("bfloat16", False), ("float16", True),
            ("int64", True))
FEW_VARIANTS = (("float32", False), ("int32", True), ("bfloat16", False))
GLOO_VARIANTS = FEW_VARIANTS + (("float16", False),)


@dataclass(frozen=True)
class Case:
    """One placement change on one mesh, run over `shapes` x `variants`."""

    mesh_shape: tuple[int, ...]
    src: str
    dst: str
    shapes: tuple[tuple[int, ...], ...] = SHAPES
    variants: tuple[tuple[str, bool], ...] = VARIANTS

    @property
    def id(self) -> str:
        mesh = "x".join(map(str, self.mesh_shape))
        return f"{mesh}:{self.src}->{self.dst}".replace(" ", "")


def cases_1d(variants=VARIANTS) -> list[Case]:
    """Every pair of {S(0), S(1), B, P(sum), P(min), P(max)} on a mesh of 4."""
    return [Case(MESH_1D, s, d, variants=variants) for s in PLACEMENTS_1D for d in PLACEMENTS_1D]


def cases_2d(variants=FEW_VARIANTS) -> list[Case]:
    """Every pair of tuples over {S(0), S(1), B, P(sum)} on a 2x2 mesh."""
    tuples = [", ".join(t) for t in itertools.product(PLACEMENTS_2D, repeat=2)]
    return [Case(MESH_2D, s, d, variants=variants) for s in tuples for d in tuples]


def cases_3d() -> list[Case]:
    """A 2x2x2 subset: hand-picked hard changes plus a fixed random sample of the 64 x 64 pairs."""
    picked = [("S(0), S(0), S(0)", "B, B, B"), ("S(0), S(1), S(0)", "S(1), S(0), S(1)"),
              ("P(sum), P(sum), P(sum)", "B, S(0), S(1)"), ("S(0), S(0), S(1)", "S(1), S(1), S(0)"),
              ("B, B, B", "S(1), S(0), S(0)"), ("S(1), B, S(0)", "S(0), S(0), S(0)"),
              ("P(sum), S(0), B", "S(0), S(1), P(sum)"), ("B, P(sum), S(1)", "P(sum), P(sum), P(sum)")]
    tuples = [", ".join(t) for t in itertools.product(PLACEMENTS_2D, repeat=3)]
    rng = random.Random(3)
    picked += [(rng.choice(tuples), rng.choice(tuples)) for _ in range(24)]
    return [Case(MESH_3D, s, d, shapes=SHAPES_8_RANKS, variants=(("float32", False),))
            for s, d in picked]


# ---- building inputs ------------------------------------------------------------------------------

def stable_seed(*parts: Any) -> int:
    """A seed that is the same in every process (`hash` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def global_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Small integers in [-8, 8]: exact in every dtype, also after a few additions."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g).to(dtype)


def _parts(value: torch.Tensor, op: str, n: int, seed: int) -> list[torch.Tensor]:
    """`n` contributions whose element-wise `op`-reduction is `value`."""
    g = torch.Generator().manual_seed(seed)
    noise = [torch.randint(0, 5, value.shape, generator=g).to(value.dtype) for _ in range(n)]
    if op == "sum":
        rest = [x - 2 for x in noise[1:]]
        return [value - sum(rest, torch.zeros_like(value))] + rest
    owner = torch.randint(0, n, value.shape, generator=g)
    sign = 1 if op == "min" else -1
    return [torch.where(owner == k, value, value + sign * noise[k].clamp(min=1)) for k in range(n)]


def source_local(g: torch.Tensor, mesh_shape: Sequence[int], src, coord: Sequence[int], seed: int) -> torch.Tensor:
    """This coord's local tensor of `g` laid out as `src` (Partial axes get real contributions).

    Contributions are made on the whole tensor, axis by axis, seeded by the coords of the earlier
    Partial axes, so every rank derives the same decomposition and slices its own block of it.
    """
    pls = sbp.placements(src)
    value = g
    for axis, p in enumerate(pls):
        if isinstance(p, Partial):
            path = tuple(coord[a] for a in range(axis) if isinstance(pls[a], Partial))
            value = _parts(value, p.op, mesh_shape[axis], stable_seed(seed, axis, path))[coord[axis]]
    return value[sbp.local_slices(g.shape, mesh_shape, pls, coord)].clone()


def strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor equal to `t` (every other element of a bigger buffer)."""
    big = t.new_zeros(tuple(2 * n for n in t.shape))
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


# ---- running (on every rank) ----------------------------------------------------------------------

def run_cases(cases: Sequence[Case], mesh: sbp.DeviceMesh) -> list[list[dict[str, Any]]]:
    """Run every case on this rank; one result dict per (shape, variant) per case."""
    return [run_case(case, mesh) for case in cases]


def run_cases_routed(cases: Sequence[Case], mesh: sbp.DeviceMesh, *, route: str,
                     native: bool = False) -> list[list[dict[str, Any]]]:
    """`run_cases` with exchanges by `route` ("messages": `send_recv`, "all_to_all": one
    all_to_all_single); with `native` on gloo, also a native reduce_scatter: the CUDA route's code run
    on CPU."""
    comm = mesh.binding
    saved = vars(comm).copy()   # gloo workers keep their meshes between runs: put the route back after
    comm.exchange_route = route
    if native:
        comm._gloo = False
    try:
        return run_cases(cases, mesh)
    finally:
        comm.exchange_route = saved.get("exchange_route", type(comm).exchange_route)
        if native:
            comm._gloo = saved["_gloo"]


def exchange_among_some_ranks(world: sbp.DeviceMesh):
    """Ranks 0, 2, 3 of a 4-rank world swap pieces point-to-point; rank 1 takes no part (both backends
    run it)."""
    ranks = [0, 2, 3]
    me = world.rank
    if me not in ranks:
        return None
    send = {p: [torch.full((me + 1,), float(me)), torch.zeros(0)] for p in ranks if p != me}
    shapes = {p: [(p + 1,), (0,)] for p in ranks if p != me}
    got = world.binding.exchange(ranks, send, shapes, dtype=torch.float32, device="cpu")
    return {p: [t.tolist() for t in pieces] for p, pieces in got.items()}, world.binding.counters.received


def has_exchange(case: Case) -> bool:
    """Whether the plan of `case` on its first shape has an all_to_all or a transfer step."""
    plan = sbp.plan(case.shapes[0], case.mesh_shape, case.src, case.dst, itemsize=4)
    return any(step.kind in ("all_to_all", "transfer") for step in plan.steps)


def run_case(case: Case, mesh: sbp.DeviceMesh, device: str = "cpu") -> list[dict[str, Any]]:
    """Run `case` on this rank with the locals on `device`; results come back on the CPU (and say
    whether they were on `device`)."""
    out = []
    for shape, (dtype_name, noncontig) in itertools.product(case.shapes, case.variants):
        dtype = getattr(torch, dtype_name)
        seed = stable_seed(case.id, shape, dtype_name)
        g = global_tensor(shape, dtype, seed)
        local = source_local(g, mesh.shape, case.src, mesh.coord, seed).to(device)
        if noncontig:
            local = strided(local)
        step_bytes, step_calls = [], []
        if (dtype_name, noncontig) == case.variants[0]:
            plan = sbp.plan(shape, mesh.shape, case.src, case.dst, itemsize=local.element_size())
            counters = mesh.binding.counters
            result = local
            for step in plan.steps:
                received, calls = counters.received, len(counters.calls)
                result = execute_step(step, result, mesh, shape)
                step_bytes.append(counters.received - received)
                step_calls.append(len(counters.calls) - calls)
        else:
            result = redistribute_local(local, mesh, shape, case.src, case.dst)
        out.append({"shape": shape, "dtype": dtype_name, "noncontig": noncontig, "local": result.cpu(),
                    "device": result.device.type, "contiguous": result.is_contiguous(), "step_bytes": step_bytes,
                    "step_calls": step_calls})
    return out


# ---- checking (in the test process) ---------------------------------------------------------------

def logical(locals_: dict[tuple[int, ...], torch.Tensor], mesh_shape: Sequence[int], pls,
            prefix: tuple[int, ...] = ()) -> torch.Tensor:
    """The logical tensor the per-coord locals represent, by the nested definition (axis 0 outermost)."""
    axis = len(prefix)
    if axis == len(mesh_shape):
        return locals_[prefix]
    parts = [logical(locals_, mesh_shape, pls, prefix + (c,)) for c in range(mesh_shape[axis])]
    match pls[axis]:
        case Split(dim=d):
            return torch.cat(parts, dim=d)
        case Broadcast():
            for c, part in enumerate(parts[1:], 1):
                if part.shape != parts[0].shape or not torch.equal(part, parts[0]):
                    raise AssertionError(f"Broadcast replicas differ on mesh axis {axis} at {prefix + (c,)}")
            return parts[0]
        case Partial(op=op):
            return reduce_list(parts, op)


def check_case(case: Case, per_rank: Sequence[list[dict[str, Any]]]) -> None:
    """Assert that the per-rank results of `case` (rank order) are right; messages name the variant."""
    mesh = sbp.DeviceMesh(case.mesh_shape)
    coords = mesh.coords()
    for i, first in enumerate(per_rank[0]):
        shape, dtype = first["shape"], getattr(torch, first["dtype"])
        what = f"{case.id} shape={shape} {first['dtype']}{' strided' if first['noncontig'] else ''}"
        dst = sbp.placements(case.dst)
        locals_ = {}
        for rank, coord in enumerate(coords):
            r = per_rank[rank][i]
            want = sbp.local_shape(shape, mesh, dst, coord)
            assert tuple(r["local"].shape) == want, f"{what}: rank {rank} local shape {tuple(r['local'].shape)} != {want}"
            assert r["local"].dtype == dtype, f"{what}: rank {rank} dtype {r['local'].dtype}"
            assert r["contiguous"], f"{what}: rank {rank} result is not contiguous"
            locals_[coord] = r["local"]
        seed = stable_seed(case.id, shape, first["dtype"])
        expected = global_tensor(shape, dtype, seed)
        got = logical(locals_, case.mesh_shape, sbp.placements(case.dst))
        assert torch.equal(got, expected), f"{what}: logical result differs from the global tensor"
        if first["step_bytes"]:
            plan = sbp.plan(shape, case.mesh_shape, case.src, case.dst, itemsize=dtype.itemsize)
            busiest = [max(per_rank[rank][i]["step_bytes"][k] for rank in range(len(coords)))
                       for k in range(len(plan.steps))]
            assert busiest == [s.bytes for s in plan.steps], (
                f"{what}: received bytes per step {busiest} != plan {[s.bytes for s in plan.steps]}\n{plan.explain()}")
            calls = [max(per_rank[rank][i]["step_calls"][k] for rank in range(len(coords)))
                     for k in range(len(plan.steps))]
            assert all(c <= s.calls for c, s in zip(calls, plan.steps)), f"{what}: calls {calls}"


# ---- hand-built steps: every collective kind forced, even and uneven ---------------------------------

def hand_steps(mesh_shape: tuple[int, ...]) -> list[tuple[sbp.Step, tuple[int, ...]]]:
    """(step, global shape) pairs that force each collective kind, whatever the planner would pick."""
    S, B, P = sbp.S, sbp.B, sbp.Partial
    if len(mesh_shape) == 1:
        a = (0,)
        steps = [sbp.Step("all_gather", a, (S(0),), (B,), dims=(0,)), sbp.Step("all_gather", a, (S(1),), (B,), dims=(1,)),
                 sbp.Step("reduce_scatter", a, (P(),), (S(0),), dims=(0,), op="sum"),
                 sbp.Step("reduce_scatter", a, (P("max"),), (S(1),), dims=(1,), op="max"),
                 sbp.Step("all_reduce", a, (P("min"),), (B,), op="min"),
                 sbp.Step("all_to_all", a, (S(0),), (S(1),), dims=(0, 1)),
                 sbp.Step("transfer", a, (S(1),), (B,)),
                 sbp.Step("reduce_transfer", a, (P("min"),), (B,), op="min")]
    else:
        ab = (0, 1)
        steps = [sbp.Step("all_gather", ab, (S(0), S(0)), (B, B), dims=(0,)),
                 sbp.Step("all_gather", (1,), (S(0), S(0)), (S(0), B), dims=(0,)),
                 sbp.Step("reduce_scatter", ab, (P(), P()), (S(0), S(0)), dims=(0,), op="sum"),
                 sbp.Step("reduce_scatter", (1,), (S(1), P()), (S(1), S(1)), dims=(1,), op="sum"),
                 sbp.Step("all_reduce", ab, (P(), P()), (B, B), op="sum"),
                 sbp.Step("transfer", ab, (S(0), S(1)), (S(1), S(0))),
                 sbp.Step("reduce_transfer", ab, (P(), S(0)), (S(0), B), op="sum"),
                 sbp.Step("reduce_transfer", ab, (P("max"), B), (S(1), S(0)), op="max")]
    return [(step, shape) for step in steps for shape in HAND_SHAPES]


def run_hand_steps(mesh: sbp.DeviceMesh) -> list[torch.Tensor]:
    out = []
    for step, shape in hand_steps(mesh.shape):
        g = global_tensor(shape, torch.float32, stable_seed("hand", shape))
        local = source_local(g, mesh.shape, step.src, mesh.coord, stable_seed("hand-parts", shape))
        out.append(execute_step(step, local, mesh, shape))
    return out


def check_hand_steps(mesh_shape: tuple[int, ...], per_rank: Sequence[list[torch.Tensor]]) -> None:
    coords = sbp.DeviceMesh(mesh_shape).coords()
    for i, (step, shape) in enumerate(hand_steps(mesh_shape)):
        locals_ = {c: per_rank[r][i] for r, c in enumerate(coords)}
        got = logical(locals_, mesh_shape, step.dst)
        assert torch.equal(got, global_tensor(shape, torch.float32, stable_seed("hand", shape))), (step, shape)
