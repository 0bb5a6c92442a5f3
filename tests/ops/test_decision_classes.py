"""Shape-class decisions: a decision made from its class equals a cold decision, over the rule table's families."""
from __future__ import annotations

import math
import random

import torch

import sbp
from sbp.ops import decide as decide_mod
from sbp.ops.cache import DECISIONS
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


def _values(rng: random.Random, m: int, residues: list[int]) -> list[int]:
    """Three distinct sizes above m with the given remainders mod m (one shape class)."""
    while True:
        v = [m * rng.randint(1, 12) + r + (m if r == 0 else 0) for r in residues]
        if len({*v, v[0] * v[1]}) == 4 and all(x > m for x in v):   # (a * b: the view's size argument)
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
        residues = [rng.randrange(m) for _ in range(3)]
        DECISIONS.clear()
        keys, made = [], []
        for _ in range(3):
            func, args, kwargs, leaves = call(name, _values(rng, m, residues))
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
