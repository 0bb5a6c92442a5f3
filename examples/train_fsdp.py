"""Train the small GPT of examples/train_tp.py fully sharded (FSDP), or fully sharded x tensor parallel, on CPUs.

The model code is unchanged PyTorch; `sbp.nn.fully_shard` is applied to each block and then to the root, as
with PyTorch FSDP2. Every rank stores a quarter of each parameter (S(0) on the dp axis), gathers a block's
parameters right before its forward (the next block's gather already on the way), frees them after, gathers
them again for backward and sends the gradients back as one reduce_scatter per block.

    python examples/train_fsdp.py                    # 4 gloo processes on 127.0.0.1, FSDP over 4 ranks
    python examples/train_fsdp.py --mesh 2x2         # FSDP on dp x tensor parallel on tp
    python examples/train_fsdp.py --check            # also train on one process and compare
    python examples/train_fsdp.py --compile          # torch.compile(model): hooks between graphs (inductor)
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py

Without torchrun's environment the script launches itself (a free port picked at run time, one process per
rank). Rank 0 prints the loss per step with a text progress bar, then the per-rank memory by storage.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_tp import (  # noqa: E402  (the model, data and launcher are the tensor-parallel example's)
    Config,
    batches,
    build,
    check_against_one_process,
    encode,
    launch,
    make_optimizer,
    parse,
    progress,
    scalar,
    tp_plan,
)


def train(model, data: torch.Tensor, args, *, on_step=None, backend=None):
    """The tensor-parallel example's loop, returning the optimizer too (its states count in the memory report).
    With a torch.compile `backend` the whole fully-sharded model is compiled: its units' hooks run eagerly
    between the graphs (a graph break at each unit boundary)."""
    opt = make_optimizer(model, args.optimizer, args.lr)
    run = model if backend is None else torch.compile(model, backend=backend)
    losses = []
    for step, (idx, targets) in enumerate(batches(data, args.batch, model.cfg.block, args.steps, args.seed)):
        t0 = time.perf_counter()
        loss = scalar(run(idx, targets))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], time.perf_counter() - t0)
    return losses, opt


def shard(model, mesh, two_d: bool):
    """FSDP (and TP on a 2-d mesh): `parallelize` first, then `fully_shard` per block, then the root."""
    import sbp.nn

    if two_d:
        sbp.nn.parallelize(model, mesh, tp_plan(), tp_axis="tp")
    for block in model.blocks:
        sbp.nn.fully_shard(block, mesh, "dp")
    return sbp.nn.fully_shard(model, mesh, "dp")


def worker(args) -> None:
    """One rank: build the full model (same seed everywhere), shard it, train, report memory, optionally check."""
    import sbp
    import sbp.nn
    from sbp.nn.fsdp import memory_report, unit_of

    torch.set_num_threads(1)
    shape = tuple(int(n) for n in args.mesh.lower().split("x"))
    names = ("dp", "tp")[:len(shape)]
    mesh = sbp.init_mesh(shape, names, device_type=args.device)
    data, vocab = encode()
    cfg = Config(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, block=args.block)
    model = shard(build(cfg, args.seed), mesh, len(shape) == 2)
    rank0 = mesh.rank == 0
    if rank0:
        print(f"sbp FSDP: mesh {shape} {names}, {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{args.steps} steps of batch {args.batch} x {cfg.block} chars", flush=True)
    t0 = time.perf_counter()
    losses, opt = train(model, data, args, on_step=progress(args.steps) if rank0 else None, backend=args.compile)
    report = memory_report(model, opt)
    if rank0:
        mib = lambda n: f"{n / 2**20:.3f} MiB"
        local = sum(unit_of(b).auto == "local" for b in model.blocks)
        calls = len(mesh.binding.counters.calls)
        print(f"trained in {time.perf_counter() - t0:.1f} s; collectives on rank 0: {calls}; "
              f"blocks computing on local batch shares (verified in step 1): {local}/{len(model.blocks)}")
        print(f"rank 0 memory by storage: params {mib(report['params'])}, grads {mib(report['grads'])}, optimizer "
              f"{mib(report['optimizer'])}, peak gathered {mib(report['peak_gathered'])}; peak total "
              f"{mib(report['total'])}", flush=True)
    if args.check:
        params = {name: p.full().detach() for name, p in model.named_parameters()}  # every rank takes part
        if rank0:
            ref = build(cfg, args.seed)
            check_against_one_process(losses, params, train(ref, data, args)[0], ref, args)


def main(argv=None) -> None:
    args = parse(argv)
    shape = [int(n) for n in args.mesh.lower().split("x")]
    if len(shape) > 2:
        sys.exit(f"--mesh {args.mesh!r}: train_fsdp takes a 1-d (FSDP) or 2-d (FSDP x TP) mesh, like '4' or '2x2'")
    if args.whole_step:
        sys.exit("--whole-step: train_fsdp compiles the model (--compile), not the whole step")
    launch(worker, args, math.prod(shape))


if __name__ == "__main__":
    main()
