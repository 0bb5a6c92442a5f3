"""Checkpoints under faults: a DCP save that fails on one rank, saves of different formats into one
directory, loads that fail (on every rank or on one), and ranks that save different values.

Each test states the rule it checks; the threads tier runs the sbp format and safetensors, the gloo
tier (`torch.distributed`) the DCP cases. Worker functions are module-level (they travel pickled).
"""
from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch

import sbp
import sbp.testing
from sbp.io.state import host_barrier
from sbp.values.errors import CheckpointError, RankMismatchError

gloo = functools.partial(sbp.testing.spmd, backend="gloo", timeout=60)
pytestmark = pytest.mark.filterwarnings("ignore::sbp.tensor.global_tensor.FallbackWarning")


def state(mesh, step, shape_b=(6,)):
    return {"a": sbp.distribute(torch.full((8, 4), float(step)), mesh, "S(0)"),
            "b": sbp.distribute(torch.full(shape_b, float(step)), mesh, "S(0)"),
            "step": step}


def _save(mesh, path, step, fmt="sbp"):
    sbp.save(state(mesh, step), path, format=fmt)


def _loaded(mesh, path):
    """(step, the distinct values of 'a' and 'b') of the checkpoint at `path`, or the error it raised."""
    sd = state(mesh, 0)
    try:
        sbp.load(path, sd)
    except sbp.SbpError as e:
        return f"{type(e).__name__}: {e}"
    return sd["step"], torch.unique(torch.cat([sd["a"].full().flatten(), sd["b"].full()])).tolist()


# ---- a DCP save that fails on one rank -----------------------------------------------------------------------

def _failing_dcp_save(mesh, path, step, fail_rank):
    """`sbp.save(format="dcp")` whose file write fails on `fail_rank` (after the others wrote theirs)."""
    import torch.distributed.checkpoint.filesystem as fs

    real = fs.FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        raise OSError("injected: disk full while writing")
    if mesh.rank == fail_rank:
        fs.FileSystemWriter.write_data = full_disk
    try:
        _save(mesh, path, step, "dcp")
        return "saved"
    except CheckpointError as e:
        return str(e)
    finally:
        fs.FileSystemWriter.write_data = real   # the gloo worker is reused by later tests


def _dtensor_reads(mesh, path):
    """What DTensor code's `torch.distributed.checkpoint.load` reads from the committed directory."""
    import torch.distributed.checkpoint as dcp

    sd = {"a": torch.zeros(8, 4), "b": torch.zeros(6), "step": -1}
    dcp.load(sd, checkpoint_id=path)
    return sd["step"], torch.unique(torch.cat([sd["a"].flatten(), sd["b"]])).tolist()


@pytest.mark.gloo
def test_a_dcp_save_that_fails_on_one_rank_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path)
    gloo(functools.partial(_save, path=path, step=1, fmt="dcp"), (2,))
    got = gloo(functools.partial(_failing_dcp_save, path=path, step=2, fail_rank=1), (2,))
    # every rank learns the save failed, in one line (it was DCP's page of every rank's traceback)
    assert got == ["save failed on rank 1: OSError: injected: disk full while writing; nothing was committed: the "
                   "previous checkpoint is intact"] * 2, got
    assert gloo(functools.partial(_loaded, path=path), (2,))[0] == (1, [1.0])      # the old state, whole
    assert gloo(functools.partial(_dtensor_reads, path=path), (2,))[0] == (1, [1.0])
    assert sorted(os.listdir(path)) == [".metadata", "gen-00000001", "gen-00000002"]
    gloo(functools.partial(_save, path=path, step=3, fmt="dcp"), (2,))
    assert sorted(os.listdir(path)) == [".metadata", "gen-00000003"]   # the failed save's data went too
    assert gloo(functools.partial(_loaded, path=path), (2,))[0] == (3, [3.0])
    assert gloo(functools.partial(_dtensor_reads, path=path), (2,))[0] == (3, [3.0])


def _disk_full_save(mesh, path, step, fmt, where, error=OSError):
    """`sbp.save` whose file write fails on rank 1 (`where="write"`) or whose commit fails on coord 0
    (`where="commit"`): a full disk (`error=OSError`) or whatever else a write may raise (`MemoryError`)."""
    real_save, real_pwrite, real_replace = torch.save, os.pwrite, os.replace

    def full(*args, **kw):
        raise (OSError(28, "injected: no space left on device") if error is OSError
               else error("injected: no space left on device"))

    def full_at_commit(src, dst, *args, **kw):
        if os.path.basename(dst) in ("metadata.json", "model.safetensors"):
            full()
        return real_replace(src, dst, *args, **kw)
    if where == "write" and mesh.rank == 1:
        torch.save, os.pwrite = full, full
    if where == "commit" and mesh.rank == 0:
        os.replace = full_at_commit
    try:
        _save(mesh, path, step, fmt)
        return "saved"
    except CheckpointError as e:
        return str(e)
    finally:
        torch.save, os.pwrite, os.replace = real_save, real_pwrite, real_replace   # the worker is reused


@pytest.mark.gloo
@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
@pytest.mark.parametrize("where, error", [("write", OSError), ("commit", OSError), ("write", MemoryError),
                                          ("commit", MemoryError)])
def test_a_save_that_fails_on_one_rank_raises_on_every_rank_at_once(tmp_path, fmt, where, error):
    """No rank waits out the collective timeout for a rank whose write or commit failed, whatever the error
    (an OSError was carried before, a MemoryError left the others in the gather until the timeout): the failure
    rides on the save's own agreement steps; the previous checkpoint still loads."""
    path = str(tmp_path)
    gloo(functools.partial(_save, path=path, step=1, fmt=fmt), (4,))
    got = sbp.testing.spmd(functools.partial(_disk_full_save, path=path, step=2, fmt=fmt, where=where,
                                             error=error), (4,), backend="gloo", timeout=20)
    failing = 1 if where == "write" else 0
    assert "injected: no space left on device" in got[failing], got
    for rank, message in enumerate(got):
        if rank != failing:
            assert "failed" in message and "the previous" in message and "unchanged" in message, got
    assert gloo(functools.partial(_loaded, path=path), (2,))[0] == (1, [1.0])
    assert not [name for name in os.listdir(path) if name.endswith(".tmp")]
    gloo(functools.partial(_save, path=path, step=3, fmt=fmt), (4,))
    assert gloo(functools.partial(_loaded, path=path), (2,))[0] == (3, [3.0])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # one process is the intent
def test_dcp_saves_in_one_process_switch_generations(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(4), "step": 0}, checkpoint_id=tmp_path)   # DTensor code: flat
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp"]
    for step in (1, 2):
        sbp.save({"w": torch.full((4,), float(step)), "step": step}, tmp_path, format="dcp")
        assert sorted(os.listdir(tmp_path)) == [".metadata", f"gen-{step:08d}"]
        sd = {"w": torch.zeros(4), "step": 0}
        dcp.load(sd, checkpoint_id=tmp_path)
        assert sd["step"] == step and sd["w"].tolist() == [float(step)] * 4
    sd = {"w": torch.zeros(4), "step": 0}
    sbp.load(tmp_path, sd)
    assert sd["step"] == 2 and sd["w"].tolist() == [2.0] * 4


class Killed(Exception):
    pass


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("stage", ["before the switch", "after the switch"])
def test_a_dcp_save_that_dies_at_its_commit_loads_as_old_or_new(tmp_path, monkeypatch, stage):
    from sbp.io import dcp as sbp_dcp

    def save(step):
        sbp.save({"w": torch.full((4,), float(step)), "step": step}, tmp_path, format="dcp")

    def loaded():
        sd = {"w": torch.zeros(4), "step": 0}
        sbp.load(tmp_path, sd)
        return sd["step"], torch.unique(sd["w"]).tolist()

    def killed(*args, **kwargs):
        raise Killed(stage)
    save(1)
    if stage == "before the switch":   # DCP's files and its inner metadata are written, .metadata not replaced
        monkeypatch.setattr(sbp_dcp.os, "replace", killed)
    else:                              # .metadata replaced, the previous data not yet removed
        monkeypatch.setattr(sbp_dcp, "retire_others", killed)
    with pytest.raises((Killed, CheckpointError)):
        save(2)
    monkeypatch.undo()
    assert sorted(n for n in os.listdir(tmp_path) if n != ".metadata.tmp") == [
        ".metadata", "gen-00000001", "gen-00000002"]
    assert loaded() == ((1, [1.0]) if stage == "before the switch" else (2, [2.0]))
    save(3)
    assert sorted(os.listdir(tmp_path)) == [".metadata", "gen-00000003"] and loaded() == (3, [3.0])


# ---- saves of different formats into one directory --------------------------------------------------------

PAIRS = [("sbp", "dcp"), ("dcp", "sbp"), ("sbp", "safetensors"), ("safetensors", "sbp"),
         ("dcp", "safetensors"), ("safetensors", "dcp")]


def _two_formats(mesh, path, first, second):
    _save(mesh, path, 1, first)
    _save(mesh, path, 2, second)
    return _loaded(mesh, path)


@pytest.mark.gloo
@pytest.mark.parametrize("first, second", PAIRS)
def test_the_newest_save_loads_whatever_its_format(tmp_path, first, second):
    got = gloo(functools.partial(_two_formats, path=str(tmp_path), first=first, second=second), (2,))
    assert got == [(2, [2.0])] * 2
    names = set(os.listdir(tmp_path))
    commits = {"sbp": "metadata.json", "dcp": ".metadata"}
    assert {commits[f] for f in (first, second) if f in commits} & names == \
        ({commits[second]} if second in commits else set())   # the older format's commit file is gone


def _torch_dcp_over_sbp(mesh, path):
    """An sbp checkpoint, then a newer state saved by torch's own dcp.save (DTensor code), which removes no
    metadata.json, into the same directory."""
    import time

    import torch.distributed.checkpoint as torch_dcp
    _save(mesh, path, 1)
    time.sleep(0.05)                                    # (the two commits' modification times differ)
    newer = {"a": torch.full((8, 4), 2.0), "b": torch.full((6,), 2.0), "step": 2}
    torch_dcp.save(newer, checkpoint_id=path)
    with_dcp = {"a": torch.zeros(8, 4), "b": torch.zeros(6), "step": 0}
    torch_dcp.load(with_dcp, checkpoint_id=path)
    return _loaded(mesh, path), with_dcp["step"]


@pytest.mark.gloo
def test_a_newer_dcp_save_by_torch_over_an_sbp_checkpoint_is_what_loads(tmp_path):
    """sbp.load read metadata.json whenever it was there: after torch's dcp.save of a newer state into an sbp
    checkpoint's directory it silently loaded the older sbp state (step 1) where dcp.load reads step 2. Of two
    commit files the newer is read."""
    got = gloo(functools.partial(_torch_dcp_over_sbp, path=str(tmp_path)), (2,))
    assert {".metadata", "metadata.json"} <= set(os.listdir(tmp_path))
    assert got == [((2, [2.0]), 2)] * 2


# ---- loads that fail change nothing --------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    sbp.testing.spmd(functools.partial(_save, path=tmp_path, step=7), (4,))
    return tmp_path


def _failed_load(mesh, path, damage):
    """Load into a state dict that a check refuses; return the error and what the targets hold after."""
    sd = state(mesh, 0, shape_b=(7,) if damage == "shape of b" else (6,))
    sd["p"] = sbp.from_local(torch.ones(3), mesh, "P(sum)", global_shape=(3,))   # P(sum): zeroed off coord 0
    try:
        sbp.load(path, sd, strict=False)
        error = None
    except sbp.SbpError as e:
        error = type(e).__name__
    return error, torch.unique(sd["a"].to_local()).tolist(), sd["p"].to_local().tolist(), sd["step"]


@pytest.mark.parametrize("damage", ["shape of b", "truncated file"])
def test_a_failed_load_changes_nothing(saved, damage):
    if damage == "truncated file":
        file = saved / json.loads((saved / "metadata.json").read_text())["data"] / "rank00003.pt"
        file.write_bytes(file.read_bytes()[:-10])
    got = sbp.testing.spmd(functools.partial(_failed_load, path=saved, damage=damage), (4,))
    assert got == [("CheckpointError", [0.0], [1.0, 1.0, 1.0], 0)] * 4


def _unwritable_target(mesh, path, kind):
    """Load into a state dict one of whose targets the load cannot fill in place; the error and what the others
    hold after."""
    sd = state(mesh, 0)
    sd["p"] = sbp.from_local(torch.ones(3), mesh, "P(sum)", global_shape=(3,))   # P(sum): zeroed off coord 0
    if kind == "meta global":         # a model built on the meta device, its state_dict taken before to_empty
        sd["b"] = sbp.distribute(torch.empty(6, device="meta"), mesh, "S(0)")
    elif kind == "meta plain":
        sd["b"] = torch.empty(6, device="meta")
    elif kind == "expand":
        sd["b"] = torch.zeros(1).expand(6)
    else:                             # a tensor made under torch.inference_mode(), loaded outside it
        with torch.inference_mode():
            sd["b"] = torch.zeros(6)
    try:
        sbp.load(path, sd, strict=False)
        error = "returned normally"
    except sbp.SbpError as e:
        error = f"{type(e).__name__}: {e}"
    return error, torch.unique(sd["a"].to_local()).tolist(), sd["p"].to_local().tolist(), sd["step"]


WHY = {"meta global": "is on the meta device (no storage)", "meta plain": "is on the meta device (no storage)",
       "expand": "shares memory between its elements (an expand)", "inference": "is an inference tensor"}


@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
@pytest.mark.parametrize("kind", list(WHY))
def test_a_target_the_load_cannot_fill_is_refused_before_anything_is_written(tmp_path, fmt, kind):
    """A target on the meta device used to be "loaded" as a no-op (the load returned, nothing was in it); an
    expanded or inference target failed with torch's RuntimeError after the other keys were written (the
    safetensors reader; the sbp format already refused an expand). All are refused before any write."""
    sbp.testing.spmd(functools.partial(_save, path=str(tmp_path), step=7, fmt=fmt), (2,))
    got = sbp.testing.spmd(functools.partial(_unwritable_target, path=str(tmp_path), kind=kind), (2,))
    for error, a, p, step in got:
        assert error.startswith(f"CheckpointError: tensor 'b': the state_dict's tensor {WHY[kind]}"), got
        assert (a, p, step) == ([0.0], [1.0, 1.0, 1.0], 0)


@pytest.mark.gloo
def test_a_meta_target_is_refused_by_a_dcp_load_before_anything_is_written(tmp_path):
    """DCP's planner swaps a meta tensor for a new one and loaded into that: nothing into the state dict."""
    gloo(functools.partial(_save, path=str(tmp_path), step=7, fmt="dcp"), (2,))
    for kind in ("meta global", "expand"):
        got = gloo(functools.partial(_unwritable_target, path=str(tmp_path), kind=kind), (2,))
        for error, a, p, step in got:
            assert error.startswith(f"CheckpointError: tensor 'b': the state_dict's tensor {WHY[kind]}"), got
            assert (a, p, step) == ([0.0], [1.0, 1.0, 1.0], 0)


def _truncated_dcp_load(mesh, path):
    _save(mesh, path, 7, "dcp")
    if mesh.rank == 0:
        file = next(os.path.join(d, "__1_0.distcp") for d, _, names in os.walk(path) if "__1_0.distcp" in names)
        with open(file, "r+b") as f:                     # rank 1's chunks: only rank 1 reads them
            f.truncate(os.path.getsize(file) // 2)
    host_barrier(mesh)                                   # the damage is done before anyone loads
    return _one_rank_fails(mesh, path)


@pytest.mark.gloo
def test_a_truncated_dcp_file_fails_the_load_on_every_rank_before_any_write(tmp_path):
    got = gloo(functools.partial(_truncated_dcp_load, path=str(tmp_path)), (2,))
    assert got[1][0].startswith("DCP checkpoint file") and "__1_0.distcp' has" in got[1][0], got
    assert got[0][0] == f"load failed on rank 1: {got[1][0]}"
    assert [values for _, values in got] == [[0.0]] * 2


def _damaged_dcp_load(mesh, path):
    _save(mesh, path, 7, "dcp")
    if mesh.rank == 0:   # bytes changed inside rank 1's file, its size kept (what a size check cannot see)
        file = next(os.path.join(d, "__1_0.distcp") for d, _, names in os.walk(path) if "__1_0.distcp" in names)
        with open(file, "rb") as f:
            data = f.read()
        assert b"torch._utils" in data
        with open(file, "wb") as f:
            f.write(data.replace(b"torch._utils", b"torch._utilz"))
    host_barrier(mesh)
    return _one_rank_fails(mesh, path)


@pytest.mark.gloo
def test_a_damaged_dcp_file_raises_a_checkpoint_error_naming_it(tmp_path):
    """A DCP file whose bytes changed (DCP keeps no checksum) used to fail with DCP's page of traceback
    ("torch.distributed.checkpoint failed: CheckpointException ranks:dict_keys([1]) Traceback ..."); where
    torch cannot read an entry back, the error now names the file on every rank."""
    got = gloo(functools.partial(_damaged_dcp_load, path=str(tmp_path)), (2,))
    assert got[1][0].startswith("cannot read DCP checkpoint file ") and "__1_0.distcp'" in got[1][0], got
    assert "it is corrupt or altered" in got[1][0] and "Traceback" not in got[1][0], got
    assert got[0][0] == f"load failed on rank 1: {got[1][0]}"


def _one_rank_fails(mesh, path):
    sd = state(mesh, 0)
    try:
        sbp.load(path, sd)
        error = "returned normally"
    except CheckpointError as e:
        error = str(e)
    return error, torch.unique(sd["a"].to_local()).tolist()


def _flip_a_byte_of_rank3(path):
    file = path / json.loads((path / "metadata.json").read_text())["data"] / "rank00003.pt"
    data = bytearray(file.read_bytes())
    data[-40] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_when_one_rank_cannot_load_every_rank_raises(saved, backend):
    _flip_a_byte_of_rank3(saved)      # only rank 3 (of 4, S(0)) reads rank00003.pt
    got = sbp.testing.spmd(functools.partial(_one_rank_fails, path=str(saved)), (4,), backend=backend)
    assert "rank00003.pt' does not match its SHA-256" in got[3][0] and "failed on rank" not in got[3][0]
    for message, _ in got[:3]:
        assert message.startswith(f"load of {str(saved)!r} failed on rank 3 (no rank's state_dict was changed); "
                                  f"rank 3: CheckpointError: checkpoint file"), message
        assert "does not match its SHA-256" in message
    assert [values for _, values in got] == [[0.0]] * 4


def _two_mesh_load(world, path, fmt, damaged):
    """Load one checkpoint into a state dict spanning two meshes (ranks 0-1 and 2-3 of the world)."""
    low, high = (sbp.testing.submesh(world, (2,), ranks=r) for r in ([0, 1], [2, 3]))
    sd = {"a": sbp.zeros((8, 4), low, "S(0)"), "b": sbp.zeros((6,), high, "S(0)"), "step": 0}
    try:
        sbp.load(path, sd)
        error = None
    except CheckpointError as e:
        error = str(e)
    mine = sd["a"] if world.rank < 2 else sd["b"]
    return error, torch.unique(mine.to_local()).tolist(), sd["step"]


@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
def test_a_state_dict_on_two_meshes_loads_and_agrees_per_mesh(tmp_path, fmt):
    sbp.testing.spmd(functools.partial(_save, path=tmp_path, step=7, fmt=fmt), (4,))
    got = sbp.testing.spmd(functools.partial(_two_mesh_load, path=tmp_path, fmt=fmt, damaged=False), (4,))
    assert got == [(None, [7.0], 7)] * 4
    if fmt == "sbp":                  # rank00003.pt holds a's rows 6-7 (loaded by rank 1) and b's 4-5 (rank 3)
        _flip_a_byte_of_rank3(tmp_path)
        got = sbp.testing.spmd(functools.partial(_two_mesh_load, path=tmp_path, fmt=fmt, damaged=True), (4,))
        assert [e is not None and "rank00003.pt' does not match its SHA-256" in e for e, _, _ in got] == [True] * 4, got
        assert [(values, step) for _, values, step in got] == [([0.0], 0)] * 4


# ---- ranks that save different values ------------------------------------------------------------------------

def _disagreeing_save(mesh, path, fmt):
    try:
        sbp.save({"a": sbp.distribute(torch.ones(4), mesh, "S(0)"), "step": 100 + mesh.rank % 2}, path,
                 format=fmt)
        return "saved"
    except RankMismatchError as e:
        return str(e)


def _step(mesh, path):
    sd = {"a": sbp.zeros((4,), mesh, "S(0)"), "step": -1}
    sbp.load(path, sd)
    return sd["step"]


def _first_save(mesh, path, fmt):
    sbp.save({"a": sbp.distribute(torch.ones(4), mesh, "S(0)"), "step": 1}, path, format=fmt)


@pytest.mark.parametrize("fmt", ["sbp", "safetensors", pytest.param("dcp", marks=pytest.mark.gloo)])
def test_ranks_saving_different_values_are_named_and_nothing_is_committed(tmp_path, fmt):
    run = functools.partial(sbp.testing.spmd, backend="gloo" if fmt == "dcp" else "threads")
    run(functools.partial(_first_save, path=str(tmp_path), fmt=fmt), (4,))
    got = run(functools.partial(_disagreeing_save, path=str(tmp_path), fmt=fmt), (4,))
    assert got == ["save: ranks disagree on JSON values (every rank must pass the same; SPMD): "
                   "{'step': 100} on ranks [0, 2]; {'step': 101} on ranks [1, 3]"] * 4
    assert run(functools.partial(_step, path=str(tmp_path)), (4,)) == [1] * 4   # the previous save still loads


NAMES = ("alpha", "beta", "gamma", "delta")


def _equal_values_in_another_order(mesh, path, fmt):
    """Each rank builds the same dict value in its own order (as from a set of strings: each torchrun process has
    its own hash seed); then loads it back."""
    order = NAMES if mesh.rank % 2 == 0 else NAMES[::-1]
    seen = {name: len(name) for name in order}
    sbp.save({"a": sbp.distribute(torch.ones(4), mesh, "S(0)"), "seen": seen, "meta": {"epoch": 3, "seen": seen}},
             path, format=fmt)
    sd = {"a": sbp.zeros((4,), mesh, "S(0)"), "seen": {}, "meta": {}}
    sbp.load(path, sd)
    return sd["seen"] == seen and sd["meta"] == {"epoch": 3, "seen": seen}, sd["a"].full().tolist()


@pytest.mark.parametrize("fmt", ["sbp", "safetensors", pytest.param("dcp", marks=pytest.mark.gloo)])
def test_equal_values_whose_dicts_come_in_another_order_save(tmp_path, fmt):
    """JSON values were compared by the repr of each rank's value, so equal dicts built in another order were
    refused ("ranks disagree on JSON values: {'alpha': 5, ...} on ranks [0, 2]; {'delta': 5, ...} on ranks
    [1, 3]"); a dict's order is no part of its value (nothing collective depends on it)."""
    run = functools.partial(sbp.testing.spmd, backend="gloo" if fmt == "dcp" else "threads")
    got = run(functools.partial(_equal_values_in_another_order, path=str(tmp_path), fmt=fmt), (4,))
    assert got == [(True, [1.0] * 4)] * 4


def _save_to_own_path(mesh, path, fmt):
    try:
        sbp.save({"a": sbp.distribute(torch.ones(4), mesh, "S(0)")}, os.path.join(path, f"r{mesh.rank % 2}"),
                 format=fmt)
        return "saved"
    except RankMismatchError as e:
        return str(e)


@pytest.mark.parametrize("fmt", ["sbp", "safetensors", pytest.param("dcp", marks=pytest.mark.gloo)])
def test_ranks_saving_to_different_paths_are_named_before_anything_is_written(tmp_path, fmt):
    # every rank would write its blocks into its own directory and coord 0 commit a checkpoint missing them
    run = functools.partial(sbp.testing.spmd, backend="gloo" if fmt == "dcp" else "threads")
    got = run(functools.partial(_save_to_own_path, path=str(tmp_path), fmt=fmt), (4,))
    assert got == [f"save: ranks disagree on path (every rank must pass the same; SPMD): {tmp_path}/r0 on ranks "
                   f"[0, 2]; {tmp_path}/r1 on ranks [1, 3]"] * 4
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == []


# ---- tensors a checkpoint cannot hold ---------------------------------------------------------------------------

def _odd_tensor(kind):
    if kind == "sparse":
        return torch.eye(3).to_sparse()
    if kind == "nested":
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    if kind == "meta":
        return torch.empty(3, device="meta")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    return distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (2,)), [Shard(0)])


def _save_odd(mesh, path, fmt, kind):
    try:
        sbp.save(state(mesh, 2) | {"t": _odd_tensor(kind)}, path, format=fmt)
        error = "saved"
    except sbp.SbpError as e:
        error = f"{type(e).__name__}: {e}"
    return error, _loaded(mesh, path)


ODD = {"sparse": "is a tensor of layout torch.sparse_coo, which checkpoints do not hold",
       "nested": "is a nested tensor, which checkpoints do not hold",
       "meta": "is on the meta device: it has no data to save",
       "dtensor": "is a torch DTensor, which this format does not hold: make it an sbp global tensor"}


@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
@pytest.mark.parametrize("kind", ["sparse", "nested", "meta"])
def test_a_tensor_no_format_holds_is_refused_before_anything_is_written(tmp_path, fmt, kind):
    """A sparse tensor failed in the write (a torch RuntimeError inside the message), a nested one raised a raw
    RuntimeError ("NestedTensorImpl doesn't support sizes"), a meta one failed copying out of it: refused now,
    by name, on every rank before anything is written; the previous checkpoint still loads."""
    sbp.testing.spmd(functools.partial(_save, path=str(tmp_path), step=1, fmt=fmt), (2,))
    got = sbp.testing.spmd(functools.partial(_save_odd, path=str(tmp_path), fmt=fmt, kind=kind), (2,))
    for error, loaded in got:
        assert error.startswith(f"CheckpointError: tensor 't' {ODD[kind]}"), got
        assert loaded == (1, [1.0])


def _dtensor_case(mesh, path, fmt):
    """With a checkpoint holding a plain 't': save a state whose 't' is a torch DTensor, then load into one."""
    sbp.save(state(mesh, 1) | {"t": torch.full((8,), 1.0)}, path, format=fmt)
    errors = []
    for call in ("save", "load"):
        sd = state(mesh, 2 if call == "save" else 0) | {"t": _odd_tensor("dtensor") * (1 if call == "save" else 0)}
        try:
            sbp.save(sd, path, format=fmt) if call == "save" else sbp.load(path, sd)
            errors.append(f"{call} returned")
        except sbp.SbpError as e:
            errors.append(f"{type(e).__name__}: {e}")
    after = state(mesh, 0) | {"t": torch.zeros(8)}
    sbp.load(path, after)
    return errors, torch.unique(sd["a"].to_local()).tolist(), after["step"], after["t"].tolist()


@pytest.mark.gloo
@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
def test_a_torch_dtensor_is_refused_by_the_sbp_and_safetensors_formats(tmp_path, fmt):
    """A torch DTensor in sbp.save(format="sbp") was written as a plain tensor: coord 0's *shard* as the whole
    tensor; the save succeeded and the checkpoint could not load (a torch RuntimeError after other keys were
    written) or, into a DTensor target, loaded wrong values. Refused on save and as a load target, by name,
    before anything is written; format="dcp" holds DTensors as they are."""
    for errors, a, step, t in gloo(functools.partial(_dtensor_case, path=str(tmp_path), fmt=fmt), (2,)):
        assert errors[0].startswith(f"CheckpointError: tensor 't' {ODD['dtensor']}"), errors
        assert errors[1].startswith("CheckpointError: tensor 't': the state_dict's tensor is a torch DTensor"), errors
        assert (a, step, t) == ([0.0], 1, [1.0] * 8)     # the failed load wrote nothing; the first save loads
    for error, loaded in gloo(functools.partial(_save_odd, path=str(tmp_path / "dcp"), fmt="dcp", kind="dtensor"),
                              (2,)):
        assert error == "saved"


# ---- a rank that refuses its save or its load on its own --------------------------------------------------------

def _one_rank_refuses(mesh, path, fmt):
    """Rank 1 passes a value the save refuses (a numpy scalar where the others pass a float), before a P(sum)
    tensor whose reduction is a collective too."""
    best = np.float64(0.5) if mesh.rank == 1 else 0.5
    sd = {"best": best, "p": sbp.from_local(torch.ones(4), mesh, "P(sum)", global_shape=(4,))} | state(mesh, 2)
    try:
        sbp.save(sd, path, format=fmt)
        return "saved"
    except sbp.SbpError as e:   # (CommError, where a rank waited out the collective timeout)
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("fmt", ["sbp", "safetensors", pytest.param("dcp", marks=pytest.mark.gloo)])
def test_a_value_one_rank_refuses_makes_every_rank_raise_at_once(tmp_path, fmt):
    """The refusal rides on the save's first collective: the refusing rank raises its own CheckpointError, the
    others one naming it and the entry -- where they used to wait in that collective until its timeout."""
    path = str(tmp_path)
    run = functools.partial(sbp.testing.spmd, backend="gloo" if fmt == "dcp" else "threads")
    run(functools.partial(_save, path=path, step=1, fmt=fmt), (3,))
    before = sorted(os.listdir(path))
    got = run(functools.partial(_one_rank_refuses, path=path, fmt=fmt), (3,), timeout=10)
    refusal = ("CheckpointError: entry 'best' would not come back as it is from JSON (np.float64(0.5) reads back as "
               "0.5): np.float64(0.5) is a numpy.float64, not a JSON type")
    assert got[1].startswith(refusal), got
    target = os.path.join(path, "model.safetensors") if fmt == "safetensors" else path
    for message in got[::2]:
        assert message.startswith(f"CheckpointError: save of {target!r} failed on rank 1 before anything was "
                                  f"written (the previous checkpoint is unchanged); rank 1: {refusal}"), got
    assert sorted(os.listdir(path)) == before        # nothing written, no lock left
    assert run(functools.partial(_loaded, path=path), (2,))[0] == (1, [1.0])


def _one_rank_sees_no_checkpoint(mesh, path, elsewhere):
    sd = state(mesh, 0)
    try:
        sbp.load(elsewhere if mesh.rank == 1 else path, sd)
        error = "loaded"
    except sbp.SbpError as e:
        error = f"{type(e).__name__}: {e}"
    return error, torch.unique(sd["a"].to_local()).tolist()


@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
def test_a_load_one_rank_finds_no_checkpoint_for_raises_on_every_rank(tmp_path, fmt):
    """A rank that finds no checkpoint at the path (a directory it does not see) joins the others' agreement:
    all raise, nothing is loaded -- where the others used to wait in it until its timeout."""
    path, elsewhere = str(tmp_path / "ckpt"), str(tmp_path / "elsewhere")
    sbp.testing.spmd(functools.partial(_save, path=path, step=7, fmt=fmt), (2,))
    got = sbp.testing.spmd(functools.partial(_one_rank_sees_no_checkpoint, path=path, elsewhere=elsewhere), (2,),
                           timeout=10)
    refusal = f"CheckpointError: checkpoint {elsewhere!r} is not a directory; write one with sbp.save"
    assert got == [(f"CheckpointError: load of {path!r} failed on rank 1 (no rank's state_dict was changed); rank 1: "
                    f"{refusal}", [0.0]), (refusal, [0.0])]
