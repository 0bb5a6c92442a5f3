"""SPMD agreement of errors: an op that refuses a call refuses it on every rank (a rank raising alone leaves
the others waiting in the next collective): out-of-range targets and indices, `out=` tensors of the wrong
shape; the fallback warning's once-per-op rule; and writes into views laid out anew, which reach the base on
every rank, also where a rank's piece of the view is empty."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import sbp
import sbp.testing
from sbp.tensor.global_tensor import FallbackWarning
from tests.support.ops_kit import randn


def _outcome(fn, mesh):
    """fn's error type name (or "ok") on this rank, with torch's builtin class where the error is also one
    ("ShapeError/IndexError"), then a collective every rank must reach."""
    try:
        fn(mesh)
        got = "ok"
    except Exception as e:  # noqa: BLE001 -- the type is the result
        also = [c.__name__ for c in (IndexError, RuntimeError) if isinstance(e, c) and type(e) is not c]
        got = "/".join([type(e).__name__] + also)
    flag = torch.tensor([1.0])
    mesh.binding.all_reduce(flag, tuple(range(mesh.ndim)), "sum")
    return got


def _agree(fn, mesh_shape):
    got = sbp.testing.spmd(lambda mesh: _outcome(fn, mesh), mesh_shape, timeout=10)
    assert len(set(got)) == 1, got
    return got[0]


# ---- writes into a view laid out anew reach the base alike, including on a rank whose piece is empty ----------
@pytest.mark.parametrize("mesh_shape, placements, write", [
    ((4,), "S(0)", lambda a: a[0:2].add_(1)),           # rank 3's S(1) piece of the (2, 3) view is empty
    ((2, 2), "S(0), S(0)", lambda a: a[0:2].add_(1)),
    ((4,), "S(0)", lambda a: a[0:2].zero_()),
])
def test_write_into_a_detached_view_reaches_the_base_on_every_rank(mesh_shape, placements, write):
    full = torch.arange(15.).reshape(5, 3)
    want = full.clone()
    write(want)

    def fn(mesh):
        a = sbp.distribute(full, mesh, placements)
        write(a)
        return a.full()

    assert all(torch.equal(got, want) for got in sbp.testing.spmd(fn, mesh_shape, timeout=10))


def test_write_into_a_view_that_aliases_still_reaches_the_base():
    full = torch.arange(12.).reshape(4, 3)

    def fn(mesh):
        a = sbp.distribute(full, mesh, "S(0)")
        a[:, 0:2].add_(1)   # the slice keeps S(0): a view of each local block
        return a.full()

    want = full.clone()
    want[:, 0:2] += 1
    assert all(torch.equal(r, want) for r in sbp.testing.spmd(fn, (3,)))


# ---- out-of-range targets / indices raise on every rank -----------------------------------------------------
LOGITS = randn((4, 5))
BAD = torch.tensor([0, 5, 1, 2])   # 5 >= 5 classes, on the first half of the batch only


@pytest.mark.parametrize("case", ["ce_S0", "ce_S1", "ce_neg", "nll_S0", "nll_none_S0", "ce_split_target",
                                  "gather_S0", "scatter_S0", "scatter_S1", "scatter_add_S0", "scatter_add_S1"])
def test_out_of_range_index_raises_on_every_rank(case):
    def fn(mesh):
        pl = "S(1)" if case.endswith("S1") else "S(0)"
        x = sbp.distribute(LOGITS, mesh, pl)
        index = torch.tensor([[0], [7], [1], [1]])
        if case.startswith("ce_"):
            target = {"ce_neg": torch.tensor([0, 1, 1, -3]),
                      "ce_split_target": sbp.distribute(torch.tensor([0, 1, 1, 9]), mesh, "S(0)")}.get(case, BAD)
            return F.cross_entropy(x, target).full()
        if case.startswith("nll"):
            return F.nll_loss(x, BAD, reduction="none" if "none" in case else "mean").full()
        if case.startswith("gather"):
            return x.gather(1, index).full()
        if case.startswith("scatter_add"):
            return x.scatter_add(1, index, torch.ones(4, 1, dtype=LOGITS.dtype)).full()
        return x.scatter(1, index, 1.0).full()

    # sbp's ShapeError, also the class torch raises for the same index (code written for torch catches it)
    expected = "ShapeError/IndexError" if case.startswith(("ce", "nll")) else "ShapeError/RuntimeError"
    assert _agree(fn, (2,)) == expected


def test_ignore_index_is_not_out_of_range():
    target = torch.tensor([0, -100, 4, 2])

    def fn(mesh):
        return F.cross_entropy(sbp.distribute(LOGITS, mesh, "S(0)"), target).full()

    want = F.cross_entropy(LOGITS, target)
    assert all(torch.allclose(r, want) for r in sbp.testing.spmd(fn, (2,)))


# ---- out= of the wrong global shape: refused before anything runs, the tensor left as it was ---------------------
def test_out_of_the_wrong_shape_is_refused_and_left_intact():
    def fn(mesh):
        x = sbp.distribute(torch.arange(12.).reshape(3, 4), mesh, "S(0)")
        o = sbp.distribute(torch.empty(0), mesh, "B")
        with pytest.raises(sbp.ShapeError, match=r"out= has global shape \(0,\) but the result has global shape"):
            torch.mul(x, 2, out=o)
        return tuple(o.shape), tuple(o.to_local().shape)

    assert sbp.testing.spmd(fn, (2,)) == [((0,), (0,))] * 2


def test_out_of_the_right_shape_still_works():
    def fn(mesh):
        x = sbp.distribute(torch.arange(12.).reshape(3, 4), mesh, "S(0)")
        o = sbp.distribute(torch.zeros(3, 4), mesh, "S(0)")
        torch.mul(x, 2, out=o)
        return o.full()

    assert all(torch.equal(r, torch.arange(12.).reshape(3, 4) * 2) for r in sbp.testing.spmd(fn, (2,)))


# ---- the fallback warning: once per op, and only when an input was gathered ------------------------------------
def test_fallback_warns_once_per_op_and_not_for_broadcast_inputs():
    sbp.ops.clear_cache()

    def fn(mesh):
        for n in (4, 5):
            for pl in ("B", "S(0)", "S(1)"):
                torch.trace(sbp.distribute(torch.eye(n) + 1, mesh, pl))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sbp.testing.spmd(fn, (2,))
    ours = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(ours) == 1 and "aten.trace.default" in ours[0] and "(S(0),)" in ours[0], ours


def test_fallback_on_broadcast_inputs_does_not_warn():
    sbp.ops.clear_cache()

    def fn(mesh):
        return torch.trace(sbp.distribute(torch.eye(4) + 1, mesh, "B")).full()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sbp.testing.spmd(fn, (2,))
    assert not [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert all(torch.equal(r, torch.trace(torch.eye(4) + 1)) for r in got)


# ---- the same on gloo processes --------------------------------------------------------------------------
def _gloo_cases(mesh):
    """Per case this rank's outcome (error type or "ok"), each followed by a collective every rank must reach."""
    def view_write(mesh):   # a view laid out anew: the write goes on into the base on every rank
        x = sbp.distribute(torch.arange(15.).reshape(5, 3), mesh, "S(0)")
        x[0:2].add_(1)
        want = torch.arange(15.).reshape(5, 3)
        want[0:2] += 1
        assert torch.equal(x.full(), want)

    def cross_entropy(mesh):
        F.cross_entropy(sbp.distribute(LOGITS, mesh, "S(0)"), BAD).full()

    def scatter(mesh):
        sbp.distribute(LOGITS, mesh, "S(1)").scatter(1, torch.tensor([[0], [7], [1], [1]]), 1.0).full()

    return [_outcome(fn, mesh) for fn in (view_write, cross_entropy, scatter)]


@pytest.mark.gloo
def test_errors_agree_on_gloo():
    got = sbp.testing.spmd(_gloo_cases, (4,), backend="gloo", timeout=60)
    assert got == [["ok", "ShapeError/IndexError", "ShapeError/RuntimeError"]] * 4
