"""Autograd through redistribute / full / to_local / from_local: gradients equal the single-device ones, leaf
gradients keep the leaf's placements, and backward passes run exactly the planned collectives."""
from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sbp
import sbp.testing
from sbp.tensor.global_tensor import GlobalTensor, grad_placements, redistribute_raw
from sbp.testing.strategies import layouts, placements
from sbp.values.placement import Partial

spmd = functools.partial(sbp.testing.spmd, timeout=30)


def values(shape, offset=1) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + offset


def _full_loss_grads(shape, leaf_pls, chain, mesh):
    t, w = values(shape), values(shape, offset=-3)
    leaf = sbp.distribute(t, mesh, leaf_pls, requires_grad=True)
    y = leaf
    for pls in chain:
        y = y.redistribute(pls)
    (y.full() * w).sum().backward()                        # single device: d/dt sum(t * w) = w
    g = leaf.grad
    return type(g) is GlobalTensor, g.placements == leaf.placements, torch.equal(g.full(), w)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(case=layouts(partial=False, max_side=6), data=st.data())
def test_chain_then_full_gives_single_device_grad(case, data):
    mesh_shape, shape, leaf_pls = case
    chain = data.draw(st.lists(placements(len(mesh_shape), len(shape)), min_size=1, max_size=3))
    for r in spmd(functools.partial(_full_loss_grads, shape, leaf_pls, chain), mesh_shape):
        assert r == (True, True, True), (mesh_shape, shape, leaf_pls, chain, r)


def _local_loss_grads(shape, leaf_pls, chain, mesh):
    t, w = values(shape), values(shape, offset=-3)
    leaf = sbp.distribute(t, mesh, leaf_pls, requires_grad=True)
    y = leaf
    for pls in chain:
        y = y.redistribute(pls)
    # each rank's loss covers its own block; Broadcast replicas count once (their grads are not summed)
    w_local = w[sbp.local_slices(shape, mesh, y.placements, mesh.coord)]
    (y.to_local() * w_local).sum().backward()
    return leaf.grad.placements == leaf.placements, torch.equal(leaf.grad.full(), w)


@settings(max_examples=25, deadline=None)
@given(case=layouts(partial=False, max_side=6), data=st.data())
def test_chain_then_to_local_gives_single_device_grad(case, data):
    mesh_shape, shape, leaf_pls = case
    chain = data.draw(st.lists(placements(len(mesh_shape), len(shape)), min_size=0, max_size=2))
    chain.append(data.draw(placements(len(mesh_shape), len(shape), partial=False)))
    for r in spmd(functools.partial(_local_loss_grads, shape, leaf_pls, chain), mesh_shape):
        assert r == (True, True), (mesh_shape, shape, leaf_pls, chain, r)


def test_to_local_of_partial_grads_are_parts():
    def fn(mesh):
        w = values((3,))
        x = sbp.distribute(values((3,)), mesh, "B", requires_grad=True)
        (x.redistribute("P").to_local() * w).sum().backward()      # local grads taken as P(sum) parts
        as_parts = x.grad.full()
        x.grad = None
        local = x.redistribute("P").to_local(grad_placements="B")  # ... or as one Broadcast value
        (local * w).sum().backward()
        return torch.equal(as_parts, 2 * w), torch.equal(x.grad.full(), w)

    assert spmd(fn, (2,)) == [(True, True)] * 2


@pytest.mark.parametrize("mesh_shape, shape, pls, bad, good", [
    ((2,), (4,), "S(0)", "P", "S(0)"),                 # a P(sum) gradient would have the global shape
    ((2,), (4, 4), "S(0)", "S(1)", "S(0)"),            # same local shape on no coord
    ((3,), (4,), "B", "S(0)", "P"),                    # B and P(sum) share the local shape
    ((2, 2), (5, 2), "S(0), B", "S(0), S(0)", "S(0), P"),
    ((2,), (1,), "S(0)", "B", "S(0)"),                 # uneven: (1,) and (0,) -- coord 1 differs
])
def test_to_local_grad_placements_must_give_the_local_shape(mesh_shape, shape, pls, bad, good):
    """`to_local(grad_placements=...)` whose layout would give the local gradient another shape than the
    local tensor on some coord is refused at the call, on every rank alike (not later in backward)."""
    def fn(mesh):
        x = sbp.distribute(values(shape), mesh, pls, requires_grad=True)
        try:
            x.to_local(grad_placements=bad)
            refused = None
        except sbp.PlacementError as e:
            refused = str(e)
        local = x.to_local(grad_placements=good)
        local.sum().backward()      # a gradient laid out as `good` reaches the leaf
        return refused, x.grad.placements, x.grad.full()

    parts = [n for n, p, g in zip(mesh_shape, sbp.placements(pls), sbp.placements(good)) if p != g]
    want = torch.ones(shape, dtype=torch.float64) * math.prod(parts)   # B taken as P(sum) parts: each counts
    for refused, grad_pls, grad in spmd(fn, mesh_shape):
        assert refused is not None and f"to_local(grad_placements={sbp.placements(bad)})" in refused
        assert f"with placements {sbp.placements(pls)}" in refused and "but the local tensor's is" in refused
        assert f"{sbp.placements(good)}" in refused.split("valid: ")[1]
        assert grad_pls == sbp.placements(pls) and torch.equal(grad, want)


def test_from_local_partial_leaf_gets_broadcast_grad():
    def fn(mesh):
        local = torch.full((2, 2), float(mesh.rank), dtype=torch.float64, requires_grad=True)
        x = sbp.from_local(local, mesh, "P(sum), S(1)")
        w = values((2, 4))
        (x.full() * w).sum().backward()
        return torch.equal(local.grad, w[sbp.local_slices((2, 4), mesh, "B, S(1)", mesh.coord)])

    assert all(spmd(fn, (2, 2)))


def test_grads_accumulate_and_optimizer_steps_shard_local():
    def fn(mesh):
        t = values((4, 6))
        p = torch.nn.Parameter(sbp.distribute(t, mesh, "S(1), B"))
        opt = torch.optim.SGD([p], lr=0.5, foreach=False)
        loss = p.redistribute("B, S(0)").full().sum() + (p.full() * 2).sum()    # p used twice
        loss.backward()
        grad_ok = p.grad.placements == p.placements and torch.equal(p.grad.full(), torch.full((4, 6), 3.0,
                                                                                           dtype=torch.float64))
        counters = mesh.binding.counters
        counters.reset()
        opt.step()                                                     # add_(grad, alpha=-lr): local, no comm
        return grad_ok, len(counters.calls), torch.equal(p.full(), t - 1.5)

    assert spmd(fn, (2, 2)) == [(True, 0, True)] * 4


class _PartialGrad(torch.autograd.Function):
    """Identity whose backward hands back the gradient as P(sum) (as a data-parallel batch would)."""

    @staticmethod
    def forward(ctx, x):
        return GlobalTensor(x._local, x._mesh, x._placements, tuple(x.shape))

    @staticmethod
    def backward(ctx, grad):
        return redistribute_raw(grad, (Partial("sum"),) * grad.mesh.ndim)


def test_leaf_rule_reduces_partial_grads_to_leaf_placements():
    def fn(mesh):
        t = values((3, 2))
        p = torch.nn.Parameter(sbp.distribute(t, mesh, "B"))
        (_PartialGrad.apply(p).full() * t).sum().backward()
        return p.grad.placements, torch.equal(p.grad.full(), t)

    assert spmd(fn, (2,)) == [((sbp.B,), True)] * 2


def test_grads_in_different_layouts_add_without_fallback():
    def fn(mesh):
        t = values((4, 2))
        p = sbp.distribute(t, mesh, "S(0)", requires_grad=True)
        loss = (_PartialGrad.apply(p).full() * t).sum() + (p.full() * t).sum()   # P(sum) and S(0) grads meet
        loss.backward()
        return p.grad.placements, torch.equal(p.grad.full(), 2 * t)

    with warnings.catch_warnings():
        warnings.simplefilter("error", sbp.FallbackWarning)         # global: applies inside the rank threads
        assert spmd(fn, (2,)) == [((sbp.S(0),), True)] * 2


# ---- the backward runs the planned collectives (counted by the communicator) -------------------------

# an exchange step runs as one all_to_all or as messages (send_recv), whichever its layout favours
KIND = {"transfer": "exchange", "all_to_all": "exchange", "send_recv": "exchange"}
CASES = [((4,), (8, 12), "S(0)", "S(1)"), ((4,), (8, 12), "B", "S(0)"), ((4,), (8, 12), "S(0)", "P(sum)"),
         ((4,), (10, 3), "S(0)", "B"), ((2, 2), (8, 12), "S(0), S(1)", "S(1), S(0)"),
         ((2, 2), (8, 12), "S(0), B", "P(max), S(1)"), ((2, 2), (9, 6), "B, S(1)", "S(0), S(0)"),
         ((2, 2, 2), (8, 8), "S(0), S(1), B", "B, S(0), S(1)")]


@pytest.mark.parametrize("mesh_shape,shape,src,dst", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_backward_collectives_are_the_planned_ones(mesh_shape, shape, src, dst):
    def fn(mesh):
        leaf = sbp.distribute(values(shape), mesh, src, requires_grad=True)
        y = leaf.redistribute(dst).full()
        mesh.binding.counters.reset()
        y.sum().backward()                      # full's backward is a local slice: only the planned move talks
        calls = mesh.binding.counters.calls
        return [(KIND.get(c.collective, c.collective), c.axes) for c in calls], mesh.binding.counters.received

    src_pls = sbp.placements(src)
    grad_src = grad_placements(sbp.placements(dst))
    plan = sbp.plan(shape, mesh_shape, grad_src, grad_placements(src_pls), itemsize=8)
    expected = [(KIND.get(s.kind, s.kind), s.axes) for s in plan.steps if s.is_collective]
    out = spmd(fn, mesh_shape)
    for calls, _ in out:
        assert calls == expected, plan.explain()
    assert max(received for _, received in out) == plan.bytes_per_rank


def test_cross_mesh_redistribute_is_differentiable():
    def fn(world):
        a = world.binding.bind(sbp.DeviceMesh((2,), ranks=(0, 1)))
        b = world.binding.bind(sbp.DeviceMesh((2, 1), ranks=(3, 2)))
        t = values((4, 2))
        x = sbp.distribute(t, a, "S(0)", requires_grad=True)
        y = x.redistribute("S(1), P", mesh=b)
        f = y.full()                                      # empty on ranks 0 and 1 (outside mesh b)
        (f * (t if b.coord is not None else f)).sum().backward()
        return y.mesh == b, x.grad.placements, (torch.equal(x.grad.full(), t) if a.coord is not None else None)

    assert spmd(fn, (4,)) == [(True, (sbp.S(0),), True)] * 2 + [(True, (sbp.S(0),), None)] * 2


@pytest.mark.parametrize("how", ["requires_grad_", "attribute", "zeros_like", "new_zeros", "detached_clone"])
def test_every_way_of_making_a_leaf_gets_the_leaf_rule(how):
    """torch sets requires_grad in C++ for ``x.requires_grad = True`` and factories with
    ``requires_grad=True``; such a leaf gets the leaf rule at its first op, so its .grad has its placements."""
    x0, w0 = torch.randn(8, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)

    def fn(mesh):
        x = sbp.distribute(x0, mesh, "S(0), B")
        w = sbp.distribute(w0, mesh, "B, S(1)")
        if how == "requires_grad_":
            w.requires_grad_()
        elif how == "attribute":
            w.requires_grad = True
        elif how == "zeros_like":
            w = torch.zeros_like(w, requires_grad=True)
        elif how == "new_zeros":
            w = w.new_zeros(w.shape, requires_grad=True)
        else:
            w = w.clone().detach()
            w.requires_grad = True
        (x @ w).sum().backward()
        return w.placements, w.grad.placements, w.grad.full()

    for pls, grad_pls, grad in sbp.testing.spmd(fn, (2, 2)):
        assert grad_pls == pls
        torch.testing.assert_close(grad, x0.sum(0)[:, None].expand(4, 3))


def test_distribute_keeps_requires_grad_of_its_input():
    """``distribute`` of a tensor that requires grad gives a leaf that requires grad (also with src=)."""
    def fn(mesh):
        t = torch.ones(4, requires_grad=True)
        a = sbp.distribute(t, mesh, "S(0)")
        b = sbp.distribute(t if mesh.coord == (0,) else None, mesh, "S(0)", src=0)
        c = sbp.distribute(t, mesh, "S(0)", requires_grad=False)
        return a.requires_grad and a.is_leaf, b.requires_grad and b.is_leaf, c.requires_grad

    assert sbp.testing.spmd(fn, (2,)) == [(True, True, False)] * 2


def _full_of_broadcast(mesh):
    w = sbp.distribute(torch.arange(4.0), mesh, "B", requires_grad=True)
    full = w.full()
    full.sum().backward()
    return w._local.grad_fn, w._local.requires_grad, full.grad_fn is not None, w.grad.to_local().tolist()


def test_full_of_a_broadcast_tensor_leaves_its_local_alone():
    # already Broadcast, full() returned the tensor's own local, which then carried full()'s grad_fn: a compiled
    # step reading w.full() recompiled (its guard on w._local's requires_grad changed)
    for grad_fn, requires_grad, tracked, grad in spmd(_full_of_broadcast, (2,)):
        assert (grad_fn, requires_grad, tracked, grad) == (None, False, True, [1.0] * 4)


@pytest.mark.parametrize("write", ["mul_slice", "setitem_row"])
@pytest.mark.parametrize("a_pls", ["B", "P(sum)"])
def test_backward_of_an_in_place_write_into_a_view_with_a_split_gradient(write, a_pls):
    # autograd's backward of an in-place op on a view writes the incoming gradient's slice in place
    # (CopySlices); with a split gradient that slice is laid out anew, and the write was refused
    a_full = torch.linspace(-1, 1, 15, dtype=torch.float64).view(5, 3)
    b_full = torch.linspace(0.5, 2, 15, dtype=torch.float64).view(5, 3)

    def written(c):
        if write == "mul_slice":
            c[2:].mul_(3.0)
        else:
            c[2] = 3.0
        return c

    def fn(mesh):
        a = sbp.distribute(a_full, mesh, a_pls).requires_grad_(True)
        b = sbp.distribute(b_full, mesh, "S(0)")
        (written(a * 1.0) * b).sum().full().backward()
        return a.grad.full()

    ref = a_full.clone().requires_grad_(True)
    (written(ref * 1.0) * b_full).sum().backward()
    for mesh in [(2,), (4,)]:
        for grad in spmd(fn, mesh):
            assert torch.allclose(grad, ref.grad, atol=1e-12, rtol=0), mesh


# ---- double backward (create_graph=True): gradient penalties as on one device --------------------------------

DBL_TOL = dict(rtol=0, atol=1e-12)
_GEN = torch.Generator().manual_seed(7)
W0, X0 = torch.randn(5, 4, generator=_GEN, dtype=torch.float64), torch.randn(5, 4, generator=_GEN, dtype=torch.float64)


def _plain(t):
    return t.full() if isinstance(t, GlobalTensor) else t


def _weight_penalty(mesh, pls, act, through_full):
    """d/dW of |d loss / dW|^2 (create_graph=True), the loss and the penalty read through `.full()`."""
    w = W0.clone().requires_grad_() if mesh is None else sbp.distribute(W0, mesh, pls, requires_grad=True)
    f = _plain if through_full else (lambda t: t)
    loss = f(act(torch.nn.functional.linear(X0, w))).pow(2).sum()
    g, = torch.autograd.grad(loss, w, create_graph=True)
    f(g).pow(2).sum().backward()
    return _plain(w.grad)


@pytest.mark.parametrize("act", [torch.tanh, lambda t: t], ids=["tanh", "linear"])
@pytest.mark.parametrize("mesh_shape, pls", [((1,), "B"), ((2,), "S(0)"), ((2,), "S(1)"), ((2,), "B"),
                                             ((2, 2), "S(0), S(1)"), ((2, 2), "B, S(0)"), ((2, 2), "S(1), B")])
def test_full_is_differentiable_twice(mesh_shape, pls, act):
    # full()'s backward wrapped the plain gradient in a new global tensor: the graph was cut there, and a
    # penalty on a gradient through .full() was wrong (tanh) or refused ("does not require grad", linear)
    ref = _weight_penalty(None, None, act, False)
    for grad in spmd(functools.partial(_weight_penalty, pls=pls, act=act, through_full=True), mesh_shape):
        torch.testing.assert_close(grad, ref, **DBL_TOL)


def _partial_sums_penalty(mesh, w_pls, x_pls, y_pls):
    """A rowwise matmul on local blocks, its partial sums wrapped by from_local(P(sum)); penalty on W's grad."""
    w = W0.clone().requires_grad_() if mesh is None else sbp.distribute(W0, mesh, w_pls, requires_grad=True)
    if mesh is None:
        y = X0 @ w.t()
    else:
        local = sbp.distribute(X0, mesh, x_pls).to_local() @ w.to_local().t()
        y = sbp.from_local(local, mesh, y_pls, global_shape=(5, 5))
    g, = torch.autograd.grad(torch.tanh(y).pow(2).sum().full() if mesh else torch.tanh(y).pow(2).sum(), w,
                             create_graph=True)
    (g.pow(2).sum().full() if mesh else g.pow(2).sum()).backward()
    return _plain(w.grad)


@pytest.mark.parametrize("mesh_shape, w_pls, x_pls, y_pls", [
    ((2,), "S(1)", "S(1)", "P(sum)"),
    ((2, 2), "S(1), S(1)", "S(1), S(1)", "P(sum), P(sum)"),
    ((2, 2), "S(1), S(0)", "S(1), B", "P(sum), S(1)"),
])
def test_from_local_partial_sums_are_differentiable_twice(mesh_shape, w_pls, x_pls, y_pls):
    # the local gradient of from_local(P(sum)) is the whole gradient on every rank, and each rank uses it
    # for its own part: its gradient (double backward) is a P(sum) part, it was taken as Broadcast
    ref = _partial_sums_penalty(None, None, None, None)
    for grad in spmd(functools.partial(_partial_sums_penalty, w_pls=w_pls, x_pls=x_pls, y_pls=y_pls), mesh_shape):
        torch.testing.assert_close(grad, ref, **DBL_TOL)


def _data_parallel_penalty(mesh, batch):
    """Data parallel on local blocks: each rank's rows times the whole W, W's local gradient a P(sum) part."""
    w = W0.clone().requires_grad_() if mesh is None else sbp.distribute(W0, mesh, (sbp.B,) * mesh.ndim,
                                                                         requires_grad=True)
    if mesh is None:
        y = X0 @ w.t()
    else:
        grad_pls = tuple(Partial() for _ in range(mesh.ndim))
        local = sbp.distribute(X0, mesh, batch).to_local() @ w.to_local(grad_placements=grad_pls).t()
        y = sbp.from_local(local, mesh, batch, global_shape=(5, 5))
    g, = torch.autograd.grad(_plain(torch.tanh(y).pow(2).sum()), w, create_graph=True)
    _plain(g.pow(2).sum()).backward()
    return _plain(w.grad)


@pytest.mark.parametrize("mesh_shape, batch", [((2,), "S(0)"), ((2, 2), "S(0), S(0)"), ((4,), "S(0)")])
def test_to_local_partial_grad_placements_are_differentiable_twice(mesh_shape, batch):
    # to_local(grad_placements=P(sum))'s local gradients are parts of W's gradient: in the double backward
    # every part's gradient is the whole incoming one, it was laid out P(sum) (on coord 0 only)
    ref = _data_parallel_penalty(None, None)
    for grad in spmd(functools.partial(_data_parallel_penalty, batch=batch), mesh_shape):
        torch.testing.assert_close(grad, ref, **DBL_TOL)


def _input_penalty(mesh, pls):
    """A plain input mixed into ops on a global W: d/dW of |d loss / dx|^2 (an input-gradient penalty)."""
    w = W0.clone().requires_grad_() if mesh is None else sbp.distribute(W0, mesh, pls, requires_grad=True)
    x = X0.clone().requires_grad_()
    gx, = torch.autograd.grad(_plain(torch.tanh(torch.nn.functional.linear(x, w)).pow(2).sum()), x,
                              create_graph=True)
    tracked = type(gx) is torch.Tensor and gx.requires_grad
    gx.pow(2).sum().backward()
    return tracked, gx.detach(), _plain(w.grad)


@pytest.mark.parametrize("mesh_shape, pls", [((1,), "B"), ((2,), "S(0)"), ((2,), "S(1)"), ((2,), "B"),
                                             ((2, 2), "S(0), S(1)"), ((2, 2), "P(sum), S(0)")])
def test_plain_input_gradient_is_differentiable_twice(mesh_shape, pls):
    # the plain input's gradient hook gathered the global gradient without autograd: autograd.grad(...,
    # create_graph=True) gave a gradient that did not require grad, and the penalty's W.grad was None
    _, ref_gx, ref = _input_penalty(None, None)
    for tracked, gx, grad in spmd(functools.partial(_input_penalty, pls=pls), mesh_shape):
        assert tracked
        torch.testing.assert_close(gx, ref_gx, **DBL_TOL)
        torch.testing.assert_close(grad, ref, **DBL_TOL)


def _freed_results(mesh) -> dict[str, bool]:
    """Per op: whether a result that requires grad, dropped without a backward, is freed (weakref dead)."""
    import gc
    import weakref
    x = sbp.distribute(torch.randn(8, 4, dtype=torch.float64), mesh, "S(0)", requires_grad=True)
    out = {}
    for name, op in (("sin", torch.sin), ("exp", torch.exp), ("relu", torch.relu), ("tanh", torch.tanh),
                     ("softmax", lambda t: t.softmax(-1)), ("t().exp()", lambda t: t.t().exp())):
        y = op(x * 2)
        ref = weakref.ref(y)
        del y
        gc.collect()
        out[name] = ref() is None
    return out


def test_results_that_autograd_saves_are_freed_without_a_backward():
    # fails without the detach / alias views taking their base's recipe instead of naming the base: autograd
    # saves exp's output as a detach of it, whose view recipe named the output -- a reference cycle through
    # autograd's C++ graph that gc cannot see (an eval forward in grad mode leaked its activations)
    for per_rank in sbp.testing.spmd(_freed_results, (2,)):
        assert all(per_rank.values()), per_rank
