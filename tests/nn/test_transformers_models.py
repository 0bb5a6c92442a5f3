"""transformers models, unchanged, with `sbp.nn.parallelize(model, mesh, "auto")`: Llama (GQA with fewer kv
heads than ranks), Qwen2 (q/k/v biases), GPT-NeoX (fused qkv weight) and Gemma3 (tied embeddings, per-head
q/k norms, sliding window) built from small configs (random weights, fixed seed, float64) match the
single-device model in loss, logits, every gradient and three AdamW steps, on (2,), (4,) and (2, 2) dp x tp;
greedy `generate()` gives the same tokens. Needs the `hf` extra (transformers)."""
from __future__ import annotations

import copy

import pytest
import torch

import sbp
import sbp.testing

transformers = pytest.importorskip("transformers")

# Gemma3RMSNorm computes in float32 (`x.float()`), also in a float64 model: its weights' gradients are
# float32 sums whose order differs between one rank and several, so Gemma3 is compared at float32 precision
TOL = {"llama": 1e-10, "llama_tied": 1e-10, "qwen2": 1e-10, "gpt_neox": 1e-10, "gemma3": 1e-5}
# transformers' causal-LM loss casts the logits to float32 (`logits.float()`) before the cross-entropy: the
# loss value is a float32 sum, whose order differs when the batch is split over a dp axis
LOSS_TOL = 1e-6
STEPS = 3


def build(name: str, attn: str = "eager") -> torch.nn.Module:
    """A small model of family `name` with random weights (seed 0), float64."""
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    torch.manual_seed(0)
    if name in ("llama", "llama_tied"):   # one kv head: fewer kv heads than ranks on every mesh here
        cfg = transformers.LlamaConfig(num_key_value_heads=1, tie_word_embeddings=name == "llama_tied", **common)
        cls = transformers.LlamaForCausalLM
    elif name == "qwen2":
        cfg, cls = transformers.Qwen2Config(num_key_value_heads=2, **common), transformers.Qwen2ForCausalLM
    elif name == "gpt_neox":
        cfg, cls = transformers.GPTNeoXConfig(**common), transformers.GPTNeoXForCausalLM
    elif name == "gemma3":
        cfg = transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=8, sliding_window=4, **common)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(name)
    cfg._attn_implementation = attn
    return cls(cfg).double()


def batch() -> torch.Tensor:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))


def train(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], dict]:
    """Losses and logits of STEPS AdamW steps, and the gradients of the first step (all as plain tensors)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    full = lambda t: t.full() if isinstance(t, sbp.GlobalTensor) else t
    out, grads = [], {}
    for step in range(STEPS):
        res = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        res.loss.backward()
        if step == 0:
            grads = {n: full(p.grad).detach() for n, p in model.named_parameters()}
            out.append(full(res.logits).detach())
        out.append(full(res.loss).detach())
        opt.step()
    params = {n: full(p).detach() for n, p in model.named_parameters()}
    return out, {"grad": grads, "param": params}


def max_diffs(single: torch.nn.Module, reference: tuple, mesh: sbp.DeviceMesh) -> dict[str, float]:
    """On every rank: the parallel copy of `single`'s largest differences from `reference` (its training on
    one device). Models are built before the threads start: ranks as threads share torch's global RNG."""
    ref_out, ref_state = reference
    model = sbp.nn.parallelize(copy.deepcopy(single), mesh, "auto")
    out, state = train(model, batch())
    diffs = {"logits": (out[0] - ref_out[0]).abs().max().item(),
             "loss": max(abs(a.item() - b.item()) for a, b in zip(out[1:], ref_out[1:]))}
    for kind in ("grad", "param"):
        assert state[kind].keys() == ref_state[kind].keys()
        diffs[kind] = max((state[kind][n] - ref_state[kind][n]).abs().max().item() for n in ref_state[kind])
    diffs["sharded"] = sum(any(not isinstance(p, sbp.Broadcast) for p in q.placements) for q in model.parameters())
    return diffs


def run(name: str, mesh_shape: tuple[int, ...], attn: str = "eager") -> list[dict[str, float]]:
    single = build(name, attn)
    reference = train(copy.deepcopy(single), batch())
    names = ("dp", "tp")[-len(mesh_shape):]
    return sbp.testing.spmd(lambda mesh: max_diffs(single, reference, mesh), mesh_shape, names=names)


def check(name: str, results: list[dict[str, float]]) -> None:
    for diffs in results:
        assert diffs["sharded"] > 0, "the auto plan sharded no parameter"
        tol = {k: LOSS_TOL if k == "loss" else TOL[name] for k in diffs}
        bad = {k: v for k, v in diffs.items() if k != "sharded" and not v <= tol[k]}
        assert not bad, (name, bad)


MODELS = ["llama", "qwen2", "gpt_neox", "gemma3"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_auto_plan_trains_like_one_device(name, mesh_shape):
    check(name, run(name, mesh_shape))


@pytest.mark.slow
@pytest.mark.parametrize("name,attn", [("llama", "sdpa"), ("llama_tied", "eager"), ("gemma3", "sdpa")])
def test_sdpa_and_tied_embeddings(name, attn):
    check(name, run(name, (4,), attn))


def test_llama_auto_plan_layouts():
    single = build("llama")

    def fn(mesh):
        model = sbp.nn.parallelize(copy.deepcopy(single), mesh, "auto")
        layer = model.model.layers[0]
        return {"embed": model.model.embed_tokens.weight.placements, "q": layer.self_attn.q_proj.weight.placements,
                "k": layer.self_attn.k_proj.weight.placements, "o": layer.self_attn.o_proj.weight.placements,
                "down": layer.mlp.down_proj.weight.placements, "lm_head": model.lm_head.weight.placements,
                "norm": model.model.norm.weight.placements,
                "logits": model(input_ids=batch()).logits.placements}
    S0, S1, B = (sbp.S(0),), (sbp.S(1),), (sbp.B,)
    for got in sbp.testing.spmd(fn, (2,)):
        assert got == {"embed": S0, "q": S0, "k": S0, "o": S1, "down": S1, "lm_head": S0, "norm": B, "logits": B}


def generate(single: torch.nn.Module, mesh: sbp.DeviceMesh) -> list[int]:
    model = sbp.nn.parallelize(copy.deepcopy(single), mesh, "auto")
    with torch.no_grad():
        got = model.generate(batch()[:1, :4], max_new_tokens=5, do_sample=False)
    got = got.full() if isinstance(got, sbp.GlobalTensor) else got
    return got[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_greedy_generate_gives_the_same_tokens(name):
    single = build(name)
    with torch.no_grad():
        ref = copy.deepcopy(single).generate(batch()[:1, :4], max_new_tokens=5, do_sample=False)[0].tolist()
    for got in sbp.testing.spmd(lambda mesh: generate(single, mesh), (4,)):
        assert len(got) == 9 and got == ref


def gloo_llama(mesh: sbp.DeviceMesh) -> dict[str, float]:
    single = build("llama")        # one process per rank: each builds the same model from the seed
    return max_diffs(single, train(copy.deepcopy(single), batch()), mesh)


@pytest.mark.gloo
def test_llama_on_gloo_processes():
    check("llama", sbp.testing.spmd(gloo_llama, (2,), backend="gloo"))
