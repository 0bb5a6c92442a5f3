"""Collectives per layer of a Hugging Face Llama with its own tensor-parallel plan on 4 gloo ranks: sbp's
`parallelize(model, mesh, "auto")` against transformers' own TP on DTensor, same model, same run.

Every rank builds the same `LlamaForCausalLM` (small config, grouped-query attention, float32, random
weights from a seed) twice: once parallelized by sbp, once by transformers' `apply_tensor_parallelism`
with the same plan (`model.tp_plan`) on a torch `DeviceMesh` over the same ranks. One training step
(forward with the loss, then backward) is counted on each: sbp's collectives from its communicator's
counters, DTensor's from the functional collectives its dispatch issues (a `TorchDispatchMode` sees each
one with its tensor). Bytes are what the busiest rank receives, ring formulas for both
(all_reduce 2 (n-1)/n of the tensor, all_gather and reduce_scatter (n-1)/n of the whole). "Per layer" is
the difference between a 4-layer and a 2-layer model, halved; "rest" is embedding, head and loss.
Needs the hf extra (transformers).

    python benchmarks/hf_collectives.py                # eager attention (the model's matmul / softmax code)
    python benchmarks/hf_collectives.py --attn sdpa    # sdpa (transformers' default), grouped-query kv heads
"""
from __future__ import annotations

import argparse
import collections
import fnmatch
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

N = 4


def build(layers: int, args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=2 * args.dim,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=args.seq)
    cfg._attn_implementation = args.attn
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


# bytes the busiest rank receives, from the bytes of the collective's input tensor (ring formulas)
RECEIVED = {"all_reduce": lambda b: 2 * (N - 1) * b // N, "all_gather_into_tensor": lambda b: (N - 1) * b,
            "reduce_scatter_tensor": lambda b: (N - 1) * b // N, "all_to_all_single": lambda b: (N - 1) * b // N}


class CountCollectives(TorchDispatchMode):
    """Records every functional collective (DTensor's redistributions) as (name, bytes received)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in RECEIVED:
            t = args[0]
            nbytes = t.numel() * t.element_size()
            self.calls.append((name.replace("_into_tensor", "").replace("_tensor", ""), RECEIVED[name](nbytes)))
        return func(*args, **(kwargs or {}))


def step_sbp(layers: int, ids: torch.Tensor, args) -> dict[str, tuple[int, int]]:
    import sbp
    import sbp.nn
    mesh = sbp.init_mesh((N,), ("tp",), device_type="cpu")
    model = sbp.nn.parallelize(build(layers, args), mesh, "auto")
    counters = mesh.binding.counters
    out = {}
    for phase in ("forward", "backward"):
        counters.reset()
        if phase == "forward":
            loss = model(input_ids=ids, labels=ids).loss
        else:
            loss.backward()
        out[phase] = (len(counters.calls), sum(c.received for c in counters.calls),
                      collections.Counter(c.collective for c in counters.calls))
    return out


def step_transformers(layers: int, ids: torch.Tensor, args) -> dict[str, tuple[int, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    mesh = init_device_mesh("cpu", (N,))
    model = build(layers, args)
    # what transformers' loader does with a tp plan: each matched module's parameters sharded by its style
    # (`shard_param`), then its forward wrapped (`install_forward`)
    modules = dict(model.named_modules())
    for pattern, style_name in model.tp_plan.items():
        style = ALL_PARALLEL_STYLES[style_name]
        for name in [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]:
            for param in list(modules[name]._parameters):
                style.shard_param(modules[name], param, mesh)
            style.install_forward(modules[name], mesh)
    out = {}
    for phase in ("forward", "backward"):
        with CountCollectives() as mode:
            if phase == "forward":
                loss = model(input_ids=ids, labels=ids).loss
            else:
                loss.backward()
        out[phase] = (len(mode.calls), sum(b for _, b in mode.calls), collections.Counter(n for n, _ in mode.calls))
    return out


def _row(name: str, phase: str, small, large, layers: tuple[int, int]) -> str:
    d = layers[1] - layers[0]
    (c2, b2, k2), (c4, b4, k4) = small[phase], large[phase]
    per_calls, per_bytes = (c4 - c2) / d, (b4 - b2) / d
    kinds = {k: (k4[k] - k2.get(k, 0)) / d for k in k4 if k4[k] != k2.get(k, 0)}
    what = ", ".join(f"{v:g} {k}" for k, v in sorted(kinds.items()))
    rest_c, rest_b = c2 - layers[0] * per_calls, b2 - layers[0] * per_bytes
    return (f"| {name:<22} | {phase:<8} | {per_calls:>5g} | {per_bytes / 1024:>9.1f} | {what:<28} | {rest_c:>4g} | "
            f"{rest_b / 1024:>9.1f} |")


def worker(rank: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(N))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=N)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    layers = (2, 4)
    results = {"sbp": [step_sbp(n, ids, args) for n in layers],
               "transformers (DTensor)": [step_transformers(n, ids, args) for n in layers]}
    if rank == 0:
        print(f"LlamaForCausalLM, plan 'auto', {N} ranks (gloo), hidden {args.dim}, 8 heads / 4 kv heads, batch "
              f"{args.batch} x {args.seq} tokens, vocab {args.vocab}, float32, {args.attn} attention; one training "
              f"step\n")
        cols = ("TP implementation", 22), ("phase", 8), ("calls", 5), ("KiB/layer", 9), \
            ("collectives per layer", 28), ("rest", 4), ("rest KiB", 9)
        print("| " + " | ".join(f"{c:<{w}}" for c, w in cols) + " |")
        print("|" + "|".join("-" * (w + 2) for _, w in cols) + "|")
        for name, (small, large) in results.items():
            for phase in ("forward", "backward"):
                print(_row(name, phase, small, large, layers))
        sb, tf = results["sbp"][1], results["transformers (DTensor)"][1]
        for phase in ("forward", "backward"):
            ok = sb[phase][0] <= tf[phase][0] and sb[phase][1] <= tf[phase][1]
            print(f"\n{phase}, 4 layers in all: sbp {sb[phase][0]} collectives, {sb[phase][1] / 1024:.1f} KiB; "
                  f"transformers {tf[phase][0]} collectives, {tf[phase][1] / 1024:.1f} KiB -> "
                  f"{'sbp not more' if ok else 'sbp MORE'}", end="")
        print()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--attn", choices=("eager", "sdpa"), default="eager", help="transformers' attention code")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, args), nprocs=N, start_method="spawn")


if __name__ == "__main__":
    main()
