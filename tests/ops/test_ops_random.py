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
