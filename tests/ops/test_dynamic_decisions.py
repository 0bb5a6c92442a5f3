"""A new sequence length every step: every decision made from a shape class equals a cold decision, in a real
tensor-parallel train step (embedding, layer norm, colwise/rowwise MLP, vocab head, cross-entropy; forward and
backward), and the step computes what plain torch computes."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import sbp
import sbp.nn
import sbp.testing
from sbp.ops import decide as decide_mod
from sbp.ops.cache import DECISIONS
from sbp.ops.decide import DecisionClass, decide
from tests.ops.test_decision_classes import _assert_same_decision

LENGTHS = (8, 10, 9, 11, 12, 13, 15, 14)   # both parities (the classes of a 2-rank mesh), two cold calls each


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(37, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 64)
        self.proj = nn.Linear(64, 16)
        self.head = nn.Linear(16, 37, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        x = x + self.proj(F.gelu(self.fc(self.ln(x))))
        return self.head(x)


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randint(0, 37, (3, t), generator=g), torch.randint(0, 37, (3, t), generator=g)


def _losses(model: nn.Module) -> list[float]:
    out = []
    for t in LENGTHS:
        idx, targets = _batch(t)
        loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
        loss = loss.full() if hasattr(loss, "full") else loss
        loss.backward()
        out.append((loss.item(), model.wte.weight.grad.full().sum().item() if hasattr(model.wte.weight.grad, "full")
                    else model.wte.weight.grad.sum().item()))
        model.zero_grad(set_to_none=True)
    return out


def test_new_lengths_decide_as_cold_decisions(monkeypatch):
    torch.manual_seed(0)
    reference = Tiny()
    expected = _losses(copy.deepcopy(reference))
    made, mismatches = [], []
    instantiate = DecisionClass.instantiate

    def checked(self, func, args, kwargs, leaves, mesh, values):
        d = instantiate(self, func, args, kwargs, leaves, mesh, values)
        cold = decide(func, args, kwargs, leaves, mesh)
        made.append((str(func), self.state))
        try:
            _assert_same_decision(d, cold, str(func))
        except AssertionError as e:
            mismatches.append(e)
        return d

    monkeypatch.setattr(decide_mod.DecisionClass, "instantiate", checked)
    DECISIONS.clear()

    def fn(mesh):
        model = copy.deepcopy(reference)
        plan = {"wte": "embedding", "fc": "colwise", "proj": "rowwise", "head": sbp.nn.Colwise(output_placement="B")}
        sbp.nn.parallelize(model, mesh, plan)
        return _losses(model)

    results = sbp.testing.spmd(fn, (2,))
    assert not mismatches, mismatches[:3]
    ops = {name for name, _ in made}
    assert len(made) >= 40 and {"aten.embedding_dense_backward.default", "aten.addmm.default",
                                "aten.native_layer_norm_backward.default"} <= ops, sorted(ops)
    assert {state for _, state in made} <= {"generic", "priced"}
    for per_rank in results:
        for (loss, grad), (want_loss, want_grad) in zip(per_rank, expected):
            assert abs(loss - want_loss) < 1e-5 and abs(grad - want_grad) < 1e-4


# ---- calls with symbolic sizes (torch.compile's dynamic shapes), decided on fake tensors ----------------------
def _fake_env():
    """A shape environment and fake-tensor mode, as torch.compile traces with, and a maker of fake tensors
    whose sizes are symbols where `dynamic` says (the other sizes static)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)

    def fake(t: torch.Tensor, dynamic=()) -> torch.Tensor:
        kinds = [DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=kinds))

    return env, mode, fake


def _nll_backward_of_symbolic_rows(targets: int, mesh):
    """``nll_loss_backward`` of symbolic (B x T, 16) logits and a static plain target of `targets` rows, as the
    backward of ``F.cross_entropy(logits.flatten(0, 1), target.flatten())`` compiled with B, T dynamic:
    the result's global shape, or the error's class names and whether it is a RuntimeError."""
    from sbp.tensor.global_tensor import GlobalTensor

    env, mode, fake = _fake_env()
    x = fake(torch.randn(4, 6, 16, dtype=torch.float64), dynamic=(0, 1))
    target = fake(torch.zeros(targets, dtype=torch.long))
    one = fake(torch.ones((), dtype=torch.float64))
    with mode:
        rows = x.view(x.shape[0] * x.shape[1], 16)   # (B x T, 16): no symbol of its own, torch guards B x T == 24
        logits = GlobalTensor(rows, mesh, (sbp.B,), tuple(rows.shape))
        grad = GlobalTensor(one, mesh, (sbp.B,), ())
        try:
            out = torch.ops.aten.nll_loss_backward.default(grad, logits, target, None, 1, -100, one)
        except Exception as e:   # noqa: BLE001 -- compared below
            return [c.__name__ for c in type(e).__mro__], isinstance(e, RuntimeError), str(e)
    return tuple(int(n) for n in out.shape), out.placements


def test_made_up_sizes_that_torch_refuses_with_an_assertion_are_pinned():
    # logits (B x T, 16) of symbolic B and T and a static target of 24 rows: torch guards B x T == 24 and
    # keeps both symbolic. sbp decides the call's shape class at made-up sizes, where nll_loss_backward's
    # decomposition refuses the rows with an AssertionError (not a RuntimeError): it escaped from torch.compile
    # ("size mismatch (got input: torch.Size([8176960, 16]), target: torch.Size([24]))"). Such made-up
    # sizes break the call like any other: the sizes are pinned and the call decided at its own
    assert sbp.testing.spmd(lambda mesh: _nll_backward_of_symbolic_rows(24, mesh), (2,)) == [((24, 16), (sbp.B,))] * 2
    # a real mismatch (30 targets for 24 rows) still raises, as eagerly: sbp's ShapeError, a RuntimeError as torch's
    for names, is_runtime, text in sbp.testing.spmd(lambda mesh: _nll_backward_of_symbolic_rows(30, mesh), (2,)):
        assert "ShapeError" in names and "SbpError" in names and is_runtime, names
        assert "size mismatch" in text and "(24, 16), (30,)" in text, text


def test_an_assertion_of_a_decomposition_is_a_shape_error_eagerly():
    # eagerly too: nll_loss_backward's meta kernel (a decomposition) asserts, torch's CPU kernel raises a
    # RuntimeError; sbp raised the bare AssertionError
    def fn(mesh):
        logits = sbp.distribute(torch.zeros(24, 16, dtype=torch.float64), mesh, "B")
        grad, weight = sbp.distribute(torch.ones((), dtype=torch.float64), mesh, "B"), torch.tensor(30.0)
        try:
            torch.ops.aten.nll_loss_backward.default(grad, logits, torch.zeros(30, dtype=torch.long), None, 1, -100,
                                                     weight.double())
        except sbp.ShapeError as e:
            return isinstance(e, RuntimeError), "size mismatch" in str(e)
    assert sbp.testing.spmd(fn, (2,)) == [(True, True)] * 2


def _slice_with_symbolic_bounds(bounds, mesh):
    """``x[:, a:b]`` of a global (R, 6) ``S(0)`` tensor of symbolic R, with bounds that are symbols of their own
    (torch.compile replays a view input ``x[:, 1:4]`` on its fake base so): the output's global shape, and
    which sizes are still symbolic."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._dynamo.source import EphemeralSource

    from sbp.runtime.symbolic import hint, is_symbolic
    from sbp.tensor.global_tensor import GlobalTensor

    env, mode, fake = _fake_env()
    full = fake(torch.randn(6, 6, dtype=torch.float64), dynamic=(0,))
    local = fake(torch.randn(3, 6, dtype=torch.float64), dynamic=(0,))

    def symbol(v: int) -> torch.SymInt:
        source = EphemeralSource("symint_visitor_fn")
        return env.create_symintnode(env.create_symbol(v, source, positive=None), hint=v, source=source)

    with mode, enable_python_dispatcher():   # as torch.compile replays a view
        x = GlobalTensor(local, mesh, (sbp.S(0),), tuple(full.shape))
        out = torch.ops.aten.slice.Tensor(x, 1, *map(symbol, bounds))
        return tuple(map(hint, out.shape)), [is_symbolic(n) for n in out.shape]


def test_slice_bounds_that_are_symbols_of_their_own_keep_their_values():
    # the shape class is decided at made-up values of every symbol, the bounds' too: 2 + 4036 and 5 + 6054
    # lie past the end of the static dim of 6, the slice came out empty at both made-up calls, and the class
    # gave every call an empty dim ((R, 0): torch.compile's check of a replayed view input failed, "Expected
    # cond to be True"). Made-up sizes whose outputs are not torch's symbolic ones break the call: the bounds
    # are pinned, the rows stay symbolic
    for found in sbp.testing.spmd(lambda mesh: _slice_with_symbolic_bounds((2, 5), mesh), (2,)):
        assert found == ((6, 3), [True, False]), found


def test_a_class_whose_formula_is_not_the_calls_is_not_used():
    # x[:, 0:6:k] with a symbolic step k (2 here): at both made-up values of k (huge) the slice has one column,
    # which the class took for a constant, though the made-up calls fit torch's symbolic output (6 + k - 1) // k.
    # A class whose output sizes are not torch's at the call's own sizes is not used
    for found in sbp.testing.spmd(lambda mesh: _slice_with_symbolic_bounds((0, 6, 2), mesh), (2,)):
        assert found[0] == (6, 3), found
