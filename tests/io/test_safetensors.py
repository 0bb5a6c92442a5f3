"""`sbp.save(..., format="safetensors")` and loading safetensors into any layout: round trips that reshard
(even, uneven, tiny, empty, 1-d; float64/bfloat16/int64/bool; Partial saved reduced), files read by
`safetensors.torch.load_file`, each rank reading only the bytes of its blocks, a transformers index with
shards, `from_pretrained` of an sbp-saved tensor-parallel Llama, and damage or mismatch raising
`sbp.CheckpointError`. In-process SPMD tier (threads backend).
"""
from __future__ import annotations

import copy
import functools
import json
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import sbp
import sbp.nn
import sbp.testing
from sbp.io.state import host_barrier
from sbp.values.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::sbp.tensor.global_tensor.FallbackWarning")

TENSORS = {"even": ((8, 4), torch.float32), "uneven": ((10, 7), torch.float64), "tiny": ((2, 3), torch.bfloat16),
           "empty": ((0, 4), torch.float32), "vector": ((5,), torch.int64), "flags": ((3, 5), torch.bool),
           "cube": ((3, 5, 4), torch.float32)}


def value(shape, dtype):
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).view(shape)
    return (t % 2 == 1) if dtype == torch.bool else t.to(dtype)


def _save(mesh, path, pls):
    sd = {k: sbp.distribute(value(s, d), mesh, pls) for k, (s, d) in TENSORS.items()}
    part = sbp.from_local(value((3, 2), torch.float32) * (mesh.coord[0] + 1), mesh,
                          ("P(sum)",) + ("B",) * (mesh.ndim - 1), global_shape=(3, 2))
    sbp.save(sd | {"partial": part, "plain": torch.ones(2), "step": 4, "cfg": {"betas": [0.9, 0.99]}}, path,
             format="safetensors")


def _load(mesh, path, pls):
    sd = {k: sbp.zeros(s, mesh, pls, dtype=d) for k, (s, d) in TENSORS.items()}
    sd |= {"partial": sbp.zeros((3, 2), mesh, pls), "plain": torch.zeros(2), "step": 0, "cfg": {}}
    sbp.load(path, sd)
    return {k: v.full() if isinstance(v, sbp.GlobalTensor) else v for k, v in sd.items()}


@pytest.mark.parametrize("save_shape, save_pls, load_shape, load_pls", [
    ((2, 2), "S(0), S(-1)", (4,), "S(-1)"),
    ((4,), "S(0)", (2, 2), "S(-1), S(0)"),
    ((2, 2), "B, S(0)", (3,), "S(0)"),
    ((4,), "S(-1)", (2, 2), "B, P(max)"),
], ids=lambda v: str(v).replace(" ", ""))
def test_roundtrip_reshards_and_load_file_reads_it(tmp_path, save_shape, save_pls, load_shape, load_pls):
    sbp.testing.spmd(functools.partial(_save, path=str(tmp_path), pls=save_pls), save_shape)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    plain = load_file(tmp_path / "model.safetensors")
    want = {k: value(s, d) for k, (s, d) in TENSORS.items()} | {"partial": value((3, 2), torch.float32) *
                                                               sum(range(1, save_shape[0] + 1)), "plain": torch.ones(2)}
    assert sorted(plain) == sorted(want)
    for k, t in want.items():
        assert plain[k].dtype == t.dtype and torch.equal(plain[k], t), k
    for got in sbp.testing.spmd(functools.partial(_load, path=str(tmp_path), pls=load_pls), load_shape):
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
        assert got["step"] == 4 and got["cfg"] == {"betas": [0.9, 0.99]}


def test_each_rank_reads_only_its_blocks(tmp_path, monkeypatch):
    shape = (64, 48)
    save_file({"w": torch.arange(64 * 48, dtype=torch.float32).view(shape)}, tmp_path / "w.safetensors")
    read = []
    real = os.pread
    start = 8 + int.from_bytes((tmp_path / "w.safetensors").read_bytes()[:8], "little")   # the data's first byte
    monkeypatch.setattr(os, "pread", lambda fd, n, at: (at >= start and read.append(n)) or real(fd, n, at))

    def load(mesh, pls):
        x = sbp.zeros(shape, mesh, pls)
        sbp.load(tmp_path / "w.safetensors", {"w": x})
        return x.full()
    for pls, runs_per_rank in (("S(0)", 1), ("S(1)", 64)):     # row blocks: one run; column blocks: one per row
        read.clear()
        got = sbp.testing.spmd(functools.partial(load, pls=pls), (4,))
        assert all(torch.equal(g, torch.arange(64 * 48, dtype=torch.float32).view(shape)) for g in got)
        assert sum(read) == 64 * 48 * 4              # every byte once over the 4 ranks: no rank read another's
        assert len(read) == 4 * runs_per_rank


def test_transformers_index_with_shards(tmp_path):
    save_file({"a": torch.arange(6.).view(2, 3)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.arange(4, dtype=torch.int64)}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                        "b": "model-00002-of-00002.safetensors"}}))

    def load(mesh):
        sd = {"a": sbp.zeros((2, 3), mesh, "S(1)"), "b": sbp.zeros((4,), mesh, "S(0)", dtype=torch.int64)}
        sbp.load(tmp_path, sd)
        return sd["a"].full().tolist(), sd["b"].full().tolist()
    assert sbp.testing.spmd(load, (2,))[1] == ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [0, 1, 2, 3])


def _tied_load(mesh, path):
    emb = torch.nn.Embedding(4, 3)
    head = torch.nn.Linear(3, 4, bias=False)
    head.weight = emb.weight   # tied, as an LM head and its embedding
    model = sbp.nn.parallelize(torch.nn.ModuleDict({"emb": emb, "head": head}), mesh,
                               {"emb": "embedding", "head": "colwise"})
    sbp.load(path, model.state_dict())   # strict: "head.weight" is the tensor "emb.weight" fills
    return model["emb"].weight.full().tolist(), model["head"].weight is model["emb"].weight


def test_a_tied_key_transformers_left_out_loads_through_its_twin(tmp_path):
    # transformers writes a tied weight once; a strict load named the other key missing from the checkpoint
    save_file({"emb.weight": torch.arange(12.).view(4, 3)}, tmp_path / "model.safetensors")
    for values, tied in sbp.testing.spmd(functools.partial(_tied_load, path=str(tmp_path)), (2,)):
        assert values == torch.arange(12.).view(4, 3).tolist() and tied


def test_a_save_that_dies_before_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    sbp.testing.spmd(functools.partial(_save, path=str(tmp_path), pls="S(0)"), (2,))
    before = (tmp_path / "model.safetensors").read_bytes()
    real = os.replace

    def dying(src, dst):
        if str(dst).endswith(".safetensors"):
            raise OSError("killed before the switch")
        return real(src, dst)
    monkeypatch.setattr(os, "replace", dying)

    def save_other(mesh):
        sbp.save({"even": sbp.zeros((8, 4), mesh, "S(0)")}, str(tmp_path), format="safetensors")
    with pytest.raises(sbp.testing.SpmdError):
        sbp.testing.spmd(save_other, (2,))
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_a_load_during_a_save_reads_the_file_it_checked(tmp_path, monkeypatch):
    """Another job replaces the file between this load's header checks and its tensor reads (its longer
    header moves every tensor): the reads still come from the file whose header was checked."""
    def state(step):
        return {"w": torch.full((4,), float(step)), "b": torch.full((2,), float(step)), "step": step,
                "note": "x" * step}
    sbp.save(state(1), tmp_path, format="safetensors")
    sbp.save(state(123), tmp_path / "other", format="safetensors")
    real = sbp.io.safetensors._check

    def then_another_save(*args):
        out = real(*args)
        os.replace(tmp_path / "other" / "model.safetensors", tmp_path / "model.safetensors")
        return out
    monkeypatch.setattr(sbp.io.safetensors, "_check", then_another_save)
    sd = {"w": torch.zeros(4), "b": torch.zeros(2), "step": 0, "note": ""}
    sbp.load(tmp_path, sd)
    assert sd["step"] == 1 and sd["note"] == "x"
    assert sd["w"].tolist() == [1.0] * 4 and sd["b"].tolist() == [1.0] * 2


def test_ranks_that_read_different_saves_all_raise(tmp_path, monkeypatch):
    """Rank 0 checks the file of save 1; another job then replaces it; rank 1 checks save 2's file. Each
    rank alone would load a whole save: only the ranks' agreement refuses the mix."""
    sbp.testing.spmd(functools.partial(_save, path=str(tmp_path), pls="S(0)"), (2,))
    sbp.testing.spmd(functools.partial(_save, path=str(tmp_path / "other"), pls="S(0)"), (2,))   # same bytes, later
    real, turn, first = sbp.io.safetensors._check, threading.Event(), []

    def in_turn(*args):
        if threading.current_thread() is not first[0]:
            turn.wait()
            return real(*args)
        out = real(*args)
        os.replace(tmp_path / "other" / "model.safetensors", tmp_path / "model.safetensors")
        turn.set()
        return out
    monkeypatch.setattr(sbp.io.safetensors, "_check", in_turn)

    def load(mesh):
        if mesh.rank == 0:
            first.append(threading.current_thread())
        host_barrier(mesh)
        sd = {k: sbp.zeros(s, mesh, "S(0)", dtype=d) for k, (s, d) in TENSORS.items()}
        sd |= {"partial": sbp.zeros((3, 2), mesh, "S(0)"), "plain": torch.zeros(2), "step": 0, "cfg": {}}
        try:
            sbp.load(tmp_path, sd)
            return "loaded"
        except CheckpointError as e:
            return str(e)
    assert sbp.testing.spmd(load, (2,)) == [
        f"load of {str(tmp_path)!r}: the ranks read different saves (another save committed during the load; no "
        f"rank's state_dict was changed); load again once the save is done"] * 2


def test_a_read_error_on_one_rank_fails_the_load_on_every_rank_with_nothing_written(tmp_path, monkeypatch):
    # the data reads came after the ranks' agreement: only the failing rank raised (a bare OSError), with its
    # first target filled and the second not, while the other rank returned; now every read comes before it
    def save(mesh):
        sbp.save({"a": sbp.distribute(torch.arange(16.).view(4, 4), mesh, "S(0)"),
                  "b": sbp.distribute(torch.arange(16.).view(4, 4) + 100, mesh, "S(0)")}, str(tmp_path),
                 format="safetensors")
    sbp.testing.spmd(save, (2,))
    failing, real = set(), os.pread

    def flaky(fd, n, offset):
        if threading.get_ident() in failing and offset > 8:   # a data read (the header is at 0 and 8)
            raise OSError(5, "Input/output error")
        return real(fd, n, offset)
    monkeypatch.setattr(os, "pread", flaky)

    def load(mesh):
        if mesh.rank == 1:
            failing.add(threading.get_ident())
        state = {"a": sbp.zeros((4, 4), mesh, "S(1)"), "b": sbp.zeros((4, 4), mesh, "S(1)")}
        with pytest.raises(CheckpointError, match="Input/output error") as info:
            sbp.load(str(tmp_path), state)
        return str(info.value).split(":")[0], [state[k].to_local().abs().sum().item() for k in "ab"]

    got = sbp.testing.spmd(load, (2,))
    assert got == [(f"load of {str(tmp_path)!r} failed on rank 1 (no rank's state_dict was changed); rank 1",
                    [0.0, 0.0]), (f"cannot read {os.path.join(str(tmp_path), 'model.safetensors')!r}", [0.0, 0.0])]


# ---- from_pretrained of an sbp-saved tensor-parallel Llama ------------------------------------------------

def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))


def _train_tp_and_save(mesh, single, path):
    model = sbp.nn.parallelize(copy.deepcopy(single), mesh, "auto")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loss = model(input_ids=IDS, labels=IDS).loss
    (loss.full() if isinstance(loss, sbp.GlobalTensor) else loss).backward()
    opt.step()                                        # the saved weights are the trained, sharded ones
    sbp.save(model.state_dict(), path, format="safetensors")
    if mesh.rank == 0:
        model.config.save_pretrained(path)
    logits = model(input_ids=IDS).logits
    return (logits.full() if isinstance(logits, sbp.GlobalTensor) else logits).detach(), \
        {k: v.full() if isinstance(v, sbp.GlobalTensor) else v for k, v in model.state_dict().items()}


@pytest.mark.slow   # imports transformers and builds, trains and reloads a model: seconds
def test_from_pretrained_of_an_sbp_saved_tp_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    single = _llama()
    run = functools.partial(_train_tp_and_save, single=single, path=str(tmp_path))
    logits, weights = sbp.testing.spmd(run, (2,))[0]
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, attn_implementation="eager")
    for k, w in loaded.state_dict().items():
        assert torch.equal(w, weights[k]), k                  # the logical weights, exactly
    assert sorted(load_file(tmp_path / "model.safetensors")) == sorted(weights)
    with torch.no_grad():
        got = loaded(input_ids=IDS).logits
    torch.testing.assert_close(got, logits, rtol=0, atol=1e-12)   # float64: only the summation order differs


# ---- damage and mismatches --------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    sbp.testing.spmd(functools.partial(_save, path=str(tmp_path), pls="S(0)"), (2,))
    return tmp_path


def load_error(path, edit) -> str:
    def load(mesh):
        sd = {k: sbp.zeros(s, mesh, "S(0)", dtype=d) for k, (s, d) in TENSORS.items()}
        sd |= {"partial": sbp.zeros((3, 2), mesh, "S(0)"), "plain": torch.zeros(2), "step": 0, "cfg": {}}
        edit(sd)
        sbp.load(path, sd)
    with pytest.raises(sbp.testing.SpmdError) as info:
        sbp.testing.spmd(load, (2,))
    assert isinstance(info.value.__cause__, CheckpointError), repr(info.value.__cause__)
    return str(info.value.__cause__)


def test_mismatches(saved):
    file = str(saved / "model.safetensors")

    def shape(sd):
        sd["even"] = torch.zeros(8, 5)

    def dtype(sd):
        sd["even"] = torch.zeros(8, 4, dtype=torch.float64)

    def keys(sd):
        sd.pop("plain")
        sd["new"] = torch.zeros(1)
    assert load_error(saved, shape) == f"tensor 'even': global shape (8, 4) in {file!r}, (8, 5) in the state_dict"
    assert load_error(saved, dtype) == \
        f"tensor 'even': dtype torch.float32 in {file!r}, torch.float64 in the state_dict"
    assert load_error(saved, keys).endswith("have different keys: missing from the checkpoint: ['new']; in the "
                                            "checkpoint but not in the state_dict: ['plain']")


def test_damaged_files(saved):
    data = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(data[:len(data) - 10])
    assert "do not hold" in load_error(saved, lambda sd: None)
    (saved / "model.safetensors").write_bytes(data[:20])
    assert "is not a safetensors file" in load_error(saved, lambda sd: None)
    deep = b"[" * 100_000 + b"]" * 100_000        # deeper than json's recursion goes
    (saved / "model.safetensors").write_bytes(len(deep).to_bytes(8, "little") + deep)
    assert "the safetensors header is not JSON (maximum recursion depth" in load_error(saved, lambda sd: None)


def test_unsupported_dtype_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="which safetensors cannot hold"):
        sbp.save({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path, format="safetensors")


def test_a_tensor_named_like_the_files_own_metadata_is_refused(tmp_path):
    """safetensors keeps the file's metadata under the name '__metadata__': a tensor of that name was dropped
    from the header (the file unreadable); it is refused before anything is written."""
    with pytest.raises(CheckpointError) as info:
        sbp.save({"__metadata__": torch.arange(3.), "w": torch.ones(2)}, tmp_path, format="safetensors")
    assert str(info.value) == ("entry '__metadata__': safetensors reserves the name '__metadata__' for the file's "
                               "own metadata (sbp keeps the JSON values there); rename the entry")
    assert os.listdir(tmp_path) == []
