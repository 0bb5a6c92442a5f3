"""Elastic resume (examples/train_tp.py ``--checkpoint DIR --resume --save-every K``): under
``torchrun --max-restarts 1`` a rank SIGKILLed mid-run makes the job restart and resume from the last
checkpoint, and the loss curve equals an uninterrupted run's to float32 rounding.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

import sbp
import sbp.nn
import sbp.testing
from tests.support.repo import load_example

EX = load_example("train_tp")
SCRIPT = pathlib.Path(EX.__file__)
ARGS = ["--mesh", "2", "--steps", "12", "--batch", "4", "--block", "16", "--dim", "32"]   # 2 ranks: quicker starts
pytestmark = pytest.mark.filterwarnings("ignore::sbp.tensor.global_tensor.FallbackWarning")


def _uninterrupted(mesh, model, path):
    args = EX.parse(ARGS + ["--checkpoint", path])
    model = sbp.nn.parallelize(copy.deepcopy(model), mesh, EX.tp_plan())
    return EX.train(model, EX.encode()[0], args, mesh=mesh)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return sorted(found)


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds torchrun's workers in /proc")
def test_sigkill_at_step_7_under_torchrun_resumes_with_the_same_loss_curve(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "--monitor-interval", "0.2", str(SCRIPT), *ARGS, "--checkpoint", str(ckpt), "--resume",
           "--save-every", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})
    lines, killed = [], None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        lines.append(line.rstrip())
        if killed is None and line.startswith("step   7/12"):
            workers = _children(proc.pid)
            assert len(workers) == 2, (workers, lines)
            os.kill(workers[-1], signal.SIGKILL)     # one rank, mid-run: no warning, no cleanup
            killed = lines[-1]
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("torchrun did not finish in 300 s:\n" + "\n".join(lines[-40:]))
    assert proc.wait(timeout=60) == 0, "\n".join(lines[-60:])
    assert killed is not None, "\n".join(lines)
    resumed = [line for line in lines if line.startswith("resumed from step ")]
    assert len(resumed) == 1 and resumed[0].startswith(("resumed from step 5 ", "resumed from step 10 ")), lines
    meta = json.loads((ckpt / "metadata.json").read_text())
    curve = meta["values"]["losses"]
    assert meta["values"]["step"] == 12 and len(curve) == 12
    args = EX.parse(ARGS)
    model = EX.build(EX.Config(vocab=EX.encode()[1], dim=args.dim, heads=args.heads, layers=args.layers,
                               block=args.block), args.seed)   # built once: threads share torch's global RNG
    reference = sbp.testing.spmd(functools.partial(_uninterrupted, model=model, path=str(tmp_path / "ref")), (2,))[0]
    diff = max(abs(a - b) for a, b in zip(curve, reference))
    print(f"killed after '{killed}'; {resumed[0]}; max |loss diff| against an uninterrupted run: {diff:.3e}")
    assert diff <= 1e-5, (curve, reference)
    assert reference[-1] < reference[0]              # it learns


# ---- a rank killed mid-training: the others fail, they do not hang ----------------------------------------

TIMEOUT_S = 3.0


def train_until_killed(rank: int, port: int, outdir: str) -> None:
    """One rank of a 4-rank tensor-parallel training job (gloo, collectives bounded by TIMEOUT_S); rank 3
    SIGKILLs itself at step 3, the others write when and how their step failed."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 4, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=timedelta(seconds=TIMEOUT_S))
    mesh = sbp.init_mesh((4,), device_type="cpu", timeout=TIMEOUT_S)
    torch.manual_seed(0)
    model = sbp.nn.parallelize(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), mesh,
                               {"0": "colwise", "2": "rowwise"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(200):
        if step == 3 and rank == 3:
            pathlib.Path(outdir, "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            loss = model(torch.ones(4, 8)).full().pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        except Exception as e:   # noqa: BLE001 - the test checks that it is a CommError
            pathlib.Path(outdir, f"rank{rank}.json").write_text(json.dumps([time.time(), type(e).__name__, str(e),
                                                                            step]))
            os._exit(1)
    pathlib.Path(outdir, f"rank{rank}.json").write_text(json.dumps([time.time(), "finished", "", step]))


@pytest.mark.gloo
def test_a_rank_killed_mid_training_makes_every_other_rank_raise_comm_error(tmp_path):
    from tests.support import crash_trials

    store, procs = crash_trials.start_ranks(crash_trials.context(), train_until_killed, str(tmp_path))
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [1, 1, 1, -signal.SIGKILL]
    killed = float((tmp_path / "killed").read_text())
    for rank in range(3):
        when, kind, message, step = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert kind == "CommError" and step == 3, (rank, kind, message)
        assert when - killed <= TIMEOUT_S + 5, (rank, when - killed)
        print(f"rank {rank}: CommError {when - killed:.2f} s after rank 3 was killed: {message[:100]}")


@pytest.mark.parametrize("argv, message", [(["--resume"], "--resume needs --checkpoint DIR"),
                                           (["--checkpoint", "d", "--save-every", "0"], "--save-every 0")])
def test_resume_options_are_checked(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        EX.parse(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err
