"""The values a sharding rule works with: what an op call looks like (`OpSpec`), a per-axis SBP
signature (`Sig`), the chosen whole-mesh placements (`Choice`), a rule (`Rule`) and a local call (`Call`).

A rule sees only what the decision cache keys on: global shapes, dtypes, current placements and the
non-tensor arguments, with every finite non-zero float replaced by `FLOAT` (so a rule can never depend on
a learning rate, only on whether a scalar is zero or not finite). Local computations (`Rule.run`) see the
real values.

Per mesh axis a signature gives one placement per tensor input (in flattened argument order; plain
tensors count and are Broadcast) and one per output slot (`None` outputs included)::

    mm on one axis:   (S(0), B) -> S(0)    (B, S(1)) -> S(1)    (S(1), S(0)) -> P(sum)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ..runtime.symbolic import block_of
from ..values.errors import ShapeError
from ..values.layout import Block, block_shape
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, Split

B = Broadcast()
PSUM, PMAX, PMIN = Partial("sum"), Partial("max"), Partial("min")


class _Float:
    """Stands for a finite non-zero float argument in an `OpSpec` (rules may not depend on its value)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FLOAT"


FLOAT = _Float()


class _Any:
    """A signature input placement meaning "whatever the input has on this axis": no redistribution."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ANY"


ANY = _Any()


@dataclass(frozen=True, slots=True)
class Ref:
    """Stands for the tensor input with flattened index `index` inside `OpSpec.values`."""

    index: int


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor argument or output: global shape, dtype and (inputs) current placements.

    A plain tensor mixed into an op is Broadcast (`is_global=False`).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[Placement, ...] = ()
    is_global: bool = True

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Sig:
    """One SBP signature on one mesh axis: a placement per tensor input and per output slot.

    >>> from sbp import S
    >>> Sig((S(1), S(0)), (PSUM,))
    (S(1), S(0)) -> (P(sum),)
    """

    inputs: tuple[Any, ...]
    outputs: tuple[Placement, ...]

    def __repr__(self) -> str:
        ins = "(" + ", ".join(map(repr, self.inputs)) + ("," if len(self.inputs) == 1 else "") + ")"
        outs = "(" + ", ".join(map(repr, self.outputs)) + ("," if len(self.outputs) == 1 else "") + ")"
        return f"{ins} -> {outs}"


@dataclass(slots=True)
class OpSpec:
    """One op call as the rules see it (cache-key information only).

    `values` maps every schema argument name to its value, with tensors replaced by `Ref` (lists of
    tensors by lists of `Ref`), defaults filled in and non-zero floats replaced by `FLOAT`.
    """

    func: Any
    mesh_shape: tuple[int, ...]
    values: dict[str, Any]
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[Optional[TensorMeta], ...] = ()

    def arg(self, name: str, default: Any = None) -> Any:
        """The value of schema argument `name` (a `Ref` for a tensor)."""
        return self.values.get(name, default)

    def tensor(self, name: str) -> Optional[TensorMeta]:
        """The metadata of tensor argument `name`, or None when it is absent (an optional tensor)."""
        ref = self.values.get(name)
        return self.inputs[ref.index] if isinstance(ref, Ref) else None

    def index(self, name: str) -> Optional[int]:
        """The flattened input index of tensor argument `name`, or None."""
        ref = self.values.get(name)
        return ref.index if isinstance(ref, Ref) else None

    def sig(self, placed: dict[str, Any], outputs: Sequence[Placement], default: Any = B) -> Sig:
        """A signature giving the named tensor arguments their placements and every other input `default`.

        A name that holds a list of tensors gives every element the same placement.
        """
        ins = [default] * len(self.inputs)
        for name, p in placed.items():
            ref = self.values.get(name)
            refs = ref if isinstance(ref, list) else [ref]
            for r in refs:
                if isinstance(r, Ref):
                    ins[r.index] = p
        return Sig(tuple(ins), tuple(outputs))

    @property
    def out(self) -> TensorMeta:
        """The first output (most ops have one)."""
        return self.outputs[0]


@dataclass(frozen=True, slots=True)
class Choice:
    """The whole-mesh outcome of signature selection: full placements per input and per output slot."""

    inputs: tuple[tuple[Placement, ...], ...]
    outputs: tuple[tuple[Placement, ...], ...]


@dataclass(slots=True)
class Call:
    """A local computation: `args`/`kwargs` hold this rank's local tensors, already laid out as chosen."""

    func: Any
    args: list
    kwargs: dict
    spec: OpSpec
    choice: Choice
    mesh: DeviceMesh
    coord: tuple[int, ...]

    def in_block(self, index: int) -> Block:
        """Global (start, stop) per dim of this rank's block of input `index` under its chosen placements."""
        meta = self.spec.inputs[index]
        return block_of(meta.shape, self.mesh.shape, self.choice.inputs[index], self.coord)

    def out_block(self, index: int = 0) -> Block:
        """Global (start, stop) per dim of this rank's block of output `index`."""
        meta = self.spec.outputs[index]
        return block_of(meta.shape, self.mesh.shape, self.choice.outputs[index], self.coord)

    def out_shape(self, index: int = 0) -> tuple[int, ...]:
        """This rank's local shape of output `index`."""
        return block_shape(self.out_block(index))

    def default(self) -> Any:
        """Run the op itself on the local tensors."""
        return self.func(*self.args, **self.kwargs)


def default_run(call: Call) -> Any:
    """The local computation of most rules: the op itself on the local tensors.

    >>> call = Call(torch.ops.aten.neg.default, [torch.ones(2)], {}, None, None, None, ())
    >>> default_run(call)
    tensor([-1., -1.])
    """
    return call.default()


def contiguous_run(call: Call) -> Any:
    """The fallback's local computation: the op on local tensors laid out as global tensors report themselves.

    A global tensor's strides are contiguous whatever its local's (a transposed gradient, a view laid out
    anew), so torch code that makes an argument contiguous before a kernel that relies on it -- autograd's
    formula for ``weight_norm`` calls ``grad.contiguous()`` -- finds nothing to do on the wrapper, and the
    kernel would misread a strided local. Arguments the op writes or returns a view of stay as they are, but
    for the views that read the memory layout itself (`view_as_complex`, `view(dtype)`, `as_strided`): they
    view a contiguous copy, a view laid out anew (a write into it goes on into the base:
    `sbp.ops.through`).

    >>> call = Call(torch.ops.aten.mul.Tensor, [torch.ones(2, 3).t(), 2.0], {}, None, None, None, ())
    >>> contiguous_run(call).is_contiguous()
    True
    """
    schema = call.func._schema.arguments
    reads = call.func in _READS_LAYOUT
    args = [_contiguous(a) if reads or i >= len(schema) or schema[i].alias_info is None else a
            for i, a in enumerate(call.args)]
    names = {a.name: a for a in schema}
    kwargs = {k: v if k in names and names[k].alias_info is not None else _contiguous(v)
              for k, v in call.kwargs.items()}
    return call.func(*args, **kwargs)


_aten = torch.ops.aten
_READS_LAYOUT = frozenset((_aten.view_as_complex.default, _aten.view.dtype, _aten.as_strided.default))


def _contiguous(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.is_contiguous() else value.contiguous()
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_contiguous(v) for v in value)
    return value


SigFn = Callable[[OpSpec, int], Sequence[Sig]]
CheckFn = Callable[[OpSpec, Choice], bool]
RunFn = Callable[[Call], Any]
CompositeFn = Callable[[Any, tuple, dict], Any]   # (func, args, kwargs) -> result, or NotImplemented


def no_signatures(spec: OpSpec, axis: int) -> list[Sig]:
    """The signatures of a composite rule: none (its parts are dispatched through their own rules).

    >>> no_signatures(None, 0)
    []
    """
    return []


@dataclass(frozen=True, slots=True)
class Rule:
    """A sharding rule: per-axis signatures, an optional whole-mesh check and the local computation.

    >>> relu_like = Rule(lambda spec, axis: [Sig((B,), (B,)), Sig((PMAX,), (PMAX,))], doc="B->B; P(max)->P(max)")
    >>> relu_like.doc
    'B->B; P(max)->P(max)'


    `sigs(spec, axis)` lists the accepted signatures on one mesh axis, preferred first; the dispatcher
    takes their product over the axes, drops the combinations `check` refuses (e.g. views whose uneven
    blocks would not line up) and picks the cheapest. `run(call)` computes this rank's outputs;
    `doc` is the signature summary shown in docs/operators.md.

    A *composite* rule (`composite(func, args, kwargs)`, with `sigs=no_signatures`) runs the whole call
    on the global tensors itself, dispatching its parts through their own rules: ``_foreach_*`` ops index
    by index, in-place views through their out-of-place view. It returns `NotImplemented` to decline a
    call, which then takes the fallback (Broadcast inputs, one-time warning).
    """

    sigs: SigFn
    run: RunFn = default_run
    check: Optional[CheckFn] = None
    doc: str = ""
    meta: bool = True  # False: output shapes come from the local results (Broadcast outputs only)
    composite: Optional[CompositeFn] = None


def splits(pls: Sequence[Placement], dim: int) -> bool:
    """Whether any axis splits `dim`.

    >>> from sbp import S, B
    >>> splits((S(0), B), 0), splits((S(0), B), 1)
    (True, False)
    """
    return any(isinstance(p, Split) and p.dim == dim for p in pls)


# ---- dtype conversions of Partial parts ------------------------------------------------------------------------
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)   # with +-inf, rounding to nearest
_COMPLEX_PART = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _integral(t: torch.dtype) -> bool:
    return not t.is_floating_point and not t.is_complex and t is not torch.bool


def _exact(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every value of `src` is a value of `dst`."""
    if src == dst or src is torch.bool:
        return True
    if dst.is_complex:   # compare with the real part's dtype (real -> complex, complex -> complex)
        part = _COMPLEX_PART.get(dst)
        return part is not None and _exact(_COMPLEX_PART.get(src, src), part)
    if src.is_complex or dst is torch.bool:
        return False
    if _integral(src):
        s = torch.iinfo(src)
        if _integral(dst):
            return torch.iinfo(dst).min <= s.min and s.max <= torch.iinfo(dst).max
        # every integer up to 2**digits is exact in a float of `digits` significant bits
        return dst in _FLOATS and max(-s.min, s.max) <= 2 / torch.finfo(dst).eps
    if src in _FLOATS and dst in _FLOATS:
        a, b = torch.finfo(src), torch.finfo(dst)
        return a.eps >= b.eps and a.max <= b.max and a.smallest_normal >= b.smallest_normal
    return False


def _monotone(src: torch.dtype, dst: torch.dtype) -> bool:
    """The conversion is non-decreasing over every value of `src`, +-inf included."""
    if src.is_complex or dst.is_complex:   # no order
        return src == dst
    if src == dst or src is torch.bool:
        return True
    if dst is torch.bool:
        return False
    if dst in _FLOATS:
        return src in _FLOATS or _integral(src)      # rounding (and overflow to +-inf) keeps the order
    return _integral(src) and _exact(src, dst)       # float -> int: +-inf, nan and out of range wrap


def keeps_partial(p: Partial, src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting the parts of a `p` tensor from `src` to `dst` one by one gives parts of the
    converted value: for P(sum) the conversion must be exact (every `src` value kept: widening, bool ->
    any, int8/int16 -> float32, int32 -> float64, real -> complex as wide); for P(max|min) non-decreasing
    over all values, +-inf (an empty shard's identity) included (float -> float, int -> float, int -> an
    int that holds it, bool -> any). Where it is not, a rule must reduce the Partial input first.

    ======================  ======  ==========  ==========================================
    src -> dst              P(sum)  P(max|min)  a part that breaks it
    ======================  ======  ==========  ==========================================
    float32 -> float64      yes     yes
    float64 -> float32      no      yes         parts 1 + 2**-30 and -1 round to 1 and -1
    int64 -> float32        no      yes         parts 2**40 + 1 and -2**40
    float64 -> int64        no      no          +inf (a P(min) identity) -> INT64_MIN
    int64 -> int8           no      no          200 -> -56
    float32 -> bool         no      no          -1.0 -> True > 0.0 -> False
    ======================  ======  ==========  ==========================================

    >>> keeps_partial(PSUM, torch.int32, torch.float64), keeps_partial(PSUM, torch.int64, torch.float32)
    (True, False)
    >>> keeps_partial(PMAX, torch.int64, torch.float32), keeps_partial(PMIN, torch.float64, torch.int64)
    (True, False)
    """
    if src == dst:
        return True
    return _exact(src, dst) if p.op == "sum" else _monotone(src, dst)


def converts_parts(t: TensorMeta, axis: int, p: Partial, dst: torch.dtype) -> bool:
    """Whether input `t`, laid out as `p` on mesh axis `axis`, may be converted to `dst` part by part: the
    conversion keeps `p` (`keeps_partial`), or `t` is Broadcast there (the local move to `p` puts its whole
    value into one part and zeros into the others, or into every part: each part converts as the value).

    >>> converts_parts(TensorMeta((3,), torch.int64, (PSUM,)), 0, PSUM, torch.float32)
    False
    >>> converts_parts(TensorMeta((3,), torch.int64, (B,)), 0, PSUM, torch.float32)
    True
    """
    return keeps_partial(p, t.dtype, dst) or t.placements[axis] == B


def dims_of(value: Any, ndim: int) -> tuple[int, ...]:
    """Normalise a dim argument (an int, a list, or None/[] for every dim) to sorted non-negative dims.

    >>> dims_of([-1, 0], 3), dims_of(None, 2), dims_of(1, 2)
    ((0, 2), (0, 1), (1,))
    >>> dims_of(4, 2)
    Traceback (most recent call last):
    ...
    sbp.values.errors.ShapeError: dim 4 is out of range for a 2-d tensor (valid: -2..1)
    """
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return tuple(range(ndim))
    if isinstance(value, int):
        value = [value]
    n = max(ndim, 1)   # a 0-d tensor takes dim 0 or -1, as in torch
    for d in value:
        if not -n <= d < n:
            raise ShapeError(f"dim {d} is out of range for a {ndim}-d tensor (valid: {-n}..{n - 1})")
    return tuple(sorted({d % n for d in value}))
