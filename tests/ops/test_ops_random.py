"""Random ops on global tensors: every rank draws the same numbers (a seed agreed over the mesh), so a
Broadcast result is one value on every rank, as its placements claim."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import sbp
import sbp.testing

CASES = {
    "normal_": lambda x: torch.nn.init.normal_(x),
    "uniform_": lambda x: x.uniform_(-1, 1),
    "bernoulli_": lambda x: x.bernoulli_(0.5),
    "dropout": lambda x: F.dropout(x + 1, 0.5, training=True),
    "rand_like": lambda x: torch.rand_like(x),
    "generator": lambda x: x.normal_(generator=torch.Generator().manual_seed(3)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_random_ops_draw_alike_on_every_rank(name, mesh):
    def rank(mesh_):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sbp.FallbackWarning)
            x = sbp.distribute(torch.zeros(6, 4), mesh_, ("B",) * len(mesh))
            y = CASES[name](x)
            z = sbp.distribute(torch.zeros(6, 4), mesh_, ("S(0)",) + ("B",) * (len(mesh) - 1))
            CASES[name](z)
        return y.placements, y.to_local(), z.full()

    results = sbp.testing.spmd(rank, mesh)
    placements, first, full = results[0]
    assert all(p == (sbp.B,) * len(mesh) for p, _, _ in results)
    for _, local, other_full in results[1:]:
        assert torch.equal(local, first)            # a Broadcast tensor holds one value everywhere
        assert torch.equal(other_full, full)
    assert first.std() > 0                          # and it is random


# draws that ignore their input's values: the input's shape is all they read
OVER = {
    "normal_": lambda x, g: x.normal_(generator=g),
    "uniform_": lambda x, g: x.uniform_(-1, 1, generator=g),
    "bernoulli_": lambda x, g: x.bernoulli_(0.3, generator=g),
    "exponential_": lambda x, g: x.exponential_(generator=g),
    "random_": lambda x, g: x.random_(0, 9, generator=g),
    "rand_like": lambda x, g: torch.rand_like(x, generator=g),
}


@pytest.mark.parametrize("name", list(OVER))
@pytest.mark.parametrize("mesh, placements", [((2,), "S(0)"), ((2,), "S(1)"), ((2, 2), "S(0), S(1)"),
                                              ((2, 2), "P(sum), S(0)"), ((3,), "S(0)")])
def test_a_draw_over_its_input_gathers_nothing(name, mesh, placements):
    # fails without `draws_over`: the input was all-gathered (its values unused) before the draw, with a
    # FallbackWarning, and sbp.strict() refused the op
    def rank(mesh_):
        with warnings.catch_warnings():
            warnings.simplefilter("error", sbp.FallbackWarning)
            x = sbp.distribute(torch.zeros(5, 3), mesh_, placements)
            ref = sbp.distribute(torch.zeros(5, 3), mesh_, ("B",) * len(mesh))
            counters = mesh_.binding.counters
            counters.reset()
            with sbp.strict():
                y = OVER[name](x, torch.Generator().manual_seed(11))
            calls = [(c.collective, c.sent) for c in counters.calls]
            z = OVER[name](ref, torch.Generator().manual_seed(11))
        expected = x.placements if y is x or "P" not in placements else (sbp.B,) * len(mesh)
        return calls, y.placements == expected, y.full(), z.full()

    results = sbp.testing.spmd(rank, mesh)
    first = results[0][2]
    for calls, laid_out, full, over_b in results:
        assert [c for c, _ in calls] == ["all_gather"] and calls[0][1] <= 8 * 8, calls   # the seed, nothing more
        assert laid_out                         # in place: the input's layout; a new draw: the input's S/B
        assert torch.equal(full, over_b)        # the draw a Broadcast input gets from the same generator
        assert torch.equal(full, first)
    assert first.std() > 0


@pytest.mark.parametrize("mesh, placements, out", [
    ((2,), "S(0)", "S(0)"), ((2,), "S(1)", "S(1)"), ((2, 2), "S(0), S(1)", "S(0), S(1)"),
    ((2, 2), "P(sum), S(0)", "P(sum), S(0)"), ((3,), "S(0)", "S(0)"),
    ((2,), "P(max)", "P(sum)")])   # P(max) is reduced to a split first (one reduce_scatter), then kept as P(sum)
def test_native_dropout_keeps_the_layout_and_gathers_nothing(mesh, placements, out):
    # fails without its rule (sbp.ops.random.NATIVE_DROPOUT, what compiled dropout runs): the input was
    # gathered, the outputs Broadcast
    value = torch.arange(1.0, 71.0).reshape(10, 7)   # 70 elements: a mask keeping all or none is ~1e-9 likely

    def rank(mesh_):
        x = sbp.distribute(value, mesh_, ("B",) * len(mesh)).redistribute(placements)
        counters = mesh_.binding.counters
        counters.reset()
        with sbp.strict():
            y, mask = torch.ops.aten.native_dropout.default(x, 0.25, True)
        calls = [c.collective for c in counters.calls]
        return calls, y.placements, mask.placements, y.full(), mask.full()

    results = sbp.testing.spmd(rank, mesh)
    first_mask = results[0][4]
    for calls, y_pls, _, y, mask in results:
        reduced = ["reduce_scatter"] if "P(max)" in placements else []
        assert calls == reduced + ["all_gather"], calls   # the seed's all_gather, no gather of the input
        assert [repr(p) for p in y_pls] == [s.strip() for s in out.split(",")]
        assert mask.dtype == torch.bool and torch.equal(mask, first_mask)
        assert torch.equal(y, value * mask * (1 / 0.75))   # as torch scales
    assert 0 < int(first_mask.sum()) < first_mask.numel()
