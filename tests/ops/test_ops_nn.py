"""NN rules: layer norm, RMS norm, embedding (incl. vocab-parallel), NLL / cross-entropy (batch-split mean
over uneven shards is exact); values and gradients match torch."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import sbp
import sbp.testing
from sbp import Partial, S
from tests.support.ops_kit import check_op, make_global, meshes, placements_for, randn, shape

SETTINGS = settings(max_examples=15, deadline=None)
aten = torch.ops.aten


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_layer_norm(data, mesh):
    b, t, c = shape(data.draw, 3, 1, 5)
    affine = data.draw(st.booleans())
    fulls = [randn((b, t, c))] + ([randn((c,), 1), randn((c,), 2)] if affine else [])
    pls = [data.draw(placements_for(f.ndim, len(mesh))) for f in fulls]
    check_op(lambda x, *wb: F.layer_norm(x, (c,), *wb), fulls, pls, mesh)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_layer_norm_over_two_dims(data, mesh):
    b, t, c = shape(data.draw, 3, 1, 4)
    fulls = [randn((b, t, c)), randn((t, c), 1)]
    pls = [data.draw(placements_for(f.ndim, len(mesh))) for f in fulls]
    check_op(lambda x, w: F.layer_norm(x, (t, c), w), fulls, pls, mesh)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_rms_norm(data, mesh):
    b, t, c = shape(data.draw, 3, 1, 5)
    fulls = [randn((b, t, c)), randn((c,), 1)]
    pls = [data.draw(placements_for(f.ndim, len(mesh))) for f in fulls]
    check_op(lambda x, w: F.rms_norm(x, (c,), w, eps=1e-6), fulls, pls, mesh)
    # the fused ATen op (forward; its backward kernel is CUDA-only in torch 2.13)
    check_op(lambda x, w: aten._fused_rms_norm(x, [c], w, 1e-6), fulls, pls, mesh, backward=False)


@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_embedding(data, mesh):
    vocab, dim = shape(data.draw, 2, 1, 7)
    idx_shape = shape(data.draw, data.draw(st.integers(1, 2)), 1, 5)
    g = torch.Generator().manual_seed(vocab * 10 + dim)
    indices = torch.randint(0, vocab, idx_shape, generator=g)
    padding = data.draw(st.sampled_from([None, 0, vocab - 1]))
    pls = [data.draw(placements_for(2, len(mesh))), data.draw(placements_for(len(idx_shape), len(mesh), ()))]
    check_op(lambda w, i: F.embedding(i, w, padding_idx=padding), [randn((vocab, dim)), indices], pls, mesh)


def test_vocab_parallel_embedding_is_local_and_partial():
    """weight S(0) over 4 ranks with 6 rows (2,2,1,1): masked lookups give P(sum), no communication."""
    w, idx = randn((6, 3)), torch.tensor([[0, 5, 2], [3, 3, 1]])

    def fn(mesh):
        with sbp.strict():
            weight = make_global(w, mesh, (S(0),), requires_grad=True)
            mesh.binding.counters.reset()
            out = F.embedding(idx, weight)
            moved = mesh.binding.counters.received
            out.full().sum().backward()
        return out.placements, moved, out.full(), weight.grad.placements, weight.grad.full()

    ref = torch.zeros(6, 3).double().index_add_(0, idx.flatten(), torch.ones(6, 3).double())
    for pls, moved, out, gpls, grad in sbp.testing.spmd(fn, (4,)):
        assert pls == (Partial("sum"),) and moved == 0 and torch.equal(out, w[idx])
        assert gpls == (S(0),) and torch.equal(grad, ref)


@st.composite
def loss_case(draw, mesh_ndim: int):
    n, c = shape(draw, 2, 1, 6)
    g = torch.Generator().manual_seed(n * 10 + c)
    target = torch.randint(0, c, (n,), generator=g)
    if draw(st.booleans()):
        target[0] = -100                          # an ignored row
    weight = randn((c,), 3).abs() + 0.5 if draw(st.booleans()) else None
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    pls = [draw(placements_for(2, mesh_ndim)), draw(placements_for(1, mesh_ndim, ()))]
    return randn((n, c)), target, weight, reduction, pls


@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_cross_entropy(data, mesh):
    logits, target, weight, reduction, pls = data.draw(loss_case(len(mesh)))
    check_op(lambda x, t: F.cross_entropy(x, t, weight=weight, reduction=reduction), [logits, target], pls, mesh)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_nll_loss_and_label_smoothing(data, mesh):
    logits, target, weight, reduction, pls = data.draw(loss_case(len(mesh)))
    target = target.clamp(min=0)
    check_op(lambda x, t: F.nll_loss(F.log_softmax(x, -1), t, weight=weight, reduction=reduction),
             [logits, target], pls, mesh)
    check_op(lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), [logits, target], pls, mesh)


def test_batch_split_mean_loss_is_one_all_reduce_read_or_not():
    # the local sum and the total weight travel together: one all_reduce on a 1-D mesh (it was one for the
    # weight, then one more for the P(sum) loss when read), and reading the Broadcast loss moves nothing
    logits, target = randn((8, 4)), torch.arange(8) % 4

    def fn(mesh):
        x, t = make_global(logits, mesh, (S(0),)), make_global(target, mesh, (S(0),))
        calls = mesh.binding.counters.calls
        before = len(calls)
        loss = F.cross_entropy(x, t)
        made = len(calls)
        value = loss.full()
        return [c.collective for c in calls[before:made]], len(calls) - made, value

    for made, read, value in sbp.testing.spmd(fn, (4,)):
        assert made == ["all_reduce"] and read == 0
        assert torch.allclose(value, F.cross_entropy(logits, target), atol=1e-12)


@pytest.mark.parametrize("n", [3, 5, 7])
def test_batch_split_cross_entropy_mean_is_exact_on_uneven_shards(n):
    logits, target = randn((n, 4)), torch.arange(n) % 4

    def fn(mesh):
        with sbp.strict():
            x = make_global(logits, mesh, (S(0), S(0)))
            t = make_global(target, mesh, (S(0), S(0)))
            loss = F.cross_entropy(x, t)
            return loss.placements, loss.full()

    for pls, loss in sbp.testing.spmd(fn, (2, 2)):
        assert pls == (sbp.B, sbp.B)   # both sums reduced in one all_reduce: the loss comes out whole
        assert torch.allclose(loss, F.cross_entropy(logits, target), atol=1e-12)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_scaled_dot_product_attention(data, mesh):
    b, h, t, d = shape(data.draw, 4, 1, 4)
    causal = data.draw(st.booleans())
    fulls = [randn((b, h, t, d), i) for i in range(3)]
    pls = [data.draw(placements_for(4, len(mesh))) for _ in range(3)]
    check_op(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), fulls, pls, mesh)


def test_head_parallel_attention_stays_local():
    q = randn((2, 4, 5, 3))

    def fn(mesh):
        with sbp.strict():
            x = make_global(q, mesh, (S(1),), requires_grad=True)
            mesh.binding.counters.reset()
            out = F.scaled_dot_product_attention(x, x, x, is_causal=True)
            (out * out).sum().backward()
            return out.placements, x.grad.placements, mesh.binding.counters.received

    for pls, gpls, moved in sbp.testing.spmd(fn, (2,)):
        assert pls == gpls == (S(1),)
        assert moved <= 16   # only the scalar loss is reduced


@pytest.mark.parametrize("mesh, kv", [((2,), 2), ((4,), 4), ((2, 2), 4)], ids=str)
def test_grouped_query_attention_splits_the_heads_with_no_collective(mesh, kv):
    """sdpa with 8 query heads over `kv` kv heads (enable_gqa), heads split on every tp axis: each rank's query
    heads are the groups of its kv heads, so forward and backward run locally; values and grads exact."""
    q, k, v = randn((2, 8, 5, 3), 0), randn((2, kv, 5, 3), 1), randn((2, kv, 5, 3), 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    heads = tuple(S(1) for _ in mesh)

    def fn(mesh_):
        with sbp.strict():
            xs = [make_global(t, mesh_, heads, requires_grad=True) for t in (q, k, v)]
            mesh_.binding.counters.reset()
            out = F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=True)
            out.backward(torch.ones_like(out))
            calls = len(mesh_.binding.counters.calls)
            return out.placements, [x.grad.placements for x in xs], calls, (out.full() - ref).abs().max().item()

    check_op(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
             [q, k, v], [heads] * 3, mesh)
    for pls, gpls, calls, diff in sbp.testing.spmd(fn, mesh):
        assert pls == heads and gpls == [heads] * 3 and calls == 0 and diff < 1e-12


def test_grouped_query_attention_with_fewer_kv_heads_than_ranks_is_exact():
    """One kv head on 2 ranks: the heads cannot split alike (rank 1 has no kv head), so the rule refuses the
    head split and the planner lays the inputs out otherwise: still exact."""
    q, k, v = randn((2, 4, 5, 3), 0), randn((2, 1, 5, 3), 1), randn((2, 1, 5, 3), 2)
    check_op(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
             [q, k, v], [(S(1),)] * 3, (2,))


# name -> loss(x, t, w, reduction) of any x and t of one shape and w of x's last dim (a broadcast weight)
LOSSES = {
    "mse": lambda x, t, w, r: F.mse_loss(x, t, reduction=r),
    "huber": lambda x, t, w, r: F.huber_loss(x, t, reduction=r, delta=0.7),
    "smooth_l1": lambda x, t, w, r: F.smooth_l1_loss(x, t, reduction=r, beta=0.7),
    "bce": lambda x, t, w, r: F.binary_cross_entropy(x.sigmoid(), t.sigmoid(), weight=w, reduction=r),
    "bce_with_logits": lambda x, t, w, r: F.binary_cross_entropy_with_logits(x, t.sigmoid(), weight=w, pos_weight=w,
                                                                              reduction=r),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOSSES))
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_elementwise_loss(name, data, mesh):
    # strict: smooth_l1, huber and the binary cross-entropies had no rule (the fallback gathered both inputs)
    s = shape(data.draw, data.draw(st.integers(1, 3)), 1, 5)
    reduction = data.draw(st.sampled_from(["mean", "sum", "none"]))
    pls = [data.draw(placements_for(len(s), len(mesh))) for _ in range(2)] + \
        [data.draw(placements_for(1, len(mesh), ()))]
    fulls = [randn(s, 0), randn(s, 1), randn(s[-1:], 2)]
    check_op(lambda x, t, w: LOSSES[name](x, t, w.abs().detach(), reduction), fulls, pls, mesh)


@pytest.mark.parametrize("loss", [F.mse_loss, F.huber_loss, F.smooth_l1_loss], ids=lambda f: f.__name__)
@pytest.mark.parametrize("pls", ["S(0)", "S(1)", "B"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_pointwise_losses_of_empty_tensors_differentiate(loss, pls, reduction):
    # torch's meta kernels of their backwards divide by the element count (2 / numel): sbp took their output
    # shapes from there and raised ZeroDivisionError; the gradient is empty, as torch's
    check_op(lambda x, t: loss(x, t, reduction=reduction), [randn((0, 5), 0), randn((0, 5), 1)], [pls, pls], (4,))


@pytest.mark.parametrize("vocab, mesh", [(10, (2,)), (10, (4,)), (3, (4,))])
@pytest.mark.parametrize("bad", [12, -1, 10])
def test_vocab_parallel_embedding_refuses_indices_outside_the_vocabulary(vocab, mesh, bad):
    """Masking another rank's rows must not turn an index outside the whole vocabulary into a row of zeros:
    it raises, as the lookup on one device does (also on a rank whose vocabulary shard is empty)."""
    weight = randn((vocab, 4))
    ids = torch.tensor([1, bad, 0])
    with pytest.raises(IndexError):
        F.embedding(ids, weight)

    def rank(mesh_):
        w = sbp.distribute(weight, mesh_, "S(0)")
        try:
            F.embedding(ids, w)
        except IndexError as e:
            return str(e)
        return None

    for message in sbp.testing.spmd(rank, mesh):
        assert message is not None and "out of range" in message
    ok = torch.tensor([1, vocab - 1, 0])
    check_op(lambda w: F.embedding(ok, w), [weight], [("S(0)",) * len(mesh)], mesh)


@pytest.mark.parametrize("how", ["causal", "mask"])
def test_attention_over_heads_cut_between_ranks(how):
    # before: 24 features split 12 | 12 over 3 heads of 8 cut a head in two; the view to heads laid q out anew
    # with a non-contiguous last dim (local strides (5, 80, 1, 10)), while the global tensor reported contiguous
    # strides, so torch chose the CPU flash kernel, which misread the local: outputs off by 2.5 (Llama's
    # logits by 0.13 with attn_implementation="sdpa" on tp=2)
    x = torch.linspace(-1, 1, 2 * 5 * 24, dtype=torch.float64).reshape(2, 5, 24).sin()
    mask = torch.ones(5, 5, dtype=torch.bool).tril()

    def attend(t):
        q = t.view(2, 5, 3, 8).transpose(1, 2)
        kv = (t * 0.5).view(2, 5, 3, 8).transpose(1, 2)
        if how == "causal":
            return F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
        return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)

    want = attend(x)

    def fn(mesh):
        return attend(sbp.distribute(x, mesh, "S(2)")).full()

    for got in sbp.testing.spmd(fn, (2,)):
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


def _batch_norm_with_global_running_stats(mesh, pls):
    """Training-mode batch norm whose running stats are global tensors: (output, input grad, running stats)."""
    x0 = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x = sbp.distribute(x0, mesh, pls, requires_grad=True)
    w = sbp.distribute(torch.linspace(1, 2, 4, dtype=torch.float64), mesh, "B", requires_grad=True)
    mean, var = (sbp.distribute(t, mesh, "B") for t in (torch.zeros(4, dtype=torch.float64),
                                                      torch.ones(4, dtype=torch.float64)))
    y = NATIVE_BATCH_NORM(x, w, None, mean, var, True, 0.5, 1e-5)[0]   # saves the running stats it writes
    (y.full() ** 2).sum().backward()
    return y.full(), x.grad.full(), w.grad.full(), mean.full(), var.full()


NATIVE_BATCH_NORM = torch.ops.aten._native_batch_norm_legit.default


@pytest.mark.parametrize("pls", ["B", "S(0)", "S(1)"])
def test_batch_norm_training_with_global_running_stats_differentiates(pls):
    # guards the writes torch does not count (batch norm's running stats): sbp drops a kept reduction there
    # and must not bump the version counters (autograd then refused the backward: "modified by an inplace
    # operation", seen while fused optimizers' writes were being counted)
    x0 = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    w0 = torch.linspace(1, 2, 4, dtype=torch.float64).requires_grad_()
    mean, var = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    y = NATIVE_BATCH_NORM(x0, w0, None, mean, var, True, 0.5, 1e-5)[0]
    (y ** 2).sum().backward()
    for got in sbp.testing.spmd(functools.partial(_batch_norm_with_global_running_stats, pls=pls), (2,)):
        for g, want in zip(got, (y.detach(), x0.grad, w0.grad, mean, var)):
            torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)


# name -> (fn(x, w, b), input shape, weight shape, bias shape or None)
CONVOLUTIONS = {
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), (5, 3, 6, 6), (4, 3, 3, 3), (4,)),
    "conv2d_strided_no_bias": (lambda x, w, b: F.conv2d(x, w, stride=2), (5, 3, 7, 7), (4, 3, 3, 3), None),
    "conv1d_groups": (lambda x, w, b: F.conv1d(x, w, b, groups=2, padding=2, dilation=2), (5, 4, 9), (6, 2, 3), (6,)),
    "conv_transpose2d": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), (5, 3, 4, 4), (3, 2, 3, 3), (2,)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVOLUTIONS))
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_convolution(name, data, mesh):
    # strict: aten.convolution and its backward had no rule (the fallback gathered the whole batch)
    fn, xs, ws, bs = CONVOLUTIONS[name]
    fulls = [randn(xs, 0), randn(ws, 1)] + ([randn(bs, 2)] if bs else [])
    pls = [data.draw(placements_for(len(f.shape), len(mesh))) for f in fulls]
    check_op(lambda x, w, b=None: fn(x, w, b), fulls, pls, mesh)


POOLS = {
    "max_pool2d": lambda x: F.max_pool2d(x, 2, ceil_mode=True),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 3, stride=2, padding=1),
    "max_pool3d": lambda x: F.max_pool3d(x.unsqueeze(2).expand(-1, -1, 3, -1, -1), 2),
    "avg_pool3d": lambda x: F.avg_pool3d(x.unsqueeze(2).expand(-1, -1, 3, -1, -1), 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(POOLS))
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_pooling(name, data, mesh):
    s = (data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4)), 5, 6)
    check_op(POOLS[name], [randn(s)], [data.draw(placements_for(4, len(mesh)))], mesh)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_group_norm(data, mesh):
    # strict: native_group_norm and its backward had no rule; the batch-size argument is each rank's rows
    s = (data.draw(st.integers(1, 5)), 4, 3, data.draw(st.integers(1, 4)))
    fulls = [randn(s, 0), randn((4,), 1), randn((4,), 2)]
    pls = [data.draw(placements_for(len(f.shape), len(mesh))) for f in fulls]
    check_op(lambda x, w, b: F.group_norm(x, 2, w, b), fulls, pls, mesh)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_glu(data, mesh):
    s = shape(data.draw, 3, 1, 5)[:2] + (4,)
    dim = data.draw(st.sampled_from([-1, 2]))
    check_op(lambda x: F.glu(x, dim), [randn(s)], [data.draw(placements_for(3, len(mesh)))], mesh)
