"""`x[index] = value` on split dims: every rank writes its block's part of the region (no copy that the
write would miss), for every placement, uneven and empty shards, broadcast values and global values."""
from __future__ import annotations

import pytest
import torch

import sbp
import sbp.testing

INDICES = [(slice(1, 3),), (slice(None), 2), (4,), (-1, slice(0, 5, 2)), (slice(0, 7, 3), None, slice(1, None)),
           (Ellipsis, 1), (slice(2, 6), slice(1, 4)), (slice(5, 2),), (slice(0, 100),), (slice(6, 7), 0)]
LAYOUTS = {(2,): ["S(0)", "S(1)", "P(sum)", "P(max)"], (4,): ["S(0)", "S(1)", "P(sum)"], (3,): ["S(0)", "S(1)"],
           (2, 2): ["S(0), S(1)", "S(1), S(0)", "S(0), S(0)", "P, S(0)", "S(1), P(min)"]}
FULL = torch.arange(35.0).view(7, 5)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(LAYOUTS))
def test_setitem_matches_torch(mesh):
    def rank(mesh_):
        wrong = []
        for pls in LAYOUTS[mesh]:
            for index in INDICES:
                region = FULL[index].shape
                value = torch.randn(region, generator=torch.Generator().manual_seed(len(wrong)))
                for v in (-9.0, value, value[..., :1] if len(region) and region[-1] else 7):
                    want = FULL.clone()
                    want[index] = v
                    x = sbp.distribute(FULL, mesh_, pls)
                    x[index] = v
                    if x.placements != sbp.placements(pls) or not torch.equal(x.full(), want):
                        wrong.append((pls, index))
        return wrong

    for wrong in sbp.testing.spmd(rank, mesh):
        assert wrong == []


def test_setitem_with_a_global_value_an_int_dtype_and_a_view():
    def rank(mesh):
        x = sbp.distribute(torch.zeros(6, 4, dtype=torch.int64), mesh, "S(0)")
        x[1:5, 1] = sbp.distribute(torch.tensor([1.9, 2.0, 3.0, 4.0]), mesh, "S(0)")   # cast like torch
        cols = x[:, 2:4]            # a view (columns are not split): writes reach x
        cols[0:3] = 7
        return x.full()

    want = torch.zeros(6, 4, dtype=torch.int64)
    want[1:5, 1] = torch.tensor([1.9, 2.0, 3.0, 4.0])
    want[:, 2:4][0:3] = 7
    for got in sbp.testing.spmd(rank, (4,)):
        assert torch.equal(got, want)


def test_setitem_refusals():
    """Autograd cannot see a block write: a tensor that records gradients keeps torch's route (refused
    with the view message); a value of the wrong shape is a ShapeError."""
    def rank(mesh):
        x = sbp.distribute(torch.ones(4, 2), mesh, "S(0)", requires_grad=True) * 2
        messages = []
        for target, value in ((x, 0.0), (sbp.distribute(torch.ones(4, 2), mesh, "S(0)"), torch.ones(3))):
            try:
                target[1:3] = value
            except sbp.SbpError as e:
                messages.append(type(e).__name__ + ": " + str(e))
        return messages

    for messages in sbp.testing.spmd(rank, (2,)):
        assert len(messages) == 2
        assert "could not stay a view" in messages[0]
        assert messages[1].startswith("ShapeError: x[1:3] on global shape (4, 2)") and "cannot be broadcast" in messages[1]


def test_setitem_on_a_mesh_over_some_ranks():
    """Ranks outside the tensor's mesh hold no block and write nothing (also for a global value)."""
    def rank(mesh):
        sub = sbp.testing.submesh(mesh, (2,), ranks=[0, 1])
        x = sbp.distribute(torch.zeros(4, 2), sub, "S(0)")
        x[1:3] = sbp.distribute(torch.ones(2, 2), sub, "S(1)")
        x[0] = torch.tensor([5.0, 6.0])
        return x.full()

    want = torch.tensor([[5.0, 6.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    got = sbp.testing.spmd(rank, (4,))
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
    assert got[2].numel() == 0 and got[3].numel() == 0
