"""DTensor's redistribution plan for a placement change, priced with sbp's cost model: the baseline.

No processes: `plans()` builds torch DeviceMeshes on the "fake" process-group backend
(`FakeStore`, rank 0) and asks DTensor's own planner,
``torch.distributed.tensor._redistribute._gen_transform_infos_non_cached(src_spec, dst_spec)``
(the default greedy planner, or the graph-based one with ``graph=True``), for its list of
``_TransformInfo`` steps. Because that initialises torch.distributed, tests call it through
`dtensor_plans()`, which runs this file in a subprocess (``python tests/support/dtensor_ref.py`` reads JSON
cases on stdin) so no process group leaks into other tests.

Pricing (`price`) uses the same formulas as `sbp.planning.cost` on DTensor's own layout: blocks nest in mesh-axis
order like sbp's, but a dim of length L splits torch.chunk-style (chunks of ceil(L/n), the last ones
smaller or empty) where sbp splits balanced. For each step on mesh axis a (group of n ranks), the bytes
the busiest rank receives:

========================  ==============  ===================================================
DTensor step              collective      busiest rank receives
========================  ==============  ===================================================
``Shard -> Replicate``    all_gather      max over ranks of (output - input) elements
``Partial -> Shard``      reduce_scatter  (n - 1) x the largest output piece
``Partial -> Replicate``  all_reduce      ring: (n - 2) x ceil(data / n) + the data
``Shard(d) -> Shard(e)``  all_to_all      the part of its new block it does not hold
``Replicate -> Shard``    local           0
``Replicate -> Partial``  local           0
``Shard -> Partial``,     (none)          unsupported: DTensor 2.13 raises when it runs them;
``P(op) -> P(op2)``                       the plan is priced as None
========================  ==============  ===================================================

For even shapes these are the textbook ring formulas ((n-1)/n of the gathered logical shape for
all_gather, 2 (n-1)/n of the data for all_reduce, (n-1)/n of the local tensor for all_to_all).
Padding DTensor adds for uneven collectives is not counted, and steps are priced one by one as
`_gen_transform_infos` lists them (DTensor merges consecutive same-type collectives only when the user
has created a flattened mesh), so the figures favour DTensor. Totals are per-step maxima summed, as in `sbp.Plan.bytes_per_rank`.
"""
from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
from typing import Optional, Sequence

import sbp
from sbp.io.interop import _to_torch
from sbp.values.placement import Broadcast, Partial, Placement, Split, normalize

Transform = tuple[int, Placement, Placement]  # (mesh axis, from, to) in sbp placements


# ---- DTensor's layout ----------------------------------------------------------------------------------
def chunk_range(lo: int, hi: int, n: int, i: int) -> tuple[int, int]:
    """The `i`-th of `n` torch.chunk-style parts of [lo, hi).

    >>> [chunk_range(0, 5, 4, i) for i in range(4)]
    [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    size = -(-(hi - lo) // n)
    start = min(hi, lo + i * size)
    return start, min(hi, start + size)


def dtensor_block(global_shape: Sequence[int], mesh_shape: Sequence[int], pls: Sequence[Placement],
                  coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The block DTensor holds at `coord` (default shard order: mesh axes nest left to right).

    >>> [dtensor_block((5,), (4,), (Split(0),), (c,)) for c in range(4)]
    [((0, 2),), ((2, 4),), ((4, 5),), ((5, 5),)]
    """
    ranges = [(0, n) for n in global_shape]
    for axis, p in enumerate(pls):
        if isinstance(p, Split):
            ranges[p.dim] = chunk_range(*ranges[p.dim], mesh_shape[axis], coord[axis])
    return tuple(ranges)


def _numel(b) -> int:
    return math.prod(hi - lo for lo, hi in b)


def _lack(have, want) -> int:
    common = math.prod(max(0, min(ah, bh) - max(al, bl)) for (al, ah), (bl, bh) in zip(have, want))
    return _numel(want) - common


def _ring_all_reduce(m: int, n: int) -> int:
    """Elements the busiest rank receives in a ring all_reduce of `m` elements over `n` ranks: a
    reduce_scatter and an all_gather of balanced pieces, (n - 1) pieces of ceil(m / n) plus the rest
    once (as `sbp.planning.cost`); 2 (n - 1) / n x m when n divides m.

    >>> _ring_all_reduce(1024, 4), _ring_all_reduce(35, 4)
    (1536, 53)
    """
    return -(-m // n) * (n - 2) + m if n > 1 else 0


def price(global_shape: Sequence[int], mesh_shape: Sequence[int], src: Sequence[Placement],
          transforms: Sequence[Transform], itemsize: int = 4) -> Optional[int]:
    """Bytes the busiest rank receives under DTensor's plan (see the module docstring), or None.

    DTensor's plan for ``(S(0), S(1)) -> (S(1), S(0))`` on 1024x1024 fp32, 2x2: all_gather on axis 1,
    all_to_all on axis 0, a local slice on axis 1:

    >>> S, B = Split, Broadcast()
    >>> price((1024, 1024), (2, 2), (S(0), S(1)), [(1, S(1), B), (0, S(0), S(1)), (1, B, S(0))])
    2097152
    """
    coords = sbp.DeviceMesh(tuple(mesh_shape)).coords()
    state = list(src)
    total = 0
    for axis, frm, to in transforms:
        if state[axis] != frm:
            raise ValueError(f"transform {frm!r} -> {to!r} on axis {axis} does not start from state {tuple(state)}")
        new = list(state)
        new[axis] = to
        n = mesh_shape[axis]
        before = [dtensor_block(global_shape, mesh_shape, state, c) for c in coords]
        after = [dtensor_block(global_shape, mesh_shape, new, c) for c in coords]
        match frm, to:
            case Split(), Broadcast():
                recv = max(_numel(o) - _numel(i) for i, o in zip(before, after))
            case Partial(), Split():
                recv = (n - 1) * max(map(_numel, after))
            case Partial(), Broadcast():
                recv = max(_ring_all_reduce(_numel(b), n) for b in before)
            case Split(), Split():
                recv = max(_lack(i, o) for i, o in zip(before, after))
            case Broadcast(), (Split() | Partial()):
                recv = 0
            case _:
                return None  # S -> P, P(op) -> P(op2): DTensor cannot run these
        total += recv * itemsize
        state = new
    return total


# ---- DTensor's planner (needs the fake process group; run in a subprocess) --------------------------------
def plans(cases: list[dict], graph: bool = False) -> list[dict]:
    """DTensor's transforms and their price for each case (``shape``, ``mesh``, ``src``, ``dst``, ``itemsize``).

    Initialises torch.distributed with the fake backend: call it in a fresh process (`dtensor_plans`).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    meshes = fake_meshes([tuple(c["mesh"]) for c in cases])
    out = []
    for case in cases:
        shape, mesh_shape = tuple(case["shape"]), tuple(case["mesh"])
        src = normalize(case["src"], len(shape), len(mesh_shape))
        dst = normalize(case["dst"], len(shape), len(mesh_shape))
        meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), torch.float32)
        try:
            infos = _gen_transform_infos_non_cached(
                DTensorSpec(meshes[mesh_shape], to_dtensor(src), meta),
                DTensorSpec(meshes[mesh_shape], to_dtensor(dst), meta), use_graph_based_transform=graph)
        except Exception as e:  # noqa: BLE001 - DTensor refuses some changes (mixed Partial ops)
            out.append({"bytes": None, "steps": [], "error": f"{type(e).__name__}: {e}"})
            continue
        steps = [(i.mesh_dim, from_dtensor(i.src_dst_placements[0]), from_dtensor(i.src_dst_placements[1]))
                 for i in infos]
        out.append({"bytes": price(shape, mesh_shape, src, steps, case.get("itemsize", 4)),
                    "steps": [f"axis {a}: {f!r} -> {t!r}" for a, f, t in steps]})
    dist.destroy_process_group()
    return out


def fake_meshes(mesh_shapes: list[tuple[int, ...]]) -> dict:
    """torch DeviceMeshes of the given shapes over one fake process group (world = the largest mesh)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = max(math.prod(m) for m in mesh_shapes)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return {m: DeviceMesh("cpu", torch.arange(math.prod(m)).reshape(m)) for m in set(mesh_shapes)}


def to_dtensor(pls: Sequence[Placement]) -> tuple:
    """sbp placements as DTensor placements (S(d) -> Shard(d), B -> Replicate(), P(op) -> Partial(op))."""
    return tuple(_to_torch(p) for p in pls)


def from_dtensor(p) -> Placement:
    """A DTensor placement as an sbp placement."""
    if p.is_shard():
        return Split(p.dim)
    if p.is_replicate():
        return Broadcast()
    if p.is_partial():
        return Partial(p.reduce_op)
    raise TypeError(f"no sbp placement for DTensor placement {p!r}")


def dtensor_plans(cases: list[dict], graph: bool = False) -> list[dict]:
    """`plans(cases)` computed in a fresh Python process (keeps the fake process group out of the caller)."""
    cases = [{**c, "src": repr(normalize(c["src"], len(c["shape"]), len(c["mesh"]))),
              "dst": repr(normalize(c["dst"], len(c["shape"]), len(c["mesh"])))} for c in cases]
    done = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve())] + (["--graph"] if graph else []),
                          input=json.dumps(cases), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"dtensor_ref subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


if __name__ == "__main__":
    json.dump(plans(json.load(sys.stdin), graph="--graph" in sys.argv[1:]), sys.stdout)
