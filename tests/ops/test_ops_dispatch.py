"""The dispatcher: fallback with a one-time warning naming op and placements, `sbp.strict()`, cheapest
input redistribution (planner bytes, not replication), decision cache, plain tensors and scalars,
in-place write-back, gradients of plain tensors, mesh mismatches."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import sbp
import sbp.testing
from sbp import B, Partial, S
from sbp.tensor.global_tensor import FallbackWarning
from tests.support.ops_kit import make_global, randn
from tests.support.repo import DOCS

aten = torch.ops.aten


def _no_rule(x):
    return x.renorm(2, 0, 1.0)   # aten.renorm has no rule


def test_fallback_runs_on_broadcast_inputs_and_warns_once():
    full = randn((5, 3))
    sbp.ops.clear_cache()

    def fn(mesh):
        x = make_global(full, mesh, (S(0),))
        return _no_rule(x).placements, _no_rule(x).full(), _no_rule(x * 2).full()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = sbp.testing.spmd(fn, (1,))
    ours = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "aten.renorm.default" in str(ours[0].message) and "(S(0),)" in str(ours[0].message)
    pls, once, twice = results[0]
    assert pls == (B,) and torch.equal(once, full.renorm(2, 0, 1.0))
    assert torch.equal(twice, (full * 2).renorm(2, 0, 1.0))


def test_strict_turns_the_fallback_into_unsupported_op_error():
    def fn(mesh):
        x = make_global(randn((4, 3)), mesh, (S(0),))
        with sbp.strict():
            assert sbp.ops.is_strict()
            with pytest.raises(sbp.UnsupportedOpError, match=r"aten\.renorm\.default.*S\(0\)"):
                _no_rule(x)
        assert not sbp.ops.is_strict()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _no_rule(x).shape   # outside strict(): the fallback again

    assert sbp.testing.spmd(fn, (2,)) == [torch.Size([4, 3])] * 2
    assert issubclass(sbp.UnsupportedOpError, sbp.SbpError)


def test_no_global_flag_strict_is_per_context():
    """strict() is a context variable: SPMD ranks start from a copy of the caller's context, and what a
    rank sets stays in that rank."""
    def inherits(mesh):
        return sbp.ops.is_strict()

    def sets_its_own(mesh):
        with sbp.strict(mesh.rank == 0):
            return sbp.ops.is_strict()

    with sbp.strict():
        assert sbp.ops.is_strict()
        assert sbp.testing.spmd(inherits, (2,)) == [True, True]
    assert not sbp.ops.is_strict()
    assert sbp.testing.spmd(inherits, (2,)) == [False, False]
    assert sbp.testing.spmd(sets_its_own, (2,)) == [True, False]
    assert not sbp.ops.is_strict()


def test_cheapest_redistribution_moves_the_small_input():
    """x (512, 4) S(0) + y (512, 4) S(1): moving y to S(0) (an all_to_all of y) beats gathering both."""
    a, b = randn((512, 4)), randn((512, 4), 1)

    def fn(mesh):
        x, y = make_global(a, mesh, (S(0),)), make_global(b, mesh, (S(1),))
        mesh.binding.counters.reset()
        z = x + y
        moved = mesh.binding.counters.received
        return z.placements, moved, z.full()

    expect = sbp.plan((512, 4), (4,), "S(1)", "S(0)", itemsize=8).bytes_per_rank
    for pls, moved, full in sbp.testing.spmd(fn, (4,)):
        assert pls == (S(0),) and moved == expect and torch.equal(full, a + b)


def test_partial_inputs_reduce_by_reduce_scatter_when_that_is_cheaper():
    """exp(P(sum)) needs the value: reduce_scatter to a split costs half an all_reduce."""
    a = randn((8, 6))

    def fn(mesh):
        x = make_global(a, mesh, (Partial("sum"),))
        mesh.binding.counters.reset()
        y = x.exp()
        return y.placements, [c.collective for c in mesh.binding.counters.calls], y.full()

    for pls, calls, full in sbp.testing.spmd(fn, (2,)):
        assert isinstance(pls[0], type(S(0))) and calls == ["reduce_scatter"]
        assert torch.allclose(full, a.exp())


def test_decisions_are_cached_per_op_and_input_specs():
    sbp.ops.clear_cache()

    def fn(mesh):
        x = make_global(randn((4, 4)), mesh, (S(0),))
        for _ in range(3):
            x = x + 1
        return sbp.ops.DECISIONS.info()["size"]

    sizes = sbp.testing.spmd(fn, (2,))
    assert all(0 < n <= 2 for n in sizes)   # add.Tensor with (S(0),) (and the factory's ops), not one per call


def test_python_scalars_keep_values_out_of_the_cache_key():
    """Different learning rates reuse one decision (floats are keyed by type), but 0 is special."""
    sbp.ops.clear_cache()

    def fn(mesh):
        x = make_global(randn((4,)), mesh, (Partial("sum"),))
        a, b, c = x * 0.1, x * 0.2, x + 0.0
        return a.placements, b.placements, c.placements, (x + 1.0).placements

    for pa, pb, pc, pd in sbp.testing.spmd(fn, (2,)):
        assert pa == pb == pc == (Partial("sum"),)     # P*scalar and P+0 stay Partial
        assert pd != (Partial("sum"),)                  # P+1 is not linear: reduced first


def test_in_place_op_on_a_redistributed_input_writes_back():
    a, b = randn((4, 6)), randn((4, 6), 1)

    def fn(mesh):
        with sbp.strict():
            x, y = make_global(a, mesh, (B,)), make_global(b, mesh, (S(1),))
            same = x.add_(y)
            return same is x, x.placements, x.full()

    for same, pls, full in sbp.testing.spmd(fn, (3,)):
        assert same and pls == (B,) and torch.equal(full, a + b)


def test_plain_tensor_gradient_is_plain_and_full():
    w_full = randn((3,), 2)

    def fn(mesh):
        x = make_global(randn((5, 3)), mesh, (S(0), S(1)))
        w = w_full.clone().requires_grad_()
        (x * w).sum().full().backward()
        return type(w.grad), w.grad

    ref = randn((5, 3)).sum(0)
    for kind, grad in sbp.testing.spmd(fn, (2, 2)):
        assert kind is torch.Tensor and torch.allclose(grad, ref)


def test_mixing_different_meshes_raises():
    def fn(mesh):
        other = mesh.binding.bind(sbp.DeviceMesh((2,), ranks=(1, 0)))
        a = make_global(randn((4,)), mesh, (S(0),))
        b = make_global(randn((4,)), other, (S(0),))
        with pytest.raises(sbp.SbpError, match="different meshes"):
            a + b
        return True

    assert sbp.testing.spmd(fn, (2,)) == [True, True]


def test_rank_outside_the_mesh_gets_empty_locals():
    def fn(mesh):
        sub = mesh.binding.bind(sbp.DeviceMesh((2,), ranks=(0, 1)))
        x = sbp.distribute(torch.arange(6.).view(3, 2), sub, "S(0)")
        y = (x @ torch.ones(2, 2)).sum(0)
        return tuple(y.shape), y.to_local().numel() if mesh.rank == 2 else y.full().tolist()

    out = sbp.testing.spmd(fn, (3,))
    assert out[0] == ((2,), [15.0, 15.0]) and out[2] == ((2,), 0)


def test_strict_transformer_ops_need_no_fallback():
    """A tiny layer with every op the transformer test uses, with sharded weights, under strict()."""
    def fn(mesh):
        with sbp.strict():
            x = make_global(randn((2, 3, 4)), mesh, (B,), requires_grad=True)
            w = make_global(randn((8, 4), 1), mesh, (S(0),), requires_grad=True)
            h = F.gelu(F.linear(F.layer_norm(x, (4,)), w))
            loss = h.pow(2).mean()
            loss.backward()
            return w.grad.placements

    assert sbp.testing.spmd(fn, (2,)) == [(S(0),)] * 2


def test_docs_list_every_rule():
    from sbp.ops.table import table_rows
    text = (DOCS / "operators.md").read_text()
    missing = [name for name, _ in table_rows() if f"`{name}`" not in text]
    assert not missing, f"docs/operators.md lacks {missing}; regenerate its table from table_rows()"


def test_scalar_kinds_do_not_share_decisions():
    """x * 0 and x * 0.0 (or + True and + 1) promote differently: one cached decision must not serve both."""
    def fn(mesh):
        x = sbp.distribute(torch.arange(4), mesh, "S(0)")
        b = sbp.distribute(torch.tensor([True, False, True, False]), mesh, "S(0)")
        return (x * 0).dtype, (x * 0.0).dtype, (b + True).dtype, (b + 1).dtype

    assert sbp.testing.spmd(fn, (2,))[0] == (torch.int64, torch.float32, torch.bool, torch.int64)


@pytest.mark.parametrize("mesh_shape,plan", [((1,), None), ((2,), None), ((2,), "colwise"), ((2,), "rowwise")])
def test_fallback_kernels_see_locals_laid_out_as_the_global_tensors_report(mesh_shape, plan):
    # A global tensor reports contiguous strides whatever its local's. Autograd's weight_norm formula makes
    # the (transposed) weight gradient contiguous before a kernel that relies on it: a no-op on the wrapper,
    # so the fallback kernel must get contiguous locals (it read the strided local as contiguous: grads off
    # by up to 15).
    import copy

    from torch.nn.utils.parametrizations import weight_norm
    torch.manual_seed(0)
    ref = weight_norm(torch.nn.Linear(4, 6).double())
    x = torch.randn(3, 4, dtype=torch.double)
    ref(x).tanh().sum().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    def fn(mesh):
        m = copy.deepcopy(ref)
        m.zero_grad(set_to_none=True)
        if plan is None:
            for name, p in list(m.named_parameters()):
                owner = m.parametrizations.weight if "original" in name else m
                setattr(owner, name.rsplit(".", 1)[-1], torch.nn.Parameter(sbp.distribute(p.detach(), mesh, "B")))
        else:
            sbp.nn.parallelize(m, mesh, {"": plan})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            m(x).tanh().sum().backward()
        return {n: p.grad.full() if isinstance(p.grad, sbp.GlobalTensor) else p.grad for n, p in m.named_parameters()}

    for got in sbp.testing.spmd(fn, mesh_shape):
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-12, atol=1e-12, msg=name)
