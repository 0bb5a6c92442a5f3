"""The command line: ``python -m sbp plan`` output (text and JSON), dtypes, and bad arguments.

Bad arguments must exit 2 with one line on stderr naming the argument, never a traceback.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import sbp
from sbp.__main__ import main
from sbp.tools.cli import DTYPE_ITEMSIZE
from tests.support.repo import GOLDEN

KNOWN = ["plan", "--mesh", "2x2", "--shape", "1024x1024", "--src", "S(0),S(1)", "--dst", "S(1),S(0)"]


def run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_text_output_is_explain_plus_a_summary(capsys):
    rc, out, err = run(KNOWN, capsys)
    p = sbp.plan((1024, 1024), (2, 2), "S(0),S(1)", "S(1),S(0)")
    assert rc == 0 and err == ""
    assert out.startswith(p.explain() + "\n")
    assert "bytes per rank: 1048576 (1.00 MiB), lower bound: 1048576 (1.00 MiB)" in out
    path = GOLDEN / "cli-s0s1-to-s1s0.txt"
    if os.environ.get("SBP_REGEN_GOLDEN"):
        path.write_text(out)
    assert out == path.read_text()


def test_json_output_is_the_plan_as_data(capsys):
    rc, out, err = run(KNOWN + ["--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and err == "" and out.count("\n") == 1
    assert {"steps", "bytes_per_rank", "lower_bound_bytes", "num_collectives", "peak_bytes"} <= data.keys()
    assert data == sbp.plan((1024, 1024), (2, 2), "S(0),S(1)", "S(1),S(0)").to_dict()
    assert data["bytes_per_rank"] == data["lower_bound_bytes"] == 1 << 20


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float64", 8), ("torch.int8", 1), ("bool", 1)])
def test_dtype_sets_the_itemsize(dtype, itemsize, capsys):
    rc, out, _ = run(KNOWN + ["--dtype", dtype, "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["itemsize"] == itemsize
    assert data["bytes_per_rank"] == (1 << 18) * itemsize


@pytest.mark.parametrize("name", sorted(DTYPE_ITEMSIZE))
def test_dtype_table_matches_torch(name):
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype) and dtype.itemsize == DTYPE_ITEMSIZE[name]


def test_common_torch_dtypes_are_known():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
                  torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn):
        assert str(dtype).removeprefix("torch.") in DTYPE_ITEMSIZE


def test_other_shapes_and_partial(capsys):
    rc, out, _ = run(["plan", "--mesh", "8", "--shape", "16", "--src", "P(max)", "--dst", "S0", "--json"], capsys)
    assert rc == 0 and json.loads(out)["steps"][0]["kind"] == "reduce_scatter"
    rc, out, _ = run(["plan", "--mesh", "2", "--shape", "()", "--src", "P", "--dst", "B"], capsys)
    assert rc == 0 and "all_reduce(sum)" in out


def test_reduce_transfer_in_text_and_json(capsys):
    argv = ["plan", "--mesh", "2x2", "--shape", "1024x1024", "--src", "P,S0", "--dst", "S0,B"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0 and "reduce_transfer(sum)" in out and "bytes per rank: 2097152 (2.00 MiB), lower bound: 2097152" in out
    rc, out, _ = run(argv + ["--json"], capsys)
    step = json.loads(out)["steps"][0]
    assert (step["kind"], step["axes"], step["op"], step["bytes"], step["calls"]) == ("reduce_transfer", [0, 1], "sum",
                                                                                      1 << 21, 2)


@pytest.mark.parametrize("argv, names", [
    (["plan", "--mesh", "2xa", "--shape", "4", "--src", "S0", "--dst", "B"], "--mesh"),
    (["plan", "--mesh", "0x2", "--shape", "4", "--src", "S0,B", "--dst", "B,B"], "--mesh"),
    (["plan", "--mesh", "99999999999", "--shape", "4", "--src", "S0", "--dst", "B"], "--mesh"),
    (["plan", "--mesh", "2", "--shape", "4x", "--src", "S0", "--dst", "B"], "--shape"),
    (["plan", "--mesh", "2", "--shape", "4x-1", "--src", "S0", "--dst", "B"], "--shape"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S(0", "--dst", "B"], "--src"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "P(avg)"], "--dst"),
    (["plan", "--mesh", "2x2", "--shape", "4", "--src", "S0", "--dst", "B,B"], "--src"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "B,B"], "--dst"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S1", "--dst", "B"], "--src"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "B", "--dtype", "float33"], "--dtype"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "B", "--latency-bytes", "-3"], "--latency-bytes"),
    (["plan", "--mesh", "2x2", "--shape", "8", "--src", "S0,B", "--dst", "P,B", "--dtype", "bool"], "--dst"),
    (["plan", "--mesh", "2", "--shape", "8", "--src", "P(max)", "--dst", "B", "--dtype", "complex64"], "--src"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S0"], "--dst"),
    (["plan", "--shape", "4", "--src", "S0", "--dst", "B"], "--mesh"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "B", "--frob"], "--frob"),
    (["frob"], "frob"),
    ([], "command"),
    # a value starting with '-' is no option here: the negative size is named (not "expected one argument")
    (["plan", "--mesh", "2x2", "--shape", "-4x4", "--src", "S0,S1", "--dst", "S1,S0"], "--shape: global_shape"),
    (["plan", "--mesh", "-2x2", "--shape", "4x4", "--src", "S0,S1", "--dst", "S1,S0"], "--mesh: mesh shape"),
    # refused with or without a --topology preset
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "B", "--devices-per-host", "0"],
     "argument --devices-per-host: must be a positive int, got '0'"),
    (["plan", "--mesh", "2", "--shape", "4", "--src", "S0", "--dst", "B", "--devices-per-host", "two"],
     "argument --devices-per-host"),
])
def test_bad_arguments_exit_2_with_one_line_naming_them(argv, names, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("sbp"), err
    assert names in err and "Traceback" not in err


def test_help_exits_0(capsys):
    rc, out, _ = run(["plan", "--help"], capsys)
    assert rc == 0 and "--mesh" in out and "--dtype" in out


def test_python_dash_m_sbp():
    ok = subprocess.run([sys.executable, "-m", "sbp"] + KNOWN[:-4] + ["--src", "S0,S1", "--dst", "B,B"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "bytes per rank: 3145728 (3.00 MiB)" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "sbp", "plan", "--mesh", "2xa", "--shape", "4", "--src", "S0",
                          "--dst", "B"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "sbp plan: error: argument --mesh: cannot parse mesh shape '2xa'; write it like '2x2'\n"


# the console script of the interpreter running the tests (its venv's bin, on PATH or not), else PATH's
CONSOLE_SCRIPT = shutil.which("sbp", path=os.path.dirname(sys.executable)) or shutil.which("sbp")


@pytest.mark.skipif(CONSOLE_SCRIPT is None, reason="console script not installed")
def test_console_script():
    done = subprocess.run([CONSOLE_SCRIPT] + KNOWN + ["--json"], capture_output=True, text=True)
    assert done.returncode == 0 and json.loads(done.stdout)["bytes_per_rank"] == 1 << 20


def test_cli_plans_without_importing_torch():
    """`python -m sbp plan` is pure maths: run in a fresh interpreter, it never loads torch."""
    code = ("import sys, runpy; sys.argv = ['sbp', 'plan', '--mesh', '2x2', '--shape', '64x64', '--src', 'S(0),S(1)', "
            "'--dst', 'S(1),S(0)', '--dtype', 'bfloat16']\n"
            "try:\n    runpy.run_module('sbp', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
            "print('NO TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "bytes/rank" in out.stdout and out.stdout.rstrip().endswith("NO TORCH")


def test_pure_packages_import_without_torch():
    """`import sbp.values` / `sbp.planning` (and the top-level pure names) load no torch."""
    code = ("import sys, sbp, sbp.values, sbp.planning, sbp.planning.search, sbp.tools.cli\n"
            "sbp.plan((8, 8), (2,), 'S(0)', 'B'); sbp.placements('S(0)'); sbp.DeviceMesh((2, 2))\n"
            "assert 'torch' not in sys.modules\nprint('NO TORCH')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "NO TORCH", out.stderr
