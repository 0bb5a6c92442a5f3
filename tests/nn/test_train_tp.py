"""examples/train_tp.py: the tensor-parallel GPT trains to the single-process numbers (float32, 20 steps),
on TP, DP x TP and sequence-parallel meshes, and the script runs end to end on 4 gloo processes."""
from __future__ import annotations

import copy
import functools
import pathlib
import subprocess
import sys

import pytest
import torch

import sbp
import sbp.nn
import sbp.testing
from tests.support.repo import load_example

EX = load_example("train_tp")  # the example module, loaded once per process
SCRIPT = pathlib.Path(EX.__file__)
# slow: 20 training steps per mesh, and the script itself in subprocesses (a few seconds each)
pytestmark = [pytest.mark.filterwarnings("ignore::sbp.tensor.global_tensor.FallbackWarning"), pytest.mark.slow]


def _train(mesh, model, args, sequence_parallel):
    model = copy.deepcopy(model)
    data, _ = EX.encode()
    if mesh is not None:
        sbp.nn.parallelize(model, mesh, EX.tp_plan(sequence_parallel))
    losses = EX.train(model, data, args)
    return losses, {n: p.full() if isinstance(p, sbp.GlobalTensor) else p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mesh_shape, sequence_parallel, steps",
                         [((4,), False, 20), ((2, 2), False, 5), ((2,), True, 5)],
                         ids=["tp4-20-steps", "dp2xtp2", "tp2-sequence-parallel"])
def test_training_matches_one_process(mesh_shape, sequence_parallel, steps):
    _, vocab = EX.encode()
    args = EX.parse(["--steps", str(steps), "--batch", "4", "--block", "16", "--dim", "32"])
    model = EX.build(EX.Config(vocab=vocab, dim=32, heads=4, layers=2, block=16), seed=0)  # float32
    ref_losses, ref_params = _train(None, model, args, False)
    losses, params = sbp.testing.spmd(functools.partial(_train, model=model, args=args,
                                                        sequence_parallel=sequence_parallel), mesh_shape)[0]
    assert ref_losses[-1] < ref_losses[0]  # it learns
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert max((params[n] - p).abs().max().item() for n, p in ref_params.items()) <= 1e-5


@pytest.mark.gloo
def test_script_on_gloo_with_check():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "3", "--check", "--dim", "32", "--block", "16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("sbp TP: mesh (4,) ('tp',)")     # rank 0 only: one header, one line per step
    assert [line[:14] for line in lines[1:4]] == ["step   1/3 [##", "step   2/3 [##", "step   3/3 [##"]
    assert "-> OK (tolerance 1e-05)" in lines[-1]


@pytest.mark.parametrize("argv, message",
                         [(["--mesh", "2y2"], "--mesh '2y2'"), (["--optimizer", "lbfgs"], "--optimizer"),
                          (["--whole-step"], "--whole-step compiles the whole step: it needs --compile")])
def test_script_bad_arguments(argv, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_batch_smaller_than_the_dp_size_runs_as_one_process():
    # batch 1 on dp=2: one dp rank's share is empty, and its local heads are a (0, T, C/n) plain tensor (the
    # example's attention names its head count: reshape(b, t, -1, hd) has no answer for 0 elements)
    data, vocab = EX.encode()
    cfg = EX.Config(vocab=vocab, block=4, dim=8, heads=2, layers=1, mlp_ratio=1)
    model = EX.build(cfg, seed=0, dtype=torch.float64)
    idx, targets = next(EX.batches(data, 1, 4, 1, seed=1))

    def fn(mesh):
        m = copy.deepcopy(model)
        sbp.nn.parallelize(m, mesh, EX.tp_plan(), tp_axis="tp")
        return EX.scalar(m(idx, targets)).item()

    want = model(idx, targets).item()
    assert sbp.testing.spmd(fn, (2, 2), names=("dp", "tp")) == pytest.approx([want] * 4, rel=1e-12, abs=1e-12)
