"""Train a small Hugging Face Llama, unchanged, tensor-parallel with its own plan: `parallelize(model, mesh, "auto")`.

The model is `transformers.LlamaForCausalLM` built from a small config (grouped-query attention, random
weights from a fixed seed: nothing is downloaded); its config carries the tensor-parallel plan transformers
uses (q/k/v, gate/up "colwise", o/down "rowwise", the embedding "embedding_rowwise", the LM head
"colwise_gather_output"), and sbp applies it. The text is the corpus stored in examples/train_tp.py, read
character by character. Needs the hf extra: pip install -e ".[hf]".

    python examples/hf_llama.py                      # 4 gloo processes on 127.0.0.1, TP over 4 ranks
    python examples/hf_llama.py --mesh 2x2           # DP x TP: batch S(0) on dp, the plan on tp
    python examples/hf_llama.py --check              # also train on one process and compare
    torchrun --standalone --nproc-per-node 4 examples/hf_llama.py

Without torchrun's environment the script launches itself (train_tp.py's launcher: a free port, one
spawned process per rank). Rank 0 prints the loss per step with a text progress bar.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import train_tp  # examples/train_tp.py: the corpus, batches, progress bar and launching helpers


def build(vocab: int, args) -> torch.nn.Module:
    """A small LlamaForCausalLM, the same random weights on every rank (seeded), float32 or float64."""
    from transformers import LlamaConfig, LlamaForCausalLM  # the hf extra: imported where it is needed
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.dim, intermediate_size=2 * args.dim,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=args.block)
    cfg._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))


def train(model: torch.nn.Module, data: torch.Tensor, args, *, on_step=None) -> list[float]:
    """`args.steps` AdamW steps on windows of the corpus; the model shifts the labels itself."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step, (idx, _) in enumerate(train_tp.batches(data, args.batch, args.block, args.steps, args.seed)):
        t0 = time.perf_counter()
        loss = train_tp.scalar(model(input_ids=idx, labels=idx).loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], time.perf_counter() - t0)
    return losses


def worker(args) -> None:
    """One rank: build the model, parallelize it with its own plan, train, optionally check."""
    import sbp
    import sbp.nn

    torch.set_num_threads(1)
    shape = tuple(int(n) for n in args.mesh.lower().split("x"))
    names = ("dp", "tp")[-len(shape):]
    mesh = sbp.init_mesh(shape, names, device_type="cpu")
    data, vocab = train_tp.encode()
    model = sbp.nn.parallelize(build(vocab, args), mesh, "auto")
    rank0 = mesh.rank == 0
    if rank0:
        sharded = sum(any(not isinstance(p, sbp.Broadcast) for p in q.placements) for q in model.parameters())
        print(f"sbp + transformers: LlamaForCausalLM, mesh {shape} {names}, plan 'auto' "
              f"({sharded} sharded parameters), {args.steps} steps of batch {args.batch} x {args.block} chars",
              flush=True)
    t0 = time.perf_counter()
    losses = train(model, data, args, on_step=train_tp.progress(args.steps) if rank0 else None)
    if rank0:
        print(f"trained in {time.perf_counter() - t0:.1f} s; collectives on rank 0: "
              f"{len(mesh.binding.counters.calls)}", flush=True)
    if args.check:
        params = {name: p.full() for name, p in model.named_parameters()}  # every rank takes part
        if rank0:
            ref = build(vocab, args)
            train_tp.check_against_one_process(losses, params, train(ref, data, args), ref, args)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="4", help="mesh shape: '4' (TP) or '2x2' (DP x TP); default 4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="grouped-query attention: kv heads (default 2)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--attn", choices=("eager", "sdpa"), default="sdpa", help="transformers' attention code")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="also train on one process and compare")
    p.add_argument("--tol", type=float, default=1e-4)
    args = p.parse_args(argv)
    try:
        shape = [int(n) for n in args.mesh.lower().split("x")]
        if not shape or len(shape) > 2 or any(n <= 0 for n in shape):
            raise ValueError
    except ValueError:
        p.error(f"--mesh {args.mesh!r}: write it like '4' or '2x2'")
    try:
        import transformers  # noqa: F401
    except ImportError:
        p.error("transformers is not installed: pip install -e '.[hf]'")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    train_tp.launch(worker, args, math.prod(int(n) for n in args.mesh.lower().split("x")))


if __name__ == "__main__":
    main()
