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
