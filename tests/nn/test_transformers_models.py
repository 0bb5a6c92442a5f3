"""transformers models, unchanged, with `sbp.nn.parallelize(model, mesh, "auto")`: Llama (GQA with fewer kv
heads than ranks), Qwen2 (q/k/v biases), GPT-NeoX (fused qkv weight) and Gemma3 (tied embeddings, per-head
q/k norms, sliding window) built from small configs (random weights, fixed seed, float64) match the
single-device model in loss, logits, every gradient and three AdamW steps, on (2,), (4,) and (2, 2) dp x tp;
greedy `generate()` gives the same tokens. Needs the `hf` extra (transformers)."""
from __future__ import annotations

import collections
import copy

import pytest
import torch

import sbp
import sbp.testing

transformers = pytest.importorskip("transformers")

# Gemma3RMSNorm computes in float32 (`x.float()`), also in a float64 model: its weights' gradients are
# float32 sums whose order differs between one rank and several, so Gemma3 is compared at float32 precision
TOL = {"llama": 1e-10, "llama_tied": 1e-10, "qwen2": 1e-10, "gpt_neox": 1e-10, "gemma3": 1e-5, "phi3": 1e-10}
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
    elif name == "phi3":   # fused qkv_proj and gate_up_proj weights
        cfg = transformers.Phi3Config(num_key_value_heads=2, pad_token_id=0, **common)
        cls = transformers.Phi3ForCausalLM
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


def max_diffs(single: torch.nn.Module, reference: tuple, mesh: sbp.DeviceMesh, plan="auto") -> dict[str, float]:
    """On every rank: the parallel copy of `single`'s largest differences from `reference` (its training on
    one device). Models are built before the threads start: ranks as threads share torch's global RNG.
    A packed parameter is held unfolded ((2, n, ...) for (2n, ...)): compared in the model's own shape."""
    ref_out, ref_state = reference
    model = sbp.nn.parallelize(copy.deepcopy(single), mesh, plan)
    out, state = train(model, batch())
    diffs = {"logits": (out[0] - ref_out[0]).abs().max().item(),
             "loss": max(abs(a.item() - b.item()) for a, b in zip(out[1:], ref_out[1:]))}
    for kind in ("grad", "param"):
        assert state[kind].keys() == ref_state[kind].keys()
        diffs[kind] = max((state[kind][n].reshape(ref.shape) - ref).abs().max().item()
                          for n, ref in ref_state[kind].items())
    diffs["sharded"] = sum(any(not isinstance(p, sbp.Broadcast) for p in q.placements) for q in model.parameters())
    return diffs


def run(name: str, mesh_shape: tuple[int, ...], attn: str = "eager", plan="auto") -> list[dict[str, float]]:
    single = build(name, attn)
    reference = train(copy.deepcopy(single), batch())
    names = ("dp", "tp")[-len(mesh_shape):]
    return sbp.testing.spmd(lambda mesh: max_diffs(single, reference, mesh, plan), mesh_shape, names=names)


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


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_trains_like_one_device(reentrant):
    # each decoder layer is recomputed in the backward, outside the root module's forward: its attention's
    # batched matmuls must keep their split heads there as in the forward (the saved tensors of the two runs
    # are matched by order), or the gradients come out wrong (non-reentrant: 1e-3 before the submodules' hooks;
    # reentrant checkpointing differentiates the recomputed graph itself, and was right)
    single = build("qwen2")
    single.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    reference = train(copy.deepcopy(single), batch())   # one device, checkpointed alike
    check("qwen2", sbp.testing.spmd(lambda mesh: max_diffs(single, reference, mesh), (2,)))


def packed_plan(model: torch.nn.Module) -> dict:
    """Phi-3's own plan with its fused MLP packed: ``gate_up_proj`` split per part (each rank its slice of gate
    and of up, so the model's own ``chunk(2, -1)`` splits the local output), ``down_proj`` rowwise on it."""
    plan = dict(sbp.nn.hf.auto_plan(model))
    plan.update({"model.layers.*.mlp.gate_up_proj": "packed_colwise", "model.layers.*.mlp.down_proj": "rowwise"})
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=str)
def test_packed_gate_up_trains_like_one_device(mesh_shape):
    check("phi3", run("phi3", mesh_shape, plan=packed_plan(build("phi3"))))


@pytest.mark.slow
def test_packed_gate_up_layout_and_collectives():
    """The packed weight is held unfolded (2, intermediate, hidden), S(1): each of 4 ranks holds 12 rows of
    gate and 12 of up; the MLP's forward costs the one all_reduce of down_proj, as transformers' packed TP."""
    single = build("phi3")
    plan = packed_plan(single)

    def fn(mesh):
        model = sbp.nn.parallelize(copy.deepcopy(single), mesh, plan)
        mlp = model.model.layers[0].mlp
        x = sbp.distribute(torch.randn(2, 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
                           mesh, "B")
        mesh.binding.counters.reset()
        y = mlp(x)
        calls = [c.collective for c in mesh.binding.counters.calls]
        ref = copy.deepcopy(single).model.layers[0].mlp(x.full())
        return (tuple(mlp.gate_up_proj.weight.shape), mlp.gate_up_proj.weight.placements,
                tuple(mlp.gate_up_proj.weight.local_shape), calls, (y.full() - ref).abs().max().item())
    for shape, pls, local, calls, diff in sbp.testing.spmd(fn, (4,)):
        assert (shape, pls, local) == ((2, 48, 32), (sbp.S(1),), (2, 12, 32))
        assert calls == ["all_reduce"] and diff < 1e-12


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


def _count(layers: int, attn: str, mesh: sbp.DeviceMesh) -> dict[str, list[str]]:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = sbp.nn.parallelize(transformers.LlamaForCausalLM(cfg).double(), mesh, "auto")
    counters, out = mesh.binding.counters, {}
    counters.reset()
    loss = model(input_ids=batch(), labels=batch()).loss
    out["forward"] = sorted(c.collective for c in counters.calls)
    counters.reset()
    loss.backward()
    out["backward"] = sorted(c.collective for c in counters.calls)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_layer_costs_two_all_reduces(attn):
    """Per decoder layer (a 2-layer model minus a 1-layer one), heads split on 2 ranks with grouped kv heads:
    the attention core (eager's 4-d matmuls, sdpa with enable_gqa) runs on the split heads, so forward and
    backward each cost the two all_reduces of o_proj and down_proj (Megatron's layout), nothing else."""
    def fn(mesh):
        one, two = _count(1, attn, mesh), _count(2, attn, mesh)
        return {phase: sorted((collections.Counter(two[phase]) - collections.Counter(one[phase])).elements())
                for phase in one}
    for per_layer in sbp.testing.spmd(fn, (2,)):
        assert per_layer == {"forward": ["all_reduce"] * 2, "backward": ["all_reduce"] * 2}, per_layer
