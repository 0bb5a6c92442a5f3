"""DCP interop on gloo (4 processes): checkpoints written by DTensor code (`torch.distributed.checkpoint.save`
of a `parallelize_module`d model and its AdamW state, or of 2-D-sharded DTensors) load with `sbp.load`
into other meshes and placements, and `sbp.save(..., format="dcp")` loads into DTensors with
`torch.distributed.checkpoint.load`; 1-D and 2-D meshes, even and uneven shapes, Partial reduced first.
Every value is compared exactly. Worker functions are module-level (they travel pickled).
"""
from __future__ import annotations

import collections
import copy
import functools
import os

import pytest
import torch
from torch import nn

import sbp
import sbp.nn
import sbp.testing
from sbp.values.errors import CheckpointError

spmd = functools.partial(sbp.testing.spmd, backend="gloo", timeout=60)
pytestmark = [pytest.mark.gloo, pytest.mark.filterwarnings("ignore::sbp.tensor.global_tensor.FallbackWarning")]

PLAN = {"0": "colwise", "2": "rowwise"}
BATCH = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.GELU(), nn.Linear(hidden, 6)).double()


def _train(model, full):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        out = model(BATCH)
        (full(out) ** 2).sum().backward()
        opt.step()
    return opt


def _dtensor_model(hidden, torch_mesh):
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = parallelize_module(mlp(hidden), torch_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(2):   # gradients set by hand: DTensor's own forward refuses uneven row-wise shards
        for i, p in enumerate(model.parameters()):
            g = torch.linspace(-1, 1, p.numel(), dtype=p.dtype).view(p.shape) * (i + step + 1)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    return model, opt


def _full(x):
    if hasattr(x, "full_tensor"):
        return x.full_tensor()
    return x.full() if isinstance(x, sbp.GlobalTensor) else x


def _flat(sd, prefix=""):
    items = sd.items() if isinstance(sd, dict) else enumerate(sd)
    out = {}
    for k, v in items:
        if isinstance(v, (dict, list)):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a: dict, b: dict) -> list[str]:
    """The keys whose values differ (tensors compared exactly, by their full logical value)."""
    fa, fb = _flat(a), _flat(b)
    bad = sorted(set(fa) ^ set(fb))
    for k in set(fa) & set(fb):
        x, y = _full(fa[k]), _full(fb[k])
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        if not same:
            bad.append(k)
    return bad


def _dtensor_to_sbp_model(mesh, path, hidden):
    """DTensor TP model + AdamW -> DCP -> an sbp-parallelized model + AdamW on the same ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    tmesh = init_device_mesh("cpu", (4,))
    dmodel, dopt = _dtensor_model(hidden, tmesh)
    saved = {"model": dmodel.state_dict(), "optim": dopt.state_dict()}
    dcp.save(saved, checkpoint_id=path)
    model = sbp.nn.parallelize(mlp(hidden), mesh, PLAN)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)    # other values everywhere: the load must set them
    opt.zero_grad()
    (model(BATCH * 2).full() ** 2).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    sbp.load(path, state)
    opt.load_state_dict(state["optim"])
    return _same(saved, {"model": model.state_dict(), "optim": opt.state_dict()})


def _sbp_to_dtensor_model(mesh, path, hidden):
    """sbp TP model + AdamW (+ a P(sum) tensor) -> sbp.save(format="dcp") -> a DTensor model + AdamW."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = sbp.nn.parallelize(mlp(hidden), mesh, PLAN)
    opt = _train(model, lambda out: out.full())
    partial = sbp.from_local(torch.arange(15.).view(5, 3) * (mesh.rank + 1), mesh, "P(sum)", global_shape=(5, 3))
    sbp.save({"model": model.state_dict(), "optim": opt.state_dict(), "partial": partial}, path, format="dcp")
    tmesh = init_device_mesh("cpu", (4,))
    dmodel, dopt = _dtensor_model(hidden, tmesh)
    with torch.no_grad():
        for p in dmodel.parameters():
            p.zero_()
    state = {"model": dmodel.state_dict(), "optim": dopt.state_dict(),
             "partial": distribute_tensor(torch.zeros(5, 3), tmesh, [Replicate()])}
    dcp.load(state, checkpoint_id=path)
    dopt.load_state_dict(state["optim"])
    bad = _same({"model": model.state_dict(), "optim": opt.state_dict()},
                {"model": dmodel.state_dict(), "optim": dopt.state_dict()})
    return bad + ([] if torch.equal(state["partial"].full_tensor(), torch.arange(15.).view(5, 3) * 10) else ["partial"])


@pytest.mark.parametrize("hidden", [8, 10], ids=["even", "uneven"])
def test_model_and_adamw_dtensor_to_sbp_and_back_1d(tmp_path, hidden):
    assert spmd(functools.partial(_dtensor_to_sbp_model, path=str(tmp_path / "a"), hidden=hidden), (4,)) == [[]] * 4
    assert spmd(functools.partial(_sbp_to_dtensor_model, path=str(tmp_path / "b"), hidden=hidden), (4,)) == [[]] * 4


# ---- 2-D meshes: DTensors on a 2x2 mesh, sbp on other meshes and placements --------------------------------

SHAPES_2D = {"even": ((8, 4), "S(0), S(1)", "S(1), S(0)"), "uneven": ((10, 7), "S(0), S(0)", "S(1), B"),
             "tiny": ((3, 2), "S(1), S(0)", "S(0), S(0)"), "rep": ((5, 3), "B, S(1)", "P(sum), S(0)"),
             "vector": ((9,), "S(0), B", "B, S(0)")}


def values(shape, scale=1) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1) * scale


def _torch_placements(pls):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [Shard(p.dim) if isinstance(p, sbp.Split) else Partial() if isinstance(p, sbp.Partial) else Replicate()
            for p in sbp.placements(pls)]


def _adamw_on_dtensors(tmesh):
    """2-D sharded DTensor parameters trained one AdamW step: their state is 2-D sharded too."""
    from torch.distributed.tensor import distribute_tensor

    params = {k: nn.Parameter(distribute_tensor(values(shape), tmesh, _torch_placements(dt)))
              for k, (shape, dt, _) in SHAPES_2D.items()}
    opt = torch.optim.AdamW(params.values(), lr=0.1)
    sum((p * p).sum() for p in params.values()).backward()
    opt.step()
    return params, opt


def _dtensor_to_sbp_2d(mesh, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    tmesh = init_device_mesh("cpu", (2, 2))
    params, opt = _adamw_on_dtensors(tmesh)
    saved = {"params": dict(params), "optim": opt.state_dict()}
    dcp.save(saved, checkpoint_id=path)
    # sbp targets: the same global shapes in other placements, on the 2x2 mesh passed in or on 4 ranks
    layouts = {shape: pls for shape, _, pls in SHAPES_2D.values()}

    def target(v):
        if isinstance(v, dict):
            return {k: target(x) for k, x in v.items()}
        if isinstance(v, list):
            return [target(x) for x in v]
        if hasattr(v, "full_tensor"):
            return sbp.zeros(tuple(v.shape), mesh, layouts[tuple(v.shape)] if mesh.ndim == 2 else "S(0)", dtype=v.dtype)
        return torch.zeros_like(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)

    state = target(saved)
    sbp.load(path, state)
    return _same(saved, state)


def _sbp_to_dtensor_2d(mesh, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    state = {}
    for k, (shape, _, pls) in SHAPES_2D.items():
        if "P" in pls:   # real partial contributions: rank r holds (r + 1) * v, the value is 10 * v
            state[k] = sbp.from_local(_partial_local(shape, mesh, pls), mesh, pls, global_shape=shape)
        else:
            state[k] = sbp.distribute(values(shape), mesh, pls)
    sbp.save({"t": state, "step": 5}, path, format="dcp")
    tmesh = init_device_mesh("cpu", (2, 2))
    loaded = {"t": {k: distribute_tensor(torch.zeros(shape), tmesh, _torch_placements(dt))
                    for k, (shape, dt, _) in SHAPES_2D.items()}, "step": 0}
    dcp.load(loaded, checkpoint_id=path)
    want = {k: state[k].full() for k in SHAPES_2D}
    bad = [k for k in SHAPES_2D if not torch.equal(loaded["t"][k].full_tensor(), want[k])]
    return bad + ([] if loaded["step"] == 5 else ["step"])


def _partial_local(shape, mesh, pls):
    """This rank's local tensor of a `pls` layout whose P(sum) axis holds (axis coord + 1) * v: the logical
    value is 3 * v on a 2-long axis."""
    b = sbp.distribute(values(shape), mesh, pls.replace("P(sum)", "B")).to_local()
    axis = [i for i, p in enumerate(sbp.placements(pls)) if isinstance(p, sbp.Partial)][0]
    return b * (mesh.coord[axis] + 1)


def test_dtensor_2d_to_sbp_on_2d_and_1d_meshes(tmp_path):
    assert spmd(functools.partial(_dtensor_to_sbp_2d, path=str(tmp_path / "a")), (2, 2)) == [[]] * 4
    assert spmd(functools.partial(_dtensor_to_sbp_2d, path=str(tmp_path / "b")), (4,)) == [[]] * 4


def test_sbp_2d_with_partial_to_dtensor_2d(tmp_path):
    assert spmd(functools.partial(_sbp_to_dtensor_2d, path=str(tmp_path)), (2, 2)) == [[]] * 4


def _dcp_errors(mesh, path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.), "n": 1}, checkpoint_id=path)
    out = []
    for state in ({"w": sbp.zeros((7,), mesh, "S(0)"), "n": 0}, {"w": sbp.zeros((6,), mesh, "S(0)")},
                  {"w": sbp.zeros((6,), mesh, "S(0)", dtype=torch.float64), "n": 0}):
        try:
            sbp.load(path, state)
            out.append("loaded")
        except CheckpointError as e:
            out.append(str(e))
    state = {"w": sbp.zeros((6,), mesh, "S(0)")}
    sbp.load(path, state, strict=False)
    return out + [state["w"].full().tolist()]


def test_mismatches_raise_checkpoint_error(tmp_path):
    got = spmd(functools.partial(_dcp_errors, path=str(tmp_path)), (4,))[0]
    assert got == ["tensor 'w': global shape (6,) in the checkpoint, (7,) in the state_dict",
                   "the DCP checkpoint and the state_dict have different keys: in the checkpoint but not in the "
                   "state_dict: ['n']",
                   "tensor 'w': dtype float32 in the checkpoint, float64 in the state_dict",
                   [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]


def test_dcp_needs_torch_distributed_on_a_mesh(tmp_path):
    def fn(mesh):
        sbp.save({"w": sbp.zeros((4,), mesh, "S(0)")}, tmp_path, format="dcp")
    with pytest.raises(sbp.testing.SpmdError) as info:
        sbp.testing.spmd(fn, (2,))
    assert "DCP checkpoints need a mesh bound to torch.distributed" in str(info.value.__cause__)


def test_plain_state_dict_in_one_process(tmp_path):
    sbp.save({"w": torch.arange(4.), "cfg": {"lr": 0.1}}, tmp_path, format="dcp")
    state = {"w": torch.zeros(4), "cfg": {"lr": 0.0}}
    sbp.load(tmp_path, state)
    assert torch.equal(state["w"], torch.arange(4.)) and state["cfg"] == {"lr": 0.1}


def _tuple_round_trip(mesh, path):
    import torch.distributed.checkpoint as dcp

    sbp.save({"t": (sbp.distribute(torch.arange(4.) + 1, mesh, "S(0)"), torch.tensor([7.]))}, path, format="dcp")
    sd = {"t": (sbp.zeros((4,), mesh, "S(0)"), torch.zeros(1))}
    sbp.load(path, sd)
    plain = {"t": [torch.zeros(4), torch.zeros(1)]}   # DTensor code sees the tuple as a list: keys t.0, t.1
    dcp.load(plain, checkpoint_id=path)
    return sd["t"][0].full().tolist(), sd["t"][1].tolist(), [x.tolist() for x in plain["t"]]


def test_a_tuple_of_tensors_round_trips_like_a_list(tmp_path):
    got = spmd(functools.partial(_tuple_round_trip, path=str(tmp_path)), (2,))
    assert got == [([1.0, 2.0, 3.0, 4.0], [7.0], [[1.0, 2.0, 3.0, 4.0], [7.0]])] * 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # one process is the intent
@pytest.mark.parametrize("saved, target, message", [
    ({"w": torch.arange(4.)}, {"w": torch.zeros(4, dtype=torch.int64)},
     "tensor 'w': dtype float32 in the checkpoint, int64 in the state_dict"),
    ({"w": torch.arange(4.)}, {"w": torch.zeros(2, 2)},
     "tensor 'w': global shape (4,) in the checkpoint, (2, 2) in the state_dict"),
    ({"step": 3}, {"step": torch.tensor(0)},
     "entry 'step' is a value in the checkpoint (3) but a tensor in the state_dict"),
    ({"step": torch.tensor(3)}, {"step": 0}, "entry 'step' is a tensor in the checkpoint but a int in the state_dict"),
], ids=["dtype", "shape", "value for tensor", "tensor for value"])
def test_plain_targets_are_checked_like_the_sbp_format(tmp_path, saved, target, message):
    """The messages of the sbp format (docs/checkpoints.md), where DCP would convert or skip silently."""
    for fmt in ("sbp", "dcp"):
        path = tmp_path / fmt
        sbp.save(saved, path, format=fmt)
        before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in target.items()}
        with pytest.raises(CheckpointError) as info:
            sbp.load(path, target)
        assert str(info.value) == message, fmt
        assert all(torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]
                   for k, v in target.items())


Cfg = collections.namedtuple("Cfg", "hidden layers")
Cfg3 = collections.namedtuple("Cfg3", "hidden layers heads")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # one process is the intent
def test_a_dict_value_replaces_the_state_dicts_as_in_the_other_formats(tmp_path):
    """DCP splits a dict value into one entry per item (meta.epoch, meta.best): loading into a dict with other
    keys raised (strict) or kept the stale dict (strict=False). sbp's DCP saves also carry the values whole,
    which replace the state dict's as in the sbp and safetensors formats -- empty dicts inside them included
    (an optimizer before its first step), which DCP's own entries cannot hold. DTensor code still reads
    DCP's own entries."""
    import torch.distributed.checkpoint as dcp

    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]
    saved = {"w": torch.arange(4.), "meta": {"epoch": 3, "best": 0.5}, "optim": {"state": {}, "param_groups": groups}}
    for fmt in ("sbp", "safetensors", "dcp"):
        sbp.save(saved, tmp_path / fmt, format=fmt)
        for strict, stale in ((True, {}), (True, {"epoch": 0, "old": 1}), (False, {})):
            sd = {"w": torch.zeros(4), "meta": stale, "optim": {"param_groups": [{"lr": 0.0}]}}
            sbp.load(tmp_path / fmt, sd, strict=strict)
            assert sd["meta"] == {"epoch": 3, "best": 0.5}, (fmt, strict, stale)
            assert sd["optim"] == {"state": {}, "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99], "params": [0]}]}
            assert torch.equal(sd["w"], torch.arange(4.))
    theirs = {"meta": {"epoch": 0, "best": 0.0},
              "optim": {"param_groups": [{"lr": 0.0, "betas": (0, 0), "params": [1]}]}}
    dcp.load(theirs, checkpoint_id=tmp_path / "dcp")
    assert theirs == {"meta": {"epoch": 3, "best": 0.5}, "optim": {"param_groups": groups}}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_namedtuple_and_size_values_come_back_from_dcp_as_from_the_other_formats(tmp_path):
    """A namedtuple value, which DCP pickles with its class, made sbp.load of sbp's own checkpoint fail with a
    message naming no entry; it comes back in the state dict's type, as a torch.Size does (as in the sbp
    format), and a state dict whose type cannot take it is refused before anything is read. A namedtuple in
    DCP's own entries (DTensor code's checkpoints) is refused naming its entry."""
    import torch.distributed.checkpoint as dcp

    sbp.save({"w": torch.arange(4.), "cfg": Cfg(16, 2), "shape": torch.Size([4, 2])}, tmp_path / "a", format="dcp")
    sd = {"w": torch.zeros(4), "cfg": Cfg(0, 0), "shape": torch.Size([0, 0])}
    sbp.load(tmp_path / "a", sd)
    assert (sd["cfg"], type(sd["cfg"]), sd["shape"], type(sd["shape"])) == (Cfg(16, 2), Cfg, (4, 2), torch.Size)
    assert torch.equal(sd["w"], torch.arange(4.))

    sd = {"w": torch.zeros(4), "cfg": Cfg3(0, 0, 0), "shape": torch.Size([0, 0])}
    with pytest.raises(CheckpointError, match=r"^entry 'cfg': the checkpoint holds \[16, 2\] where the state_dict "
                                              r"holds a tests.io.test_dcp.Cfg3, which cannot be rebuilt from it"):
        sbp.load(tmp_path / "a", sd)
    assert torch.equal(sd["w"], torch.zeros(4)) and sd["cfg"] == Cfg3(0, 0, 0)

    dcp.save({"w": torch.arange(4.), "cfg": Cfg(16, 2)}, checkpoint_id=tmp_path / "b")   # DTensor code
    with pytest.raises(CheckpointError, match=r"^entry 'cfg' of the DCP checkpoint holds an object sbp does not "
                                              r"unpickle .*Unsupported global: GLOBAL tests.io.test_dcp.Cfg"):
        sbp.load(tmp_path / "b", {"w": torch.zeros(4), "cfg": Cfg(0, 0)})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_name_of_sbps_record_of_values_is_reserved(tmp_path):
    with pytest.raises(CheckpointError, match="^entry '__sbp_values__': format='dcp' reserves this name"):
        sbp.save({"w": torch.ones(2), "__sbp_values__": {"a": 1}}, tmp_path, format="dcp")
    assert os.listdir(tmp_path) == []


def _save_dcp_step(mesh, path: str, step: int) -> None:
    sbp.save({"w": sbp.distribute(torch.full((4, 4), float(step)), mesh, "S(0)"), "step": step}, path, format="dcp")


def _load_while_another_save_commits(mesh, path: str, other: str):
    """Rank 1 reads the `.metadata` of another save (as when another job's save commits between the ranks'
    reads of `path`); rank 0 reads `path`'s."""
    from sbp.io import dcp as sbp_dcp
    real = sbp_dcp._CheckedReader._get_metadata_path
    if mesh.rank == 1:   # (undone below: the gloo worker processes serve the next tests)
        sbp_dcp._CheckedReader._get_metadata_path = lambda self, rank=None: real(type(self)(other), rank)
    state = {"w": sbp.zeros((4, 4), mesh, "S(1)"), "step": 0}
    try:
        sbp.load(path, state)
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        sbp_dcp._CheckedReader._get_metadata_path = real
    return error, state["step"], state["w"].to_local().unique().tolist()


def test_a_dcp_load_whose_ranks_read_different_saves_raises_on_every_rank(tmp_path):
    # rank 0 loaded step 1 and its columns from one save, rank 1 step 2 and its columns from the other, and both
    # returned; now the ranks compare the `.metadata` they read before any data is read
    path, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    spmd(functools.partial(_save_dcp_step, path=path, step=1), (2,))
    spmd(functools.partial(_save_dcp_step, path=other, step=2), (2,))
    for error, step, values in spmd(functools.partial(_load_while_another_save_commits, path=path, other=other), (2,)):
        assert error is not None and "the ranks read different saves" in error, error
        assert (step, values) == (0, [0.0])   # nothing written


def _save_rank_plain(mesh, path: str) -> None:
    sbp.save({"w": sbp.distribute(torch.arange(8.), mesh, "S(0)"), "a": torch.full((3,), float(mesh.rank)),
              "b": torch.full((1000,), float(mesh.rank)), "c": torch.full((2,), float(mesh.rank))}, path, format="dcp")


def _load_plain(mesh, path: str) -> dict:
    state = {"w": sbp.zeros((8,), mesh, "S(0)"), "a": torch.zeros(3), "b": torch.zeros(1000), "c": torch.zeros(2)}
    sbp.load(path, state)
    return {k: state[k].unique().tolist() for k in "abc"}


def test_plain_tensors_are_written_from_coord_0_as_in_the_other_formats(tmp_path):
    # DCP's de-duplication picked a writer per entry (load balancing): ranks holding different plain data (an
    # RNG state) saved 'a' from rank 0, 'b' from rank 1, 'c' from rank 2
    spmd(functools.partial(_save_rank_plain, path=str(tmp_path)), (4,))
    assert spmd(functools.partial(_load_plain, path=str(tmp_path)), (4,)) == [{"a": [0.0], "b": [0.0], "c": [0.0]}] * 4
