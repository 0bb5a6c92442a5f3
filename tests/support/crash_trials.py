"""The crash-safety trials behind tests/io/test_crash_safe.py: 4 gloo ranks
in fresh processes save a new state over an existing checkpoint and are all SIGKILLed at a random moment;
the checkpoint must then load as exactly the old state or exactly the new one.

Rank processes come from a forkserver that imported torch and sbp once, so a trial costs a fork, a gloo
rendezvous and the save, not four torch imports.
"""
from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import random
import signal
import time
from datetime import timedelta

import torch

import sbp

WORLD = 4
MESH = (2, 2)
SHAPES = {"model.w": ((1024, 384), "S(0), S(1)"), "model.b": ((1001,), "S(0), B"),
          "model.p": ((257, 129), "P(sum), S(0)"), "optim.m": ((640, 333), "B, S(1)")}


def expected(seed: int) -> dict[str, torch.Tensor]:
    """The logical state of trial `seed` (every rank and the checker compute the same)."""
    g = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=g) for key, (shape, _) in SHAPES.items()}


def _nest(flat: dict) -> dict:
    out: dict = {}
    for key, v in flat.items():
        outer, inner = key.split(".")
        out.setdefault(outer, {})[inner] = v
    return out


def rank_main(rank: int, port: int, path: str, seed: int, marks: str) -> None:
    """One rank of a trial: join the gloo world, build trial `seed`'s state, save it (rank 0 marks the start
    and the end of the save with files)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    mesh = sbp.init_mesh(MESH, device_type="cpu", timeout=60)
    state = {key: sbp.distribute(t, mesh, SHAPES[key][1]) for key, t in expected(seed).items()}
    state = _nest(state) | {"step": seed, "plain": torch.full((3,), float(seed))}
    mesh.binding.all_reduce(torch.ones(1), (0, 1), "sum")   # everyone is ready: the save starts together
    if rank == 0:
        open(os.path.join(marks, f"started-{seed}"), "w").close()
    sbp.save(state, path)
    if rank == 0:
        open(os.path.join(marks, f"done-{seed}"), "w").close()
    dist.destroy_process_group()


def which_state(path: str, seeds: tuple[int, ...]) -> int:
    """The seed whose state the checkpoint at `path` holds, exactly; AssertionError if none (a mix, or an
    error from `sbp.load`, which propagates)."""
    target = _nest({key: torch.zeros(shape) for key, (shape, _) in SHAPES.items()}) | {
        "step": -1, "plain": torch.zeros(3)}
    sbp.load(path, target)
    seed = target["step"]
    assert seed in seeds, f"the checkpoint says step {seed}, expected one of {seeds}"
    want = expected(seed)
    for key in SHAPES:
        outer, inner = key.split(".")
        assert torch.equal(target[outer][inner], want[key]), f"{key} is not trial {seed}'s (a mix of states)"
    assert torch.equal(target["plain"], torch.full((3,), float(seed)))
    return seed


@dataclasses.dataclass
class Report:
    trials: int = 0
    mid_write: int = 0        # killed after the save started and before it returned
    before_start: int = 0
    after_end: int = 0
    loaded_old: int = 0
    loaded_new: int = 0
    save_s: float = 0.0       # an uninterrupted save, as seen from the parent

    def table(self) -> str:
        return (f"{self.trials} SIGKILLed saves (4 gloo ranks, mesh 2x2, uninterrupted save "
                f"{self.save_s * 1e3:.0f} ms): "
                f"{self.mid_write} hit mid-write, {self.before_start} before the save started, "
                f"{self.after_end} after it returned; loaded the old state {self.loaded_old} times, the new "
                f"state {self.loaded_new} times, an error or a mix 0 times")


def context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "sbp.runtime.backends.dist", "sbp.io.checkpoint"])
    return ctx


def start_ranks(ctx, target, *args):
    """`WORLD` processes running ``target(rank, port, *args)``, and the TCPStore (on `port`) they meet at."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    procs = [ctx.Process(target=target, args=(r, store.port, *args), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    return store, procs


def _start(ctx, path: str, seed: int, marks: str):
    return start_ranks(ctx, rank_main, path, seed, marks)


def run_trials(path: str, marks: str, trials: int, rng: random.Random) -> Report:
    """Save trial 0 uninterrupted, then `trials` saves each SIGKILLed at a random moment; check every time."""
    ctx = context()
    report = Report()
    store, procs = _start(ctx, path, 0, marks)
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"the first save failed (exit code {p.exitcode})"
    report.save_s = shortest = _save_time(marks, 0)
    committed = which_state(path, (0,))
    for seed in range(1, trials + 1):
        store, procs = _start(ctx, path, seed, marks)
        started = os.path.join(marks, f"started-{seed}")
        deadline = time.monotonic() + 120
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.001)
        # the kill lands up to 1.3 saves after the start; a save's time is the shortest seen so far (a burst of
        # load during one save must not push every later kill past the end of the next, faster saves)
        time.sleep(rng.uniform(0, 1.3 * shortest))
        for p in procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:   # it ended (and was reaped) between the test and the kill
                    pass
        for p in procs:
            p.join(30)
        done = os.path.exists(os.path.join(marks, f"done-{seed}"))
        report.trials += 1
        if not os.path.exists(started):
            report.before_start += 1
        elif done:
            report.after_end += 1
            shortest = min(shortest, _save_time(marks, seed))
        else:
            report.mid_write += 1
        got = which_state(path, (committed, seed))
        if got == seed:
            report.loaded_new += 1
        else:
            report.loaded_old += 1
        committed = got
        del store
    return report


def _save_time(marks: str, seed: int) -> float:
    mark = functools.partial(os.path.join, marks)
    return os.path.getmtime(mark(f"done-{seed}")) - os.path.getmtime(mark(f"started-{seed}"))
