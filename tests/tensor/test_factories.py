"""Factories: only the local block is allocated, Partial placements hold the value exactly once, and
rand / randn give the same logical tensor on every mesh, every layout and in a single process."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings

import sbp
import sbp.testing
from sbp.testing.strategies import layouts

spmd = functools.partial(sbp.testing.spmd, timeout=30)


def _constant_factories(shape, pls, mesh):
    out = []
    for name, x in (("zeros", sbp.zeros(shape, mesh, pls)), ("ones", sbp.ones(shape, mesh, pls)),
                    ("full", sbp.full(shape, 2.5, mesh, pls, dtype=torch.float64)),
                    ("empty", sbp.empty(shape, mesh, pls, dtype=torch.int32))):
        local_ok = tuple(x.local_shape) == sbp.local_shape(shape, mesh, pls, mesh.coord)
        out.append((name, type(x).__name__, x.dtype, local_ok, x.placements == sbp.placements(pls),
                    None if name == "empty" else x.full().tolist()))
    return out


@pytest.mark.parametrize("mesh_shape,pls", [((4,), "S(0)"), ((2, 2), "P(sum), S(1)"), ((2, 2), "P(max), B")])
def test_constant_factories(mesh_shape, pls):
    shape = (5, 3)
    for per_rank in spmd(functools.partial(_constant_factories, shape, pls), mesh_shape):
        for name, kind, dtype, local_ok, pls_ok, value in per_rank:
            assert kind == "GlobalTensor" and local_ok and pls_ok
            expect = {"zeros": 0.0, "ones": 1.0, "full": 2.5, "empty": None}[name]
            assert dtype == {"full": torch.float64, "empty": torch.int32}.get(name, torch.float32)
            if expect is not None:
                assert value == torch.full(shape, expect).tolist(), name


def test_factories_without_mesh_and_requires_grad():
    assert torch.equal(sbp.full((2, 2), 3), torch.full((2, 2), 3))
    assert sbp.zeros(0).shape == (0,)

    def fn(mesh):
        x = sbp.ones((4,), mesh, "S(0)", requires_grad=True)
        x.full().sum().backward()
        return x.is_leaf, x.requires_grad, x.grad.placements, x.grad.to_local().tolist()

    assert spmd(fn, (2,)) == [(True, True, (sbp.S(0),), [1.0, 1.0])] * 2
    with pytest.raises(sbp.SbpError, match="need a mesh"):
        sbp.zeros((2,), None, "S(0)")
    with pytest.raises(sbp.SbpError, match="bound to processes"):
        sbp.zeros((2,), sbp.DeviceMesh((2,)), "S(0)")


def _random_full(shape, pls, dtype, mesh):
    return sbp.randn(shape, mesh, pls, seed=1234, dtype=dtype).full(), sbp.rand(shape, mesh, pls, seed=5).full()


@pytest.mark.parametrize("mesh_shape,pls", [((4,), "S(0)"), ((4,), "S(1)"), ((2, 2), "S(1), S(0)"),
                                            ((2, 2), "P(sum), S(0)"), ((2, 2), "B, P(min)")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_is_layout_independent(mesh_shape, pls, dtype):
    shape = (70, 1000)          # 70000 elements: more than one random chunk, uneven over every mesh
    single_n, single_u = sbp.randn(shape, seed=1234, dtype=dtype), sbp.rand(shape, seed=5)
    for n, u in spmd(functools.partial(_random_full, shape, pls, dtype), mesh_shape):
        assert torch.equal(n, single_n) and torch.equal(u, single_u)
    assert abs(single_n.double().mean()) < 0.02 and 0.98 < single_n.double().std() < 1.02
    assert 0 <= single_u.min() and single_u.max() < 1


@settings(max_examples=20, deadline=None)
@given(case=layouts(max_side=7))
def test_randn_small_shapes_any_layout(case):
    mesh_shape, shape, pls = case
    single = sbp.randn(shape, seed=3)
    fn = lambda mesh: sbp.randn(shape, mesh, pls, seed=3).full()
    for full in spmd(fn, mesh_shape):
        assert torch.equal(full, single)


def test_seeds_differ_and_unseeded_ranks_agree():
    assert not torch.equal(sbp.randn((8,), seed=0), sbp.randn((8,), seed=1))

    def fn(mesh):
        g = torch.Generator().manual_seed(100 + mesh.rank)    # ranks disagree: coord 0's draw wins
        return sbp.randn((6,), mesh, "S(0)", generator=g).full()

    out = spmd(fn, (2,))
    assert torch.equal(out[0], out[1])
    with pytest.raises(sbp.SbpError, match="floating dtype"):
        sbp.rand((2,), seed=0, dtype=torch.int64)
