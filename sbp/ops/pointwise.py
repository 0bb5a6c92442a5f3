"""Pointwise ops (ATen tag `pointwise`, plus a few untagged spellings): signatures per mesh axis.

=====================================  ======================================================
inputs (broadcast right-aligned)       output
=====================================  ======================================================
every input S(d') of output dim d      S(d)   (an input broadcast along d, or lacking it, is B)
all B                                  B
P(sum) on one `LINEAR` group, rest B   P(sum) (e.g. add: P+P; mul: P*B, B*P; div: P/B; neg P)
P(max|min) where `MONOTONE`            P(max|min) (relu, exp, sigmoid, tanh, clamp, maximum...)
P(max|min) where `ANTITONE` (neg)      P(min|max)   (floating dtypes: integer neg wraps)
=====================================  ======================================================

A Partial signature needs every argument of the group to be a tensor (a plain tensor is B, which
becomes Partial for free) or a scalar 0; `x + 1` on P(sum) therefore first reduces `x`. Non-linear ops
(exp, gelu, comparisons, ...) have no P(sum) signature: their Partial inputs are reduced first (the
planner picks the cheaper of reduce_scatter to a split or all_reduce to B).
"""
from __future__ import annotations

from typing import Any

import torch

from ..values.placement import Split
from .spec import PMAX, PMIN, PSUM, B, OpSpec, Ref, Rule, Sig  # noqa: F401 (Ref: doctests)

# "name.overload" (in-place "_" dropped) -> groups of arguments the op is jointly linear in
LINEAR: dict[str, tuple[tuple[str, ...], ...]] = {
    "add.Tensor": (("self", "other"),),
    "add.Scalar": (("self", "other"),),
    "sub.Tensor": (("self", "other"),),
    "sub.Scalar": (("self", "other"),),
    "mul.Tensor": (("self",), ("other",)),
    "mul.Scalar": (("self",),),
    "div.Tensor": (("self",),),
    "div.Scalar": (("self",),),
    "true_divide.Tensor": (("self",),),
    "neg.default": (("self",),),
    "positive.default": (("self",),),
    "clone.default": (("self",),),
    "alias.default": (("self",),),
    "detach.default": (("self",),),
    "addcmul.default": (("self", "tensor1"), ("self", "tensor2")),
    "addcdiv.default": (("self", "tensor1"),),
    "lerp.Scalar": (("self", "end"),),
    "lerp.Tensor": (("self", "end"),),
    "where.self": (("self", "other"),),
    "where.ScalarOther": (("self", "other"),),
    "where.ScalarSelf": (("self", "other"),),
    "masked_fill.Scalar": (("self", "value"),),
    "masked_fill.Tensor": (("self", "value"),),
    # backward ops: linear in the incoming gradient
    "threshold_backward.default": (("grad_output",),),
    "gelu_backward.default": (("grad_output",),),
    "silu_backward.default": (("grad_output",),),
    "sigmoid_backward.default": (("grad_output",),),
    "tanh_backward.default": (("grad_output",),),
    "hardtanh_backward.default": (("grad_output",),),
    "leaky_relu_backward.default": (("grad_output",),),
    "elu_backward.default": (("grad_output",),),
    "softplus_backward.default": (("grad_output",),),
    "mish_backward.default": (("grad_output",),),
    "hardswish_backward.default": (("grad_output",),),
    "hardsigmoid_backward.default": (("grad_output",),),
    "log_sigmoid_backward.default": (("grad_output",),),
    "softshrink_backward.default": (("grad_output",),),
    "hardshrink_backward.default": (("grad_out",),),
}

# non-decreasing in each listed argument (the others Broadcast): P(max) -> P(max), P(min) -> P(min)
MONOTONE: dict[str, tuple[str, ...]] = {
    "relu.default": ("self",), "exp.default": ("self",), "sigmoid.default": ("self",), "tanh.default": ("self",),
    "clamp.default": ("self",), "clamp.Tensor": ("self",), "clamp_min.default": ("self",),
    "clamp_max.default": ("self",), "maximum.default": ("self", "other"), "minimum.default": ("self", "other"),
    "clone.default": ("self",), "alias.default": ("self",), "detach.default": ("self",),
    "positive.default": ("self",),
}
# jointly: maximum(P(max), P(max)) -> P(max), minimum(P(min), P(min)) -> P(min)
JOINT = {"maximum.default": PMAX, "minimum.default": PMIN}
ANTITONE: dict[str, tuple[str, ...]] = {"neg.default": ("self",)}   # P(max) <-> P(min)

# pointwise ops ATen does not tag (activation backward kernels, dunder bit ops, a few spellings)
UNTAGGED = ("masked_fill.Tensor", "where.ScalarOther", "where.ScalarSelf", "where.Scalar", "floor_divide.default",
            "floor_divide.Scalar", "hardswish.default", "log_sigmoid_forward.default", "__and__.Tensor",
            "__or__.Tensor", "__xor__.Tensor", "hardtanh_backward.default", "leaky_relu_backward.default",
            "elu_backward.default", "softplus_backward.default", "mish_backward.default",
            "hardswish_backward.default", "hardsigmoid_backward.default", "log_sigmoid_backward.default",
            "softshrink_backward.default", "hardshrink_backward.default")


def op_name(func) -> str:
    """``"add.Tensor"`` for both ``aten.add.Tensor`` and ``aten.add_.Tensor``.

    >>> op_name(torch.ops.aten.add_.Tensor)
    'add.Tensor'
    """
    name = func._schema.name.split("::")[-1]
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return f"{name}.{func._overloadname}"


def is_pointwise(func) -> bool:
    """ATen-tagged pointwise (and not random), or one of the untagged pointwise spellings.

    >>> is_pointwise(torch.ops.aten.mul.Tensor), is_pointwise(torch.ops.aten.mm.default)
    (True, False)
    """
    tags = func.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    name = op_name(func)
    if torch.Tag.pointwise in tags or name in UNTAGGED:
        return True
    packet, overload = name.split(".")
    functional = getattr(getattr(torch.ops.aten, packet, None), overload, None)  # add_.Tensor -> add.Tensor
    return functional is not None and functional is not func and torch.Tag.pointwise in functional.tags


def broadcast_sigs(spec: OpSpec, nout: int) -> list[Sig]:
    """Split any output dim (inputs right-aligned; a broadcast input stays B), or all B.

    >>> from sbp.ops.spec import TensorMeta
    >>> ins = (TensorMeta((4, 3), torch.float32), TensorMeta((1, 3), torch.float32))
    >>> spec = OpSpec(torch.ops.aten.add.Tensor, (2,), {}, ins, (TensorMeta((4, 3), torch.float32),))
    >>> broadcast_sigs(spec, 1)
    [(S(0), B) -> (S(0),), (S(1), S(1)) -> (S(1),), (B, B) -> (B,)]
    """
    out = spec.out
    sigs = []
    for d in range(out.ndim):
        ins = []
        for t in spec.inputs:
            k = d - (out.ndim - t.ndim)
            ins.append(Split(k) if k >= 0 and t.shape[k] == out.shape[d] else B)
        sigs.append(Sig(tuple(ins), (Split(d),) * nout))
    sigs.append(Sig((B,) * len(spec.inputs), (B,) * nout))
    return sigs


def _scalar_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


DIVISIONS = ("div.Tensor", "div.Scalar", "true_divide.Tensor")


def _group_ok(spec: OpSpec, name: str, group: tuple[str, ...]) -> bool:
    """Every argument of the group is a tensor or a scalar zero, and at least one is a tensor; no scalar
    outside the group is inf or nan (``inf * (a + b)`` is not ``inf * a + inf * b`` when a part is 0 or
    the parts' signs differ), and a division's scalar divisor is not zero (for the same reason)."""
    values = [spec.values.get(arg) for arg in group]
    if not any(isinstance(v, Ref) for v in values) or not all(isinstance(v, Ref) or _scalar_zero(v) for v in values):
        return False
    for arg, v in spec.values.items():
        if arg not in group and type(v) is float and v - v != 0:
            return False
    return not (name in DIVISIONS and _scalar_zero(spec.values.get("other")))


def partial_sigs(spec: OpSpec, name: str, nout: int) -> list[Sig]:
    """The Partial signatures of op `name` from the LINEAR / MONOTONE / ANTITONE tables.

    >>> from sbp.ops.spec import TensorMeta
    >>> ins = (TensorMeta((4,), torch.float32), TensorMeta((4,), torch.float32))
    >>> spec = OpSpec(torch.ops.aten.mul.Tensor, (2,), {"self": Ref(0), "other": Ref(1)}, ins,
    ...               (TensorMeta((4,), torch.float32),))
    >>> partial_sigs(spec, "mul.Tensor", 1)
    [(P(sum), B) -> (P(sum),), (B, P(sum)) -> (P(sum),)]
    """
    out_dtype = spec.out.dtype
    sigs = []
    if out_dtype is not torch.bool:
        for group in LINEAR.get(name, ()):
            if _group_ok(spec, name, group):
                sigs.append(spec.sig({g: PSUM for g in group}, (PSUM,) * nout))
    if out_dtype.is_complex or out_dtype is torch.bool:
        return sigs
    for arg in MONOTONE.get(name, ()):
        if isinstance(spec.values.get(arg), Ref):
            sigs += [spec.sig({arg: p}, (p,) * nout) for p in (PMAX, PMIN)]
    if name in JOINT:
        p = JOINT[name]
        sigs.append(spec.sig({"self": p, "other": p}, (p,) * nout))
    if out_dtype.is_floating_point:   # integer neg wraps (-(-128) is -128 in int8, -x of uint8 is 256 - x)
        for arg in ANTITONE.get(name, ()):
            sigs += [spec.sig({arg: PMAX}, (PMIN,) * nout), spec.sig({arg: PMIN}, (PMAX,) * nout)]
    return sigs


def pointwise_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """The pointwise rule's signatures: `broadcast_sigs` then `partial_sigs` (same on every axis).

    >>> from sbp.ops.spec import TensorMeta
    >>> spec = OpSpec(torch.ops.aten.neg.default, (2,), {"self": Ref(0)}, (TensorMeta((3,), torch.float32),),
    ...               (TensorMeta((3,), torch.float32),))
    >>> pointwise_sigs(spec, 0)
    [(S(0),) -> (S(0),), (B,) -> (B,), (P(sum),) -> (P(sum),), (P(max),) -> (P(min),), (P(min),) -> (P(max),)]
    """
    nout = len(spec.outputs)
    return broadcast_sigs(spec, nout) + partial_sigs(spec, op_name(spec.func), nout)


POINTWISE = Rule(pointwise_sigs, doc="S(d)..->S(d) (broadcast inputs B); B..->B; P(sum) on a linear group; "
                                     "P(max|min) through monotone ops")


# ---- dtype casts and copies ------------------------------------------------------------------------------------
def _to_copy_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    src, dst = spec.inputs[0].dtype, spec.out.dtype
    sigs = broadcast_sigs(spec, 1)
    if src == dst or _widens(src, dst):
        sigs.append(Sig((PSUM,), (PSUM,)))   # rounding each part would not sum to the rounded value
    if dst is not torch.bool and not dst.is_complex and not src.is_complex and not _wraps(src, dst):
        sigs += [Sig((PMAX,), (PMAX,)), Sig((PMIN,), (PMIN,))]  # rounding and truncation are monotone
    return sigs


def _wraps(src: torch.dtype, dst: torch.dtype) -> bool:
    """An integer cast that does not keep every value (narrower, or signed <-> unsigned): it wraps around,
    so it is not monotone (int64 200 -> int8 -56, int64 -1 -> uint8 255).

    >>> _wraps(torch.int64, torch.int8), _wraps(torch.int8, torch.uint8), _wraps(torch.uint8, torch.int16)
    (True, True, False)
    """
    integral = lambda t: not t.is_floating_point and not t.is_complex and t is not torch.bool
    return integral(src) and integral(dst) and torch.promote_types(src, dst) != dst


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every value of `src` is exact in `dst` (float16/bfloat16 -> float32 -> float64, complex likewise)."""
    rank = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
    if src in rank and dst in rank:
        return rank[src] < rank[dst]
    return (src, dst) == (torch.complex64, torch.complex128)


TO_COPY = Rule(_to_copy_sigs, doc="S/B kept; P(sum) when the dtype is kept or widened; P(max|min) unless ->bool or "
                                   "a wrapping integer cast")


def _identity_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    n = len(spec.inputs)
    sigs = broadcast_sigs(spec, len(spec.outputs))
    return sigs + [Sig((p,) * n, (p,) * len(spec.outputs)) for p in (PSUM, PMAX, PMIN)]


IDENTITY = Rule(_identity_sigs, doc="any placement kept (S, B, P)")
# `x.detach()` (also `x.data`, `state_dict()`'s values): the result's local is x's local itself, not an ATen
# detach of it -- run below autograd, that would be a new tensor with a version counter of its own, and a
# write into the result's local (`sbp.load` into a state dict's values) would not count as a change of x
# (fully_shard's gathered copies go stale by x's counters). In-place views replace a wrapper's
# local instead of changing it (`sbp.ops.views.inplace_view`), so sharing it is safe.
DETACH = Rule(_identity_sigs, run=lambda call: call.args[0],
              doc="any placement kept (S, B, P); the local tensor shared with the input's")


def _linear_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    return broadcast_sigs(spec, 1) + [Sig((PSUM,), (PSUM,))]


def _complex_view_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """view_as_real adds a last dim of 2 (real, imag), view_as_complex removes it: the other dims keep
    their splits; B and P(sum) pass (both views are linear)."""
    ndim = min(spec.inputs[0].ndim, spec.out.ndim)
    return [Sig((Split(d),), (Split(d),)) for d in range(ndim)] + [Sig((B,), (B,)), Sig((PSUM,), (PSUM,))]


COMPLEX_VIEW = Rule(_complex_view_sigs, doc="S(d)->S(d) for the dims both sides have; B; P(sum)")


# torch's lazy conjugate / negative views set a bit on the result; a wrapper's local carrying the bit is
# read inconsistently by the ops that later run inside dispatch, so the local is conjugated (negated) now
CONJ = Rule(_linear_sigs, run=lambda call: torch.conj_physical(call.args[0]),
            doc="S/B/P(sum) kept; the local conjugated at once (no lazy conjugate bit)")
NEG_VIEW = Rule(_linear_sigs, run=lambda call: torch.neg(call.args[0]),
                doc="S/B/P(sum) kept; the local negated at once (no lazy negative bit)")


