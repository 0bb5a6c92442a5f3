"""torch.optim on global-tensor parameters (SGD with momentum, Adam, AdamW, Adagrad; per tensor, foreach and
fused) makes the same updates as on single-device tensors; `_foreach_*` ops with mismatched or Partial placements fall
back to per-index pointwise rules."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import sbp
import sbp.testing
from sbp import B, Partial, S
from tests.support.ops_kit import make_global, randn

TOL = 1e-10
SHAPES = {"w1": (6, 4), "w2": (5,), "w3": (3, 5)}
LAYOUTS = {
    (3,): {"w1": (S(0),), "w2": (B,), "w3": (S(1),)},
    (2, 2): {"w1": (S(0), S(1)), "w2": (S(0), B), "w3": (B, S(0))},
}
OPTIMIZERS = {
    "sgd_momentum": lambda ps, kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **kw),
    "adam_amsgrad": lambda ps, kw: torch.optim.Adam(ps, lr=0.05, amsgrad=True, **kw),
    "adamw": lambda ps, kw: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, **kw),
    "adagrad": lambda ps, kw: torch.optim.Adagrad(ps, lr=0.1, **kw),
}
# the per-tensor kernels, the _foreach_* ops, torch's fused kernels (_fused_adamw_, ...)
MODES = {"per-tensor": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _loss(ps: dict) -> torch.Tensor:
    return (ps["w1"].sin() * 2).sum() + (ps["w2"] ** 3).sum() + (ps["w3"] @ ps["w3"].t()).sum() * 0.1


def _train(params: dict, make_opt, steps: int = 3) -> None:
    opt = make_opt(list(params.values()))
    for _ in range(steps):
        opt.zero_grad()
        _loss(params).backward()
        opt.step()


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_steps_match_single_device(name, mode, mesh_shape):
    # strict: no op falls back (the fused kernels did, gathering every parameter and state to run on full copies)
    fulls = {k: randn(s, i) for i, (k, s) in enumerate(SHAPES.items())}
    ref = {k: nn.Parameter(v.clone()) for k, v in fulls.items()}
    _train(ref, lambda ps: OPTIMIZERS[name](ps, MODES[mode]))

    def fn(mesh):
        with sbp.strict():
            params = {k: nn.Parameter(make_global(v, mesh, LAYOUTS[mesh_shape][k])) for k, v in fulls.items()}
            _train(params, lambda ps: OPTIMIZERS[name](ps, MODES[mode]))
            for k, p in params.items():
                assert p.placements == LAYOUTS[mesh_shape][k]
            return {k: p.full() for k, p in params.items()}

    for got in sbp.testing.spmd(fn, mesh_shape):
        for k in SHAPES:
            assert torch.allclose(got[k], ref[k].detach(), atol=TOL, rtol=0), k


def test_foreach_with_mismatched_placements_runs_per_index():
    a, b, c = randn((4, 3)), randn((4, 3), 1), randn((5,), 2)

    def fn(mesh):
        with sbp.strict(), torch.no_grad():
            xs = [make_global(a, mesh, (S(0),)), make_global(c, mesh, (Partial("sum"),))]
            ys = [make_global(b, mesh, (S(1),)), make_global(c, mesh, (B,))]
            torch._foreach_add_(xs, ys, alpha=2)
            torch._foreach_addcdiv_(xs, ys, [y.abs() + 1 for y in ys], [0.5, -1.0])
            torch._foreach_lerp_(xs, ys, 0.25)
            roots = torch._foreach_sqrt([x.abs() for x in xs])
            torch._foreach_maximum_(xs, ys)
            return [x.placements for x in xs], [x.full() for x in xs], [r.full() for r in roots]

    ref = [a.clone(), c.clone()]
    ys = [b, c]
    for x, y in zip(ref, ys):
        x.add_(y, alpha=2)
    for x, y, s in zip(ref, ys, [0.5, -1.0]):
        x.addcdiv_(y, y.abs() + 1, value=s)
    for x, y in zip(ref, ys):
        x.lerp_(y, 0.25)
    roots = [x.abs().sqrt() for x in ref]
    for x, y in zip(ref, ys):
        torch.maximum(x, y, out=x)
    for pls, got, got_roots in sbp.testing.spmd(fn, (2,)):
        assert pls == [(S(0),), (Partial("sum"),)]   # in-place ops keep each tensor's layout
        for g, e in zip(got + got_roots, ref + roots):
            assert torch.allclose(g, e, atol=TOL), (g, e)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_clip_grad_norm_foreach_matches_single_device(mesh_shape):
    """``clip_grad_norm_(foreach=True)`` runs ``_foreach_norm``, a reduction per tensor (not pointwise)."""
    w, b, gw, gb = randn((5, 3)), randn((3,), 1), randn((5, 3), 2), randn((3,), 3)
    ref = [nn.Parameter(w.clone()), nn.Parameter(b.clone())]
    ref[0].grad, ref[1].grad = gw.clone(), gb.clone()
    total_ref = nn.utils.clip_grad_norm_(ref, 0.5, foreach=True)
    pls = {(2,): ((S(0),), (B,)), (2, 2): ((S(0), S(1)), (B, S(0)))}[mesh_shape]

    def fn(mesh):
        with sbp.strict():
            ps = [nn.Parameter(make_global(w, mesh, pls[0])), nn.Parameter(make_global(b, mesh, pls[1]))]
            ps[0].grad, ps[1].grad = make_global(gw, mesh, pls[0]), make_global(gb, mesh, pls[1])
            norms = torch._foreach_norm([p.grad for p in ps])
            total = nn.utils.clip_grad_norm_(ps, 0.5, foreach=True)
            return [tuple(n.shape) for n in norms], total.full(), [p.grad.full() for p in ps]

    for shapes, total, grads in sbp.testing.spmd(fn, mesh_shape):
        assert shapes == [(), ()]
        torch.testing.assert_close(total, total_ref)
        for got, want in zip(grads, ref):
            torch.testing.assert_close(got, want.grad)


_MLP = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
_X = randn((4, 8), 5)


def _fused_training(mesh=None, steps: int = 2):
    import copy
    model = copy.deepcopy(_MLP)
    if mesh is not None:
        sbp.nn.parallelize(model, mesh, {"0": "colwise", "2": "rowwise"})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    for _ in range(steps):
        opt.zero_grad()
        model(_X).pow(2).sum().backward()
        opt.step()
    return [p.full().detach() if mesh is not None else p.detach() for p in model.parameters()]


def test_fused_adamw_on_a_parallelized_model_matches_single_device():
    # the colwise weight's gradient block is laid out transposed (strides (1, 8)); torch's fused kernel reads
    # every list with its parameter's strides, so run on the locals as they are it updated that weight from
    # mis-read gradients (off by 0.2 after one step of lr 0.1)
    ref = _fused_training()
    with sbp.strict():
        for got in sbp.testing.spmd(_fused_training, (2,)):
            for g, r in zip(got, ref):
                assert torch.allclose(g, r, atol=TOL, rtol=0)


def _partial_param_steps(mesh, name: str, kwargs: dict) -> list:
    """Three steps of a fused / foreach / for-loop optimizer on a P(sum) parameter, each followed by a read of
    the whole value (a reduction sbp keeps while the parameter is unchanged)."""
    w = nn.Parameter(sbp.distribute(torch.linspace(1, 2, 4, dtype=torch.float64), mesh, "P(sum)"))
    opt = getattr(torch.optim, name)([w], lr=0.1, **kwargs)
    seen = []
    for step in range(3):
        w.grad = sbp.distribute(torch.full((4,), 1.0 + step, dtype=torch.float64), mesh, "P(sum)")
        opt.step()
        seen.append(w.full().tolist())
    return seen


@pytest.mark.filterwarnings("ignore:sbp. no sharding rule")   # a fused kernel on a Partial: the fallback
@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad"])
@pytest.mark.parametrize("mode", [{"fused": True}, {"foreach": True}, {"foreach": False}])
def test_optimizers_on_a_partial_parameter_see_every_step(name, mode):
    # fails without the dispatch counting the writes of ops that have no ADInplaceOrView kernel (fused
    # kernels, amp's unscale): the first step's kept reduction of the P(sum) parameter outlived every
    # later write, so steps 2 and 3 read (and updated from) step 1's value
    plain = nn.Parameter(torch.linspace(1, 2, 4, dtype=torch.float64))
    opt = getattr(torch.optim, name)([plain], lr=0.1, **mode)
    want = []
    for step in range(3):
        plain.grad = torch.full((4,), 1.0 + step, dtype=torch.float64)
        opt.step()
        want.append(plain.detach().tolist())
    for got in sbp.testing.spmd(functools.partial(_partial_param_steps, name=name, kwargs=mode), (2,)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-12, atol=1e-12)


def _other_handles_after_a_fused_step(mesh) -> dict:
    """Reads of a P(sum) parameter through other handles (a detach, a view, a view's base) after a fused
    step that wrote it: each handle's value was reduced (and kept) before the step."""
    p = nn.Parameter(sbp.from_local(torch.full((4,), 0.5, dtype=torch.float64), mesh, "P(sum)", global_shape=(4,)))
    d, v = p.detach(), p.detach().view(2, 2)
    seen = {"before": (d.full().sum().item(), v.full().sum().item(), p.full().sum().item())}
    p.grad = sbp.distribute(torch.ones(4, dtype=torch.float64), mesh, "B")
    torch.optim.SGD([p], lr=1.0, fused=True).step()          # p <- 1 - 1 = 0
    seen["after step"] = (d.full().sum().item(), v.full().sum().item(), p.full().sum().item())
    w = p.detach().view(4)                                     # a write into a view, read through its base
    base = p.detach()
    base.full()
    torch._fused_sgd_([w], [sbp.distribute(torch.ones(4, dtype=torch.float64), mesh, "B")], [], weight_decay=0.,
                      momentum=0., lr=1.0, dampening=0., nesterov=False, maximize=False, is_first_step=True)
    seen["after a write into a view"] = (base.full().sum().item(), w.full().sum().item())
    return seen


@pytest.mark.filterwarnings("ignore:sbp. no sharding rule")
def test_a_fused_step_on_a_partial_parameter_reaches_every_handle():
    # fails without uncounted writes recorded by storage: each handle (a detach, a view -- their locals share
    # no version counter with the parameter's) kept its reduction from before the step and read the old value
    for seen in sbp.testing.spmd(_other_handles_after_a_fused_step, (2,)):
        assert seen == {"before": (4.0, 4.0, 4.0), "after step": (0.0, 0.0, 0.0),
                        "after a write into a view": (-4.0, -4.0)}, seen


def _scaled_training(params: dict, mesh=None, steps: int = 3) -> tuple:
    """`steps` AdamW steps through `torch.amp.GradScaler`, the second with an inf in w1's gradient at (5, 3)
    (on one rank's block only); the parameters, the scale after each step, and the collectives each
    `unscale_` made (with a mesh)."""
    opt = torch.optim.AdamW(list(params.values()), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    scales, made = [], []
    for step in range(steps):
        opt.zero_grad()
        mask = torch.zeros(SHAPES["w1"], dtype=torch.float64)
        mask[5, 3] = float("inf") if step == 1 else 0.0
        if mesh is not None:
            mask = make_global(mask, mesh, params["w1"].placements)
        scaler.scale(_loss(params) + (params["w1"] * mask).sum()).backward()
        if mesh is not None:
            mesh.binding.counters.reset()
        scaler.unscale_(opt)
        if mesh is not None:
            made.append(sorted(c.collective for c in mesh.binding.counters.calls))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return params, scales, made


@pytest.mark.parametrize("mesh_shape", sorted(LAYOUTS))
def test_grad_scaler_skips_a_step_on_every_rank_when_one_block_overflows(mesh_shape):
    # GradScaler's unscale op had no rule: the fallback gathered every gradient whole on every rank; now each
    # rank checks its own blocks and the ranks agree on found_inf with one all_reduce of one element (per axis)
    fulls = {k: randn(s, i) for i, (k, s) in enumerate(SHAPES.items())}
    ref, ref_scales, _ = _scaled_training({k: nn.Parameter(v.clone()) for k, v in fulls.items()})
    assert ref_scales == [2.0 ** 11, 2.0 ** 10, 2.0 ** 11]   # the second step skipped, the scale halved

    def fn(mesh):
        with sbp.strict():
            params = {k: nn.Parameter(make_global(v, mesh, LAYOUTS[mesh_shape][k])) for k, v in fulls.items()}
            params, scales, made = _scaled_training(params, mesh)
            return {k: p.full() for k, p in params.items()}, scales, made

    for rank, (got, scales, made) in enumerate(sbp.testing.spmd(fn, mesh_shape)):
        assert scales == ref_scales, (rank, scales)
        assert made == [["all_reduce"] * len(mesh_shape)] * 3, (rank, made)   # (one call per mesh axis)
        for k in SHAPES:
            assert torch.allclose(got[k], ref[k].detach(), atol=TOL, rtol=0), k
