"""Train a small GPT-style transformer with tensor parallelism (and optionally data parallelism) on CPUs.

The model code below is plain PyTorch; one `sbp.nn.parallelize` call with a `{module path: style}`
plan makes it run tensor-parallel (Megatron layout: q/k/v and fc colwise, attention output and MLP
output rowwise, vocab-parallel embedding). The corpus is a few paragraphs stored in this file, read
character by character.

    python examples/train_tp.py                      # 4 gloo processes on 127.0.0.1, TP over 4 ranks
    python examples/train_tp.py --mesh 2x2           # DP x TP: batch S(0) on dp, TP on the last axis
    python examples/train_tp.py --check              # also train on one process and compare
    python examples/train_tp.py --sequence-parallel  # layer norms on S(1): all_gather + reduce_scatter
    python examples/train_tp.py --compile            # forward + loss as one torch.compile graph (inductor)
    python examples/train_tp.py --compile --whole-step   # the whole step compiled, under compiled autograd
    torchrun --standalone --nproc-per-node 4 examples/train_tp.py
    torchrun --standalone --nproc-per-node 4 --max-restarts 1 examples/train_tp.py --checkpoint ckpt --resume
                                                     # a checkpoint every 5 steps; a restarted job resumes

Without torchrun's environment the script launches itself: it picks a free port at run time and
spawns one process per rank. Rank 0 prints the loss per step with a text progress bar.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

CORPUS = """\
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light,
it was the season of Darkness, it was the spring of hope, it was the winter of despair.
In the beginning the mesh was without form, and every rank held the whole tensor. Then the planner said:
let there be shards; and the rows were split among the ranks, and each rank kept only its block.
A broadcast value is the same on every rank; a partial value is a sum not yet taken; a split value is a
row of bricks, each rank laying its own. To gather is to collect the bricks, to reduce is to add the
partial sums, and to scatter is to give each rank the part that is its own.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly
quick daft zebras jump! Sphinx of black quartz, judge my vow.
"""


# ---- the model: unchanged PyTorch ----------------------------------------------------------------------

@dataclass
class Config:
    vocab: int = 64
    block: int = 32          # context length T
    dim: int = 64            # C
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.register_buffer("mask", torch.tril(torch.ones(cfg.block, cfg.block, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)        # (B, T, C); under TP each rank's local heads
        b, t, c = q.shape                                 # shapes of the tensor itself: local under TP
        h = c // self.head_dim                            # (not -1: a rank's share of a small batch may be empty)
        q, k, v = (z.reshape(b, t, h, self.head_dim).transpose(1, 2) for z in (q, k, v))  # (B, h, T, hd)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)                          # (B, h, T, T)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)                                     # (B, T, h*hd)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.block, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))    # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))              # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ---- the tensor-parallel plan ---------------------------------------------------------------------------

def tp_plan(sequence_parallel: bool = False) -> dict:
    """Megatron's layout as an sbp plan. q/k/v return local heads (attention runs on plain local
    tensors, one rank's heads each); the attention output projection takes them back as `S(-1)`."""
    from sbp.nn import Colwise, Embedding, Rowwise, SequenceParallel

    plan = {
        "wte": "embedding",
        "blocks.*.attn.[qkv]": Colwise(use_local_output=True),
        "blocks.*.attn.proj": Rowwise(local_input=True),
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "lm_head": Colwise(output_placement="B"),
    }
    if sequence_parallel:  # the residual stream lives on S(1); each norm gathers once for its consumers
        plan.update({
            "wte": Embedding(output_placement="S(1)"),
            "blocks.*.ln[12]": SequenceParallel(output_placement="B"),
            "ln_f": SequenceParallel(output_placement="B"),
            "blocks.*.attn.proj": Rowwise(local_input=True, output_placement="S(1)"),
            "blocks.*.mlp.proj": Rowwise(output_placement="S(1)"),
        })
    return plan


# ---- data and training ------------------------------------------------------------------------------------

def encode(text: str = CORPUS) -> tuple[torch.Tensor, int]:
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    return torch.tensor([lookup[c] for c in text], dtype=torch.int64), len(chars)


def batches(data: torch.Tensor, batch: int, block: int, steps: int, seed: int):
    """The same (B, T) windows on every rank: every rank passes the full batch (a plain tensor is Broadcast)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        idx = torch.stack([data[s:s + block] for s in start.tolist()])
        yield idx, torch.stack([data[s + 1:s + block + 1] for s in start.tolist()])


def build(cfg: Config, seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).to(dtype)


def make_optimizer(model: nn.Module, name: str, lr: float | None) -> torch.optim.Optimizer:
    """SGD with momentum by default. AdamW works as well, but `--check` compares rounding-level noise there:
    the key bias has an exactly zero gradient (softmax ignores a shift shared by all keys), and Adam scales
    its ~1e-9 rounding noise up to lr-sized steps, which differ between any two summation orders."""
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr or 3e-3, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=lr or 0.5, momentum=0.9)


def scalar(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor (a global loss is gathered; its gradient enters as Broadcast)."""
    return loss.full() if hasattr(loss, "placements") else loss


def loss_fn(model: nn.Module, backend: str | None):
    """The step's loss as a plain tensor; with a torch.compile `backend`, forward and loss run as one graph
    (``fullgraph=True``: the planner's collectives are in it; backward and optimizer step stay eager)."""
    if backend is None:
        return lambda idx, targets: scalar(model(idx, targets))
    return torch.compile(lambda idx, targets: model(idx, targets).full(), backend=backend, fullgraph=True)


def train(model: nn.Module, data: torch.Tensor, args, *, on_step=None, mesh=None) -> list[float]:
    """Train for `args.steps` steps; with a `mesh` and ``--checkpoint DIR``, save every ``--save-every`` steps
    and at the end, and (``--resume``) start from the checkpoint in DIR if there is one."""
    opt = make_optimizer(model, args.optimizer, args.lr)
    losses, start = [], 0
    saving = mesh is not None and args.checkpoint is not None
    if saving and args.resume:
        start, losses = resume(model, opt, args.checkpoint, mesh)
    backend = getattr(args, "compile", None) if mesh is not None else None   # --check's model: eager
    whole = backend is not None and getattr(args, "whole_step", False)
    forward = loss_fn(model, None if whole else backend)

    def train_step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = forward(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    if whole:   # compiled autograd: backward and optimizer step compile too (torch.compile reads the flag)
        with torch._dynamo.config.patch(compiled_autograd=True):
            train_step = torch.compile(train_step, backend=backend)
    for step, (idx, targets) in enumerate(batches(data, args.batch, model.cfg.block, args.steps, args.seed)):
        if step < start:
            continue   # a step taken before the restart: its batch is drawn again, so the data stream continues
        t0 = time.perf_counter()
        losses.append(train_step(idx, targets).item())
        if on_step is not None:
            on_step(step, losses[-1], time.perf_counter() - t0)
        if saving and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            save_checkpoint(model, opt, args.checkpoint, step + 1, losses)
    return losses


def join_restarted_job(device: str) -> None:
    """A job torchrun restarted (``--max-restarts``) makes its default group over a store prefix of its own:
    torchrun's store keeps the failed attempt's keys, whose gloo addresses are dead (connectFullMesh would
    time out on them). The first attempt leaves it to `sbp.init_mesh`."""
    from datetime import timedelta

    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or dist.is_initialized():
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          timeout=timedelta(minutes=5))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=rank, world_size=world)


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, path: str, step: int, losses: list[float]) -> None:
    """`sbp.save` of the model, the optimizer, the step and the loss curve so far (crash-safe: a job killed
    while saving leaves the previous checkpoint)."""
    import sbp
    sbp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "losses": losses}, path)


def resume(model: nn.Module, opt: torch.optim.Optimizer, path: str, mesh) -> tuple[int, list[float]]:
    """Load the checkpoint at `path` into `model` and `opt` if there is one; (steps done, their losses)."""
    import sbp
    if not os.path.exists(os.path.join(path, "metadata.json")):
        return 0, []
    for p in model.parameters():   # sbp.load fills the entries a state dict has: a zero step makes the optimizer's
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0, "losses": []}
    sbp.load(path, state)          # parameters in place; the zero step's changes are overwritten
    opt.load_state_dict(state["optim"])
    if mesh.rank == 0:
        print(f"resumed from step {state['step']} ({path})", flush=True)
    return state["step"], state["losses"]


def progress(total: int):
    def show(step: int, loss: float, seconds: float) -> None:
        done = step + 1
        bar = "#" * (20 * done // total) + "." * (20 - 20 * done // total)
        print(f"step {done:3d}/{total} [{bar}] loss {loss:.4f}  {seconds * 1000:6.1f} ms", flush=True)
    return show


def worker(args) -> None:
    """One rank: build the full model (same seed everywhere), parallelize it, train, optionally check."""
    import sbp
    import sbp.nn

    torch.set_num_threads(1)
    shape = tuple(int(n) for n in args.mesh.split("x"))
    names = ("dp", "tp")[-len(shape):] if len(shape) <= 2 else None
    join_restarted_job(args.device)
    mesh = sbp.init_mesh(shape, names, device_type=args.device)  # cuda: NCCL, each rank on GPU LOCAL_RANK
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    data, vocab = encode()
    data = data.to(device)
    cfg = Config(vocab=vocab, dim=args.dim, heads=args.heads, layers=args.layers, block=args.block)
    model = build(cfg, args.seed).to(device)
    sbp.nn.parallelize(model, mesh, tp_plan(args.sequence_parallel))
    rank0 = mesh.rank == 0
    if rank0:
        print(f"sbp TP: mesh {shape} {names}, {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{args.steps} steps of batch {args.batch} x {cfg.block} chars", flush=True)
    t0 = time.perf_counter()
    losses = train(model, data, args, on_step=progress(args.steps) if rank0 else None, mesh=mesh)
    if rank0:
        note = " run eagerly (the compiled graphs' own collectives are torch's and not counted)" if args.compile else ""
        print(f"trained in {time.perf_counter() - t0:.1f} s; collectives on rank 0{note}: "
              f"{len(mesh.binding.counters.calls)}", flush=True)
    if args.check:
        params = {name: p.full().cpu() for name, p in model.named_parameters()}  # every rank takes part
        if rank0:
            ref = build(cfg, args.seed)
            check_against_one_process(losses, params, train(ref, data, args), ref, args)


def check_against_one_process(losses: list[float], params: dict, ref_losses: list[float], ref: nn.Module,
                              args) -> None:
    """Rank 0 of `--check`: the parallel run's losses and full parameters against the one-process run's; prints
    the largest differences and exits with status 1 beyond `args.tol`."""
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff, worst = max(((params[n] - p.detach()).abs().max().item(), n) for n, p in ref.named_parameters())
    ok = loss_diff <= args.tol and param_diff <= args.tol
    print(f"check against one process: max |loss diff| {loss_diff:.3e}, max |param diff| {param_diff:.3e} "
          f"({worst}) after {args.steps} steps -> {'OK' if ok else 'MISMATCH'} (tolerance {args.tol:g})", flush=True)
    if not ok:
        sys.exit(1)


# ---- launching ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker, args, world: int) -> None:
    """Run `worker(args)` on `world` ranks: under torchrun (RANK set) this process is one of them; otherwise start
    `world` processes on this machine (gloo on 127.0.0.1, a free port). A failing rank's exit status is ours."""
    if "RANK" in os.environ:  # torchrun (or another launcher) started us
        worker(args)
        finish()
        return
    import torch.multiprocessing as mp
    try:
        mp.start_processes(_spawned, args=(world, free_port(), worker, args), nprocs=world, start_method="spawn")
    except mp.ProcessExitedException as e:  # a rank failed (or --check found a mismatch): its output says why
        sys.exit(e.exit_code or 1)


def _spawned(rank: int, world: int, port: int, worker, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        worker(args)
    except BaseException:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    finish()


def finish() -> None:
    """Every rank waits for the others (rank 0 may still be checking), then all tear down together: a rank
    that exits while a peer still holds its gloo connections can abort in gloo's teardown."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="4", help="mesh shape: '4' (TP) or '2x2' (DP x TP); default 4")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=None, help="default: 0.5 for sgd, 3e-3 for adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo ranks (default); cuda: NCCL, one GPU per rank")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--check", action="store_true", help="also train on one process and compare")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="forward and loss as one torch.compile(fullgraph=True) graph; backend default inductor")
    p.add_argument("--whole-step", action="store_true",
                   help="with --compile: the whole step (forward, backward, optimizer) compiled, compiled autograd")
    p.add_argument("--tol", type=float, default=1e-5)
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="save model, optimizer and step to DIR every --save-every steps and at the end")
    p.add_argument("--resume", action="store_true",
                   help="start from the checkpoint in --checkpoint DIR if there is one (for torchrun --max-restarts)")
    p.add_argument("--save-every", type=int, default=5, metavar="K", help="steps between checkpoints; default 5")
    args = p.parse_args(argv)
    if args.whole_step and args.compile is None:
        p.error("--whole-step compiles the whole step: it needs --compile [BACKEND]")
    if args.resume and args.checkpoint is None:
        p.error("--resume needs --checkpoint DIR (the checkpoint to resume from)")
    if args.save_every < 1:
        p.error(f"--save-every {args.save_every}: the number of steps between checkpoints must be at least 1")
    try:
        shape = [int(n) for n in args.mesh.lower().split("x")]
        assert shape and all(n > 0 for n in shape)
    except (ValueError, AssertionError):
        p.error(f"--mesh {args.mesh!r}: write it like '4' or '2x2'")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    launch(worker, args, math.prod(int(n) for n in args.mesh.lower().split("x")))


if __name__ == "__main__":
    main()
