"""Ops that work along some dims (reductions, scans, softmax, sort, tril...): signatures per mesh axis.

An op *along* dims D acts independently on every slice across the other dims, so a split of any other
dim passes through (renumbered when D is dropped). A split of a dim in D is accepted only where the op
decomposes over pieces:

==========================  =========================  =======================  ====================
op                          S(d), d not in D            S(d), d in D              Partial input
==========================  =========================  =======================  ====================
sum, mean                   S(d')                       P(sum)                    P(sum) -> P(sum)
amax, max (all dims)        S(d')                       P(max)                    P(max) -> P(max)
amin, min (all dims)        S(d')                       P(min)                    P(min) -> P(min)
cumsum                      S(d)                        (redistribute)            P(sum) -> P(sum)
tril, triu, flip            S(d)                        (redistribute)            P(any) -> same
var, std, logsumexp, norm,  S(d')                       (redistribute)            (reduce first)
argmax, max/min.dim, sort,
topk, prod, all, any
==========================  =========================  =======================  ====================

`mean` computes ``sum(local) / N`` with N the *global* number of reduced elements, so it is exact on
uneven shards; an empty shard of amax/amin contributes the op's identity (-inf / +inf). A Partial input
passes only where its parts survive the conversion to the result's dtype (`keeps_partial`: ``dtype=`` of
sum, mean and cumsum; int32 sums to int64): a narrowing ``dtype=`` reduces it first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..runtime.executor import identity
from ..values.placement import Partial, Split
from .pointwise import op_name
from .spec import PMAX, PMIN, PSUM, B, Call, OpSpec, Rule, Sig, default_run, dims_of, keeps_partial

aten = torch.ops.aten

Along = Callable[[OpSpec], tuple[tuple[int, ...], bool]]   # spec -> (dims D, keepdim)


def _dim_keep(dim_arg: str = "dim") -> Along:
    """Read D from argument `dim_arg` (None or [] means every dim) and keepdim from "keepdim"."""
    def along(spec: OpSpec) -> tuple[tuple[int, ...], bool]:
        ndim = spec.inputs[0].ndim
        return dims_of(spec.arg(dim_arg), ndim), bool(spec.arg("keepdim", False))
    return along


def _all_dims(spec: OpSpec) -> tuple[tuple[int, ...], bool]:
    return tuple(range(spec.inputs[0].ndim)), False


def _same_shape(dim_arg: str) -> Along:
    """Ops that keep every dim (scans, softmax, sort): D from `dim_arg`, output dims unchanged."""
    def along(spec: OpSpec) -> tuple[tuple[int, ...], bool]:
        return dims_of(spec.arg(dim_arg), spec.inputs[0].ndim), True
    return along


def _last_two(spec: OpSpec) -> tuple[tuple[int, ...], bool]:
    ndim = spec.inputs[0].ndim
    return tuple(range(max(ndim - 2, 0), ndim)), True


@dataclass(frozen=True, slots=True)
class AlongDims:
    """An op along dims: how to read D, and what a split of D / a Partial input becomes."""

    along: Along
    split_to: Optional[Partial] = None           # S(d in D) -> this Partial (decomposable reductions)
    partial_in: tuple[Partial, ...] = ()         # Partial inputs passed through unchanged
    run: Callable[[Call], Any] = default_run
    doc: str = ""

    def sigs(self, spec: OpSpec, axis: int) -> list[Sig]:
        x = spec.inputs[0]
        dims, keep = self.along(spec)
        nout = len(spec.outputs)
        rest = (B,) * (len(spec.inputs) - 1)     # e.g. a dtype-less extra tensor argument: Broadcast
        sigs = []
        for d in range(x.ndim):
            if d in dims:
                if self.split_to is not None:
                    sigs.append(Sig((Split(d),) + rest, (self.split_to,) * nout))
                continue
            out_d = d if keep else d - sum(1 for r in dims if r < d)
            sigs.append(Sig((Split(d),) + rest, (Split(out_d),) * nout))
        sigs.append(Sig((B,) + rest, (B,) * nout))
        # a Partial passes where its parts survive the conversion to the result's dtype (`x.sum(0, dtype=
        # torch.float16)` of P(sum) float64 parts would round each part first): elsewhere it is reduced first
        sigs += [Sig((p,) + rest, (p,) * nout) for p in self.partial_in if keeps_partial(p, x.dtype, spec.out.dtype)]
        return sigs

    def rule(self) -> Rule:
        return Rule(self.sigs, run=self.run, doc=self.doc)


def _run_mean(call: Call) -> Any:
    """sum over the local piece divided by the *global* count: exact for uneven shards."""
    spec = call.spec
    x = call.args[0]
    dims, keep = _dim_keep()(spec) if call.func is not aten.mean.default else _all_dims(spec)
    whole = spec.inputs[0].shape
    count = math.prod(whole[d] for d in dims if d < len(whole))   # a 0-d tensor's dim 0 counts 1, as in torch
    dtype = call.kwargs.get("dtype")
    total = aten.sum.dim_IntList(x, list(dims), keep, dtype=dtype)
    return total / count if count else total * math.nan


def _run_extreme(op: str, along: Along) -> Callable[[Call], Any]:
    """amax/amin/max/min: a local piece empty along a reduced dim the global tensor is not empty along (an
    empty shard) contributes the identity of `op` instead of failing; where the global reduction itself has
    nothing to reduce, every rank fails as torch does."""
    def run(call: Call) -> Any:
        x, whole = call.args[0], call.spec.inputs[0].shape
        dims = [d for d in along(call.spec)[0] if d < len(whole)]   # (a 0-d tensor's dim 0 is no dim)
        if any(x.shape[d] == 0 for d in dims) and all(whole[d] > 0 for d in dims):
            return torch.full(call.out_shape(0), identity(op, x.dtype), dtype=x.dtype, device=x.device)
        return call.default()
    return run


SUM = AlongDims(_dim_keep(), PSUM, (PSUM,), doc="S(d in dims)->P(sum); S(other)->S; P(sum)->P(sum)")
SUM_ALL = AlongDims(_all_dims, PSUM, (PSUM,), doc="S->P(sum); P(sum)->P(sum)")
MEAN = AlongDims(_dim_keep(), PSUM, (PSUM,), _run_mean, doc="as sum; divides by the global count")
MEAN_ALL = AlongDims(_all_dims, PSUM, (PSUM,), _run_mean, doc="S->P(sum) (divided by the global numel)")
AMAX = AlongDims(_dim_keep(), PMAX, (PMAX,), _run_extreme("max", _dim_keep()),
              doc="S(d in dims)->P(max); P(max)->P(max)")
AMIN = AlongDims(_dim_keep(), PMIN, (PMIN,), _run_extreme("min", _dim_keep()),
              doc="S(d in dims)->P(min); P(min)->P(min)")
MAX_ALL = AlongDims(_all_dims, PMAX, (PMAX,), _run_extreme("max", _all_dims), doc="S->P(max); P(max)->P(max)")
MIN_ALL = AlongDims(_all_dims, PMIN, (PMIN,), _run_extreme("min", _all_dims), doc="S->P(min); P(min)->P(min)")
ALONG_DIM = AlongDims(_dim_keep(), doc="S(d not in dims)->S; dims must not be split")
ALONG_ALL = AlongDims(_all_dims, doc="B only")
SCAN = AlongDims(_same_shape("dim"), partial_in=(PSUM,), doc="S(d != dim)->S(d); P(sum)->P(sum)")
ALONG_KEEP = AlongDims(_same_shape("dim"), doc="S(d != dim)->S(d)")
TRIANGLE = AlongDims(_last_two, partial_in=(PSUM, PMAX, PMIN), doc="S(batch dims)->S; P->P")
FLIP = AlongDims(_same_shape("dims"), partial_in=(PSUM, PMAX, PMIN), doc="S(d not flipped)->S; P->P")
ROLL = AlongDims(_same_shape("dims"), partial_in=(PSUM, PMAX, PMIN),
                doc="S(d not rolled)->S (no dims: the flattened roll, every dim); P->P")
COUNT_NONZERO = AlongDims(_dim_keep(), PSUM, doc="S(d in dims)->P(sum); S(other)->S")


# ---- indexed ops along one dim: gather, scatter, scatter_add, index_select -------------------------------------------
def _indexed_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """Every tensor split alike on a dim d != `dim` where all have the output's length; Partial where linear.

    `index_select`'s / `index_add`'s 1-d index is always B; `gather` is linear in `self`; `scatter(_add)`
    jointly in `self` and `src`, `index_add` in `self` and `source`."""
    out = spec.out
    dim = spec.arg("dim") % max(out.ndim, 1)
    name = op_name(spec.func)
    vector_index = name in ("index_select.default", "index_add.default")   # a 1-d index: B
    sigs = []
    for d in range(out.ndim):
        if d == dim:
            continue
        if vector_index:
            sigs.append(spec.sig({"self": Split(d), "source": Split(d)}, (Split(d),)))
        elif all(t.ndim == out.ndim and t.shape[d] == out.shape[d] for t in spec.inputs):
            sigs.append(Sig((Split(d),) * len(spec.inputs), (Split(d),)))
    sigs.append(spec.sig({}, (B,)))
    linear = {"scatter.src": ("self", "src"), "scatter_add.default": ("self", "src"),
              "index_add.default": ("self", "source"), "gather.default": ("self",),
              "index_select.default": ("self",)}.get(name, ())
    if name == "scatter.value" and spec.arg("value") == 0:
        linear = ("self",)   # scattering a non-zero constant into every part would count it n times
    if out.dtype is not torch.bool and linear:
        sigs.append(spec.sig({arg: PSUM for arg in linear}, (PSUM,)))
    return sigs


INDEXED = Rule(_indexed_sigs, doc="S(d != dim) on all tensors (index_select: index B); B; P(sum) where linear")
