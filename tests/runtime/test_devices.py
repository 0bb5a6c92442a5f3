"""The executor on each available device: CPU always, CUDA where a GPU is present (one GPU is enough).

- The conformance cases run on the threads backend with the locals on the device, so every buffer,
  copy and reduction of the executor happens there (the threads backend hands tensors between ranks by
  copying them, on the device). On CPU a small subset checks the plumbing (the full table runs in
  tests/runtime/test_execute_threads.py); on CUDA the whole 1-D and 2x2 tables run.
- A one-rank torch.distributed world on the device's backend (gloo for "cpu", NCCL for "cuda") makes
  the torch.distributed calls of sbp's route for that device on a one-member process group, for every
  dtype and reduction the conformance suite uses, and checks that they give the one member's value
  back. sbp itself never calls torch.distributed for a one-member group (it copies locally), so this
  is how one GPU checks that NCCL accepts exactly the calls, dtypes and buffers sbp hands it. It runs
  in a process of its own, like a torchrun rank.
"""
from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import sbp
import sbp.testing
from tests.support import conformance as conf
from tests.support.repo import ROOT

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CPU_SUBSET = [conf.Case((4,), "P(min)", "S(1)", variants=conf.FEW_VARIANTS),
              conf.Case((4,), "S(0)", "S(1)", variants=conf.FEW_VARIANTS),
              conf.Case((2, 2), "S(0), S(0)", "B, S(0)", variants=conf.FEW_VARIANTS),
              conf.Case((2, 2), "P(sum), P(sum)", "S(0), S(1)", variants=conf.FEW_VARIANTS),
              conf.Case((2, 2), "P(sum), S(0)", "S(0), B", variants=conf.FEW_VARIANTS)]
CUDA_CASES = conf.cases_1d(conf.FEW_VARIANTS) + conf.cases_2d()
DEVICE_CASES = [(d, c) for d in DEVICES for c in (CPU_SUBSET if d == "cpu" else CUDA_CASES)]


@pytest.mark.parametrize("device, case", DEVICE_CASES, ids=lambda v: v if isinstance(v, str) else v.id)
def test_conformance_with_locals_on_the_device(device: str, case: conf.Case) -> None:
    per_rank = sbp.testing.spmd(functools.partial(conf.run_case, case, device=device), case.mesh_shape)
    assert {r["device"] for results in per_rank for r in results} == {device}
    conf.check_case(case, per_rank)


# ---- a one-rank world on the device's backend -----------------------------------------------------

# the conformance dtypes, and those NCCL/gloo need help with (complex as real pairs, int16 as bytes / int32)
DTYPES = ("float32", "int32", "bfloat16", "float16", "int64", "int8", "bool", "complex64", "int16")


def one_rank_world(device: str, port: int) -> dict:
    """Run in a fresh process: every torch.distributed call of sbp's route for `device`, on a one-member
    group, per dtype and reduction; returns what ran and what went wrong."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    mesh = sbp.init_mesh((1,), device_type=device)
    comm = mesh.binding
    comm._groups[(0,)] = dist.new_group([0])   # sbp makes no group for one member: give the calls one
    members, axes = (0,), (0,)
    ran, wrong = [], []

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        ran.append(what)
        if got.device.type != device or got.dtype != want.dtype or not torch.equal(got.cpu(), want.cpu()):
            wrong.append(f"{what}: got {got.dtype} on {got.device}: {got.cpu().tolist()}")

    routes = [True, False] if device == "cpu" else [False]   # gloo's own route, then NCCL's collectives
    for dtype_name in DTYPES:
        x = (torch.arange(12) % 7 - 3).to(getattr(torch, dtype_name)).to(device)
        for gloo_route in routes:
            comm._gloo = gloo_route
            tag = f"{dtype_name} {'gloo' if gloo_route else 'native'}"
            out = torch.empty_like(x)
            comm._all_gather(x, out, members, axes)
            check(f"all_gather {tag}", out, x)
            out = torch.empty_like(x)
            comm._all_to_all(out, x, (12,), (12,), members, axes, None)
            check(f"all_to_all {tag}", out, x)
            out, copied = torch.empty_like(x), torch.empty_like(x)
            comm._all_to_all(out, x, (12,), (12,), members, axes, lambda: copied.copy_(x))   # async + meanwhile
            check(f"all_to_all meanwhile {tag}", out, x)
            for op in ("sum", "min", "max"):
                check(f"reduce_scatter({op}) {tag}", comm._reduce_scatter(x.view(1, 12), members, axes, op), x)
                got, _ = comm._reduce_scatter_runs(x, (12,), members, axes, op)
                check(f"reduce_scatter_runs({op}) {tag}", got, x)
                check(f"all_reduce({op}) {tag}", comm._all_reduce(x, members, axes, op, False), x)
                check(f"all_reduce({op}) in place {tag}", comm._all_reduce(x.clone(), members, axes, op, True), x)
    comm._gloo = device == "cpu"
    # the public path on the device: distribute, redistribute, an operator, full
    t = torch.arange(12.).view(3, 4).to(device)
    y = sbp.distribute(t, mesh, "S(0)").redistribute("B")
    check("redistribute S(0) -> B", y.to_local(), t)
    check("matmul", (y @ y.t()).full(), t @ t.t())
    r = sbp.rand((4, 3), mesh, "S(0)", generator=torch.Generator(device=device).manual_seed(0))   # a device generator
    check("rand(generator=<device generator>)", r.to_local(), r.full())
    if device == "cuda":
        try:
            comm._all_reduce(torch.ones(2), members, axes, "sum", False)
            wrong.append("a CPU tensor on a CUDA mesh was not refused")
        except sbp.CommError as e:
            ran.append(f"refused: {e}")
    dist.destroy_process_group()
    return {"ran": ran, "wrong": wrong}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.gloo
def test_one_rank_world_takes_every_call_of_the_route(device: str) -> None:
    code = (f"import json; from tests.runtime import test_devices; "
            f"print(json.dumps(test_devices.one_rank_world({device!r}, {_free_port()})))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["wrong"] == []
    # dtypes x routes x (3 calls + 4 per reduction x 3 reductions) + 3 public-path checks
    routes = 2 if device == "cpu" else 1
    assert len([r for r in report["ran"] if not r.startswith("refused")]) == len(DTYPES) * routes * 15 + 3
    if device == "cuda":
        assert any(r.startswith("refused") for r in report["ran"])
