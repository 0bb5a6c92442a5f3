"""The direct path (`sbp.ops.direct`): Python operators on global tensors that skip torch's dispatcher.

It must give exactly what the dispatcher route gives (values, placements, shape, dtype), be taken only when
nothing on the dispatcher's way would act (autograd recording, dispatch and function modes, autocast), and
leave every other call (keyword arguments, plain tensors, other meshes) to torch's own way."""
from __future__ import annotations

import collections
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import sbp
import sbp.testing
from sbp import B, S
from sbp.ops import direct
from sbp.tensor.global_tensor import GlobalTensor
from tests.support.cases import SMALL_MESHES
from tests.support.ops_kit import make_global, placements_for, randn

aten = torch.ops.aten

# the Python spelling and the ATen call the dispatcher would hand the op handler for it
BINARY = {
    "+": (lambda a, b: a + b, aten.add.Tensor), "add": (lambda a, b: a.add(b), aten.add.Tensor),
    "-": (lambda a, b: a - b, aten.sub.Tensor), "sub": (lambda a, b: a.sub(b), aten.sub.Tensor),
    "*": (lambda a, b: a * b, aten.mul.Tensor), "mul": (lambda a, b: a.mul(b), aten.mul.Tensor),
    "/": (lambda a, b: a / b, aten.div.Tensor), "div": (lambda a, b: a.div(b), aten.div.Tensor),
}
MATMUL = {"@": lambda a, b: a @ b, "matmul": lambda a, b: a.matmul(b), "mm": lambda a, b: a.mm(b)}
REDUCE = {"sum": (lambda a: a.sum(), aten.sum.default), "mean": (lambda a: a.mean(), aten.mean.default)}


class _DispatchCounter:
    """Records calls of `GlobalTensor.__torch_dispatch__` (the dispatcher route) per thread while installed.

    Install it around `spmd` in the main thread (thread-ranks share the class); each rank reads its own."""

    def __init__(self) -> None:
        self.calls: dict[int, list] = collections.defaultdict(list)

    def mine(self) -> list:
        return self.calls[threading.get_ident()]

    def __enter__(self):
        self.original = GlobalTensor.__dict__["__torch_dispatch__"]
        original, calls = self.original.__func__, self.calls

        def counting(cls, func, types, args=(), kwargs=None):
            calls[threading.get_ident()].append(func)
            return original(cls, func, types, args, kwargs)

        GlobalTensor.__torch_dispatch__ = classmethod(counting)
        return self

    def __exit__(self, *exc) -> None:
        GlobalTensor.__torch_dispatch__ = self.original


def _same(a: GlobalTensor, b: GlobalTensor) -> None:
    assert type(a) is GlobalTensor and type(b) is GlobalTensor
    assert a.placements == b.placements and a.shape == b.shape and a.dtype == b.dtype
    assert a.stride() == b.stride() and a.requires_grad == b.requires_grad
    assert torch.equal(a.to_local(), b.to_local())


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(BINARY)), st.sampled_from(SMALL_MESHES), st.data())
def test_binary_operators_equal_the_dispatcher_route(name, mesh_shape, data):
    spell, op = BINARY[name]
    shape = data.draw(st.sampled_from([(5, 3), (4, 4), (1, 7), (0, 3)]))
    pa = data.draw(placements_for(len(shape), len(mesh_shape), partial=("sum",)))
    pb = data.draw(placements_for(len(shape), len(mesh_shape), partial=("sum",)))
    scalar = data.draw(st.sampled_from([None, 2.5, 3, 0.0]))
    fa, fb = randn(shape, seed=1), randn(shape, seed=2).abs() + 1

    def fn(mesh):
        x = make_global(fa, mesh, pa, seed=1)
        y = make_global(fb, mesh, pb, seed=2)
        other = y if scalar is None else scalar
        for _ in range(2):  # the first call decides (handler), the second takes the cached decision
            got = spell(x, other)
            want = op(x, other)  # an OpOverload call goes through torch's dispatcher
            _same(got, want)
        return got.full()

    other = fb if scalar is None else scalar
    for full in sbp.testing.spmd(fn, mesh_shape):
        torch.testing.assert_close(full, spell(fa, other), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(MATMUL))
@pytest.mark.parametrize("pa,pb", [((S(0),), (B,)), ((B,), (S(1),)), ((S(1),), (S(0),)), ((S(0),), (S(0),))])
def test_matmul_spellings_equal_mm_through_the_dispatcher(name, pa, pb):
    fa, fb = randn((7, 5), seed=3), randn((5, 3), seed=4)

    def fn(mesh):
        x, w = make_global(fa, mesh, pa, seed=3), make_global(fb, mesh, pb, seed=4)
        for _ in range(2):
            _same(MATMUL[name](x, w), aten.mm.default(x, w))
        return MATMUL[name](x, w).full()

    for full in sbp.testing.spmd(fn, (3,)):
        torch.testing.assert_close(full, fa @ fb, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(REDUCE))
@pytest.mark.parametrize("pls", [(S(0),), (S(1),), (B,), (sbp.Partial("sum"),)])
def test_reductions_equal_the_dispatcher_route(name, pls):
    spell, op = REDUCE[name]
    full = randn((7, 3), seed=5)

    def fn(mesh):
        x = make_global(full, mesh, pls, seed=5)
        for _ in range(2):
            _same(spell(x), op(x))
        return spell(x).full()

    for got in sbp.testing.spmd(fn, (4,)):
        torch.testing.assert_close(got, spell(full), rtol=1e-12, atol=1e-12)


def test_the_direct_path_skips_the_dispatcher_once_a_decision_is_cached():
    def fn(mesh):
        x, y = make_global(randn((4, 4)), mesh, (S(0),)), make_global(randn((4, 4), seed=1), mesh, (S(0),))
        w = make_global(randn((4, 4), seed=2), mesh, (B,))
        x + y, x @ w, x.sum(), x * 2.0   # decide
        before = len(counter.mine())
        x + y, x @ w, x.sum(), x * 2.0, x.mean()
        return counter.mine()[before:]

    with _DispatchCounter() as counter:
        calls = sbp.testing.spmd(fn, (2,))
    # mean over a split dim is an exact global mean: a rule with its own computation, so it goes through
    # the handler, which runs local ATen ops (not GlobalTensor dispatch): nothing reaches the dispatcher
    assert calls == [[], []], calls


def test_autograd_takes_torch_s_way_and_records_the_graph():
    full = randn((4, 3))

    def fn(mesh):
        x = make_global(full, mesh, (S(0),), requires_grad=True)
        y = make_global(full, mesh, (S(0),))
        before = len(counter.mine())
        out = (x * y + x).sum()
        assert len(counter.mine()) > before, "a tensor that requires grad must go through the dispatcher"
        assert out.grad_fn is not None
        out.full().backward()
        with torch.no_grad():
            x * y                       # may decide (no_grad: the decision of a plain mul)
            before = len(counter.mine())
            x * y
        assert counter.mine()[before:] == []
        return x.grad.full()

    with _DispatchCounter() as counter:
        grads = sbp.testing.spmd(fn, (2,))
    for grad in grads:
        torch.testing.assert_close(grad, full + 1, rtol=0, atol=1e-12)


def test_dispatch_modes_see_every_op():
    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    def fn(mesh):
        x = make_global(randn((4, 4)), mesh, (S(0),))
        x + x   # cache a decision first: the mode must still see the op
        with Seen() as seen:
            x + x, x.sum()
        return [str(f) for f in seen.ops]

    seen = sbp.testing.spmd(fn, (2,))[0]
    assert "aten.add.Tensor" in seen and "aten.sum.default" in seen


def test_autocast_still_casts():
    def fn(mesh):
        x = make_global(randn((4, 4)).float(), mesh, (S(0),))
        w = make_global(randn((4, 4), seed=1).float(), mesh, (B,))
        x @ w
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ w).dtype

    assert sbp.testing.spmd(fn, (2,)) == [torch.bfloat16] * 2


def test_keyword_arguments_plain_tensors_and_other_meshes_take_torch_s_way():
    fa, fb = randn((4, 3)), randn((4, 3), seed=1)

    def fn(mesh):
        x, y = make_global(fa, mesh, (S(0),)), make_global(fb, mesh, (B,))
        alpha = x.add(y, alpha=2).full()
        floor = x.div(y, rounding_mode="floor").full()
        plain = (x + fb).full()
        other = make_global(fb, mesh.binding.bind(sbp.DeviceMesh((2,), ranks=(1, 0))), (S(0),))
        for _ in range(2):   # the dispatcher route raises, and so does the direct path once a decision exists
            with pytest.raises(sbp.SbpError, match="different meshes"):
                x + other
        return alpha, floor, plain

    for alpha, floor, plain in sbp.testing.spmd(fn, (2,)):
        torch.testing.assert_close(alpha, fa + 2 * fb, rtol=0, atol=1e-12)
        torch.testing.assert_close(floor, torch.div(fa, fb, rounding_mode="floor"), rtol=0, atol=0)
        torch.testing.assert_close(plain, fa + fb, rtol=0, atol=1e-12)


def test_direct_ok_names_what_blocks_the_short_way():
    x = GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (B,), (2,))
    assert direct.direct_ok(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not direct.direct_ok(x)
    with TorchDispatchMode():
        assert not direct.direct_ok(x)
    x.requires_grad_()
    assert not direct.direct_ok(x)
    with torch.no_grad():
        assert direct.direct_ok(x)


# in-place spellings an optimizer runs, and the ATen call (with keywords) the dispatcher hands the handler
INPLACE = {
    "add_": (lambda a, b: a.add_(b), aten.add_.Tensor, {}),
    "add_ alpha": (lambda a, b: a.add_(b, alpha=-0.5), aten.add_.Tensor, {"alpha": -0.5}),
    "sub_ alpha": (lambda a, b: a.sub_(b, alpha=2), aten.sub_.Tensor, {"alpha": 2}),
    "mul_": (lambda a, b: a.mul_(b), aten.mul_.Tensor, {}),
    "div_": (lambda a, b: a.div_(b), aten.div_.Tensor, {}),
}


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(INPLACE)), st.sampled_from(SMALL_MESHES), st.data())
def test_inplace_operators_with_autograd_off_equal_the_dispatcher_route(name, mesh_shape, data):
    spell, op, kw = INPLACE[name]
    shape = data.draw(st.sampled_from([(5, 3), (4, 4), (0, 3)]))
    pa = data.draw(placements_for(len(shape), len(mesh_shape), partial=("sum",)))
    pb = data.draw(placements_for(len(shape), len(mesh_shape), partial=("sum",)))
    scalar = data.draw(st.sampled_from([None, 0.9, 3]))
    fa, fb = randn(shape, seed=1), randn(shape, seed=2).abs() + 1

    def fn(mesh):
        got, want = make_global(fa, mesh, pa, seed=1), make_global(fa, mesh, pa, seed=1)
        other = make_global(fb, mesh, pb, seed=2) if scalar is None else scalar
        with torch.no_grad():
            for _ in range(2):  # the first call decides (handler), the second takes the cached decision
                assert spell(got, other) is got
                assert op(want, other, **kw) is want   # an OpOverload call goes through torch's dispatcher
                _same(got, want)
                assert got._version == want._version   # the in-place kernel's version bump, either way
        return got.full()

    other, ref = fb if scalar is None else scalar, fa.clone()
    spell(spell(ref, other), other)
    for full in sbp.testing.spmd(fn, mesh_shape):
        torch.testing.assert_close(full, ref, rtol=1e-12, atol=1e-12)


def test_an_sgd_step_skips_the_dispatcher_and_equals_plain_sgd():
    """torch.optim.SGD with momentum, per tensor (its default on CPU): ``buf.mul_(m).add_(g, alpha=1.0)`` and
    ``p.add_(buf, alpha=-lr)``, three dispatcher trips per parameter on the dispatcher route; none once the
    decisions are cached. The parameters equal plain SGD's on the full tensors."""
    fulls = [randn((6, 4), seed=1), randn((4,), seed=2), randn((3, 6), seed=3)]
    grads = [randn(tuple(f.shape), seed=10 + i) for i, f in enumerate(fulls)]
    pls = [(S(0),), (B,), (S(1),)]

    def fn(mesh):
        params = [torch.nn.Parameter(make_global(f, mesh, p)) for f, p in zip(fulls, pls)]
        for p, g, pl in zip(params, grads, pls):
            p.grad = make_global(g, mesh, pl)
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
        opt.step()   # makes the momentum buffers (a clone of each gradient)
        opt.step()   # decides the in-place ops
        before = len(counter.mine())
        opt.step()
        return [str(f) for f in counter.mine()[before:]], [p.full() for p in params]

    plain = [torch.nn.Parameter(f.clone()) for f in fulls]
    for p, g in zip(plain, grads):
        p.grad = g.clone()
    opt = torch.optim.SGD(plain, lr=0.1, momentum=0.9, foreach=False)
    for _ in range(3):
        opt.step()
    with _DispatchCounter() as counter:
        results = sbp.testing.spmd(fn, (2,))
    for calls, got in results:
        assert calls == [], calls
        for g, want in zip(got, plain):
            torch.testing.assert_close(g, want.detach(), rtol=0, atol=0)


def test_inplace_direct_path_keeps_autograd_s_checks_and_refusals():
    """A write on the direct path bumps the version counter (autograd then refuses a backward through the
    changed saved tensor, as torch does); a view laid out anew still refuses writes; a dispatch mode still
    sees the op."""
    full = randn((4, 6))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def fn(mesh):
        w = make_global(full, mesh, (S(0),), requires_grad=True)
        x = make_global(full, mesh, (S(0),))
        with torch.no_grad():
            x.mul_(2.0)                  # decides
        y = (w * x).sum()                # saves x for the backward
        version = x._version
        before = len(counter.mine())
        with torch.no_grad():
            x.mul_(2.0)                  # the direct path
        assert counter.mine()[before:] == [] and x._version == version + 1
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.full().backward()
        base = sbp.distribute(torch.arange(24.0).view(4, 6), mesh, "S(1)")
        v = base.view(24)   # laid out anew: a write goes through the handler, on into the base
        with torch.no_grad():
            for _ in range(2):
                v.mul_(2.0)
        assert torch.equal(base.full(), 4 * torch.arange(24.0).view(4, 6))
        with torch.no_grad():
            with Seen() as seen:
                x.mul_(2.0)
        return seen.ops

    with _DispatchCounter() as counter:
        for ops in sbp.testing.spmd(fn, (2,)):
            assert "aten.mul_.Tensor" in ops
