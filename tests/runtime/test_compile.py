"""torch.compile of global tensors on gloo: redistributions, conversions and ops with rules compile with
fullgraph=True, match eager, and the compiled graph holds exactly the eager plan's collectives as torch's
functional collectives (`sbp.runtime.traced`).

Worker functions are module-level (they travel pickled to the shared gloo pool).
"""
from __future__ import annotations

import collections
import functools
import io
import itertools
import re
import threading

import pytest
import torch
import torch._dynamo.testing
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import sbp
import sbp.testing
from sbp.runtime import pending

spmd = functools.partial(sbp.testing.spmd, backend="gloo", timeout=300)
pytestmark = [pytest.mark.gloo, pytest.mark.slow]

# eager call log name -> the functional collective that carries it in a graph
EAGER_TO_FUNCOL = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
                   "all_reduce": "all_reduce", "all_to_all": "all_to_all_single", "send_recv": "all_to_all_single"}

PLACEMENTS_1D = ["S(0)", "S(1)", "B", "P(sum)", "P(max)"]
PAIRS_1D = [(s, d) for s, d in itertools.product(PLACEMENTS_1D, repeat=2) if s != d]
PAIRS_2D = [("S(0), S(1)", "S(1), S(0)"), ("S(0), S(0)", "S(1), S(1)"), ("S(0), S(0)", "B, S(0)"),
            ("S(0), B", "B, S(0)"), ("P(sum), P(sum)", "B, B"), ("P(sum), P(sum)", "S(0), S(1)"),
            ("S(0), S(1)", "B, B"), ("B, B", "S(0), S(0)"), ("P(sum), S(0)", "S(1), P(sum)"),
            ("S(1), P(sum)", "B, S(0)"), ("S(0), S(0)", "P(sum), P(sum)"), ("B, S(1)", "S(1), S(1)"),
            ("P(sum), S(0)", "S(0), B"), ("B, S(0)", "B, S(1)"), ("S(1), B", "S(0), B"),
            ("P(max), B", "S(0), S(1)")]


class GraphRecorder:
    """An aot_eager-like backend that keeps the forward and backward graphs it is handed."""

    def __init__(self, **partitioner) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep, **partitioner)

    def _keep(self, gm: torch.fx.GraphModule, _inputs):
        self.graphs.append(gm)
        return make_boxed_func(gm.forward)

    def collectives(self, which: int | None = None) -> collections.Counter:
        """Functional-collective nodes by name (wait_tensor included) in one graph, or in all of them."""
        graphs = self.graphs if which is None else [self.graphs[which]]
        return collections.Counter(
            str(n.target).split(".")[1] for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("_c10d_functional."))


def _global_value(shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64) % 7 - 3).reshape(shape)


def _start(mesh, shape, src):
    """A global tensor laid out as `src` whose value is `_global_value` (Partial: split into parts)."""
    x = sbp.distribute(_global_value(shape), mesh, src.replace("P(sum)", "B").replace("P(max)", "B"))
    return x.redistribute(src)


def run_redistributions(pairs, shape, backend, mesh, rounds=1):
    """Per pair: (compiled == eager, graph collectives, eager collectives) on this rank. With `rounds` > 1
    each pair compiles again after `torch._dynamo.reset()`: inductor then loads the graph from torch's
    on-disk compile cache, which all ranks share."""
    out = []
    counters = mesh.binding.counters
    for src, dst in pairs:
        x = _start(mesh, shape, src)
        counters.reset()
        eager = x.redistribute(dst)
        calls = collections.Counter(EAGER_TO_FUNCOL[c.collective] for c in counters.calls)
        same = True
        for _ in range(rounds):
            torch._dynamo.reset()
            rec = GraphRecorder()
            f = torch.compile(lambda t: t.redistribute(dst), backend=rec.backend if backend == "record" else backend,
                              fullgraph=True)
            got = f(x)
            same = same and (isinstance(got, sbp.GlobalTensor) and got.placements == eager.placements
                             and torch.equal(got.to_local(), eager.to_local()))
        graph = rec.collectives() if backend == "record" else None
        if graph is not None:
            waits = graph.pop("wait_tensor", 0)
            graph = (dict(graph), waits)
        out.append((same, graph, dict(calls)))
    return out


def _check_redistributions(pairs, results) -> None:
    for (src, dst), per_rank in zip(pairs, zip(*results)):
        for rank, (same, graph, calls) in enumerate(per_rank):
            assert same, f"{src} -> {dst}: compiled differs from eager on rank {rank}"
            if graph is not None:
                counts, waits = graph
                assert counts == calls, f"{src} -> {dst} rank {rank}: graph {counts}, eager plan {calls}"
                assert waits == sum(counts.values())


def test_redistribute_1d_graph_holds_the_plans_collectives() -> None:
    shape = (5, 3)   # uneven on 4 ranks: 2,1,1,1 rows and 1,1,1,0 columns (padded and exact pieces)
    _check_redistributions(PAIRS_1D, spmd(functools.partial(run_redistributions, PAIRS_1D, shape, "record"), (4,)))


@pytest.mark.parametrize("shape", [(8, 4), (5, 7)], ids=["even", "uneven"])
def test_redistribute_2d_graph_holds_the_plans_collectives(shape) -> None:
    _check_redistributions(PAIRS_2D, spmd(functools.partial(run_redistributions, PAIRS_2D, shape, "record"),
                                          (2, 2)))


def run_cache_hits(mesh):
    """AOTAutograd cache hits on this rank so far (the warm-cache round of the test below must hit)."""
    return torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]


def test_redistribute_2_ranks_eager_and_inductor_backends() -> None:
    # P(sum) -> S(1) of (5, 3): both ranks hold a (5, 3) part, and their graphs are the same to dynamo, but
    # the traced plan keeps 2 columns on rank 0 and 1 on rank 1. The second inductor round loads from the
    # on-disk cache the ranks share: the cache key must tell the ranks apart (regression: rank 1 got rank
    # 0's graph, a (5, 2) local)
    pairs = [("S(0)", "B"), ("P(sum)", "S(1)"), ("S(0)", "S(1)")]
    for backend, rounds in (("eager", 1), ("inductor", 2)):
        before = spmd(run_cache_hits, (2,))
        _check_redistributions(pairs, spmd(functools.partial(run_redistributions, pairs, (5, 3), backend,
                                                             rounds=rounds), (2,)))
    assert all(after > hits for after, hits in zip(spmd(run_cache_hits, (2,)), before)), "no warm-cache round ran"


def run_dynamic_inductor_round(mesh):
    """One round of a dynamic-shape inductor compile (dynamo reset first): equal to eager, and this rank's
    AOTAutograd cache hits so far."""
    x = sbp.distribute(_global_value((6, 4)), mesh, "S(1)")
    torch._dynamo.reset()
    f = torch.compile(lambda t: t.redistribute("B") * 2, backend="inductor", fullgraph=True, dynamic=True)
    same = torch.equal(f(x).to_local(), (x.redistribute("B") * 2).to_local())
    return same, torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]


def test_dynamic_shape_graphs_are_saved_to_the_compile_cache() -> None:
    # the second round loads the first's graph from AOTAutograd's on-disk cache. Fails without the global
    # shape's symbolic sizes left out of the tensor's flatten metadata: pickling a symbolic size dragged its
    # shape environment along and torch warned "AOTAutograd cache unable to serialize compiled graph"
    first = spmd(run_dynamic_inductor_round, (2,))
    second = spmd(run_dynamic_inductor_round, (2,))
    for (same, before), (again, after) in zip(first, second):
        assert same and again
        assert after > before, "the warm round did not load from the cache"


def run_conversions(backend, mesh):
    """from_local / to_local / full / a rowwise matmul (P(sum) -> B): forward and backward, compiled vs eager."""
    x0, w0 = _global_value((6, 4)), _global_value((4, 3)) + 0.5

    def step(x, w):
        y = sbp.from_local(x.to_local() * 2, mesh, "S(0)", global_shape=(6, 4))
        out = (y.redistribute("S(1)") @ w.redistribute("S(0)")).redistribute("B")   # rowwise: P(sum) -> B
        return (out.full() ** 2).sum()

    results = []
    for fn in (step, torch.compile(step, backend=backend, fullgraph=True)):
        x = sbp.distribute(x0, mesh, "S(0)", requires_grad=True)
        w = sbp.distribute(w0, mesh, "B", requires_grad=True)
        loss = fn(x, w)
        loss.backward()
        results.append((loss.detach(), x.grad.full(), w.grad.full()))
    (le, xe, we), (lc, xc, wc) = results
    return [torch.allclose(a, b, rtol=0, atol=1e-10) for a, b in ((le, lc), (xe, xc), (we, wc))]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_conversions_and_rowwise_matmul_forward_backward(backend) -> None:
    for per_rank in spmd(functools.partial(run_conversions, backend), (2,)):
        assert per_rank == [True, True, True]


def run_unsplit_from_local_without_shape(mesh):
    """Per placements without a Split, under fullgraph=True: (compiled == eager, the graph's collectives
    are the redistribution's plan alone)."""
    local = torch.arange(6., dtype=torch.float64).reshape(3, 2) + mesh.rank
    counters = mesh.binding.counters
    out = {}
    for pls in ("B, B", "P(sum), B", "B, P(max)"):
        torch._dynamo.reset()
        rec = GraphRecorder()
        got = torch.compile(lambda t, pls=pls: sbp.from_local(t * 2, mesh, pls).redistribute("S(0), B"),
                            backend=rec.backend, fullgraph=True)(local)
        eager = sbp.from_local(local * 2, mesh, pls)
        counters.reset()
        eager = eager.redistribute("S(0), B")
        plan = collections.Counter(EAGER_TO_FUNCOL[c.collective] for c in counters.calls)
        graph = rec.collectives()
        graph.pop("wait_tensor", None)
        out[pls] = (got.shape == eager.shape and torch.equal(got.to_local(), eager.to_local()), graph == plan)
    return out


def test_from_local_without_a_split_needs_no_global_shape_in_a_compiled_function() -> None:
    # fails without from_local reading the global shape off the local tensor where no placement splits it
    # (as DTensor's from_local): every such call was a graph break, refused under fullgraph
    for per_rank in spmd(run_unsplit_from_local_without_shape, (2, 2)):
        assert per_rank == {pls: (True, True) for pls in ("B, B", "P(sum), B", "B, P(max)")}, per_rank


class _Block(torch.nn.Module):
    """A pre-norm MLP block (Megatron layout under parallelize: fc1 colwise, fc2 rowwise)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


def run_parallel_mlp_training(backend, steps, mesh):
    """Eager and compiled training of the same parallelized two-block model: losses and final weights per
    run, the graphs compiled, and the functional collectives in the recorded graphs."""
    import copy
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(8), _Block(8)).double()
    runs = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rec = GraphRecorder()
    for compiled in (False, True):
        m = sbp.nn.parallelize(copy.deepcopy(model), mesh, {"*.fc1": "colwise", "*.fc2": "rowwise"})
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def loss_of(x):
            return m(x).full().pow(2).mean()
        f = torch.compile(loss_of, backend=rec.backend if backend == "record" else backend,
                          fullgraph=True) if compiled else loss_of
        losses = []
        for i in range(steps):
            x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
            loss = f(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), [p.full().detach() for p in m.parameters()]))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return runs, graphs, dict(rec.collectives()) if backend == "record" else None


@pytest.mark.parametrize("backend", ["record", "inductor"])
def test_parallelized_mlp_training_compiles_to_one_graph_and_matches_eager(backend) -> None:
    tol = 1e-10 if backend == "record" else 1e-5
    for (eager, compiled), graphs, collectives in spmd(functools.partial(run_parallel_mlp_training, backend, 3),
                                                        (2,)):
        assert torch.allclose(eager[0], compiled[0], rtol=0, atol=tol)
        for a, b in zip(eager[1], compiled[1]):
            assert torch.allclose(a, b, rtol=0, atol=tol)
        assert graphs == 1   # no recompile after the first step (fixed shapes)
        if collectives is not None:
            # forward: one all_reduce per rowwise fc2 (P(sum) -> B) and the loss's full(); backward: one
            # all_reduce per colwise input boundary; every collective waited on
            assert collectives["all_reduce"] >= 4
            assert collectives["wait_tensor"] == sum(v for k, v in collectives.items() if k != "wait_tensor")


def run_threads_compile(mesh):
    x = sbp.distribute(torch.ones(4, 2), mesh, "S(0)")
    try:
        torch.compile(lambda t: t.redistribute("B"), backend="aot_eager", fullgraph=True)(x)
    except Exception as e:
        return "threads" in str(e) and "gloo" in str(e)
    return False


def test_threads_backend_refuses_compiled_collectives_clearly() -> None:
    assert sbp.testing.spmd(run_threads_compile, (2,)) == [True, True]


def run_output_gradient_in_other_placements(mesh):
    """A compiled function's output used eagerly so that its gradient arrives with other placements than
    the output's (AOTAutograd traced the backward for the output's own): gradients equal eager's."""
    t = _global_value((6, 4))
    cases = {
        "B out, S(0) partner": (lambda a: a.redistribute("B") * 1.5,
                                lambda y: (y * sbp.distribute(t, mesh, "S(0)")).full().sum()),
        "S(0) out, summed": (lambda a: a.redistribute("S(1)").sin(), lambda y: y.sum().full()),
        "P(sum) out, full": (lambda a: a.redistribute("P(sum)"), lambda y: (y.full() * t).sum()),
        "P(max) out, full": (lambda a: a.redistribute("P(max)") * 2, lambda y: (y.full() * t).sum()),
    }
    out = {}
    for name, (inner, outer) in cases.items():
        grads = []
        for compiled in (False, True):
            torch._dynamo.reset()
            x = sbp.distribute(t, mesh, "S(0)", requires_grad=True)
            f = torch.compile(inner, backend="aot_eager", fullgraph=True) if compiled else inner
            outer(f(x)).backward()
            grads.append((x.grad.placements, x.grad.full()))
        out[name] = grads[0][0] == grads[1][0] and torch.allclose(grads[0][1], grads[1][1], rtol=0, atol=1e-12)
    return out


def test_compiled_output_gradient_with_other_placements_is_redistributed() -> None:
    # fails without GlobalTensor.__coerce_same_metadata_as_tangent__ (AOTAutograd: "guessed its metadata
    # incorrectly") and __coerce_tangent_metadata__ (a Partial output's gradient is B)
    for per_rank in spmd(run_output_gradient_in_other_placements, (2,)):
        assert per_rank == dict.fromkeys(per_rank, True) and len(per_rank) == 4


def run_leaf_rule_under_compiled_autograd(mesh):
    """A `B` leaf whose gradient arrives `P(sum)` (it scales an `S(0)` tensor), forward and backward compiled
    as one function under compiled autograd: gradients and their placements against eager, the collectives
    that ran eagerly in the compiled call, and the functional collectives in each compiled graph."""
    t = _global_value((6, 4))
    got = []
    recorder = GraphRecorder()
    torch._dynamo.reset()
    for compiled in (False, True):
        x = sbp.distribute(t, mesh, "S(0)", requires_grad=True)
        w = sbp.distribute(torch.linspace(-1, 1, 4, dtype=torch.float64), mesh, "B", requires_grad=True)

        def train(x, w):
            loss = (x * w).sin().full().sum()
            loss.backward()
            return loss.detach()
        f = train
        if compiled:
            with torch._dynamo.config.patch(compiled_autograd=True):   # read by torch.compile
                f = torch.compile(train, backend=recorder.backend)
        mesh.binding.counters.reset()
        loss = f(x, w)
        eager_calls = len(mesh.binding.counters.calls)
        got.append((loss, x.grad.full(), w.grad.placements, w.grad.full(), eager_calls))
    (l0, x0, p0, w0, _), (l1, x1, p1, w1, eager_calls) = got
    same = p0 == p1 and all(torch.allclose(a, b, rtol=0, atol=1e-12) for a, b in ((l0, l1), (x0, x1), (w0, w1)))
    return same, p1, eager_calls, [dict(recorder.collectives(i)) for i in range(len(recorder.graphs))]


def test_leaf_rule_runs_in_the_compiled_autograd_graph() -> None:
    # compiled autograd inlines the leaf hooks into its backward graph: w's P(sum) gradient is reduced there
    # (an all_reduce in a compiled graph, none eagerly). Fails without the hook's traced call (a graph break
    # in the hook, its all_reduce eager) and without sbp's frames kept from dynamo ("Found tensor of type
    # GlobalTensor, which is not supported by FakeTensorMode")
    for rank, (same, placements, eager_calls, graphs) in enumerate(spmd(run_leaf_rule_under_compiled_autograd, (2,))):
        assert same and placements == (sbp.B,), (rank, placements)
        assert eager_calls == 0, (rank, eager_calls)
        assert sum(g.get("all_reduce", 0) for g in graphs) == 1, (rank, graphs)


def run_distribute_in_graph(mesh):
    t = _global_value((5, 3))
    out = []
    for pls in ("S(0), S(1)", "P(sum), B", "B, P(max)", "S(1), S(1)"):
        torch._dynamo.reset()
        f = torch.compile(lambda a, pls=pls: sbp.distribute(a, mesh, pls).redistribute("B, S(0)") * 2,
                          backend="aot_eager", fullgraph=True)
        got = f(t)
        eager = sbp.distribute(t, mesh, pls)
        out.append(torch.equal(got.to_local(), (eager.redistribute("B, S(0)") * 2).to_local())
                   and torch.equal(f(t + 1).full(), (t + 1).mul(2)))
    refusals = []
    for call, arg in ((lambda a: sbp.distribute(a, mesh, "S(0), B", src=0), t),
                      (lambda a: sbp.distribute(a, mesh, "S(0), B", requires_grad=True), t),
                      (lambda a: sbp.distribute(a, mesh, "S(0), B"), t.clone().requires_grad_())):
        torch._dynamo.reset()
        try:
            torch.compile(call, backend="aot_eager", fullgraph=True)(arg)
            refusals.append(False)
        except Exception as e:  # noqa: BLE001 - fullgraph refuses the graph break, quoting sbp's reason
            refusals.append("outside the compiled function" in str(e))
    return out, refusals


def test_distribute_in_a_compiled_function_slices_as_eager() -> None:
    for done, refusals in spmd(run_distribute_in_graph, (2, 2)):
        assert done == [True] * 4
        assert refusals == [True] * 3


BAD_IN_GRAPH = [  # (name, call, sbp error class, fragment of its message)
    ("distribute-dim", lambda t, m: sbp.distribute(t, m, "S(5)"), "PlacementError", "S(5) is out of range"),
    ("distribute-count", lambda t, m: sbp.distribute(t, m, "S(0), B"), "PlacementError",
     "placements (S(0), B) give 2 placement(s) but the mesh has 1 axes"),
    ("from-local-dim", lambda t, m: sbp.from_local(t, m, "S(4)", global_shape=(8, 3)), "PlacementError",
     "S(4) is out of range"),
    ("from-local-bool-psum", lambda t, m: sbp.from_local(t > 0, m, "P(sum)", global_shape=(4, 3)),
     "PlacementError", "P(sum) cannot hold a torch.bool tensor"),
    ("from-local-ndim", lambda t, m: sbp.from_local(t, m, "S(0)", global_shape=(8,)), "ShapeError",
     "global_shape (8,) has 1 dims"),
    ("from-local-shape", lambda t, m: sbp.from_local(t, m, "S(0)", global_shape=(10, 3)), "ShapeError",
     "local shape (4, 3) does not fit global shape (10, 3) with placements (S(0),)"),
    ("full-dim", lambda t, m: sbp.full((4, 3), 1.0, m, "S(3)"), "PlacementError", "S(3) is out of range"),
]


def run_bad_arguments_in_graph(mesh):
    """Per case: with fullgraph=True, dynamo's error carries sbp's (not an opaque call's 'unsupported output
    type'); without it, the graph break lets the call raise sbp's error itself."""
    out = {}
    t = torch.arange(12.).reshape(4, 3)
    for name, call, kind, fragment in BAD_IN_GRAPH:
        eager = "no error"
        try:
            call(t, mesh)
        except sbp.SbpError as e:
            eager = f"{type(e).__name__}: {e}"
        got = []
        for fullgraph in (True, False):
            torch._dynamo.reset()
            try:
                torch.compile(lambda t: call(t, mesh), backend="aot_eager", fullgraph=fullgraph)(t)
                got.append("no error")
            except Exception as e:  # noqa: BLE001 - which error is the result
                seen = f"{type(e).__name__}: {e}"
                got.append(f"{kind}(" in str(e) and fragment in str(e) if fullgraph else seen == eager or seen)
        out[name] = got
    return out


def test_bad_arguments_in_a_compiled_function_raise_sbps_errors() -> None:
    # fails without construct's checks in the traced code: raised inside the opaque call, dynamo reports
    # "Unsupported output type for nonstrict_trace-ed function" and sbp's message is only in the chain
    for per_rank in spmd(run_bad_arguments_in_graph, (2,)):
        assert per_rank == {name: [True, True] for name, *_ in BAD_IN_GRAPH}, per_rank


def run_cross_mesh_in_compiled_code(world):
    """A cross-mesh move in compiled code: a graph break that runs it eagerly (exact), or with fullgraph=True
    dynamo's error; per rank (values equal, fullgraph refused, graphs compiled around the break)."""
    sub = sbp.testing.submesh(world, (2,), ranks=[0, 1])
    x = sbp.distribute(torch.arange(8.).reshape(4, 2), world, "S(0)")
    want = x.redistribute("B", mesh=sub) * 2
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = torch.compile(lambda t: (t * 1).redistribute("B", mesh=sub) * 2, backend="aot_eager")(x)
    same = got.mesh == sub and got.placements == want.placements and torch.equal(got.to_local(), want.to_local())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    try:
        torch.compile(lambda t: t.redistribute("B", mesh=sub), backend="aot_eager", fullgraph=True)(x)
        refused = False
    except Exception:  # noqa: BLE001 - dynamo's graph break, as an error under fullgraph
        refused = True
    return same, refused, graphs


def test_cross_mesh_move_in_compiled_code_breaks_the_graph_and_is_exact() -> None:
    # fails without GlobalTensor.redistribute's graph break: dynamo traced the move's frame into an opaque
    # call and the result held zeros where other ranks' rows belong
    for rank, (same, refused, graphs) in enumerate(spmd(run_cross_mesh_in_compiled_code, (4,))):
        assert same and refused, (rank, same, refused)
        assert graphs >= 2, (rank, graphs)   # the code before and after the move compiled around it


MESH_SPELLINGS = {   # a move on the tensor's own mesh, with the mesh passed as DTensor code passes it
    "mesh=x.mesh": lambda t, mesh: t.redistribute("B, S(0)", mesh=t.mesh),
    "(x.mesh, placements)": lambda t, mesh: t.redistribute(t.mesh, [sbp.B, sbp.S(0)]),
    "(mesh, placements), mesh a closure": lambda t, mesh: t.redistribute(mesh, (sbp.B, sbp.S(0))),
    "device_mesh=, placements=": lambda t, mesh: t.redistribute(device_mesh=mesh, placements=[sbp.B, sbp.S(0)]),
}


def run_mesh_argument_in_compiled_code(mesh):
    """Per spelling: (compiled == eager, graph collectives == eager's plan) under fullgraph=True."""
    x = sbp.distribute(_global_value((6, 4)), mesh, "S(0), S(1)")
    counters = mesh.binding.counters
    counters.reset()
    eager = x.redistribute("B, S(0)")
    calls = collections.Counter(EAGER_TO_FUNCOL[c.collective] for c in counters.calls)
    out = {}
    for name, move in MESH_SPELLINGS.items():
        torch._dynamo.reset()
        rec = GraphRecorder()
        got = torch.compile(lambda t, move=move: move(t, mesh) * 2, backend=rec.backend, fullgraph=True)(x)
        graph = rec.collectives()
        graph.pop("wait_tensor", None)
        out[name] = (got.mesh == mesh and got.placements == eager.placements
                     and torch.equal(got.to_local(), (eager * 2).to_local()), graph == calls)
    return out


def test_a_mesh_argument_naming_the_tensors_own_mesh_compiles_to_the_plans_collectives() -> None:
    # fails without DeviceMesh keeping its binding outside the dataclass fields: dynamo rebuilds a mesh
    # argument from its fields and could not proxy the communicator ("Failed to convert args/kwargs to proxy")
    for per_rank in spmd(run_mesh_argument_in_compiled_code, (2, 2)):
        assert per_rank == {name: (True, True) for name in MESH_SPELLINGS}, per_rank


def run_layout_reads_in_compiled_code(mesh):
    x = sbp.distribute(torch.arange(8.).reshape(4, 2), mesh, "S(0), B")
    torch._dynamo.reset()
    f = torch.compile(lambda t: t * 2 if t.placements[0] == sbp.S(0) and t.mesh == mesh else t * 3,
                      backend="aot_eager", fullgraph=True)
    return torch.equal(f(x).to_local(), (x * 2).to_local()), torch.equal(f(x.redistribute("B, B")).full(), x.full() * 3)


def test_placements_and_mesh_read_inside_a_compiled_function() -> None:
    # branching on x.placements / x.mesh compiles (fullgraph) and picks the eager branch; a tensor of other
    # placements takes the other branch (a guard)
    assert spmd(run_layout_reads_in_compiled_code, (2, 2)) == [(True, True)] * 4


# reads of the placements / mesh of a global tensor the graph made (no source: sbp.tensor.traced_values)
IN_GRAPH_READS = {
    "redistribute-to-read": lambda x, w: x.redistribute(x.redistribute("B, S(0)").placements),
    "branch": lambda x, w: (lambda y: y * 2 if y.placements[0] == sbp.B and isinstance(y.placements[1], sbp.Split)
                            and y.placements[1].dim == 0 else y * 3)(x.redistribute("B, S(0)")),
    "from_local-like": lambda x, w: (lambda y: sbp.from_local(y.to_local() * 2, y.mesh, y.placements,
                                                              global_shape=y.shape))(x + 1),
    "partial-op": lambda x, w: (lambda y: y.redistribute("B, B") if y.placements[1].op == "sum" else y)(x @ w),
    "kind-methods": lambda x, w: (lambda y: y * 2 if y.placements[0].is_replicate() and y.placements[1].is_split(0)
                                  and not y.placements[1].is_partial() else y * 3)(x.redistribute("B, S(0)")),
    "kind-methods-of-an-input": lambda x, w: x * 2 if x.placements[1].is_shard(1) else x * 3,
    "returned": lambda x, w: ((x @ w).placements, (x + 1).mesh, (x @ w).sum() * 1),
    "index": lambda x, w: x * (x.redistribute("B, S(0)").placements.index(SPLIT_0) + 1),
    "index-of-an-input": lambda x, w: x * (x.placements.index(sbp.S(1)) + list(x.placements).index(SPLIT_0) + 1),
}
SPLIT_0 = sbp.S(0)   # a module constant: read by the graph from a global (a value with a source)


def run_in_graph_layout_reads(mesh):
    """Per case: compiled with fullgraph=True equals eager, placements and meshes returned from the graph
    included (the mesh returned is the live bound one), with the eager plan's collectives in the graph."""
    x = sbp.distribute(torch.arange(24., dtype=torch.float64).reshape(4, 6), mesh, "S(0), S(1)")
    w = sbp.distribute(torch.arange(12., dtype=torch.float64).reshape(6, 2) / 7, mesh, "B, S(0)")
    out = {}
    for name, call in IN_GRAPH_READS.items():
        mesh.binding.counters.reset()
        want = call(x, w)
        eager = collections.Counter(EAGER_TO_FUNCOL[c.collective] for c in mesh.binding.counters.calls)
        torch._dynamo.reset()
        rec = GraphRecorder()
        got = torch.compile(call, backend=rec.backend, fullgraph=True)(x, w)
        same = all(g is m if isinstance(m, sbp.DeviceMesh) else g == m if isinstance(m, tuple)
                   else g.placements == m.placements and torch.equal(g.full(), m.full())
                   for g, m in zip(*((got, want) if isinstance(want, tuple) else ((got,), (want,)))))
        traced = rec.collectives()
        traced.pop("wait_tensor", None)
        out[name] = (same, traced == eager)
    return out


def test_placements_and_mesh_of_tensors_made_in_the_graph_read_as_constants() -> None:
    # fails without sbp.tensor.traced_values: dynamo's "Unexpected type in sourceless builder" on every case;
    # the two "index" cases without its sourced entries: "currently can't reconstruct arbitrary frozen dataclass
    # instances" (a placement read from an input or a global was a plain frozen dataclass)
    for per_rank in spmd(run_in_graph_layout_reads, (2, 2)):
        assert per_rank == dict.fromkeys(IN_GRAPH_READS, (True, True)), per_rank


def run_sub_mesh_returned_and_reloaded(mesh):
    """A sub-mesh (mesh["tp"]) that a compiled function returns, and the one a torch.load of a tensor on it
    binds to: the input's own object and binding (per call), and results equal eager."""
    sub = mesh["tp"]
    x = sbp.distribute(torch.arange(8.), sub, "S(0)")
    torch._dynamo.reset()
    cf = torch.compile(lambda t: ((t + 1).mesh, t * 2), backend="aot_eager", fullgraph=True)
    out = []
    for _ in range(2):
        m, y = cf(x)
        out.append(m is sub and m.binding is sub.binding and torch.equal(y.full(), torch.arange(8.) * 2))
    buf = io.BytesIO()
    torch.save(x, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    out.append(loaded.mesh is sub and torch.equal(loaded.full(), x.full()))
    return out


def test_a_sub_mesh_returned_or_reloaded_is_the_live_one() -> None:
    # before sub-meshes were remembered as live (sbp.values.mesh.LIVE_MESHES), each was bound anew: a mesh
    # equal to the input's with other process groups (made by init_mesh over the world on first use)
    assert spmd(run_sub_mesh_returned_and_reloaded, (2, 2), names=("dp", "tp")) == [[True] * 3] * 4


EAGER_ONLY = {   # calls that need collectives on values or make new leaves: graph breaks that run eagerly
    "from_local-check": lambda t, m: sbp.from_local(t, m, "S(0)", global_shape=(8, 3), check=True).full() * 2,
    "distribute-src": lambda t, m: sbp.distribute(t, m, "S(0)", src=1).full() * 2,
    "distribute-requires-grad": lambda t, m: sbp.distribute(t, m, "S(1)", requires_grad=True).full() * 2,
}


def run_eager_only_calls(mesh):
    """Per call: compiled without fullgraph == eager (the call runs eagerly between graphs), and with
    fullgraph=True dynamo's error quotes what to do instead."""
    t = torch.arange(12.).reshape(4, 3) + 100 * mesh.rank   # ranks differ: src= and from_local are visible
    out = {}
    for name, call in EAGER_ONLY.items():
        want = call(t, mesh)
        torch._dynamo.reset()
        same = torch.equal(torch.compile(lambda a: call(a, mesh), backend="aot_eager")(t), want)
        torch._dynamo.reset()
        try:
            torch.compile(lambda a: call(a, mesh), backend="aot_eager", fullgraph=True)(t)
            told = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            told = "outside the compiled function" in str(e) or str(e)
        out[name] = (same, told)
    return out


def test_calls_that_need_eager_break_the_graph_and_equal_eager() -> None:
    # fails without construct's disabled eager paths: dynamo traced distribute's / from_local's eager frames
    # after the graph break (an internal dynamo error: "'GlobalTensor' object has no attribute '_mesh'")
    for per_rank in spmd(run_eager_only_calls, (2,)):
        assert per_rank == dict.fromkeys(EAGER_ONLY, (True, True)), per_rank


def run_from_local_inferring_the_shape(mesh):
    """Per placements: `from_local` of split locals without global_shape, compiled with fullgraph=True, equals
    eager (value, shape, placements, the local's gradient) and its graph holds one all_gather (of the local
    shapes, which eager runs too); with uneven locals the compiled call raises on every rank, naming the fix;
    with dynamic=True new local lengths compile at most once more."""
    out = {}
    for pls in ("S(0)", "S(1)") if mesh.ndim == 1 else ("S(0), B", "S(0), S(1)", "S(1), S(1)", "P(sum), S(0)"):
        def call(t, pls=pls):
            g = sbp.from_local(t, mesh, pls)
            return g * 2, g.shape

        local = (torch.arange(12., dtype=torch.float64).reshape(4, 3) + 100 * mesh.rank).requires_grad_()
        (want, want_shape) = call(local)
        want.to_local().sum().backward()
        want_grad, local.grad = local.grad, None
        torch._dynamo.reset()
        rec = GraphRecorder()
        got, got_shape = torch.compile(call, backend=rec.backend, fullgraph=True)(local)
        got.to_local().sum().backward()
        traced = rec.collectives()
        out[pls] = (got_shape == want_shape and got.placements == want.placements
                    and torch.equal(got.to_local(), want.to_local()) and torch.equal(local.grad, want_grad),
                    dict(traced))
    if mesh.ndim > 1:
        return out
    uneven = torch.ones(3 if mesh.rank == 0 else 2, 3)   # a balanced split of 5 rows eagerly
    eager_rows = sbp.from_local(uneven, mesh, "S(0)").shape[0]
    torch._dynamo.reset()
    try:
        torch.compile(lambda t: sbp.from_local(t, mesh, "S(0)") * 2, backend="inductor", fullgraph=True)(uneven)
        told = "no error"
    except RuntimeError as e:
        told = "pass global_shape=" in str(e) or str(e)
    out["uneven"] = (eager_rows, told)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    def rows(t):
        g = sbp.from_local(t, mesh, "S(0)") * 2
        return g.to_local(), g.shape[0]

    f = torch.compile(rows, backend=counter, fullgraph=True, dynamic=True)
    same = []
    for n in (5, 7, 4, 9):   # (not 3: duck sizing would tie the 3 rows to the 3 columns)
        t = torch.arange(3. * n).reshape(n, 3) + mesh.rank
        (got, got_rows), (want, want_rows) = f(t), rows(t)
        same.append(torch.equal(got, want) and got_rows == want_rows == 2 * n)
    out["dynamic"] = (same, counter.frame_count)
    return out


def test_from_local_without_global_shape_compiles_fullgraph_taking_even_shards() -> None:
    # fails without construct's even-shard path: from_local of a Split without global_shape was a graph break
    # (fullgraph=True refused it)
    checked = {"all_gather_into_tensor": 1, "wait_tensor": 1}
    per_rank = spmd(run_from_local_inferring_the_shape, (2,))
    for r in per_rank:
        assert r == {"S(0)": (True, checked), "S(1)": (True, checked), "uneven": (5, True),
                     "dynamic": ([True] * 4, 1)}, r
    for r in spmd(run_from_local_inferring_the_shape, (2, 2)):
        assert r == {pls: (True, checked) for pls in ("S(0), B", "S(0), S(1)", "S(1), S(1)", "P(sum), S(0)")}, r


FACTORIES = {   # (call inside the compiled function on input t, which is added so the graph has an input)
    "zeros": lambda t, m, pls: sbp.zeros((5, 3), m, pls, dtype=torch.float64) + t,
    "ones": lambda t, m, pls: sbp.ones((5, 3), m, pls, dtype=torch.float64) * t,
    "full": lambda t, m, pls: sbp.full((5, 3), 2.5, m, pls) * t,
    "full-int": lambda t, m, pls: sbp.full(5, 7, m, pls.replace("S(1)", "S(0)")),
    "empty": lambda t, m, pls: sbp.empty((5, 3), m, pls, dtype=torch.float64).zero_() + t,
}


def run_factories_in_compiled_code(mesh):
    """Per factory and placements: the compiled (fullgraph) result equals eager's on this rank, and the graph
    holds the eager run's collectives (those of the op on the factory's result; the factory makes none);
    rand/randn and requires_grad=True run eagerly at a graph break (fullgraph refuses them)."""
    t = sbp.distribute(_global_value((5, 3)), mesh, "B" + ", B" * (mesh.ndim - 1))
    out = {}
    for pls in ("S(0)", "P(sum)", "S(1)") if mesh.ndim == 1 else ("S(0), P(sum)", "P(max), S(1)"):
        for name, make in FACTORIES.items():
            mesh.binding.counters.reset()
            want = make(t, mesh, pls)
            eager = collections.Counter(EAGER_TO_FUNCOL[c.collective] for c in mesh.binding.counters.calls)
            torch._dynamo.reset()
            rec = GraphRecorder()
            got = torch.compile(lambda a: make(a, mesh, pls), backend=rec.backend, fullgraph=True)(t)
            traced = rec.collectives()
            traced.pop("wait_tensor", None)
            out[name, pls] = (got.placements == want.placements and torch.equal(got.to_local(), want.to_local())
                              and traced == eager)   # the factory adds none: only the op's own plan
    for name, make in {"randn": lambda a: sbp.randn((5, 3), mesh, "S(0)" + ", B" * (mesh.ndim - 1), seed=3,
                                                     dtype=torch.float64) + a,
                       "zeros-grad": lambda a: sbp.zeros((5, 3), mesh, "S(1)" + ", B" * (mesh.ndim - 1),
                                                         dtype=torch.float64, requires_grad=True) + a}.items():
        want = make(t)
        torch._dynamo.reset()
        got = torch.compile(make, backend="aot_eager")(t)
        same = torch.equal(got.to_local(), want.to_local())
        torch._dynamo.reset()
        try:
            torch.compile(make, backend="aot_eager", fullgraph=True)(t)
            told = False
        except Exception as e:  # noqa: BLE001 - the message is the result
            told = "outside the compiled function" in str(e)
        out[name] = same and told
    return out


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["1d", "2d"])
def test_factories_in_compiled_code_equal_eager(mesh_shape) -> None:
    for per_rank in spmd(run_factories_in_compiled_code, mesh_shape):
        assert all(per_rank.values()), {k: v for k, v in per_rank.items() if not v}


def _constructors(t, local, m):
    return (sbp.from_local(local, m, "S(0)", global_shape=(4, 3)), sbp.distribute(t, m, "S(1)"),
            sbp.zeros((4, 3), m, "S(0)") + t.sum())


def run_constructors_with_symbolic_mesh_ints(mesh):
    """from_local / distribute / zeros compiled where dynamo makes the mesh description's ints symbols: under
    dynamic=True, and with the mesh an argument of the compiled function called with a second mesh of the
    same shape (other rank order; automatic dynamic). Each result equals eager's."""
    other = sbp.testing.submesh(mesh, (2,), ranks=[1, 0])
    t = torch.arange(12.0).reshape(4, 3)
    local = t[sbp.local_slices((4, 3), mesh, "S(0)", mesh.coord)[0]]
    same = []
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: _constructors(a, b, mesh), backend="aot_eager", fullgraph=True, dynamic=True)
    same += [torch.equal(g.full(), w.full()) for g, w in zip(f(t, local), _constructors(t, local, mesh))]
    torch._dynamo.reset()
    g = torch.compile(_constructors, backend="aot_eager", fullgraph=True)
    for m in (mesh, other):
        mine = t[sbp.local_slices((4, 3), m, "S(0)", m.coord)[0]]
        same += [torch.equal(x.to_local(), y.to_local()) for x, y in zip(g(t, mine, m), _constructors(t, mine, m))]
    return same


def test_constructors_compile_with_symbolic_mesh_ints() -> None:
    # before: "Unsupported output type for nonstrict_trace-ed function" (the opaque call rebuilt the mesh from
    # a description holding symbols, and DeviceMesh refused them: MeshError inside dynamo)
    for same in spmd(run_constructors_with_symbolic_mesh_ints, (2,)):
        assert all(same) and len(same) == 9, same


def run_item_between_graphs(mesh):
    """``.item()`` on a global tensor breaks the graph (as on a plain tensor); the code around it compiles and
    the whole equals eager. dynamo must not compile sbp's dispatch as a frame of its own."""
    x = sbp.distribute(_global_value((4, 3)), mesh, "S(0)")
    f = lambda t: (t * t.sum().item()).redistribute("B") + 1
    torch._dynamo.reset()
    return torch.equal(torch.compile(f, backend="aot_eager")(x).to_local(), f(x).to_local())


def test_item_breaks_the_graph_and_equals_eager() -> None:
    # fails without the code-level skip of GlobalTensor.__torch_dispatch__ (InternalTorchDynamoError:
    # "'dict' object has no attribute 'node'" in dispatch's tensor_key)
    assert spmd(run_item_between_graphs, (2,)) == [True, True]


def run_changing_float_argument(mesh):
    """A Python float argument that changes between calls (a scale, a learning rate): dynamo recompiles once
    with it symbolic (a SymFloat); every call equals eager."""
    x = sbp.distribute(_global_value((5, 3)), mesh, "S(0)")
    f = lambda t, s: (t * s).redistribute("B") + s
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.compile(f, backend="aot_eager")
    same = [torch.equal(g(x, s).to_local(), f(x, s).to_local()) for s in (0.5, 1.5, 2.5, -3.0)]
    return same, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_changing_float_argument_compiles_as_eager() -> None:
    # fails without dispatch refusing to key a SymFloat: the cache compared the SymFloat of dynamo's trace
    # with AOTAutograd's ("... is not tracked with proxy")
    for same, graphs in spmd(run_changing_float_argument, (2,)):
        assert same == [True] * 4 and graphs <= 2, (same, graphs)


def run_dropout_compiled(mesh):
    """Training-mode dropout in a fullgraph-compiled function on an S(0) tensor: each rank draws from its own
    generator (seeded alike here, as tensor-parallel training seeds its ranks), the result keeps the input's
    placements as eagerly, and the gradient is the same mask."""
    torch.manual_seed(7)
    x = sbp.distribute(_global_value((6, 4)) + 10, mesh, "S(0)", requires_grad=True)
    mesh.binding.counters.reset()
    eager_pls = torch.nn.functional.dropout(x, 0.5, training=True).placements
    eager_calls = [c.collective for c in mesh.binding.counters.calls]
    torch._dynamo.reset()
    rec = GraphRecorder()
    f = torch.compile(lambda t: torch.nn.functional.dropout(t, 0.5, training=True) * 3, backend=rec.backend,
                      fullgraph=True)
    y = f(x)
    y.sum().full().backward()
    again = f(x).full()
    return (y.placements == eager_pls == x.placements, y.full().detach(), x.grad.full(), again.detach(),
            eager_calls, dict(rec.collectives()))


def test_dropout_compiles_fullgraph_and_ranks_agree() -> None:
    # fails without the traced path of sbp.ops.random (the eager seed agreement is a collective on values:
    # "Could not extract specialized integer from data-dependent expression"), and without the draw keeping
    # the input's layout the output was B where eager's is S(0). The mask is drawn over a tensor made on each
    # rank, not gathered: eagerly one collective (the seed), none in the graphs (both failed before)
    out = spmd(run_dropout_compiled, (2,))
    x = _global_value((6, 4)) + 10
    for same_layout, y, grad, again, eager_calls, graph_calls in out:
        assert same_layout
        assert eager_calls == ["all_gather"] and graph_calls == {}, (eager_calls, graph_calls)
        kept = y != 0
        assert torch.equal(y[kept], (x * 6)[kept]) and 0 < int(kept.sum()) < y.numel()   # 1/(1-p) * 3
        assert torch.equal(grad, kept.to(grad.dtype) * 6)
        assert not torch.equal(again != 0, kept)   # a new mask each call, not one baked into the graph
    assert all(torch.equal(r[1], out[0][1]) for r in out)   # every rank holds the same draw


def run_slice_then_reshape(mesh):
    """``t[:, :-1].reshape(-1, n)`` (shifted logits for a language-model loss) in a compiled function: the slice
    admits no view on one device, so reshape copies; compiled equals eager, placements included."""
    out = {}
    for pls in ("B", "S(0)", "S(1)", "S(2)"):
        x = sbp.distribute(_global_value((4, 8, 6)), mesh, pls)
        f = lambda t: (t * 1)[:, :-1].reshape(-1, 6) * 2
        want = f(x)
        torch._dynamo.reset()
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
        out[pls] = got.placements == want.placements and torch.equal(got.full(), want.full())
    return out


def test_slice_then_reshape_compiles_as_eager() -> None:
    # fails without logical_strides' copy case: dynamo asked the reshape's strides, whose replay as a view of
    # the slice's logical strides raised "view size is not compatible with input tensor's size and stride"
    for per_rank in spmd(run_slice_then_reshape, (2,)):
        assert per_rank == dict.fromkeys(("B", "S(0)", "S(1)", "S(2)"), True), per_rank



_VIEW_WRITES = {
    "slice": lambda t: t[1:3].mul_(2), "narrow": lambda t: t.narrow(1, 1, 3).add_(1), "select": lambda t: t[2].fill_(0),
    "flat": lambda t: t.view(-1).mul_(2), "iadd": lambda t: t[:, 1:3].__iadd__(1), "t": lambda t: t.t().mul_(2)}


def run_writes_into_views(mesh):
    """Writes into views of a function's input and of an intermediate, compiled: the views a split dim lays out
    anew write through into their base, as eager (docs/operators.md "Writes into views laid out anew")."""
    out = {}
    for pls, (name, write) in itertools.product(("S(0)", "S(1)", "B"), _VIEW_WRITES.items()):
        def on_input(x, write=write):
            write(x)
            return x.sum()

        def on_intermediate(x, write=write):
            y = x * 1
            write(y)
            return y
        for f in (on_input, on_intermediate):
            want_x = sbp.distribute(_global_value((7, 5)), mesh, pls)
            want = f(want_x)
            torch._dynamo.reset()
            x = sbp.distribute(_global_value((7, 5)), mesh, pls)
            got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
            out[pls, name, f.__name__] = torch.equal(got.full(), want.full()) and torch.equal(x.full(), want_x.full())
    return out


def test_writes_into_views_laid_out_anew_reach_their_base_in_compiled_code() -> None:
    # fails without the traced alias test in _mark_detached (the write was silently dropped: the graph kept the
    # input and the intermediate unchanged) and the element map on host tensors (flat: a data-dependent error)
    for per_rank in spmd(run_writes_into_views, (2,)):
        assert [k for k, ok in per_rank.items() if not ok] == [], per_rank


def run_transfer_with_gradients(mesh, shape, src, dst):
    """(values equal eager, gradient equal eager, collectives in the forward graph) on this rank: a compiled
    exact transfer whose input requires grad, through AOTAutograd's default partitioner."""
    value, grad = _global_value(shape), _global_value(shape) * 10 + 1
    recorder = GraphRecorder()
    torch._dynamo.reset()
    x = sbp.distribute(value, mesh, src).requires_grad_()
    y = torch.compile(lambda a: a.redistribute(dst), backend=recorder.backend, fullgraph=True)(x)
    y.backward(sbp.distribute(grad, mesh, dst))
    return (torch.equal(y.full(), value), torch.equal(x.grad.full(), grad),
            dict(recorder.collectives(0)))


def test_a_transfer_to_ranks_that_only_send_keeps_its_collective_on_every_rank() -> None:
    # fails without sbp.runtime.traced._all_to_all's `one`: a rank that receives nothing did not use the
    # call's result, the partitioner dropped it from that rank's forward graph (or moved it to the backward)
    # and the ranks' all_to_alls paired up wrongly: garbage values on (4,), a gloo size mismatch on (2, 2)
    for mesh_shape, shape, src, dst in (((4,), (4, 1), "S(0)", "S(1)"), ((2, 2), (6, 5), "S(0), S(1)", "S(1), S(0)")):
        for rank, (values, grads, forward) in enumerate(spmd(functools.partial(
                run_transfer_with_gradients, shape=shape, src=src, dst=dst), mesh_shape)):
            assert values and grads, (mesh_shape, rank)
            assert forward.get("all_to_all_single") == 1, (mesh_shape, rank, forward)


def run_uneven_backward_min_cut(mesh):
    """(collectives of the forward and the backward graph, gradient equal eager) on this rank: a compiled
    ``x.logsumexp(0)`` of an unevenly split x through the min-cut partitioner (``aot_eager``'s and
    ``inductor``'s), and the same under activation checkpointing."""
    value = _global_value((7, 6)) * 0.37
    grad = sbp.distribute(torch.linspace(0.5, 2.0, 6, dtype=torch.float64), mesh, "B")
    out = []
    for fn in (lambda a: a.logsumexp(0),
               lambda a: torch.utils.checkpoint.checkpoint(lambda b: b.logsumexp(0).sin(), a, use_reentrant=False)):
        x = sbp.distribute(value, mesh, "S(0)").requires_grad_()
        fn(x).backward(grad)
        want = x.grad.full()
        torch._dynamo.reset()
        recorder = GraphRecorder(partition_fn=min_cut_rematerialization_partition)
        x = sbp.distribute(value, mesh, "S(0)").requires_grad_()
        torch.compile(fn, backend=recorder.backend, fullgraph=True)(x).backward(grad)
        out.append((dict(recorder.collectives(0)), dict(recorder.collectives(1)),
                    torch.allclose(x.grad.full(), want, rtol=0, atol=1e-12)))
    return out


def test_uneven_backward_graphs_hold_the_same_collectives_on_every_rank() -> None:
    # fails without sbp.runtime.traced._keep_forward_collectives_forward: the rank holding 1 of the 7 rows saved
    # exp(x - lse) for the backward, the others x and the gathered lse, and their backward graphs re-ran the
    # forward's all_to_all and all_gather (kept alive by wait_tensor, unused): the ranks' collectives differed
    # and the backward hung. Under activation checkpointing the backward re-runs them on purpose (on every rank).
    # The forward holds eager's forward collective only: the backward's collectives stay in the backward
    # (`_keep_backward_collectives_backward`; the partitioner had computed one of them ahead in the forward)
    forward = {"all_to_all_single": 1, "wait_tensor": 1}
    backward = ({"all_gather_into_tensor": 2, "wait_tensor": 2},
                {"all_to_all_single": 1, "all_gather_into_tensor": 2, "wait_tensor": 3})
    for rank, per_rank in enumerate(spmd(run_uneven_backward_min_cut, (4,))):
        for case, want in enumerate(backward):
            assert per_rank[case] == (forward, want, True), (rank, case, per_rank[case])


def run_amax_of_an_empty_shard(mesh):
    """(the backward graph's collectives, gradient equal eager) on this rank: ``x.amax(0)`` of x (3, 3) split
    over 4 ranks (rank 3 holds no row), through the min-cut partitioner."""
    value = _global_value((3, 3)).sin()

    def loss(a):
        return a.amax(0).full().pow(2).sum()

    x = sbp.distribute(value, mesh, "S(0)").requires_grad_()
    loss(x).backward()
    want = x.grad.full()
    torch._dynamo.reset()
    recorder = GraphRecorder(partition_fn=min_cut_rematerialization_partition)
    x = sbp.distribute(value, mesh, "S(0)").requires_grad_()
    torch.compile(loss, backend=recorder.backend, fullgraph=True)(x).backward()
    return dict(recorder.collectives(1)), torch.allclose(x.grad.full(), want, rtol=0, atol=1e-12)


def test_backward_collectives_stay_in_every_ranks_backward_graph() -> None:
    # fails without sbp.runtime.traced._keep_backward_collectives_backward: amax's backward reduces its saved
    # result again (no dependence on the gradient); ranks 0-2 moved those collectives into their forward
    # graphs, rank 3 (no rows) kept an all_reduce in its backward, and the backward hung
    results = spmd(run_amax_of_an_empty_shard, (4,))
    assert all(same for _, same in results)
    assert len({tuple(sorted(graph.items())) for graph, _ in results}) == 1, results
    assert results[0][0].get("all_reduce") == 1, results[0][0]


def test_a_mesh_axis_of_size_one_compiles() -> None:
    # before: a P on an axis of size 1 planned an all_reduce over that 1-member group, and its traced lowering
    # looked for a process group of one rank ("no process group for ranks [0]"); it is the identity
    pairs = [("B, P(sum)", "B, B"), ("P(sum), P(max)", "B, B"), ("S(0), B", "S(0), S(1)")]
    _check_redistributions(pairs, spmd(functools.partial(run_redistributions, pairs, (5, 6), "aot_eager"), (2, 1)))


def run_two_transfers_compiled_together(mesh):
    """(values and gradients equal eager, collectives in the forward graph) on this rank: two independent
    exact transfers ``B, S(0) -> S(0), S(0)`` of (7, 5) tensors in one compiled function whose inputs require
    grad, traced as inductor traces (its decompositions make a rank's one-row ``new_ones`` calls equal
    constants) and split by its partitioner (the min-cut one, which first runs a CSE pass over the joint
    graph)."""
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    values = [_global_value((7, 5)), _global_value((7, 5)) * 3 - 1]
    grads = [_global_value((7, 5)) * 10 + 1, _global_value((7, 5)) - 2]
    recorder = GraphRecorder(partition_fn=partition_fn, decompositions=select_decomp_table())
    torch._dynamo.reset()
    xs = [sbp.distribute(v, mesh, "B, S(0)").requires_grad_() for v in values]
    ys = torch.compile(lambda a, b: (a.redistribute("S(0), S(0)"), b.redistribute("S(0), S(0)")),
                       backend=recorder.backend, fullgraph=True)(*xs)
    torch.autograd.backward(ys, [sbp.distribute(g, mesh, "S(0), S(0)") for g in grads])
    same = all(torch.equal(y.full(), v) for y, v in zip(ys, values))
    same_grads = all(torch.equal(x.grad.full(), g) for x, g in zip(xs, grads))
    return same, same_grads, dict(recorder.collectives(0))


def test_equal_collectives_of_one_rank_are_not_merged_by_the_partitioner() -> None:
    # fails without sbp.runtime.torch_fixes' CSE mend: rank 0 holds its target rows already, so both transfers
    # gave it the same one-row all_to_all_single; the partitioner's CSE folded them into one on ranks 0 and 3
    # while ranks 1 and 2 kept two, and the ranks hung in the second
    for rank, (same, same_grads, forward) in enumerate(spmd(run_two_transfers_compiled_together, (2, 2))):
        assert same and same_grads, rank
        assert forward.get("all_to_all_single") == 2, (rank, forward)


def run_fused_read_of_a_gathered_buffer(mesh):
    """(output equal eager, the generated code's order is right) on this rank: inductor fuses the kernel that
    adds an all-gathered tensor to a sum of strided slices ((4, 5) loops) with the add's own flat loop."""
    from torch._inductor.utils import run_and_get_code
    value = _global_value((8, 5)).float()
    parts = [_global_value((4, 7)).float().cos() * k for k in range(10)]

    def f(a, *bs):
        h = sum(b[:, 1:6] * (i + 1) for i, b in enumerate(bs))
        return h + a.redistribute("B")[:4], h.sum()

    with torch._inductor.config.patch(force_disable_caches=True):   # compile now, whatever the cache holds
        (out, _), codes = run_and_get_code(torch.compile(f, backend="inductor", fullgraph=True),
                                           sbp.distribute(value, mesh, "S(0)"),
                                           *(sbp.distribute(p, mesh, "B") for p in parts))
    want = sum(p[:, 1:6] * (i + 1) for i, p in enumerate(parts)) + value[:4]
    lines = codes[0][codes[0].index("def call"):].splitlines()
    gather = next(i for i, line in enumerate(lines) if "all_gather_into_tensor.default(" in line)
    buf = lines[gather].split("=")[0].strip()
    wait = next(i for i, line in enumerate(lines) if f"wait_tensor.default({buf})" in line)
    first_read = next(i for i, line in enumerate(lines)
                      if line.strip().startswith("cpp_fused") and re.search(rf"\b{buf}\b", line))
    return torch.allclose(out.full(), want), wait < first_read


def test_a_kernel_fused_across_loop_shapes_reads_a_gathered_buffer_after_its_wait() -> None:
    # fails without sbp.runtime.torch_fixes' inductor mend: fusing the (4, 5) and the (20,) loops rebuilt the
    # add's dependencies without the wait's rename, the fused kernel ran before wait_tensor and read the
    # all_gather's buffer unfilled (garbage on both ranks; a (2, 2) redistribution's gradient the same way)
    assert spmd(run_fused_read_of_a_gathered_buffer, (2,)) == [(True, True)] * 2


def run_bool_mask_through_a_collective(mesh):
    """(equal eager, the gathered mask is bool) on this rank: ``torch.where`` on an all-gathered comparison,
    compiled by inductor; and a bool `P(max)` reduced (a logical or)."""
    value = _global_value((7, 5)).float()

    def f(x, p):
        mask = (x > 0).redistribute("B")
        return torch.where(mask, x.redistribute("B") * 2, 0.0), mask, p.redistribute("B")

    x = sbp.distribute(value, mesh, "S(0)")
    p = sbp.from_local(torch.eye(3, dtype=torch.bool) & (mesh.coord[0] == 0), mesh, "P(max)", global_shape=(3, 3))
    with torch._inductor.config.patch(force_disable_caches=True):
        out, mask, summed = torch.compile(f, backend="inductor", fullgraph=True)(x, p)
    return (torch.equal(out.full(), torch.where(value > 0, value * 2, 0.0)), mask.dtype == torch.bool,
            torch.equal(summed.full(), torch.eye(3, dtype=torch.bool)), summed.dtype == torch.bool)


def test_a_bool_tensor_through_a_collective_compiles_with_inductor() -> None:
    # fails without sbp.runtime.traced._collective's uint8 carriage: inductor's C++ backend asserted in its
    # mask cast ("CppCSEVariable(... dtype: torch.int64 ...)", a torch bug); on (2, 2) with uneven shapes only
    # some ranks' graphs hit it and the others hung
    assert spmd(run_bool_mask_through_a_collective, (2,)) == [(True, True, True, True)] * 2


def run_async_work_beside_compiled_graphs(mesh):
    torch._dynamo.reset()
    pending.GRAPH_GROUPS.clear()   # the groups earlier tests' graphs used in this worker: axis 0's among them
    f = torch.compile(lambda y: y.redistribute("B, B") * 2, backend="aot_eager", fullgraph=True)
    value = torch.arange(12.).reshape(6, 2)
    y = sbp.distribute(value, mesh, "B, S(0)")
    f(y)   # compiled: the graph all-gathers on axis 1
    ok = []
    for i in range(3):   # a move queued on the graph's group, of another size than the graph's, before each call
        big = torch.arange(4000.).reshape(1000, 4) + i
        queued = sbp.distribute(big, mesh, "B, S(0)").redistribute("B, B", async_op=True)
        ok.append(torch.equal(f(y).full(), value * 2) and torch.equal(queued.wait().full(), big))
    go = threading.Event()
    beside = pending.submit(mesh.binding, lambda: (go.wait(60), torch.ones(1))[1], (1,), torch.float32,
                            torch.device("cpu"), axes=(0,))
    out = f(y)
    ok.append(not beside.done())   # work on axis 0 still queued: the graph, on axis 1, did not wait for it
    go.set()
    ok.append(beside.wait().tolist() == [1.0] and torch.equal(out.full(), value * 2))
    return ok


def test_async_work_on_a_compiled_graphs_group_runs_before_the_graph() -> None:
    """A compiled graph issues its collectives straight to the process groups. Async work queued before it on
    the same group runs first (`sbp.runtime.pending.fence`): before, the queue's thread and the graph reached
    the gloo group in orders that differed by rank and the ranks aborted ("Received data size doesn't match").
    Async work on another group keeps running beside the graph."""
    for ok in spmd(run_async_work_beside_compiled_graphs, (2, 2)):
        assert all(ok), ok
