"""`sbp.save` / `sbp.load`: round trips that reshard (other rank counts, mesh shapes, placements, uneven
shapes), what each rank writes, and every kind of damage or mismatch raising `sbp.CheckpointError`.

In-process SPMD tier (threads backend), plus one save on gloo processes loaded back in threads.
"""
from __future__ import annotations

import collections
import copy
import enum
import functools
import json
import os
import threading

import numpy as np
import pytest
import torch
from torch import nn

import sbp
import sbp.nn
import sbp.testing
from sbp.values.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::sbp.tensor.global_tensor.FallbackWarning")


def value(shape, dtype=torch.float32) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return torch.arange(n, dtype=torch.float64).view(shape).to(dtype)


SHAPES = {"even": (8, 4), "uneven": (10, 7), "tiny": (2, 3), "empty": (0, 4), "vector": (5,)}


def _save(mesh, path, placements, extra=None):
    sd = {name: sbp.distribute(value(shape), mesh, placements) for name, shape in SHAPES.items()}
    sd.update(extra or {})
    sbp.save(sd, path)


def _load(mesh, path, placements, extra=None):
    sd = {name: sbp.zeros(shape, mesh, placements) for name, shape in SHAPES.items()}
    sd.update(copy.deepcopy(extra or {}))
    sbp.load(path, sd)
    return {k: v.full() if isinstance(v, sbp.GlobalTensor) else v for k, v in sd.items()}


def data_dir(path):
    """The data directory the committed metadata.json names."""
    return path / json.loads((path / "metadata.json").read_text())["data"]


def roundtrip(path, save_shape, save_pls, load_shape, load_pls, extra=None, load_extra=None):
    sbp.testing.spmd(functools.partial(_save, path=path, placements=save_pls, extra=extra), save_shape)
    return sbp.testing.spmd(functools.partial(_load, path=path, placements=load_pls, extra=load_extra), load_shape)


@pytest.mark.parametrize("save_shape, save_pls, load_shape, load_pls", [
    ((4,), "S(0)", (2,), "S(0)"),
    ((4,), "S(0)", (2,), "B"),
    ((4,), "S(0)", (2, 2), "S(-1), S(0)"),
    ((4,), "S(0)", (2, 2), "B, P(sum)"),
    ((2, 2), "S(0), S(-1)", (4,), "S(-1)"),
    ((2, 2), "B, S(0)", (3,), "S(0)"),
    ((1,), "B", (2, 2), "S(0), S(0)"),
], ids=lambda v: str(v).replace(" ", ""))
def test_roundtrip_reshards(tmp_path, save_shape, save_pls, load_shape, load_pls):
    for per_rank in roundtrip(tmp_path, save_shape, save_pls, load_shape, load_pls):
        for name, shape in SHAPES.items():
            assert torch.equal(per_rank[name], value(shape)), name


def test_plain_tensors_and_values_roundtrip(tmp_path):
    extra = {"step": 7, "config": {"lr": 0.1, "betas": [0.9, 0.99]}, "plain": torch.arange(3.0),
             "nested": {"bias": torch.ones(2, dtype=torch.float64)}}
    load_extra = {"step": 0, "config": {}, "plain": torch.zeros(3),
                  "nested": {"bias": torch.zeros(2, dtype=torch.float64)}}
    for per_rank in roundtrip(tmp_path, (4,), "S(0)", (2,), "S(0)", extra, load_extra):
        assert per_rank["step"] == 7 and per_rank["config"] == {"lr": 0.1, "betas": [0.9, 0.99]}
        assert torch.equal(per_rank["plain"], torch.arange(3.0))
        assert torch.equal(per_rank["nested"]["bias"], torch.ones(2, dtype=torch.float64))
    # plain tensors are written once, by coord 0
    holders = [f for f in os.listdir(data_dir(tmp_path))
               if f.endswith(".pt") and "plain[0:3]" in torch.load(data_dir(tmp_path) / f, weights_only=True)]
    assert holders == ["rank00000.pt"]


def test_broadcast_blocks_are_written_once(tmp_path):
    def save(mesh):
        sbp.save({"x": sbp.distribute(value((6, 2)), mesh, "S(0), B")}, tmp_path)
    sbp.testing.spmd(save, (2, 2))
    meta = json.loads((tmp_path / "metadata.json").read_text())
    blocks = meta["tensors"]["x"]["blocks"]
    assert blocks == [{"file": "rank00000.pt", "block": [[0, 3], [0, 2]]},
                      {"file": "rank00002.pt", "block": [[3, 6], [0, 2]]}]
    assert sorted(f for f in os.listdir(data_dir(tmp_path)) if f.endswith(".pt")) == ["rank00000.pt", "rank00002.pt"]
    entry = meta["tensors"]["x"]
    assert (entry["global_shape"], entry["dtype"], entry["mesh_shape"], entry["placements"]) == \
        ([6, 2], "float32", [2, 2], "(S(0), B)")


def _save_partial(mesh, path):
    # real partial contributions: rank r holds (r + 1) * v, so the logical value is 10 * v on 4 ranks
    part = value((3, 2)) * (mesh.rank + 1)
    x = sbp.from_local(part, mesh, "P(sum)", global_shape=(3, 2))
    sbp.save({"x": x}, path)


def test_partial_is_saved_reduced(tmp_path):
    sbp.testing.spmd(functools.partial(_save_partial, path=tmp_path), (4,))
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["tensors"]["x"]["placements"] == "(P(sum),)"
    assert meta["tensors"]["x"]["saved_placements"] == "(B,)"
    assert torch.equal(torch.load(data_dir(tmp_path) / "rank00000.pt", weights_only=True)["x[0:3,0:2]"], 10 * value((3, 2)))

    def load(mesh):
        x = sbp.zeros((3, 2), mesh, "S(0)")
        sbp.load(tmp_path, {"x": x})
        return x.full()
    assert all(torch.equal(got, 10 * value((3, 2))) for got in sbp.testing.spmd(load, (2,)))


def test_load_opens_only_the_files_it_needs(tmp_path, monkeypatch):
    sbp.testing.spmd(functools.partial(_save, path=tmp_path, placements="S(0)"), (4,))
    opened = []
    real = sbp.io.checkpoint._Files.load
    monkeypatch.setattr(sbp.io.checkpoint._Files, "load", lambda self, name: opened.append(name) or real(self, name))

    def load_first_rows(mesh):
        x = sbp.zeros((8, 4), mesh, "S(0)")          # "even": 8 rows saved as 2, 2, 2, 2 over 4 files
        sbp.load(tmp_path, {"even": x}, strict=False)
        return x.full()
    assert torch.equal(sbp.testing.spmd(load_first_rows, (1,))[0], value((8, 4)))
    assert sorted(set(opened)) == ["rank00000.pt", "rank00001.pt", "rank00002.pt", "rank00003.pt"]
    opened.clear()

    def load_on_two(mesh):
        x = sbp.zeros((8, 4), mesh, "S(0)")
        sbp.load(tmp_path, {"even": x}, strict=False)
        return x.to_local()
    sbp.testing.spmd(load_on_two, (2,))
    # rank 0 needs rows 0..4 (files 0 and 1), rank 1 rows 4..8 (files 2 and 3): each file opened once
    assert sorted(opened) == ["rank00000.pt", "rank00001.pt", "rank00002.pt", "rank00003.pt"]


def test_plain_state_dict_without_mesh(tmp_path):
    sbp.save({"w": torch.arange(4.0), "n": 3}, tmp_path)
    sd = {"w": torch.zeros(4), "n": 0}
    sbp.load(tmp_path, sd)
    assert torch.equal(sd["w"], torch.arange(4.0)) and sd["n"] == 3


# ---- a parallelized model and its optimizer ----------------------------------------------------------------

def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6)).double()


PLAN = {"0": "colwise", "2": "rowwise"}
BATCH = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _train_and_save(mesh, model, path):
    model = copy.deepcopy(model)
    sbp.nn.parallelize(model, mesh, PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    for _ in range(2):
        opt.zero_grad()
        (model(BATCH).full() ** 2).sum().backward()
        opt.step()
    sbp.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    return {n: p.full() for n, p in model.named_parameters()}


def _load_and_step(mesh, model, path):
    model = copy.deepcopy(model)
    sbp.nn.parallelize(model, mesh, PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    opt.zero_grad()
    (model(BATCH).full() ** 2).sum().backward()
    opt.step()  # creates the optimizer state the checkpoint overwrites
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    sbp.load(path, sd)
    opt.load_state_dict(sd["optim"])
    loaded = {n: p.full().clone() for n, p in model.named_parameters()}  # full() of a B tensor may alias it
    opt.zero_grad()
    (model(BATCH).full() ** 2).sum().backward()
    opt.step()
    return loaded, {n: p.full() for n, p in model.named_parameters()}


def test_model_and_optimizer_reshard(tmp_path):
    model = mlp()
    saved = sbp.testing.spmd(functools.partial(_train_and_save, model=model, path=tmp_path), (4,))[0]
    # the same three steps on one device
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=False)
    for _ in range(3):
        opt.zero_grad()
        (ref(BATCH) ** 2).sum().backward()
        opt.step()
    for loaded, stepped in sbp.testing.spmd(functools.partial(_load_and_step, model=model, path=tmp_path), (2,)):
        for name, p in ref.named_parameters():
            torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0)
            torch.testing.assert_close(stepped[name], p.detach(), rtol=1e-10, atol=1e-12)


def _save_gloo(mesh, path):
    sbp.save({"x": sbp.distribute(value((10, 7)), mesh, "S(0)"), "step": 1}, path)


@pytest.mark.gloo
def test_save_on_gloo_load_in_threads(tmp_path):
    sbp.testing.spmd(functools.partial(_save_gloo, path=str(tmp_path)), (4,), backend="gloo", timeout=60)

    def load(mesh):
        x = sbp.zeros((10, 7), mesh, "S(1), S(0)")
        sbp.load(tmp_path, {"x": x, "step": 0})
        return x.full()
    assert all(torch.equal(t, value((10, 7))) for t in sbp.testing.spmd(load, (2, 2)))


def _plain_save_in_a_job(mesh, path, fmt):
    """Each of the job's processes saves the same plain state dict: without mesh= (refused), then with it."""
    errors = []
    try:
        sbp.save({"w": torch.arange(4.0), "n": 3}, path, format=fmt)
    except CheckpointError as e:
        errors.append(str(e))
    sbp.save({"w": torch.arange(4.0), "n": 3}, path, mesh=mesh, format=fmt)
    sd = {"w": torch.zeros(4), "n": 0}
    sbp.load(path, sd)
    return errors, sd["w"].tolist(), sd["n"]


@pytest.mark.gloo
@pytest.mark.parametrize("fmt", ["sbp", "safetensors", "dcp"])
def test_a_plain_state_dict_saved_by_several_processes_needs_a_mesh(tmp_path, fmt):
    got = sbp.testing.spmd(functools.partial(_plain_save_in_a_job, path=str(tmp_path), fmt=fmt), (4,),
                           backend="gloo", timeout=60)
    message = ("save: the state_dict holds no global tensor and no mesh= was given, but this is one of 4 processes "
               "(torch.distributed is initialised): each would write the checkpoint as rank 0; pass mesh= (its "
               "coord 0 writes the plain tensors)")
    assert got == [([message], [0.0, 1.0, 2.0, 3.0], 3)] * 4


# ---- damage and mismatches -------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    sbp.testing.spmd(functools.partial(_save, path=tmp_path, placements="S(0)", extra={"step": 1}), (4,))
    return tmp_path


def load_error(path, targets=None, strict=True) -> str:
    def load(mesh):
        sd = {name: sbp.zeros(shape, mesh, "S(0)") for name, shape in SHAPES.items()} | {"step": 0}
        sd.update(targets or {})
        sbp.load(path, {k: v for k, v in sd.items() if v is not None}, strict=strict)
    with pytest.raises(sbp.SbpError) as info:
        sbp.testing.spmd(load, (2,))
    error = info.value.__cause__
    assert isinstance(error, CheckpointError), repr(error)
    return str(error)


def edit_metadata(path, edit) -> None:
    meta = json.loads((path / "metadata.json").read_text())
    edit(meta)
    (path / "metadata.json").write_text(json.dumps(meta))


def test_missing_file(saved):
    os.remove(data_dir(saved) / "rank00002.pt")
    assert "rank00002.pt' is missing (it holds blocks of tensors ['even', 'uneven', 'vector'])" in load_error(saved)


def test_truncated_file(saved):
    data = (data_dir(saved) / "rank00001.pt").read_bytes()
    (data_dir(saved) / "rank00001.pt").write_bytes(data[:len(data) // 2])
    assert "is truncated or altered" in load_error(saved)


def test_altered_file_bytes(saved):
    data = bytearray((data_dir(saved) / "rank00003.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (data_dir(saved) / "rank00003.pt").write_bytes(bytes(data))
    assert "does not match its SHA-256" in load_error(saved)


def test_missing_metadata(saved):
    os.remove(saved / "metadata.json")
    assert "has no metadata.json" in load_error(saved)


def test_metadata_not_json(saved):
    (saved / "metadata.json").write_text('{"format": "sbp-checkpoint", ')
    assert "is not valid JSON" in load_error(saved)
    (saved / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)   # deeper than json's recursion goes
    assert "is not valid JSON (maximum recursion depth" in load_error(saved)


def test_a_file_that_goes_during_its_checks(saved, monkeypatch):
    """A concurrent save retires the data directory between a file's size check and its SHA-256 read."""
    real = sbp.io.checkpoint._sha256

    def retired_meanwhile(file):
        os.remove(file)
        return real(file)
    monkeypatch.setattr(sbp.io.checkpoint, "_sha256", retired_meanwhile)
    message = load_error(saved)
    assert message.startswith("cannot read checkpoint file") and "No such file or directory" in message, message
    assert message.endswith("if another save committed meanwhile, load again")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["tensors"]["uneven"].update(global_shape=[10, 8]),
     "tensor 'uneven': its blocks do not tile the global shape (10, 8) exactly"),
    (lambda m: m["tensors"]["uneven"]["blocks"][1].update(block=[[2, 6], [0, 7]]),
     "tensor 'uneven': its blocks do not tile"),
    (lambda m: m["tensors"]["even"].update(dtype="float99"), "tensor 'even': dtype 'float99' is not a torch dtype"),
    (lambda m: m["tensors"]["even"].update(placements="S(5)"), "tensor 'even': placements 'S(5)'"),
    (lambda m: m["tensors"]["even"]["blocks"][0].update(file="rank00009.pt"), "does not list it in 'files'"),
    (lambda m: m["tensors"]["even"].update(dtype="float64"),
     "tensor 'even': dtype float64 in the checkpoint, float32 in the state_dict"),
    (lambda m: m.pop("files"), "field 'files' is missing"),
    (lambda m: m.update(version=99), "has checkpoint version 99"),
], ids=["shape", "block", "bad-dtype", "placements", "file", "dtype", "files", "version"])
def test_altered_metadata(saved, edit, message):
    edit_metadata(saved, edit)
    assert message in load_error(saved)


def test_the_tiling_check_of_many_blocks_compares_each_block_with_few_others(monkeypatch):
    """Every loading rank checks that each tensor's blocks tile its global shape; the check compared every pair
    of blocks: a tensor saved by 4096 ranks took seconds (1024 ranks: 0.22 s per tensor, a minute for 300
    tensors). A sweep along the split dim compares each block with those still open where it starts: a
    number of block intersections linear in the blocks, counted here (not timed)."""
    import sbp.io.checkpoint as checkpoint

    calls, original = [], checkpoint.intersect

    def counted(a, b):
        calls.append(1)
        return original(a, b)

    monkeypatch.setattr(checkpoint, "intersect", counted)
    n = 4096
    for dim in (0, 1):
        blocks = [[[r * 2, r * 2 + 2], [0, 3]] if dim == 0 else [[0, 3], [r * 2, r * 2 + 2]] for r in range(n)]
        shape = [2 * n, 3] if dim == 0 else [3, 2 * n]
        entry = {"global_shape": shape, "dtype": "float32", "mesh_shape": [n],
                 "placements": f"(S({dim}),)", "blocks": [{"file": "rank00000.pt", "block": b} for b in blocks]}
        calls.clear()
        checkpoint._check_entry("metadata.json", "w", entry)
        assert len(calls) <= 2 * n       # every pair: n (n - 1) / 2 = 8.4 million
        entry["blocks"][-1]["block"] = blocks[0]          # two blocks hold the same rows, one is missing
        with pytest.raises(CheckpointError, match="its blocks do not tile the global shape"):
            checkpoint._check_entry("metadata.json", "w", entry)


def test_block_swapped_between_files(saved):
    def swap(meta):
        blocks = meta["tensors"]["even"]["blocks"]
        blocks[0]["file"], blocks[1]["file"] = blocks[1]["file"], blocks[0]["file"]
    edit_metadata(saved, swap)  # the same shapes, so only the order is wrong: values would be silently wrong
    message = load_error(saved, {"uneven": None, "tiny": None, "empty": None, "vector": None}, strict=False)
    assert "tensor 'even': file 'rank00001.pt' should hold its block ((0, 2), (0, 4)) but does not" in message


def test_shape_mismatch(saved):
    message = _error_with(saved, "uneven", (10, 8), torch.float32)
    assert message == "tensor 'uneven': global shape (10, 7) in the checkpoint, (10, 8) in the state_dict"


def test_dtype_mismatch(saved):
    message = _error_with(saved, "uneven", (10, 7), torch.float64)
    assert message == "tensor 'uneven': dtype float32 in the checkpoint, float64 in the state_dict"


def _error_with(path, name, shape, dtype) -> str:
    def load(mesh):
        sd = {n: sbp.zeros(s, mesh, "S(0)") for n, s in SHAPES.items()} | {"step": 0}
        sd[name] = sbp.zeros(shape, mesh, "S(0)", dtype=dtype)
        sbp.load(path, sd)
    with pytest.raises(sbp.SbpError) as info:
        sbp.testing.spmd(load, (2,))
    assert isinstance(info.value.__cause__, CheckpointError)
    return str(info.value.__cause__)


def test_missing_and_extra_keys(saved):
    message = load_error(saved, {"tiny": None, "new.weight": torch.zeros(2)})
    assert "missing from the checkpoint: ['new.weight']" in message
    assert "in the checkpoint but not in the state_dict: ['tiny']" in message


def test_non_strict_loads_common_keys(saved):
    def load(mesh):
        x = sbp.zeros((10, 7), mesh, "S(0)")
        sbp.load(saved, {"uneven": x, "other": torch.zeros(1)}, strict=False)
        return x.full()
    assert torch.equal(sbp.testing.spmd(load, (2,))[0], value((10, 7)))


def test_tensor_where_a_value_was_saved(saved):
    message = load_error(saved, {"even": 3})
    assert "entry 'even' is a tensor in the checkpoint but a int in the state_dict" in message


def test_unsupported_value_on_save(tmp_path):
    with pytest.raises(CheckpointError, match="entry 'fn' is a function, which a checkpoint cannot hold"):
        sbp.save({"fn": lambda: 0}, tmp_path)


class Mode(enum.IntEnum):
    TRAIN = 1


@pytest.mark.parametrize("value, message", [
    (np.float64(0.25), "entry 'v' would not come back as it is from JSON (np.float64(0.25) reads back as 0.25): "
                       "np.float64(0.25) is a numpy.float64, not a JSON type"),
    (Mode.TRAIN, "entry 'v' would not come back as it is from JSON (<Mode.TRAIN: 1> reads back as 1): "
                 "<Mode.TRAIN: 1> is a tests.io.test_checkpoint.Mode, not a JSON type"),
    ({"k": [np.int64(3)]}, "entry 'v' cannot be held by a checkpoint: at ['k'][0]: np.int64(3) is a numpy.int64, "
                           "not a JSON type"),
    ({"k": {2: "a"}}, "entry 'v' would not come back as it is from JSON ({'k': {2: 'a'}} reads back as "
                      "{'k': {'2': 'a'}}): at ['k']: dict key 2 is a int: dict keys must be strings"),
], ids=["numpy scalar", "IntEnum", "nested numpy", "int key"])
def test_a_value_json_would_change_is_named_with_its_type(tmp_path, value, message):
    with pytest.raises(CheckpointError) as info:
        sbp.save({"w": torch.ones(2), "v": value}, tmp_path)
    assert str(info.value).startswith(message), str(info.value)
    assert str(info.value).endswith("(valid: JSON values: None, bool, int, float, str, and lists and dicts of them "
                                    "with str keys)") or "dict keys must be strings" in message


def test_json_values_come_back_as_they_were(tmp_path):
    """Tuples nested in values (an optimizer's betas) come back as tuples, nan as nan; a value JSON would
    change (int dict keys) is refused when saving; a value where the state_dict has a tensor, or a value
    inside a tuple of the state_dict, is refused before anything is loaded."""
    sd = {"w": torch.ones(2), "groups": [{"betas": (0.9, 0.99), "lr": 0.1}], "x": float("nan"), "t": (1, 2)}
    sbp.save(sd, str(tmp_path / "a"))
    into = {"w": torch.zeros(2), "groups": [{"betas": (0.0, 0.0), "lr": 0.0}], "x": 0.0, "t": (0, 0)}
    sbp.load(str(tmp_path / "a"), into)
    assert into["groups"] == [{"betas": (0.9, 0.99), "lr": 0.1}] and into["t"] == (1, 2) and into["x"] != into["x"]
    assert torch.equal(into["w"], torch.ones(2))

    with pytest.raises(CheckpointError, match=r"entry 'cfg' would not come back as it is from JSON .*dict keys must be strings"):
        sbp.save({"w": torch.ones(1), "cfg": {1: "a"}}, str(tmp_path / "b"))

    sbp.save({"w": 3, "v": torch.ones(2)}, str(tmp_path / "c"))
    target = {"w": torch.zeros(2), "v": torch.zeros(2)}
    with pytest.raises(CheckpointError, match=r"entry 'w' is a value in the checkpoint \(3\) but a tensor"):
        sbp.load(str(tmp_path / "c"), target)
    assert torch.equal(target["v"], torch.zeros(2))   # refused before anything was loaded

    sbp.save({"t": [torch.arange(2.0), 3]}, str(tmp_path / "d"))
    target = {"t": (torch.zeros(2), 0)}
    with pytest.raises(CheckpointError, match=r"entry 't.1' sits in a tuple of the state_dict"):
        sbp.load(str(tmp_path / "d"), target)
    assert torch.equal(target["t"][0], torch.zeros(2))


Cfg = collections.namedtuple("Cfg", "hidden layers")
Cfg3 = collections.namedtuple("Cfg3", "hidden layers heads")


class Pair(tuple):
    """A tuple subclass that is no namedtuple: JSON gives it back as a plain list."""


def _typed_values(mesh, path, fmt):
    sbp.save({"w": sbp.distribute(torch.ones(4), mesh, "S(0)"), "cfg": Cfg(16, 2), "shape": torch.Size([4, 2]),
              "groups": [{"shape": torch.Size([3]), "cfg": Cfg(8, (1, 2))}]}, path, format=fmt)
    sd = {"w": sbp.zeros((4,), mesh, "S(0)"), "cfg": Cfg(0, 0), "shape": torch.Size([0, 0]),
          "groups": [{"shape": torch.Size([0]), "cfg": Cfg(0, (0, 0))}]}
    sbp.load(path, sd)
    inner = sd["groups"][0]
    return [(v, type(v)) for v in (sd["cfg"], sd["shape"], inner["shape"], inner["cfg"], inner["cfg"].layers)]


@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
def test_namedtuples_and_sizes_come_back_in_the_state_dicts_types(tmp_path, fmt):
    """A namedtuple or a torch.Size value comes back as that type (it came back a plain tuple), rebuilt from the
    loading state dict's entry, never from the file; a list that type cannot take is refused before anything
    is loaded, and a tuple subclass load could not rebuild is refused when saving."""
    got = sbp.testing.spmd(functools.partial(_typed_values, path=str(tmp_path / "a"), fmt=fmt), (2,))
    assert got == [[(Cfg(16, 2), Cfg), (torch.Size([4, 2]), torch.Size), (torch.Size([3]), torch.Size),
                    (Cfg(8, (1, 2)), Cfg), ((1, 2), tuple)]] * 2

    sbp.save({"w": torch.ones(2), "cfg": Cfg(16, 2), "shape": [0.5, 2]}, tmp_path / "b", format=fmt)
    for wrong, message in [({"cfg": Cfg3(0, 0, 0)}, "entry 'cfg': the checkpoint holds [16, 2] where the state_dict "
                                                    "holds a tests.io.test_checkpoint.Cfg3, which cannot be rebuilt "
                                                    "from it: its fields are ('hidden', 'layers', 'heads')"),
                           ({"shape": torch.Size([0, 0])}, "entry 'shape': the checkpoint holds [0.5, 2] where the "
                                                           "state_dict holds a torch.Size, which cannot be rebuilt "
                                                           "from it: a torch.Size holds ints")]:
        target = {"w": torch.zeros(2), "cfg": Cfg(0, 0), "shape": [0, 0]} | wrong
        with pytest.raises(CheckpointError) as info:
            sbp.load(tmp_path / "b", target)
        assert str(info.value) == message
        assert torch.equal(target["w"], torch.zeros(2)) and target["cfg"] in (Cfg(0, 0), Cfg3(0, 0, 0))

    with pytest.raises(CheckpointError) as info:
        sbp.save({"w": torch.ones(2), "p": {"pair": Pair((1, 2))}}, tmp_path / "c", format=fmt)
    assert str(info.value) == (
        "entry 'p' would not come back as it is from JSON ({'pair': (1, 2)} reads back as {'pair': [1, 2]}): at "
        "['pair']: (1, 2) is a tests.io.test_checkpoint.Pair, a tuple subclass that reads back as a plain list (valid sequences: "
        "list, tuple, a namedtuple or torch.Size (rebuilt in the type the loading state_dict holds))")


@pytest.mark.parametrize("fmt", ["sbp", "safetensors"])
def test_a_dict_subclass_value_is_refused_when_saving(tmp_path, fmt):
    # a Counter or a defaultdict was saved and came back a plain dict (a defaultdict then raised KeyError)
    for value, name in [(collections.Counter({"a": 3}), "collections.Counter"),
                        (collections.defaultdict(int, {"x": 2}), "collections.defaultdict")]:
        with pytest.raises(CheckpointError, match=f"is a {name}, a dict subclass that reads back as a plain dict "
                                                  r"\(valid mappings: dict, OrderedDict\)"):
            sbp.save({"w": torch.ones(2), "counts": value}, tmp_path / name, format=fmt)
    sbp.save({"w": torch.ones(2), "cfg": collections.OrderedDict(a=1)}, tmp_path / "ordered", format=fmt)
    target = {"w": torch.zeros(2), "cfg": {}}
    assert sbp.load(tmp_path / "ordered", target)["cfg"] == {"a": 1}


def test_ranks_saving_in_different_formats_are_refused_before_anything_is_written(tmp_path):
    # the formats run different collectives: the ranks waited out the timeout and left a half-made save behind
    def fn(mesh):
        x = sbp.distribute(torch.arange(8.), mesh, "S(0)")
        with pytest.raises(sbp.RankMismatchError, match=r"disagree on format .*sbp on ranks \[0\]; safetensors on "
                                                         r"ranks \[1\]"):
            sbp.save({"x": x}, str(tmp_path), format=("sbp", "safetensors")[mesh.rank])

    sbp.testing.spmd(fn, (2,), timeout=30)
    assert os.listdir(tmp_path) == []


def test_ranks_that_find_different_formats_raise_together(tmp_path, monkeypatch):
    # another format's save committing during a load: each rank took the path of the format it saw, and their
    # collectives never met (a hang); now every rank raises "read different saves" with nothing written
    from sbp.io import checkpoint
    sbp.testing.spmd(functools.partial(_save, path=str(tmp_path), placements="S(0)"), (2,))
    seen = {}
    real = checkpoint.checkpoint_format
    monkeypatch.setattr(checkpoint, "checkpoint_format", lambda path: seen.get(threading.get_ident(), real(path)))

    def fn(mesh):
        if mesh.rank == 1:
            seen[threading.get_ident()] = "safetensors"
        state = {name: sbp.zeros(shape, mesh, "S(0)") for name, shape in SHAPES.items()}
        with pytest.raises(CheckpointError, match="the ranks read different saves"):
            sbp.load(str(tmp_path), state)
        return sum(t.to_local().abs().sum().item() for t in state.values())

    assert sbp.testing.spmd(fn, (2,), timeout=30) == [0.0, 0.0]
