"""The testing kit itself: strategies draw valid, edge-covering layouts; assert_layout_equivalent accepts
equal logical tensors in any layouts and explains a difference; the example in docs/testing.md runs."""
from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import find, given, settings

import sbp
import sbp.testing
from sbp.testing import assert_layout_equivalent, global_shapes, layouts, meshes, placements
from sbp.values.placement import normalize
from tests.support.repo import DOCS

TESTING_MD = DOCS / "testing.md"


@settings(max_examples=60, deadline=None)
@given(case=layouts())
def test_layouts_fit_together(case):
    mesh_shape, shape, pls = case
    assert 1 <= len(mesh_shape) <= 3 and math.prod(mesh_shape) <= 8
    assert normalize(pls, len(shape), len(mesh_shape)) == pls      # valid as drawn


def test_strategies_reach_the_edges():
    assert find(global_shapes(), lambda s: 0 in s) == (0,)
    assert find(global_shapes(), lambda s: len(s) == 3) == (0, 0, 0)
    assert find(meshes(), lambda m: m == (2, 2, 2)) == (2, 2, 2)                 # reachable
    assert find(placements(2, 2), lambda p: sbp.Partial("min") in p) == (sbp.B, sbp.Partial("min"))
    assert find(placements(1, 0), lambda p: True) == (sbp.B,)                  # a 0-d tensor cannot be split
    assert find(placements(2, 1, partial=False), lambda p: sbp.S(0) in p) == (sbp.B, sbp.S(0))
    with pytest.raises(Exception):
        find(placements(3, 2, partial=False), lambda p: any(isinstance(q, sbp.Partial) for q in p))


def _equivalence(mesh):
    t = torch.arange(12.0).reshape(3, 4)
    x = sbp.distribute(t, mesh, "S(0), P(sum)")
    y = sbp.distribute(t, mesh, "B, S(1)")
    assert_layout_equivalent(x, y)
    assert_layout_equivalent(x, t)
    messages = []
    for other in (sbp.distribute(t + torch.eye(3, 4) * 4, mesh, "S(1), B"), sbp.zeros((4, 3), mesh, "B, B"),
                  sbp.distribute(t.double(), mesh, "B, B")):
        try:
            assert_layout_equivalent(x, other)
        except AssertionError as e:
            messages.append(str(e))
    return messages


def test_assert_layout_equivalent_messages():
    for messages in sbp.testing.spmd(_equivalence, (2, 2)):
        assert messages == [
            "not the same logical tensor: x ((S(0), P(sum)) on mesh (2, 2)) vs y ((S(1), B) on mesh (2, 2)), "
            "shape (3, 4): max abs diff 4.0 at index (0, 0) (x=0.0, y=4.0)",
            "not the same logical tensor: x ((S(0), P(sum)) on mesh (2, 2)) vs y ((B, B) on mesh (2, 2)): "
            "global shapes (3, 4) != (4, 3)",
            "not the same logical tensor: x ((S(0), P(sum)) on mesh (2, 2)) vs y ((B, B) on mesh (2, 2)): "
            "dtypes torch.float32 != torch.float64",
        ]


@pytest.mark.slow
def test_docs_example_runs():
    text = TESTING_MD.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {"__name__": "docs_testing_example"}
    exec(compile(code, str(TESTING_MD), "exec"), namespace)
    namespace["test_redistribution_chains"]()


def test_assert_layout_equivalent_nan_and_ranks_outside_the_mesh():
    """NaN in the same places is the same logical value (exact and close paths agree); a rank outside a
    tensor's mesh holds nothing of it and compares nothing."""
    t = torch.tensor([float("nan"), 1.0, 2.0, 3.0])

    def fn(mesh):
        sbp.testing.assert_layout_equivalent(sbp.distribute(t, mesh, "S(0)"), t)
        sbp.testing.assert_layout_equivalent(sbp.distribute(t, mesh, "S(0)"), sbp.distribute(t, mesh, "B"),
                                             exact=False)
        sub = sbp.testing.submesh(mesh, (1,), ranks=[0])
        sbp.testing.assert_layout_equivalent(sbp.distribute(t, sub, "B"), t)
        other = t.clone()
        other[1] = float("nan")
        try:
            sbp.testing.assert_layout_equivalent(sbp.distribute(t, mesh, "S(0)"), other)
        except AssertionError as e:
            return str(e)
        return None

    for message in sbp.testing.spmd(fn, (2,)):
        assert message is not None and "at index (1,) (x=1.0, y=nan)" in message


def test_assert_layout_equivalent_fails_every_rank_when_a_plain_side_differs_between_ranks():
    """A plain tensor is each rank's own: one that differs between ranks (an SPMD slip) must fail on every
    rank, not only where it differs (the others would carry on into the next collective)."""
    t = torch.arange(12.).reshape(3, 4)

    def fn(mesh):
        try:
            sbp.testing.assert_layout_equivalent(sbp.distribute(t, mesh, "S(0)"), t + (mesh.rank == 1))
        except AssertionError as e:
            return str(e)
        return None

    messages = sbp.testing.spmd(fn, (2,))
    assert messages[0] is not None and "ranks [1] see a difference" in messages[0]
    assert messages[1] is not None and "max abs diff 1.0" in messages[1]


def test_assert_layout_equivalent_is_exact_for_max_and_min_partials():
    # before: every Partial used the float tolerance of sums, so a P(max) holding 1000.0 passed against 1000.001
    # (float32) and a bfloat16 one holding 100 against 101; max and min are exact in any order
    def fn(mesh):
        out = []
        for op, dtype, a, b in (("max", torch.float32, 1000.0, 1000.001), ("min", torch.bfloat16, 100.0, 101.0)):
            x = sbp.distribute(torch.full((3,), a, dtype=dtype), mesh, f"P({op})")
            try:
                sbp.testing.assert_layout_equivalent(x, torch.full((3,), b, dtype=dtype))
                out.append("passed")
            except AssertionError:
                out.append("failed")
        return out

    assert sbp.testing.spmd(fn, (2,)) == [["failed", "failed"]] * 2


class _TwoArgError(Exception):
    def __init__(self, a, b):   # pickles as _TwoArgError(message): does not unpickle
        super().__init__(f"{a} {b}")


def _raises_unpicklable(mesh):
    if mesh.coord == (1,):
        raise _TwoArgError("a", "b")
    return "first"


def _says_second(mesh):
    return "second"


@pytest.mark.gloo
def test_gloo_reply_that_does_not_unpickle_is_named_and_leaves_the_pool_in_step():
    # before: the unpickling error escaped raw from the middle of the reply loop, and the next call returned
    # rank 0's stale reply of this one (['first', 'second'])
    with pytest.raises(sbp.testing.SpmdError, match="rank 1's reply .* cannot be unpickled") as info:
        sbp.testing.spmd(_raises_unpicklable, (2,), backend="gloo", timeout=60)
    assert info.value.rank == 1
    assert sbp.testing.spmd(_says_second, (2,), backend="gloo", timeout=60) == ["second", "second"]
