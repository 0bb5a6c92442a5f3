"""View and shape rules: reshape/view (merging and splitting dims, uneven shards), transpose, permute,
unsqueeze/squeeze, expand, slice, select, split, cat, stack; values and gradients match torch, and the
splits that can be tracked stay local."""
from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sbp
import sbp.testing
from sbp import Partial, S
from tests.support.ops_kit import check_op, make_global, meshes, placements_for, randn, shape

SETTINGS = settings(max_examples=15, deadline=None)
PARTIALS = ("sum", "max")


def _factor(draw, n: int) -> tuple[int, int]:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    a = draw(st.sampled_from(divisors))
    return a, n // a


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_view_merge_and_split_dims(data, mesh):
    a, b, c = shape(data.draw, 3, 1, 6)
    p, q = _factor(data.draw, b * c)
    targets = [(a * b, c), (a, b * c), (a * b * c,), (a, p, q), (a * b, c, 1), (1, a, b, c), (-1, c)]
    target = data.draw(st.sampled_from(targets))
    pls = data.draw(placements_for(3, len(mesh), PARTIALS))
    check_op(lambda x: x.reshape(target), [randn((a, b, c))], [pls], mesh)
    check_op(lambda x: x.view(target) * 2, [randn((a, b, c))], [pls], mesh)


@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_view_after_transpose_of_local_blocks(data, mesh):
    """(B, H, T, D) -> transpose -> view (B, T, H*D): a non-contiguous local block must still work."""
    bsz, heads, t, d = shape(data.draw, 4, 1, 4)
    pls = data.draw(placements_for(4, len(mesh), PARTIALS))
    check_op(lambda x: x.transpose(1, 2).contiguous().view(bsz, t, heads * d), [randn((bsz, heads, t, d))],
             [pls], mesh)


SHAPE_OPS = {
    "transpose": lambda x: x.transpose(0, -1),
    "permute": lambda x: x.permute(2, 0, 1),
    "t": lambda x: x[0].t(),
    "unsqueeze": lambda x: x.unsqueeze(1).unsqueeze(-1),
    "squeeze": lambda x: x[:, :1].squeeze(1).squeeze(),
    # an empty dims list squeezes nothing (before: every size-1 dim of the local, the global shape kept)
    "squeeze_no_dims": lambda x: x[:1, :1].squeeze([]) * 2 + torch.squeeze(x[:1, :1], ()),
    "expand": lambda x: x[:, :1].expand(-1, 4, -1).unsqueeze(0).expand(2, -1, -1, -1),
    "slice": lambda x: x[1:, ::2, -2:],
    "select": lambda x: x[-1] + x[:, 0].sum() + x.select(2, 1).sum(),
    "split": lambda x: x.split(2, dim=1),
    "chunk": lambda x: x.chunk(2, dim=2),
    "unbind": lambda x: x.unbind(0),
    "cat": lambda x: torch.cat([x, x * 2], dim=1),
    "stack": lambda x: torch.stack([x, -x], dim=2),
    "contiguous_clone_detach": lambda x: x.contiguous().clone() + x.detach(),
    "flatten_unflatten": lambda x: x.flatten(1).unflatten(1, (x.shape[1], x.shape[2])),
    "index_select_gather": lambda x: x.index_select(1, torch.tensor([0, 0])) +
    x.gather(1, torch.zeros((x.shape[0], 2, x.shape[2]), dtype=torch.int64)),
    "scatter": lambda x: x.scatter(1, torch.zeros((x.shape[0], 1, x.shape[2]), dtype=torch.int64), 2.0) +
    x.scatter_add(1, torch.ones((x.shape[0], 1, x.shape[2]), dtype=torch.int64), x[:, :1] * 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHAPE_OPS))
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_shape_op(name, data, mesh):
    s = shape(data.draw, 3, 2, 5)
    pls = data.draw(placements_for(3, len(mesh), PARTIALS))
    check_op(SHAPE_OPS[name], [randn(s)], [pls], mesh)


@pytest.mark.parametrize("src, dst, pls, moved", [
    ((4, 6, 5), (24, 5), (S(0),), 0),              # merge after the split dim: blocks 12,12 both ways
    ((5, 6, 5), (30, 5), (S(0),), 3 * 5),          # uneven: rows 3,2 -> 18,12 where S(0) of 30 is 15,15
    ((4, 12), (4, 4, 3), (S(1),), 0),              # split a split dim: 6,6 -> heads 2,2 of 3
    ((4, 12), (4, 3, 4), (S(1),), 4 * 2),          # 6,6 per row where heads of 4 split 2,1 put 8,4
    ((4, 6, 5), (24, 5), (S(0), S(0)), 0),         # nested over 2x2: 1,1,1,1 rows -> 6,6,6,6
    ((2, 6, 4), (2, 24), (S(1), S(1)), 2 * (2 + 2)),   # nested 2,1,2,1 -> 8,4,8,4 where S(1),S(1) is 6 each
    ((7, 3), (21,), (S(0),), 2 + 1),               # rows 3,2,2 over 3 ranks: 9,6,6 elements where S(0) of 21 is 7 each
])
def test_reshape_keeps_splits_and_moves_only_rows_cut_elsewhere(src, dst, pls, moved):
    # every split survives the view; where the input's blocks are not the output's (uneven pieces merged
    # or split), the view moves exactly the elements whose rank changes, point to point (it redistributed
    # the input before: an all_to_all of about half the tensor, or a gather)
    full = randn(src)
    mesh_shape = (3,) if src == (7, 3) else (2,) * len(pls)

    def fn(mesh):
        x = make_global(full, mesh, pls)
        mesh.binding.counters.reset()
        y = x.view(dst)
        calls = {c.collective for c in mesh.binding.counters.calls}
        return y.placements, mesh.binding.counters.received // full.element_size(), calls, y.full()

    results = sbp.testing.spmd(fn, mesh_shape)
    for got, _, calls, value in results:
        assert torch.equal(value, full.view(dst))
        assert got == pls
        assert calls <= {"send_recv"}, calls
    assert sum(received for _, received, _, _ in results) == moved


@pytest.mark.parametrize("write", ["view", "slice", "select", "unbind", "split", "chunk", "narrow", "t_reshape",
                                   "regrouped", "chained"])
def test_a_write_into_a_view_laid_out_anew_reaches_the_base(write):
    # its local is no view of the base's: the write goes on into the base (sbp.ops.through); before, it was
    # refused ("could not stay a view"), also where autograd's own backward writes into a view of a gradient
    writes = {
        "view": lambda x: x.view(30).add_(1),
        "slice": lambda x: x[1:4].mul_(3),
        "select": lambda x: x[3].fill_(7),
        "unbind": lambda x: x.unbind(0)[2].add_(5),
        "split": lambda x: x.split(2)[1].sub_(1),
        "chunk": lambda x: x.chunk(3, 0)[2].zero_(),
        "narrow": lambda x: x.narrow(0, 2, 2).add_(x.narrow(0, 0, 2)),
        "t_reshape": lambda x: x.t().reshape(30)[::7].add_(10),
        "regrouped": lambda x: x.view(3, 10)[1].add_(100),   # a view of rows moved, then a select of it
        "chained": lambda x: x[1:5][1:3, 2:].mul_(-1),
    }
    full = torch.arange(30.0).view(5, 6)
    want = full.clone()
    writes[write](want)

    def fn(mesh):
        x = sbp.distribute(full, mesh, "S(0)")
        writes[write](x)
        return x.placements, x.full()

    for mesh in [(2,), (4,)]:   # 5 rows on 4 ranks: pieces of a slice are empty on some
        for placements, got in sbp.testing.spmd(fn, mesh):
            assert placements == (sbp.S(0),) and torch.equal(got, want), (write, mesh)


def test_select_on_split_dim_gives_partial_sum():
    full = randn((5, 3))

    def fn(mesh):
        x = make_global(full, mesh, (S(0),))
        mesh.binding.counters.reset()
        row = x[3]
        return row.placements, mesh.binding.counters.received, row.full()

    for pls, moved, row in sbp.testing.spmd(fn, (3,)):
        assert pls == (Partial("sum"),) and moved == 0 and torch.equal(row, full[3])


def test_backward_of_a_whole_range_slice_keeps_the_split():
    # narrow(0, 0, 5) slices dim 0 whole (as a compiled x[:, :2] does): its slice_backward keeps S(0), as
    # the forward slice does (it moved the gradient to S(1) with an all_to_all before)
    full = randn((5, 3))

    def fn(mesh):
        x = make_global(full, mesh, (S(0),), requires_grad=True)
        y = (x.narrow(0, 0, 5)[:, :2] * 2).sum(1)
        mesh.binding.counters.reset()
        y.backward(torch.ones_like(y))
        return [c.collective for c in mesh.binding.counters.calls], x.grad.placements, x.grad.full()

    want = torch.zeros(5, 3, dtype=full.dtype)
    want[:, :2] = 2
    for calls, pls, grad in sbp.testing.spmd(fn, (2,)):
        assert calls == [] and pls == (S(0),) and torch.equal(grad, want), (calls, pls)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_fill_zero_copy_and_like_factories(data, mesh):
    s = shape(data.draw, 2)
    pls = [data.draw(placements_for(2, len(mesh), ("sum", "max"))) for _ in range(2)]

    def fn(a, b):
        c = a.clone()
        c.copy_(b)                 # b laid out like c
        d = a.clone().fill_(1.5)   # P(sum): the value once
        e = a.clone().zero_()
        return c, d, e, torch.ones_like(a) * a, torch.zeros_like(b) + 1, torch.full_like(a, 2.0), a.new_zeros(3)

    check_op(fn, [randn(s, 0), randn(s, 1)], pls, mesh)


def test_item_and_equal_need_whole_values():
    full = randn((4,))

    def fn(mesh):
        with sbp.strict():
            x = make_global(full, mesh, (Partial("sum"),))
            return x.sum().item(), torch.equal(x, x), bool((x > 100).any())

    for got in sbp.testing.spmd(fn, (2,)):
        assert math.isclose(got[0], full.sum().item(), rel_tol=1e-12) and got[1] and not got[2]


def test_in_place_through_views():
    """A view that stays local aliases its base (writes reach it, autograd included); a view that needed a
    new layout has a local of its own, and a write into it goes on into the base (before: refused)."""
    full = randn((4, 3))

    def fn(mesh):
        x = make_global(full, mesh, (S(1),), requires_grad=True)
        y = x * 1
        y[0].mul_(2)                       # select on an unsplit dim: a real view of the local block
        y[:, 1].add_(3)                    # select on the split dim: not a view of y's blocks, written through
        (y * y).sum().backward()
        return y.full(), x.grad.full()

    ref = full.clone().requires_grad_()
    ry = ref * 1
    ry[0].mul_(2)
    ry[:, 1].add_(3)
    (ry * ry).sum().backward()
    for y, grad in sbp.testing.spmd(fn, (2,)):
        assert torch.allclose(y, ry) and torch.allclose(grad, ref.grad)


@pytest.mark.parametrize("pls", ["B", "S(0)", "S(1)"])
def test_in_place_on_a_reshape_that_copies(pls):
    """``x.t().reshape(-1)`` copies on one device, but the wrapper's contiguous strides make torch record a
    view: under autograd a write into it is refused (before: the write's gradient was lost, x.grad 1 for 3);
    with .contiguous() before the reshape or .clone() after it the gradients are torch's, and without
    autograd the write stays in the copy, as in torch."""
    full = torch.arange(6.0, dtype=torch.float64).view(3, 2)

    def fn(mesh):
        x = sbp.distribute(full, mesh, pls, requires_grad=True)
        with pytest.raises(sbp.SbpError, match="reshape copied"):
            (x * 1).t().reshape(-1).mul_(3)
        grads = []
        for fix in (lambda h: h.t().contiguous().reshape(-1), lambda h: h.t().reshape(-1).clone()):
            x.grad = None
            fix(x * 1).mul_(3).sum().full().backward()
            grads.append(x.grad.full())
        with torch.no_grad():
            y = x.t().reshape(-1)
            y.mul_(3)
            return grads, y.full(), x.full()

    for grads, y, x in sbp.testing.spmd(fn, (2,)):
        assert all(torch.equal(g, torch.full((3, 2), 3.0, dtype=torch.float64)) for g in grads), grads
        assert torch.equal(y, full.t().reshape(-1) * 3) and torch.equal(x, full)


def _write_through_partial(case, mesh):
    if case == "reshape-unsqueeze":   # (1, 2, 5) P(sum), S(2) on (2, 3): rank 5's block of the reshape is empty
        x = sbp.distribute(torch.arange(10.0, dtype=torch.float64).view(1, 2, 5), mesh, "P(sum), S(2)")
        y = x.reshape(5, 2, 1)
        y.unsqueeze(0).mul_(2)
        return y.full(), x.full()
    full = torch.arange(6.0, dtype=torch.float64).view(1, 6)   # S(1), P(max) on (2, 2), under autograd
    local = full[sbp.local_slices((1, 6), mesh, "S(1), B", mesh.coord)].clone().requires_grad_()
    h = sbp.from_local(local, mesh, "S(1), P(max)", global_shape=(1, 6)) * 1
    h[:, :3].diagonal().fill_(2.5)
    return h.full(), None


@pytest.mark.filterwarnings("ignore::sbp.FallbackWarning")   # diagonal has no rule: it runs on B
@pytest.mark.parametrize("case, mesh_shape", [("reshape-unsqueeze", (2, 3)), ("diagonal-of-slice", (2, 2))])
def test_writes_through_views_of_partial_tensors_keep_ranks_in_step(case, mesh_shape):
    """A write through a view laid out anew reaches only the ranks whose block the region meets; every rank
    must still count it as a write of the base (its version), or the base's kept P reduction was dropped on
    some ranks and reused on others, and the ranks ran different collectives (RankMismatchError / a hang)."""
    if case == "reshape-unsqueeze":
        want_x = torch.arange(10.0, dtype=torch.float64).view(1, 2, 5) * 2
        want = want_x.reshape(5, 2, 1)
    else:
        want, want_x = torch.arange(6.0, dtype=torch.float64).view(1, 6), None
        want[:, :3].diagonal().fill_(2.5)
    for y, x in sbp.testing.spmd(functools.partial(_write_through_partial, case), mesh_shape, timeout=30):
        assert torch.equal(y, want) and (x is None or torch.equal(x, want_x)), (y, x)


@pytest.mark.parametrize("pls", [("B",), ("S(0)",), ("S(1)",), ("P(sum)",)])
def test_vector_matrix_product_has_the_vector_shape(pls):
    """torch builds ``v @ M`` as unsqueeze -> mm -> squeeze_: the in-place squeeze must shrink the global
    shape too (it was (1, 5) with a (5,) local)."""
    v, m = randn((7,)), randn((7, 5), 1)
    vec_pls = ("S(0)",) if pls == ("S(0)",) else ("B",)
    check_op(lambda a, b: a @ b, [v, m], [vec_pls, pls], (2,))
    check_op(lambda a, b: b.t() @ a, [v, m], [vec_pls, pls], (2,))


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
def test_in_place_views_change_the_global_shape(mesh):
    full = randn((1, 7, 5))

    def fn(x):
        y = x * 1.0                       # a non-leaf to change in place
        y.squeeze_(0)
        y.t_()
        y.unsqueeze_(1)
        y.transpose_(0, 2)
        y.swapdims_(1, 2)
        return y

    for pls in (("S(1)",) * len(mesh), ("S(2)",) + ("B",) * (len(mesh) - 1), ("P(sum)",) * len(mesh)):
        check_op(fn, [full], [pls], mesh)

    def rank(mesh_):
        x = make_global(full, mesh_, ("S(1)",) * len(mesh))
        same = x
        x.squeeze_(0)
        return (x is same, tuple(x.shape), x.placements, tuple(x.local_shape), mesh_.coord,
                torch.equal(x.full(), full[0]))

    for same, gshape, placements, lshape, coord, equal in sbp.testing.spmd(rank, mesh):
        assert same and equal and gshape == (7, 5) and placements == (S(0),) * len(mesh)
        assert lshape == sbp.local_shape((7, 5), mesh, placements, coord)


def test_in_place_squeeze_of_a_split_size_one_dim():
    """A size-1 dim split over 2 ranks (one rank holds it, the other an empty shard): squeezing it in
    place gives the owner's values as a Partial, like the out-of-place squeeze."""
    def rank(mesh):
        x = sbp.distribute(torch.arange(4.).view(1, 4), mesh, "S(0)")
        x.squeeze_(0)
        return tuple(x.shape), x.full().tolist()

    for gshape, values in sbp.testing.spmd(rank, (2,)):
        assert gshape == (4,) and values == [0.0, 1.0, 2.0, 3.0]


VIEW_CHAINS = {
    "t": lambda x: x.t(), "t_t": lambda x: x.t().t(), "permute": lambda x: x.unsqueeze(0).permute(2, 0, 1),
    "unsqueeze": lambda x: x.unsqueeze(1), "slice_rows": lambda x: x[1:3], "slice_cols": lambda x: x[:, 1:3],
    "split0": lambda x: x.split(2, dim=0)[1], "chunk1": lambda x: x.chunk(2, dim=1)[0],
    "unbind1": lambda x: x.unbind(1)[2], "expand": lambda x: x[:, :1].expand(5, 4), "detach_t": lambda x: x.t().detach(),
    "view": lambda x: x.view(20), "inplace_t": lambda x: x.clone().t_(),
}


@pytest.mark.parametrize("name", list(VIEW_CHAINS))
@pytest.mark.parametrize("pls", [("S(0)",), ("S(1)",), ("B",)])
def test_contiguity_follows_torch_and_contiguous_copies_views(name, pls):
    """is_contiguous() and contiguous() follow the logical strides torch would have, on every rank alike:
    contiguous() of a transposed view is a copy (a write into it leaves the base alone), of a contiguous
    view the view itself (a write reaches the base, as in torch)."""
    chain = VIEW_CHAINS[name]
    full = torch.arange(20.0).view(5, 4)
    ref = full.clone()
    view = chain(ref)
    want_contiguous = view.is_contiguous()
    view.contiguous().add_(100)
    for mesh in [(2,), (3,)]:
        def rank(mesh_):
            x = sbp.distribute(full, mesh_, pls)
            v = chain(x)
            flag = v.is_contiguous()
            same = v.contiguous() is v
            try:
                v.contiguous().add_(100)
                wrote = True
            except sbp.SbpError as e:   # a contiguous view laid out anew (docs/operators.md): refused
                assert same and "could not stay a view" in str(e)
                wrote = False
            return flag, same, wrote, x.full()

        for flag, same, wrote, got in sbp.testing.spmd(rank, mesh):
            assert flag == want_contiguous and same == want_contiguous
            assert torch.equal(got, ref if wrote else full), (name, pls, mesh)


def test_contiguous_of_a_view_of_a_leaf_that_requires_grad():
    """torch copies here; writing into the copy is allowed (writing into a view of the leaf is not)."""
    def rank(mesh):
        x = sbp.distribute(torch.arange(24.0).view(2, 3, 4), mesh, "S(0)", requires_grad=True)
        y = x.transpose(0, 1).contiguous()
        y.add_(1.0)
        y.sum().backward()
        return x.grad.full()

    for grad in sbp.testing.spmd(rank, (2,)):
        assert torch.equal(grad, torch.ones(2, 3, 4))


@pytest.mark.parametrize("full, target, pls", [
    ((3, 0), (0,), "B"), ((3, 0), (0,), "S(0)"), ((2, 0, 3), (0, 3), "B"), ((0, 3), (3, 0), "B"),
    ((4, 0), (2, 2, 0), "S(0)"),
])
def test_views_of_tensors_with_no_elements(full, target, pls):
    # no element to line up: view_groups ran past the end of a shape (IndexError on every rank, also in backward)
    check_op(lambda x: x.reshape(target), [randn(full)], [pls], (2,))


@pytest.mark.parametrize("fn, full, pls", [
    (lambda x: x.permute(1, 0, 2).reshape(2, 15), (3, 2, 5), "S(0), S(1)"),
    (lambda x: x.transpose(1, 2).reshape(15, 2), (3, 2, 5), "S(2), S(1)"),
    (lambda x: x.unsqueeze(1).expand(5, 3, 1, 2).reshape(-1, 2), (5, 1, 2), "S(0), S(2)"),
])
def test_rows_moved_where_some_rank_holds_nothing_before_the_group(fn, full, pls):
    # a dim before the moved group is empty on some ranks (2 split over 3): their reshape(..., -1, ...) was
    # ambiguous and raised there alone while the others waited in the row move's all_to_all (a hang)
    check_op(fn, [randn(full)], [pls], (2, 3))


def _rotary_pairs(mesh):
    x = sbp.distribute(randn((2, 8, 32)), mesh, "S(2)")   # a colwise q_proj output: 32 = 4 heads x 8
    q = x.view(2, 8, 4, 8)                                # 11/11/10 features -> heads 2/1/1: rows moved
    c = torch.view_as_complex(q.float().reshape(2, 8, 4, 4, 2))
    return q.to_local().is_contiguous(), torch.view_as_real(c).full()


def test_a_view_that_moves_rows_is_laid_out_as_a_contiguous_view():
    # view_as_complex (rotary embeddings, DeepSeek-V2 on 3 ranks) needs a last dim of stride 1, as a view of a
    # contiguous tensor has: the rows moved to other ranks came back with permuted strides and it raised
    want = randn((2, 8, 32)).float().view(2, 8, 4, 4, 2)
    for contiguous, got in sbp.testing.spmd(_rotary_pairs, (3,)):
        assert contiguous and torch.equal(got, want)


def _layout_reading_views(mesh, pls):
    x = sbp.distribute(torch.arange(70.0, dtype=torch.float64).view(5, 2, 7), mesh, pls)
    y = (x.transpose(1, 2) * 1).contiguous()   # contiguous as a global tensor; its local kept the transpose
    return (torch.view_as_complex(y).full(), y.view(torch.complex128).full(), y.as_strided((5, 3), (14, 2)).full())


@pytest.mark.filterwarnings("ignore::sbp.FallbackWarning")   # view(dtype) and as_strided have no rule
@pytest.mark.parametrize("pls", ["B", "S(0)"])
def test_views_that_read_the_memory_layout_see_the_logical_layout(pls):
    # a pointwise op keeps its input's (transposed) strides on the local, the global tensor reports contiguous
    # strides, so .contiguous() does nothing: view_as_complex and view(dtype) raised "stride 1" errors and
    # as_strided read the transposed memory (wrong values, silently)
    y = (torch.arange(70.0, dtype=torch.float64).view(5, 2, 7).transpose(1, 2) * 1).contiguous()
    want = (torch.view_as_complex(y), y.view(torch.complex128), y.as_strided((5, 3), (14, 2)))
    for got in sbp.testing.spmd(functools.partial(_layout_reading_views, pls=pls), (3,)):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def _complex_view_writes(mesh, pls):
    y = sbp.distribute(torch.arange(70.0, dtype=torch.float64).view(7, 10), mesh, pls)
    c = torch.view_as_complex(y.view(7, 5, 2))   # S(1): 10 columns 4/3/3 -> 5 pairs 2/2/1, rows moved
    torch.view_as_real(c).mul_(2)
    c[1:3].add_(1j)
    a = sbp.distribute(torch.arange(70.0, dtype=torch.float64).view(7, 10), mesh, pls).requires_grad_()
    d = torch.view_as_complex((a * 1).view(7, 5, 2))
    torch.view_as_real(d).mul_(2)
    d.abs().sum().backward()   # (autograd replays the view chain on the gradient, split where rows move)
    return y.full(), c.full(), a.grad.full()


@pytest.mark.parametrize("pls", ["S(1)", "P(sum)", "B"])
def test_writes_into_complex_views_of_views_laid_out_anew_reach_the_base(pls):
    # view_as_complex / view_as_real change the dtype and could not be replayed on element indices: a write
    # into one whose base had moved rows raised an SbpError, in the forward or in backward
    y = torch.arange(70.0, dtype=torch.float64).view(7, 10)
    c = torch.view_as_complex(y.view(7, 5, 2))
    torch.view_as_real(c).mul_(2)
    c[1:3].add_(1j)
    a = torch.arange(70.0, dtype=torch.float64).view(7, 10).requires_grad_()
    d = torch.view_as_complex((a * 1).view(7, 5, 2))
    torch.view_as_real(d).mul_(2)
    d.abs().sum().backward()
    for got_y, got_c, grad in sbp.testing.spmd(functools.partial(_complex_view_writes, pls=pls), (3,)):
        assert torch.equal(got_y, y) and torch.equal(got_c, c) and torch.allclose(grad, a.grad, atol=1e-12)


def test_copy_into_a_partial_of_another_dtype_writes_the_converted_value():
    """``dst.copy_(src)`` into a Partial dst of another dtype: src laid out as dst's Partial and cast part by
    part would truncate P(sum) parts one by one (0.6 + 0.6 -> 0 + 0, not 1) and wrap an S -> P(min|max)
    identity fill (+inf -> INT64_MIN, int64 max -> int32 -1, -inf -> True). src is written whole and then
    laid out as dst's Partial; dst keeps its placements. A conversion that keeps the parts moves nothing."""
    rows = torch.arange(15, dtype=torch.float64).view(5, 3)
    cases = [("P(sum)", torch.int64, "P(sum)", torch.float64), ("P(min)", torch.int64, "S(0)", torch.float64),
             ("P(min)", torch.int32, "S(0)", torch.int64), ("P(max)", torch.bool, "S(0)", torch.float64),
             ("P(sum)", torch.float32, "P(sum)", torch.float64)]

    def value(src_dtype):
        return rows.to(src_dtype) + 0.2 if src_dtype.is_floating_point else rows.to(src_dtype)

    def rank(mesh):
        out = []
        for dst_pls, dst_dtype, src_pls, src_dtype in cases:
            if src_pls == "P(sum)":    # parts 0.6 + 0.6 (+ 1 / 3 and 2**-30 / 3 beyond float32's precision)
                part = value(src_dtype) / 2 + (1 / 3 + 2 ** -30 / 3) * (1 - 2 * mesh.rank)
                src = sbp.from_local(part, mesh, "P(sum)", global_shape=(5, 3))
            else:
                src = sbp.distribute(value(src_dtype), mesh, src_pls)
            dst = sbp.distribute(torch.zeros(5, 3, dtype=dst_dtype), mesh, dst_pls)
            with sbp.strict():
                dst.copy_(src)
            out.append((dst.placements, dst.full()))
        same = sbp.distribute(torch.zeros(5, 3, dtype=torch.float64), mesh, "P(sum)")
        mesh.binding.counters.reset()
        same.copy_(sbp.from_local(rows.float(), mesh, "P(sum)", global_shape=(5, 3)))   # float32 -> float64: exact
        return out, mesh.binding.counters.received, same.full()

    for out, moved, same in sbp.testing.spmd(rank, (2,)):
        for (dst_pls, dst_dtype, _, src_dtype), (pls, got) in zip(cases, out):
            assert pls == (Partial(dst_pls[2:-1]),)
            torch.testing.assert_close(got, value(src_dtype).to(dst_dtype), rtol=0, atol=1e-6,
                                       msg=f"{dst_pls} {dst_dtype}")
        assert moved == 0 and torch.equal(same, 2 * rows)


def test_cat_of_partials_of_mixed_dtypes_reduces_those_whose_parts_do_not_convert():
    """cat promotes int64 and float64 pieces to float64: int64 parts 2**60 + 1 and -2**60 converted one by one
    lose the 1, so that piece is reduced first; float32 and float64 P(sum) pieces stay Partial."""
    big = 2 ** 60

    def rank(mesh):
        sign = 1 - 2 * mesh.rank
        a = sbp.from_local(torch.tensor([big + 1, big + 3]) if mesh.rank == 0 else torch.tensor([-big, -big]), mesh,
                           "P(sum)", global_shape=(2,))
        b = sbp.from_local(torch.tensor([0.5, 0.25], dtype=torch.float64) * sign, mesh, "P(sum)", global_shape=(2,))
        c = sbp.from_local(torch.tensor([0.5, 0.25]) * sign, mesh, "P(sum)", global_shape=(2,))
        with sbp.strict():
            mixed = torch.cat([a, b])
        mesh.binding.counters.reset()
        kept = torch.cat([c, b])
        moved = mesh.binding.counters.received
        return mixed.full(), kept.placements, moved

    for mixed, kept, moved in sbp.testing.spmd(rank, (2,)):
        assert torch.equal(mixed, torch.tensor([1.0, 3.0, 0.0, 0.0], dtype=torch.float64)), mixed
        assert kept == (Partial("sum"),) and moved == 0


def test_an_invalid_view_in_a_known_shape_class_is_torchs_error():
    # before: after valid views made the shape class, x.view(120) of a (10, 14) tensor took the class's
    # decision without torch's check and raised a raw IndexError inside the view rule
    def fn(mesh):
        for n in (10, 12, 14):
            sbp.distribute(torch.ones(n, 14), mesh, "B").view(n * 14)
        with pytest.raises(RuntimeError, match=r"shape '\[120\]' is invalid for input of size 140"):
            sbp.distribute(torch.ones(10, 14), mesh, "B").view(120)

    sbp.testing.spmd(fn, (2,))


@pytest.mark.filterwarnings("ignore::sbp.FallbackWarning")   # index_put_ on a split dim: no rule, runs on B
@pytest.mark.parametrize("pls", ["S(1)", "P(sum)"])
def test_a_write_computed_elsewhere_into_an_expand_is_refused(pls):
    """torch writes into an expanded tensor's shared memory; here a write computed on B cannot be copied back
    into an expand's local, nor a write through a view laid out anew written into it: an SbpError naming it
    (before: torch's raw "more than one element of the written-to tensor refers to a single memory location")."""
    def fn(mesh):
        x = sbp.distribute(torch.arange(3.0).view(1, 3), mesh, pls).expand(3, 3)
        with pytest.raises(sbp.SbpError, match="share memory"):
            x[[1]] = x[[1]] + 1
        y = sbp.distribute(torch.arange(6.0).view(1, 6), mesh, pls) + 2
        with pytest.raises(sbp.SbpError, match="share memory"):   # written through the diagonal into the expand
            y.expand(3, 6).diagonal().fill_(5)
        return True

    assert all(sbp.testing.spmd(fn, (2,)))
