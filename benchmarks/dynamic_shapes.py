"""Dynamic shapes: a train step with the same sequence length every step vs a new length every step.

Two models on 2 gloo ranks on 127.0.0.1, each parallelized by sbp (`sbp.nn.parallelize`) and by DTensor
(`parallelize_module`) in the same processes, their steps alternating so load on the machine hits both
alike: a 4-block MLP (d 64, hidden 256; fc colwise, proj rowwise; residual) and the example GPT of
examples/train_tp.py (d 128, 2 heads, 2 layers, its `tp_plan()`). One step = forward, a sum/cross-entropy
loss, backward. Each framework has two copies of each model, one per mode, all warmed with `--warmup`
steps at length T0; then each copy runs `--steps` steps, the four copies interleaved step by step (so a
burst of load on the machine hits every column alike):

- ``same``: every step at length T0;
- ``new``: each step at a length never seen before, alternately below and above T0 (T0-1, T0+1, T0-2,
  T0+2, ...: odd and even alike), so new-length steps compute as much as same-length ones on the whole
  (lengths T0+1, T0+2, ... would average T0 + steps/2: 15% more work per step at the defaults, which
  would be counted as the cost of a new length).

A third framework, ``torch``, runs the whole model unsharded on every rank (no communication): the
floor, what plain torch itself pays for a new length on this machine (allocations of new sizes, kernel
set-up), which no library on top of it can remove.

Per model and framework it prints the median over steps of the slowest rank's step time (ms) in each
mode and ``new/same``, the ratio the issue (#22) targets (<= 1.10 for sbp), then the same for the
stepping thread's CPU time per step (``cpu``, `time.thread_time`: what the step computes, without the
time a loaded machine keeps the process waiting or gloo's background threads). A second table splits what
a new length costs sbp: its CPU time per step over the same-length step (``sbp cpu +ms``) against plain
torch's (``torch cpu +ms``); their difference (``sbp extra us``, the part of the new-length step sbp adds
over the torch ops it runs); and what sbp itself does per new length: op decisions made
(``decisions``: each distinct op call of a new length is one; from its shape class once the class is
known) and the CPU time making them took (``deciding us``, `sbp.ops.cache.DECISIONS`), planner
searches (lengths outside a known plan class), and time in the garbage collector (``gc us``: a new
length adds cache entries, which the collector then scans) in both modes. The new lengths grow by one
every step, never seen before; plain torch itself pays less for a length it has seen (its allocator
and kernels warm up), so cycling through a few lengths would understate what a new length costs.
``--profile`` writes cProfiles (CPU time) of rank 0's sbp steps after the first four, one per mode
(`--profile-out`.<model>.<mode>), and leaves DTensor out.

    python benchmarks/dynamic_shapes.py [--steps 30] [--warmup 3] [--batch 8] [--t0 100] [--profile]
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 2
FRAMEWORKS = ("sbp", "dtensor", "torch")   # torch: the whole model unsharded on every rank, no communication
ROOT = pathlib.Path(__file__).resolve().parents[1]

sys.path.insert(0, str(ROOT / "benchmarks"))
from tp_step import example, free_port, init_worker  # noqa: E402  (the example loader and port picker of the TP benchmark)


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(x)))   # (B, T, C)


class MLP(nn.Module):
    def __init__(self, dim: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def plain(t):
    """A global output as a plain tensor (sbp: `full()`; DTensor: `full_tensor()`)."""
    for attr in ("full", "full_tensor"):
        if hasattr(t, attr):
            return getattr(t, attr)()
    return t


def build_mlp(framework: str, args):
    torch.manual_seed(0)
    model = MLP()
    plan = {f"blocks.{i}.{m}": s for i in range(4) for m, s in (("fc", "colwise"), ("proj", "rowwise"))}
    if framework == "sbp":
        import sbp
        import sbp.nn
        sbp.nn.parallelize(model, sbp.init_mesh((WORLD,), device_type="cpu"), plan)
    elif framework == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), {k: styles[v]() for k, v in plan.items()})

    def step(t: int) -> None:
        x = torch.randn(args.batch, t, 64, generator=torch.Generator().manual_seed(t))
        loss = plain(model(x)).square().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def build_gpt(framework: str, args, ex):
    data, vocab = ex.encode()
    cfg = ex.Config(vocab=vocab, dim=128, heads=2, layers=2, block=args.t0 + args.steps + 1)
    model = ex.build(cfg, seed=0)
    if framework == "sbp":
        import sbp
        import sbp.nn
        sbp.nn.parallelize(model, sbp.init_mesh((WORLD,), device_type="cpu"), ex.tp_plan())
    elif framework == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(cfg.layers):
            plan |= {f"blocks.{i}.attn.{m}": ColwiseParallel() for m in "qkv"}
            plan |= {f"blocks.{i}.attn.proj": RowwiseParallel(), f"blocks.{i}.mlp.fc": ColwiseParallel(),
                     f"blocks.{i}.mlp.proj": RowwiseParallel()}
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), plan)

    def step(t: int) -> None:
        g = torch.Generator().manual_seed(t)
        start = torch.randint(0, len(data) - t - 1, (args.batch,), generator=g).tolist()
        idx = torch.stack([data[s:s + t] for s in start])
        targets = torch.stack([data[s + 1:s + t + 1] for s in start])
        logits = model(idx)
        if hasattr(logits, "to_local") and not hasattr(logits, "full"):  # a DTensor output stays Replicate
            logits = logits.to_local()
        loss = plain(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


class GcClock:
    """Wall time this process spends in the garbage collector (`gc.callbacks`): a new length adds entries to
    caches, which the collector then scans; a step that keeps nothing rarely collects."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def sbp_counters() -> tuple[float, int, int]:
    """(seconds sbp spent making op decisions, decisions made, planner searches) so far; zeros without sbp."""
    if "sbp" not in sys.modules:
        return 0.0, 0, 0
    import sbp.planning
    from sbp.ops.cache import DECISIONS
    info = DECISIONS.info()
    return info.get("seconds", 0.0), info["made"], sbp.planning.cache_info()["search.plan_cached"].misses


def timed(step, t: int, gc_clock: GcClock) -> tuple[float, ...]:
    """One step's (wall seconds, this thread's CPU seconds, seconds deciding ops, decisions made, planner
    searches, seconds in the garbage collector)."""
    dist.barrier()
    before, g0 = sbp_counters(), gc_clock.seconds
    t0, c0 = time.perf_counter(), time.thread_time()
    step(t)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    after = sbp_counters()
    return (wall, cpu, *(a - b for a, b in zip(after, before)), gc_clock.seconds - g0)


def new_length(t0: int, i: int) -> int:
    """The length of new-length step `i`: ``t0 - 1, t0 + 1, t0 - 2, t0 + 2, ...`` (centred on `t0`)."""
    return t0 + (i // 2 + 1) * (1 if i % 2 else -1)


def run_model(name: str, args, ex) -> dict:
    """One model per (framework, mode), all warmed at T0 alike; then their steps interleave (for each step:
    sbp same, sbp new, DTensor same, DTensor new), so load on the machine hits every column alike."""
    frameworks = ("sbp",) if args.profile else FRAMEWORKS
    steps = {(fw, mode): (build_mlp(fw, args) if name == "mlp" else build_gpt(fw, args, ex))
             for fw in frameworks for mode in ("same", "new")}
    for _ in range(args.warmup):
        for step in steps.values():
            step(args.t0)
    times: dict[str, dict[str, list[tuple]]] = {mode: {fw: [] for fw in frameworks} for mode in ("same", "new")}
    gc_clock = GcClock()
    profilers = {}
    if args.profile and dist.get_rank() == 0:
        import cProfile
        profilers = {mode: cProfile.Profile(time.process_time) for mode in ("same", "new")}   # CPU, not waits
    for i in range(args.steps):
        for (fw, mode), step in steps.items():
            t = args.t0 if mode == "same" else new_length(args.t0, i)
            if profilers and i >= 4:   # the steady state: new lengths of known classes
                profilers[mode].enable()
            times[mode][fw].append(timed(step, t, gc_clock))
            if profilers:
                profilers[mode].disable()
    for mode, profiler in profilers.items():
        profiler.dump_stats(f"{args.profile_out}.{name}.{mode}")
    gc.callbacks.remove(gc_clock._callback)
    return times


def worker(rank: int, port: int, args, queue) -> None:
    init_worker(rank, port, WORLD)
    ex = example()
    for name in args.models:
        result = run_model(name, args, ex)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, result)
        if rank == 0:
            queue.put((name, gathered))
    dist.barrier()
    dist.destroy_process_group()


def slowest_median(per_rank: list[dict], mode: str, framework: str, which: int = 0, scale: float = 1e3) -> float:
    """Median over steps of the slowest rank's figure `which` for that step (`timed`'s order; seconds are
    printed in ms, `scale` 1 leaves counts as they are)."""
    n = len(per_rank[0][mode][framework])
    return statistics.median(max(r[mode][framework][i][which] for r in per_rank) for i in range(n)) * scale


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode and framework (default 30)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--t0", type=int, default=100, help="the warm-up and same-shape sequence length")
    p.add_argument("--models", default="mlp,gpt", help="comma separated: mlp, gpt")
    p.add_argument("--profile", action="store_true", help="cProfile rank 0's sbp steps per mode (no DTensor)")
    p.add_argument("--profile-out", default="/tmp/dynamic_shapes.prof")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    lengths = sorted(new_length(args.t0, i) for i in range(args.steps))
    if lengths[0] < 1:
        p.error(f"--t0 {args.t0} leaves no room for {args.steps} new lengths below it: "
                f"use --t0 > {args.steps // 2 + 1}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(free_port(), args, queue), nprocs=WORLD, start_method="spawn")
    results = {}
    while not queue.empty():
        name, per_rank = queue.get()
        results[name] = per_rank
    print(f"torch {torch.__version__}, {WORLD} gloo ranks, fp32, batch {args.batch}, median of {args.steps} steps "
          f"after {args.warmup} warm-up steps at T={args.t0}; new: T={lengths[0]}..{lengths[-1]}, alternately below "
          f"and above {args.t0}\n")
    frameworks = ("sbp",) if args.profile else FRAMEWORKS
    print(f"{'model':<6} {'framework':<9} {'same ms':>8} {'new ms':>8} {'new/same':>8} {'same cpu':>9} {'new cpu':>8} "
          f"{'cpu new/same':>12}")
    cpu = {}
    for name, per_rank in results.items():
        for fw in frameworks:
            same, new = slowest_median(per_rank, "same", fw), slowest_median(per_rank, "new", fw)
            same_cpu, new_cpu = slowest_median(per_rank, "same", fw, 1), slowest_median(per_rank, "new", fw, 1)
            cpu[name, fw] = new_cpu - same_cpu
            print(f"{name:<6} {fw:<9} {same:8.1f} {new:8.1f} {new / same:8.2f} {same_cpu:9.1f} {new_cpu:8.1f} "
                  f"{new_cpu / same_cpu:12.2f}")
    print("ms: wall time; cpu: the stepping thread's CPU time, less sensitive to a loaded machine")
    print("\nsbp per new length, per step (medians over steps, slowest rank): its CPU time over plain torch's, and "
          "where sbp's own\nper-length work goes (op decisions made and the CPU time making them took, planner "
          "searches, garbage collection)")
    print(f"{'model':<6} {'sbp cpu +ms':>11} {'torch cpu +ms':>13} {'sbp extra us':>12} {'decisions':>9} "
          f"{'deciding us':>11} {'searches':>8} {'gc us same':>10} {'gc us new':>9}")
    for name, per_rank in results.items():
        if ("torch" not in frameworks):
            break
        extra = cpu[name, "sbp"] - cpu[name, "torch"]
        made, searches = (slowest_median(per_rank, "new", "sbp", k, 1) for k in (3, 4))
        deciding = slowest_median(per_rank, "new", "sbp", 2, 1e6)
        gc_same, gc_new = (slowest_median(per_rank, mode, "sbp", 5, 1e6) for mode in ("same", "new"))
        print(f"{name:<6} {cpu[name, 'sbp']:11.2f} {cpu[name, 'torch']:13.2f} {extra * 1e3:12.0f} {made:9.0f} "
              f"{deciding:11.0f} {searches:8.0f} {gc_same:10.0f} {gc_new:9.0f}")
    if args.profile:
        print(f"\ncProfiles of rank 0's sbp steps: {args.profile_out}.<model>.<same|new>")


if __name__ == "__main__":
    main()
