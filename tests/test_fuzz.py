"""Fuzzing: every input either works or raises `sbp.SbpError` -- nothing else.

* `sbp.placements` on arbitrary and near-valid strings (and a parsed tuple's repr parses back to it);
* the command line, ``sbp.__main__.main(argv)``: exit status 0 or 2, never a traceback, an error line on
  stderr for status 2;
* checkpoints (`sbp.load`) whose metadata.json or rank files were truncated, flipped or edited.

Hypothesis runs a modest number of examples (deadline off) so the file stays within seconds.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sbp
import sbp.testing

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- placements strings -------------------------------------------------------------------------------

NEAR = st.text(alphabet="SBPR()0123456789-+, sumaxinSBP\t", max_size=24)
ATOMS = st.sampled_from(["S(0)", "S1", "S(-1)", "B", "R", "P", "P(sum)", "P(min)", "P(max)", "S( 2 )", "P( max )"])


@FUZZ
@given(st.one_of(NEAR, st.text(max_size=24), st.lists(ATOMS, max_size=5).map(", ".join),
                 st.lists(ATOMS, min_size=1, max_size=4).map(lambda xs: "(" + ",".join(xs) + ",)")))
def test_placements_strings_parse_or_raise_placement_error(text):
    try:
        parsed = sbp.placements(text)
    except sbp.PlacementError:
        return
    assert isinstance(parsed, tuple)
    assert sbp.placements(repr(parsed)) == parsed       # repr is the inverse of parsing


@FUZZ
@given(st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=6), st.none(), st.floats(), ATOMS), max_size=4),
       st.integers(0, 3), st.integers(1, 3))
def test_placements_objects_normalize_or_raise(items, ndim, mesh_ndim):
    """Any list handed to a layout function is either valid or a PlacementError (never TypeError)."""
    from sbp.values.placement import normalize
    try:
        out = normalize(items, ndim, mesh_ndim)
    except sbp.PlacementError:
        return
    assert len(out) == mesh_ndim and all(not isinstance(p, sbp.Split) or 0 <= p.dim < ndim for p in out)


# ---- the command line ---------------------------------------------------------------------------------

def run_cli(argv: list[str]) -> tuple[int, str, str]:
    from sbp.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)     # an exception here fails the test: the CLI must never raise
    return code, out.getvalue(), err.getvalue()


# at most 4 mesh axes: the planner's search grows fast with Partial sources on more axes (see docs/errors.md)
DIMS = st.one_of(st.lists(st.integers(0, 64), min_size=1, max_size=3).map(lambda xs: "x".join(map(str, xs))),
                 st.text(alphabet="0123456789x-() ", max_size=7))
MESH = st.one_of(st.lists(st.integers(1, 4), min_size=1, max_size=4).map(lambda xs: "x".join(map(str, xs))),
                 st.text(alphabet="0123456789x- ", max_size=7))
PLACEMENTS = st.one_of(st.lists(ATOMS, min_size=1, max_size=4).map(",".join), NEAR)
DTYPE = st.one_of(st.sampled_from(["float32", "bfloat16", "torch.int8", "bool", "complex128"]), st.text(max_size=8))
OPTION = st.one_of(
    st.tuples(st.just("--mesh"), MESH), st.tuples(st.just("--shape"), DIMS),
    st.tuples(st.just("--src"), PLACEMENTS), st.tuples(st.just("--dst"), PLACEMENTS),
    st.tuples(st.just("--dtype"), DTYPE), st.tuples(st.just("--latency-bytes"), st.one_of(
        st.integers(-5, 10 ** 6).map(str), st.text(max_size=5))),
    st.tuples(st.just("--json")), st.tuples(st.text(max_size=8)))


@pytest.mark.slow
@FUZZ
@given(st.sampled_from([["plan"], [], ["plot"]]), st.lists(OPTION, max_size=7))
def test_cli_exits_0_or_2_without_traceback(command, options):
    argv = command + [part for option in options for part in option]
    code, out, err = run_cli(argv)
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err and "Traceback" not in out
    if code == 2:
        assert "error" in err and err.strip(), (argv, err)


@pytest.mark.slow
@FUZZ
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.lists(st.integers(0, 12), min_size=0, max_size=3),
       st.data())
def test_cli_valid_requests_match_the_planner(mesh, shape, data):
    """Well-formed requests always succeed and print the planner's own numbers."""
    src = data.draw(sbp.testing.placements(len(mesh), len(shape)))
    dst = data.draw(sbp.testing.placements(len(mesh), len(shape)))
    argv = ["plan", "--mesh", "x".join(map(str, mesh)), "--shape", "x".join(map(str, shape)) or "()",
            "--src", ",".join(map(repr, src)), "--dst", ",".join(map(repr, dst)), "--json"]
    code, out, err = run_cli(argv)
    assert code == 0, (argv, err)
    got = json.loads(out)
    p = sbp.plan(tuple(shape), tuple(mesh), src, dst)
    assert (got["bytes_per_rank"], got["num_collectives"]) == (p.bytes_per_rank, p.num_collectives)


# ---- checkpoints ----------------------------------------------------------------------------------------

def _save(mesh, path):
    state = {"x": sbp.distribute(torch.arange(12.).view(4, 3), mesh, "S(0)"),
             "y": sbp.distribute(torch.arange(6).view(2, 3), mesh, "B"),
             "plain": torch.ones(2), "step": 3}
    sbp.save(state, path)


@pytest.fixture(scope="module")
def checkpoint():
    root = tempfile.mkdtemp(prefix="sbp-fuzz-")
    path = os.path.join(root, "ok")
    sbp.testing.spmd(lambda mesh: _save(mesh, path), (2,))
    missing = [f for f in RANK_FILES if not os.path.exists(os.path.join(path, f))]
    assert not missing, f"the mutations below target files a save no longer writes: {missing}"
    yield path
    shutil.rmtree(root, ignore_errors=True)


def _target() -> dict:
    return {"x": torch.zeros(4, 3), "y": torch.zeros(2, 3, dtype=torch.int64), "plain": torch.zeros(2), "step": 0}


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 10 ** 12), st.floats(allow_nan=True),
                              st.text(max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner,
                                                                                          max_size=3)),
                    max_leaves=6)


def _edit_json(meta, choices: list[int], value, delete: bool):
    """Walk into `meta` following `choices`; replace (or delete) the value found there (anywhere: the
    tensors and the "files" table alike)."""
    node, key = meta, None
    parent = None
    for c in choices:
        if isinstance(node, dict) and node:
            parent, key = node, sorted(node)[c % len(node)]
        elif isinstance(node, list) and node:
            parent, key = node, c % len(node)
        else:
            break
        node = parent[key]
    if parent is None:
        return value
    if delete and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = value
    return meta


# what a two-rank save leaves: the switch file and the rank files of its generation directory
RANK_FILES = ["metadata.json", "gen-00000001/rank00000.pt", "gen-00000001/rank00001.pt"]
MUTATION = st.one_of(
    st.tuples(st.just("truncate"), st.sampled_from(RANK_FILES),
              st.floats(0, 1)),
    st.tuples(st.just("flip"), st.sampled_from(RANK_FILES),
              st.floats(0, 1), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.sampled_from(RANK_FILES)),
    st.tuples(st.just("edit"), st.lists(st.integers(0, 50), min_size=1, max_size=7), JSON, st.booleans()),
)


@pytest.mark.slow
@FUZZ
@given(st.lists(MUTATION, min_size=1, max_size=3))
def test_damaged_checkpoints_load_or_raise_checkpoint_error(checkpoint, mutations):
    work = tempfile.mkdtemp(prefix="sbp-fuzz-case-")
    try:
        path = os.path.join(work, "ck")
        shutil.copytree(checkpoint, path)
        for m in mutations:
            _mutate(path, m)
        try:
            state = sbp.load(path, _target())
        except sbp.SbpError:
            return
        assert set(state) == {"x", "y", "plain", "step"}   # it loaded: an edit that kept the checkpoint valid
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mutate(path: str, mutation) -> None:
    kind, *args = mutation
    if kind == "edit":
        file = os.path.join(path, "metadata.json")
        if not os.path.exists(file):
            return
        try:
            meta = json.loads(open(file, "rb").read())
        except ValueError:
            return
        choices, value, delete = args
        meta = _edit_json(meta, choices, value, delete)
        with open(file, "w") as f:
            json.dump(meta, f)
        return
    file = os.path.join(path, args[0])
    if not os.path.exists(file):
        return
    if kind == "delete":
        os.remove(file)
        return
    data = bytearray(open(file, "rb").read())
    at = min(int(args[1] * len(data)), max(len(data) - 1, 0))
    if kind == "truncate":
        data = data[:at]
    elif data:
        data[at] = args[2]
    with open(file, "wb") as f:
        f.write(bytes(data))


def test_checkpoint_fuzz_baseline_loads(checkpoint):
    state = sbp.load(checkpoint, _target())
    assert torch.equal(state["x"], torch.arange(12.).view(4, 3)) and state["step"] == 3


# What the checkpoint fuzz once found in sbp/io/checkpoint.py: metadata.json's "files" entries were used
# unchecked, so an edited entry crashed `load` with a bare KeyError / TypeError. Pinned here.
@pytest.mark.parametrize("edit, fragment", [
    pytest.param(lambda files: files["rank00000.pt"].pop("sha256"), "the entry has no 'sha256'",
                 id="entry-without-sha256"),
    pytest.param(lambda files: files["rank00000.pt"].pop("bytes"), "the entry has no 'bytes'",
                 id="entry-without-bytes"),
    pytest.param(lambda files: files.__setitem__("rank00000.pt", []), "the entry is a list, not an object",
                 id="entry-is-a-list"),
    pytest.param(lambda files: files["rank00000.pt"].__setitem__("bytes", "12"), "bytes '12' is not a non-negative int",
                 id="bytes-is-a-str"),
    pytest.param(lambda files: files["rank00000.pt"].__setitem__("bytes", True), "bytes True is not a non-negative int",
                 id="bytes-is-a-bool"),
    pytest.param(lambda files: files["rank00000.pt"].__setitem__("sha256", 7),
                 "sha256 7 is not 64 lowercase hex digits", id="sha256-is-an-int"),
    pytest.param(lambda files: files.__setitem__("../rank00000.pt", files.pop("rank00000.pt")),
                 "is not a file name inside the checkpoint directory", id="name-outside-the-directory"),
])
def test_edited_file_entries_raise_checkpoint_error(checkpoint, tmp_path, edit, fragment):
    path = tmp_path / "ck"
    shutil.copytree(checkpoint, path)
    meta = json.loads((path / "metadata.json").read_text())
    edit(meta["files"])
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(sbp.CheckpointError) as info:
        sbp.load(str(path), _target())
    assert fragment in str(info.value) and "'files' entry" in str(info.value), str(info.value)
