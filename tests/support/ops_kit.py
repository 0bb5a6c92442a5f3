"""Shared helpers of the operator tests: random layouts (with random Partial parts), an op checker that
compares forward values and every input gradient against single-device torch, and Hypothesis strategies."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from hypothesis import strategies as st

import sbp
import sbp.testing
from sbp.tensor.global_tensor import GlobalTensor, local_from_full
from sbp.values.placement import Broadcast, Partial, Split, normalize
from tests.support.cases import OP_MESHES

TOL = 1e-10


def make_global(full: torch.Tensor, mesh: sbp.DeviceMesh, pls, seed: int = 0,
                requires_grad: bool = False) -> GlobalTensor:
    """A leaf global tensor holding `full` with `pls`; Partial parts are random (exact in float64):
    P(sum) parts get zero-sum noise along their axis, P(max|min) parts get smaller|larger values off coord 0."""
    pls = normalize(pls, full.ndim, mesh.ndim)
    local = local_from_full(full, mesh, pls)
    coord = mesh.coord
    kinds = {p.op for p in pls if isinstance(p, Partial)}
    if coord is not None and len(kinds) == 1 and full.is_floating_point() and local.numel():
        kind = kinds.pop()
        for axis, p in enumerate(pls):
            if not isinstance(p, Partial):
                continue
            # the same along Broadcast axes (B locals must be equal); free along the others
            rest = tuple(c for a, c in enumerate(coord) if a != axis and not isinstance(pls[a], Broadcast))
            g = torch.Generator().manual_seed(hash((seed, axis, rest, len(kind))) % (2 ** 31))
            noise = torch.randn(local.shape, generator=g, dtype=full.dtype)
            if kind == "sum":
                local = local + (noise * -(mesh.shape[axis] - 1) if coord[axis] == 0 else noise)
            elif coord[axis] != 0:
                here = tuple(c for a, c in enumerate(coord) if not isinstance(pls[a], Broadcast))
                g2 = torch.Generator().manual_seed(hash((seed, axis, here, len(kind) + 7)) % (2 ** 31))
                delta = torch.rand(local.shape, generator=g2, dtype=full.dtype) + 0.1
                local = local - delta if kind == "max" else local + delta
    x = GlobalTensor(local.contiguous(), mesh, pls, tuple(full.shape))
    return x.requires_grad_(True) if requires_grad else x


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_op(fn: Callable, fulls: Sequence[torch.Tensor], pls: Sequence, mesh_shape: tuple[int, ...], *,
             backward: bool = True, strict: bool = True, tol: float = TOL, plain: Sequence[int] = (),
             out_placements: Callable | None = None) -> list:
    """Run `fn` on global tensors laid out with `pls` (inputs listed in `plain` stay plain tensors) and on
    the plain `fulls`; the logical outputs and every input gradient must match. Returns per-rank outputs'
    placements."""
    grad_ok = [f.is_floating_point() and backward for f in fulls]
    seeds = torch.Generator().manual_seed(len(fulls) * 7 + sum(f.numel() for f in fulls))

    def reference():
        xs = [f.clone().requires_grad_(g) for f, g in zip(fulls, grad_ok)]
        outs = _as_list(fn(*xs))
        return xs, outs

    xs_ref, outs_ref = reference()
    weights = [torch.randn(o.shape, dtype=o.dtype, generator=seeds)
               if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outs_ref]
    grads_ref = None
    if any(grad_ok) and any(w is not None and o.requires_grad for w, o in zip(weights, outs_ref)):
        loss = sum((o * w).sum() for o, w in zip(outs_ref, weights) if w is not None and o.requires_grad)
        loss.backward()
        grads_ref = [x.grad for x in xs_ref]

    def rank(mesh):
        ctx = sbp.strict() if strict else _nullcontext()
        with ctx:
            xs = [f.clone().requires_grad_(g) if i in plain else
                  make_global(f, mesh, p, seed=i, requires_grad=g)
                  for i, (f, p, g) in enumerate(zip(fulls, pls, grad_ok))]
            outs = _as_list(fn(*xs))
            got = [o.full() if isinstance(o, GlobalTensor) else o for o in outs]
            grads = None
            if grads_ref is not None:
                loss = sum((g * w).sum() for g, w, o in zip(got, weights, outs_ref)
                           if w is not None and o.requires_grad)
                loss.backward()
                grads = [None if x.grad is None else x.grad.full() if isinstance(x.grad, GlobalTensor) else x.grad
                         for x in xs]
                for x, i in zip(xs, range(len(xs))):
                    if isinstance(x.grad, GlobalTensor) and i not in plain:
                        want = tuple(Broadcast() if isinstance(p, Partial) else p for p in x.placements)
                        assert x.grad.placements == want, (x.grad.placements, want)
        return got, grads, [o.placements if isinstance(o, GlobalTensor) else None for o in outs]

    results = sbp.testing.spmd(rank, mesh_shape)
    for r, (got, grads, _) in enumerate(results):
        assert len(got) == len(outs_ref)
        for k, (g, e) in enumerate(zip(got, outs_ref)):
            if e is None:
                assert g is None
                continue
            assert tuple(g.shape) == tuple(e.shape), f"rank {r} output {k}: shape {tuple(g.shape)} != {tuple(e.shape)}"
            assert g.dtype == e.dtype, f"rank {r} output {k}: dtype {g.dtype} != {e.dtype}"
            _close(g, e.detach(), tol, f"rank {r} output {k}")
        if grads_ref is not None:
            for i, (g, e) in enumerate(zip(grads, grads_ref)):
                if e is None:
                    continue
                assert g is not None, f"rank {r}: input {i} got no gradient"
                _close(g, e, tol, f"rank {r} grad of input {i}")
    return [pl for _, _, pl in results]


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    if got.dtype.is_floating_point or got.dtype.is_complex:
        ok = torch.allclose(got, want, atol=tol, rtol=tol, equal_nan=True)
    else:
        ok = torch.equal(got, want)
    if not ok:
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else float("nan")
        raise AssertionError(f"{what}: mismatch (max abs diff {diff})\n got {got}\nwant {want}")


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- strategies ------------------------------------------------------------------------------------------------------
meshes = st.sampled_from(OP_MESHES)


@st.composite
def placements_for(draw, ndim: int, mesh_ndim: int, partial: Sequence[str] = ("sum",)) -> tuple:
    """Random placements of an `ndim`-d tensor on a mesh with `mesh_ndim` axes (Partial kinds from `partial`)."""
    options = [Split(d) for d in range(ndim)] + [Broadcast()] + [Partial(op) for op in partial]
    return tuple(draw(st.sampled_from(options)) for _ in range(mesh_ndim))


def shape(draw, ndim: int, lo: int = 1, hi: int = 5) -> tuple[int, ...]:
    return tuple(draw(st.integers(lo, hi)) for _ in range(ndim))


def randn(shape: Sequence[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * len(shape) + int(math.prod(shape)))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64)
