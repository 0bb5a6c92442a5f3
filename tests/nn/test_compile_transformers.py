"""torch.compile on transformers models parallelized with ``sbp.nn.parallelize(model, mesh, "auto")``: each
decoder layer compiled (as torchtitan compiles its blocks), or the whole model with the loss computed from the
logits inside the compiled function. Zero graph breaks; loss and every gradient equal the eager parallel
model's. Needs the `hf` extra (transformers); gloo (compiled collectives need process groups).

Worker functions are module-level (they travel pickled to the shared gloo pool)."""
from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import sbp
import sbp.testing

transformers = pytest.importorskip("transformers")
from tests.nn.test_transformers_models import batch, build  # noqa: E402
from tests.runtime.test_compile import EAGER_TO_FUNCOL, GraphRecorder  # noqa: E402

spmd = functools.partial(sbp.testing.spmd, backend="gloo", timeout=600)
pytestmark = [pytest.mark.gloo, pytest.mark.slow]
TOL = 1e-10


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full() if isinstance(t, sbp.GlobalTensor) else t


def _shifted_loss(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def run_compiled(name, how, mesh):
    """Two training steps' loss differences (compiled vs eager parallel model), the largest gradient
    difference, the graphs compiled and the graph breaks; for the whole model also the forward and
    backward graphs' collectives and the eager step's (as functional-collective names)."""
    single, ids = build(name), batch()
    if how.endswith("-checkpointed"):   # every decoder layer recomputed in the backward
        single.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        how = how.removesuffix("-checkpointed")
    eager, compiled = (sbp.nn.parallelize(copy.deepcopy(single), mesh, "auto") for _ in range(2))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rec = GraphRecorder()
    if how == "layers":   # use_cache=False: a cache's keys and values are outputs no loss reaches (see docs)
        for layer in compiled.model.layers:
            layer.compile(backend="aot_eager")
        run = {id(m): (lambda m=m: m(input_ids=ids, labels=ids, use_cache=False).loss) for m in (eager, compiled)}
    else:   # "loose": the whole model without fullgraph (graph breaks allowed)
        whole = torch.compile(_shifted_loss, backend=rec.backend, fullgraph=how == "whole")
        run = {id(eager): lambda: _shifted_loss(eager, ids), id(compiled): lambda: whole(compiled, ids)}
    diffs, eager_calls = [], []
    for _ in range(2):
        mesh.binding.counters.reset()
        want = run[id(eager)]()
        eager_calls.append(_funcol_names(mesh.binding.counters.calls))
        mesh.binding.counters.reset()
        want.backward()
        eager_calls.append(_funcol_names(mesh.binding.counters.calls))
        got = run[id(compiled)]()
        got.backward()
        diffs.append((_full(want) - _full(got)).abs().item())
    grads = max((_full(p.grad) - _full(q.grad)).abs().max().item()
                for p, q in zip(eager.parameters(), compiled.parameters()) if p.grad is not None)
    counters = torch._dynamo.utils.counters
    traced = [dict(rec.collectives(i)) for i in range(len(rec.graphs))]
    for found in traced:
        found.pop("wait_tensor", None)
    return (max(diffs), grads, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
            (traced, eager_calls[2:]))


def _funcol_names(calls) -> dict:
    return dict(collections.Counter(EAGER_TO_FUNCOL[c.collective] for c in calls))


@pytest.mark.parametrize("name, how, graphs", [("llama", "layers", 2), ("qwen2", "layers", 2),
                                               ("llama", "whole", 1), ("qwen2", "whole-checkpointed", 1)])
def test_transformers_model_compiles_without_graph_breaks(name, how, graphs) -> None:
    # per layer: fails without SplitBatchMatmul's opaque call under compile (attention's matmul read the
    # placements of a tensor made in the graph: 8 graph breaks); whole: fails without logical_strides' copy
    # case (the shifted logits' reshape). The whole model's forward and backward graphs hold the eager
    # step's collectives: fails when the split-heads matmul mode is off under compile (attention's batched
    # matmuls then fold split heads into the batch: 6 + 14 all_to_alls for eager's 2 + 2). Checkpointed: every
    # decoder layer is one higher order op to dynamo, which refuses a change of outside state inside it (the
    # rowwise layers' parameter swap before: sbp.nn.parallelize's compiled rowwise forward); the split-heads
    # mode enters that op again (without: forward 8 all_to_alls more, backward 16 all_to_alls, 8 all_gathers
    # and 6 reduce_scatters more than eager's 7 all_reduces)
    if how.endswith("-checkpointed"):
        _skip_unless_one_device_compiles_checkpointed(name)
    for rank, (loss_diff, grad_diff, made, breaks, (traced, eager)) in enumerate(
            spmd(functools.partial(run_compiled, name, how), (2,))):
        assert loss_diff <= TOL and grad_diff <= TOL, (rank, loss_diff, grad_diff)
        assert breaks == 0 and made == graphs, (rank, made, breaks)
        if how.startswith("whole"):
            assert traced == eager, (rank, traced, eager)


def test_checkpointed_transformers_model_with_graph_breaks_trains_as_eager() -> None:
    # transformers 5.25 with the `kernels` package breaks the graph inside each checkpointed decoder layer (see
    # above); the layers then run eagerly on the compiled forward's parameter twins and are recomputed on the
    # leaves in the backward. Before: "Recomputed values ... have different metadata" (a rowwise layer took
    # the twin's global path and the leaf's local one). Without `kernels` there is no break, and this is the
    # fullgraph case above
    for rank, (loss_diff, grad_diff, _, _, _) in enumerate(
            spmd(functools.partial(run_compiled, "qwen2", "loose-checkpointed"), (2,))):
        assert loss_diff <= TOL and grad_diff <= TOL, (rank, loss_diff, grad_diff)


def _skip_unless_one_device_compiles_checkpointed(name: str) -> None:
    """Skip when the single-device model itself does not compile with its layers checkpointed: transformers
    5.25 with the `kernels` package wraps attention in a forward that sets a context variable, which dynamo
    refuses inside the checkpoint region (`HOP: Unsafe side effect`), sbp or not."""
    single = build(name)
    single.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch._dynamo.reset()
    try:
        torch.compile(_shifted_loss, backend="aot_eager", fullgraph=True)(single, batch())
    except torch._dynamo.exc.Unsupported as e:
        pytest.skip(f"the single-device {name} does not compile checkpointed here: {str(e).splitlines()[0]}")
    finally:
        torch._dynamo.reset()


def run_compiled_dynamic(name, mesh):
    """The whole model compiled with dynamic=True over five (batch, sequence) shapes, with sdpa attention:
    the largest loss and gradient differences from the eager parallel model, the graphs and graph breaks."""
    single = build(name, "sdpa")
    eager, compiled = (sbp.nn.parallelize(copy.deepcopy(single), mesh, "auto") for _ in range(2))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    whole = torch.compile(_shifted_loss, backend="aot_eager", fullgraph=True, dynamic=True)
    loss_diff = grad_diff = 0.0
    for b, t in ((2, 8), (4, 8), (3, 8), (2, 10), (4, 12)):
        ids = torch.randint(0, single.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(b * t))
        want, got = _shifted_loss(eager, ids), whole(compiled, ids)
        want.backward()
        got.backward()
        loss_diff = max(loss_diff, (_full(want) - _full(got)).abs().item())
        pairs = [(p.grad, q.grad) for p, q in zip(eager.parameters(), compiled.parameters()) if p.grad is not None]
        grad_diff = max([grad_diff] + [(_full(g) - _full(h)).abs().max().item() for g, h in pairs])
        eager.zero_grad(), compiled.zero_grad()
    counters = torch._dynamo.utils.counters
    return loss_diff, grad_diff, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_transformers_model_compiles_one_graph_for_every_batch_and_sequence_length() -> None:
    # dynamic=True: the batch and the sequence length stay symbolic through the whole model (the shift
    # logits[:, :-1] and ids[:, 1:], rotary slices, the causal mask). Before, the RMS norm's epsilon (a
    # symbolic float under dynamic=True) failed ("unsupported operand type(s) for +: 'GlobalTensor' and
    # 'SymFloat'"); the other families (qwen2, gpt_neox, phi3, gemma3) also compile one graph (checked by hand)
    for rank, (loss_diff, grad_diff, made, breaks) in enumerate(spmd(functools.partial(run_compiled_dynamic, "llama"),
                                                                    (2,))):
        assert loss_diff <= TOL and grad_diff <= TOL, (rank, loss_diff, grad_diff)
        assert breaks == 0 and made == 1, (rank, made, breaks)
