"""Matmul family rules (mm, addmm, bmm, baddbmm, matmul paths, dot, mv): random placements on 1-D and 2x2
meshes with uneven shapes; values and gradients match torch; the textbook signatures need no communication."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import sbp
import sbp.testing
from sbp import B, Partial, S
from sbp.ops.matmul import SplitBatchMatmul, split_batch_first
from tests.support.ops_kit import check_op, make_global, meshes, placements_for, randn, shape

SETTINGS = settings(max_examples=15, deadline=None)


@st.composite
def case(draw, kind: str, mesh_ndim: int):
    b, m, k, n = shape(draw, 4, 1, 5)
    shapes = {
        "mm": [(m, k), (k, n)],
        "linear_bias": [(b, m, k), (n, k), (n,)],
        "addmm": [(m, n), (m, k), (k, n)],
        "bmm": [(b, m, k), (b, k, n)],
        "baddbmm": [(b, 1, n), (b, m, k), (b, k, n)],
        "matmul_3d_2d": [(b, m, k), (k, n)],
        "matmul_2d_3d": [(m, k), (b, k, n)],
        "dot": [(k,), (k,)],
        "mv": [(m, k), (k,)],
    }[kind]
    return shapes, [draw(placements_for(len(s), mesh_ndim)) for s in shapes]


FNS = {
    "mm": torch.mm,
    "linear_bias": F.linear,
    "addmm": lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
    "bmm": torch.bmm,
    "baddbmm": lambda c, a, b: torch.baddbmm(c, a, b, beta=-1.0),
    "matmul_3d_2d": torch.matmul,
    "matmul_2d_3d": torch.matmul,
    "dot": torch.dot,
    "mv": torch.mv,
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(FNS))
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_matmul_family(kind, data, mesh):
    shapes, pls = data.draw(case(kind, len(mesh)))
    check_op(FNS[kind], [randn(s, i) for i, s in enumerate(shapes)], pls, mesh)


@pytest.mark.parametrize("a_pl, b_pl, out_pl", [
    (S(0), B, S(0)),
    (B, S(1), S(1)),
    (S(1), S(0), Partial("sum")),
    (Partial("sum"), B, Partial("sum")),
    (B, Partial("sum"), Partial("sum")),
])
def test_mm_signatures_need_no_communication(a_pl, b_pl, out_pl):
    """The OneFlow/DTensor signatures run locally: no bytes move and the output has the table's placement."""
    a, b = randn((7, 5)), randn((5, 3), 1)

    def fn(mesh):
        x, w = make_global(a, mesh, (a_pl,)), make_global(b, mesh, (b_pl,))
        mesh.binding.counters.reset()
        y = x @ w
        moved = mesh.binding.counters.received
        return y.placements, moved, y.full()

    for pls, moved, full in sbp.testing.spmd(fn, (3,)):
        assert pls == (out_pl,) and moved == 0
        assert torch.allclose(full, a @ b, atol=1e-12)


def test_mm_picks_cheapest_redistribution_not_replication():
    """x S(0) @ w S(0): replicating w (all_gather of 8x4) is cheaper than moving x; x is never gathered."""
    a, b = randn((64, 8)), randn((8, 4), 1)

    def fn(mesh):
        x, w = make_global(a, mesh, (S(0),)), make_global(b, mesh, (S(0),))
        mesh.binding.counters.reset()
        y = x @ w
        return y.placements, mesh.binding.counters.received

    for pls, moved in sbp.testing.spmd(fn, (4,)):
        assert pls == (S(0),)
        assert moved == 6 * 4 * 8   # 3 of 4 shards of w (2x4 float64 each): exactly w's all_gather


def test_column_then_row_parallel_linear_is_one_partial_sum():
    """Megatron MLP: x B -> colwise (w1 S(0)) -> S(-1) -> rowwise (w2 S(1)) -> P(sum)."""
    x, w1, w2 = randn((6, 4)), randn((10, 4), 1), randn((4, 10), 2)

    def fn(mesh):
        xg = make_global(x, mesh, (B,))
        h = F.linear(xg, make_global(w1, mesh, (S(0),)))
        y = F.linear(h, make_global(w2, mesh, (S(1),)))
        return h.placements, y.placements, y.full()

    for hp, yp, full in sbp.testing.spmd(fn, (3,)):
        assert hp == (S(1),) and yp == (Partial("sum"),)
        assert torch.allclose(full, x @ w1.T @ w2.T, atol=1e-12)


def _attention_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.matmul(torch.matmul(q, k.transpose(2, 3)).softmax(-1), v)   # eager attention's two matmuls


@pytest.mark.parametrize("mesh, heads", [((2,), 4), ((4,), 8), ((4,), 6), ((2, 2), 4)], ids=str)
def test_split_batch_matmul_keeps_the_head_split(mesh, heads):
    """4-d matmuls on heads split S(1) on every axis (torch merges batch and heads before bmm): under
    SplitBatchMatmul values and gradients are exact, and with heads that divide evenly no collective runs
    (6 heads on 4 ranks split 2,2,1,1: exact, the planner moves what the merge needs)."""
    fulls = [randn((3, heads, 5, 2), i) for i in range(3)]
    pls = [tuple(S(1) for _ in mesh)] * 3
    with SplitBatchMatmul():
        assert check_op(_attention_scores, fulls, pls, mesh)

    def fn(mesh_):
        xs = [make_global(f, mesh_, p, requires_grad=True) for f, p in zip(fulls, pls)]
        mesh_.binding.counters.reset()
        with SplitBatchMatmul():
            out = _attention_scores(*xs)
        out.backward(torch.ones_like(out))
        return out.placements, len(mesh_.binding.counters.calls)

    even = heads % (2 if mesh == (2,) else 4) == 0
    for out_pls, calls in sbp.testing.spmd(fn, mesh):
        assert (calls == 0) == even and (out_pls == pls[0] or not even), (out_pls, calls)


@pytest.mark.parametrize("mesh, q, k, v", [
    ((2, 2), "S(0), S(1)", "S(0), S(1)", "S(0), S(1)"),           # batch on dp, heads on tp
    ((2, 2, 2), "S(0), S(1), S(2)", "S(0), S(1), B", "S(0), S(1), B"),   # and q's tokens on a third axis
    ((2, 2, 2), "S(0), S(1), B", "S(0), S(1), S(2)", "S(0), S(1), B"),   # k's tokens: the scores' columns
], ids=str)
def test_matmul_with_several_split_batch_dims_computes_on_the_local_blocks(mesh, q, k, v):
    """Batch and heads split on different axes (a dp x tp mesh): no batch order keeps both splits through
    torch's merge of the batch dims, so SplitBatchMatmul computes such a matmul on the local blocks (a row or
    column split of one operand beside them). Values and gradients exact (batch 3: uneven), and the first
    matmul runs no collective (before: all_to_alls and row moves of the operands, then of the gradients)."""
    fulls = [randn((3, 4, 6, 2), i) for i in range(3)]
    pls = [sbp.placements(p) for p in (q, k, v)]
    with SplitBatchMatmul():
        assert check_op(_attention_scores, fulls, pls, mesh)

    def fn(mesh_):
        xs = [make_global(f, mesh_, p) for f, p in zip(fulls, pls)]
        mesh_.binding.counters.reset()
        with SplitBatchMatmul():
            scores = torch.matmul(xs[0], xs[1].transpose(2, 3))
        return scores.placements, len(mesh_.binding.counters.calls)

    want = sbp.placements(q if k == v else "S(0), S(1), S(3)")
    assert sbp.testing.spmd(fn, mesh) == [(want, 0)] * len(sbp.testing.spmd(lambda m: 0, mesh))


def test_split_batch_matmul_leaves_other_calls_alone():
    """Plain tensors, broadcast batch dims and already-leading splits take torch's own path."""

    def fn(mesh):
        x = sbp.distribute(randn((2, 4, 3, 3)), mesh, "S(0)")
        y = sbp.distribute(randn((4, 3, 3)), mesh, "S(0)")
        return split_batch_first(x, x), split_batch_first(x, y), split_batch_first(x.full(), x.full())
    for got in sbp.testing.spmd(fn, (2,)):
        assert got == (None, None, None)
    a, b = randn((2, 3, 4, 5)), randn((5, 2))
    with SplitBatchMatmul():
        assert torch.equal(a @ b, torch.matmul(a, b))


def _grouped_mm(mesh):
    a = sbp.distribute(torch.arange(24.0).view(6, 4) / 10, mesh, "B")
    b = sbp.distribute(torch.arange(48.0).view(3, 4, 4) / 10, mesh, "B")
    return torch._grouped_mm(a, b, offs=torch.tensor([2, 4, 6], dtype=torch.int32)).full()


def test_grouped_mm_in_float32_runs_where_the_host_kernel_does():
    # torch's meta kernel of _grouped_mm wants bfloat16 (the CUDA kernel's rule); the CPU kernel takes float32,
    # as transformers' Mixtral experts call it on one device. sbp decided on the meta kernel alone: DTypeError
    want = torch._grouped_mm(torch.arange(24.0).view(6, 4) / 10, torch.arange(48.0).view(3, 4, 4) / 10,
                             offs=torch.tensor([2, 4, 6], dtype=torch.int32))
    for got in sbp.testing.spmd(_grouped_mm, (2,)):
        assert torch.equal(got, want)
