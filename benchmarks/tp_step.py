"""Tensor-parallel train step: sbp.nn.parallelize against DTensor's parallelize_module, same model, same run.

The model is examples/train_tp.py's GPT (hidden size >= 512) on 4 gloo ranks on 127.0.0.1 (TP over 4),
with the equivalent plans: sbp's `tp_plan()` and DTensor's ColwiseParallel (q, k, v, fc; the LM head
with Replicate output) / RowwiseParallel (attention and MLP output projections; the vocab-parallel
embedding) on the same modules. One step = forward, cross-entropy, backward, SGD (momentum) step.
Per case it prints:

- ``sbp ms`` / ``DT ms``: median over steps of the slowest rank's step time (barrier before each step);
- ``ratio``: sbp / DTensor time (below 1: sbp is faster);
- ``sbp MiB`` / ``DT MiB``: peak memory of the busiest rank during the timed steps, as the growth of the
  process's peak resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` after the model
  is built and sharded) over its resident set at that moment: activations, gradients, optimizer state,
  communication buffers and allocator slack. Python-level tracers (tracemalloc) do not see torch's
  allocations, and torch has no CPU allocator statistics, so RSS is the honest measure on CPU. The
  memory processes pin glibc's mmap threshold (128 KiB) so freed buffers leave the resident set and it
  follows the live tensors; with the default dynamic threshold RSS climbs at random from step to step
  for both frameworks. Read it to about a MiB;
- ``loss diff``: |sbp loss - DTensor loss| at the first step (both start from the same weights).

With ``--compile`` (the default; ``--no-compile`` skips it) the same processes also hold a second copy of
each model whose forward and loss run as one ``torch.compile(..., fullgraph=True)`` graph (inductor;
backward and optimizer step as usual, for both frameworks alike), and a second table prints:

- ``sbp eager`` / ``sbp comp`` / ``DT eager`` / ``DT comp``: the four step times, measured as above;
- ``comp/DT``: sbp compiled / DTensor compiled; ``comp/eager``: sbp compiled / sbp eager;
- ``cpu c/DT``: sbp compiled / DTensor compiled in CPU time (all threads of the process, gloo's included:
  ``time.process_time``) per step, median over steps, mean over ranks. With 4 ranks on few cores a step is
  CPU-bound, and CPU time is less sensitive than wall time to other jobs on the machine;
- ``1st step s``: the first compiled step of sbp / DTensor (tracing and inductor's compile, on a cold or
  warm on-disk cache), slowest rank;
- ``comp diff``: |compiled loss - eager loss| at the first step (sbp, DTensor).

With ``--whole-step`` a third table times sbp's whole step (forward, loss, backward and SGD) as one compiled
function under compiled autograd (``sbp whole``) against DTensor's compiled step (``DT comp``; DTensor does
not run under compiled autograd on torch 2.13), with its CPU ratio, first step and loss difference to eager.

Times come from one set of 4 processes holding both models, their steps alternating (sbp, DTensor, sbp,
...), so a burst of load on the machine hits both alike. Memory comes from two more sets of processes,
one per framework, so one's cached memory does not hide the other's. Timings on a shared 2-core
machine are still noisy; compare ratios within one run.

    python benchmarks/tp_step.py [--steps 8] [--dims 512,1024] [--layers 2] [--batch 8] [--block 64]
                                  [--no-compile] [--whole-step]
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import pathlib
import re
import socket
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 4
ROOT = pathlib.Path(__file__).resolve().parents[1]


def example():
    """examples/train_tp.py as a module (its model, data and plan)."""
    spec = importlib.util.spec_from_file_location("train_tp", ROOT / "examples" / "train_tp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_tp", module)
    spec.loader.exec_module(module)
    return module


def memory_kib() -> dict[str, int]:
    status = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", status).group(1)) for k in ("VmRSS", "VmHWM")}


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def dtensor_plan(layers: int) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"wte": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(layers):
        plan |= {f"blocks.{i}.attn.{m}": ColwiseParallel() for m in "qkv"}
        plan |= {f"blocks.{i}.attn.proj": RowwiseParallel(), f"blocks.{i}.mlp.fc": ColwiseParallel(),
                 f"blocks.{i}.mlp.proj": RowwiseParallel()}
    return plan


def sharded_model(framework: str | None, ex, dim: int, args):
    """The example's GPT (seed 0) at hidden size `dim`, sharded in place by `framework` ("sbp": its
    `tp_plan()`; "dtensor": `dtensor_plan`; None: left whole), and the batch (inputs, targets) it trains on."""
    data, vocab = ex.encode()
    cfg = ex.Config(vocab=vocab, dim=dim, heads=max(WORLD, dim // 64), layers=args.layers, block=args.block)
    model = ex.build(cfg, seed=0)
    if framework == "sbp":
        import sbp
        import sbp.nn
        sbp.nn.parallelize(model, sbp.init_mesh((WORLD,), device_type="cpu"), ex.tp_plan())
    elif framework == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), dtensor_plan(args.layers))
    return model, next(ex.batches(data, args.batch, cfg.block, 1, seed=0))


def forward_loss_of(framework: str | None, model):
    """Forward and cross-entropy of `model` as one function returning a plain scalar tensor (what the
    compiled steps compile)."""
    def forward_loss(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = model(idx)
        if framework == "dtensor" and hasattr(logits, "to_local"):  # a DTensor output stays Replicate
            logits = logits.to_local()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss.full() if framework == "sbp" else loss

    return forward_loss


def build(framework: str, ex, dim: int, args, compiled: bool | str = False):
    """The example's model, sharded by `framework`; returns (step function, parameters per rank). With
    `compiled`, forward and loss run as one compiled graph (``fullgraph=True``); with ``"whole"``, the whole
    step (forward, loss, backward, SGD) is one compiled function under compiled autograd."""
    model, (idx, targets) = sharded_model(framework, ex, dim, args)
    params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    forward_loss = forward_loss_of(framework, model)
    loss_of = torch.compile(forward_loss, fullgraph=True) if compiled is True else forward_loss

    def step() -> torch.Tensor:
        loss = loss_of(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    if compiled == "whole":
        with torch._dynamo.config.patch(compiled_autograd=True):   # read by torch.compile, here
            step = torch.compile(step)
    return (lambda: step().item()), params


def timed(step) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step, after a barrier."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - t0, time.process_time() - c0


def time_case(ex, dim: int, args) -> dict:
    """Both models in the same processes, their steps alternating, so load on the machine hits both alike
    (and, with ``--compile``, a compiled copy of each)."""
    built = {fw: build(fw, ex, dim, args) for fw in ("sbp", "dtensor")}
    steps, params = {fw: step for fw, (step, _) in built.items()}, built["sbp"][1]
    if args.compile:
        steps |= {f"{fw}-comp": build(fw, ex, dim, args, compiled=True)[0] for fw in ("sbp", "dtensor")}
    if args.whole_step:
        steps["sbp-whole"] = build("sbp", ex, dim, args, compiled="whole")[0]
    losses, first = {}, {}
    for fw, step in steps.items():
        dist.barrier()
        t0 = time.perf_counter()
        losses[fw] = step()
        first[fw] = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {fw: [] for fw in steps}
    cpu: dict[str, list[float]] = {fw: [] for fw in steps}
    for _ in range(args.steps):
        for fw, step in steps.items():
            wall, used = timed(step)
            times[fw].append(wall)
            cpu[fw].append(used)
    return {"times": times, "cpu": cpu, "loss": losses, "first": first, "params": params}


def memory_case(framework: str, ex, dim: int, args) -> dict:
    """One framework alone in its processes: growth of the peak RSS over the timed steps."""
    step, params = build(framework, ex, dim, args)
    for _ in range(args.warmup):
        step()
    dist.barrier()
    reset = reset_peak()
    base = memory_kib()["VmRSS"]
    for _ in range(max(2, args.steps // 2)):
        timed(step)
    return {"peak_kib": memory_kib()["VmHWM"] - (base if reset else 0), "params": params, "peak_reset": reset}


def fixed_mmap_threshold(size: int = 128 * 1024) -> None:
    """Pin glibc's mmap threshold so every buffer of `size` bytes or more is mmapped and returned to the OS
    when freed: the resident set then follows the live tensors instead of how the heap happened to grow
    (with the default, dynamic threshold RSS climbs at random for sbp and DTensor alike)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, size)  # M_MMAP_THRESHOLD; also turns off its dynamic raising
    except (OSError, AttributeError):
        pass


def init_worker(rank: int, port: int, world: int) -> None:
    """Join a gloo world of `world` ranks on 127.0.0.1:`port`, one thread per rank, quiet."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def worker(rank: int, port: int, case, args, queue, pin_mmap: bool) -> None:
    """One rank: join the gloo world, run `case(ex, dim, args)` for each of `args.dims`; rank 0 queues
    (dim, every rank's result)."""
    if pin_mmap:  # memory only: timings keep the default allocator (mmap per buffer costs page faults)
        fixed_mmap_threshold()
    init_worker(rank, port, WORLD)
    ex = example()
    for dim in args.dims:
        result = case(ex, dim, args)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, result)
        if rank == 0:
            queue.put((dim, gathered))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(case, args, pin_mmap: bool = False) -> dict[int, list[dict]]:
    """`case(ex, dim, args)` (ex: the example module) for each of `args.dims` in `WORLD` spawned gloo
    processes on 127.0.0.1, a free port picked now: {dim: [each rank's result]}."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(free_port(), case, args, queue, pin_mmap), nprocs=WORLD, start_method="spawn")
    out = {}
    while not queue.empty():
        dim, per_rank = queue.get()
        out[dim] = per_rank
    return out


def slowest_median(per_rank: list[dict], framework: str) -> float:
    """Median over steps of the slowest rank's time for that step (ms)."""
    steps = len(per_rank[0]["times"][framework])
    return statistics.median(max(r["times"][framework][i] for r in per_rank) for i in range(steps)) * 1e3


def mean_cpu(per_rank: list[dict], framework: str) -> float:
    """Mean over ranks of the median over steps of a rank's CPU time per step (ms)."""
    return statistics.mean(statistics.median(r["cpu"][framework]) for r in per_rank) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="512,1024", help="model widths (hidden size), comma separated")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps per framework (default 8)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                   help="measure peak memory in two more sets of processes (MiB columns); default on")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also time compiled copies of both models (torch.compile, inductor); default on")
    p.add_argument("--whole-step", action="store_true",
                   help="also time sbp's whole step compiled under compiled autograd (with --compile)")
    args = p.parse_args(argv)
    args.dims = [int(d) for d in args.dims.split(",")]
    if any(d % 64 or d < 64 for d in args.dims):
        p.error("--dims must be multiples of 64 (heads of 64 features)")
    timing = measure(time_case, args)
    memory = {fw: measure(functools.partial(memory_case, fw), args, pin_mmap=True) if args.memory else {}
              for fw in ("sbp", "dtensor")}
    print(f"torch {torch.__version__}, {WORLD} gloo ranks (TP=4), fp32, {args.layers} layers, batch {args.batch} x "
          f"{args.block} tokens, median of {args.steps} steps after {args.warmup} warm-up\n")
    print(f"{'case':<14} {'sbp ms':>8} {'DT ms':>8} {'ratio':>6} {'sbp MiB':>8} {'DT MiB':>8} {'mem ratio':>9} "
          f"{'params/rank':>11} {'loss diff':>9}")
    for dim in args.dims:
        t, sm, dm = timing[dim], memory["sbp"].get(dim), memory["dtensor"].get(dim)
        s_ms, d_ms = slowest_median(t, "sbp"), slowest_median(t, "dtensor")
        if sm is None:   # --no-memory
            sm = [{"params": t[0]["params"]}]
        s_mib = max(r["peak_kib"] for r in sm) / 1024 if dm else float("nan")
        d_mib = max(r["peak_kib"] for r in dm) / 1024 if dm else float("nan")
        loss_diff = abs(t[0]["loss"]["sbp"] - t[0]["loss"]["dtensor"])
        print(f"{f'gpt-d{dim}':<14} {s_ms:8.1f} {d_ms:8.1f} {s_ms / d_ms:6.2f} {s_mib:8.1f} {d_mib:8.1f} "
              f"{s_mib / d_mib if d_mib else float('nan'):9.2f} {sm[0]['params']:11,d} {loss_diff:9.1e}")
    if args.compile:
        print("\ncompiled (torch.compile(forward + loss, fullgraph=True), inductor; backward and SGD eager)\n")
        print(f"{'case':<14} {'sbp eager':>9} {'sbp comp':>9} {'DT eager':>9} {'DT comp':>8} {'comp/DT':>7} "
              f"{'comp/eager':>10} {'cpu c/DT':>8} {'1st step s':>11} {'comp diff':>17}")
        for dim in args.dims:
            t = timing[dim]
            ms = {fw: slowest_median(t, fw) for fw in ("sbp", "sbp-comp", "dtensor", "dtensor-comp")}
            first = "/".join(f"{max(r['first'][fw] for r in t):.0f}" for fw in ("sbp-comp", "dtensor-comp"))
            diffs = "/".join(f"{abs(t[0]['loss'][f'{fw}-comp'] - t[0]['loss'][fw]):.1e}" for fw in ("sbp", "dtensor"))
            cpu = mean_cpu(t, "sbp-comp") / mean_cpu(t, "dtensor-comp")
            print(f"{f'gpt-d{dim}':<14} {ms['sbp']:9.1f} {ms['sbp-comp']:9.1f} {ms['dtensor']:9.1f} "
                  f"{ms['dtensor-comp']:8.1f} {ms['sbp-comp'] / ms['dtensor-comp']:7.2f} "
                  f"{ms['sbp-comp'] / ms['sbp']:10.2f} {cpu:8.2f} {first:>11} {diffs:>17}")
        if args.whole_step:
            print("\nsbp's whole step compiled (forward, loss, backward, SGD; compiled autograd, inductor)\n")
            print(f"{'case':<14} {'sbp whole':>9} {'DT comp':>8} {'whole/DT':>8} {'cpu w/DT':>8} {'1st step s':>10} "
                  f"{'loss diff':>9}")
            for dim in args.dims:
                t = timing[dim]
                whole, dt = slowest_median(t, "sbp-whole"), slowest_median(t, "dtensor-comp")
                cpu = mean_cpu(t, "sbp-whole") / mean_cpu(t, "dtensor-comp")
                first = max(r["first"]["sbp-whole"] for r in t)
                diff = abs(t[0]["loss"]["sbp-whole"] - t[0]["loss"]["sbp"])
                print(f"{f'gpt-d{dim}':<14} {whole:9.1f} {dt:8.1f} {whole / dt:8.2f} {cpu:8.2f} {first:10.0f} "
                      f"{diff:9.1e}")
    if not all(r["peak_reset"] for fw in memory.values() for rs in fw.values() for r in rs):
        print("\n(note: /proc/self/clear_refs was not writable: MiB columns are whole-process peaks)")


if __name__ == "__main__":
    main()
