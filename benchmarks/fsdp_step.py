"""One training step of examples/train_fsdp.py's GPT: sbp's `fully_shard` against PyTorch FSDP2
(`torch.distributed.fsdp.fully_shard`) on the same model, mesh and global batch, 4 gloo ranks, in the same
processes, steps interleaved (sbp, FSDP2, sbp, ...).

    python benchmarks/fsdp_step.py                 # FSDP on (4,), then FSDP x TP on (2, 2)
    python benchmarks/fsdp_step.py --steps 20 --dim 128
    python benchmarks/fsdp_step.py --compile aot_eager   # both models under torch.compile(model, backend=...)

Figures per layout (rank 0; medians over the timed steps):

- step ms: forward + backward + optimizer step;
- CPU ms: the process's CPU time over the step (all its threads: the training thread, sbp's communication
  queue, gloo's), a figure the machine's load moves less than the wall time: with 4 ranks on fewer cores
  the step time follows the CPU time the ranks need;
- exposed comm ms: time the training thread is blocked on communication -- sbp: on its ordered queue
  (`CommQueue.blocked_s`: waiting for gathers and reduce_scatters); FSDP2: inside its collectives and their
  waits (`dist.all_gather_single`, `dist.reduce_scatter_single`, `dist.all_reduce`, timed by wrappers);
- peak MiB by storage: stored parameters + gradients + optimizer states + the most gathered (unsharded)
  parameter bytes held or on the way at once (sbp: `sbp.nn.fsdp.memory_report`; FSDP2: each parameter group
  from its all-gather's issue to its reshard, sampled at every unshard / wait / reshard); "gathered" is
  that gathered peak alone;
- sbp colls: the collectives sbp's communicator ran on rank 0 in one step (its `counters.calls`).

"FSDP (4,)": the default `fully_shard(block, mesh)`: each block is verified on the first step and then computes
on plain local shares, as FSDP2's do (the root's embedding, head and loss stay global tensors); "FSDP (4,)
global": `local_batch=False`, the blocks on global tensors throughout.

FSDP x TP: sbp `parallelize` (q, k, v, fc colwise; attention and MLP projections rowwise) then
`fully_shard` on dp; FSDP2: `parallelize_module` with the same styles, then `fully_shard` on dp. By default
the tensor-parallel blocks too are verified on the first step and then compute on plain local shares (their
colwise / rowwise layers on their local pieces, the tp collectives issued by `parallelize`'s hooks), as
FSDP2 + `parallelize_module`'s do (its styles return local tensors: `use_local_output=True`); "FSDP x TP
(2, 2) global": `local_batch=False`, the blocks on global tensors (sbp's code before this path existed).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_tp import Config, batches, build, encode, free_port  # noqa: E402

BLOCK_PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
              "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}


def _sbp_model(cfg, mesh, two_d: bool, local_batch=None):
    import sbp.nn
    from sbp.nn import Colwise, Rowwise

    model = build(cfg, 0)
    if two_d:   # the attention code reshapes heads with local shapes: q/k/v return local tensors
        plan = {k: Colwise(use_local_output=True) if k.endswith(("q", "k", "v")) else v for k, v in BLOCK_PLAN.items()}
        plan["blocks.*.attn.proj"] = Rowwise(local_input=True)
        sbp.nn.parallelize(model, mesh, plan, tp_axis="tp")
    for block in model.blocks:
        sbp.nn.fully_shard(block, mesh, "dp", local_batch=local_batch)
    return sbp.nn.fully_shard(model, mesh, "dp")


def _torch_model(cfg, mesh, two_d: bool):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build(cfg, 0)
    dp = mesh["dp"] if two_d else mesh
    if two_d:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                                   "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                                   "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    return fully_shard(model, mesh=dp)


class _TimedCollectives:
    """Wrap torch.distributed's collectives (as FSDP2 calls them) to add up the time spent in them and in
    their waits on the calling thread."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self.dist, self.seconds, self.saved = dist, 0.0, {}
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor",
                     "reduce_scatter_tensor"):
            if hasattr(dist, name):
                self.saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, fn):
        outer = self

        class Work:
            def __init__(self, work) -> None:
                self.work = work

            def wait(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return self.work.wait(*a, **k)
                finally:
                    outer.seconds += time.perf_counter() - t0

            def __getattr__(self, name):
                return getattr(self.work, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                out = fn(*a, **k)
            finally:
                outer.seconds += time.perf_counter() - t0
            return Work(out) if out is not None else out
        return timed


class _TorchGatheredPeak:
    """FSDP2's most gathered (unsharded) parameter bytes held or on the way at once -- sbp's `peak_gathered`
    definition: a parameter group counts from its all-gather's issue (`FSDPParamGroup.unshard`, its output
    buffer is allocated then) until its `reshard`, at its padded size. Sampled after every unshard, wait and
    reshard of every group (the methods are wrapped for the run)."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        self.cls, self.groups, self.peak, self.saved = FSDPParamGroup, set(), 0, {}
        for name in ("unshard", "wait_for_unshard", "reshard"):
            self.saved[name] = getattr(FSDPParamGroup, name)
            setattr(FSDPParamGroup, name, self._wrap(self.saved[name]))

    def _wrap(self, fn):
        outer = self

        def sampled(group, *a, **k):
            out = fn(group, *a, **k)
            outer.groups.add(group)
            outer.sample()
            return out
        return sampled

    def sample(self) -> None:
        held = 0
        for g in self.groups:
            if not g.is_sharded or g._all_gather_result is not None:
                held += sum(fp._sharded_param_data.numel() * fp._sharded_param_data.element_size()
                            * g.mesh_info.shard_mesh_size for fp in g.fsdp_params)
        self.peak = max(self.peak, held)

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t._local_tensor if hasattr(t, "_local_tensor") else t   # a DTensor's shard
        s = local.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def run_layout(args, shape: tuple[int, ...], rank: int, local_batch=None) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import sbp
    from sbp.nn.fsdp import memory_report
    from sbp.runtime.pending import queue_of

    two_d = len(shape) == 2
    names = ("dp", "tp") if two_d else ("dp",)
    mesh = sbp.init_mesh(shape, names, device_type="cpu")
    tmesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    data, vocab = encode()
    cfg = Config(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, block=args.block)
    ours, theirs = _sbp_model(cfg, mesh, two_d, local_batch), _torch_model(cfg, tmesh, two_d)
    # --compile: the whole root compiled (each library's unit hooks run between graphs); the warm-up steps compile.
    # Each block of each model is a frame dynamo compiles once (its hooks are guarded by id): this process builds
    # 8 models, past dynamo's default limit of 8 compiles per code object, after which it would run them eagerly
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    run_ours, run_theirs = ((torch.compile(m, backend=args.compile) for m in (ours, theirs)) if args.compile
                            else (ours, theirs))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3, foreach=True)   # the same setting for both
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=True)
    queue, timed, probe = queue_of(mesh.binding), _TimedCollectives(), _TorchGatheredPeak()
    dp_size, dp_coord = shape[0], mesh.coord[0]
    times = {"sbp": [], "fsdp2": []}
    exposed = {"sbp": [], "fsdp2": []}
    cpu = {"sbp": [], "fsdp2": []}
    calls, colls = mesh.binding.counters.calls, []   # sbp's collectives on this rank, per step
    for step, (idx, targets) in enumerate(batches(data, args.batch, cfg.block, args.warmup + args.steps, 0)):
        per = idx.shape[0] // dp_size
        local = slice(dp_coord * per, (dp_coord + 1) * per)
        for who in ("sbp", "fsdp2"):
            torch.distributed.barrier()
            blocked0, coll0, ncalls = queue.blocked_s, timed.seconds, len(calls)
            t0, c0 = time.perf_counter(), time.process_time()
            if who == "sbp":
                loss = run_ours(idx, targets).full()
                opt_ours.zero_grad(set_to_none=True)
                loss.backward()
                opt_ours.step()
            else:
                loss = run_theirs(idx[local], targets[local])
                opt_theirs.zero_grad(set_to_none=True)
                loss.backward()
                opt_theirs.step()
            seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
            if step >= args.warmup:
                if who == "sbp":
                    colls.append(len(calls) - ncalls)
                times[who].append(seconds)
                cpu[who].append(cpu_s)
                exposed[who].append(queue.blocked_s - blocked0 if who == "sbp" else timed.seconds - coll0)
    for name, fn in timed.saved.items():
        setattr(timed.dist, name, fn)
    probe.restore()
    report = memory_report(ours, opt_ours)
    theirs_params = list(theirs.parameters())
    theirs_state = [v for s in opt_theirs.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim]
    fsdp2_peak = (_storage_bytes(theirs_params) + _storage_bytes([p.grad for p in theirs_params])
                  + _storage_bytes(theirs_state) + probe.peak)
    ms = lambda xs: 1000 * statistics.median(xs)
    return {"layout": ("FSDP (4,)" if not two_d else "FSDP x TP (2, 2)") + (" global" if local_batch is False else ""),
            "sbp_ms": ms(times["sbp"]), "fsdp2_ms": ms(times["fsdp2"]),
            "sbp_cpu_ms": ms(cpu["sbp"]), "fsdp2_cpu_ms": ms(cpu["fsdp2"]),
            "sbp_exposed_ms": ms(exposed["sbp"]), "fsdp2_exposed_ms": ms(exposed["fsdp2"]),
            "sbp_peak": report["total"], "fsdp2_peak": fsdp2_peak,
            "sbp_gathered": report["peak_gathered"], "fsdp2_gathered": probe.peak,
            "sbp_collectives": statistics.median(colls)}


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    shapes = [shape for shape in ((4,), (2, 2)) if args.layout in ("all", "x".join(map(str, shape)))]
    rows = []
    for shape in shapes:   # each layout, then its blocks on global tensors throughout (local_batch=False)
        rows += [run_layout(args, shape, rank), run_layout(args, shape, rank, local_batch=False)]
    if rank == 0:
        print(f"model: GPT dim {args.dim}, {args.layers} layers, batch {args.batch} x {args.block}; "
              f"{args.steps} timed steps after {args.warmup} warm-up, 4 gloo ranks"
              + (f"; torch.compile(model, backend={args.compile!r})" if args.compile else ""))
        print(f"{'layout':23} {'sbp ms':>8} {'FSDP2 ms':>9} {'ratio':>6} {'CPU ms sbp/FSDP2':>17} {'ratio':>6} "
              f"{'sbp exposed':>12} {'FSDP2 exposed':>14} "
              f"{'sbp peak MiB':>13} {'FSDP2 peak MiB':>15} {'gathered KiB sbp/FSDP2':>23} {'sbp colls':>9}")
        for r in rows:
            print(f"{r['layout']:23} {r['sbp_ms']:8.1f} {r['fsdp2_ms']:9.1f} {r['sbp_ms'] / r['fsdp2_ms']:6.2f} "
                  f"{r['sbp_cpu_ms']:8.1f}/{r['fsdp2_cpu_ms']:<8.1f} {r['sbp_cpu_ms'] / r['fsdp2_cpu_ms']:6.2f} "
                  f"{r['sbp_exposed_ms']:10.1f}ms {r['fsdp2_exposed_ms']:12.1f}ms {r['sbp_peak'] / 2**20:13.3f} "
                  f"{r['fsdp2_peak'] / 2**20:15.3f} {r['sbp_gathered'] / 2**10:11.1f}/"
                  f"{r['fsdp2_gathered'] / 2**10:<11.1f} {r['sbp_collectives']:5.0f}", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--layout", choices=("all", "4", "2x2"), default="all")
    p.add_argument("--compile", metavar="BACKEND", default=None,
                   help="compile both roots whole with this torch.compile backend (e.g. aot_eager, inductor)")
    args = p.parse_args()
    import torch.multiprocessing as mp
    mp.start_processes(worker, args=(4, free_port(), args), nprocs=4, start_method="spawn")


if __name__ == "__main__":
    main()
