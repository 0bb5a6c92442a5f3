"""`sbp.full_state_dict`: the logical state of a sharded model and its optimizer as plain tensors, equal to one
process's after the same training step; alone (threads backend) and after torch's own state-dict helpers
(`get_model_state_dict` / `get_optimizer_state_dict`, which need torch.distributed: gloo)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import sbp
import sbp.nn
import sbp.testing


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3)).double()


def _step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model(x).square().mean().backward()
    opt.step()


def _reference():
    """(the initial model, the model after one AdamW step, its optimizer, the batch); built in the test's own
    process before any rank runs (thread-ranks would share torch's generator)."""
    model, x = _model(), torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    initial = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, x, opt)
    return initial, model, opt, x


def _sharded_state(initial: nn.Module, x: torch.Tensor, mesh, torch_helpers: bool = False):
    """(model state, optimizer state) of `initial` trained one step sharded (TP on "tp", fully sharded on
    "dp"), as full_state_dict gives them."""
    model = sbp.nn.parallelize(copy.deepcopy(initial), mesh, {"0": "colwise", "2": "rowwise"}, tp_axis="tp")
    sbp.nn.fully_shard(model, mesh, "dp")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, sbp.distribute(x, mesh, "S(0), B"), opt)
    if torch_helpers:
        full = StateDictOptions(full_state_dict=True)
        return (sbp.full_state_dict(get_model_state_dict(model, options=full)),
                sbp.full_state_dict(get_optimizer_state_dict(model, opt, options=full)))
    return sbp.full_state_dict(model.state_dict()), sbp.full_state_dict(opt.state_dict(), cpu_offload=True)


def _same(got, want) -> bool:
    """Same nesting and keys; plain tensors (no global one left) equal to 1e-12; other values equal."""
    if isinstance(want, torch.Tensor):
        return (type(got) is torch.Tensor and got.shape == want.shape and got.dtype == want.dtype
                and torch.allclose(got, want, rtol=0, atol=1e-12))
    if isinstance(want, dict):
        return isinstance(got, dict) and list(got) == list(want) and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(map(_same, got, want))
    return got == want


def test_full_state_dict_of_a_sharded_model_and_optimizer_equals_one_process() -> None:
    initial, single, opt, x = _reference()
    for model_sd, opt_sd in sbp.testing.spmd(functools.partial(_sharded_state, initial, x), (2, 2),
                                             names=("dp", "tp")):
        assert _same(model_sd, single.state_dict())
        assert _same(opt_sd, opt.state_dict())


@pytest.mark.gloo
def test_full_state_dict_after_torchs_state_dict_helpers() -> None:
    # torch's helpers key the optimizer state by parameter name (as they do for DTensor models)
    initial, single, opt, x = _reference()
    names = {i: n for i, (n, _) in enumerate(single.named_parameters())}
    want_opt = copy.deepcopy(opt.state_dict())
    want_opt["state"] = {names[i]: s for i, s in want_opt["state"].items()}
    for model_sd, opt_sd in sbp.testing.spmd(functools.partial(_sharded_state, initial, x, torch_helpers=True),
                                             (2, 2), names=("dp", "tp"), backend="gloo", timeout=120):
        assert _same(model_sd, single.state_dict())
        assert _same(opt_sd["state"], want_opt["state"])


def test_full_state_dict_keeps_kinds_and_moves_to_the_cpu() -> None:
    def fn(mesh):
        sd = {"w": sbp.distribute(torch.arange(6.).reshape(3, 2), mesh, "S(0)"), "step": 3,
              "pair": (sbp.distribute(torch.ones(2), mesh, "P(sum)"), "x"), "plain": torch.zeros(1)}
        out = sbp.full_state_dict(sd, cpu_offload=True)
        return out, [type(v).__name__ for v in (out["w"], out["pair"], out["pair"][0])]
    for out, kinds in sbp.testing.spmd(fn, (2,)):
        assert kinds == ["Tensor", "tuple", "Tensor"]
        assert out["w"].tolist() == [[0., 1.], [2., 3.], [4., 5.]] and out["step"] == 3
        assert out["pair"][0].tolist() == [1., 1.] and out["pair"][1] == "x" and out["plain"].tolist() == [0.]


def test_full_state_dict_gathers_in_the_order_of_the_keys() -> None:
    # ranks that built the same keys in different orders: each tensor still meets its own pieces (before, the
    # gathers ran in each rank's dict order and swapped halves of "a" and "b" without a word); a tensor at two
    # paths (tied) is gathered once (3 collectives: the agreement on keys and layouts, then one gather each)
    def fn(mesh):
        a = sbp.distribute(torch.arange(4.), mesh, "S(0)")
        b = sbp.distribute(torch.arange(10., 14.), mesh, "S(0)")
        sd = {"a": a, "b": b, "tied": [a]} if mesh.rank == 0 else {"tied": [a], "b": b, "a": a}
        mesh.binding.counters.reset()
        out = sbp.full_state_dict(sd)
        return {k: v.tolist() for k, v in out.items() if k != "tied"}, out["tied"][0] is out["a"], \
            len(mesh.binding.counters.calls)
    for got, tied, gathers in sbp.testing.spmd(fn, (2,)):
        assert got == {"a": [0., 1., 2., 3.], "b": [10., 11., 12., 13.]} and tied and gathers == 3


def test_full_state_dict_names_a_key_the_ranks_do_not_share() -> None:
    # before the ranks agreed on keys and layouts first, rank 0's second gather waited for a rank that had no
    # such key (a collective timeout, which named nothing)
    def fn(mesh):
        a = sbp.distribute(torch.arange(4.), mesh, "S(0)")
        sd = {"a": a, "opt": {"state": {0: [a * 2]}}}
        if mesh.rank == 0:
            sd["b"] = sbp.distribute(torch.ones(2), mesh, "B")
        try:
            sbp.full_state_dict(sd)
        except sbp.RankMismatchError as e:
            return str(e)
        return "no error"
    for message in sbp.testing.spmd(fn, (2,)):
        assert "['a', 'b', 'opt.state[0][0]'] on ranks [0]; ['a', 'opt.state[0][0]'] on ranks [1]" in message, \
            message


def test_full_state_dict_refuses_two_entries_with_one_path() -> None:
    # {"a.b": x, "a": {"b": y}}: y overwrote x in the walk, and x's replacement failed with a bare KeyError
    def fn(mesh):
        x, y = (sbp.distribute(torch.full((4,), float(v)), mesh, "S(0)") for v in (1, 2))
        with pytest.raises(sbp.CheckpointError, match="two entries of the state_dict have the path 'a.b'; rename one"):
            sbp.full_state_dict({"a.b": x, "a": {"b": y}})
        return sbp.full_state_dict({"a.b": x, "a": {"c": y}})["a.b"].tolist()

    assert sbp.testing.spmd(fn, (2,)) == [[1.0] * 4] * 2
