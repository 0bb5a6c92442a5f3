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
planner picks the cheaper of reduce_scatter to a split or all_reduce to B). A Partial argument also needs
its parts to survive the conversion to the result's dtype (`sbp.ops.spec.keeps_partial`): `x * 0.5` of an
int64 P(sum) is float32 and first reduces `x`; `.long()` of a P(max) float first reduces it.
"""
from __future__ import annotations

from typing import Any

import torch

from ..values.placement import Split
from .spec import PMAX, PMIN, PSUM, B, OpSpec, Ref, Rule, Sig, contiguous_run, converts_parts, keeps_partial  # noqa: F401 (Ref: doctests)

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


def _group_ok(spec: OpSpec, name: str, group: tuple[str, ...], axis: int) -> bool:
    """Every argument of the group is a tensor or a scalar zero, and at least one is a tensor; every tensor's
    parts survive the conversion to the result's dtype (`_carries`: an int64 P(sum) times 0.5 is float32,
    and parts 2**40 + 1 and -2**40 converted one by one sum to 0); no scalar outside the group is inf or
    nan (``inf * (a + b)`` is not ``inf * a + inf * b`` when a part is 0 or the parts' signs differ), and a
    division's scalar divisor is not zero (for the same reason)."""
    values = [spec.values.get(arg) for arg in group]
    if not any(isinstance(v, Ref) for v in values) or not all(isinstance(v, Ref) or _scalar_zero(v) for v in values):
        return False
    if not all(_carries(spec, arg, PSUM, axis) for arg, v in zip(group, values) if isinstance(v, Ref)):
        return False
    for arg, v in spec.values.items():
        if arg not in group and type(v) is float and v - v != 0:
            return False
    return not (name in DIVISIONS and _scalar_zero(spec.values.get("other")))


def _carries(spec: OpSpec, arg: str, p, axis: int) -> bool:
    """Argument `arg` is a tensor that may be laid out as `p` on `axis` and converted to the result's dtype
    part by part (`converts_parts`)."""
    t = spec.tensor(arg)
    return t is not None and converts_parts(t, axis, p, spec.out.dtype)


def partial_sigs(spec: OpSpec, name: str, nout: int, axis: int) -> list[Sig]:
    """The Partial signatures of op `name` on mesh axis `axis` from the LINEAR / MONOTONE / ANTITONE
    tables, for arguments whose parts survive the conversion to the result's dtype (`_carries`).

    >>> from sbp.ops.spec import TensorMeta
    >>> ins = (TensorMeta((4,), torch.float32, (PSUM,)), TensorMeta((4,), torch.float32, (B,)))
    >>> spec = OpSpec(torch.ops.aten.mul.Tensor, (2,), {"self": Ref(0), "other": Ref(1)}, ins,
    ...               (TensorMeta((4,), torch.float32),))
    >>> partial_sigs(spec, "mul.Tensor", 1, 0)
    [(P(sum), B) -> (P(sum),), (B, P(sum)) -> (P(sum),)]
    >>> spec.inputs = (TensorMeta((4,), torch.int64, (PSUM,)), ins[1])    # int64 parts to float32: not exact
    >>> partial_sigs(spec, "mul.Tensor", 1, 0)
    [(B, P(sum)) -> (P(sum),)]
    """
    out_dtype = spec.out.dtype
    sigs = []
    if out_dtype is not torch.bool:
        for group in LINEAR.get(name, ()):
            if _group_ok(spec, name, group, axis):
                sigs.append(spec.sig({g: PSUM for g in group}, (PSUM,) * nout))
    if out_dtype.is_complex or out_dtype is torch.bool:
        return sigs
    for arg in MONOTONE.get(name, ()):
        sigs += [spec.sig({arg: p}, (p,) * nout) for p in (PMAX, PMIN) if _carries(spec, arg, p, axis)]
    if name in JOINT:
        p = JOINT[name]
        if _carries(spec, "self", p, axis) and _carries(spec, "other", p, axis):
            sigs.append(spec.sig({"self": p, "other": p}, (p,) * nout))
    if out_dtype.is_floating_point:   # integer neg wraps (-(-128) is -128 in int8, -x of uint8 is 256 - x)
        for arg in ANTITONE.get(name, ()):
            if _carries(spec, arg, PMAX, axis):
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
    return broadcast_sigs(spec, nout) + partial_sigs(spec, op_name(spec.func), nout, axis)


POINTWISE = Rule(pointwise_sigs, doc="S(d)..->S(d) (broadcast inputs B); B..->B; P(sum) on a linear group; "
                                     "P(max|min) through monotone ops")


# ---- dtype casts and copies ------------------------------------------------------------------------------------
def _to_copy_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """S and B kept; a Partial kept where converting each part gives parts of the converted value
    (`keeps_partial`: P(sum) through exact casts, P(max|min) through monotone ones), else reduced first.

    >>> from sbp.ops.spec import TensorMeta
    >>> cast = lambda a, b: OpSpec(torch.ops.aten._to_copy.default, (2,), {}, (TensorMeta((3,), a),),
    ...                           (TensorMeta((3,), b),))
    >>> _to_copy_sigs(cast(torch.float32, torch.float64), 0)[2:], _to_copy_sigs(cast(torch.float64, torch.int64), 0)[2:]
    ([(P(sum),) -> (P(sum),), (P(max),) -> (P(max),), (P(min),) -> (P(min),)], [])
    """
    src, dst = spec.inputs[0].dtype, spec.out.dtype
    return broadcast_sigs(spec, 1) + [Sig((p,), (p,)) for p in (PSUM, PMAX, PMIN) if keeps_partial(p, src, dst)]


TO_COPY = Rule(_to_copy_sigs, doc="S/B kept; P(sum) through exact casts (kept or widened dtype); P(max|min) through "
                                   "monotone ones (not float->int, a narrowing or sign-changing int cast, ->bool)")


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


COMPLEX_VIEW = Rule(_complex_view_sigs, run=contiguous_run,   # (view_as_complex reads the local's strides)
                    doc="S(d)->S(d) for the dims both sides have; B; P(sum)")


# torch's lazy conjugate / negative views set a bit on the result; a wrapper's local carrying the bit is
# read inconsistently by the ops that later run inside dispatch, so the local is conjugated (negated) now
CONJ = Rule(_linear_sigs, run=lambda call: torch.conj_physical(call.args[0]),
            doc="S/B/P(sum) kept; the local conjugated at once (no lazy conjugate bit)")
NEG_VIEW = Rule(_linear_sigs, run=lambda call: torch.neg(call.args[0]),
                doc="S/B/P(sum) kept; the local negated at once (no lazy negative bit)")


