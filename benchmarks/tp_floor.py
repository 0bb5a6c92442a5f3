"""Where a compiled tensor-parallel train step's CPU time goes: sbp, DTensor and the same plan written by hand.

The model is examples/train_tp.py's GPT (2 layers by default, heads of 64 features, at least 4) on 4
gloo ranks on 127.0.0.1 (TP over 4), built three times from the same weights:

- ``sbp``: `sbp.nn.parallelize` with the example's `tp_plan()`;
- ``DTensor``: `parallelize_module` with benchmarks/tp_step.py's `dtensor_plan` (the equivalent
  Colwise/Rowwise plan on the same modules);
- ``by hand``: Megatron tensor parallelism on plain local tensors, no framework: each rank holds its
  slices of the same weights (q, k, v and fc by output rows, both output projections by input columns,
  the embedding and the LM head by vocabulary rows, padded to a multiple of 4), Megatron's ``f``
  (identity forward, all-reduce backward) and ``g`` (all-reduce forward, identity backward) as autograd
  functions around ``torch.ops._c10d_functional.all_reduce`` + ``wait_tensor``, and the LM head's output
  gathered with ``all_gather_into_tensor``: the same 11 collectives per step as sbp's graph. With no
  framework in it, it is the floor of this plan on this machine for any framework.

All three train alike: forward and cross-entropy as one ``torch.compile(..., fullgraph=True)`` graph
(inductor), as benchmarks/tp_step.py compiles them; eager backward; ``torch.optim.SGD(lr=0.1,
momentum=0.9)``. Each step is cut into four phases -- forward + loss, ``zero_grad(set_to_none=True)``,
backward, optimizer step -- and each phase is timed in CPU time of the whole process
(``time.process_time``: all threads, gloo's included; with 4 ranks on few cores a step is CPU-bound, and
CPU time is less sensitive than wall time to other jobs on the machine). The three models live in the
same 4 processes and their steps alternate (sbp, DTensor, by hand, sbp, ...) after a barrier, so a burst
of load hits all three alike. Per hidden size (``--dims``) it prints, in ms per rank and step:

- one row per phase: the median over the timed steps of a rank's CPU time in that phase, mean over ranks;
- ``total``: the sum of the four phase rows;
- ``/ DTensor``: each column's total over DTensor's.

Then the loss of each model on the training batch after the warm-up and timed steps (one more compiled
forward, rank 0) and the largest difference between the three: they start from the same weights and
take the same steps, so they agree to rounding.

    python benchmarks/tp_floor.py [--dims 64,512] [--steps 10] [--warmup 3] [--layers 2] [--batch 8] [--block 64]
"""
from __future__ import annotations

import argparse
import copy
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from tp_step import WORLD, forward_loss_of, measure, sharded_model  # noqa: E402  (the TP benchmark's model and launcher)

FRAMEWORKS = {"sbp": "sbp", "dtensor": "DTensor", "hand": "by hand"}
PHASES = {"fwd": "forward + loss", "zero": "zero_grad", "bwd": "backward", "opt": "optimizer step"}


# ---- the hand-written model ------------------------------------------------------------------------------

def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    group = dist.group.WORLD.group_name
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", group))


class Copy(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward (before a column-parallel op)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _all_reduce(grad.contiguous())


class Reduce(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward (after a row-parallel op), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class GatherLast(torch.autograd.Function):
    """All-gather of each rank's slice of the last dim (the LM head's vocabulary); backward keeps the rank's
    slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rank: int) -> torch.Tensor:
        ctx.rank, ctx.n = rank, x.shape[-1]
        gathered = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(
            x.contiguous(), WORLD, dist.group.WORLD.group_name))            # (WORLD * B, T, V / WORLD)
        return torch.cat(gathered.chunk(WORLD, 0), dim=-1)                 # (B, T, V padded)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def _rows(t: torch.Tensor, rank: int, n: int) -> nn.Parameter:
    """Rank `rank`'s `n` rows of `t`, a parameter of its own."""
    return nn.Parameter(t[rank * n:(rank + 1) * n].detach().clone())


def _padded(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`weight` with zero rows appended up to `rows` (the vocabulary rounded up to a multiple of WORLD)."""
    out = torch.zeros(rows, weight.shape[1], dtype=weight.dtype)
    out[:weight.shape[0]] = weight.detach()
    return out


class HandTP(nn.Module):
    """examples/train_tp.py's GPT as Megatron tensor parallelism on plain local tensors: rank `rank`'s
    slices of `full`'s weights, its collectives written out. ``HandTP(full, rank)(idx)`` gives the full
    (B, T, vocab) logits on every rank, as `full(idx)` does on one process."""

    def __init__(self, full: nn.Module, rank: int) -> None:
        super().__init__()
        cfg = full.cfg
        self.rank, self.vocab = rank, cfg.vocab
        self.vloc = -(-cfg.vocab // WORLD)                                  # vocabulary rows per rank
        self.head_dim = cfg.dim // cfg.heads
        self.wte = _rows(_padded(full.wte.weight, self.vloc * WORLD), rank, self.vloc)
        self.wpe = nn.Parameter(full.wpe.weight.detach().clone())
        self.blocks = nn.ModuleList()
        c = cfg.dim // WORLD                                                # local features of q, k, v
        for b in full.blocks:
            m = nn.Module()
            m.ln1, m.ln2 = copy.deepcopy(b.ln1), copy.deepcopy(b.ln2)
            for n in "qkv":
                lin = getattr(b.attn, n)
                setattr(m, n + "w", _rows(lin.weight, rank, c))
                setattr(m, n + "b", _rows(lin.bias, rank, c))
            m.pw = nn.Parameter(b.attn.proj.weight[:, rank * c:(rank + 1) * c].detach().clone())
            m.pb = nn.Parameter(b.attn.proj.bias.detach().clone())
            h = b.mlp.fc.weight.shape[0] // WORLD                           # local MLP hidden features
            m.fw, m.fb = _rows(b.mlp.fc.weight, rank, h), _rows(b.mlp.fc.bias, rank, h)
            m.mw = nn.Parameter(b.mlp.proj.weight[:, rank * h:(rank + 1) * h].detach().clone())
            m.mb = nn.Parameter(b.mlp.proj.bias.detach().clone())
            m.register_buffer("mask", b.attn.mask.clone(), persistent=False)
            self.blocks.append(m)
        self.ln_f = copy.deepcopy(full.ln_f)
        self.head = _rows(_padded(full.lm_head.weight, self.vloc * WORLD), rank, self.vloc)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        local = idx - self.rank * self.vloc
        outside = (local < 0) | (local >= self.vloc)                       # tokens of other ranks' rows
        e = F.embedding(local.masked_fill(outside, 0), self.wte).masked_fill(outside.unsqueeze(-1), 0.0)
        x = Reduce.apply(e) + F.embedding(torch.arange(t), self.wpe)        # (B, T, C)
        for m in self.blocks:
            h = Copy.apply(m.ln1(x))
            q, k, v = (F.linear(h, getattr(m, n + "w"), getattr(m, n + "b")) for n in "qkv")  # (B, T, C/W)
            q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            att = att.masked_fill(~m.mask[:t, :t], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, t, -1)
            x = x + (Reduce.apply(F.linear(y, m.pw)) + m.pb)
            h = Copy.apply(m.ln2(x))
            x = x + (Reduce.apply(F.linear(F.gelu(F.linear(h, m.fw, m.fb)), m.mw)) + m.mb)
        h = Copy.apply(self.ln_f(x))
        return GatherLast.apply(F.linear(h, self.head), self.rank)[..., :self.vocab]  # (B, T, vocab)


# ---- building and timing ---------------------------------------------------------------------------------

def build(framework: str, ex, dim: int, args):
    """The example's model (seed 0) sharded by `framework`; returns (optimizer, compiled forward + loss,
    batch inputs, batch targets)."""
    model, (idx, targets) = sharded_model(None if framework == "hand" else framework, ex, dim, args)
    if framework == "hand":
        model = HandTP(model, dist.get_rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return opt, torch.compile(forward_loss_of(framework, model), fullgraph=True), idx, targets


def step_phases(opt, loss_of, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """One train step; the process's CPU seconds in each phase."""
    c0 = time.process_time()
    loss = loss_of(idx, targets)
    c1 = time.process_time()
    opt.zero_grad(set_to_none=True)
    c2 = time.process_time()
    loss.backward()
    c3 = time.process_time()
    opt.step()
    c4 = time.process_time()
    return {"fwd": c1 - c0, "zero": c2 - c1, "bwd": c3 - c2, "opt": c4 - c3}


def time_case(ex, dim: int, args) -> dict:
    """The three models in the same process, their steps alternating."""
    torch._dynamo.reset()  # each hidden size compiles afresh, within dynamo's recompile limit
    models = {fw: build(fw, ex, dim, args) for fw in FRAMEWORKS}
    for _ in range(args.warmup):
        for opt, loss_of, idx, targets in models.values():
            step_phases(opt, loss_of, idx, targets)
    cpu: dict[str, list[dict[str, float]]] = {fw: [] for fw in models}
    for _ in range(args.steps):
        for fw, (opt, loss_of, idx, targets) in models.items():
            dist.barrier()
            cpu[fw].append(step_phases(opt, loss_of, idx, targets))
    # with grad on, as in the steps: under no_grad dynamo would compile the graph again
    losses = {fw: loss_of(idx, targets).item() for fw, (_, loss_of, idx, targets) in models.items()}
    return {"cpu": cpu, "loss": losses}


def phase_ms(per_rank: list[dict], framework: str, phase: str) -> float:
    """Mean over ranks of the median over steps of a rank's CPU time in `phase` (ms)."""
    return statistics.mean(statistics.median(s[phase] for s in r["cpu"][framework]) for r in per_rank) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="64,512", help="model widths (hidden size), comma separated (default 64,512)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="timed steps per model (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (default 3)")
    args = p.parse_args(argv)
    args.dims = [int(d) for d in args.dims.split(",")]
    if any(d % 64 or d < 64 for d in args.dims):
        p.error("--dims must be multiples of 64 (heads of 64 features)")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1 (the first step compiles)")
    timing = measure(time_case, args)
    print(f"torch {torch.__version__}, {WORLD} gloo ranks (TP=4), fp32, {args.layers} layers, batch {args.batch} x "
          f"{args.block} tokens; forward + loss compiled (fullgraph, inductor), backward and SGD eager; CPU ms "
          f"per rank and step (process_time, all threads), mean over ranks of the median of {args.steps} steps "
          f"after {args.warmup} warm-up")
    for dim in args.dims:
        t = timing[dim]
        ms = {fw: {ph: phase_ms(t, fw, ph) for ph in PHASES} for fw in FRAMEWORKS}
        total = {fw: sum(ms[fw].values()) for fw in FRAMEWORKS}
        print(f"\n{f'hidden {dim}, CPU ms':<20}" + "".join(f"{name:>10}" for name in FRAMEWORKS.values()))
        for ph, name in PHASES.items():
            print(f"{name:<20}" + "".join(f"{ms[fw][ph]:10.1f}" for fw in FRAMEWORKS))
        print(f"{'total':<20}" + "".join(f"{total[fw]:10.1f}" for fw in FRAMEWORKS))
        print(f"{'/ DTensor':<20}" + "".join(f"{total[fw] / total['dtensor']:10.2f}" for fw in FRAMEWORKS))
        losses = t[0]["loss"]
        spread = max(losses.values()) - min(losses.values())
        print(f"loss after {args.warmup + args.steps} steps (rank 0): "
              + ", ".join(f"{FRAMEWORKS[fw]} {loss:.8f}" for fw, loss in losses.items())
              + f"; max difference {spread:.1e}")


if __name__ == "__main__":
    main()
