"""GlobalTensor: metadata, repr, nn.Parameter / state_dict, distribute / from_local / redistribute / full,
default dispatch (layout-preserving ops, fallback) and visualize. In-process SPMD (threads)."""
from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sbp
import sbp.testing
from sbp.tensor.global_tensor import GlobalTensor, set_op_handler
from sbp.testing.strategies import layouts, placements
from sbp.values.placement import Partial
from tests.support.cases import SMALL_MESHES

spmd = functools.partial(sbp.testing.spmd, timeout=30)


def reference(shape, dtype=torch.float64) -> torch.Tensor:
    """A tensor whose every element is distinct (exact in float64 under sums of zeros)."""
    return torch.arange(torch.Size(shape).numel(), dtype=dtype).reshape(shape) + 1


# ---- metadata and repr (pure: the constructor needs no processes) -------------------------------------

def test_repr_and_metadata():
    mesh = sbp.DeviceMesh((2, 2))
    x = GlobalTensor(torch.zeros(4, 12), mesh, (sbp.S(0), sbp.B), (8, 12))
    assert repr(x) == "GlobalTensor(shape=(8, 12), placements=(S(0), B), mesh=(2, 2))"
    assert str(x) == repr(x)
    assert x.shape == (8, 12) and x.local_shape == (4, 12) and x.stride() == (12, 1)
    assert x.placements == (sbp.S(0), sbp.B) and x.mesh == mesh and x.dtype == torch.float32
    y = GlobalTensor(torch.zeros(3, dtype=torch.float64), sbp.DeviceMesh((1,)), (sbp.B,), (3,))
    assert repr(y) == "GlobalTensor(shape=(3,), placements=(B,), mesh=(1,), dtype=torch.float64)"
    assert repr(y.requires_grad_()).endswith("dtype=torch.float64, requires_grad=True)")


def test_parameter_state_dict_deepcopy():
    def fn(mesh):
        t = reference((6, 4))
        p = torch.nn.Parameter(sbp.distribute(t, mesh, "S(0), B"))
        assert isinstance(p, torch.nn.Parameter) and type(p) is GlobalTensor and p.requires_grad
        module = torch.nn.Module()
        module.w = p
        state = module.state_dict()
        twin = copy.deepcopy(module)
        with torch.no_grad():
            p.copy_(t * 2)                       # a plain source is the full value (Broadcast)
        assert twin.w.mesh.binding is mesh.binding  # the mesh is shared, the data copied
        twin.load_state_dict({"w": sbp.distribute(t * 3, mesh, "B, S(1)")})  # copy_ across layouts
        return (repr(state["w"]), type(twin.w).__name__, twin.w.requires_grad,
                torch.equal(state["w"].full(), 2 * t), torch.equal(twin.w.full(), 3 * t))

    for r in spmd(fn, (2, 2)):
        assert r == ("GlobalTensor(shape=(6, 4), placements=(S(0), B), mesh=(2, 2), dtype=torch.float64)",
                     "GlobalTensor", True, True, True)


# ---- distribute / redistribute / full round trips ---------------------------------------------------------

def _chain(t: torch.Tensor, chain: list, mesh) -> list:
    x = sbp.distribute(t, mesh, chain[0])
    out = []
    for pls in chain[1:] + [chain[0]]:
        x = x.redistribute(pls)
        ok = x.placements == sbp.placements(pls) and tuple(x.shape) == tuple(t.shape)
        if not any(isinstance(p, Partial) for p in x.placements):  # S/B locals are determined: exact blocks
            ok = ok and torch.equal(x.to_local(), t[sbp.local_slices(t.shape, mesh, x.placements, mesh.coord)])
        out.append(ok)
    out.append(torch.equal(x.full(), t))
    return out


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(case=layouts(max_side=7), data=st.data())
def test_round_trip_chains(case, data):
    mesh_shape, shape, first = case
    chain = [first] + data.draw(st.lists(placements(len(mesh_shape), len(shape)), min_size=1, max_size=3))
    for r in spmd(functools.partial(_chain, reference(shape), chain), mesh_shape):
        assert all(r), (mesh_shape, shape, chain, r)


@settings(max_examples=5, deadline=None)
@given(case=layouts(mesh_shape=(2, 2, 2), max_side=5), data=st.data())
def test_round_trip_chains_3d_mesh(case, data):
    mesh_shape, shape, first = case
    chain = [first] + data.draw(st.lists(placements(3, len(shape)), min_size=1, max_size=2))
    for r in spmd(functools.partial(_chain, reference(shape), chain), mesh_shape):
        assert all(r), (shape, chain, r)


def test_distribute_partial_locals():
    def fn(mesh):
        t = reference((4, 2))
        s = sbp.distribute(t, mesh, "S(0), P(sum)").to_local()
        m = sbp.distribute(t, mesh, "P(max), B").to_local()
        return s.tolist(), torch.equal(m, t)

    out = spmd(fn, (2, 2))
    assert [r[0] for r in out] == [[[1, 2], [3, 4]], [[0, 0], [0, 0]], [[5, 6], [7, 8]], [[0, 0], [0, 0]]]
    assert all(r[1] for r in out)


@pytest.mark.parametrize("mesh_shape, src, dst", [
    ((4,), "B", "P(sum)"), ((4,), "B", "P(min)"), ((4,), "B", "P(max)"), ((2, 2), "B, B", "P(sum), P(sum)"),
    ((2, 2), "B, B", "P(max), P(max)"), ((2, 2), "S(0), B", "S(0), P(sum)"), ((2, 2), "B, S(1)", "P(min), S(1)"),
    ((2, 2), "B, B", "P(sum), S(1)"), ((2, 3), "B, B", "P(max), P(sum)")])
def test_redistribute_broadcast_to_partial_keeps_the_design_locals(mesh_shape, src, dst):
    # DESIGN.md: B -> P(sum) keeps the value on coord 0 of the axis and zeros elsewhere, B -> P(min|max)
    # keeps it everywhere -- the locals distribute() makes. (The planner once sliced first, a smaller
    # modeled peak, leaving each rank a slice embedded into the op's identity.)
    def fn(mesh):
        t = reference((5, 3))
        got = sbp.distribute(t, mesh, src).redistribute(dst).to_local()
        return torch.equal(got, sbp.distribute(t, mesh, dst).to_local())

    assert all(spmd(fn, mesh_shape))
    assert all(s.kind == "local" for s in sbp.plan((5, 3), mesh_shape, src, dst).steps)


@pytest.mark.parametrize("pls", ["S(0), S(1)", "P(sum), S(0)", "B, P(max)", "S(1), S(1)", "B, S(0)", "S(1), P(min)"])
def test_distribute_from_src_rank_sends_only_blocks(pls):
    shape = (5, 3)

    def fn(mesh):
        t = reference(shape)
        x = sbp.distribute(t if mesh.rank == 2 else None, mesh, pls, src=2)
        calls = [(c.collective, c.received) for c in mesh.binding.counters.calls]
        last_gather = max(i for i, (kind, _) in enumerate(calls) if kind == "all_gather")   # the metadata
        moved = calls[last_gather + 1:]
        kinds = {kind for kind, _ in moved}
        return torch.equal(x.full(), t), x.dtype, (kinds, sum(r for _, r in moved))

    out = spmd(fn, (2, 2))
    for rank, (ok, dtype, (kinds, received)) in enumerate(out):
        assert ok and dtype == torch.float64 and kinds <= {"all_to_all", "send_recv"}
        block = sbp.local_shape(shape, (2, 2), pls, divmod(rank, 2))
        holds = sbp.tensor.global_tensor.sum_holds_value(sbp.DeviceMesh((2, 2)), sbp.placements(pls), divmod(rank, 2))
        expect = 0 if rank == 2 or not holds else torch.Size(block).numel() * 8
        assert received == expect, (rank, received, expect)   # exactly its block, nothing more


def test_distribute_errors():
    def fn(mesh):
        errors = []
        for call in (lambda: sbp.distribute(torch.ones(2), mesh, "S(1)"),
                     lambda: sbp.distribute(torch.ones(2), mesh, "S(0), B"),
                     lambda: sbp.distribute(torch.ones(2), mesh, "B", src=7)):
            try:
                call()
            except sbp.SbpError as e:
                errors.append(str(e))
        return errors

    errors = spmd(fn, (2,))[0]
    assert "S(1) is out of range for a 1-d tensor (valid: -1..0)" in errors[0]
    assert "one placement per mesh axis" in errors[1]
    assert "src=7 must be a world rank of the mesh" in errors[2]
    with pytest.raises(sbp.MeshError, match="pure value"):
        sbp.distribute(torch.ones(2), sbp.DeviceMesh((2,)), "B")


# ---- from_local ----------------------------------------------------------------------------------------------

def test_from_local_infers_uneven_global_shape():
    def fn(mesh):
        # 10 rows over a 2x2 mesh, nested (S(0), S(0)): 3, 2, 3, 2 rows; then 3 columns split 2, 1
        t = reference((10, 3))
        local = t[sbp.local_slices((10, 3), mesh, "S(0), S(0)", mesh.coord)]
        x = sbp.from_local(local, mesh, "S(0), S(0)")
        y = sbp.from_local(t[sbp.local_slices((10, 3), mesh, "B, S(1)", mesh.coord)], mesh, "B, S(1)", check=True)
        return tuple(x.shape), torch.equal(x.full(), t), tuple(y.shape), torch.equal(y.full(), t)

    for r in spmd(fn, (2, 2)):
        assert r == ((10, 3), True, (10, 3), True)


def test_from_local_refuses_chunk_style_shards():
    def fn(mesh):
        local = torch.zeros((3, 3, 3, 1)[mesh.coord[0]], 2)    # torch.chunk sizes, not balanced ones
        return sbp.from_local(local, mesh, "S(0)")

    with pytest.raises(sbp.SbpError, match=r"rank 2 has \(3, 2\), expected \(2, 2\); rank 3 has \(1, 2\)"):
        spmd(fn, (4,))


@pytest.mark.parametrize("what,expect", [
    ("dtype", r"disagree on dtype: ranks \[0, 1, 2\] vs ranks \[3\]"),
    ("value", r"disagree on Broadcast values \(axes \(1,\)\): ranks \[2\] vs ranks \[3\]"),
    ("placements", r"disagree on placements: ranks \[0, 1, 2\] vs ranks \[3\]"),
])
def test_from_local_check_names_ranks(what, expect):
    def fn(mesh):
        local = torch.ones(2, 2)
        pls = "S(0), B"
        if mesh.rank == 3:
            local = local.double() if what == "dtype" else local + (what == "value")
            pls = "S(0), P" if what == "placements" else pls
        return sbp.from_local(local, mesh, pls, check=True)

    with pytest.raises(sbp.SbpError, match=expect):
        spmd(fn, (2, 2))


def test_from_local_is_differentiable():
    def fn(mesh):
        local = torch.full((2,), float(mesh.rank + 1), requires_grad=True)
        x = sbp.from_local(local, mesh, "S(0)")
        (x.full() * torch.arange(4.)).sum().backward()
        return local.grad.tolist()

    assert spmd(fn, (2,)) == [[0.0, 1.0], [2.0, 3.0]]


# ---- dispatch ----------------------------------------------------------------------------------------------------

def test_ops_without_the_operator_rules_installed_raise():
    """`__torch_dispatch__` has one path, the plugged-in handler; without one an op names the fix."""
    previous = set_op_handler(None)
    try:
        x = GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,))
        with pytest.raises(sbp.SbpError, match=r"operator rules are not installed.*sbp\.ops\.install\(\)"):
            x.detach()
    finally:
        set_op_handler(previous)


def test_op_handler_plugs_in():
    seen = []

    def handler(func, args, kwargs):
        seen.append(str(func))
        return previous(func, args, kwargs)        # the rule table does the work

    previous = set_op_handler(handler)
    try:
        y = spmd(lambda mesh: sbp.distribute(torch.ones(2), mesh, "B").detach(), (1,))[0]
    finally:
        set_op_handler(previous)
    assert "aten.detach.default" in seen and type(y) is GlobalTensor


def test_rank_outside_the_mesh_holds_an_empty_local():
    def fn(world):
        pair = world.binding.bind(sbp.DeviceMesh((2,), ranks=(2, 3)))
        x = sbp.distribute(reference((4, 2)), pair, "S(0)")
        return tuple(x.shape), tuple(x.local_shape), x.redistribute("B").local_shape.numel()

    assert spmd(fn, (4,)) == [((4, 2), (0, 0), 0), ((4, 2), (0, 0), 0), ((4, 2), (2, 2), 8), ((4, 2), (2, 2), 8)]


# ---- visualize -------------------------------------------------------------------------------------------------------

def test_visualize():
    def fn(mesh):
        return sbp.visualize(sbp.zeros((8, 12), mesh, "S(0), B"))

    text = spmd(fn, (2, 2), names=("dp", "tp"))[0]
    assert text == ("shape=(8, 12) placements=(S(0), B) mesh=(2, 2)\n"
                    "          tp=0                 tp=1\n"
                    "dp=0      rank 0: [0:4, 0:12]  rank 1: [0:4, 0:12]\n"
                    "dp=1      rank 2: [4:8, 0:12]  rank 3: [4:8, 0:12]")
    one = sbp.visualize(global_shape=(10,), mesh=sbp.DeviceMesh((4,)), placements="P(max)")
    assert one.splitlines()[-1].split("  ")[0] == "rank 0: [0:10] P(max) part"


# ---- the same calls on real process groups (gloo; the 4-process pool is shared with other gloo tests) ----

def _gloo_calls(mesh):
    t = reference((5, 3))
    x = sbp.distribute(t if mesh.rank == 3 else None, mesh, "S(0), P(sum)", src=3)
    local = t[sbp.local_slices((5, 3), mesh, "S(1), B", mesh.coord)]
    y = sbp.from_local(local, mesh, "S(1), B", check=True)
    leaf = sbp.distribute(t, mesh, "B, S(0)", requires_grad=True)
    (leaf.redistribute("S(1), P(max)").full() * t).sum().backward()
    try:
        sbp.from_local(local + mesh.rank, mesh, "S(1), B", check=True)
        mismatch = None
    except sbp.RankMismatchError as e:
        mismatch = str(e)
    return (torch.equal(x.full(), t), tuple(y.shape), torch.equal(y.full(), t), torch.equal(leaf.grad.full(), t),
            leaf.grad.placements, mismatch)


@pytest.mark.gloo
def test_gloo_distribute_from_local_and_grads():
    for r in sbp.testing.spmd(_gloo_calls, (2, 2), backend="gloo", timeout=60):
        assert r[:5] == (True, (5, 3), True, True, (sbp.B, sbp.S(0)))
        assert r[5] == ("from_local(check=True): ranks disagree on Broadcast values (axes (1,)): "
                        "ranks [0] vs ranks [1]")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", SMALL_MESHES)
def test_redistribute_never_aliases_its_source(mesh):
    """A plan that only slices or keeps (B -> S(0), (S(0), B) -> (S(0), S(0)), B -> P) returns a new tensor:
    writing into the result leaves the source alone (it changed the source on some ranks only), and the
    source's gradient stays right."""
    import itertools

    kinds = ["S(0)", "S(1)", "B", "P", "P(max)"] if len(mesh) == 1 else ["S(0)", "S(1)", "B", "P"]
    pairs = [(", ".join(a), ", ".join(b)) for a, b in itertools.product(itertools.product(kinds, repeat=len(mesh)),
                                                                          repeat=2) if a != b]

    def rank(mesh_):
        changed = []
        for src, dst in pairs:
            for shape in [(8, 12), (7, 5)]:
                x = sbp.distribute(torch.arange(float(shape[0] * shape[1])).view(shape), mesh_, src)
                before = x.to_local().clone()
                x.redistribute(dst).to_local().add_(1000)
                if not torch.equal(x.to_local(), before):
                    changed.append((src, dst, shape))
        w = sbp.distribute(torch.full((6,), 2.0), mesh_, ("B",) * len(mesh), requires_grad=True)
        a = (w * w).sum()
        w.redistribute(("S(0)",) + ("B",) * (len(mesh) - 1)).mul_(0)
        a.backward()
        return changed, w.grad.full()

    for changed, grad in sbp.testing.spmd(rank, mesh):
        assert changed == []
        assert torch.equal(grad, torch.full((6,), 4.0))


def test_data_assignment_takes_the_new_layout_or_refuses():
    # before: `x.data = y` was silently ignored (value unchanged), and `x.data = x.data.half()` left the
    # wrapper float16 over a float32 local
    def fn(mesh):
        x = sbp.distribute(reference((4, 3)), mesh, "S(0)")
        x.data = x.data * 2
        doubled = torch.equal(x.full(), reference((4, 3)) * 2)
        x.data = sbp.distribute(torch.zeros(2, 3), mesh, "B")
        relaid = (x.placements, tuple(x.shape), tuple(x.to_local().shape), float(x.full().abs().sum()))
        x.data = x.data.half()
        halves = (x.dtype, x.to_local().dtype)
        p = torch.nn.Parameter(sbp.distribute(torch.ones(4, 3), mesh, "S(0)"))
        p.data = sbp.distribute(torch.full((4, 3), 3.0), mesh, "S(1)")
        param = (p.placements, torch.equal(p.full(), torch.full((4, 3), 3.0)), p.requires_grad)
        try:
            x.data = torch.zeros(2, 3)
            refused = False
        except sbp.SbpError as e:
            refused = "must be a global tensor" in str(e)
        return doubled, relaid, halves, param, refused

    for doubled, relaid, halves, param, refused in spmd(fn, (2,)):
        assert doubled
        assert relaid == ((sbp.B,), (2, 3), (2, 3), 0.0)
        assert halves == (torch.float16, torch.float16)
        assert param == ((sbp.S(1),), True, True)
        assert refused


def test_parameters_have_static_shapes_for_dynamo():
    # dynamo keeps a plain nn.Parameter's sizes static under dynamic=True but checks the exact type: a global
    # parameter reached through an optimizer got symbolic sizes, and its dynamic optimizer graph failed
    def static(t):
        return (sorted(getattr(t, "_dynamo_static_indices", ())),
                sorted(getattr(t._local, "_dynamo_static_indices", ())))

    def fn(mesh):
        x = sbp.distribute(reference((4, 3)), mesh, "S(0)")
        p = torch.nn.Parameter(x)
        twin = copy.deepcopy(p)
        p.data = sbp.distribute(torch.ones(4, 3), mesh, "S(1)")   # a new local tensor
        return static(x), static(p), static(twin)

    for plain, param, twin in spmd(fn, (2,)):
        assert plain == ([], [])   # not a parameter: a batch dimension may be dynamic
        assert param == twin == ([0, 1], [0, 1])


# ---- a P(sum) tensor is one logical tensor, whichever plan reduces it ------------------------------------
def _sum_parts(mesh, x: torch.Tensor) -> GlobalTensor:
    """`x` as P(sum) on every axis, with parts whose sum rounds differently in another order."""
    coord, n = mesh.coord, mesh.size()
    noise = [torch.randn(x.shape, generator=torch.Generator().manual_seed(k), dtype=x.dtype) for k in range(n)]
    k = mesh.ranks.index(mesh.binding.rank)   # this rank's part
    local = x - sum(noise[1:]) if k == 0 else noise[k]
    return sbp.from_local(local, mesh, ",".join(["P(sum)"] * len(coord)), global_shape=tuple(x.shape))


def test_partial_sum_reductions_by_any_plan_agree_bitwise():
    # before: P -> (B,B) (one all_reduce) and P -> (S(0),S(0)) (two reduce_scatters) summed in different orders:
    # 8.9e-16 apart, so `x == x.amax(1, keepdim=True)` marked no element in 2 of 5 rows, and amax's backward
    # (which reduces its saved P(sum) input again) gave NaN rows
    x = torch.linspace(-2, 3, 15, dtype=torch.float64).reshape(5, 3)

    def rank(mesh):
        a = _sum_parts(mesh, x).requires_grad_(True)
        same = torch.equal(a.redistribute("B,B").full(), a.redistribute("S(0),S(0)").full())
        hits = (a == a.amax(1, keepdim=True)).sum(1).full()
        a.amax(1).full().sum().backward()
        return same, hits, a.grad.full()

    ref = x.clone().requires_grad_(True)
    ref.amax(1).sum().backward()
    for same, hits, grad in spmd(rank, (2, 2)):
        assert same
        assert hits.tolist() == [1] * 5
        assert torch.equal(grad, ref.grad)


def test_partial_sum_kept_reduction_never_leaks_writes():
    """The kept reduction is private: results made from it never alias each other, and a write into the
    P(sum) tensor, into its local, or into a result is seen by (or kept from) the next reduction as torch would."""
    x = torch.arange(8, dtype=torch.float64)

    def rank(mesh):
        a = _sum_parts(mesh, x)
        first = a.redistribute("B")
        again = a.redistribute("B")
        split = a.redistribute("S(0)")
        first.add_(100)                          # into a result: the others and the next reduction keep x
        out = [again.full().tolist(), split.full().tolist(), a.full().tolist()]
        a.mul_(2)                                # into the P(sum) tensor itself
        out.append(a.full().tolist())
        a.to_local().add_(1)                     # into its local, around the wrapper
        out.append(a.redistribute("S(0)").full().tolist())
        return out

    close = functools.partial(torch.allclose, rtol=0, atol=1e-12)
    for again, split, full, doubled, local_write in spmd(rank, (2,)):
        assert again == split == full
        assert close(torch.tensor(full, dtype=x.dtype), x)
        assert close(torch.tensor(doubled, dtype=x.dtype), 2 * x)
        assert close(torch.tensor(local_write, dtype=x.dtype), 2 * x + 2)   # each of the 2 parts gained 1


def _writes_through_data(mesh, placements: str) -> list:
    """A P(sum) tensor reduced once, then written through ``x.data`` (a wrapper with a version counter of its
    own around the same local): in place, by a copy, by setitem on the rows of coord 0 only, through a view."""
    x = sbp.distribute(torch.arange(12., dtype=torch.float64).view(3, 4), mesh, placements)
    out = []
    for write in (lambda d: d.mul_(2), lambda d: d.copy_(d * 3), lambda d: d.__setitem__(slice(0, 2), 0.0),
                  lambda d: d.view(-1)[9:].zero_()):
        x.full()                    # kept
        write(x.data)
        out.append(x.full().tolist())
    return out


@pytest.mark.parametrize("placements, mesh", [("P(sum)", (2,)), ("P(sum), S(1)", (2, 2)), ("P(sum), S(0)", (2, 2))])
def test_partial_sum_kept_reduction_sees_writes_through_data(placements, mesh):
    # the kept reduction was served stale after x.data.mul_(0) (writes inside dispatch bumped the wrapper's
    # counter, and .data's wrapper is another); after a setitem on some ranks' rows the ranks that wrote
    # dropped it and the others kept it, and they ran different collectives (a timeout)
    want = torch.arange(12., dtype=torch.float64).view(3, 4) * 2
    wants = [want.tolist(), (want * 3).tolist()]
    want = want * 3
    want[0:2] = 0.0
    wants.append(want.tolist())
    want.view(-1)[9:] = 0.0
    wants.append(want.tolist())
    assert spmd(functools.partial(_writes_through_data, placements=placements), mesh) == [wants] * math.prod(mesh)


def test_partial_sum_kept_reduction_is_not_pickled():
    import io

    def rank(mesh):
        a = _sum_parts(mesh, torch.arange(4.0, dtype=torch.float64))
        a.redistribute("B")
        buf = io.BytesIO()
        torch.save(a, buf)
        b = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        return "_reduced" in b.__dict__, b.placements, torch.equal(b.to_local(), a.to_local())

    assert spmd(rank, (2,)) == [(False, (Partial("sum"),), True)] * 2


@pytest.mark.parametrize("pls", ["S(0), S(1)", "P, S(0)", "B, P(max)"])
def test_tolist_and_numpy_give_the_logical_tensor(pls):
    # torch refuses both for tensor subclasses; a global tensor gives its logical value on every rank, as
    # .item() does (every rank calls them: one planned gather).
    import numpy as np
    full = torch.arange(15.).reshape(5, 3)

    def fn(mesh):
        x = sbp.distribute(full, mesh, pls)
        w = sbp.distribute(full, mesh, "S(0), B").requires_grad_()
        with pytest.raises(RuntimeError, match="requires grad"):
            w.numpy()
        return x.tolist(), x.numpy(), np.asarray(x), w.tolist(), w.numpy(force=True)

    for listed, array, asarray, grad_listed, forced in sbp.testing.spmd(fn, (2, 2)):
        assert listed == grad_listed == full.tolist()
        for a in (array, asarray, forced):
            assert isinstance(a, np.ndarray) and a.tolist() == full.tolist()


def _views_in_inference_mode(mesh):
    """Views of normal global tensors taken inside inference_mode: (equal to torch's, normal like torch's)."""
    t = torch.arange(12.).reshape(4, 3)
    out = {}
    for pls in ("S(0)", "S(1)", "B"):
        w = sbp.distribute(t, mesh, pls)
        for name, op in (("t", lambda a: a.t()), ("slice", lambda a: a[1:3]), ("view", lambda a: a.view(-1)),
                         ("add", lambda a: a + 1)):
            with torch.inference_mode():
                want, got = op(t), op(w)
                out[pls, name] = (torch.equal(got.full(), want), got.is_inference() == want.is_inference())
    return out


def test_views_of_normal_tensors_inside_inference_mode_are_normal_tensors():
    # fails without the view's wrapper made outside inference mode: torch shares the base's version counter
    # with the view, which an inference-tensor wrapper refuses ("Cannot set version_counter for inference tensor")
    for per_rank in sbp.testing.spmd(_views_in_inference_mode, (2,)):
        assert all(a and b for a, b in per_rank.values()), per_rank
