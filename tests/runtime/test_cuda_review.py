"""What a review of the CUDA/NCCL path found (issue 23), each checked on CPU.

A device or dtype mistake that NCCL would refuse, or a call some member of a group skips (a hang on
NCCL), is caught here with gloo, the threads backend, a recording stand-in for torch.distributed
(`tests.support.recording`), monkeypatched `torch.cuda` functions where a code path branches on CUDA,
and a source audit for tensors made without an explicit device.
"""
from __future__ import annotations

import ast
import os
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import sbp
import sbp.testing
from sbp.io import checkpoint
from sbp.runtime.backends import base as base_backend, dist as dist_backend
from sbp.testing.spmd import submesh
from tests.support.recording import RecordingDist, unmatched_calls
from tests.support.repo import ROOT

# ---- device mistakes: an explicit device for every tensor made in the runtime, io and tensor packages ----

FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "randint", "rand", "randn", "linspace"}
AUDITED = ("sbp/runtime", "sbp/io", "sbp/tensor", "sbp/ops/random.py")


def _factory_calls_without_device() -> list[str]:
    found = []
    for top in AUDITED:
        path = os.path.join(ROOT, top)
        files = [path] if path.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(path)
                                                    for f in fs if f.endswith(".py")]
        for file in files:
            tree = ast.parse(open(file).read())
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                        and node.func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords)):
                    found.append(f"{os.path.relpath(file, ROOT)}:{node.lineno} torch.{node.func.attr}")
    return found


# host-side work that never meets a collective: (file, torch factory) -> why it may stay on the CPU
HOST_SIDE = {
    ("sbp/runtime/simulate.py", "*"): "the one-process reference simulation: host only, no collective",
    ("sbp/io/interop.py", "torch.tensor"): "DTensor's mesh of ranks, which torch keeps on the CPU",
}


def test_every_tensor_made_for_a_collective_names_its_device():
    """A tensor made without `device=` lands on the CPU; handed to an NCCL collective it is refused (as
    `sbp.save`'s digest table and barrier and the agreed seed were). Host-side work is listed, with why."""
    bad = []
    for site in _factory_calls_without_device():
        file, factory = site.split(":")[0], site.split(" ")[1]
        if (file, factory) not in HOST_SIDE and (file, "*") not in HOST_SIDE:
            bad.append(site)
    assert bad == []


# ---- the device check runs before the one-member shortcut, and compares the GPU index too --------------

def _comm(shape=(1,), device_type="cpu", device=None) -> dist_backend.DistComm:
    mesh = sbp.DeviceMesh(shape, device_type=device_type)
    return dist_backend.DistComm(mesh, 0, {}, timedelta(seconds=5), device=device)


@pytest.mark.parametrize("call", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_single"])
def test_a_one_member_group_refuses_a_tensor_on_another_device(call):
    comm, t = _comm(), torch.empty(4, device="meta")
    run = {"all_reduce": lambda: comm.all_reduce(t, (0,), "sum"),
           "all_gather": lambda: comm.all_gather(t, (0,)),
           "reduce_scatter": lambda: comm.reduce_scatter(t.view(1, 4), (0,), "sum"),
           "all_to_all_single": lambda: comm.all_to_all_single(torch.empty(4, device="meta"), t, [4], [4], (0,))}
    with pytest.raises(sbp.CommError, match="tensor is on meta but this rank's mesh device is cpu"):
        run[call]()


def test_a_tensor_on_another_gpu_of_the_node_is_refused():
    comm = _comm(device_type="cuda", device=torch.device("cuda", 1))
    with pytest.raises(sbp.CommError, match="tensor is on cuda:0 but this rank's mesh device is cuda:1"):
        comm._check_device("all_reduce(sum)", (0,), SimpleNamespace(device=torch.device("cuda", 0)))
    comm._check_device("all_reduce(sum)", (0,), SimpleNamespace(device=torch.device("cuda", 1)))


class _FakeCuda:
    """The torch.cuda functions init_mesh uses, on a node of `count` GPUs with none selected."""

    def __init__(self, count: int) -> None:
        self.count, self.current, self.selected = count, 0, []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.select)

    def select(self, index: int) -> None:
        self.selected.append(index)
        self.current = index


@pytest.mark.parametrize("local_rank, expected", [(None, 3), ("1", 1)])
def test_a_world_the_caller_started_gets_each_rank_on_its_own_gpu(monkeypatch, local_rank, expected):
    """torch.distributed initialised by the caller without torch.cuda.set_device: init_mesh selects the
    rank's GPU (LOCAL_RANK, else rank % GPUs per node), as DTensor does, and the binding checks it."""
    cuda = _FakeCuda(count=4)
    cuda.install(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(dist_backend.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist_backend.dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(dist_backend.dist, "get_rank", lambda: 7)
    monkeypatch.setattr(dist_backend.PROCESS_GROUPS, "get", lambda members, backend, timeout: None)
    monkeypatch.setattr(dist_backend.PROCESS_GROUPS, "add_mesh", lambda ranks, backend, timeout: None)
    mesh = dist_backend.init_mesh((8,), device_type="cuda")
    assert cuda.selected == [expected]
    assert mesh.binding.device == torch.device("cuda", expected)


# ---- sbp.debug() and sbp.strict() hold in backward, which CUDA runs on a device thread -----------------

@pytest.mark.parametrize("switch", [sbp.debug, sbp.strict])
def test_the_switches_keep_backward_on_the_calling_thread(switch):
    """Autograd runs CUDA backward nodes on a worker thread per device, which does not see this thread's
    ContextVars; inside the switches backward runs on the calling thread (autograd's multithreading off)."""
    assert torch.autograd.is_multithreading_enabled()
    with switch():
        assert not torch.autograd.is_multithreading_enabled()
        seen = []
        w = torch.ones(2, requires_grad=True)
        w.register_hook(lambda g: seen.append(threading.get_ident()))
        (w * 2).sum().backward()
        assert seen == [threading.get_ident()]
    assert torch.autograd.is_multithreading_enabled()


# ---- sbp.save's closing barrier is a host barrier ------------------------------------------------------

class _Queued:
    """An all_reduce result as NCCL gives it: the call has returned, the value is not there until read."""

    def __init__(self, run) -> None:
        self._run, self._value = run, None

    def _wait(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._run()
        return self._value

    def item(self):
        return self._wait().item()

    def cpu(self) -> torch.Tensor:
        return self._wait().cpu()

    def tolist(self):
        return self._wait().tolist()


def test_save_returns_only_once_the_metadata_is_written(monkeypatch, tmp_path):
    """All-reduce as on NCCL (it returns once queued): rank 1 must not leave `save` before rank 0 wrote
    metadata.json, which rank 0 does only after waiting (up to 1 s) for rank 1 to have left."""
    real_all_reduce = base_backend.BoundComm.all_reduce
    monkeypatch.setattr(base_backend.BoundComm, "all_reduce",
                        lambda self, t, axes, op, **kw: _Queued(lambda: real_all_reduce(self, t, axes, op, **kw)))
    left = threading.Event()
    real_dump = checkpoint.json.dump

    def slow_dump(obj, f, **kw):   # only rank 0 writes the metadata
        left.wait(timeout=1.0)
        return real_dump(obj, f, **kw)

    monkeypatch.setattr(checkpoint.json, "dump", slow_dump)

    def fn(mesh):
        sbp.save({"x": sbp.zeros((4,), mesh, "S(0)")}, str(tmp_path))
        there = os.path.exists(tmp_path / "metadata.json")
        if mesh.rank == 1:
            left.set()
        return there

    assert sbp.testing.spmd(fn, (2,)) == [True, True]


# ---- random draws with a generator on another device ---------------------------------------------------

def test_the_agreed_seed_is_drawn_on_the_generators_device(monkeypatch):
    """`torch.randint(generator=g)` draws on the CPU unless told the device; a CUDA generator then raises
    "Expected a 'cpu' device type for generator". The draw must name the generator's device."""
    from sbp.tensor import factories
    seen = []
    real = torch.randint

    def randint(*args, generator=None, device=None, **kw):
        seen.append(device)
        return real(*args, generator=generator, device=device, **kw)

    monkeypatch.setattr(factories.torch, "randint", randint)
    g = torch.Generator().manual_seed(3)
    seeds = sbp.testing.spmd(lambda mesh: factories.agreed_seed(mesh, g if mesh.rank == 0 else None), (2,))
    assert seeds[0] == seeds[1] and seen and all(d == torch.device("cpu") for d in seen)


def test_random_chunks_are_drawn_on_the_mesh_device(monkeypatch):
    """Every chunk of `sbp.rand` / `sbp.randn` is drawn by a generator on the mesh's device, never drawn on
    the host and copied (on a CUDA mesh that was a CPU draw and a host-to-device copy per block)."""
    from sbp.tensor import factories
    made = []
    real = torch.Generator

    def generator(*args, **kw):
        made.append(kw.get("device", args[0] if args else None))
        return real(*args, **kw)

    monkeypatch.setattr(factories.torch, "Generator", generator)

    def fn(mesh):
        return sbp.randn((70_000, 2), mesh, "S(0)", seed=5).to_local(), sbp.rand((3, 4), mesh, "B", seed=1).to_local()

    out = sbp.testing.spmd(fn, (2,))
    assert made and all(d is not None and torch.device(d) == torch.device("cpu") for d in made), made
    assert torch.equal(torch.cat([o[0] for o in out]), sbp.randn((70_000, 2), seed=5))


def _sent_by_src(mesh, full, placements):
    """`distribute(src=1)`: (elements rank 1 hands to all_to_all, whether the locals equal those of
    distributing the full tensor everywhere)."""
    comm, sent = mesh.binding, [0]
    a2a = comm.all_to_all

    def all_to_all(send, recv_shapes, axes):
        sent[0] += sum(t.numel() for t in send)
        return a2a(send, recv_shapes, axes)

    comm.all_to_all = all_to_all
    try:
        x = sbp.distribute(full if mesh.rank == 1 else None, mesh, placements, src=1)
    finally:
        del comm.all_to_all
    same = torch.equal(x.to_local(), sbp.distribute(full, mesh, placements).to_local())
    return sent[0] if mesh.rank == 1 else None, same


@pytest.mark.parametrize("mesh_shape, placements", [((4,), "B"), ((4,), "P(max)"), ((4,), "P(min)"),
                                                    ((2, 2), "B, S(0)"), ((2, 2), "P(max), B"),
                                                    ((2, 2), "P(sum), B")])
def test_distribute_from_one_rank_holds_each_block_once_on_the_root(mesh_shape, placements):
    """Broadcast and P(min|max) targets: the root used to stage one copy per rank holding the value
    (world x the tensor); now each distinct block leaves it once, and the first rank along the repeating
    axes passes it on there (one message per member)."""
    full = torch.arange(24.).view(6, 4) - 7
    out = sbp.testing.spmd(lambda mesh: _sent_by_src(mesh, full, placements), mesh_shape)
    assert all(same for _, same in out)
    assert out[1][0] == full.numel()    # before: one block per rank holding the value


def distribute_from_rank_1(mesh):
    """`distribute(src=1)` to repeating targets on gloo: every local equals the one slicing gives."""
    full = torch.arange(35.).view(7, 5) - 9
    targets = ("B, S(1)", "P(max), S(0)", "S(0), P(min)", "P(sum), B", "B, B")
    return [torch.equal(sbp.distribute(full if mesh.rank == 1 else None, mesh, t, src=1).to_local(),
                        sbp.distribute(full, mesh, t).to_local()) for t in targets]


@pytest.mark.gloo
def test_distribute_from_one_rank_passes_blocks_on_over_gloo():
    assert all(all(r) for r in sbp.testing.spmd(distribute_from_rank_1, (2, 2), backend="gloo"))


# ---- the gloo tier: what each rank hands torch.distributed ---------------------------------------------

def cross_mesh_calls(world):
    """A move from ranks [0, 1] to ranks [1, 2] (rank 3 outside both), checked under sbp.debug() (whose
    peer gather runs on the same group), with every torch.distributed call recorded."""
    a = submesh(world, (2,), ranks=[0, 1])
    b = submesh(world, (2,), ranks=[1, 2])
    x = sbp.distribute(torch.arange(12.).view(6, 2), a, "S(0)")
    with RecordingDist("cpu") as rec, sbp.debug():
        y = x.redistribute("S(1)", mesh=b)
    full = y.full() if b.coord is not None else None
    return rec.calls, rec.violations, None if full is None else full.tolist()


@pytest.mark.gloo
def test_cross_mesh_moves_run_only_on_groups_where_every_member_takes_part():
    """NCCL's first batched point-to-point call on a group must involve every rank of it; a move on the
    default group, which rank 3 never calls, hangs there. Every group a call uses must see the same calls
    from all its members."""
    out = sbp.testing.spmd(cross_mesh_calls, (4,), backend="gloo")
    per_rank = [calls for calls, _, _ in out]
    assert all(v == [] for _, v, _ in out)
    assert unmatched_calls(per_rank) == []
    assert per_rank[3] == []                               # outside both meshes: takes part in nothing
    assert all(c.group == (0, 1, 2) for calls in per_rank[:3] for c in calls)
    assert out[1][2] == out[2][2] == torch.arange(12.).view(6, 2).tolist()


def wire_dtypes(mesh):
    """Reductions and moves of complex and int16 on sbp's gloo route and on the NCCL route (the
    collectives NCCL would run), checked for what NCCL accepts and for the values."""
    comm = mesh.binding
    results = {}
    try:
        for nccl_route in (False, True):
            comm._gloo = not nccl_route
            for dtype in (torch.complex64, torch.int16):
                full = (torch.arange(8) - 3).to(dtype) * (1 + 1j if dtype.is_complex else 1)
                with RecordingDist("cpu") as rec:
                    p = sbp.distribute(full, mesh, "P(sum)")                    # value on coord 0, zeros elsewhere
                    s = p.redistribute("S(0)")                                  # reduce_scatter
                    b = p.redistribute("B")                                     # all_reduce
                    g = s.redistribute("B")                                     # all_gather
                    m = sbp.distribute(full.view(2, 4), mesh, "S(0)").redistribute("S(1)")   # all_to_all
                results[f"{dtype} nccl={nccl_route}"] = (
                    rec.violations, torch.equal(s.full(), full), torch.equal(b.to_local(), full),
                    torch.equal(g.to_local(), full), torch.equal(m.full(), full.view(2, 4)))
    finally:
        comm._gloo = True
    return results


@pytest.mark.gloo
def test_complex_and_int16_reach_the_wire_as_types_gloo_and_nccl_take():
    """NCCL has no complex type and torch's reduce_scatter does not view complex as real; neither gloo nor
    NCCL carries int16 at all. sbp views complex as real pairs, moves int16 as bytes, reduces it in int32."""
    out = sbp.testing.spmd(wire_dtypes, (2,), backend="gloo")
    for rank, results in enumerate(out):
        assert len(results) == 4
        for what, (violations, *equal) in results.items():
            assert violations == [], (rank, what)
            assert equal == [True] * 4, (rank, what)


# per rank: values near the top of each unsigned range (uint64: above 2**63) and float8-exact fractions
_UNSIGNED_VALUES = {torch.uint16: ([40000, 7], [30000, 9]), torch.uint32: ([3_000_000_000, 7], [2_000_000_000, 9]),
                    torch.uint64: ([2**63 + 5, 7], [2**63 + 2**62, 9])}
_FLOAT8_VALUES = ([0.5, -1.5], [0.25, 2.0])


def _unsigned_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([v - 2**64 if v >= 2**63 else v for v in values]).view(torch.uint64).to(dtype) \
        if dtype == torch.uint64 else torch.tensor(values).to(dtype)


def _as_ints(t: torch.Tensor) -> list[int]:
    return [v % 2**64 for v in t.view(torch.int64).tolist()] if t.dtype == torch.uint64 else t.tolist()


def partial_reductions(mesh):
    """P(sum|max|min) of the unsigned and float8 dtypes made full (all_reduce) and split (reduce_scatter),
    on the route of the mesh's backend (and, on gloo, on the NCCL route too)."""
    comm, results = mesh.binding, {}
    routes = (False, True) if hasattr(comm, "_gloo") else (None,)
    try:
        for nccl_route in routes:
            if nccl_route is not None:
                comm._gloo = not nccl_route
            for dtype, per_rank in (*_UNSIGNED_VALUES.items(), (torch.float8_e4m3fn, _FLOAT8_VALUES),
                                    (torch.float8_e5m2, _FLOAT8_VALUES)):
                local = (_unsigned_tensor(per_rank[mesh.rank], dtype) if dtype in _UNSIGNED_VALUES
                         else torch.tensor(per_rank[mesh.rank]).to(dtype))
                for op in ("sum", "max", "min"):
                    x = sbp.from_local(local, mesh, f"P({op})", global_shape=(2,))
                    whole, halves = x.full(), x.redistribute("S(0)").full()
                    read = _as_ints if dtype in _UNSIGNED_VALUES else (lambda t: t.float().tolist())
                    results[(str(dtype), op, nccl_route)] = (read(whole), read(halves))
    finally:
        if routes != (None,):
            comm._gloo = True
    return results


def _expected(dtype: torch.dtype, op: str) -> list:
    if dtype in _UNSIGNED_VALUES:
        bits = torch.iinfo(dtype).bits
        columns = list(zip(*_UNSIGNED_VALUES[dtype]))
        return [sum(c) % 2**bits if op == "sum" else (max if op == "max" else min)(c) for c in columns]
    columns = list(zip(*_FLOAT8_VALUES))
    return [sum(c) if op == "sum" else (max if op == "max" else min)(c) for c in columns]


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_partials_of_unsigned_and_float8_dtypes_reduce_exactly(backend):
    # torch's CPU kernels have no add/maximum for uint16/32/64 or float8 (the threads backend raised
    # NotImplementedError); gloo widened them to int32, which cut uint64 sums and put uint32 values above 2**31
    # below small ones (P(max) of 3e9 and 7 gave 7), and turned float8 0.5 into 0
    for rank, results in enumerate(sbp.testing.spmd(partial_reductions, (2,), backend=backend)):
        assert len(results) == 15 * (2 if backend == "gloo" else 1)
        for (dtype, op, route), (whole, halves) in results.items():
            want = _expected(getattr(torch, dtype.removeprefix("torch.")), op)
            assert whole == halves == want, (rank, dtype, op, route, whole, halves)


def rebinding_makes_no_group(world):
    sub = sbp.DeviceMesh((2,), ranks=[0, 1])
    world.binding.bind(sub)
    made = dist_backend.PROCESS_GROUPS.made
    world.binding.bind(sub)                               # the same mesh again: the groups are reused
    sbp.init_mesh((4,), device_type="cpu", timeout=world.binding.timeout)   # the world again
    return dist_backend.PROCESS_GROUPS.made - made


@pytest.mark.gloo
def test_binding_a_mesh_again_reuses_its_process_groups():
    """Every NCCL communicator costs GPU memory: `bind()`, DTensor interop and `init_mesh` of ranks already
    grouped take the cached groups instead of making duplicates."""
    assert sbp.testing.spmd(rebinding_makes_no_group, (4,), backend="gloo") == [0, 0, 0, 0]
