"""`x[index] = value` on split dims: every rank writes its block's part of the region (no copy that the
write would miss), for every placement, uneven and empty shards, broadcast values and global values."""
from __future__ import annotations

import math

import pytest
import torch

import sbp
import sbp.testing
from sbp.tensor.global_tensor import grad_placements

INDICES = [(slice(1, 3),), (slice(None), 2), (4,), (-1, slice(0, 5, 2)), (slice(0, 7, 3), None, slice(1, None)),
           (Ellipsis, 1), (slice(2, 6), slice(1, 4)), (slice(5, 2),), (slice(0, 100),), (slice(6, 7), 0)]
LAYOUTS = {(2,): ["S(0)", "S(1)", "P(sum)", "P(max)"], (4,): ["S(0)", "S(1)", "P(sum)"], (3,): ["S(0)", "S(1)"],
           (2, 2): ["S(0), S(1)", "S(1), S(0)", "S(0), S(0)", "P, S(0)", "S(1), P(min)"]}
FULL = torch.arange(35.0).view(7, 5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(LAYOUTS))
def test_setitem_matches_torch(mesh):
    def rank(mesh_):
        wrong = []
        for pls in LAYOUTS[mesh]:
            for index in INDICES:
                region = FULL[index].shape
                value = torch.randn(region, generator=torch.Generator().manual_seed(len(wrong)))
                for v in (-9.0, value, value[..., :1] if len(region) and region[-1] else 7):
                    want = FULL.clone()
                    want[index] = v
                    x = sbp.distribute(FULL, mesh_, pls)
                    x[index] = v
                    if x.placements != sbp.placements(pls) or not torch.equal(x.full(), want):
                        wrong.append((pls, index))
        return wrong

    for wrong in sbp.testing.spmd(rank, mesh):
        assert wrong == []


def test_setitem_with_a_global_value_an_int_dtype_and_a_view():
    def rank(mesh):
        x = sbp.distribute(torch.zeros(6, 4, dtype=torch.int64), mesh, "S(0)")
        x[1:5, 1] = sbp.distribute(torch.tensor([1.9, 2.0, 3.0, 4.0]), mesh, "S(0)")   # cast like torch
        cols = x[:, 2:4]            # a view (columns are not split): writes reach x
        cols[0:3] = 7
        return x.full()

    want = torch.zeros(6, 4, dtype=torch.int64)
    want[1:5, 1] = torch.tensor([1.9, 2.0, 3.0, 4.0])
    want[:, 2:4][0:3] = 7
    for got in sbp.testing.spmd(rank, (4,)):
        assert torch.equal(got, want)


def test_setitem_refusals():
    """A value of the wrong shape is a ShapeError; an in-place write into a leaf that requires grad is
    refused as torch refuses it (RuntimeError), also when the index narrows a split dim."""
    def rank(mesh):
        messages = []
        leaf = sbp.distribute(torch.ones(4, 2), mesh, "S(0)", requires_grad=True)
        for target, value in ((sbp.distribute(torch.ones(4, 2), mesh, "S(0)"), torch.ones(3)), (leaf, 0.0)):
            try:
                target[1:3] = value
            except (sbp.SbpError, RuntimeError) as e:
                messages.append(type(e).__name__ + ": " + str(e))
        return messages

    for messages in sbp.testing.spmd(rank, (2,)):
        assert len(messages) == 2
        assert messages[0].startswith("ShapeError: x[1:3] on global shape (4, 2)") and "cannot be broadcast" in messages[0]
        assert messages[1].startswith("RuntimeError: ") and "leaf Variable that requires grad" in messages[1]


GRAD_INDICES = [(0, 0), 0, (slice(None), 1), slice(1, None), (slice(0, 5, 2), slice(1, 3)), (Ellipsis, -1),
                (None, slice(2, 4))]
GRAD_LAYOUTS = {(2,): ["S(0)", "S(1)", "P(sum)", "B"], (2, 2): ["S(0), S(1)", "P, S(0)", "S(1), S(0)"]}


@pytest.mark.parametrize("mesh", sorted(GRAD_LAYOUTS))
def test_setitem_with_grad_matches_torch(mesh):
    """`y[index] = v` on an activation that requires grad (and/or a value that does) is recorded by
    autograd: the gradients of the input, of a plain value (full, on every rank) and of a global value
    (its placements' gradient layout) equal one-process torch's, for every value kind and layout."""
    full = torch.arange(20.0).view(5, 4) / 7
    weight = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))

    def torch_grads(index, kind, x_grad):
        x = full.clone().requires_grad_(x_grad)
        value = _grad_value(full[index].shape, kind)
        y = x * 2
        y[index] = value
        (y * y * weight).sum().backward()
        return x.grad, (value.grad if isinstance(value, torch.Tensor) else None)

    def rank(mesh_):
        wrong = []
        for pls in GRAD_LAYOUTS[mesh]:
            for index in GRAD_INDICES:
                for kind, x_grad in (("scalar", True), ("plain", True), ("plain", False), ("global", True)):
                    want_x, want_v = torch_grads(index, kind, x_grad)
                    x = sbp.distribute(full, mesh_, pls, requires_grad=x_grad)
                    value = _grad_value(full[index].shape, kind)
                    given = sbp.distribute(value.detach(), mesh_, (sbp.S(0) if value.ndim else sbp.B,) * len(mesh),
                                           requires_grad=True) if kind == "global" else value
                    y = x * 2
                    y[index] = given
                    (y * y * weight).sum().full().backward()
                    ok = (want_x is None) == (x.grad is None)
                    if ok and want_x is not None:
                        ok = x.grad.placements == grad_placements(x.placements) and \
                            torch.allclose(x.grad.full(), want_x)
                    if kind == "plain":
                        ok = ok and type(given.grad) is torch.Tensor and torch.allclose(given.grad, want_v)
                    if kind == "global":
                        ok = ok and given.grad.placements == given.placements and torch.allclose(given.grad.full(), want_v)
                    if not ok:
                        wrong.append((pls, index, kind, x_grad))
        return wrong

    for wrong in sbp.testing.spmd(rank, mesh):
        assert wrong == []


def _grad_value(region, kind):
    """A value for `region`: a float, or a tensor that requires grad and is broadcast along some dims."""
    if kind == "scalar":
        return 5.0
    shape = (1,) + tuple(region[1:]) if len(region) > 1 else tuple(region)   # broadcast along the first dim
    return (torch.arange(math.prod(shape), dtype=torch.float32).view(shape) - 3).requires_grad_()


def test_setitem_with_grad_into_a_view():
    """A recorded write into a view of an activation (columns not split) reaches the base's gradient."""
    def rank(mesh):
        x = sbp.distribute(torch.arange(24.0).view(6, 4), mesh, "S(0)", requires_grad=True)
        y = x * 1
        cols = y[:, 2:4]
        v = sbp.distribute(torch.ones(3, 2), mesh, "S(1)", requires_grad=True)
        cols[0:3] = v * 3
        (y * y).sum().full().backward()
        return x.grad.full(), v.grad.placements, v.grad.full()

    x = torch.arange(24.0).view(6, 4).requires_grad_()
    v = torch.ones(3, 2, requires_grad=True)
    y = x * 1
    y[:, 2:4][0:3] = v * 3
    (y * y).sum().backward()
    for gx, placements, gv in sbp.testing.spmd(rank, (2,)):
        assert torch.equal(gx, x.grad) and placements == (sbp.S(1),) and torch.equal(gv, v.grad)


def test_setitem_on_a_mesh_over_some_ranks():
    """Ranks outside the tensor's mesh hold no block and write nothing (also for a global value)."""
    def rank(mesh):
        sub = sbp.testing.submesh(mesh, (2,), ranks=[0, 1])
        x = sbp.distribute(torch.zeros(4, 2), sub, "S(0)")
        x[1:3] = sbp.distribute(torch.ones(2, 2), sub, "S(1)")
        x[0] = torch.tensor([5.0, 6.0])
        return x.full()

    want = torch.tensor([[5.0, 6.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    got = sbp.testing.spmd(rank, (4,))
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    assert got[2].numel() == 0 and got[3].numel() == 0


def test_setitem_with_grad_on_a_mesh_over_some_ranks():
    """The recorded write on a sub-mesh: the mesh's ranks get torch's gradients; the others, which hold no
    block, take part in nothing and get no gradient of the tensor (a plain value's gradient is zeros)."""
    def rank(mesh):
        sub = sbp.testing.submesh(mesh, (2,), ranks=[0, 1])
        x = sbp.distribute(torch.arange(8.0).view(4, 2), sub, "S(0)", requires_grad=True)
        v = torch.tensor([1.0, 2.0], requires_grad=True)
        y = x * 2
        y[0] = v
        y[1:3] = sbp.distribute(torch.ones(2, 2), sub, "S(1)")
        (y * y).sum().full().backward()
        return x.grad.full(), v.grad

    x = torch.arange(8.0).view(4, 2).requires_grad_()
    v = torch.tensor([1.0, 2.0], requires_grad=True)
    y = x * 2
    y[0] = v
    y[1:3] = torch.ones(2, 2)
    (y * y).sum().backward()
    got = sbp.testing.spmd(rank, (4,))
    for gx, gv in got[:2]:
        assert torch.equal(gx, x.grad) and torch.equal(gv, v.grad)
    for gx, gv in got[2:]:
        assert gx.numel() == 0 and torch.equal(gv, torch.zeros(2))


def _setitem_grad_gloo(mesh):
    full = torch.arange(20.0).view(5, 4) / 7
    x = sbp.distribute(full, mesh, "S(0)", requires_grad=True)
    v = torch.tensor([1.0, -2.0, 3.0, 0.5], requires_grad=True)
    y = x * 2
    y[1] = v
    (y * y).sum().full().backward()
    return x.grad.placements, x.grad.full(), v.grad


@pytest.mark.gloo
def test_setitem_with_grad_on_gloo():
    full = torch.arange(20.0).view(5, 4) / 7
    x = full.clone().requires_grad_()
    v = torch.tensor([1.0, -2.0, 3.0, 0.5], requires_grad=True)
    y = x * 2
    y[1] = v
    (y * y).sum().backward()
    for placements, x_grad, v_grad in sbp.testing.spmd(_setitem_grad_gloo, (3,), backend="gloo", timeout=60):
        assert placements == (sbp.S(0),)
        assert torch.allclose(x_grad, x.grad) and torch.allclose(v_grad, v.grad)
