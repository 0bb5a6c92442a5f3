"""Reductions and ops along dims: sum/mean (exact global mean on uneven shards), amax/amin/max/min to
P(max|min), softmax and friends on non-split dims; values and gradients match torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import sbp
import sbp.testing
from sbp import Partial, S
from tests.support.ops_kit import check_op, make_global, meshes, placements_for, randn, shape

SETTINGS = settings(max_examples=15, deadline=None)

# name -> (fn(x, dim, keepdim), Partial kinds worth drawing)
REDUCTIONS = {
    "sum_dim": (lambda x, d, k: x.sum(d, keepdim=k), ("sum",)),
    "sum_dims": (lambda x, d, k: x.sum(tuple({d % x.ndim, 0}), keepdim=k), ("sum",)),
    "sum_all": (lambda x, d, k: x.sum(), ("sum",)),
    "mean_dim": (lambda x, d, k: x.mean(d, keepdim=k), ("sum",)),
    "mean_all": (lambda x, d, k: x.mean(), ("sum",)),
    "amax": (lambda x, d, k: x.amax(d, keepdim=k), ("max",)),
    "amin": (lambda x, d, k: x.amin((d,), keepdim=k), ("min",)),
    "max_all": (lambda x, d, k: x.max(), ("max",)),
    "min_all": (lambda x, d, k: x.min(), ("min",)),
    "max_dim": (lambda x, d, k: x.max(d, keepdim=k), ("sum",)),
    "argmax": (lambda x, d, k: x.argmax(d, keepdim=k), ("sum",)),
    "var": (lambda x, d, k: x.var(d, keepdim=k), ("sum",)),
    "std": (lambda x, d, k: x.std(d, correction=0, keepdim=k), ("sum",)),
    "logsumexp": (lambda x, d, k: x.logsumexp(d, keepdim=k), ("sum",)),
    "norm": (lambda x, d, k: torch.linalg.vector_norm(x + 3, dim=d, keepdim=k), ("sum",)),
    "cumsum": (lambda x, d, k: x.cumsum(d), ("sum",)),
    "softmax": (lambda x, d, k: x.softmax(d), ("sum",)),
    "log_softmax": (lambda x, d, k: F.log_softmax(x, d), ("sum",)),
    # attention's softmax (what compiled scaled-dot-product attention runs); a fully masked row gives zeros
    "safe_softmax": (lambda x, d, k: torch.ops.aten._safe_softmax(x.masked_fill(x > 1, float("-inf")), d), ("sum",)),
    "sort": (lambda x, d, k: x.sort(d, descending=k), ("sum",)),
    "tril": (lambda x, d, k: x.tril(-1 if k else 0), ("sum", "max")),
    "flip": (lambda x, d, k: x.flip(d), ("sum", "max")),
    "prod": (lambda x, d, k: x.prod(d, keepdim=k), ("sum",)),
    "var_mean": (lambda x, d, k: torch.var_mean(x, d, keepdim=k), ("sum",)),
    "std_mean": (lambda x, d, k: torch.std_mean(x, d, correction=0, keepdim=k), ("sum",)),
    "median_dim": (lambda x, d, k: x.median(d, keepdim=k), ("sum",)),
    "nanmedian_dim": (lambda x, d, k: x.nanmedian(d, keepdim=k), ("sum",)),
    "mode": (lambda x, d, k: x.mode(d, keepdim=k), ("sum",)),
    # (what F.pairwise_distance runs; torch.norm itself goes to vector_norm)
    "norm_p_dim": (lambda x, d, k: torch.ops.aten.norm.ScalarOpt_dim(x + 3, 3, [d], k), ("sum",)),
    "logcumsumexp": (lambda x, d, k: x.logcumsumexp(d), ("sum",)),
    "cummax": (lambda x, d, k: x.cummax(d), ("sum",)),
    "cummin": (lambda x, d, k: x.cummin(d), ("sum",)),
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*degrees of freedom")   # torch's own var/std on length-1 dims
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_reduction(name, data, mesh):
    fn, partial = REDUCTIONS[name]
    ndim = data.draw(st.integers(2, 3))
    s = shape(data.draw, ndim, 1, 6)
    dim = data.draw(st.integers(-ndim, ndim - 1))
    keep = data.draw(st.booleans())
    pls = data.draw(placements_for(ndim, len(mesh), partial))
    check_op(lambda x: fn(x, dim, keep), [randn(s)], [pls], mesh)


ZERO_D_REDUCTIONS = {
    "amax": lambda x: torch.amax(x, dim=0, keepdim=True) + torch.amax(x, dim=-1),
    "amin": lambda x: torch.amin(x, dim=(0,)) + torch.amin(x, dim=-1, keepdim=True),
    "mean": lambda x: torch.mean(x, dim=0, keepdim=True) + x.mean(-1),
    "sum": lambda x: torch.sum(x, dim=0) + x.sum(-1, keepdim=True),
}


@pytest.mark.parametrize("name", sorted(ZERO_D_REDUCTIONS))
@pytest.mark.parametrize("pls", ["B", "P(sum)", "B, P(sum)"])
def test_reductions_over_dim_0_of_a_0_d_tensor(name, pls):
    # fails without the runners skipping the 0-d tensor's dim 0: amax / amin / mean raised IndexError
    mesh = (2,) if pls.count(",") == 0 else (2, 2)
    check_op(ZERO_D_REDUCTIONS[name], [torch.tensor(3.5, dtype=torch.float64)], [pls], mesh)


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 10])
def test_mean_over_uneven_split_divides_by_global_length(rows):
    """DTensor's classic bug: the mean of an unevenly split dim must weigh every element equally."""
    full = torch.arange(rows * 3, dtype=torch.float64).view(rows, 3) ** 2

    def fn(mesh):
        x = make_global(full, mesh, (S(0), S(0)))
        m = x.mean(0)
        return m.placements, m.full(), x.mean().full()

    for pls, m, m_all in sbp.testing.spmd(fn, (2, 2)):
        assert pls == (Partial("sum"), Partial("sum"))
        assert torch.allclose(m, full.mean(0)) and torch.allclose(m_all, full.mean())


def test_sum_and_max_over_split_dim_give_partials_without_communication():
    full = randn((5, 4))

    def fn(mesh):
        x = make_global(full, mesh, (S(0),))
        mesh.binding.counters.reset()
        s, mx, mn = x.sum(0), x.amax(0), x.amin(0)
        moved = mesh.binding.counters.received
        return (s.placements, mx.placements, mn.placements), moved, (s.full(), mx.full(), mn.full())

    for pls, moved, (s, mx, mn) in sbp.testing.spmd(fn, (4,)):
        assert pls == ((Partial("sum"),), (Partial("max"),), (Partial("min"),)) and moved == 0
        assert torch.allclose(s, full.sum(0)) and torch.equal(mx, full.amax(0)) and torch.equal(mn, full.amin(0))


def test_amax_with_empty_shards():
    """3 rows over 4 ranks: the empty shard contributes -inf to P(max), not an error."""
    full = randn((3, 2))

    def fn(mesh):
        return make_global(full, mesh, (S(0),)).amax(0).full()

    for got in sbp.testing.spmd(fn, (4,)):
        assert torch.equal(got, full.amax(0))


@pytest.mark.parametrize("op", [lambda x: x.amax(0, keepdim=True), lambda x: x.amin((0, 1)), lambda x: x.amax(1),
                                lambda x: x.max()], ids=["amax-dim0", "amin-dims01", "amax-dim1", "max"])
def test_extremes_of_a_tensor_with_a_zero_size_dim(op):
    """(1, 0) split on dim 0 over 2 ranks: rank 1's shard (0, 0) is empty along the reduced dim 0 that the
    tensor is not empty along (before: rank 1 raised IndexError, rank 0 returned); where torch refuses the
    reduction itself (the zero-size dim 1 reduced), every rank refuses it."""
    full = torch.zeros(1, 0)
    try:
        want = op(full)
    except (IndexError, RuntimeError) as e:
        want = type(e)

    def fn(mesh):
        try:
            return op(make_global(full, mesh, (S(0),))).full()
        except (IndexError, RuntimeError) as e:
            return type(e)

    for got in sbp.testing.spmd(fn, (2,)):
        if isinstance(want, type):
            assert isinstance(got, type), (got, want)
        else:
            assert isinstance(got, torch.Tensor) and torch.equal(got, want), (got, want)


# ---- rules DTensor has: pad / roll / repeat keep a split they leave alone; count_nonzero like sum -------------
_KEEP = {
    "pad_last_dim_S0": (lambda x: F.pad(x, (1, 2)), "S(0)", (S(0),)),
    "pad_3d_S1": (lambda x: F.pad(x[None], (0, 0, 1, 1), value=2.0), "S(1)", (S(2),)),
    "repeat_S1": (lambda x: x.repeat(2, 1), "S(1)", (S(1),)),
    "repeat_leading_S0": (lambda x: x.repeat(3, 1, 2), "S(0)", (S(1),)),
    "roll_dim0_S1": (lambda x: x.roll(1, 0), "S(1)", (S(1),)),
    "count_nonzero_S0": (lambda x: torch.count_nonzero(x - 3), "S(0)", (Partial("sum"),)),
    "count_nonzero_dim1_S0": (lambda x: torch.count_nonzero(x - 3, dim=1), "S(0)", (S(0),)),
}


@pytest.mark.parametrize("case", sorted(_KEEP))
@pytest.mark.parametrize("mesh_shape", [(2,), (4,)])
def test_pad_roll_repeat_count_nonzero_have_rules(case, mesh_shape):
    f, placements, want_pls = _KEEP[case]
    full = torch.arange(30.).reshape(5, 6)

    def fn(mesh):
        with sbp.strict():   # no fallback: a rule placed it
            out = f(sbp.distribute(full, mesh, placements))
        return out.placements, out.full()

    for pls, got in sbp.testing.spmd(fn, mesh_shape):
        assert pls == want_pls and torch.equal(got, f(full))


def test_reduction_dtype_that_narrows_reduces_a_partial_sum_first():
    """``sum/mean/cumsum(dtype=torch.float16)`` of a float64 P(sum): parts 1000.4 and -1000.3 would each round
    to float16 first (0.5 for 0.1): the Partial is reduced first. A widening dtype (and int32's sum to
    int64) keeps it and moves nothing."""
    half = torch.float16
    cases = {"sum_dim": lambda x: x.sum(0, dtype=half), "sum_all": lambda x: x.sum(dtype=half),
             "mean_dim": lambda x: x.mean(0, dtype=half), "mean_all": lambda x: x.mean(dtype=half),
             "cumsum": lambda x: x.cumsum(0, dtype=half)}
    value = torch.tensor([[0.1, 0.1], [0.1, 0.1]], dtype=torch.float64)

    def rank(mesh):
        big = torch.tensor([[1000.3, 500.7], [0.2, 0.1]], dtype=torch.float64)
        parts = value + big if mesh.rank == 0 else -big
        x = sbp.from_local(parts, mesh, "P(sum)", global_shape=(2, 2))
        n = sbp.from_local(torch.tensor([[2, 3], [4, 5]], dtype=torch.int32) * (1 - 2 * mesh.rank), mesh, "P(sum)",
                           global_shape=(2, 2))
        y = sbp.from_local(parts.float(), mesh, "P(sum)", global_shape=(2, 2))
        mesh.binding.counters.reset()
        kept = [y.sum(0, dtype=torch.float64), n.sum(0), n.cumsum(1)]
        moved = mesh.binding.counters.received
        with sbp.strict():
            got = {name: f(x).full() for name, f in cases.items()}
        return got, [k.placements for k in kept], [k.full() for k in kept[1:]], moved

    for got, kept, ints, moved in sbp.testing.spmd(rank, (2,)):
        for name, f in cases.items():
            torch.testing.assert_close(got[name], f(value), rtol=0, atol=1e-3, msg=name)
        assert kept == [(Partial("sum"),)] * 3 and moved == 0
        assert all(i.dtype == torch.int64 and not i.any() for i in ints)   # the parts cancel
