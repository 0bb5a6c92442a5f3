"""Crash-safe saving: a save over an existing checkpoint either completes or leaves the old checkpoint
loadable; never an error or a mix of the two. Threads tier: a save that fails at each stage; gloo tier:
20 saves by 4 rank processes SIGKILLed at random moments (tests/support/crash_trials.py)."""
from __future__ import annotations

import errno
import functools
import json
import os
import random
import shutil
import sys
import threading

import pytest
import torch

import sbp
import sbp.testing
from sbp.io import checkpoint
from sbp.io.state import host_barrier
from sbp.values.errors import CheckpointError
from tests.support import crash_trials


def _save(mesh, path, value):
    pls = "S(0)" if mesh.ndim == 1 else "S(0), S(1)"
    sbp.save({"x": sbp.distribute(torch.full((10, 7), float(value)), mesh, pls), "step": value}, path)


def _load(mesh, path):
    sd = {"x": sbp.zeros((10, 7), mesh, "S(1)"), "step": -1}
    sbp.load(path, sd)
    return sd["step"], torch.unique(sd["x"].full()).tolist()


def save(path, value, shape=(4,)):
    sbp.testing.spmd(functools.partial(_save, path=str(path), value=value), shape)


def load(path):
    return sbp.testing.spmd(functools.partial(_load, path=str(path)), (2,))[0]


def test_each_save_is_a_new_generation_and_the_old_one_goes(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2, shape=(2, 2))
    assert sorted(os.listdir(tmp_path)) == ["gen-00000002", "metadata.json"]
    assert json.loads((tmp_path / "metadata.json").read_text())["data"] == "gen-00000002"
    assert load(tmp_path) == (2, [2.0])


class Boom(Exception):
    pass


@pytest.mark.parametrize("stage", ["write", "commit"])
def test_a_save_that_dies_leaves_the_old_checkpoint(tmp_path, monkeypatch, stage):
    save(tmp_path, 1)
    real = {"write": checkpoint._write, "commit": checkpoint._commit}[stage]
    calls = []

    def dying(*args):
        calls.append(args)
        if stage == "write" and len(calls) < 3:   # two ranks wrote their files: the other two die
            return real(*args)
        raise Boom(stage)
    monkeypatch.setattr(checkpoint, f"_{stage}", dying)
    with pytest.raises(sbp.testing.SpmdError):
        save(tmp_path, 2)
    monkeypatch.undo()
    assert load(tmp_path) == (1, [1.0])          # the old checkpoint, whole
    assert sorted(os.listdir(tmp_path)) == ["gen-00000001", "gen-00000002", "metadata.json"]
    save(tmp_path, 3)                            # the next save skips the abandoned generation, then removes it
    assert sorted(os.listdir(tmp_path)) == ["gen-00000003", "metadata.json"]
    assert load(tmp_path) == (3, [3.0])


def _save_format(mesh, path, value, fmt):
    sbp.save({"x": sbp.distribute(torch.full((10, 7), float(value)), mesh, "S(0)"), "step": value}, path,
             format=fmt)


@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
def test_a_cleanup_that_fails_after_the_commit_does_not_fail_the_save(tmp_path, monkeypatch, fmt):
    """Listing the directory for the cleanup after the switch failing (EIO, a directory without read permission)
    used to raise that OSError on coord 0 -- a committed save reported as failed, and on torch.distributed the
    other ranks waited at the closing barrier until the collective timeout. The save is committed: it returns,
    and the next save removes what is left."""
    sbp.testing.spmd(functools.partial(_save_format, path=str(tmp_path), value=1, fmt=fmt), (2,))
    real = os.listdir

    def listdir(path="."):
        if sys._getframe(1).f_code.co_name == "retire_others":
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path)
    monkeypatch.setattr(os, "listdir", listdir)
    sbp.testing.spmd(functools.partial(_save_format, path=str(tmp_path), value=2, fmt=fmt), (2,), timeout=10)
    monkeypatch.undo()
    assert load(tmp_path) == (2, [2.0])
    sbp.testing.spmd(functools.partial(_save_format, path=str(tmp_path), value=3, fmt=fmt), (2,))
    assert sorted(os.listdir(tmp_path)) == (["gen-00000003", "metadata.json"] if fmt == "sbp" else
                                            ["model.safetensors"])
    assert load(tmp_path) == (3, [3.0])


def test_a_save_into_a_directory_it_cannot_list_never_reuses_the_committed_generation(tmp_path, monkeypatch):
    """Where the directory cannot be listed (EIO; write but no read permission) every rank used to count 0
    generations and write into 'gen-00000001' -- the committed checkpoint's own data directory: a write that
    then failed on one rank left the previous checkpoint with replaced files, unloadable ("does not match its
    SHA-256"). The committed generation is read from metadata.json by name instead."""
    save(tmp_path, 1, shape=(2,))
    real_listdir, real_write = os.listdir, checkpoint._write

    def listdir(path="."):
        if os.path.abspath(path) == str(tmp_path):
            raise OSError(errno.EIO, "Input/output error", path)
        return real_listdir(path)

    def write(shard, file):
        if file.endswith("rank00001.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(shard, file)
    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(checkpoint, "_write", write)
    with pytest.raises(sbp.testing.SpmdError, match="could not write its file to 'gen-00000002'"):
        save(tmp_path, 2, shape=(2,))
    monkeypatch.undo()
    assert load(tmp_path) == (1, [1.0])          # the previous checkpoint, whole
    save(tmp_path, 3, shape=(2,))
    assert sorted(os.listdir(tmp_path)) == ["gen-00000003", "metadata.json"]
    assert load(tmp_path) == (3, [3.0])


def test_a_torn_metadata_write_never_replaces_the_committed_one(tmp_path, monkeypatch):
    save(tmp_path, 1)

    def torn(obj, f, **kw):
        f.write('{"format": "sbp-checkpoint", "vers')
        raise Boom("killed while writing metadata")
    monkeypatch.setattr(checkpoint.json, "dump", torn)
    with pytest.raises(sbp.testing.SpmdError):
        save(tmp_path, 2)
    monkeypatch.undo()
    assert load(tmp_path) == (1, [1.0])


def test_version_1_checkpoints_still_load_and_are_replaced_cleanly(tmp_path):
    save(tmp_path, 1)
    data = json.loads((tmp_path / "metadata.json").read_text())["data"]
    for name in os.listdir(tmp_path / data):     # the version-1 layout: rank files beside metadata.json
        shutil.move(tmp_path / data / name, tmp_path / name)
    os.rmdir(tmp_path / data)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    meta["version"] = 1
    del meta["data"]
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    (tmp_path / "notes.txt").write_text("the user's own file")
    assert load(tmp_path) == (1, [1.0])
    save(tmp_path, 2)
    assert sorted(os.listdir(tmp_path)) == ["gen-00000001", "metadata.json", "notes.txt"]
    assert load(tmp_path) == (2, [2.0])


@pytest.mark.parametrize("data", ["../elsewhere", "gen-1", 7, None])
def test_a_data_field_that_is_not_a_generation_is_refused(tmp_path, data):
    save(tmp_path, 1)
    meta = json.loads((tmp_path / "metadata.json").read_text())
    meta["data"] = data
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(sbp.testing.SpmdError) as info:
        load(tmp_path)
    assert isinstance(info.value.__cause__, CheckpointError)
    assert "not a data directory name like 'gen-00000001'" in str(info.value.__cause__)


def test_a_load_during_another_jobs_save_never_mixes_the_two(tmp_path, monkeypatch):
    """Rank 0 reads generation 1; another job then commits generation 2; rank 1 reads that. Each rank's own
    checks pass: only the ranks' agreement on what they read can refuse the mix."""
    path, other = tmp_path / "ckpt", tmp_path / "other"
    save(path, 1)
    save(other, 0)
    save(other, 2)                       # gen-00000002 of step 2, ready to be committed into `path`
    real, turn = checkpoint._prepare, threading.Event()

    def in_turn(*args):
        if threading.current_thread() is not first:
            turn.wait()
            return real(*args)
        out = real(*args)
        shutil.copytree(other / "gen-00000002", path / "gen-00000002")   # the other job's save and commit
        os.replace(other / "metadata.json", path / "metadata.json")
        turn.set()
        return out
    first = None

    def _load_first(mesh):
        nonlocal first
        if mesh.rank == 0:
            first = threading.current_thread()
        host_barrier(mesh)
        try:
            return _load(mesh, str(path))
        except CheckpointError as e:
            return str(e)
    monkeypatch.setattr(checkpoint, "_prepare", in_turn)
    got = sbp.testing.spmd(_load_first, (2,))
    assert got == [f"load of {str(path)!r}: the ranks read different saves (another save committed during the "
                   f"load; no rank's state_dict was changed); load again once the save is done"] * 2
    monkeypatch.undo()
    assert load(path) == (2, [2.0])


@pytest.mark.gloo
@pytest.mark.slow
def test_sigkill_at_random_moments_during_saves_leaves_old_or_new(tmp_path):
    report = crash_trials.run_trials(str(tmp_path / "ck"), str(tmp_path), 20, random.Random(20))
    print(report.table())
    assert report.trials == 20 and report.loaded_old + report.loaded_new == 20
    assert report.mid_write >= 1, report.table()   # the kills did land inside saves
    # a final uninterrupted save leaves one generation: every abandoned one is gone
    os.mkdir(tmp_path / "final")
    crash_trials.run_trials(str(tmp_path / "ck"), str(tmp_path / "final"), 0, random.Random(0))
    assert sorted(os.listdir(tmp_path / "ck")) == [
        json.loads((tmp_path / "ck" / "metadata.json").read_text())["data"], "metadata.json"]


# ---- two saves into one directory at once ----------------------------------------------------------------------

def _save_as(mesh, path, value, fmt):
    try:
        sbp.save({"x": sbp.distribute(torch.full((10, 7), float(value)), mesh, "S(0)"), "step": value}, path,
                 format=fmt)
        return "saved"
    except CheckpointError as e:
        return str(e)


def _plain_load(path):
    sd = {"x": torch.zeros(10, 7), "step": -1}
    sbp.load(path, sd)
    return sd["step"], torch.unique(sd["x"]).tolist()


def _paused(real, writing, resume):
    def write(*args, **kwargs):
        writing.set()
        assert resume.wait(60)
        return real(*args, **kwargs)
    return write


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # the DCP save runs in one process
@pytest.mark.parametrize("first, second", [("sbp", "sbp"), ("sbp", "safetensors"), ("dcp", "sbp")])
def test_a_save_into_a_directory_another_save_is_writing_is_refused(tmp_path, monkeypatch, first, second):
    """Another job's save into the same directory while a save writes: it is refused on every rank before it
    writes anything, the first save commits, and the directory loads as that save's state, whole. (Both used
    to go ahead, each removing the other's data directory: nothing loaded, not even the previous save.)"""
    path = str(tmp_path)
    save(tmp_path, 1)
    writing, resume = threading.Event(), threading.Event()
    if first == "sbp":   # the first save stops in its writes, its data directory made
        real = checkpoint._write
        monkeypatch.setattr(checkpoint, "_write", lambda shard, file: (
            _paused(real, writing, resume) if "gen-00000002" in file else real)(shard, file))

        def run_first():
            return sbp.testing.spmd(functools.partial(_save_as, path=path, value=2, fmt="sbp"), (2,))
    else:
        from sbp.io import dcp as sbp_dcp
        monkeypatch.setattr(sbp_dcp._GenerationWriter, "write_data",
                            _paused(sbp_dcp._GenerationWriter.write_data, writing, resume))

        def run_first():
            sbp.save({"x": torch.full((10, 7), 2.0), "step": 2}, path, format="dcp")
            return ["saved"]
    results = []
    job = threading.Thread(target=lambda: results.append(run_first()))
    job.start()
    try:
        assert writing.wait(60)
        got = sbp.testing.spmd(functools.partial(_save_as, path=path, value=3, fmt=second), (2,), timeout=20)
    finally:
        resume.set()
        job.join()
    assert results == [["saved"] * (2 if first == "sbp" else 1)]
    target = os.path.join(path, "model.safetensors") if second == "safetensors" else path
    refusal = f"save: another save into {path!r} is in progress (its coord 0 holds .sbp-save.lock)"
    assert got[0].startswith(refusal), got
    assert got[1].startswith(f"save of {target!r} failed on rank 0 before anything was written (the previous "
                             f"checkpoint is unchanged); rank 0: CheckpointError: {refusal}"), got
    assert _plain_load(path) == (2, [2.0])
    assert sorted(os.listdir(path)) == ([".metadata"] if first == "dcp" else []) + ["gen-00000002"] + \
        (["metadata.json"] if first == "sbp" else [])
