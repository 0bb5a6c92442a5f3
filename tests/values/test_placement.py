"""Placements as values: equality, hashing, reprs, aliases, parsing (the inverse of repr) and `normalize`.

Pure tier: no torch, no processes.
"""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from hypothesis import given, settings, strategies as st

import sbp
from sbp.values.placement import REDUCE_OPS, is_partial, normalize, parse_placement

ACCEPTED = "S(d) or Sd for an int d, B, P, P(sum), P(min), P(max); comma separated, optional ( )"

# ---- strategies ------------------------------------------------------------------------------------
one_placement = st.one_of(
    st.builds(sbp.Split, st.integers(-12, 12)),
    st.just(sbp.B),
    st.sampled_from(REDUCE_OPS).map(sbp.Partial),
)
placement_tuples = st.lists(one_placement, min_size=0, max_size=5).map(tuple)
spaces = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def compact_spellings(draw, pls: tuple) -> str:
    """Another accepted spelling of `pls`: `S0` for `S(0)`, `P` for `P(sum)`, random spaces, maybe wrapped."""
    parts = []
    for p in pls:
        match p:
            case sbp.Split(dim=d):
                token = draw(st.sampled_from([f"S{d}", f"S({d})", f"S( {d} )"]))
            case sbp.Broadcast():
                token = "B"
            case sbp.Partial(op=op):
                token = draw(st.sampled_from(["P", "P(sum)", "P (sum)"])) if op == "sum" else f"P({op})"
        parts.append(draw(spaces) + token + draw(spaces))
    text = ",".join(parts)
    if draw(st.booleans()) and pls:
        text = "(" + text + ")"
    return text


# ---- values ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, text", [
    (sbp.Split(0), "S(0)"),
    (sbp.Split(-1), "S(-1)"),
    (sbp.S(3), "S(3)"),
    (sbp.Broadcast(), "B"),
    (sbp.B, "B"),
    (sbp.Partial(), "P(sum)"),
    (sbp.Partial("sum"), "P(sum)"),
    (sbp.Partial(op="min"), "P(min)"),
    (sbp.Partial("max"), "P(max)"),
    (sbp.PartialSum(), "P(sum)"),
    (sbp.PartialMin(), "P(min)"),
    (sbp.PartialMax(), "P(max)"),
])
def test_repr(p, text):
    assert repr(p) == text
    assert str(p) == text


def test_tuple_reprs():
    assert repr((sbp.S(0), sbp.B)) == "(S(0), B)"
    assert repr((sbp.PartialMax(),)) == "(P(max),)"


def test_aliases():
    assert sbp.S is sbp.Split
    assert isinstance(sbp.B, sbp.Broadcast)
    assert sbp.B == sbp.Broadcast()
    assert sbp.PartialSum() == sbp.Partial("sum") == sbp.Partial()
    assert sbp.PartialMin() == sbp.Partial("min")
    assert sbp.PartialMax() == sbp.Partial("max")
    assert sbp.PartialMin() != sbp.PartialMax()
    assert all(isinstance(f(), sbp.Partial) for f in (sbp.PartialSum, sbp.PartialMin, sbp.PartialMax))


def test_equality_and_hash():
    same = [sbp.S(0), sbp.Split(0), sbp.B, sbp.Broadcast(), sbp.Partial(), sbp.PartialSum(),
            sbp.Partial("max"), sbp.PartialMax()]
    assert set(same) == {sbp.S(0), sbp.B, sbp.Partial("sum"), sbp.Partial("max")}
    assert len(set(same)) == 4
    assert sbp.S(0) != sbp.S(1)
    assert sbp.S(-1) != sbp.S(1)  # dims are normalised only against a tensor
    assert sbp.B != sbp.Partial()
    assert sbp.S(0) != sbp.B
    assert sbp.Partial("sum") != sbp.Partial("min")
    assert sbp.S(0) != 0 and sbp.B != "B" and sbp.Partial() != "P(sum)"
    table = {(sbp.S(0), sbp.B): "row", (sbp.B, sbp.S(0)): "col"}
    assert table[(sbp.Split(0), sbp.Broadcast())] == "row"
    assert hash((sbp.S(1), sbp.PartialMin())) == hash((sbp.Split(1), sbp.Partial("min")))


@pytest.mark.parametrize("p, field", [(sbp.S(0), "dim"), (sbp.Partial(), "op")])
def test_immutable(p, field):
    before = repr(p)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(p, field, 1)
    assert repr(p) == before


def test_no_new_attributes():
    # Slotted: no instance dict. (CPython 3.10/3.11 raise TypeError here for frozen slotted dataclasses,
    # later versions FrozenInstanceError; either way the value is unchanged.)
    for p in (sbp.S(0), sbp.B, sbp.Partial()):
        with pytest.raises((AttributeError, TypeError)):
            p.extra = 1
        assert not hasattr(p, "__dict__")


@given(one_placement)
@settings(max_examples=50, deadline=None)
def test_pickle_and_copy_round_trip(p):
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) == p
    assert copy.copy(p) == p
    # interned: every way of making an equal placement gives the one object
    assert pickle.loads(pickle.dumps(p)) is p and copy.deepcopy(p) is p and copy.copy(p) is p


def test_placements_are_interned():
    """Equal placements are one object however they are made (constructor, alias, parser, replace, an int
    subclass as dim), so identity, equality and hash agree."""
    import enum

    class Dim(enum.IntEnum):
        ONE = 1

    assert sbp.S(1) is sbp.Split(1) is parse_placement("S1") is dataclasses.replace(sbp.S(0), dim=1)
    assert sbp.S(Dim.ONE) is sbp.S(1) and type(sbp.S(Dim.ONE).dim) is int
    assert sbp.Broadcast() is sbp.B and sbp.Partial() is sbp.PartialSum() is sbp.Partial(op="sum")
    assert sbp.Partial("max") is sbp.PartialMax() and sbp.Partial("max") is not sbp.Partial("min")
    assert sbp.placements("S(0), P(min)") == (sbp.S(0), sbp.PartialMin())
    assert all(a is b for a, b in zip(sbp.placements("S(0), P(min)"), (sbp.S(0), sbp.PartialMin())))
    # a refused value never reaches the interned objects
    with pytest.raises(sbp.PlacementError):
        sbp.S(True)
    assert sbp.S(1).dim == 1 and type(sbp.S(1).dim) is int


def test_is_partial():
    assert [is_partial(p) for p in (sbp.S(0), sbp.B, sbp.PartialSum(), sbp.PartialMax())] == [False, False, True, True]


def test_kind_methods_answer_as_isinstance():
    ps = (sbp.S(0), sbp.S(1), sbp.S(-1), sbp.B, sbp.PartialSum(), sbp.PartialMax())
    assert [p.is_split() for p in ps] == [isinstance(p, sbp.Split) for p in ps] == [True] * 3 + [False] * 3
    assert [p.is_split(1) for p in ps] == [False, True, False, False, False, False]
    assert [p.is_shard(dim=-1) for p in ps] == [False, False, True, False, False, False]
    assert [p.is_broadcast() for p in ps] == [p.is_replicate() for p in ps] == [False] * 3 + [True, False, False]
    assert [p.is_partial() for p in ps] == [is_partial(p) for p in ps]
    assert [p.is_partial("max") for p in ps] == [False] * 5 + [True]


@pytest.mark.parametrize("make, message", [
    (lambda: sbp.Split(True), "Split dim must be an int, got True (bool)"),
    (lambda: sbp.Split("0"), "Split dim must be an int, got '0' (str)"),
    (lambda: sbp.Split(1.0), "Split dim must be an int, got 1.0 (float)"),
    (lambda: sbp.Partial("mean"), "Partial op must be one of ('sum', 'min', 'max'), got 'mean'"),
    (lambda: sbp.Partial(None), "Partial op must be one of ('sum', 'min', 'max'), got None"),
    (lambda: sbp.Partial("SUM"), "Partial op must be one of ('sum', 'min', 'max'), got 'SUM'"),
])
def test_invalid_values(make, message):
    with pytest.raises(sbp.PlacementError) as info:
        make()
    assert str(info.value) == message


# ---- parsing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("S(0), B", (sbp.S(0), sbp.B)),
    ("S0,B", (sbp.S(0), sbp.B)),
    ("(S(0), B)", (sbp.S(0), sbp.B)),
    ("  ( S(0) ,B )  ", (sbp.S(0), sbp.B)),
    ("P", (sbp.PartialSum(),)),
    ("P(sum)", (sbp.PartialSum(),)),
    ("P(min)", (sbp.PartialMin(),)),
    ("P(max)", (sbp.PartialMax(),)),
    ("S(0)", (sbp.S(0),)),
    ("(S(0))", (sbp.S(0),)),
    ("(S(0),)", (sbp.S(0),)),
    ("S(-1), S-2", (sbp.S(-1), sbp.S(-2))),
    ("S(+1)", (sbp.S(1),)),
    ("S( -1 )", (sbp.S(-1),)),
    ("S(12),B,P(max),P", (sbp.S(12), sbp.B, sbp.PartialMax(), sbp.PartialSum())),
    ("R", (sbp.B,)),  # DTensor's Replicate, accepted on input
    ("()", ()),
])
def test_parse_table(text, expected):
    assert sbp.placements(text) == expected


def test_parse_objects_and_mixtures():
    assert sbp.placements(sbp.S(1)) == (sbp.S(1),)
    assert sbp.placements(sbp.B) == (sbp.B,)
    assert sbp.placements([sbp.S(0), "B"]) == (sbp.S(0), sbp.B)
    assert sbp.placements(("P(max)", sbp.S(-1))) == (sbp.PartialMax(), sbp.S(-1))
    assert sbp.placements(p for p in [sbp.B, sbp.B]) == (sbp.B, sbp.B)
    assert sbp.placements([]) == ()


def test_parse_placement_single():
    assert parse_placement("S(1)") == sbp.S(1)
    assert parse_placement(" S3 ") == sbp.S(3)
    assert parse_placement("B") == sbp.B
    assert parse_placement("P") == sbp.PartialSum()


@pytest.mark.slow
@given(placement_tuples)
@settings(max_examples=200, deadline=None)
def test_parse_is_inverse_of_repr(pls):
    assert sbp.placements(repr(pls)) == pls
    assert sbp.placements(", ".join(repr(p) for p in pls)) == pls
    assert sbp.placements([repr(p) for p in pls]) == pls


@given(one_placement)
@settings(max_examples=100, deadline=None)
def test_parse_single_placement_repr(p):
    assert parse_placement(repr(p)) == p
    assert sbp.placements(repr(p)) == (p,)
    assert sbp.placements(repr((p,))) == (p,)


@pytest.mark.slow
@given(placement_tuples.flatmap(lambda pls: st.tuples(st.just(pls), compact_spellings(pls))))
@settings(max_examples=200, deadline=None)
def test_parse_compact_spellings(case):
    pls, text = case
    assert sbp.placements(text) == pls


@given(st.text(alphabet="SBPRsbp()0123456789+-, xminaumeQ", max_size=14))
@settings(max_examples=300, deadline=None)
def test_parse_never_crashes_and_round_trips(text):
    """Any string either parses (and its result round-trips) or raises PlacementError, never another error."""
    try:
        pls = sbp.placements(text)
    except sbp.PlacementError as e:
        assert "cannot parse placement" in str(e)
        return
    assert isinstance(pls, tuple)
    assert all(isinstance(p, (sbp.Split, sbp.Broadcast, sbp.Partial)) for p in pls)
    assert sbp.placements(repr(pls)) == pls


@pytest.mark.parametrize("text", ["Q", "S", "S(x)", "s(0)", "S(1.5)", "P(sum", "B()", "S(0) B", "S(0),,B",
                                  "((S(0), B))", "Split(0)", "S(0), X", "P(mean)", "S(0)(1)", "b"])
def test_garbage_raises(text):
    with pytest.raises(sbp.PlacementError) as info:
        sbp.placements(text)
    assert isinstance(info.value, sbp.SbpError)
    assert isinstance(info.value, ValueError)
    assert "cannot parse placement" in str(info.value)


@pytest.mark.parametrize("spec, message", [
    ("Q", f"cannot parse placement 'Q'; accepted: {ACCEPTED}"),
    ("S(0), X", f"cannot parse placement 'X'; accepted: {ACCEPTED}"),
    ("S(0),,B", f"cannot parse placement ''; accepted: {ACCEPTED}"),
    ("S(1.5)", f"cannot parse placement 'S(1.5)'; accepted: {ACCEPTED}"),
    ("P(mean)", "cannot parse placement 'P(mean)': Partial op 'mean' is not one of ('sum', 'min', 'max')"),
    (3, "placements must be a string, a placement or an iterable of placements, got int"),
    (None, "placements must be a string, a placement or an iterable of placements, got NoneType"),
    ([sbp.S(0), 3], f"3 is not a placement; accepted: {ACCEPTED} or sbp.Split/Broadcast/Partial"),
])
def test_parse_error_messages(spec, message):
    with pytest.raises(sbp.PlacementError) as info:
        sbp.placements(spec)
    assert str(info.value) == message


def test_error_hierarchy():
    errors = [sbp.PlacementError, sbp.MeshError, sbp.ShapeError, sbp.PlanError, sbp.CommError,
              sbp.RankMismatchError, sbp.CheckpointError, sbp.UnsupportedOpError]
    assert issubclass(sbp.SbpError, ValueError)
    assert all(issubclass(e, sbp.SbpError) for e in errors)
    with pytest.raises(ValueError):  # a user can catch every sbp error as a ValueError
        sbp.placements("nonsense")


# ---- normalize -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, ndim, mesh_ndim, expected", [
    ("S(-1), B", 2, 2, (sbp.S(1), sbp.B)),
    ("S(-2), S(1)", 2, 2, (sbp.S(0), sbp.S(1))),
    ("S(0)", 1, 1, (sbp.S(0),)),
    ("S(-3), P(max), B", 3, 3, (sbp.S(0), sbp.PartialMax(), sbp.B)),
    ("B, P", 0, 2, (sbp.B, sbp.PartialSum())),
    ([sbp.S(-1)], 4, 1, (sbp.S(3),)),
])
def test_normalize(spec, ndim, mesh_ndim, expected):
    assert normalize(spec, ndim, mesh_ndim) == expected
    assert normalize(expected, ndim, mesh_ndim) == expected  # idempotent


@pytest.mark.parametrize("spec, ndim, mesh_ndim, message", [
    ("S(2), B", 2, 2, "S(2) is out of range for a 2-d tensor (valid: -2..1)"),
    ("B, S(-3)", 2, 2, "S(-3) is out of range for a 2-d tensor (valid: -2..1)"),
    ("S(1)", 1, 1, "S(1) is out of range for a 1-d tensor (valid: -1..0)"),
    ("S(0)", 0, 1, "S(0) is out of range for a 0-d tensor (valid: none: a 0-d tensor cannot be split)"),
    ("S(0)", 2, 2, "placements (S(0),) give 1 placement(s) but the mesh has 2 axes "
                   "(need exactly one placement per mesh axis)"),
    ("S(0), B, B", 2, 2, "placements (S(0), B, B) give 3 placement(s) but the mesh has 2 axes "
                         "(need exactly one placement per mesh axis)"),
])
def test_normalize_errors(spec, ndim, mesh_ndim, message):
    with pytest.raises(sbp.PlacementError) as info:
        normalize(spec, ndim, mesh_ndim)
    assert str(info.value) == message


@given(st.integers(0, 5).flatmap(lambda ndim: st.tuples(st.just(ndim), placement_tuples)))
@settings(max_examples=200, deadline=None)
def test_normalize_property(case):
    ndim, pls = case
    in_range = all(-ndim <= p.dim < ndim for p in pls if isinstance(p, sbp.Split))
    if not in_range:
        with pytest.raises(sbp.PlacementError, match="is out of range for a"):
            normalize(pls, ndim, len(pls))
        return
    out = normalize(pls, ndim, len(pls))
    assert len(out) == len(pls)
    for before, after in zip(pls, out):
        if isinstance(before, sbp.Split):
            assert after == sbp.Split(before.dim % ndim) and 0 <= after.dim < ndim
        else:
            assert after == before
