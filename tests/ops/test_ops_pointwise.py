"""Pointwise rules: random placements (Split, Broadcast, Partial) on 1-D and 2x2 meshes, even and uneven
shapes, broadcasting, scalars and plain tensors; forward values and input gradients match torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import sbp
import sbp.testing
from sbp import Partial
from tests.support.ops_kit import check_op, make_global, meshes, placements_for, randn, shape

SETTINGS = settings(max_examples=15, deadline=None)

# name -> (fn, number of tensor inputs, Partial kinds worth drawing, broadcasting allowed)
BINARY = {
    "add": (lambda a, b: a + b, ("sum",)),
    "sub_alpha": (lambda a, b: torch.sub(a, b, alpha=0.5), ("sum",)),
    "mul": (lambda a, b: a * b, ("sum",)),
    "div": (lambda a, b: a / (b.abs() + 1), ("sum",)),
    "maximum": (torch.maximum, ("max", "min")),
    "where": (lambda a, b: torch.where(a > 0, a, b), ("sum",)),
    "lerp": (lambda a, b: torch.lerp(a, b, 0.3), ("sum",)),
    "atan2": (torch.atan2, ("sum",)),
}
UNARY = {
    "neg": (lambda x: -x, ("sum", "max", "min")),
    "exp": (torch.exp, ("max", "min", "sum")),
    "relu": (torch.relu, ("max", "sum")),
    "gelu": (F.gelu, ("sum",)),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), ("sum",)),
    "silu": (F.silu, ("sum",)),
    "tanh": (torch.tanh, ("max", "sum")),
    "sigmoid": (torch.sigmoid, ("min", "sum")),
    "clamp": (lambda x: x.clamp(-0.5, 0.5), ("max",)),
    "scalar_affine": (lambda x: x * 2.5 + 1, ("sum",)),
    "scalar_mul_div": (lambda x: (x * 3) / 4, ("sum",)),
    "pow": (lambda x: x ** 2, ("sum",)),
    "rsqrt": (lambda x: torch.rsqrt(x * x + 1), ("sum",)),
    "to_float32_and_back": (lambda x: x.to(torch.float32).to(torch.float64), ("sum", "max")),
    "clone": (torch.clone, ("sum", "max", "min")),
    "masked_fill": (lambda x: x.masked_fill(x > 0.5, 0.0), ("sum",)),
    "masked_fill_neginf": (lambda x: x.masked_fill(x > 0.5, float("-inf")).exp(), ("sum",)),
    "activations": (lambda x: F.elu(x) + F.leaky_relu(x, 0.1) + F.hardtanh(x) + F.softplus(x) + F.mish(x)
                    + F.hardswish(x) + F.hardsigmoid(x) + F.logsigmoid(x) + F.softshrink(x) + F.hardshrink(x),
                    ("sum",)),
}


@st.composite
def broadcast_pair(draw, mesh_ndim: int, partial):
    full = shape(draw, draw(st.integers(1, 3)))
    other = list(full[draw(st.integers(0, len(full) - 1)):])
    for k in range(len(other)):
        if draw(st.booleans()) and draw(st.booleans()):
            other[k] = 1
    shapes = [full, tuple(other)]
    if draw(st.booleans()):
        shapes.reverse()
    pls = [draw(placements_for(len(s), mesh_ndim, partial)) for s in shapes]
    return shapes, pls


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BINARY))
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_binary(name, data, mesh):
    fn, partial = BINARY[name]
    shapes, pls = data.draw(broadcast_pair(len(mesh), partial))
    check_op(fn, [randn(s, i) for i, s in enumerate(shapes)], pls, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(UNARY))
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_unary(name, data, mesh):
    fn, partial = UNARY[name]
    s = shape(data.draw, data.draw(st.integers(0, 3)))
    pls = data.draw(placements_for(len(s), len(mesh), partial))
    check_op(fn, [randn(s)], [pls], mesh)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_ternary_addcmul_addcdiv_where(data, mesh):
    s = shape(data.draw, 2)
    pls = [data.draw(placements_for(2, len(mesh))) for _ in range(3)]
    fulls = [randn(s, i) for i in range(3)]
    check_op(lambda a, b, c: torch.addcmul(a, b, c, value=0.5), fulls, pls, mesh)
    check_op(lambda a, b, c: torch.addcdiv(a, b, c.abs() + 1, value=-2), fulls, pls, mesh)
    check_op(lambda a, b, c: torch.where(c > 0, a, b), fulls, pls, mesh)


@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_comparisons_and_bool_outputs(data, mesh):
    s = shape(data.draw, 2)
    pls = [data.draw(placements_for(2, len(mesh))) for _ in range(2)]
    fulls = [randn(s, 0), randn(s, 1)]
    check_op(lambda a, b: (a < b, a == a, ~(a > 0), a.isnan()), fulls, pls, mesh)


@pytest.mark.slow
@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_in_place_ops_write_back_into_their_layout(data, mesh):
    s = shape(data.draw, 2)
    pls = [data.draw(placements_for(2, len(mesh))) for _ in range(3)]
    fulls = [randn(s, i) for i in range(3)]

    def fn(a, b, c):
        a = a.clone()
        a.mul_(0.5).add_(b, alpha=2).addcmul_(b, c, value=0.1).lerp_(c, 0.25)
        a.addcdiv_(b, c.abs() + 1, value=-1)
        return a

    check_op(fn, fulls, pls, mesh)


@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_plain_tensors_and_scalars_are_broadcast(data, mesh):
    s = shape(data.draw, 2)
    pls = [data.draw(placements_for(2, len(mesh))), None]
    fulls = [randn(s, 0), randn(s[1:], 1)]
    # the plain tensor (input 1) stays plain: its gradient is a plain full tensor
    check_op(lambda a, b: (a * b + b) * 2 - 1, fulls, pls, mesh, plain=(1,))


@SETTINGS
@given(data=st.data(), mesh=meshes)
def test_integer_and_bool_tensors(data, mesh):
    s = shape(data.draw, 2)
    pls = [data.draw(placements_for(2, len(mesh))) for _ in range(2)]
    fulls = [torch.arange(int(torch.tensor(s).prod())).view(s) - 3, torch.ones(s, dtype=torch.int64)]
    check_op(lambda a, b: (a + b * 3, a // 2, (a > 0) & (b > 0)), fulls, pls, mesh, backward=False)


@pytest.mark.parametrize("fn", [lambda x: x / 0.0, lambda x: x * float("inf"), lambda x: x * float("nan"),
                                lambda x: x / 0, lambda x: x.add(x, alpha=float("inf")), lambda x: x * -0.0],
                         ids=["div0.0", "mul_inf", "mul_nan", "div0", "add_alpha_inf", "mul_neg0"])
def test_partial_sum_is_reduced_before_non_finite_scalars(fn):
    """P(sum) parts of mixed signs: (a1 + a2) / 0 is +-inf, but a1/0 + a2/0 would be inf - inf = nan."""
    full = torch.tensor([[1.0, -2.0, 0.0], [3.0, 0.5, -1.0]], dtype=torch.float64)

    def rank(mesh):
        x = make_global(full, mesh, ("P(sum)",), seed=3)   # random zero-sum noise: parts of both signs
        with sbp.strict():
            return fn(x).full(), fn(x).full()   # the second call takes the cached decision

    want = fn(full)
    for first, second in sbp.testing.spmd(rank, (2,)):
        torch.testing.assert_close(first, want, rtol=0, atol=1e-12, equal_nan=True)
        torch.testing.assert_close(second, want, rtol=0, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("cast", [torch.int8, torch.uint8, torch.int16, torch.float32, torch.int64],
                         ids=str)
def test_partial_max_min_through_integer_casts(op, cast):
    """A cast that wraps (narrower, or signed <-> unsigned) is not monotone: the Partial is reduced first;
    widening and float casts keep it."""
    full = torch.tensor([[200, -1, 7], [100, 5, -300]], dtype=torch.int64)

    def rank(mesh):
        x = sbp.distribute(full, mesh, "S(0)")
        part = x.amax(0) if op == "max" else x.amin(0)
        with sbp.strict():
            y = part.to(cast)
        return y.placements, y.full()

    reduced = full.amax(0) if op == "max" else full.amin(0)
    for placements, got in sbp.testing.spmd(rank, (2,)):
        assert torch.equal(got, reduced.to(cast))
        wraps = cast in (torch.int8, torch.uint8, torch.int16)
        assert (placements == (Partial(op),)) == (not wraps)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float32], ids=str)
def test_neg_of_partial_max(dtype):
    """neg maps P(max) to P(min) on floats; on integers it wraps (-0 of uint8 is 0, -(-128) of int8 is -128)."""
    full = torch.tensor([[0, 0, -128], [5, 3, 1]]).to(dtype)

    def rank(mesh):
        m = sbp.distribute(full, mesh, "S(0)").amax(0)
        with sbp.strict():
            return (-m).full()

    for got in sbp.testing.spmd(rank, (2,)):
        assert torch.equal(got, -full.amax(0))


@pytest.mark.parametrize("pls", [("S(0)",), ("S(1)",), ("B",), ("P(sum)",)])
def test_conjugate_views_and_complex_views(pls):
    """``x.conj()`` is a lazy view in torch (a bit on the result); on a global tensor the local is
    conjugated at once, so later ops (sum, exp, .imag) see the conjugate, as on one device."""
    full = torch.complex(randn((5, 3)), randn((5, 3), 1)).to(torch.complex128)
    check_op(lambda x: (x.conj().sum(0), x.conj().exp(), x.conj().imag, torch.view_as_real(x.conj().resolve_conj()),
                        torch.view_as_complex(torch.view_as_real(x) * 2)), [full], [pls], (4,))


@pytest.mark.parametrize("cast", [torch.int64, torch.int32, torch.int16, torch.int8], ids=str)
def test_partial_max_min_cast_from_float_to_integer_is_reduced_first(cast):
    """float -> int is not monotone at +-inf, the identity an empty shard holds (+inf -> INT64_MIN,
    -inf -> 0 in int8): the Partial is reduced first. float64 -> float32 is monotone and keeps it."""
    value = torch.tensor([-3.5, 2.0, -7.25], dtype=torch.float64)

    def rank(mesh):
        out = []
        for op, identity in (("max", float("-inf")), ("min", float("inf"))):
            part = value if mesh.rank == 0 else torch.full((3,), identity, dtype=torch.float64)
            x = sbp.from_local(part, mesh, f"P({op})", global_shape=(3,))
            mesh.binding.counters.reset()
            kept = x.float()
            moved = mesh.binding.counters.received
            with sbp.strict():
                out.append((op, x.to(cast).full(), kept.placements, moved))
        return out

    for out in sbp.testing.spmd(rank, (2,)):
        for op, got, kept, moved in out:
            assert torch.equal(got, value.to(cast)), (op, got)
            assert kept == (Partial(op),) and moved == 0


def test_integer_partial_sum_in_a_floating_result_is_reduced_first():
    """An int64 P(sum) times a float is floating: int64 parts 2**60 + 1 and -2**60 converted one by one lose
    the 1 (float32 and float64 alike), so the Partial is reduced first. Exact conversions keep it: int64
    times an int, and a Broadcast integer mixed into a float P(sum) (its value sits whole in one part)."""
    big = 2 ** 60
    value = torch.tensor([1, 3])
    f64 = torch.tensor(0.5, dtype=torch.float64)
    cases = {"mul_float": lambda x: x * 0.5, "div_int": lambda x: x / 2, "mul_f64_tensor": lambda x: x * f64,
             "add_f64": lambda x: x + torch.zeros(2, dtype=torch.float64), "where": lambda x: torch.where(
                 torch.tensor([True, False]), x, torch.tensor([0.25, 0.5], dtype=torch.float64))}

    def rank(mesh):
        parts = torch.tensor([big + 1, big + 3]) if mesh.rank == 0 else torch.tensor([-big, -big])
        x = sbp.from_local(parts, mesh, "P(sum)", global_shape=(2,))
        y = sbp.from_local(parts.to(torch.float64) / big, mesh, "P(sum)", global_shape=(2,))
        mesh.binding.counters.reset()
        kept = [x * 2, torch.where(torch.tensor([True, False]), y, torch.tensor(7)), y + torch.tensor([big, 1])]
        moved = mesh.binding.counters.received
        with sbp.strict():
            got = {name: f(x).full() for name, f in cases.items()}
        return got, [k.placements for k in kept], moved

    for got, kept, moved in sbp.testing.spmd(rank, (2,)):
        for name, f in cases.items():
            assert torch.equal(got[name], f(value)), (name, got[name])
        assert kept == [(Partial("sum"),)] * 3 and moved == 0
