"""`sbp.nn.fully_shard` under training-loop patterns FSDP2 users rely on, each against one process (float64):
blocks with buffers and batch norm, tied parameters (within the root and across units), a unit used twice in
one backward, activation checkpointing of a unit (wrapped, and around its call), a unit skipped for a step (its
prefetched gather must not go stale), evaluation after the parameters change in place (`load_state_dict`), and
trainable parameters a step does not use (`.grad` None where no rank used them, as FSDP2; the reduced gradient
where some rank did, mixture-of-experts style, also with AdamW, accumulation and mixed precision).

Threads backend, mesh (2,) named dp; the default `local_batch=None` unless a case says otherwise.
"""
from __future__ import annotations

import copy
import functools
import threading
from typing import Optional

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import sbp
import sbp.nn
import sbp.testing

pytestmark = pytest.mark.filterwarnings("ignore::sbp.tensor.global_tensor.FallbackWarning")
_BUILD = threading.Lock()   # thread-ranks share torch's global generator
X = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
X2 = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full() if isinstance(t, sbp.GlobalTensor) else t


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return torch.tanh(self.scale * self.fc(x))


class Tied(nn.Module):
    """A tied embedding / head in the root and one linear shared by two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        shared = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Tanh())])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Skippable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(4, 1)
        self.skip = None

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if i != self.skip:
                x = b(x)
        return self.head(x)


class CheckpointedCalls(nn.Module):
    """Activation checkpointing around each unit's call (torch.utils.checkpoint in the parent's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)) for _ in range(2)])
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return self.head(x)


class Centred(nn.Module):
    """Subtracts the batch mean in training only: it mixes samples, but not in eval mode."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True) if self.training else x


def _blocks(kind: str) -> nn.Module:
    if kind == "inplace_input":   # a block that writes into its input
        return nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6), nn.Tanh()),
                             nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 1))
    if kind == "eval_first":
        return nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), Centred(), nn.Tanh()),
                             nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 1))
    if kind == "buffer":
        return nn.Sequential(Scaled(), Scaled(), nn.Linear(4, 1))
    if kind == "batch_norm":
        return nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Tanh()), Scaled(), nn.Linear(4, 1))
    if kind == "tied":
        return Tied()
    if kind == "skip":
        return Skippable()
    if kind == "checkpointed_calls":
        return CheckpointedCalls()
    return nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)),
                         nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)), nn.Linear(6, 1))


def _make(kind: str) -> nn.Module:
    with _BUILD:
        torch.manual_seed(0)
        return _blocks(kind).double()


def _units(m: nn.Module, kind: str) -> list[int]:
    return [0, 1] if kind in ("buffer", "batch_norm", "tied", "skip", "checkpointed_calls") else [1, 2]


def _loss(m: nn.Module, kind: str, step: int) -> torch.Tensor:
    if kind == "tied":
        idx = torch.tensor([[1, 2, 3], [4, 5, 9]])
        return _full(m(idx)).pow(2).mean()
    if kind == "twice":   # the whole model (and each unit) used twice in one backward
        return _full(m(X)).pow(2).sum() + _full(m(X2)).sin().sum()
    if kind == "skip":
        m.skip = 1 if step == 1 else None
    if kind == "unfreeze":   # unit 1 frozen for two steps (its gathered copies must not stay), then trained
        for p in m[1].parameters():
            p.requires_grad_(step >= 2)
    if kind == "partly_frozen" and step == 0:   # frozen after sharding, within trained units (LoRA-style)
        m[1][0].weight.requires_grad_(False)
        m[2][2].bias.requires_grad_(False)
    if kind == "eval_first" and step == 0:   # an evaluation before any training forward: the local check waits
        m.eval()
        with torch.no_grad():
            m(X)
        m.train()
    if kind == "hooked":   # a forward hook keeps a block's activation for the loss (a feature loss)
        kept = []
        handle = m[1][1].register_forward_hook(lambda mod, args, out: kept.append(out))
        y = _full(m(X))
        handle.remove()
        return y.pow(2).sum() + _full(kept[-1]).pow(2).mean()
    if kind == "penalty":   # a gradient penalty: double backward through the units (local shares from step 1)
        x = X.clone().requires_grad_()
        y = _full(m(x))
        gx, = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y.pow(2).sum() + _full(gx).pow(2).sum()
    return _full(m(X)).pow(2).sum()


def _train(m: nn.Module, kind: str, steps: int = 3):
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=kind == "foreach_eval")
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=kind != "skip")   # skip: zeroed grads, momentum keeps moving a skipped unit
        loss = _loss(m, kind, step)
        loss.backward()
        if kind == "foreach_eval":   # evaluated between backward and step: the root keeps its gathered copies,
            with torch.no_grad():    # which the foreach step's in-place update must make stale
                m(X)
        opt.step()
        losses.append(loss.item())
    return (losses, {n.replace("_checkpoint_wrapped_module.", ""): _full(p).detach().clone()
                     for n, p in m.named_parameters()},
            {n: _full(b).clone() for n, b in m.named_buffers()}, len(list(m.parameters())))


def _sharded(kind: str, mesh):
    m = _make(kind)
    blocks = m.blocks if kind in ("tied", "skip", "checkpointed_calls") else m
    for i in _units(m, kind):
        if kind == "checkpointed":
            blocks[i] = checkpoint_wrapper(blocks[i])
        sbp.nn.fully_shard(blocks[i], mesh, "dp")
    sbp.nn.fully_shard(m, mesh, "dp")
    if kind == "tied":
        assert m.head.weight is m.emb.weight and m.blocks[0][0].weight is m.blocks[1][0].weight
    return _train(m, kind)


@pytest.mark.parametrize("kind", ["buffer", "batch_norm", "tied", "twice", "checkpointed", "checkpointed_calls",
                                  "skip", "unfreeze", "partly_frozen", "foreach_eval", "eval_first", "penalty",
                                  "hooked", "inplace_input"])
def test_training_pattern_matches_one_process(kind: str) -> None:
    # each failed before: buffers/batch norm (in-place restore of a saved buffer), tied (untied: a second
    # stored parameter), twice (the unit's gathered storage freed after its first backward), checkpointed
    # (the recomputed forward read the stored shards), checkpointed_calls (the first step's recompute ran on local
    # shares, the forward on global tensors), skip (a stale prefetched gather after the step), unfreeze (a unit with
    # no trainable parameter kept its gathered copies after backward: unfrozen, it never trained), foreach_eval
    # (a foreach optimizer step bumped no version counter: the root computed with stale copies), eval_first (the
    # local check ran in eval mode and passed a unit that mixes samples in training), penalty (on local shares the
    # gradient's graph was cut at the unit's inputs: the penalty's gradient was dropped), hooked (the hook saw the
    # local check's rerun, then plain local shares), inplace_input (on local shares autograd refused the write)
    losses, params, buffers, count = _train(_make(kind), kind)
    for got in sbp.testing.spmd(functools.partial(_sharded, kind), (2,), names=("dp",)):
        assert got[3] == count   # tied parameters stay one parameter
        assert got[0] == pytest.approx(losses, abs=1e-10, rel=0)
        for name, value in params.items():
            assert torch.allclose(got[1][name], value, atol=1e-10, rtol=0), name
        for name, value in buffers.items():
            assert torch.allclose(got[2][name].to(value.dtype), value, atol=1e-10, rtol=0), name


def _evaluate_after_load(mesh, how: str, path: str):
    m = _make("checkpointed")
    for i in (1, 2):
        sbp.nn.fully_shard(m[i], mesh, "dp")
    sbp.nn.fully_shard(m, mesh, "dp")
    with torch.no_grad():
        before = _full(m(X)).clone()
        other = _make("checkpointed")
        with torch.no_grad():
            for p in other.parameters():
                p.mul_(-0.5)
        if how == "load_state_dict":
            m.load_state_dict(other.state_dict())
        elif how == "assign":   # replaces the modules' parameters: their values go into the stored ones
            m.load_state_dict(other.state_dict(), assign=True)
        elif how == "sbp.load":   # writes into the stored parameters' local tensors
            sbp.load(path, m.state_dict())
        else:                     # "to_local": in place on p.to_local()
            for p, q in zip(m.parameters(), other.parameters()):
                p.to_local().copy_(sbp.distribute(q.detach(), mesh, p.placements).to_local())
        after = _full(m(X)).clone()
    return before, after, other(X).detach()


def _save_halved(mesh, path: str) -> None:
    other = _make("checkpointed")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-0.5)
    sbp.save({k: sbp.distribute(v, mesh, "S(0)" if v.ndim else "B") for k, v in other.state_dict().items()}, path)


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
@pytest.mark.parametrize("how", ["load_state_dict", "assign", "sbp.load", "to_local"])
def test_evaluation_after_an_in_place_load_sees_the_new_parameters(how: str, tmp_path, backend: str) -> None:
    # the root stays gathered after a forward without backward; its gather was reused after the in-place load
    # (sbp.load into m.state_dict() and p.to_local() write the local tensor: the parameter's own version counter
    # stays; a state dict's detached values share the parameters' local tensors)
    ref = _make("checkpointed")(X).detach()
    if how == "sbp.load":
        sbp.testing.spmd(functools.partial(_save_halved, path=str(tmp_path)), (2,), names=("dp",), backend=backend)
    for before, after, expected in sbp.testing.spmd(functools.partial(_evaluate_after_load, how=how,
                                                                      path=str(tmp_path)), (2,), names=("dp",),
                                                    backend=backend):
        assert torch.allclose(before, ref, atol=1e-12, rtol=0)
        assert torch.allclose(after, expected, atol=1e-12, rtol=0)


def _input_grad(mesh):
    m = _make("checkpointed")
    for i in (1, 2):
        sbp.nn.fully_shard(m[i], mesh, "dp")
    sbp.nn.fully_shard(m, mesh, "dp")
    x = X.clone().requires_grad_()
    m(x).full().pow(2).sum().backward()
    return x.grad


@pytest.mark.parametrize("backend", ["threads", pytest.param("gloo", marks=pytest.mark.gloo)])
def test_a_plain_input_requiring_grad_gets_the_full_gradient_on_every_rank(backend: str) -> None:
    # a plain tensor entering the root is the full batch on every rank: its .grad is the full gradient there
    # (it used to be this rank's rows only, zeros elsewhere: a plain module in front drifted apart per rank)
    x = X.clone().requires_grad_()
    _make("checkpointed")(x).pow(2).sum().backward()
    for grad in sbp.testing.spmd(_input_grad, (2,), names=("dp",), backend=backend):
        assert torch.allclose(grad, x.grad, atol=1e-12, rtol=0)


@pytest.mark.gloo
@pytest.mark.parametrize("kind", ["tied", "checkpointed_calls", "skip", "unfreeze"])
def test_training_pattern_matches_one_process_on_gloo(kind: str) -> None:
    # the same on gloo processes: parameters pickled to the workers, the verification's all_reduce, async gathers
    losses, params, _, count = _train(_make(kind), kind)
    for got in sbp.testing.spmd(functools.partial(_sharded, kind), (2,), names=("dp",), backend="gloo", timeout=120):
        assert got[3] == count
        assert got[0] == pytest.approx(losses, abs=1e-10, rel=0)
        for name, value in params.items():
            assert torch.allclose(got[1][name], value, atol=1e-10, rtol=0), name


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):   # (B, T, 3) -> (B * T, 3): rows that are the batch's only while T is 1
        return torch.tanh(self.fc(x)).reshape(-1, 3)


def _flattening(mesh, shapes):
    with _BUILD:
        torch.manual_seed(0)
        m = nn.Sequential(Flat(), nn.Linear(3, 1)).double()
    sbp.nn.fully_shard(m[0], mesh, "dp")
    sbp.nn.fully_shard(m, mesh, "dp")
    losses = []
    for b, t in shapes:
        x = torch.linspace(-1, 1, b * t * 3, dtype=torch.float64).reshape(b, t, 3)
        try:
            loss = _full(m(x)).pow(2).sum()
        except sbp.ShapeError as e:
            losses.append(str(e))
            continue
        loss.backward()
        losses.append(loss.item())
    return losses


def test_a_local_unit_reads_only_this_forwards_batch_length():
    # the local check passes on (7, 1); a later batch (4, 2) found the first step's local -> global batch length
    # (4 -> 7) for its flattened rows: one rank skipped the collective the other made (a mismatch, a hang on
    # gloo). An uneven (3, 3) batch flattens to rows no balanced layout holds: a clear error on every rank.
    shapes = [(7, 1), (4, 2), (3, 3)]
    with _BUILD:
        torch.manual_seed(0)
        ref = nn.Sequential(Flat(), nn.Linear(3, 1)).double()
    want = [ref(torch.linspace(-1, 1, b * t * 3, dtype=torch.float64).reshape(b, t, 3)).pow(2).sum().item()
            for b, t in shapes[:2]]
    for got in sbp.testing.spmd(functools.partial(_flattening, shapes=shapes), (2,), names=("dp",)):
        assert got[:2] == pytest.approx(want, abs=1e-12, rel=0)
        assert "local_batch=False" in got[2] and "balanced" in got[2]


def _sharded_fsdp2_default(mesh):
    m = _make("buffer")
    for i in (0, 1):
        sbp.nn.fully_shard(m[i], mesh, "dp", reshard_after_forward=None)
    sbp.nn.fully_shard(m, mesh, "dp", reshard_after_forward=None)
    return sbp.nn.fsdp.unit_of(m[0]).reshard_after_forward, _train(m, "buffer")[0]


def test_reshard_after_forward_none_is_fsdp2s_default():
    # FSDP2's default (None): blocks reshard after forward, the root keeps its copies -- sbp's True
    losses = _train(_make("buffer"), "buffer")[0]
    for reshards, got in sbp.testing.spmd(_sharded_fsdp2_default, (2,), names=("dp",)):
        assert reshards is True and got == pytest.approx(losses, abs=1e-10, rel=0)


class Promoting(nn.Module):
    """A float32 buffer in the root promotes the bfloat16 activation before the block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x):
        return self.head(torch.tanh(self.block(self.inp(x) * self.scale)))


def _bfloat16_units(mesh):
    with _BUILD:
        torch.manual_seed(0)
        m = Promoting()
    sbp.nn.fully_shard(m.block, mesh, "dp", param_dtype=torch.bfloat16)
    sbp.nn.fully_shard(m, mesh, "dp", param_dtype=torch.bfloat16)
    y = m(torch.linspace(-1, 1, 12).reshape(4, 3)).full()
    y.float().pow(2).sum().backward()
    return y.dtype, m.block.weight.grad.dtype, y.float()


def test_param_dtype_casts_every_units_inputs():
    # a float32 input reached the bfloat16 block (a DTypeError in its matmul); FSDP2 casts each unit's inputs
    with _BUILD:
        torch.manual_seed(0)
        ref = Promoting()
    want = ref(torch.linspace(-1, 1, 12).reshape(4, 3))
    for dtype, grad_dtype, y in sbp.testing.spmd(_bfloat16_units, (2,), names=("dp",)):
        assert (dtype, grad_dtype) == (torch.bfloat16, torch.float32)
        assert torch.allclose(y, want, atol=3e-2, rtol=0)


def _meta_init(mesh):
    with torch.device("meta"):
        m = _blocks("checkpointed").double()
    for i in (1, 2):
        sbp.nn.fully_shard(m[i], mesh, "dp")
    sbp.nn.fully_shard(m, mesh, "dp")
    placements = [p.placements for p in m.parameters()]
    m.to_empty(device="cpu")
    ref = _make("checkpointed")
    with torch.no_grad():   # the init after to_empty: here the reference's values, written into the shards
        for p, q in zip(m.parameters(), ref.parameters()):
            p.copy_(q)
    return placements, _train(m, "checkpointed")


def test_a_model_built_on_the_meta_device_shards_then_initialises():
    # FSDP2's deferred init (build on meta, fully_shard, to_empty, init): refused before ("cannot move the
    # tensor from meta"); the shards are made with no storage and to_empty gives them theirs
    losses, params, _, _ = _train(_make("checkpointed"), "checkpointed")
    for placements, got in sbp.testing.spmd(_meta_init, (2,), names=("dp",)):
        assert all(p == (sbp.S(0),) for p in placements)
        assert got[0] == pytest.approx(losses, abs=1e-10, rel=0)
        for name, value in params.items():
            assert torch.allclose(got[1][name], value, atol=1e-10, rtol=0), name


class _Adapted(nn.Module):
    """A frozen base layer and a small trainable adapter (LoRA's shape), and a trainable layer left unused."""

    def __init__(self) -> None:
        super().__init__()
        self.base, self.down, self.up, self.unused = (nn.Linear(8, 8, bias=False), nn.Linear(8, 2, bias=False),
                                                      nn.Linear(2, 8, bias=False), nn.Linear(8, 8))
        self.base.weight.requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.up(self.down(x)))


def _adapted(mesh):
    with _BUILD:
        torch.manual_seed(0)
        m = nn.Sequential(_Adapted(), _Adapted()).double()
    for block in m:
        sbp.nn.fully_shard(block, mesh, "dp")
    sbp.nn.fully_shard(m, mesh, "dp")
    x = torch.linspace(-1, 1, 48, dtype=torch.float64).reshape(6, 8)
    _full(m(x)).pow(2).sum().backward()
    grads = {n: (None if p.grad is None else _full(p.grad)) for n, p in m.named_parameters()}   # (waits for them)
    return grads, [sum(c.sent for c in e[3]) for e in sbp.nn.fsdp.unit_of(m).schedule.log if e[0] == "reduce_scatter"]


def test_frozen_parameters_take_no_gradient_and_send_none():
    # before: a frozen parameter's gathered copy required grad, so backward computed its gradient and the
    # unit reduce-scattered it (zeros): 97% of a LoRA unit's reduce_scatter bytes. FSDP2 skips both.
    with _BUILD:
        torch.manual_seed(0)
        ref = nn.Sequential(_Adapted(), _Adapted()).double()
    x = torch.linspace(-1, 1, 48, dtype=torch.float64).reshape(6, 8)
    ref(x).pow(2).sum().backward()
    for grads, sent in sbp.testing.spmd(_adapted, (2,), names=("dp",)):
        for name, p in ref.named_parameters():
            if p.grad is None:   # frozen, or a trainable layer no rank used: None, as on one process (and FSDP2)
                assert grads[name] is None, name
            else:
                assert torch.allclose(grads[name], p.grad, atol=1e-12, rtol=0), name
        # per block and rank: half of the adapter's (16 + 16) and the unused layer's (64 + 8) float64s (an unused
        # layer takes part: ranks may differ in what they use), and the other rank's piece of the "used" flags,
        # one per trainable parameter (down, up, unused.weight, unused.bias): 4 float64s
        assert sent == [(16 + 16 + 64 + 8) // 2 * 8 + 4 * 8] * 2


class _DictInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, batch):   # one dict argument, as transformers' models are often called
        return self.out(torch.tanh(self.inp(batch["x"])))


def _nested_inputs(mesh):
    with _BUILD:
        torch.manual_seed(0)
        m = _DictInput()
    sbp.nn.fully_shard(m, mesh, "dp", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    x = torch.linspace(-1, 1, 20).reshape(4, 5)
    nested = m({"x": x})
    return nested.dtype, nested.placements, _full(nested)


def test_the_roots_inputs_nested_in_dicts_are_the_batch_and_cast():
    # before: only top-level arguments were laid out as the batch and cast to param_dtype: a float32 tensor in
    # a dict reached the bfloat16 block (DTypeError); without param_dtype every rank computed the whole batch
    with _BUILD:
        torch.manual_seed(0)
        ref = _DictInput().to(torch.bfloat16)
    want = ref({"x": torch.linspace(-1, 1, 20).reshape(4, 5).to(torch.bfloat16)})
    for dtype, placements, value in sbp.testing.spmd(_nested_inputs, (2,), names=("dp",)):
        assert dtype == torch.bfloat16 and placements == (sbp.S(0),)
        assert torch.allclose(value.float(), want.float(), atol=1e-2, rtol=0)


class _Steps:
    """State a forward updates in place, as a transformers `Cache` (each decoder layer writes its keys)."""

    def __init__(self) -> None:
        self.seen = 0


class _Stepping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, steps: _Steps):
        steps.seen += 1
        return self.fc(x) * steps.seen


class _SteppingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.out = _Stepping(), nn.Linear(4, 2)

    def forward(self, x, steps: _Steps):
        return self.out(self.block(x, steps))


def _stepping(mesh=None):
    with _BUILD:
        torch.manual_seed(0)
        m = _SteppingModel().double()
    if mesh is not None:
        sbp.nn.fully_shard(m.block, mesh, "dp")
        sbp.nn.fully_shard(m, mesh, "dp")
    steps, outs = _Steps(), []
    for _ in range(3):   # training mode: the block's first forward is checked against a local run
        outs.append(_full(m(X, steps)).detach())
    return steps.seen, outs


def test_a_forward_taking_an_object_it_updates_runs_once():
    # local_batch=None's check ran a unit's first forward a second time, on local shares, with the same
    # arguments: an object the forward updates in place (a transformers StaticCache) was updated twice --
    # generate() wrote past the prompt and gave wrong tokens, or raised IndexError in index_copy_
    want_seen, want = _stepping()
    for seen, outs in sbp.testing.spmd(_stepping, (2,), names=("dp",)):
        assert seen == want_seen == 3
        for got, ref in zip(outs, want):
            assert torch.allclose(got, ref, atol=1e-12, rtol=0)


def _converted_after_eval(mesh):
    m = _make("plain").float()
    sbp.nn.fully_shard(m[1], mesh, "dp")
    sbp.nn.fully_shard(m, mesh, "dp")
    with torch.no_grad():
        m(X.float())   # an evaluation: the root keeps its gathered (float32) copies
    m.double()
    with torch.no_grad():
        return _full(m(X))


def test_a_dtype_conversion_after_an_evaluation_gathers_again():
    # before: model.double() swapped the stored locals without bumping a version counter: the root's kept
    # float32 copies were used again (DTypeError)
    want = _make("plain").float().double()(X)
    for got in sbp.testing.spmd(_converted_after_eval, (2,), names=("dp",)):
        assert got.dtype == torch.float64
        assert torch.allclose(got, want, atol=1e-12, rtol=0)


# ---- parameters the backward does not reach: .grad None where no rank used them (FSDP2), safe where ranks differ --
class _Routed(nn.Module):
    """A block with an `expert` its forward uses only where a row it sees has a positive first feature (a mixture of
    experts' routing: on plain local shares, `local_batch=True`, the ranks differ in what they use) and an `idle`
    layer it never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.expert, self.idle = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = torch.tanh(self.fc(x))
        return y + self.expert(x) if bool((x[:, 0] > 0).any()) else y


def _routed_model(dtype: torch.dtype = torch.float64) -> nn.Module:
    with _BUILD:
        torch.manual_seed(0)
        return nn.Sequential(_Routed(), nn.Linear(4, 1)).to(dtype)


# the expert used by every rank, by none, by rank 0 only (rows 0-2 are rank 0's share of the batch on (2,) dp)
ROUTES = {"all": X.abs(), "none": -X.abs(), "rank0": torch.cat([X[:3].abs(), -X[3:].abs()])}


def _routed_loss(m: nn.Module, route: str, shares: int = 1) -> torch.Tensor:
    """One process: the loss of `shares` ranks each computing on its own share of the batch (the model's routing
    decided per share, as on local shares), summed."""
    return sum(m(x).pow(2).sum() for x in ROUTES[route].chunk(shares))


def _routed_sharded(mesh, local_batch: Optional[bool], dtype: torch.dtype = torch.float64, **mixed) -> nn.Module:
    m = _routed_model(dtype)
    if "tp" in mesh.names:
        sbp.nn.parallelize(m, mesh, {"0.fc": "colwise", "0.expert": "colwise", "0.idle": "colwise"}, tp_axis="tp")
    sbp.nn.fully_shard(m[0], mesh, "dp", local_batch=local_batch, **mixed)
    return sbp.nn.fully_shard(m, mesh, "dp", **mixed)


def _grads(m: nn.Module) -> dict:
    return {n: None if p.grad is None else _full(p.grad).detach().clone() for n, p in m.named_parameters()}


def _routed_grads(mesh, route: str, local_batch: Optional[bool]):
    m = _routed_sharded(mesh, local_batch)
    _full(m(ROUTES[route])).pow(2).sum().backward()
    calls = {e[1]: [(c.collective, c.sent) for c in e[3]] for e in sbp.nn.fsdp.schedule_log(m)
             if e[0] == "reduce_scatter"}
    return _grads(m), calls


def _assert_grads(got: dict, want: dict, atol: float = 1e-12) -> None:
    for name, g in want.items():
        if g is None:
            assert got[name] is None, name
        else:
            assert got[name] is not None and torch.allclose(got[name].to(g.dtype), g, atol=atol, rtol=0), name


@pytest.mark.parametrize("route", ["all", "none", "rank0"])
@pytest.mark.parametrize("layout, local_batch", [("dp", True), ("dp", False), ("dp_tp", False)],
                         ids=["local", "global", "dp-tp"])
def test_a_parameter_no_rank_uses_gets_no_gradient(route: str, layout: str, local_batch: Optional[bool]) -> None:
    # before: every trainable parameter the backward missed got a zero .grad (FSDP2: None where no rank used it; an
    # optimizer then skips it). Each rank still sends its part (zeros) in the unit's one reduce_scatter, with a "used"
    # flag per trainable parameter in the same buffer: 0 summed over the ranks leaves .grad None. Where only rank 0
    # used the expert (local shares) its gradient is rank 0's, reduced as before; the ranks' collectives match.
    # dp-tp: the colwise biases move outside the flat buffer (their own redistribution); their flags ride in it.
    ref = _routed_model()
    _routed_loss(ref, route, 2 if local_batch else 1).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    mesh, names = ((2,), ("dp",)) if layout == "dp" else ((2, 2), ("dp", "tp"))
    for got, calls in sbp.testing.spmd(functools.partial(_routed_grads, route=route, local_batch=local_batch), mesh,
                                       names=names, timeout=60):
        _assert_grads(got, want)
        for unit in ("0", "<root>"):   # one collective per unit, as before
            assert [c for c, _ in calls[unit]] == ["reduce_scatter"], calls
        if layout == "dp":   # the other rank's half of fc's, expert's and idle's 3 x 20 float64s, and its 6 flags
            assert calls["0"][0][1] == 3 * 20 // 2 * 8 + 6 * 8


def _routed_adamw(mesh, route: str, steps: int):
    m = _routed_sharded(mesh, True)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(steps):
        opt.zero_grad()
        _full(m(ROUTES[route])).pow(2).sum().backward()
        opt.step()
    return {n: _full(p).detach().clone() for n, p in m.named_parameters()}


def test_adamw_leaves_a_parameter_no_rank_uses_unchanged() -> None:
    # before: the unused layer's zero gradient made AdamW decay it (and count a step in its state); on one process
    # (and under FSDP2) its .grad is None and AdamW skips it. The expert only rank 0 uses trains as on one process.
    ref = _routed_model()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        _routed_loss(ref, "rank0", 2).backward()
        opt.step()
    for params in sbp.testing.spmd(functools.partial(_routed_adamw, route="rank0", steps=2), (2,), names=("dp",)):
        for name, p in ref.named_parameters():
            assert torch.allclose(params[name], p.detach(), atol=1e-10, rtol=0), name
        for name in ("0.idle.weight", "0.idle.bias"):
            assert torch.equal(params[name], init[name]), name


def _routed_micro_batches(mesh, routes: tuple[str, ...], hold: bool):
    m = _routed_sharded(mesh, True)
    for i, route in enumerate(routes):
        if hold:   # gradients held unreduced but in the last micro-batch
            m.set_requires_gradient_sync(i == len(routes) - 1)
        _full(m(ROUTES[route])).pow(2).sum().backward()
    return _grads(m)


@pytest.mark.parametrize("routes", [("rank0", "none"), ("none", "rank0"), ("none", "none")],
                         ids=["first", "second", "neither"])
@pytest.mark.parametrize("hold", [True, False], ids=["held", "synced"])
def test_gradient_accumulation_keeps_a_gradient_any_micro_batch_made(routes: tuple[str, ...], hold: bool) -> None:
    # the expert used (by rank 0) in one micro-batch of two: its .grad is that one's, as on one process, whether
    # the first one's was held unreduced (set_requires_gradient_sync(False)) or stored; a micro-batch that used it
    # nowhere adds nothing. Used in neither, and the idle layer: None (before: zeros)
    ref = _routed_model()
    for route in routes:
        _routed_loss(ref, route, 2).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for got in sbp.testing.spmd(functools.partial(_routed_micro_batches, routes=routes, hold=hold), (2,),
                                names=("dp",)):
        _assert_grads(got, want)


class _Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x, use_b: bool, use_head: bool):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) if use_b else h
        return self.head(h) if use_head else h


torch.manual_seed(5)
_BRANCHY = _Branchy().double()
_MICRO = [torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in range(3)]
# (use_b, use_head) per micro-batch: the last one, with sync, skips unit b and then the root's own head
_SKIPS = [(True, True), (False, True), (True, False)]


def _branchy_steps(model, set_sync) -> list[dict[str, Optional[torch.Tensor]]]:
    """Two accumulations (held, then synced in a micro-batch that skips `b` or the head), then a plain step."""
    grads = []
    for last in _SKIPS[1:]:
        model.zero_grad()
        set_sync(False)
        model(_MICRO[0], True, True).pow(2).sum().backward()
        set_sync(True)
        model(_MICRO[1], *last).pow(2).sum().backward()
        grads.append({n: None if p.grad is None else _full(p.grad).clone() for n, p in model.named_parameters()})
    model.zero_grad()
    model(_MICRO[2], True, True).pow(2).sum().backward()
    grads.append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
    return grads


def _branchy_sharded(mesh):
    m = copy.deepcopy(_BRANCHY)
    sbp.nn.fully_shard(m.a, mesh), sbp.nn.fully_shard(m.b, mesh), sbp.nn.fully_shard(m, mesh)
    return _branchy_steps(m, m.set_requires_gradient_sync)


def test_held_gradients_of_a_unit_the_synced_micro_batch_skips_reach_grad() -> None:
    # micro-batch 1 (held, no sync) uses unit b and the root's head; micro-batch 2 (sync) skips b, or the head:
    # their held gradients are reduced at the end of that backward, as one process sums them. Before: .grad None
    # for the step, and the held gradient added into the next step's (after zero_grad)
    want = _branchy_steps(copy.deepcopy(_BRANCHY), lambda sync: None)
    for got in sbp.testing.spmd(_branchy_sharded, (2,), names=("dp",)):
        for g, w in zip(got, want):
            _assert_grads(g, w)


def _routed_mixed(mesh, reduce_dtype: torch.dtype):
    m = _routed_sharded(mesh, True, torch.float32, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    _full(m(ROUTES["rank0"].float())).pow(2).sum().backward()
    return _grads(m), {p.grad.dtype for p in m.parameters() if p.grad is not None}


@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_unused_parameters_under_mixed_precision(reduce_dtype: torch.dtype) -> None:
    # gathered in bfloat16 and reduced in bfloat16 or float32: the flags travel in the reduce dtype (0 stays 0,
    # a sum of ones stays positive); the expert only rank 0 uses gets its gradient, the idle layer None (before:
    # zeros); .grad in the stored float32
    ref = _routed_model()
    _routed_loss(ref, "rank0", 2).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for got, dtypes in sbp.testing.spmd(functools.partial(_routed_mixed, reduce_dtype=reduce_dtype), (2,),
                                        names=("dp",)):
        assert dtypes == {torch.float32}
        _assert_grads(got, want, atol=0.1)


def _routed_fsdp2(route: str, send_zeros: bool = False) -> dict:
    """PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) on the same model, each rank on its share of the batch:
    .grad of every parameter, summed over the ranks (FSDP2 averages them: times 2, sbp's global loss's gradient).
    `send_zeros`: FSDP2's ``set_reduce_scatter_unused_params(True)`` (every rank sends zeros for what it missed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tmesh = init_device_mesh("cpu", (2,))
    m = _routed_model()
    fully_shard(m[0], mesh=tmesh)
    fully_shard(m, mesh=tmesh)
    if send_zeros:
        for unit in (m[0], m):
            unit.set_reduce_scatter_unused_params(True)
    m(ROUTES[route].chunk(2)[tmesh.get_rank()]).pow(2).sum().backward()
    return {n: None if p.grad is None else 2 * p.grad.full_tensor() for n, p in m.named_parameters()}


def _unused_on_gloo(mesh):
    # FSDP2 where no rank's use differs (it leaves None where no rank used a parameter). Where rank 0 alone uses the
    # expert, FSDP2's reduce_scatter would differ in size by rank (a hang), unless every rank sends zeros for what it
    # did not use (`set_reduce_scatter_unused_params`, recent torch): then the idle layer gets zeros
    from torch.distributed.fsdp import FSDPModule

    fsdp2 = {route: _routed_fsdp2(route) for route in ("all", "none")}
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        fsdp2["rank0"] = _routed_fsdp2("rank0", send_zeros=True)
    return fsdp2, {route: _routed_grads(mesh, route, True)[0] for route in ("all", "none", "rank0")}


@pytest.mark.gloo
def test_a_parameter_no_rank_uses_gets_no_gradient_as_under_fsdp2_on_gloo() -> None:
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6")
    for fsdp2, got in sbp.testing.spmd(_unused_on_gloo, (2,), names=("dp",), backend="gloo", timeout=120):
        for route in ("all", "none", "rank0"):
            ref = _routed_model()
            _routed_loss(ref, route, 2).backward()
            want = {n: p.grad for n, p in ref.named_parameters()}
            _assert_grads(got[route], want)
            if route == "rank0" and route in fsdp2:   # FSDP2 sending zeros: the same where sbp has a gradient
                assert all(torch.equal(g, torch.zeros_like(g)) for n, g in fsdp2[route].items() if want[n] is None)
                _assert_grads({n: g for n, g in got[route].items() if g is not None}, {
                    n: g for n, g in fsdp2[route].items() if got[route][n] is not None})
            elif route in fsdp2:   # FSDP2's own: None exactly where sbp's is
                assert {n for n, g in fsdp2[route].items() if g is None} == {n for n, g in want.items() if g is None}
                _assert_grads(got[route], fsdp2[route])
