"""transformers' style strings, each on its own on a small module: the parallel module's output, input
gradient and every parameter gradient equal the single-device module's (float64, 2 ranks, threads), with
the placements transformers gives weight, bias and output. Also the plan vocabulary's errors and "auto"'s
merge. Needs no `transformers` except the test that the table covers every string transformers registers."""
from __future__ import annotations

import copy
import importlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sbp
import sbp.testing
from sbp import B, S
from sbp.nn.hf import REFUSED, TRANSFORMERS_STYLES, auto_plan

TOL = 1e-12


class HeadNorm(nn.Module):
    """RMS norm per head over a (..., heads * 4) activation: Qwen3 / Gemma3's q_norm on split heads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.view(*x.shape[:-1], -1, 4)).flatten(-2)        # (B, H*4)


class Sinks(nn.Module):
    """A bare per-head parameter (gpt-oss' attention sinks): laid out by its own plan entry."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(*x.shape[:-1], self.sinks.shape[0], -1)                 # (B, H, hd)
        return (h + self.sinks[:, None]).softmax(-1).flatten(-2)


class Mla(nn.Module):
    """DeepSeek-V2's kv path in small: kv_a's output splits into a part through kv_b (colwise) and a rope
    part that bypasses it."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_a = nn.Linear(8, 6)
        self.kv_b = nn.Linear(4, 8)
        self.o = nn.Linear(10, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        passed, rope = self.kv_a(x).split([4, 2], dim=-1)
        return self.o(torch.cat([self.kv_b(passed), rope], dim=-1))


class ModelRMSNorm(nn.Module):
    """A model's own RMS norm class, as transformers' models write it (``LlamaRMSNorm``): not an nn.RMSNorm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _linear() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 12))


LOCAL = "local"   # the output is this rank's plain local block (transformers' use_local_output)

# style string -> (module factory, {path: style string}, input kind, {param: tp placement}, output tp placement).
# Input kinds: "x" a plain full (3, 8), "x_local" / "x_packed" this rank's slice of (3, 8) / of each half of
# (3, 12) (what transformers' rowwise / packed_rowwise take), "x3" (3, 5, 8), "ids" token ids.
CASES = {
    "colwise": (_linear, {"0": "colwise"}, "x", {"0.weight": S(0), "0.bias": S(0)}, S(1)),
    "colwise_rep": (_linear, {"0": "colwise_rep"}, "x", {"0.weight": S(0), "0.bias": S(0)}, B),
    "colwise_gather_output": (_linear, {"0": "colwise_gather_output"}, "x", {"0.weight": S(0)}, B),
    "rowwise": (_linear, {"0": "rowwise"}, "x_local", {"0.weight": S(1), "0.bias": B}, B),
    "rowwise_rep": (_linear, {"0": "rowwise_rep"}, "x", {"0.weight": S(1), "0.bias": B}, B),
    "rowwise_split_input": (_linear, {"0": "rowwise_split_input"}, "x", {"0.weight": S(1)}, B),
    "embedding_rowwise": (lambda: nn.Sequential(nn.Embedding(13, 6)), {"0": "embedding_rowwise"}, "ids",
                          {"0.weight": S(0)}, B),
    "embedding_colwise": (lambda: nn.Sequential(nn.Embedding(13, 6)), {"0": "embedding_colwise"}, "ids",
                          {"0.weight": S(1)}, B),
    "sequence_parallel": (lambda: nn.Sequential(nn.LayerNorm(8), ModelRMSNorm(8)),
                          {"0": "sequence_parallel", "1": "sequence_parallel"}, "x3",
                          {"0.weight": B, "0.bias": B, "1.weight": B}, S(1)),
    "replicate": (_linear, {"0": "replicate"}, "x", {"0.weight": B, "0.bias": B}, B),
    "replicated_with_grad_allreduce": (
        lambda: nn.Sequential(nn.Linear(8, 12), HeadNorm(), nn.Linear(12, 8)),
        {"0": "colwise", "1.norm": "replicated_with_grad_allreduce", "2": "rowwise"}, "x",
        {"1.norm.weight": B}, B),
    "local_params": (lambda: nn.Sequential(nn.Linear(8, 12), Sinks()),
                     {"0": "colwise", "1.sinks": "colwise", "1": "local_params"}, "x", {"1.sinks": S(0)}, S(1)),
    "mla_kv_a_proj": (Mla, {"kv_a": "mla_kv_a_proj", "kv_b": "colwise", "o": "rowwise_split_input"}, "x",
                      {"kv_a.weight": B, "kv_b.weight": S(0), "o.weight": S(1)}, B),
    "all_reduce": (_linear, {"0.weight": "rowwise", "0": "all_reduce"}, "x", {"0.weight": S(1), "0.bias": B}, B),
    "packed_colwise": (_linear, {"0": "packed_colwise"}, "x", {"0.weight": S(1), "0.bias": S(1)}, LOCAL),
    "packed_rowwise": (lambda: nn.Sequential(nn.Linear(12, 8)), {"0": "packed_rowwise"}, "x_packed",
                       {"0.weight": S(2), "0.bias": B}, B),
}


def _block(t: torch.Tensor, mesh: sbp.DeviceMesh, parts: int) -> torch.Tensor:
    """This rank's slice (on the tp axis, the last mesh axis) of each of `parts` equal parts of t's last dim."""
    n, c = mesh.shape[-1], mesh.coord[-1]
    return torch.cat([torch.tensor_split(part, n, dim=-1)[c] for part in t.chunk(parts, dim=-1)], dim=-1)


def _input(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if kind == "ids":
        return torch.randint(0, 13, (3, 5), generator=g)
    shape = {"x3": (3, 5, 8), "x_packed": (3, 12)}.get(kind, (3, 8))
    return torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)


def _run_case(name: str, mesh_shape: tuple[int, ...] = (2,)) -> list[dict]:
    make, plan, kind, params, out_tp = CASES[name]
    torch.manual_seed(0)
    single = make().double()
    parallel = copy.deepcopy(single)
    x = _input(kind)
    y_ref = single(x)
    weight = torch.linspace(-1, 1, y_ref.numel(), dtype=torch.float64).view(y_ref.shape)
    (y_ref * weight).sum().backward()
    grads = {n: p.grad for n, p in single.named_parameters()}

    def fn(mesh):
        model = sbp.nn.parallelize(copy.deepcopy(parallel), mesh, plan)
        parts = {"x_local": 1, "x_packed": 2}.get(kind)
        xi = (x if parts is None else _block(x, mesh, parts)).detach().clone().requires_grad_(x.requires_grad)
        y = model(xi)
        local = not isinstance(y, sbp.GlobalTensor)   # a local output: this rank's slice of each half
        want, w = (_block(y_ref, mesh, 2), _block(weight, mesh, 2)) if local else (y_ref, weight)
        (y * w).sum().backward()
        x_grad = x.grad if parts is None or x.grad is None else _block(x.grad, mesh, parts)
        named = dict(model.named_parameters())
        return {
            "out": ((y if local else y.full()) - want).abs().max().item(),
            "out_tp": LOCAL if local else y.placements[-1],
            "x_grad": 0.0 if xi.grad is None else (xi.grad - x_grad).abs().max().item(),
            "grads": max((named[n].grad.full().reshape(g.shape) - g).abs().max().item() for n, g in grads.items()),
            "placements": {n: named[n].placements[-1] for n in params},
        }
    return sbp.testing.spmd(fn, mesh_shape)


@pytest.mark.parametrize("name", sorted(CASES))
def test_style_string_matches_single_device(name):
    _, _, _, params, out_tp = CASES[name]
    for res in _run_case(name):
        assert res["out"] < TOL and res["x_grad"] < TOL and res["grads"] < TOL, (name, res)
        assert res["out_tp"] == out_tp, (name, res["out_tp"])
        assert res["placements"] == params, (name, res["placements"])


def test_every_transformers_string_is_mapped_or_refused():
    pytest.importorskip("transformers")
    for name in ("tensor_parallel", "expert_parallel"):   # importing them registers their styles
        importlib.import_module(f"transformers.distributed.{name}")
    registered = set(importlib.import_module("transformers.distributed.parallel_utils").ALL_PARALLEL_STYLES)
    assert registered, "transformers registered no tensor-parallel style"
    missing = registered - set(TRANSFORMERS_STYLES) - set(REFUSED)
    assert not missing, f"transformers styles sbp neither maps nor refuses: {sorted(missing)}"
    assert set(CASES) == set(TRANSFORMERS_STYLES), "every mapped string has a case here"


def test_unknown_string_lists_the_valid_ones():
    with pytest.raises(sbp.SbpError, match=r"'colwize' is not a style; valid: .*'colwise_gather_output'.*"
                                           r"'embedding_rowwise'.*'sequence_parallel'"):
        sbp.testing.spmd(lambda mesh: sbp.nn.parallelize(_linear(), mesh, {"0": "colwize"}), (2,))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_string_says_why(name):
    with pytest.raises(sbp.SbpError, match=rf"transformers style '{name}' is not supported by sbp: .+"):
        sbp.testing.spmd(lambda mesh: sbp.nn.parallelize(_linear(), mesh, {"0": name}), (2,))


def test_auto_without_a_plan_is_an_error():
    with pytest.raises(sbp.SbpError, match=r"Sequential carries no tensor-parallel plan"):
        sbp.testing.spmd(lambda mesh: sbp.nn.parallelize(_linear(), mesh, "auto"), (2,))


def test_auto_merges_class_and_config_plans_under_the_base_prefix():
    class Base(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

    class Lm(nn.Module):
        base_model_prefix, _tp_plan = "model", {"lm_head": "colwise_gather_output"}

        def __init__(self) -> None:
            super().__init__()
            self.model, self.lm_head = Base(), nn.Linear(8, 5)
            self.config = type("Config", (), {"base_model_tp_plan": {"up": "colwise", "down": "rowwise"}})()

        def forward(self, x):
            return self.lm_head(self.model.down(F.relu(self.model.up(x))))

    assert auto_plan(Lm()) == {"lm_head": "colwise_gather_output", "model.up": "colwise", "model.down": "rowwise"}
    for up, down, out, diff in _auto_runs(Lm, lambda m: m.model):
        assert (up, down, out) == ((S(0),), (S(1),), (B,)) and diff < TOL


def _auto_runs(make: type, base) -> list[tuple]:
    """(placements of base(model).up's and .down's weights, of the output; the largest difference from the
    single-device output) per rank of `make()` under parallelize(..., "auto"), 2 ranks."""
    torch.manual_seed(0)
    single = make().double()
    x = _input("x")
    y_ref = single(x)

    def fn(mesh):
        model = sbp.nn.parallelize(copy.deepcopy(single), mesh, "auto")
        y = model(x.detach())
        return (base(model).up.weight.placements, base(model).down.weight.placements, y.placements,
                (y.full() - y_ref).abs().max().item())
    return sbp.testing.spmd(fn, (2,))


def test_auto_skips_plan_entries_matching_nothing_with_a_warning():
    # transformers' plans list alternatives (DeepSeek-V3: q_proj and q_b_proj, one per config) and dense
    # layers a sparse config lacks (Qwen3-MoE's mlp.gate_proj): "auto" applies the rest, as transformers does
    class Lm(nn.Module):
        _tp_plan = {"up": "colwise", "down": "rowwise", "q_b_proj": "colwise", "layers.*.mlp.gate_proj": "colwise"}

        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

        def forward(self, x):
            return self.down(F.relu(self.up(x)))

    with pytest.warns(UserWarning, match=r"2 entries of Lm's tensor-parallel plan match no module and were not "
                                         r"applied .*'q_b_proj', 'layers.\*.mlp.gate_proj'"):   # from the rank threads
        results = _auto_runs(Lm, lambda m: m)
    for up, down, out, diff in results:
        assert (up, down, out) == ((S(0),), (S(1),), (B,)) and diff < TOL
    # a plan given as a dict still must match everywhere; "auto" with nothing matching is an error too
    with pytest.raises(sbp.SbpError, match=r"plan entry 'q_b_proj' matches no module of Lm"):
        sbp.testing.spmd(lambda mesh: sbp.nn.parallelize(Lm(), mesh, dict(Lm._tp_plan)), (2,))
    Lm._tp_plan = {"q_b_proj": "colwise"}
    with pytest.raises(sbp.SbpError, match=r"no entry of Lm's tensor-parallel plan matches a module"):
        sbp.testing.spmd(lambda mesh: sbp.nn.parallelize(Lm(), mesh, "auto"), (2,))


@pytest.mark.slow   # a fresh interpreter importing torch
def test_sbp_works_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"   # an import of transformers now fails
            "import torch, sbp, sbp.nn, sbp.testing\n"
            "fn = lambda mesh: sbp.nn.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 6)), mesh,\n"
            "                                     {'0': 'colwise_gather_output'})(torch.ones(2, 4)).placements\n"
            "print(sbp.testing.spmd(fn, (2,)))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[(B,), (B,)]", proc.stderr[-2000:]


@pytest.mark.parametrize("module, plan, match", [
    (lambda: nn.Sequential(nn.Linear(8, 7)), {"0": "packed_colwise"},
     r"packed parameter '0.weight': dim 0 of length 7 does not hold 2 equal parts"),
    (_linear, {"0.weight": "packed_colwise"}, r"a packed parameter entry \('weight'\) is the expert weights of a "
                                              r"'moe_tp_experts' module"),
])
def test_packed_refusals(module, plan, match):
    """A packed dim the parts do not divide and a packed parameter entry are SbpErrors naming what is valid."""
    with pytest.raises(sbp.SbpError, match=match):
        sbp.testing.spmd(lambda mesh: sbp.nn.parallelize(module(), mesh, plan), (2,))


def test_packed_rowwise_refuses_a_global_input():
    def fn(mesh):
        model = sbp.nn.parallelize(nn.Sequential(nn.Linear(12, 8)), mesh, {"0": "packed_rowwise"})
        model(sbp.distribute(torch.ones(3, 12), mesh, "B"))
    with pytest.raises(sbp.SbpError, match=r"packed rowwise Linear takes its input as this rank's slice of every "
                                           r"part .* got a global tensor with placements \(B,\)"):
        sbp.testing.spmd(fn, (2,))


def test_packed_style_arguments():
    with pytest.raises(sbp.SbpError, match=r"Packed\(along='sideways'\): .* valid: 'colwise', 'rowwise'"):
        sbp.nn.Packed(along="sideways")
    with pytest.raises(sbp.SbpError, match=r"Packed\(parts=0\)"):
        sbp.nn.Packed(parts=0)
