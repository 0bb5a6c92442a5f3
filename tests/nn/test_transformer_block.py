"""A small transformer block (causal attention, GELU MLP, layer norms, residuals, cross-entropy) on global
tensors with Megatron-style sharded weights matches the single-device block in the loss and every
gradient (float64, 1e-10), inside `sbp.strict()` -- so no op fell back to replication."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sbp
import sbp.testing
from sbp import B, S

TOL = 1e-10


class Block(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 4, vocab: int = 11, mask: str = "masked_fill") -> None:
        super().__init__()
        self.heads, self.mask = heads, mask
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape                                                    # (B, T, C)
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))                      # (B, H, T, hd)
        if self.mask == "sdpa":                                              # the fused kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5      # (B, H, T, T)
            causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
            if self.mask == "additive":
                att = att + torch.zeros(t, t, dtype=att.dtype).masked_fill(~causal, float("-inf"))
            else:
                att = att.masked_fill(~causal, float("-inf"))
            y = att.softmax(-1) @ v                                          # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(b, t, c)                     # (B, T, C)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        logits = self.head(x)                                                # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# tensor-parallel placements on the last mesh axis; data parallel (batch S(0)) on the first of two
COLWISE = {"q": S(0), "k": S(0), "v": S(0), "fc1": S(0), "head": S(0)}
ROWWISE = {"proj": S(1), "fc2": S(1)}


def _placements(name: str, ndim: int, mesh_ndim: int) -> tuple:
    module, kind = name.split(".")
    tp = B
    if module in COLWISE:
        tp = S(0)                      # weight (out, in) and bias (out,): split the output features
    elif module in ROWWISE and kind == "weight":
        tp = S(1)                      # weight (out, in): split the input features; bias B
    return (B,) * (mesh_ndim - 1) + (tp,)


def _shard(model: nn.Module, mesh: sbp.DeviceMesh) -> nn.Module:
    model = copy.deepcopy(model)
    for name, p in list(model.named_parameters()):
        owner_name, attr = name.split(".")
        owner = getattr(model, owner_name)
        g = sbp.distribute(p.detach(), mesh, _placements(name, p.ndim, mesh.ndim))
        setattr(owner, attr, nn.Parameter(g))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, mask", [((2,), "masked_fill"), ((2, 2), "additive"), ((3,), "masked_fill"),
                                              ((2, 2), "sdpa")])
def test_sharded_block_matches_single_device(mesh_shape, mask):
    torch.manual_seed(0)
    model = Block(mask=mask).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)        # batch 3: uneven over a data-parallel axis of 2
    targets = torch.randint(0, 11, (3, 5))
    ref = copy.deepcopy(model)
    ref_loss = ref(x, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def fn(mesh):
        with sbp.strict():
            sharded = _shard(model, mesh)
            batch = (S(0),) * (mesh.ndim - 1) + (B,)
            loss = sharded(sbp.distribute(x, mesh, batch), sbp.distribute(targets, mesh, batch))
            loss.backward()
            grads = {}
            for n, p in sharded.named_parameters():
                assert p.grad.placements == p.placements, (n, p.grad.placements, p.placements)
                grads[n] = p.grad.full()
            return loss.full(), grads

    for loss, grads in sbp.testing.spmd(fn, mesh_shape):
        assert torch.allclose(loss, ref_loss.detach(), atol=TOL, rtol=0)
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            assert torch.allclose(g, ref_grads[n], atol=TOL, rtol=0), n
