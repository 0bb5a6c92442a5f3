"""torch.compile of `sbp.nn.parallelize`d transformers: the embedding, colwise / rowwise and sequence-parallel
styles train with forward and loss as one ``fullgraph=True`` graph (its backward compiled from it) that
matches eager to float64 rounding (1e-10) on 1-d and 2-d meshes, even and uneven shapes, and compiles once
for fixed shapes, also when the batch size changes (``dynamic=True``: the batch stays symbolic, see
docs/compile.md); with ``torch.compile(opt.step)``; and as a whole step under compiled autograd.

The backend is ``aot_eager``: AOTAutograd traces sbp's ops and the planner's collectives (as torch's
functional collectives, `sbp.runtime.traced`), the part that must be right; inductor's code generation
is tested once in tests/runtime/test_compile.py (it costs tens of seconds per graph on two cores).
Worker functions are module-level (they travel pickled to the shared gloo pool).
"""
from __future__ import annotations

import collections
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import sbp
import sbp.nn
import sbp.testing
from sbp.nn import Colwise, Embedding, Rowwise, SequenceParallel
from tests.runtime.test_compile import EAGER_TO_FUNCOL, GraphRecorder

spmd = functools.partial(sbp.testing.spmd, backend="gloo", timeout=300)
pytestmark = [pytest.mark.gloo, pytest.mark.slow]
TOL = 1e-10


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)      # plain local heads under the plan below
        b, t = q.shape[:2]
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        y = att.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))   # a non-contiguous local, reshaped


class TinyGPT(nn.Module):
    """Embedding, position table (left out of the plans: Broadcast), one pre-norm block (attention, GELU MLP),
    final norm, LM head, cross-entropy."""

    def __init__(self, vocab: int = 13, dim: int = 8, heads: int = 4, block: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + self.attn(self.ln1(x))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class CheckpointedGPT(TinyGPT):
    """TinyGPT with its attention and MLP recomputed in the backward (activation checkpointing, non-reentrant,
    as training scripts wrap each block)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + checkpoint(lambda h: self.attn(self.ln1(h)), x, use_reentrant=False)
        x = x + checkpoint(lambda h: self.out(F.gelu(self.fc(self.ln2(h)))), x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class BrokenCheckpointedGPT(TinyGPT):
    """CheckpointedGPT whose MLP region breaks dynamo's graph (as transformers' attention wrapper does with the
    `kernels` package): the region then runs eagerly in the forward and again in the backward."""

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return self.out(F.gelu(self.fc(self.ln2(h))))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + checkpoint(lambda h: self.attn(self.ln1(h)), x, use_reentrant=False)
        x = x + checkpoint(self.mlp, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def plan(sequence_parallel: bool) -> dict:
    """Megatron's layout (vocab-parallel embedding, colwise q/k/v/fc, rowwise proj/out); with sequence
    parallelism the residual stream is S(1) and each norm gathers it once."""
    p = {"wte": "embedding", "attn.[qkv]": Colwise(use_local_output=True), "attn.proj": Rowwise(local_input=True),
         "fc": "colwise", "out": "rowwise", "head": Colwise(output_placement="B")}
    if sequence_parallel:
        p |= {"wte": Embedding(output_placement="S(1)"), "ln[12]": SequenceParallel(output_placement="B"),
              "ln_f": SequenceParallel(output_placement="B"),
              "attn.proj": Rowwise(local_input=True, output_placement="S(1)"), "out": Rowwise(output_placement="S(1)")}
    return p


def _batch(step: int, batch: int, seq: int, vocab: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def _parallel_pair(mesh, sequence_parallel: bool, model_class: type = TinyGPT):
    torch.manual_seed(0)
    model = model_class().double()
    return [sbp.nn.parallelize(copy.deepcopy(model), mesh, plan(sequence_parallel)) for _ in range(2)]


def run_training(sequence_parallel, batch, seq, steps, mesh, model_class=TinyGPT, fullgraph=True):
    """The same parallelized model trained eagerly and compiled (aot_eager, `fullgraph`): per step the loss
    difference, the largest parameter difference at the end, and the graphs dynamo compiled."""
    eager, compiled = _parallel_pair(mesh, sequence_parallel, model_class)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses = []
    for m, compile_it in ((eager, False), (compiled, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        def loss_of(idx, targets, m=m):
            return m(idx, targets).full()
        f = torch.compile(loss_of, backend="aot_eager", fullgraph=fullgraph) if compile_it else loss_of
        run = []
        for i in range(steps):
            loss = f(*_batch(i, batch, seq))
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.detach())
        losses.append(torch.stack(run))
    param_diff = max((a.full() - b.full()).abs().max().item()
                     for a, b in zip(eager.parameters(), compiled.parameters()))
    return ((losses[0] - losses[1]).abs().max().item(), param_diff,
            torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("mesh_shape, batch, seq, sequence_parallel",
                         [((2,), 3, 7, True), ((2, 2), 4, 6, True), ((2, 2), 3, 5, False)],
                         ids=["1d-uneven-sp", "2d-even-sp", "2d-uneven-tp"])
def test_parallelized_transformer_trains_compiled_as_eager(mesh_shape, batch, seq, sequence_parallel) -> None:
    # uneven: the vocabulary (13 rows of the embedding and LM head) always; sequence 7 on the sequence-
    # parallel S(1) of (2,); batch 3 on the dp axis of (2, 2). 1-d even TP without sequence parallelism:
    # the batch-size test below (and the MLP of tests/runtime/test_compile.py)
    fn = functools.partial(run_training, sequence_parallel, batch, seq, 3)
    for rank, (loss_diff, param_diff, graphs) in enumerate(spmd(fn, mesh_shape)):
        assert loss_diff <= TOL and param_diff <= TOL, (rank, loss_diff, param_diff)
        assert graphs == 1, f"rank {rank}: {graphs} graphs for 3 steps of one shape (recompiled)"


@pytest.mark.parametrize("mesh_shape, sequence_parallel", [((2,), False), ((2, 2), True)], ids=["1d-tp", "2d-sp"])
def test_checkpointed_blocks_compile_fullgraph_and_train_as_eager(mesh_shape, sequence_parallel) -> None:
    # activation checkpointing is one higher order op to dynamo, which refuses a change of state made outside
    # it: the rowwise layers (attn.proj, out; with and without local input) compile in a forward of their own
    fn = functools.partial(run_training, sequence_parallel, 4, 6, 2, model_class=CheckpointedGPT)
    for rank, (loss_diff, param_diff, graphs) in enumerate(spmd(fn, mesh_shape)):
        assert loss_diff <= TOL and param_diff <= TOL, (rank, loss_diff, param_diff)
        assert graphs == 1, f"rank {rank}: {graphs} graphs for 2 steps of one shape (recompiled)"


def test_graph_break_in_a_checkpointed_block_trains_as_eager() -> None:
    # after the break the region runs eagerly on the compiled forward's parameter twins, and is recomputed in
    # the backward on the leaves: a rowwise layer takes a twin's local block as its leaf's (before: the twin
    # went the global way, the recomputation the local one, and checkpointing refused the differing tensors)
    fn = functools.partial(run_training, True, 4, 6, 2, model_class=BrokenCheckpointedGPT, fullgraph=False)
    for rank, (loss_diff, param_diff, _) in enumerate(spmd(fn, (2, 2))):
        assert loss_diff <= TOL and param_diff <= TOL, (rank, loss_diff, param_diff)


def run_checkpointed_global_attention(mesh):
    """CheckpointedGPT with attention on global tensors (q / k / v colwise with split heads, the "auto" plan's
    attention) trained eagerly and compiled (one graph for forward and loss): loss and gradient differences,
    and the forward and backward graphs' collectives against the eager step's."""
    torch.manual_seed(0)
    model = CheckpointedGPT().double()
    p = {"wte": "embedding", "attn.[qkv]": "colwise", "attn.proj": "rowwise", "fc": "colwise", "out": "rowwise",
         "head": Colwise(output_placement="B")}
    eager, compiled = (sbp.nn.parallelize(copy.deepcopy(model), mesh, p) for _ in range(2))
    torch._dynamo.reset()
    rec = GraphRecorder()
    f = torch.compile(lambda i, t: compiled(i, t).full(), backend=rec.backend, fullgraph=True)
    idx, targets = _batch(0, 4, 6)
    mesh.binding.counters.reset()
    want = eager(idx, targets).full()
    eager_calls = [_funcol_names(mesh.binding.counters.calls)]
    mesh.binding.counters.reset()
    want.backward()
    eager_calls.append(_funcol_names(mesh.binding.counters.calls))
    got = f(idx, targets)
    got.backward()
    grads = max((a.grad.full() - b.grad.full()).abs().max().item()
                for a, b in zip(eager.parameters(), compiled.parameters()))
    traced = [dict(rec.collectives(i)) for i in range(len(rec.graphs))]
    for found in traced:
        found.pop("wait_tensor", None)
    return abs(got.item() - want.item()), grads, traced, eager_calls


def _funcol_names(calls) -> dict:
    return dict(collections.Counter(EAGER_TO_FUNCOL[c.collective] for c in calls))


def test_checkpointed_global_attention_compiles_to_eager_collectives() -> None:
    # dynamo hands the checkpointed region to the modes on the stack as one op, whose handler runs with the
    # mode popped: without sbp's split-heads mode entering the region again, attention's batched matmuls fold
    # the split heads into the batch (forward 4 all_to_alls more than eager's 3 all_reduces + 1 all_gather; the
    # backward 5 all_to_alls, 4 all_gathers and 6 reduce_scatters where eager runs 3 all_reduces)
    for rank, (loss_diff, grad_diff, traced, eager) in enumerate(spmd(run_checkpointed_global_attention, (2,))):
        assert loss_diff <= TOL and grad_diff <= TOL, (rank, loss_diff, grad_diff)
        assert traced == eager, (rank, traced, eager)


def run_batch_change(sequence_parallel, sizes, mesh):
    """Compiled (``dynamic=True``) training steps with batch sizes `sizes`: graphs compiled, and the
    largest loss and gradient differences against eager."""
    eager, compiled = _parallel_pair(mesh, sequence_parallel)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    f = torch.compile(lambda i, t: compiled(i, t).full(), backend="aot_eager", fullgraph=True, dynamic=True)
    diffs = []
    for step, batch in enumerate(sizes):
        idx, targets = _batch(step, batch, 6)
        want, got = eager(idx, targets).full(), f(idx, targets)
        got.backward()
        want.backward()
        diffs.append(abs(got.item() - want.item()))
    grads = max((a.grad.full() - b.grad.full()).abs().max().item()
                for a, b in zip(eager.parameters(), compiled.parameters()))
    return torch._dynamo.utils.counters["stats"]["unique_graphs"], max(diffs), grads


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_batch_size_change_does_not_recompile(sequence_parallel) -> None:
    # no placement splits the batch on a tp mesh (sequence parallel splits the sequence): it stays symbolic
    # (sbp.runtime.symbolic), and one graph serves every batch size
    fn = functools.partial(run_batch_change, sequence_parallel, (4, 4, 6, 3, 5))
    for rank, (graphs, loss_diff, grad_diff) in enumerate(spmd(fn, (2,))):
        assert loss_diff <= TOL and grad_diff <= TOL, (rank, loss_diff, grad_diff)
        assert graphs == 1, f"rank {rank}: {graphs} graphs for batch sizes 4, 4, 6, 3, 5"


def test_a_local_batch_length_an_earlier_graph_recorded_is_not_reused() -> None:
    # (2, 2) with sequence parallelism: the attention's local heads come back through `_global_shape`, which
    # looks up the global batch by the local one. A batch of 2 leaves dp coord 1 one row and records 1 -> 2;
    # the batch of 3 gives it one row again, recorded as the expression s0 // 2, and the lookup of 1 found
    # the stale 1 -> 2 first (a ShapeError: "broadcast a dimension of length 2"). The newest record wins now
    fn = functools.partial(run_batch_change, True, (4, 2, 3))
    for rank, (graphs, loss_diff, grad_diff) in enumerate(spmd(fn, (2, 2))):
        assert loss_diff <= TOL and grad_diff <= TOL, (rank, loss_diff, grad_diff)
        assert graphs <= 3, f"rank {rank}: {graphs} graphs for batch sizes 4, 2, 3"


def test_batch_split_on_dp_stays_symbolic_for_sizes_of_one_remainder() -> None:
    # (2, 2): the dp axis splits the batch. Its size stays symbolic, its remainder by the 2 pieces is pinned:
    # even sizes share one graph, odd sizes another. An odd batch's pieces (3 and 2 of 5) are not where the
    # flattened (batch x seq) rows' split puts them: the view moves the rows between, with sizes symbolic in
    # the batch (sbp.runtime.rows; each odd size compiled for its value before). Batch 3 gives one rank a
    # batch of 1 on the ranks of dp coord 1 (ranks 2 and 3), a size torch pins (any size-1 dim could
    # broadcast): a graph of its own there, whose local inputs still find their global batch length
    # (sbp.runtime.symbolic.SizeMap; it raised before). Every step equals eager
    fn = functools.partial(run_batch_change, True, (4, 6, 8, 5, 7, 9, 3))
    for rank, (graphs, loss_diff, grad_diff) in enumerate(spmd(fn, (2, 2))):
        assert loss_diff <= TOL and grad_diff <= TOL, (rank, loss_diff, grad_diff)
        want = 2 if rank < 2 else 3
        assert graphs == want, f"rank {rank}: {graphs} graphs for batch sizes 4, 6, 8 (one), 5, 7, 9 (one), 3"


def run_step_collectives(mesh):
    """Per plan (tp, sequence parallel): the functional collectives in the compiled forward and backward
    graphs of one training step, and the collectives run eagerly during its backward (the leaf hooks)."""
    out = {}
    for sequence_parallel in (False, True):
        model = _parallel_pair(mesh, sequence_parallel)[1]
        recorder = GraphRecorder()
        torch._dynamo.reset()
        f = torch.compile(lambda i, t, m=model: m(i, t).full(), backend=recorder.backend, fullgraph=True)
        loss = f(*_batch(0, 4, 6))
        mesh.binding.counters.reset()
        loss.backward()
        eager = collections.Counter(c.collective for c in mesh.binding.counters.calls)
        fw, bw = (dict(recorder.collectives(k)) for k in (0, 1))
        out[sequence_parallel] = fw, bw, dict(eager), _reduced_producers(recorder.graphs[0])
    return out


_VIEWS = ("view", "_unsafe_view", "reshape", "clone", "contiguous", "alias")


def _reduced_producers(gm: torch.fx.GraphModule) -> list[str]:
    """The op computing each all_reduce's input in a graph, looking through views and copies (``mm``: the
    reduction takes the matmul's partial sums as they are)."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional.all_reduce"):
            src = node.args[0]
            while src.op == "call_function" and str(src.target).split(".")[1] in _VIEWS:
                src = src.args[0]
            out.append(str(src.target).split(".")[1] if src.op == "call_function" else src.op)
    return out


def test_compiled_step_holds_every_collective_of_the_plan() -> None:
    # Forward: one reduction per rowwise module and per embedding (all_reduce, or reduce_scatter under sequence
    # parallelism: the rowwise linear computes its partial sums locally, never moving its input to the batch
    # split), the LM head's gather. Backward: the gradient reductions of the colwise inputs (q/k/v share one)
    # and, under sequence parallelism, the layer norms' P(sum) parameter gradients (the leaf rule, run
    # in the compiled backward through sbp.tensor.autograd.leaf_grad). Nothing is left to the leaf hooks, and
    # the position table (Broadcast, looked up on its local table) adds none: no gather of its gradient's rows.
    # A rowwise linear's all_reduce takes the matmul's partial sums as they are: its bias is added to the reduced
    # output (fused into the next elementwise op), not to the partial sums in a pass of its own.
    for rank, got in enumerate(spmd(run_step_collectives, (2,))):
        fw, bw, eager, producers = got[False]
        assert fw == {"all_reduce": 3, "all_gather_into_tensor": 1, "wait_tensor": 4}, (rank, fw)
        assert bw == {"all_reduce": 3, "wait_tensor": 3}, (rank, bw)
        assert eager == {}, (rank, eager)
        assert producers.count("mm") == 2, (rank, producers)   # attn.proj and out
        fw, bw, eager, _ = got[True]
        assert "all_to_all_single" not in fw and fw.get("reduce_scatter_tensor") == 3, (rank, fw)
        assert "all_reduce" in bw, (rank, bw)
        assert eager == {}, (rank, eager)


def run_replicated_embedding(mesh):
    """Eager: the parallelized TinyGPT's loss and every parameter's gradient against the one-process model's,
    and the collectives of its backward."""
    torch.manual_seed(0)
    ref = TinyGPT().double()
    model = sbp.nn.parallelize(copy.deepcopy(ref), mesh, plan(False))
    idx, targets = _batch(0, 4, 6)
    want = ref(idx, targets)
    want.backward()
    got = model(idx, targets).full()
    mesh.binding.counters.reset()
    got.backward()
    calls = collections.Counter(c.collective for c in mesh.binding.counters.calls)
    grads = dict(ref.named_parameters())
    grad_diff = max((p.grad.full() - grads[name].grad).abs().max().item() for name, p in model.named_parameters())
    return abs(got.item() - want.item()), grad_diff, dict(calls)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["tp", "dp-tp"])
def test_broadcast_embedding_looks_up_its_local_table(mesh_shape) -> None:
    # the position table is left out of the plan: its lookup runs on the local table, so its gradient is
    # whole on every rank (not split by rows and gathered back by the leaf rule). On (2,): one all_reduce per
    # colwise input and nothing else; on (2, 2) the dp axis adds gradient reductions, no gather
    for rank, (loss_diff, grad_diff, calls) in enumerate(spmd(run_replicated_embedding, mesh_shape)):
        assert loss_diff <= TOL and grad_diff <= TOL, (rank, loss_diff, grad_diff)
        assert "all_gather" not in calls, (rank, calls)
        if mesh_shape == (2,):
            assert calls == {"all_reduce": 3}, (rank, calls)


def run_bucketed_replicated_embedding(mesh):
    """Eager, dp gradients bucketed (one bucket: every gradient fits): gradients against one process, and
    the collectives per mesh axis of backward and the gradients' reduction (read as `.grad`)."""
    torch.manual_seed(0)
    ref = TinyGPT().double()
    model = sbp.nn.parallelize(copy.deepcopy(ref), mesh, plan(False), dp_bucket_bytes=1 << 30)
    idx, targets = _batch(0, 4, 6)
    ref(idx, targets).backward()
    got = model(idx, targets).full()
    mesh.binding.counters.reset()
    got.backward()
    grads = {name: p.grad.to_local() for name, p in model.named_parameters()}   # waits for the bucket
    calls = collections.Counter((c.collective, c.axes) for c in mesh.binding.counters.calls)
    want = dict(ref.named_parameters())
    grad_diff = max((p.grad.full() - want[name].grad).abs().max().item() for name, p in model.named_parameters())
    return grad_diff, dict(calls), len(grads)


def test_broadcast_embedding_gradient_stays_partial_on_dp() -> None:
    # the position table's lookup runs on its local table; the batch is split on dp, so its output's gradient
    # is a sum over the ranks' shares: it stays P(sum) on dp into the table's gradient, which the dp buckets
    # reduce with the others: the bucket's all_reduce is the only one on dp (the output's gradient had its own)
    for rank, (grad_diff, calls, _) in enumerate(spmd(run_bucketed_replicated_embedding, (2, 2))):
        assert grad_diff <= TOL, (rank, grad_diff)
        assert calls == {("all_reduce", (1,)): 3, ("all_reduce", (0,)): 1}, (rank, calls)


class _Broken(nn.Module):
    """A forward with a graph break and a data-dependent Python float in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x)))
        torch._dynamo.graph_break()
        scale = 1 + 0 * h.sum().item()
        return self.c(h * scale)


def run_parallelized_with_graph_breaks(mesh):
    torch.manual_seed(0)
    base = _Broken().double()
    layout = {"a": "colwise", "b": "rowwise", "c": "colwise"}
    eager, compiled = (sbp.nn.parallelize(copy.deepcopy(base), mesh, layout) for _ in range(2))
    torch._dynamo.reset()
    f = torch.compile(compiled, backend="aot_eager")
    diffs = []
    for step in range(3):
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        want, got = eager(x).full(), f(x).full()
        want.square().sum().backward()
        got.square().sum().backward()
        diffs.append((want - got).abs().max().item())
    grads = max((p.grad.full() - q.grad.full()).abs().max().item()
                for p, q in zip(eager.parameters(), compiled.parameters()))
    return max(diffs), grads


def test_parallelized_model_with_graph_breaks_compiles_as_eager() -> None:
    # without fullgraph the parallelized module's forward breaks into graphs around the break and the
    # .item(); the hooks and ops between them run eagerly. Outputs and gradients equal eager
    for rank, (out_diff, grad_diff) in enumerate(spmd(run_parallelized_with_graph_breaks, (2,))):
        assert out_diff <= TOL and grad_diff <= TOL, (rank, out_diff, grad_diff)



def run_compiled_optimizer_step(optimizer, mesh):
    """Forward and loss compiled (fullgraph), ``torch.compile(opt.step)``: the parallelized model's loss and
    parameters after 4 steps against the one-process model trained with the same compiled optimizer, the
    functional collectives in the optimizer's graphs, and whether steps 3 and 4 compiled anything new."""
    torch.manual_seed(0)
    ref = TinyGPT().double()
    model = sbp.nn.parallelize(copy.deepcopy(ref), mesh, plan(False))
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01)}[optimizer]
    torch._dynamo.reset()
    recorder = GraphRecorder()
    losses, graphs = [], []
    for m, full in ((ref, lambda t: t), (model, lambda t: t.full())):
        opt = make(m.parameters())
        loss_of = torch.compile(lambda i, t, m=m, full=full: full(m(i, t)), backend="aot_eager", fullgraph=True)
        step = torch.compile(opt.step, backend=recorder.backend)
        run = []
        for i in range(4):
            loss = loss_of(*_batch(i, 4, 6))
            loss.backward()
            step()
            opt.zero_grad()
            run.append(loss.detach())
            graphs.append(len(recorder.graphs))
        losses.append(torch.stack(run))
    want = dict(ref.named_parameters())
    param_diff = max((p.full() - want[name]).abs().max().item() for name, p in model.named_parameters())
    sbp_graphs = range(graphs[3], len(recorder.graphs))   # the parallelized model's optimizer graphs
    return ((losses[0] - losses[1]).abs().max().item(), param_diff, len(sbp_graphs),
            sum(sum(recorder.collectives(i).values()) for i in sbp_graphs),
            graphs[5] == graphs[7])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_compiled_optimizer_step_trains_as_one_process(optimizer) -> None:
    # torch.compile(opt.step) over global parameters: each update runs on the locals, no collective in the
    # optimizer's graphs, and after the first two steps (SGD's momentum buffers appear at step 1) nothing
    # compiles again. The reference is the same model in one process with the same compiled optimizer
    # (torch's compiled AdamW rounds its step count in float32: compared compiled to compiled)
    for rank, (loss_diff, param_diff, graphs, collectives, settled) in enumerate(
            spmd(functools.partial(run_compiled_optimizer_step, optimizer), (2,))):
        assert loss_diff <= TOL and param_diff <= TOL, (rank, loss_diff, param_diff)
        assert graphs >= 1 and collectives == 0, (rank, graphs, collectives)
        assert settled, f"rank {rank}: the optimizer step compiled again at step 3 or 4"


def _whole_step(m, compile_it: bool, **compile_kwargs):
    """`m`'s training step with SGD (momentum 0.9): forward, ``loss.backward()``, ``opt.step()``,
    ``opt.zero_grad()``; returns the detached loss. Compiled with compiled autograd on when `compile_it`."""
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    def train(idx, targets):
        loss = m(idx, targets).full()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    if not compile_it:
        return train
    with torch._dynamo.config.patch(compiled_autograd=True):   # torch.compile reads it here
        return torch.compile(train, backend="aot_eager", **compile_kwargs)


def run_compiled_autograd_step(sequence_parallel, mesh):
    """A whole training step (forward, ``loss.backward()``, ``opt.step()``, ``opt.zero_grad()``) compiled with
    compiled autograd on: loss and parameters against eager after 4 steps, the graph breaks dynamo counted
    (by reason), graphs compiled in steps 3 and 4, and the eager collectives those two steps ran."""
    eager, compiled = _parallel_pair(mesh, sequence_parallel)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses, per_step, eager_calls = [], [], []
    for m, compile_it in ((eager, False), (compiled, True)):
        f = _whole_step(m, compile_it)
        run = []
        for i in range(4):
            mesh.binding.counters.reset()
            run.append(f(*_batch(i, 4, 6)))
            if compile_it:
                per_step.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
                eager_calls.append(len(mesh.binding.counters.calls))
        losses.append(torch.stack(run))
    param_diff = max((a.full() - b.full()).abs().max().item()
                     for a, b in zip(eager.parameters(), compiled.parameters()))
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return ((losses[0] - losses[1]).abs().max().item(), param_diff, breaks, per_step[3] - per_step[1],
            eager_calls[2:], torch._dynamo.utils.counters["compiled_autograd"]["captures"])


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_compiled_autograd_trains_as_eager(sequence_parallel) -> None:
    # compiled autograd (torch._dynamo.config.compiled_autograd) traces the backward with sbp's leaf hooks
    # (one opaque traced call each: dynamo cannot read placements off a gradient made in its graph) and the
    # optimizer step. Fails without them: `GlobalTensor.__new__` compiled as a frame of its own under the
    # capture, then graph breaks in every hook. The only graph breaks left are torch's own (Tensor.backward,
    # the optimizer's), nothing compiles again after step 2, and no collective runs eagerly
    for rank, (loss_diff, param_diff, breaks, new_graphs, eager_calls, captures) in enumerate(
            spmd(functools.partial(run_compiled_autograd_step, sequence_parallel), (2,))):
        assert loss_diff <= TOL and param_diff <= TOL, (rank, loss_diff, param_diff)
        assert captures >= 1, (rank, captures)
        assert not [b for b in breaks if "sbp" in b], (rank, list(breaks))
        assert new_graphs == 0 and eager_calls == [0, 0], (rank, new_graphs, eager_calls)


def run_compiled_autograd_batch_change(sizes, mesh):
    """A whole step (forward, loss, ``backward()``, the SGD step) compiled as one function under compiled
    autograd with ``dynamic=True``, batch sizes `sizes`: losses and parameters against eager, and the graphs
    dynamo compiled after the first two sizes."""
    eager, compiled = _parallel_pair(mesh, False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    losses, graphs = [], []
    for m, compile_it in ((eager, False), (compiled, True)):
        f = _whole_step(m, compile_it, dynamic=True)
        run = []
        for step, batch in enumerate(sizes):
            run.append(f(*_batch(step, batch, 6)))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        losses.append(torch.stack(run))
    param_diff = max((a.full() - b.full()).abs().max().item()
                     for a, b in zip(eager.parameters(), compiled.parameters()))
    return (losses[0] - losses[1]).abs().max().item(), param_diff, graphs[-1] - graphs[len(sizes) + 1]


def test_compiled_autograd_with_dynamic_batch_trains_as_eager() -> None:
    # the capture fakes each global input, calling its __tensor_flatten__ with dynamo's frame hook on; with
    # symbolic sizes dynamo compiled that as a frame and failed in a guard ("Cannot call numel() on tensor
    # with symbolic sizes/strides"). The optimizer step inside needs the parameters' static sizes (nn.Parameter
    # marks a global tensor static): with symbolic ones dynamo built an optimizer graph that used a parameter
    # before its input ("Argument 'p' of Node 'getattr_1' was used before it has been defined")
    fn = functools.partial(run_compiled_autograd_batch_change, (4, 4, 6, 3, 5))
    for rank, (loss_diff, param_diff, new_graphs) in enumerate(spmd(fn, (2,))):
        assert loss_diff <= TOL and param_diff <= TOL, (rank, loss_diff, param_diff)
        assert new_graphs == 0, f"rank {rank}: {new_graphs} graphs compiled for batch sizes 6, 3, 5"


def _export_then_eager(mesh):
    from torch.overrides import _get_current_function_mode_stack
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    m = sbp.nn.parallelize(copy.deepcopy(base), mesh, {"0": "colwise", "2": "rowwise"})
    params = [id(p) for p in m.parameters()]
    with pytest.raises(Exception):
        torch.export.export(m, (x,))
    modes = [type(mode).__name__ for mode in _get_current_function_mode_stack()]
    return modes, params == [id(p) for p in m.parameters()], (m(x).full() - base(x)).abs().max().item()


def test_a_failed_export_leaves_the_model_usable():
    # torch.export's trace skips nn.Module's always_call forward hooks when the forward raises: the root's
    # matmul mode and compiled-leaf swap must not be entered there, or export's own torch-function modes pop
    # sbp's in place of theirs and every later eager call fails. (On gloo: export keeps process-wide flags,
    # which ranks as threads exporting at once would corrupt for the tests after.)
    for modes, same_params, diff in spmd(_export_then_eager, (2,)):
        assert modes == [] and same_params and diff <= 1e-12


def run_inference_mode_inside_a_compiled_function(mesh):
    """A parallelized MLP compiled with `torch.inference_mode()` inside the function: equal to plain torch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)).double()
    ref = copy.deepcopy(model)
    sbp.nn.parallelize(model, mesh, {"0": "colwise", "2": "rowwise"})
    x = torch.randn(4, 8, dtype=torch.float64)

    def infer(t):
        with torch.inference_mode():
            return model(t).full()

    torch._dynamo.reset()
    got = torch.compile(infer, backend="aot_eager", fullgraph=True)(x)
    with torch.inference_mode():
        want = ref(x)
    return (got - want).abs().max().item()


def test_inference_mode_inside_a_compiled_function_equals_eager() -> None:
    # fails without wrappers of normal locals made outside inference mode: the input conversion's wrapper was
    # an inference tensor aliasing a traced normal tensor ("Cannot set version_counter for inference tensor")
    for err in spmd(run_inference_mode_inside_a_compiled_function, (2,)):
        assert err < 1e-12, err
