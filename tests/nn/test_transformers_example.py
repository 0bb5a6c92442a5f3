"""examples/hf_llama.py: a Hugging Face Llama, unchanged, with `parallelize(model, mesh, "auto")` runs end to
end on 4 gloo processes (TP and DP x TP) and trains to the one-process numbers (`--check`)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.support.repo import EXAMPLES

pytest.importorskip("transformers")
SCRIPT = pathlib.Path(EXAMPLES / "hf_llama.py")


@pytest.mark.gloo
@pytest.mark.parametrize("mesh", ["2x2"])   # dp x tp (TP alone on 4: test_transformers_models)
def test_script_on_gloo_with_check(mesh):
    # float64 weights; transformers' loss casts the logits to float32, so the loss agrees to ~1e-7 on dp x tp
    proc = subprocess.run([sys.executable, str(SCRIPT), "--mesh", mesh, "--steps", "3", "--check", "--dim", "32",
                           "--block", "16", "--dtype", "float64", "--tol", "1e-6"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("sbp + transformers: LlamaForCausalLM, mesh ")   # rank 0 only: one header
    assert [line[:14] for line in lines[1:4]] == ["step   1/3 [##", "step   2/3 [##", "step   3/3 [##"]
    assert "-> OK (tolerance 1e-06)" in lines[-1]


@pytest.mark.slow   # a fresh interpreter importing torch and transformers per case
@pytest.mark.parametrize("argv, message", [(["--mesh", "2y2"], "--mesh '2y2'"), (["--attn", "flash"], "--attn")])
def test_script_bad_arguments(argv, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
