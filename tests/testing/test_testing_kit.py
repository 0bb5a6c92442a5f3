"""The testing kit itself: strategies draw valid, edge-covering layouts; assert_layout_equivalent accepts
equal logical tensors in any layouts and explains a difference; the example in docs/testing.md runs."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

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


@settings(max_examples=25, deadline=None)
@given(case=layouts(min_dims=0, negative_dims=True, partial=False, max_side=5))
def test_layouts_with_negative_split_dims_and_0d_tensors_hold_the_value(case):
    # the strategies drew neither (the normalisation of S(-1) was never exercised by a property test)
    mesh_shape, shape, pls = case
    t = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)

    def fn(mesh):
        x = sbp.distribute(t, mesh, pls)
        return x.placements == normalize(pls, len(shape), len(mesh_shape)) and torch.equal(x.full(), t)

    assert all(sbp.testing.spmd(fn, mesh_shape))


def test_assert_layout_equivalent_messages():
    for messages in sbp.testing.spmd(_equivalence, (2, 2)):
        assert messages == [
            "not the same logical tensor: x ((S(0), P(sum)) on mesh (2, 2)) vs y ((S(1), B) on mesh (2, 2)), "
            "shape (3, 4), compared with the dtype's default tolerances: max abs diff 4.0 at index (0, 0) "
            "(x=0.0, y=4.0)",
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


def test_assert_layout_equivalent_takes_given_tolerances():
    """Tolerances choose the close comparison (they were ignored where no Partial was involved: a row-parallel
    result reduced to B failed against its reference on a difference of one float32 rounding); with
    exact=True they are an error, and the message says which comparison failed."""
    a, b = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8, 8)

    def fn(mesh):
        x = (sbp.distribute(a, mesh, "S(1)") @ sbp.distribute(b, mesh, "S(0)")).redistribute("B")
        want = a @ b
        out = []
        for near in (want + 1e-6 * want.abs().max(), want + 1.0):
            try:
                sbp.testing.assert_layout_equivalent(x, near, rtol=1e-4, atol=1e-4)
                out.append("close")
            except AssertionError as e:
                out.append(str(e).split(": max abs")[0].split("(8, 8), ")[-1])
        with pytest.raises(sbp.SbpError, match="apply to the close comparison"):
            sbp.testing.assert_layout_equivalent(x, want, exact=True, rtol=1e-4, atol=1e-4)
        ints = sbp.distribute(torch.arange(4), mesh, "S(0)")   # integers take them too, as in assert_close
        sbp.testing.assert_layout_equivalent(ints, torch.arange(4) + 1, rtol=0, atol=1)
        return out

    for out in sbp.testing.spmd(fn, (2,)):
        assert out == ["close", "compared with rtol=0.0001, atol=0.0001"]


def test_assert_layout_equivalent_of_complex32_and_meta_tensors():
    """complex32 compares (torch has no ComplexHalf comparison on CPU: widened exactly); a meta tensor has
    no values to compare: an SbpError, not torch's NotImplementedError."""
    t = torch.tensor([1 + 2j, 3 - 1j, 0.5j, 2]).to(torch.complex32)

    def fn(mesh):
        sbp.testing.assert_layout_equivalent(sbp.distribute(t, mesh, "S(0)"), t)
        with pytest.raises(AssertionError, match=r"at index \(1,\)"):
            sbp.testing.assert_layout_equivalent(sbp.distribute(t, mesh, "S(0)"), t * torch.tensor([1, 2, 1, 1]))
        with pytest.raises(sbp.SbpError, match="y is a meta tensor"):
            sbp.testing.assert_layout_equivalent(sbp.distribute(t, mesh, "S(0)"), t.to("meta"))
        with pytest.raises(sbp.SbpError, match="x is a meta tensor"):   # a global tensor of meta locals too
            sbp.testing.assert_layout_equivalent(sbp.distribute(torch.empty(4, device="meta"), mesh, "S(0)"),
                                                 torch.zeros(4))
        return True

    assert all(sbp.testing.spmd(fn, (2,)))


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


def _pid(mesh):
    return os.getpid()


def _rank_1_exits_while_rank_0_all_reduces(mesh):
    if mesh.rank == 1:
        os._exit(3)
    return mesh.binding.all_reduce(torch.ones(1), (0,), "sum").item()


@pytest.mark.gloo
def test_gloo_worker_that_dies_is_named_and_the_pool_restarts():
    # before: rank 0's broken all_reduce (a CommError, like "worker died") was blamed, as the lowest rank
    # with a CommError: "rank 0 of 2 raised CommError: all_reduce(sum) ... Connection reset by peer"
    before = sbp.testing.spmd(_pid, (2,), backend="gloo", timeout=60)
    with pytest.raises(sbp.testing.SpmdError, match=r"^rank 1 of 2 died: .*\(exit code 3\)") as info:
        sbp.testing.spmd(_rank_1_exits_while_rank_0_all_reduces, (2,), backend="gloo", timeout=60)
    assert info.value.rank == 1 and info.value.__cause__.exitcode == 3
    after = sbp.testing.spmd(_pid, (2,), backend="gloo", timeout=60)     # a fresh pool: new workers
    assert len(set(after)) == 2 and not set(after) & set(before)
    assert sbp.testing.spmd(_says_second, (2,), backend="gloo", timeout=60) == ["second", "second"]


def _rank_1_aborts(mesh):
    if mesh.rank == 1:
        os.abort()
    return mesh.rank


@pytest.mark.gloo
def test_gloo_worker_that_aborts_is_not_blamed_on_a_missing_main_guard():
    # a worker gloo aborts (SIGABRT: a collective received another size than it expected, ranks that
    # disagree) on a fresh pool was reported with the hint for a script without an `if __name__` guard;
    # the second call is always a fresh pool's first (the first one's death replaced the pool)
    for _ in range(2):
        with pytest.raises(sbp.testing.SpmdError, match=r"^rank 1 of 2 died: .*SIGABRT") as info:
            sbp.testing.spmd(_rank_1_aborts, (2,), backend="gloo", timeout=60)
    message = str(info.value)
    assert "__main__" not in message and "ranks that disagree" in message, message


def _returns_an_unwaited_gather(mesh):
    return sbp.distribute(torch.arange(4.0), mesh, "S(0)").redistribute("B", async_op=True)


def test_async_work_issued_in_a_threads_run_finishes_before_the_run_ends():
    # the run's end aborts its world: a gather fn issued but did not wait for failed when the abort came
    # first (about 3 runs in 10)
    for _ in range(10):
        for y in sbp.testing.spmd(_returns_an_unwaited_gather, (2,), timeout=5):
            assert y.wait().to_local().tolist() == [0.0, 1.0, 2.0, 3.0]


def _returns_a_global_tensor(mesh):
    return sbp.distribute(torch.arange(4.0), mesh, "S(0)")


def test_a_global_tensor_returned_by_threads_spmd_runs_no_collective_after_the_run():
    # its thread-ranks are gone: a collective on it waited out the whole timeout, then blamed rank 1
    x = sbp.testing.spmd(_returns_a_global_tensor, (2,), timeout=5)[0]
    assert torch.equal(x.to_local(), torch.arange(2.0))   # its local is still there
    with pytest.raises(sbp.CommError, match="the spmd run of this mesh has ended"):
        x.full()


def _rank_0_times_out_and_catches_it(mesh):
    if mesh.rank == 1:
        return "skipped the all_reduce"
    try:
        mesh.binding.all_reduce(torch.ones(1), (0,), "sum")
    except sbp.CommError:
        return "caught"
    return "reduced"


def _all_reduce(mesh):
    return mesh.binding.all_reduce(torch.ones(1), (0,), "sum").item()


@pytest.mark.gloo
def test_gloo_pool_restarts_after_a_collective_failure_the_function_caught():
    # a timed-out gloo collective closes the group's connections; the function caught the CommError and returned,
    # so the call succeeded -- and before, the next call on the same pool failed at once ("Application timeout
    # caused pair closure"): a fault test that catches the error, then checks what survived, could not
    before = sbp.testing.spmd(_pid, (2,), backend="gloo", timeout=60)
    assert sbp.testing.spmd(_rank_0_times_out_and_catches_it, (2,), backend="gloo", timeout=3) == \
        ["caught", "skipped the all_reduce"]
    assert sbp.testing.spmd(_all_reduce, (2,), backend="gloo", timeout=3) == [2.0, 2.0]
    assert not set(sbp.testing.spmd(_pid, (2,), backend="gloo", timeout=60)) & set(before)


@pytest.mark.gloo
@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_why_its_workers_die(tmp_path):
    # the workers import the calling script as __main__; one calling spmd(..., backend="gloo") at its top level
    # runs it again in each worker, which dies -- reported before as "rank 0's reply ... cannot be unpickled:
    # ConnectionResetError ... Return plain values", which sent the user the wrong way
    script = tmp_path / "no_guard.py"
    script.write_text("import sbp, sbp.testing\n"
                      "def rank(mesh):\n"
                      "    return mesh.rank\n"
                      "print(sbp.testing.spmd(rank, (2,), backend='gloo', timeout=30))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode != 0
    assert "died: its worker process ended without replying" in out.stderr, out.stderr[-2000:]
    assert "needs an `if __name__ == \"__main__\":` guard" in out.stderr, out.stderr[-2000:]


def test_first_cause_blames_a_dead_worker_before_the_ranks_it_broke():
    # a survivor's broken collective may surface as any exception (a raw torch.distributed error from the
    # user's own call, not only sbp's CommError): the dead rank is still the cause
    from sbp.testing.spmd import _first_cause, _WorkerDied
    from sbp.values.errors import CommError
    assert _first_cause({0: (CommError("reset by peer"), ""), 2: (_WorkerDied(2, -9), ""),
                         1: (RuntimeError("gloo: connection closed"), "")}) == 2
    assert _first_cause({0: (CommError("reset by peer"), ""), 1: (RuntimeError("own"), "")}) == 1
    assert str(_WorkerDied(2, -9)) == "rank 2's worker process died without replying (killed by signal 9 (SIGKILL))"


def _mismatch(x, y, **kw):
    try:
        assert_layout_equivalent(x, y, **kw)
    except AssertionError as e:
        return "max abs" + str(e).split(": max abs", 1)[1]
    return None


@pytest.mark.parametrize("exact", [True, False])
def test_assert_layout_equivalent_message_names_a_real_mismatch_among_infinities(exact):
    # before: inf - inf is nan, which was ranked worst (an equal infinity named as the mismatch), and
    # nan_to_num turned an infinite difference into 1.8e308
    inf, nan = float("inf"), float("nan")
    cases = [([inf, 1., 2.], [inf, 1., 3.], "max abs diff 1.0 at index (2,) (x=2.0, y=3.0)"),
             ([-inf, 1., 2.], [-inf, 1., 3.], "max abs diff 1.0 at index (2,) (x=2.0, y=3.0)"),
             ([1., inf], [1., 5.], "max abs diff inf at index (1,) (x=inf, y=5.0)"),
             ([-inf, 0.], [inf, 0.], "max abs diff inf at index (0,) (x=-inf, y=inf)"),
             ([inf, 1.], [inf, nan], "max abs diff nan at index (1,) (x=1.0, y=nan)"),
             ([inf, 7., 1.], [inf, 9., -inf], "max abs diff inf at index (2,) (x=1.0, y=-inf)")]
    for x, y, message in cases:
        assert _mismatch(torch.tensor(x), torch.tensor(y), exact=exact) == message, (x, y)
    same = torch.tensor([inf, -inf, nan, 1.])
    assert _mismatch(same, same.clone(), exact=exact) is None            # equal infinities are equal
    assert _mismatch(torch.tensor([inf, 1.]), torch.tensor([inf, 1. + 1e-7]), exact=exact) == (
        "max abs diff 1.1920928955078125e-07 at index (1,) (x=1.0, y=1.0000001192092896)" if exact else None)


def test_assert_layout_equivalent_message_names_an_element_outside_the_tolerance_and_exact_integers():
    # the close path names the worst element that is not close, not the largest difference (within rtol here)
    assert _mismatch(torch.tensor([1000., 1.]), torch.tensor([1000.01, 1.001]), exact=False, rtol=1e-4,
                     atol=0.0) == "max abs diff 0.001000046730041504 at index (1,) (x=1.0, y=1.0010000467300415)"
    # integers differ exactly (a float64 difference of these is 0.0)
    assert _mismatch(torch.tensor([2 ** 62, 5]), torch.tensor([2 ** 62 + 1, 5])) == (
        f"max abs diff 1 at index (0,) (x={2 ** 62}, y={2 ** 62 + 1})")


def _partial_with_infinities(mesh):
    inf = float("inf")
    x = sbp.distribute(torch.tensor([[inf, 1.], [-inf, 2.]]), mesh, "P(sum), S(0)")
    return (_mismatch(x, torch.tensor([[inf, 1.], [-inf, 2.]])),
            _mismatch(x, torch.tensor([[inf, 1.], [-inf, 2.5]])))


def test_assert_layout_equivalent_with_infinities_across_a_mesh():
    for ok, message in sbp.testing.spmd(_partial_with_infinities, (2, 2)):
        assert ok is None and message == "max abs diff 0.5 at index (1, 1) (x=2.0, y=2.5)"


TIGHT_MESH_BOUNDS = [dict(min_axes=3, max_axes=3, max_size=1),                   # only (1, 1, 1)
                     dict(min_axes=3, max_axes=5, max_axis_size=4, max_size=2),
                     dict(min_axes=4, max_axes=6, max_axis_size=8, max_size=4),
                     dict(min_axes=2, max_axes=8, max_axis_size=16, max_size=3),
                     dict(min_axes=2, max_axes=4, max_axis_size=16, max_size=6)]


def _all_meshes(min_axes=1, max_axes=3, max_axis_size=4, max_size=8):
    def grow(shapes, room_of):   # one more axis on each shape, of every size its product leaves room for
        return [s + (k,) for s in shapes for k in range(1, min(max_axis_size, room_of(s)) + 1)]

    shapes, out = [()], set()
    for n in range(1, max_axes + 1):
        shapes = grow(shapes, lambda s: max_size // math.prod(s))
        if n >= min_axes:
            out.update(shapes)
    return out


@pytest.mark.parametrize("bounds", TIGHT_MESH_BOUNDS, ids=lambda b: "-".join(f"{k}={v}" for k, v in b.items()))
def test_meshes_meet_tight_bounds_without_filtering(bounds):
    # before: sizes were drawn then filtered on the product, and every one of these bounds failed Hypothesis'
    # filter_too_much health check at max_examples=50 (min_axes=3, max_size=1 passes one list in 4**3)
    everything = _all_meshes(**bounds)
    drawn = set()

    def run(examples):
        @settings(max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=())
        @given(meshes(**bounds))
        def check(shape):
            assert shape in everything
            drawn.add(shape)

        check()

    run(50)
    run(300)
    if len(everything) <= 60:           # a small space is covered whole: the fewest and most axes, all sizes
        assert drawn == everything
    else:                               # both ends of the range, and the room going to any axis
        assert {min(map(math.prod, drawn)), max(map(math.prod, drawn))} == {1, bounds["max_size"]}
        assert {len(s) for s in drawn} == set(range(bounds["min_axes"], bounds["max_axes"] + 1))
        assert {s.index(max(s)) for s in drawn if max(s) > 1} >= set(range(bounds["min_axes"]))


def test_meshes_cover_the_default_range_and_shrink():
    drawn = set()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @given(meshes())
    def check(shape):
        drawn.add(shape)

    check()
    assert drawn == _all_meshes()      # all 42 shapes, from (1,) to (2, 2, 2) and (4, 2, 1)
    # (shrinking is a search: derandomized, so the same example each run; how far it gets is Hypothesis')
    fixed = settings(derandomize=True, database=None)
    big = find(meshes(max_axes=4, max_axis_size=8, max_size=16), lambda s: math.prod(s) >= 12, settings=fixed)
    assert math.prod(big) == 12 and len(big) <= 3, big     # as small as fits: (2, 6), (3, 4), (2, 2, 3)...
    assert find(meshes(min_axes=3, max_axes=3, max_axis_size=8), lambda s: 8 in s, settings=fixed) == (1, 1, 8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_axes=3, max_axes=2), "meshes(max_axes=...) must be an int >= 3, got 2"),
    (dict(max_size=0), "meshes(max_size=...) must be an int >= 1, got 0"),
    (dict(max_axis_size=0), "meshes(max_axis_size=...) must be an int >= 1, got 0")])
def test_meshes_refuse_impossible_bounds_when_created(kwargs, message):
    # sizes are >= 1, so any max_size >= 1 fits any number of axes; what cannot be met is refused at once
    with pytest.raises(sbp.SbpError, match=re.escape(message)):
        meshes(**kwargs)
