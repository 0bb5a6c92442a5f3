"""Shape-class decisions: a decision made from its class equals a cold decision, over the rule table's families."""
from __future__ import annotations

import math
import random

import torch

import sbp
import sbp.testing
from sbp.ops import decide as decide_mod
from sbp.ops.cache import DECISIONS, SPEC_TOKENS
from sbp.ops.dispatch import class_key, decide_by_class
from sbp.tensor.global_tensor import GlobalTensor
from sbp.values.layout import local_shape
from sbp.values.placement import B, Partial, Split

aten = torch.ops.aten
MESHES = ((2,), (3,), (4,), (2, 2))


def _global(shape: tuple, mesh, placements: tuple, dtype=torch.float32) -> GlobalTensor:
    local = local_shape(shape, mesh, placements, (0,) * mesh.ndim)
    return GlobalTensor(torch.zeros(local, dtype=dtype), mesh, placements, shape)


def _placements(rng: random.Random, ndim: int, naxes: int, partial: bool = True) -> tuple:
    one = [B, B] + [Split(d) for d in range(ndim)] + ([Partial("sum")] if partial else [])
    return tuple(rng.choice(one) for _ in range(naxes))


# each family: (name, number of size symbols, call(values, placement draws) -> (func, args, kwargs))
def _family_calls(rng: random.Random, mesh):
    n = mesh.ndim

    def pls(ndim: int, partial: bool = True) -> tuple:
        return _placements(rng, ndim, n, partial)

    def g(shape, partial=True, dtype=torch.float32):
        return shape, pls(len(shape), partial), dtype

    draws = {}

    def call(name: str, v: list[int]):
        a, b, c = v
        if name not in draws:
            draws[name] = {
            "add": lambda: (g((a, b)), g((b,))),
            "mul_scalar_bcast": lambda: (g((a, 1, c)), g((b, c))),
            "gelu": lambda: (g((a, b, c), partial=False),),
            "mm": lambda: (g((a, b)), g((b, c))),
            "addmm": lambda: (g((c,)), g((a, b)), g((b, c))),
            "bmm": lambda: (g((a, b, c)), g((a, c, b))),
            "sum_dim": lambda: (g((a, b, c)),),
            "mean_keep": lambda: (g((a, b, c)),),
            "view": lambda: (g((a, b, c), partial=False),),
            "transpose": lambda: (g((a, b, c)),),
            "softmax": lambda: (g((a, b, c), partial=False),),
            "embedding_backward": lambda: (g((a, c)), g((a,), partial=False, dtype=torch.long)),
            }[name]()
        specs = draws[name]
        shapes = {
            "add": ((a, b), (b,)), "mul_scalar_bcast": ((a, 1, c), (b, c)), "gelu": ((a, b, c),),
            "mm": ((a, b), (b, c)), "addmm": ((c,), (a, b), (b, c)), "bmm": ((a, b, c), (a, c, b)),
            "sum_dim": ((a, b, c),), "mean_keep": ((a, b, c),), "view": ((a, b, c),),
            "transpose": ((a, b, c),), "softmax": ((a, b, c),), "embedding_backward": ((a, c), (a,)),
        }[name]
        ts = [_global(shape, mesh, p, d) for shape, (_, p, d) in zip(shapes, specs)]
        func, args = {
            "add": (aten.add.Tensor, tuple(ts)),
            "mul_scalar_bcast": (aten.mul.Tensor, tuple(ts)),
            "gelu": (aten.gelu.default, tuple(ts)),
            "mm": (aten.mm.default, tuple(ts)),
            "addmm": (aten.addmm.default, tuple(ts)),
            "bmm": (aten.bmm.default, tuple(ts)),
            "sum_dim": (aten.sum.dim_IntList, (ts[0], [1])),
            "mean_keep": (aten.mean.dim, (ts[0], [-1], True)),
            "view": (aten.view.default, (ts[0], [a * b, c])),
            "transpose": (aten.transpose.int, (ts[0], 0, 2)),
            "softmax": (aten._softmax.default, (ts[0], -1, False)),
            "embedding_backward": (aten.embedding_dense_backward.default, (ts[0], ts[-1], b, -1, False)),
        }[name]
        return func, args, {}, ts

    return call


FAMILIES = ("add", "mul_scalar_bcast", "gelu", "mm", "addmm", "bmm", "sum_dim", "mean_keep", "view", "transpose",
            "softmax", "embedding_backward")


def _values(rng: random.Random, m: int, residues: list[int], order: list[int]) -> list[int]:
    """Three distinct sizes above m with the given remainders mod m, in the given order (one shape class)."""
    while True:
        v = [m * rng.randint(1, 12) + r + (m if r == 0 else 0) for r in residues]
        ranked = sorted(range(3), key=v.__getitem__)
        if len(set(v)) == 3 and ranked == order and v[0] * v[1] > max(v):   # (a * b: the view's size argument)
            return v


def _outputs(d) -> tuple:
    return tuple(None if o is None else (tuple(o.shape), o.dtype) for o in d.spec.outputs)


def _assert_same_decision(d, cold, context) -> None:
    """Every slot of `Decision` equal: the spec (values, input and output metas), the choice, targets, run,
    paths, output shapes, strides and spec tokens (one token object per spec), flags."""
    for name in type(cold).__slots__:
        mine, theirs = getattr(d, name), getattr(cold, name)
        if name == "out_keys":
            assert [k is c for k, c in zip(mine, theirs)] == [True] * len(theirs), (context, name, mine, theirs)
        else:
            assert mine == theirs, (context, name, mine, theirs)


def test_class_decisions_equal_cold_decisions():
    """Per case: a random mesh, family and input placements; two cold decisions of one class (the second
    confirms it), then a third call of the class, from the class, against its cold decision."""
    rng = random.Random(22)
    from_class = {name: 0 for name in FAMILIES}
    for case in range(360):
        name = FAMILIES[case % len(FAMILIES)]
        mesh = sbp.DeviceMesh(rng.choice(MESHES))
        m = math.prod(mesh.shape)
        call = _family_calls(rng, mesh)
        residues, order = [rng.randrange(m) for _ in range(3)], rng.sample(range(3), 3)
        DECISIONS.clear()
        keys, made = [], []
        for _ in range(3):
            func, args, kwargs, leaves = call(name, _values(rng, m, residues, order))
            keys.append(class_key(func, args, kwargs, mesh.shape)[0])
            made.append(decide_by_class(func, args, kwargs, leaves, mesh))
        assert keys[0] == keys[1] == keys[2]
        cold = decide_mod.decide(func, args, kwargs, leaves, mesh)
        d = made[2]
        assert d.choice == cold.choice and _outputs(d) == _outputs(cold), (name, mesh.shape, d.choice, cold.choice)
        _assert_same_decision(d, cold, (name, mesh.shape))
        record = DECISIONS.class_get(keys[0])
        from_class[name] += record.state in ("generic", "priced")
    assert all(count >= 5 for count in from_class.values()), from_class   # every family is shared often


def test_priced_classes_choose_per_call():
    """mm of a row-split x with a column-split w: which input moves depends on the sizes. The class is
    priced: its output sizes come from the class, its choice from pricing each call, as a cold decision."""
    mesh = sbp.DeviceMesh((4,))
    DECISIONS.clear()
    choices = set()
    for a in (40, 44, 48, 40000, 80000):   # few rows: x moves; many: w (64 x 4000) moves
        x, w = _global((a, 64), mesh, (Split(0),)), _global((64, 4000), mesh, (Split(1),))
        made = decide_by_class(aten.mm.default, (x, w), {}, [x, w], mesh)
        cold = decide_mod.decide(aten.mm.default, (x, w), {}, [x, w], mesh)
        assert made.choice == cold.choice and _outputs(made) == _outputs(cold)
        _assert_same_decision(made, cold, a)
        choices.add(made.choice)
    key = class_key(aten.mm.default, (x, w), {}, mesh.shape)[0]
    assert DECISIONS.class_get(key).state == "priced" and len(choices) == 2


def test_dim_arguments_stay_exact():
    """A reduced dim is part of the class; only sizes become symbols."""
    mesh = sbp.DeviceMesh((2,))
    x = _global((10, 12, 14), mesh, (Split(0),))
    k1 = class_key(aten.sum.dim_IntList, (x, [1]), {}, mesh.shape)[0]
    k2 = class_key(aten.sum.dim_IntList, (x, [2]), {}, mesh.shape)[0]
    y = _global((16, 18, 20), mesh, (Split(0),))
    assert k1 != k2 and k1 == class_key(aten.sum.dim_IntList, (y, [1]), {}, mesh.shape)[0]
    z = _global((11, 12, 14), mesh, (Split(0),))   # 11 is odd: splits over 2 differ
    assert class_key(aten.sum.dim_IntList, (z, [1]), {}, mesh.shape)[0] != k1


def test_meta_runs_under_tracing_modes_stay_outside_them():
    # under torch.compile sbp's op handler runs inside torch's tracing modes; the meta runs that read an op's
    # output shapes (and torch's guards on symbolic sizes) went through them at several ms a call. They run
    # on plain meta tensors now, and record the same guards
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    env = ShapeEnv()
    fake = FakeTensorMode(shape_env=env)
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    x = fake.from_tensor(torch.randn(6, 8), symbolic_context=dynamic)
    w = fake.from_tensor(torch.randn(8, 4), static_shapes=True)
    rows, features = (str(n) for n in x.shape)   # symbols
    with fake, Seen() as seen:
        out = decide_mod.meta_outputs(torch.ops.aten.mm.default, (x, w), {})
    assert seen.ops == []
    assert str(out[0].shape[0]) == rows and out[0].shape[1] == 4
    assert [str(g.expr) for g in env.guards] == [f"Eq({features}, 8)"]   # mm pinned x's features to w's


# ---- output sizes that int arguments derive from input sizes -------------------------------------------------
OPEN = 2 ** 63 - 1   # a slice's open end, as torch passes it


def _derived_family(rng: random.Random, m: int):
    """A maker of calls of one op whose output sizes derive from int arguments and input sizes, its arguments
    drawn once: each call draws new sizes with the same remainders mod m, some small (a view's -1 then is)."""
    res, small, k = [rng.randrange(m) for _ in range(3)], rng.randint(1, m), rng.choice([2, 3, 4, 9])

    def n(i: int) -> int:
        return m * rng.randint(1, 6) + res[i] + (m if res[i] == 0 else 0)

    dim, step, split = rng.randrange(2), rng.choice([1, 2, 3, 9, 50]), rng.choice([1, 2, 3, 5, 20])
    topk, start, end = rng.choice([1, 2, 3, 5, 12]), rng.choice([0, 1, -3, -small, -40]), rng.choice(
        [OPEN, -1, 5, 20, 40, small])
    view = rng.choice([lambda a, b: [a, -1, k], lambda a, b: [-1, k], lambda a, b: [k, -1], lambda a, b: [-1],
                       lambda a, b: [a, b, -1]])
    reps, pads = [rng.choice([1, 2, 3]), rng.choice([1, 2, 5])], rng.choice([[1, 2], [0, 0, 3, -1], [-1, -1]])

    def view_call():
        a, b = n(0), rng.choice([n(1), rng.randint(1, m + 1)])
        return aten.view.default, [(a, b * k)], lambda x: (x, view(a, b))

    def expand_call():
        a, c = n(0), n(1)
        size = rng.choice([[-1, c], [a, c], [-1, small], [-1, 2 * a]])
        return aten.expand.default, [(a, 1)], lambda x: (x, size)

    def cat_call():
        shapes = [(n(0), n(1)), (n(2), n(1))] if dim == 0 else [(n(0), n(1)), (n(0), n(2))]
        return aten.cat.default, shapes, lambda x, y: ([x, y], dim)

    return rng.choice([
        view_call, expand_call, cat_call,
        lambda: (aten.slice.Tensor, [(n(0), n(1))], lambda x: (x, dim, start, end, step)),
        lambda: (aten.split.Tensor, [(n(0), n(1))], lambda x: (x, split, dim)),
        lambda: (aten.repeat.default, [(n(0), n(1))], lambda x: (x, reps)),
        lambda: (aten.topk.default, [(n(0), n(1))], lambda x: (x, topk, dim)),
        lambda: (aten.constant_pad_nd.default, [(n(0), n(1))], lambda x: (x, pads, 0.0)),
        lambda: (aten.new_zeros.default, [(n(0), n(1))], lambda x: (x, [x.shape[1], small])),
        lambda: (aten.unbind.int, [(small, n(1))], lambda x: (x, 0)),
        lambda: (aten.unfold.default, [(n(0), n(1))], lambda x: (x, 1, small, k)),   # no rule: every call alone
    ])


def test_sizes_derived_from_arguments_decide_as_cold_decisions():
    """Sequences of calls of one op whose output sizes derive from int arguments and input sizes (a view's -1,
    a slice's step and clamped bounds, split pieces, repeats, topk, padding), on 1-D and 2-D meshes with even,
    uneven and small sizes: every decision made through the shape classes equals a cold decision. Two calls
    of a class may agree on such a size that a third does not (the -1 of ``x.view(n, -1, 4)`` was 2 twice)."""
    rng = random.Random(46)
    for case in range(300):
        mesh = sbp.DeviceMesh(rng.choice(MESHES + ((1,), (8,))))
        make = _derived_family(rng, math.prod(mesh.shape))
        DECISIONS.clear(), SPEC_TOKENS.clear()   # (a full table cleared between the two decisions parts tokens)
        placements = None
        for _ in range(6):
            func, shapes, args_of = make()
            try:
                func(*args_of(*[torch.empty(s, device="meta") for s in shapes]))
            except (RuntimeError, IndexError):
                continue   # torch refuses it too
            placements = placements or [_placements(rng, len(s), mesh.ndim, partial=False) for s in shapes]
            ts = [_global(s, mesh, p) for s, p in zip(shapes, placements)]
            args = args_of(*ts)
            cold = decide_mod.decide(func, args, {}, ts, mesh)
            _assert_same_decision(decide_by_class(func, args, {}, ts, mesh), cold, (case, func, shapes, args[1:]))


def test_a_slice_clamps_sizes_above_its_bounds_only():
    """``x[:1000]`` has n rows for n <= 1000 and 1000 above, farther than a probe moves n: the class key orders
    sizes against int arguments, so rows above 1000 are another class."""
    mesh = sbp.DeviceMesh((2,))
    DECISIONS.clear()
    for n in (10, 14, 1010, 12, 1020, 16, 1030):
        x = _global((n, 4), mesh, (Split(0),))
        d = decide_by_class(aten.slice.Tensor, (x, 0, 0, 1000), {}, [x], mesh)
        assert d.spec.outputs[0].shape == (min(n, 1000), 4), n
    keys = {class_key(aten.slice.Tensor, (_global((n, 4), mesh, (B,)), 0, 0, 1000), {}, (2,))[0] for n in (10, 1010)}
    assert len(keys) == 2


def test_sizes_derived_from_arguments_follow_each_call():
    """The hunt's calls, run: ``x.view(n, -1, 4)`` whose -1 is 2, 2, then 3 (a raw IndexError before), and
    ``x[::9]`` of 1, 1, then 2 rows (a ShapeError before), as plain torch computes them."""
    def fn(mesh):
        out = []
        for n, c in [(5, 8), (7, 8), (9, 12)]:
            full = torch.arange(n * c, dtype=torch.float64).view(n, c)
            out.append(torch.equal(sbp.distribute(full, mesh, "B").view(n, -1, 4).full(), full.view(n, -1, 4)))
        return out

    def sliced(mesh):
        out = []
        for n in (5, 9, 13):
            full = torch.arange(n * 8, dtype=torch.float64).view(n, 8)
            out.append(torch.equal(sbp.distribute(full, mesh, "S(1)")[::9].full(), full[::9]))
        return out

    DECISIONS.clear()
    assert sbp.testing.spmd(fn, (2,)) == [[True] * 3] * 2
    DECISIONS.clear()
    assert sbp.testing.spmd(sliced, (4,)) == [[True] * 3] * 4
