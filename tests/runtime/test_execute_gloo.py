"""The executor on torch.distributed (gloo, 4 processes on 127.0.0.1): a smoke subset of the conformance
table plus what only real process groups show (init_mesh rules, meshes over part of the world, timeouts).

Multi-process tier: the workers start once (a few seconds) and are reused; cases are batched into few
calls. Functions run on the workers must be module-level (they travel pickled).
"""
from __future__ import annotations

import functools
import os
import re
from datetime import timedelta

import pytest
import torch

import sbp
import sbp.testing
from sbp.runtime.executor import execute, redistribute_local
from tests.support import conformance as conf
from tests.support.cases import EXEC_MESHES
from tests.support.repo import EXAMPLES

spmd = functools.partial(sbp.testing.spmd, backend="gloo", timeout=60)
pytestmark = pytest.mark.gloo   # every test here starts (or, once, refuses to start) gloo processes

PAIRS_1D = [("S(0)", "B"), ("S(0)", "S(1)"), ("S(1)", "S(0)"), ("B", "S(1)"), ("P(sum)", "B"), ("P(sum)", "S(0)"),
            ("P(sum)", "S(1)"), ("P(min)", "B"), ("P(max)", "S(0)"), ("P(min)", "P(max)"), ("S(0)", "P(max)"),
            ("B", "P(sum)"), ("S(1)", "P(min)"), ("P(max)", "S(1)")]
PAIRS_2D = [("S(0), S(1)", "S(1), S(0)"), ("S(0), S(0)", "S(1), S(1)"), ("S(0), S(0)", "B, S(0)"),
            ("S(0), B", "B, S(0)"), ("P(sum), P(sum)", "B, B"), ("P(sum), P(sum)", "S(0), S(1)"),
            ("S(0), S(1)", "B, B"), ("B, B", "S(0), S(0)"), ("P(sum), S(0)", "S(1), P(sum)"),
            ("S(1), P(sum)", "B, S(0)"), ("S(0), S(0)", "P(sum), P(sum)"), ("B, S(1)", "S(1), S(1)"),
            ("P(sum), S(0)", "S(0), B"),   # one reduce_transfer step
            ("B, S(0)", "B, S(1)"), ("S(1), B", "S(0), B")]   # exchanges inside one axis's group
CASES = ([conf.Case((4,), s, d, variants=conf.GLOO_VARIANTS) for s, d in PAIRS_1D]
         + [conf.Case((2, 2), s, d, variants=conf.GLOO_VARIANTS) for s, d in PAIRS_2D])


@pytest.fixture(scope="module")
def gloo_results() -> dict[str, list]:
    """Run every case on gloo in two calls (one per mesh shape); per case, the per-rank results."""
    return _by_case(CASES, conf.run_cases)


def _by_case(all_cases: list, run, **kwargs) -> dict[str, list]:
    """`run(cases, mesh, **kwargs)` on gloo, one call per mesh shape; per case id, the per-rank results."""
    out = {}
    for mesh_shape in EXEC_MESHES:
        cases = [c for c in all_cases if c.mesh_shape == mesh_shape]
        per_rank = spmd(functools.partial(run, cases, **kwargs), mesh_shape)
        for i, case in enumerate(cases):
            out[case.id] = [rank_results[i] for rank_results in per_rank]
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_conformance_gloo(case: conf.Case, gloo_results) -> None:
    conf.check_case(case, gloo_results[case.id])


FULL_TABLES = conf.cases_1d(conf.FEW_VARIANTS) + conf.cases_2d()


@pytest.fixture(scope="module")
def full_results() -> dict[str, list]:
    """Every pair of the 1-D and 2x2 tables on gloo (three dtype/stride variants, four shapes)."""
    return _by_case(FULL_TABLES, conf.run_cases)


@pytest.mark.parametrize("case", FULL_TABLES, ids=lambda c: c.id)
def test_conformance_gloo_every_pair(case: conf.Case, full_results) -> None:
    conf.check_case(case, full_results[case.id])


NATIVE_CASES = [c for c in CASES if c.src.startswith("P") or conf.has_exchange(c)]


@pytest.fixture(scope="module")
def native_results() -> dict[str, list]:
    """The cases with a reduce_scatter or an exchange, run on the collectives the CUDA route uses (a native
    reduce_scatter, exchanges by all_to_all_single) instead of gloo's faster ones."""
    return _by_case(NATIVE_CASES, conf.run_cases_routed, route="all_to_all", native=True)


@pytest.mark.parametrize("case", NATIVE_CASES, ids=lambda c: c.id)
def test_conformance_gloo_on_the_cuda_route(case: conf.Case, native_results) -> None:
    conf.check_case(case, native_results[case.id])


EXCHANGE_CASES = [c for c in CASES if conf.has_exchange(c)]


@pytest.fixture(scope="module")
def messages_results() -> dict[str, list]:
    """The cases with an exchange, every exchange as isend/irecv (packed where the blocks need it)."""
    return _by_case(EXCHANGE_CASES, conf.run_cases_routed, route="messages")


@pytest.mark.parametrize("case", EXCHANGE_CASES, ids=lambda c: c.id)
def test_conformance_gloo_exchanges_as_messages(case: conf.Case, messages_results) -> None:
    conf.check_case(case, messages_results[case.id])


ROUTED = (("P(sum), B", "S(0), B"),       # a reduce_scatter over axis 0
          ("S(0), S(0)", "B, S(0)"),      # a transfer whose blocks are rows: zero-copy messages
          ("S(0), S(0)", "S(1), S(1)"))   # a transfer of column blocks: packed


def _torch_calls_made(mesh: sbp.DeviceMesh, native: bool) -> list[list[str]]:
    """The torch.distributed functions rank 0 calls for each change in `ROUTED` on this route."""
    import torch.distributed as dist

    import sbp.runtime.backends.dist as backend
    comm = mesh.binding   # the worker keeps this mesh for later runs: its route is put back below
    if native:
        comm._gloo, comm.exchange_route = False, "all_to_all"
    names = [(dist, "isend"), (dist, "irecv"), (dist, "all_to_all_single"), (backend, "_reduce_scatter_flat")]
    saved = [(module, name, getattr(module, name)) for module, name in names]
    seen: list[str] = []
    for module, name, f in saved:
        setattr(module, name, lambda *a, _f=f, _n=name, **k: (seen.append(_n), _f(*a, **k))[1])
    out = []
    try:
        for src, dst in ROUTED:
            seen.clear()
            local = torch.ones(sbp.local_shape((8, 8), mesh.shape, src, mesh.coord))
            redistribute_local(local, mesh, (8, 8), src, dst)
            out.append(sorted(set(seen)))
    finally:
        for module, name, f in saved:
            setattr(module, name, f)
        comm._gloo, comm.exchange_route = True, "auto"
    return out


@pytest.mark.parametrize("native", [False, True], ids=["gloo_route", "cuda_route"])
def test_each_route_makes_the_torch_calls_it_names(native) -> None:
    calls = spmd(functools.partial(_torch_calls_made, native=native), (2, 2))[0]
    if native:   # NCCL's collectives
        assert calls == [["_reduce_scatter_flat"], ["all_to_all_single"], ["all_to_all_single"]]
    else:        # gloo: reduce_scatter as all_to_all + fold; zero-copy exchanges as messages
        assert calls == [["all_to_all_single"], ["irecv", "isend"], ["all_to_all_single"]]


def _uneven_reduce_scatter_traffic(mesh: sbp.DeviceMesh) -> tuple:
    comm = mesh.binding
    comm.counters.reset()
    out = redistribute_local(torch.full((7, 5), float(mesh.rank + 1)), mesh, (7, 5), "P", "S(0)")
    call = comm.counters.calls[-1]
    return out.tolist(), call.collective, call.received, call.wire_received


def test_uneven_reduce_scatter_sends_the_runs_unpadded_on_gloo() -> None:
    """7 rows over 4 ranks are 2,2,2,1: gloo's route sends each member exactly its rows (no padding)."""
    for rank, (out, kind, received, wire) in enumerate(spmd(_uneven_reduce_scatter_traffic, (4,))):
        rows = 2 if rank < 3 else 1
        assert out == [[10.0] * 5] * rows
        assert kind == "reduce_scatter" and received == wire == 3 * rows * 5 * 4


@pytest.mark.parametrize("mesh_shape", EXEC_MESHES)
def test_every_collective_kind_forced(mesh_shape) -> None:
    conf.check_hand_steps(mesh_shape, spmd(conf.run_hand_steps, mesh_shape))


# meshes whose ranks are not in sorted order: process group order differs from member order
UNSORTED = {(4,): [2, 0, 3, 1], (2, 2): [3, 1, 2, 0]}
UNSORTED_CASES = {(4,): [conf.Case((4,), s, d, shapes=((8, 12), (7, 5)), variants=(("float32", False),))
                         for s, d in PAIRS_1D[:7]],
                  (2, 2): [conf.Case((2, 2), s, d, shapes=((8, 12), (7, 5)), variants=(("float32", False),))
                           for s, d in PAIRS_2D[:7]]}


def _on_unsorted_ranks(mesh_shape: tuple[int, ...], mesh: sbp.DeviceMesh) -> tuple[list, list]:
    shuffled = sbp.init_mesh(mesh_shape, ranks=UNSORTED[mesh_shape], timeout=timedelta(seconds=60))
    return conf.run_cases(UNSORTED_CASES[mesh_shape], shuffled), conf.run_hand_steps(shuffled)


@pytest.mark.parametrize("mesh_shape", EXEC_MESHES)
def test_mesh_over_ranks_in_another_order(mesh_shape) -> None:
    per_rank = spmd(functools.partial(_on_unsorted_ranks, mesh_shape), (4,))
    per_index = [per_rank[r] for r in UNSORTED[mesh_shape]]  # results in the mesh's row-major order
    for i, case in enumerate(UNSORTED_CASES[mesh_shape]):
        conf.check_case(case, [cases[i] for cases, _ in per_index])
    conf.check_hand_steps(mesh_shape, [hand for _, hand in per_index])


def _callers_locals_untouched(mesh: sbp.DeviceMesh) -> list[bool]:
    """All_reduce works in place on gloo: on tensors the executor made, never on the caller's."""
    square = sbp.init_mesh((2, 2))
    out = []
    for m, shape, src, dst in ((mesh, (6, 4), "P", "B"), (square, (6, 4), "P, S(0)", "B, B"),
                               (square, (6, 4), "P, P", "B, B"), (mesh, (6, 4), "P", "S(1)")):
        local = torch.arange(24.).view(6, 4)[sbp.local_slices(shape, m, src.replace("P", "B"), m.coord)]
        before = local.clone()
        result = redistribute_local(local, m, shape, src, dst)
        out.append(torch.equal(local, before) and result.data_ptr() != local.data_ptr())
    # an all_reduce after an all_gather reduces the gathered tensor in place
    two = sbp.Plan((4, 2), (2, 2), (sbp.Partial(), sbp.S(0)), (sbp.B, sbp.B), 4,
                   (sbp.Step("all_gather", (1,), (sbp.Partial(), sbp.S(0)), (sbp.Partial(), sbp.B), dims=(0,)),
                    sbp.Step("all_reduce", (0,), (sbp.Partial(), sbp.B), (sbp.B, sbp.B), op="sum")))
    half = torch.full((2, 2), float(mesh.rank))
    out.append(execute(two, half, square).tolist() == [[2.0, 2.0]] * 2 + [[4.0, 4.0]] * 2
               and half.tolist() == [[float(mesh.rank)] * 2] * 2)
    return out


def test_callers_local_is_never_written() -> None:
    assert spmd(_callers_locals_untouched, (4,)) == [[True] * 5] * 4


# ---- what only real process groups show ------------------------------------------------------------

def _mesh_rules(mesh: sbp.DeviceMesh) -> dict:
    """Runs on every rank of a 4-process world; returns what each rank saw."""
    seen = {}
    try:
        sbp.init_mesh((3,))
    except sbp.MeshError as e:
        seen["size_error"] = str(e)
    pair = sbp.init_mesh((2,), ranks=[2, 3], timeout=timedelta(seconds=30))  # every rank calls it
    local = torch.full((2, 3), float(mesh.rank)) if pair.coord is not None else torch.empty(0)
    seen["pair_coord"] = pair.coord
    seen["pair_out"] = redistribute_local(local, pair, (4, 3), "S(0)", "B")
    square = sbp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = square["tp"]
    seen["tp_out"] = redistribute_local(torch.tensor([float(mesh.rank)]), tp, (2,), "S(0)", "B").tolist()
    seen["calls"] = [c.collective for c in square.binding.counters.calls]
    return seen


def test_init_mesh_rules_and_meshes_over_part_of_the_world() -> None:
    seen = spmd(_mesh_rules, (4,))
    assert all("(3,) has 3 ranks but the world has 4 processes" in s["size_error"] for s in seen)
    assert [s["pair_coord"] for s in seen] == [None, None, (0,), (1,)]
    assert seen[0]["pair_out"].numel() == 0
    assert seen[3]["pair_out"].tolist() == [[2.0] * 3] * 2 + [[3.0] * 3] * 2
    assert [s["tp_out"] for s in seen] == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
    assert all(len(s["calls"]) == 1 for s in seen)  # one collective, counted on the parent mesh's counters


def test_point_to_point_exchange_among_some_ranks() -> None:
    out = spmd(conf.exchange_among_some_ranks, (4,))
    assert out[1] is None
    assert out[0] == ({2: [[2.0] * 3, []], 3: [[3.0] * 4, []]}, 7 * 4)


def _raise_on_rank_1(mesh: sbp.DeviceMesh) -> int:
    if mesh.rank == 1:
        raise KeyError("boom on purpose")
    return os.getpid()


def _raise_on_rank_1_while_others_wait(mesh: sbp.DeviceMesh) -> int:
    if mesh.rank == 1:
        raise KeyError("boom on purpose")
    return mesh.binding.all_reduce(torch.ones(1), (0,), "sum").item()  # never completes


def _pid(mesh: sbp.DeviceMesh) -> int:
    return os.getpid()


def test_rank_exception_is_reported_with_its_rank_and_the_workers_are_reused() -> None:
    with pytest.raises(sbp.testing.SpmdError, match=r"rank 1 of 4 raised KeyError.*boom on purpose") as info:
        spmd(_raise_on_rank_1, (4,))
    assert isinstance(info.value.__cause__, KeyError)
    pids = spmd(_pid, (4,))
    assert spmd(_pid, (4,)) == pids and len(set(pids)) == 4 and os.getpid() not in pids


def _sum_of_ranks(mesh: sbp.DeviceMesh) -> int:
    return mesh.binding.all_reduce(torch.tensor([mesh.rank]), (0,), "sum").item()


def test_rank_exception_with_others_stuck_fails_fast_and_the_pool_is_replaced() -> None:
    before = spmd(_pid, (4,))
    with pytest.raises(sbp.testing.SpmdError, match=r"rank 1 of 4 raised KeyError"):
        spmd(_raise_on_rank_1_while_others_wait, (4,))
    assert spmd(_sum_of_ranks, (4,)) == [6, 6, 6, 6]
    assert not set(spmd(_pid, (4,))) & set(before)


def _dead_rank(mesh: sbp.DeviceMesh) -> str:
    """Rank 3 never joins the all_gather: the others must get a CommError after the mesh's timeout."""
    short = sbp.init_mesh((4,), timeout=timedelta(seconds=2))
    if mesh.rank == 3:
        return "skipped"
    try:
        short.binding.all_gather(torch.zeros(4), (0,))
    except sbp.CommError as e:
        return str(e)
    return "no error"


def test_dead_rank_is_a_comm_error_not_a_hang() -> None:
    seen = spmd(_dead_rank, (4,))
    assert seen[3] == "skipped"
    for message in seen[:3]:
        assert message.startswith("all_gather on mesh axes (0,) (group ranks [0, 1, 2, 3]) failed on rank"), message


def test_unpicklable_fn_is_refused_with_advice() -> None:
    with pytest.raises(sbp.SbpError, match="module-level function"):
        spmd(lambda mesh: None, (4,))


def test_example_tour_runs_on_four_gloo_ranks() -> None:
    """examples/redistribute.py launches its own 4 ranks; every rank must check all its layouts."""
    import subprocess
    import sys

    script = EXAMPLES / "redistribute.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # ranks print concurrently, so lines may interleave: look for each rank's message anywhere
    assert sorted(re.findall(r"rank (\d): all 8 layouts checked", done.stdout)) == ["0", "1", "2", "3"]
