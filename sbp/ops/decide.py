"""Making a decision: bind the call, find the output shapes on meta tensors, pick the cheapest signature.

`decide` is pure (no communication): the rule's per-axis signatures are combined over the mesh axes,
filtered by the rule's whole-mesh check, and priced with the planner (`_price`): bytes the busiest rank
receives to lay the inputs out (and to write in-place results back), plus the reduction debt of every
Partial the op would create. Ties go to fewer collectives, then fewer changed placements, then the
rule's order. Ops without a rule get the fallback decision (Broadcast inputs, one-time warning): the
one fallback of sbp, also taken by a composite rule (``_foreach_*``, in-place views) that declines a call.
"""
from __future__ import annotations

import contextvars
import itertools
import math
import warnings
from typing import Any, Optional

import torch

from ..runtime.executor import cached_plan
from ..runtime.symbolic import hint, hint_shape, is_symbolic, moved_dims, narrows, runs_symbolically
from ..runtime.traced import untraced
from ..tensor.global_tensor import GlobalTensor, contiguous_strides
from ..values.errors import DTypeError, ShapeError, torch_alike
from ..values.layout import block, block_numel
from ..values.mesh import DeviceMesh
from ..values.placement import Partial
from . import table as rules
from .apply import Decision, index_bounds
from .cache import SPEC_TOKENS
from .random import agreed_random_run, draws_over, is_random
from .spec import ANY, FLOAT, B, Choice, OpSpec, Ref, Rule, TensorMeta, contiguous_run

MAX_COMBOS = 512    # whole-mesh signature combinations priced before pruning per axis

SIZE_ARGS = frozenset({"size", "num_weights"})
"""Int arguments that are sizes (``view(x, size)``, ``expand``, ``new_zeros``, ``embedding_dense_backward``'s
``num_weights``, its output's rows): symbols in a shape class's key (`sbp.ops.dispatch.class_key`). Other ints
(dims, indices, slice bounds) stay exact."""


def _paths(args: tuple, kwargs: dict) -> list[tuple]:
    """Where each tensor sits: (position,) / (position, index) in args, or (name,) / (name, index)."""
    out = []
    for where, value in itertools.chain(enumerate(args), kwargs.items()):
        if isinstance(value, torch.Tensor):
            out.append((where,))
        elif isinstance(value, (list, tuple)):
            out.extend((where, j) for j, v in enumerate(value) if isinstance(v, torch.Tensor))
    return out


def _bind(func, args: tuple, kwargs: dict, mesh_shape: tuple[int, ...], leaves: list) -> OpSpec:
    schema = func._schema
    counter = itertools.count()

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return Ref(next(counter))
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if type(v) is float and v != 0 and v - v == 0:   # finite and non-zero; inf and nan stay values
            return FLOAT
        return v

    values: dict[str, Any] = {}
    for i, a in enumerate(args):
        values[schema.arguments[i].name if i < len(schema.arguments) else f"arg{i}"] = conv(a)
    for name, v in kwargs.items():
        values[name] = conv(v)
    for arg in schema.arguments:
        if arg.name not in values and arg.has_default_value():
            values[arg.name] = conv(arg.default_value)
    ndim = len(mesh_shape)
    inputs = tuple(TensorMeta(tuple(t.shape), t.dtype, t._placements, True) if isinstance(t, GlobalTensor)
                   else TensorMeta(tuple(t.shape), t.dtype, (B,) * ndim, False) for t in leaves)
    return OpSpec(func, mesh_shape, values, inputs)


def meta_outputs(func, args: tuple, kwargs: dict) -> tuple[Optional[TensorMeta], ...]:
    """`func` run on meta tensors of its tensors' (global) shapes: each output's shape and dtype. Shapes
    may be symbolic (torch then records its guards: `sbp.ops.symbolic`).

    >>> meta_outputs(torch.ops.aten.mm.default, (torch.ones(2, 3), torch.ones(3, 4)), {})
    (TensorMeta(shape=(2, 4), dtype=torch.float32, placements=(), is_global=True),)
    """
    def on(device: str) -> Any:
        def to(v: Any) -> Any:
            if isinstance(v, torch.Tensor):   # (on the host: values unread but for integers, zeros: offsets)
                made = torch.empty if device == "meta" or v.is_floating_point() or v.is_complex() else torch.zeros
                return made(tuple(v.shape), dtype=v.dtype, device=device)
            if isinstance(v, torch.device):  # e.g. _to_copy(device=cpu): stay on meta
                return torch.device(device)
            if isinstance(v, torch.Generator):  # shapes draw nothing (torch's meta `exponential_` refuses one)
                return None
            if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
                return type(v)(to(x) for x in v)
            return v
        return func(*[to(a) for a in args], **{k: to(v) for k, v in kwargs.items()})

    # under torch.compile the tracing modes would take these meta tensors and the run through their fake-tensor
    # and tracing machinery (several ms a call); plain meta tensors of symbolic sizes record the same guards
    with untraced():
        try:
            out = on("meta")
        except ZeroDivisionError:   # a Python meta kernel dividing by an element count of 0 (`mse_loss_backward`'s
            out = on("cpu")         # 2 / numel, as `huber_loss_backward`'s): the host kernel does not
        except (RuntimeError, AssertionError) as e:   # a meta kernel stricter than the host's, which decides for
            if not _on_host(args, kwargs) or MADE_UP.get():   # host tensors (`_grouped_mm`'s wants bfloat16, the
                raise                                 # CPU kernel takes float32: Mixtral's experts); never at made-up
                                                      # sizes, whose host tensors would take gigabytes
            try:
                out = on("cpu")
            except Exception:  # noqa: BLE001 - refused there too: the meta kernel's message
                raise e from None
    items = out if isinstance(out, (tuple, list)) else [out] if isinstance(out, torch.Tensor) else []
    return tuple(TensorMeta(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in items)


def _on_host(args: tuple, kwargs: dict) -> bool:
    """Whether every tensor among the arguments (in lists too) is a host tensor (global: on a "cpu" mesh)."""
    def host(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            return v.device.type == "cpu"
        return all(host(x) for x in v) if isinstance(v, (list, tuple)) else True
    return host(args) and host(tuple(kwargs.values()))


def _on_inputs(spec: OpSpec) -> str:
    """The op and its inputs' global shapes and placements, the prefix of a bad-input message.

    >>> import sbp
    >>> x, w = TensorMeta((4, 3), torch.float32, (sbp.S(0),)), TensorMeta((5, 2), torch.float32, (B,), False)
    >>> _on_inputs(OpSpec(torch.ops.aten.mm.default, (2,), {}, (x, w)))
    'aten.mm.default on global shapes (4, 3) and (5, 2) with placements (S(0),) and plain'
    """
    def join(items: list[str]) -> str:
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]

    shapes = [repr(tuple(m.shape)) for m in spec.inputs]
    pls = [repr(tuple(m.placements)) if m.is_global else "plain" for m in spec.inputs]
    s = "" if len(shapes) == 1 else "s"
    return f"{spec.func} on global shape{s} {join(shapes)} with placements {join(pls)}"


def _input_error(spec: OpSpec, e: Exception) -> DTypeError | ShapeError:
    """The `sbp.SbpError` for torch refusing the op on meta tensors of the global shapes: `DTypeError` when
    torch's message is about dtypes, `ShapeError` otherwise (shapes, dims, indices); torch's text kept, and
    torch's class too (`sbp.values.errors.torch_alike`: ``except RuntimeError`` still catches it). Some meta
    kernels are torch's Python decompositions, which refuse with an ``AssertionError`` (``nll_loss_backward``'s
    "size mismatch") where torch's own kernel raises a ``RuntimeError``: read as the ``RuntimeError``.

    >>> from sbp.values.errors import SbpError
    >>> x = TensorMeta((4, 3), torch.float32, (B,))
    >>> e = _input_error(OpSpec(torch.ops.aten.neg.default, (2,), {}, (x,)), AssertionError("size mismatch"))
    >>> type(e).__name__, isinstance(e, SbpError), isinstance(e, RuntimeError)
    ('ShapeError', True, True)
    """
    text = str(e)
    words = ("dtype", "scalar type", "result type", "promotion", "be cast")
    kind = DTypeError if any(w in text.lower() for w in words) else ShapeError
    alike = RuntimeError if isinstance(e, AssertionError) else e
    return torch_alike(kind, f"{_on_inputs(spec)}: {text}", alike)   # also torch's IndexError / RuntimeError


_SAME_DTYPE = {"mm", "addmm", "bmm", "baddbmm", "dot", "mv", "addmv"}
_INDEX_ARG = {"index_select": 2, "gather": 2, "scatter": 2, "scatter_add": 2, "index_add": 2}


def _check_what_meta_skips(func, args: tuple, kwargs: dict, spec: OpSpec) -> None:
    """Checks torch's CPU kernels make but its meta kernels skip, so the error names the global inputs."""
    name = func._schema.name.split("::")[-1]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name in _SAME_DTYPE and len({t.dtype for t in tensors}) > 1:
        raise DTypeError(f"{_on_inputs(spec)}: the matrix inputs must share one dtype, got "
                         f"{[str(t.dtype) for t in tensors]} (cast one with .to(dtype))")
    position = _INDEX_ARG.get(name)
    index = args[position] if position is not None and len(args) > position else kwargs.get("index")
    if position is not None and isinstance(index, torch.Tensor) and (index.dtype.is_floating_point or
                                                                       index.dtype.is_complex):
        raise DTypeError(f"{_on_inputs(spec)}: the index must be an integer tensor, got {index.dtype}")
    if name == "_local_scalar_dense" and tensors and tensors[0].numel() != 1:
        raise ShapeError(f"{_on_inputs(spec)}: .item() needs a tensor with exactly one element, got global "
                         f"shape {tuple(tensors[0].shape)} ({tensors[0].numel()} elements)")


def _check_on_meta(func, args: tuple, kwargs: dict, spec: OpSpec) -> None:
    """An op without a rule runs on full inputs; refuse arguments torch refuses for the global shapes first.

    Lenient: a meta kernel may be missing (`NotImplementedError`) or unable to compute a data-dependent
    shape (its message then names meta tensors); those calls are left to run on the real values.
    """
    try:
        meta_outputs(func, args, kwargs)
    except NotImplementedError:
        return
    except (IndexError, AssertionError) as e:   # AssertionError: a decomposition refusing the input
        raise _input_error(spec, e) from e
    except RuntimeError as e:
        if "meta" in str(e).lower():
            return
        raise _input_error(spec, e) from e


def _writes(func, spec: OpSpec) -> list[tuple[int, Optional[int]]]:
    """(input index, output slot or None) for every input the op writes (`add_`, `out=`, `_foreach_*_`)."""
    schema = func._schema
    found = []
    for arg in schema.arguments:
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        slot = next((k for k, ret in enumerate(schema.returns) if ret.alias_info is not None
                     and ret.alias_info.before_set == info.before_set), None)
        ref = spec.values.get(arg.name)
        for r in (ref if isinstance(ref, list) else [ref]):
            if isinstance(r, Ref):
                found.append((r.index, slot))
    return found


def _check_out_shapes(func, args: tuple, kwargs: dict, spec: OpSpec, writes: list) -> Optional[tuple]:
    """Refuse an `out=` tensor whose global shape is not the result's before anything runs: torch resizes
    such an `out`, sbp does not (a global tensor's shape is its layout), and a kernel left to fail halfway
    would leave the tensor's metadata and local disagreeing. So too an in-place op that would change its
    tensor's shape (`resize_`, `resize_as_`, `as_strided_`). Once per decision (cached), writing ops only;
    returns the output metadata it computed (`meta_outputs`), for `decide` to reuse, or None.

    >>> import sbp
    >>> from sbp.tensor.global_tensor import GlobalTensor
    >>> mesh = sbp.DeviceMesh((1,))
    >>> x, o = (GlobalTensor(torch.ones(n), mesh, (sbp.B,), (n,)) for n in (2, 0))
    >>> mul = torch.ops.aten.mul.out
    >>> try:
    ...     decide(mul, (x, x), {"out": o}, [x, x, o], mesh)
    ... except sbp.ShapeError as e:
    ...     print(str(e).split("; ")[0].split(": ")[1])
    out= has global shape (0,) but the result has global shape (2,)
    """
    written = [a for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not written:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch's "an output with one or more elements was resized"
            made = meta_outputs(func, args, kwargs)
    except Exception:   # noqa: BLE001 -- a bad call: the checks below name it
        return None
    slots = dict(writes)
    for arg in written:
        ref = spec.values.get(arg.name)
        for r in ref if isinstance(ref, list) else [ref]:
            k = slots.get(r.index) if isinstance(r, Ref) else None
            if k is None or k >= len(made) or made[k] is None:
                continue
            have, want = spec.inputs[r.index].shape, made[k].shape
            if have == want:
                continue
            if arg.kwarg_only:   # out=
                raise ShapeError(f"{_on_inputs(spec)}: out= has global shape {have} but the result has global "
                                 f"shape {want}; sbp does not resize an out= tensor (torch would): pass one of "
                                 f"the result's shape")
            raise ShapeError(f"{_on_inputs(spec)}: it would change a global tensor's shape in place ({have} -> "
                             f"{want}); sbp does not resize a global tensor (its shape is its layout): make a "
                             f"new one instead (x.reshape, x.new_empty, sbp.distribute)")
    return made


def decide(func, args: tuple, kwargs: dict, leaves: list, mesh: DeviceMesh) -> Decision:
    """Make the decision for one call (uncached; `handle` caches it). Pure: no communication.

    >>> import sbp
    >>> from sbp.tensor.global_tensor import GlobalTensor
    >>> mesh = sbp.DeviceMesh((2,))                                   # a pure mesh is enough to decide
    >>> x = GlobalTensor(torch.zeros(2, 3), mesh, (sbp.S(1),), (2, 6))
    >>> w = GlobalTensor(torch.zeros(3, 4), mesh, (sbp.S(0),), (6, 4))
    >>> decide(torch.ops.aten.mm.default, (x, w), {}, [x, w], mesh).choice
    Choice(inputs=((S(1),), (S(0),)), outputs=((P(sum),),))
    """
    spec = _bind(func, args, kwargs, tuple(mesh.shape), leaves)
    _check_what_meta_skips(func, args, kwargs, spec)
    paths = _paths(args, kwargs)
    writes = _writes(func, spec)
    made = _check_out_shapes(func, args, kwargs, spec, writes)
    rule = rules.lookup(func)
    if rule is None or rule.composite is not None:   # no rule, or a composite rule that declined the call
        _check_on_meta(func, args, kwargs, spec)
        return _fallback(spec, paths, writes)
    if rule.meta and made is not None:   # (an op that writes an argument: computed by the shape check)
        spec.outputs = made
    elif rule.meta:
        try:
            spec.outputs = meta_outputs(func, args, kwargs)
        except NotImplementedError:
            raise   # no meta kernel: not the user's input
        except (RuntimeError, IndexError, AssertionError) as e:   # AssertionError: a decomposition refusing
            raise _input_error(spec, e) from e
    try:
        choice = select(rule, spec, {k: i for i, k in writes if k is not None})
    except ShapeError as e:   # a rule refused an argument its op's meta kernel let through (a dim out of range)
        raise ShapeError(f"{_on_inputs(spec)}: {e}") from e
    if choice is None:
        return _fallback(spec, paths, writes)
    return Decision(spec, choice, rule.run, paths, writes)


def _fallback(spec: OpSpec, paths: list[tuple], writes: list) -> Decision:
    """Every input Broadcast, every output Broadcast with the shape of its (full) local result."""
    all_b = (B,) * len(spec.mesh_shape)
    spec.outputs = ()
    choice = Choice(tuple(all_b for _ in spec.inputs), ())
    run = agreed_random_run if is_random(spec.func) else contiguous_run   # random ops: the same draws everywhere
    # a draw over its input's shape (`normal_`, `bernoulli_(p)`, `rand_like`): the input is made, not gathered
    blank = spec.inputs[0].is_global and draws_over(spec.func)
    return Decision(spec, choice, run, paths, writes, fallback=True, blank=blank)


def select(rule: Rule, spec: OpSpec, aliases: dict[int, int]) -> Optional[Choice]:
    """The cheapest whole-mesh combination of the rule's per-axis signatures (None when none fits).

    `aliases` maps output slots to the inputs they write (in-place ops). A combination that moves
    nothing wins at once; otherwise the planner prices each (see `_price`).

    >>> import sbp
    >>> from sbp.ops.spec import TensorMeta
    >>> from sbp.ops.table import lookup
    >>> mm = torch.ops.aten.mm.default
    >>> x = TensorMeta((64, 8), torch.float32, (sbp.S(0),))        # rows split over 4 ranks
    >>> w = TensorMeta((8, 4), torch.float32, (sbp.S(0),))         # a small weight, also split
    >>> spec = OpSpec(mm, (4,), {"self": Ref(0), "mat2": Ref(1)}, (x, w), (TensorMeta((64, 4), torch.float32),))
    >>> select(lookup(mm), spec, {})                                # gather w, keep x where it is
    Choice(inputs=((S(0),), (B,)), outputs=((S(0),),))
    """
    found = candidates(rule, spec, aliases)
    return found if isinstance(found, Choice) else cheapest(spec, found, aliases)


def candidates(rule: Rule, spec: OpSpec, aliases: dict[int, int]) -> Choice | list[tuple[int, int, Choice]]:
    """`select`'s first half, what needs no planning: the first combination of the rule's signatures that
    moves nothing (a `Choice`: it wins), or every admissible combination as (placements changed, rule
    order, choice), fewest changes first -- the list `cheapest` prices.

    >>> import sbp
    >>> from sbp.ops.spec import TensorMeta
    >>> from sbp.ops.table import lookup
    >>> mm = torch.ops.aten.mm.default
    >>> x, w = TensorMeta((64, 8), torch.float32, (sbp.S(0),)), TensorMeta((8, 4), torch.float32, (sbp.S(0),))
    >>> spec = OpSpec(mm, (4,), {"self": Ref(0), "mat2": Ref(1)}, (x, w), (TensorMeta((64, 4), torch.float32),))
    >>> [c[0] for c in candidates(lookup(mm), spec, {})]          # placements each candidate changes
    [1, 1, 2, 2, 2, 2]
    """
    ndim = len(spec.mesh_shape)
    per_axis = [list(rule.sigs(spec, axis)) for axis in range(ndim)]
    for axis, sigs in enumerate(per_axis):
        for s in sigs:
            if len(s.inputs) != len(spec.inputs) or (rule.meta and len(s.outputs) != len(spec.outputs)):
                raise AssertionError(f"rule for {spec.func} gave signature {s} for {len(spec.inputs)} inputs and "
                                     f"{len(spec.outputs)} outputs")  # a bug in a rule, not a user error
    if _count(per_axis) > MAX_COMBOS:
        per_axis = [sorted(sigs, key=lambda s, a=a: _changed_on_axis(spec, s, a))[:4]
                    for a, sigs in enumerate(per_axis)]
    found, moving = [], []   # moving: choices that move a kept size, by steps that keep it symbolic
    keep = KEEP_SIZES.get()
    for index, combo in enumerate(itertools.product(*per_axis)):
        choice = _choice(spec, combo)
        if (rule.check is not None and not rule.check(spec, choice)) or not _representable(spec, choice):
            continue
        changed = _changed(spec, choice)
        if keep is not None and not keeps_dims(spec, choice, keep.__contains__):
            if keeps_dims(spec, choice, keep.__contains__, moving=True):
                moving.append((changed, index, choice))
            continue
        if changed == 0 and not _writes_back(spec, choice, aliases):
            return choice  # nothing moves: nothing can be cheaper
        found.append((changed, index, choice))
    found = found or moving   # a choice that moves a kept size only where every choice does
    found.sort(key=lambda c: c[:2])   # fewest changes first: cheap bounds early, fewer plans
    return found


# set while `sbp.ops.symbolic` decides a call at made-up sizes: a meta kernel that refuses them is not retried
# on the host (`meta_outputs`), where tensors of those sizes took gigabytes (a loss whose input and target sizes
# differ at made-up sizes: a CNN's flattened pools against a static target, 12 GB before the refusal)
MADE_UP: contextvars.ContextVar[bool] = contextvars.ContextVar("sbp_made_up", default=False)

# sizes no candidate may move (set while `sbp.ops.symbolic` decides a call of symbolic sizes at made-up ones:
# those sizes stand for its symbols) -- a choice that moves one would pin it, a recompile for every size
KEEP_SIZES: contextvars.ContextVar[Optional[frozenset[int]]] = contextvars.ContextVar("sbp_keep_sizes",
                                                                                       default=None)


def keeps_dims(spec: OpSpec, choice: Choice, kept, moving: bool = False) -> bool:
    """Whether `choice` leaves every input dim whose size is `kept` (a predicate: a symbolic size, or one of
    the made-up sizes that stand for symbols) split by the same mesh axes in every state the move's plan
    passes through (`sbp.runtime.symbolic.moved_dims`: what the executor pins), or only narrows the input's
    blocks (`sbp.runtime.symbolic.narrows`: cut locally, with symbolic bounds); with `moving`, also where
    it moves them by steps that run with the sizes symbolic (`sbp.runtime.symbolic.runs_symbolically`:
    gathers, reduce-scatters and all_to_alls along one axis at a time). Those are taken only where no
    choice keeps the dims: a move of a symbolic size splits it anew, and each split pins a remainder.

    >>> from sbp import S
    >>> x = TensorMeta((1013, 10), torch.float32, (S(0), S(0)))
    >>> spec = OpSpec(torch.ops.aten.neg.default, (2, 2), {"self": Ref(0)}, (x,), ())
    >>> choices = [Choice((pls,), ()) for pls in ((S(0), S(0)), (S(0), B), (S(1), S(0)))]
    >>> [keeps_dims(spec, c, {1013}.__contains__) for c in choices]
    [True, False, False]
    >>> [keeps_dims(spec, c, {1013}.__contains__, moving=True) for c in choices]   # a gather; a transfer
    [True, True, False]
    """
    for meta, target in zip(spec.inputs, choice.inputs):
        if not meta.is_global or target == meta.placements:
            continue
        if narrows(meta.placements, target, len(meta.shape)):
            continue
        dims = [d for d, n in enumerate(meta.shape) if kept(n)]
        if not dims:
            continue
        # the plan the executor runs, with its intermediate states: ``(B, P) -> (P, B)`` splits dim 0 on the
        # way (half the all_reduce's bytes), which pins its size as surely as a split target would
        plan = cached_plan(hint_shape(meta.shape), spec.mesh_shape, meta.placements, target, meta.itemsize)
        if plan.steps and moved_dims(plan, dims) and not (moving and runs_symbolically(plan)):
            return False
    return True


def cheapest(spec: OpSpec, found: list[tuple[int, int, Choice]], aliases: dict[int, int]) -> Optional[Choice]:
    """`select`'s second half: the cheapest of `candidates`' list by planner price (`_price`), ties to fewer
    collectives, fewer changes, then the rule's order; None for an empty list.

    >>> import sbp
    >>> x = TensorMeta((64, 8), torch.float32, (sbp.S(0),))
    >>> spec = OpSpec(torch.ops.aten.neg.default, (2,), {"self": Ref(0)}, (x,), (TensorMeta((64, 8), torch.float32),))
    >>> gather, keep = Choice(((B,),), ((B,),)), Choice(((sbp.S(1),),), ((sbp.S(1),),))
    >>> cheapest(spec, [(1, 0, gather), (1, 1, keep)], {}) == keep        # an all_to_all moves half the bytes
    True
    """
    best, best_cost = None, None
    for changed, index, choice in found:
        priced = _price(spec, choice, aliases, None if best_cost is None else best_cost[0])
        if priced is None:
            continue   # already dearer than the best: stop planning its moves
        cost = (priced[0], priced[1], changed, index)
        if best_cost is None or cost < best_cost:
            best, best_cost = choice, cost
    return best


def _representable(spec: OpSpec, choice: Choice) -> bool:
    """No new P(sum) of bools (a sum of bools is no bool) and no P(min|max) of complex numbers."""
    pairs = [(m.dtype, tgt) for m, tgt in zip(spec.inputs, choice.inputs) if tgt != m.placements]
    pairs += [(m.dtype, pls) for m, pls in zip(spec.outputs, choice.outputs) if m is not None]
    for dtype, pls in pairs:
        for p in pls:
            if isinstance(p, Partial) and ((p.op == "sum" and dtype is torch.bool) or
                                           (p.op != "sum" and dtype.is_complex)):
                return False
    return True


def _count(per_axis: list[list]) -> int:
    n = 1
    for sigs in per_axis:
        n *= len(sigs)
    return n


def _choice(spec: OpSpec, combo: tuple) -> Choice:
    ins = tuple(tuple(meta.placements[a] if sig.inputs[i] is ANY else sig.inputs[i] for a, sig in enumerate(combo))
                for i, meta in enumerate(spec.inputs))
    nout = len(combo[0].outputs) if combo else 0
    outs = tuple(tuple(sig.outputs[k] for sig in combo) for k in range(nout))
    return Choice(ins, outs)


def _changed(spec: OpSpec, choice: Choice) -> int:
    return sum(s != d for meta, tgt in zip(spec.inputs, choice.inputs) for s, d in zip(meta.placements, tgt))


def _changed_on_axis(spec: OpSpec, sig, axis: int) -> int:
    return sum(p is not ANY and p != meta.placements[axis] for p, meta in zip(sig.inputs, spec.inputs))


def _writes_back(spec: OpSpec, choice: Choice, aliases: dict[int, int]) -> bool:
    return any(choice.outputs[k] != spec.inputs[i].placements for k, i in aliases.items())


def _price(spec: OpSpec, choice: Choice, aliases: dict[int, int],
           limit: Optional[int] = None) -> Optional[tuple[int, int]]:
    """Planner bytes (busiest rank) and collectives to lay the inputs out (and write in-place results
    back), plus the reduction debt of every Partial the op would *create* (see `_debt`); None as soon
    as the bytes exceed `limit` (bytes only grow, so the rest need not be planned)."""
    nbytes, ncoll = _debt(spec, choice, aliases), 0
    moves = [(meta, meta.placements, tgt) for meta, tgt in zip(spec.inputs, choice.inputs)]
    moves += [(spec.inputs[i], choice.outputs[k], spec.inputs[i].placements) for k, i in aliases.items()]
    for meta, src, dst in moves:
        if limit is not None and nbytes > limit:
            return None
        if src != dst:   # the executor's plan memo: the move chosen is then run without planning again
            p = cached_plan(meta.shape, spec.mesh_shape, src, dst, meta.itemsize)
            nbytes += p.bytes_per_rank
            ncoll += p.num_collectives
    return None if limit is not None and nbytes > limit else (nbytes, ncoll)


def _debt(spec: OpSpec, choice: Choice, aliases: dict[int, int]) -> int:
    """What reducing a newly created Partial output will cost: a ring reduce_scatter over that axis.

    Converting S or B to P(sum) is free locally, so without this term `S(0) + S(1)` would pick
    `P + P -> P` (0 bytes now) and leave a full-size Partial to reduce later, n times dearer than
    moving one input. A Partial output on an axis where some input already is Partial adds nothing.
    """
    debt = 0
    for k, (meta, pls) in enumerate(zip(spec.outputs, choice.outputs)):
        if meta is None or k in aliases:
            continue
        for axis, p in enumerate(pls):
            if isinstance(p, Partial) and not any(isinstance(m.placements[axis], Partial) for m in spec.inputs):
                n = spec.mesh_shape[axis]
                local = block_numel(block(meta.shape, spec.mesh_shape, pls, (0,) * len(pls)))
                debt += (n - 1) * -(-local // n) * meta.itemsize
    return debt


# ---- shape classes: one decision per class of calls ----------------------------------------------------------
class DecisionClass:
    """What a shape class of calls decided: the first decision, and how its output sizes follow the class's
    symbols (`sbp.ops.dispatch.class_key` makes the key and the symbols' values).

    A class is *generic* once a second call of the class, decided cold with other values, made the same
    choice and the output sizes the formula predicts, and torch's meta kernels give those sizes for
    made-up calls of the class as well (`confirm`: an output size int arguments derive from input sizes,
    a view's -1 or a slice's rows, may agree for two calls only); from then on `instantiate` makes its decisions
    without meta kernels or planning. Only decisions that cost nothing may become generic: either nothing
    moves, or every move is local (no bytes, no collective, no new Partial to reduce). Such a choice is the
    first free one in the rule's order, whatever the sizes: in a class every size is above the rank count,
    so a change that needs communication needs it for every member. A choice that won on price depends
    on sizes: its class becomes *priced* once the second call confirms the output sizes, and `instantiate`
    then prices the class's candidates anew for each call (`cheapest`, plans by shape class) but skips the
    meta kernels; the candidates themselves (`candidates`: the rule's signatures, checks and what each
    changes) are made once per class, since they depend on placements, dtypes, sizes up to the rank count,
    remainders and which sizes are equal -- what the class key fixes -- not on the sizes' magnitudes.
    Fallbacks stay `exact` (every call of the class decided alone). A class whose output sizes are no
    symbols (``x[:, :3]``, a cat) becomes *shaped* once a second call made the same choice: eager calls
    decide such a class alone, and calls with symbolic sizes take its choice with torch's symbolic output
    sizes (`sbp.ops.symbolic`; a choice that is not free only where the call's hint sizes choose it too).

    >>> import sbp
    >>> x = GlobalTensor(torch.zeros(6, 8), sbp.DeviceMesh((2,)), (sbp.S(0),), (12, 8))
    >>> d = decide(torch.ops.aten.neg.default, (x,), {}, [x], x.mesh)
    >>> c = DecisionClass(d, [12, 8])       # symbols: 12 and 8 (sizes above the mesh's 2 ranks)
    >>> c.formula, c.state
    (((-1, -2),), 'candidate')
    """

    __slots__ = ("decision", "values", "formula", "state", "sized", "found", "free")

    def __init__(self, decision: Decision, values: list[int]) -> None:
        self.decision = decision
        self.values = values
        self.sized = size_arguments(decision.spec.func)
        self.found = None   # a priced class's `candidates`, made at its first instantiation
        self.formula = _formula(decision, values)
        self.free = not decision.fallback and free(decision)
        if self.formula is not None:
            self.state = "candidate" if self.free else "priced?"
        else:   # output sizes no symbol gives: only calls with symbolic sizes may share the choice
            self.state = "exact" if decision.fallback else "shaped?"

    def confirm(self, decision: Decision, values: list[int], call: Optional[tuple[tuple, dict]] = None) -> None:
        """Check the class's formula and choice against a second call's cold `decision`, of other values; with
        that call's (args, kwargs) `call`, also the formula at made-up calls of the class (`_probes`: far from
        both, at the least sizes, spread apart; meta kernels only): two calls may agree on an output size that
        a third call does not (``x.view(n, -1, 4)``'s -1 was 2 for two calls, ``x[::9]``'s rows 1). A formula
        a probe breaks, or one a probe torch refuses cannot check (unless the outputs are the call's size
        arguments, `_given`), makes the class exact."""
        if self.state == "candidate" and values != self.values:
            same = (decision.choice == self.decision.choice and decision.run is self.decision.run
                    and decision.fallback == self.decision.fallback
                    and _sizes(self.formula, values) == _out_shapes(decision))
            self.state = "generic" if same else "exact"
        elif self.state == "shaped?" and values != self.values:
            same = (decision.choice == self.decision.choice and decision.run is self.decision.run
                    and not decision.fallback)
            self.state = "shaped" if same else "exact"
        elif self.state == "priced?" and values != self.values:
            same = not decision.fallback and _sizes(self.formula, values) == _out_shapes(decision)
            self.state = "priced" if same else "exact"
        if call is not None and self.state in ("generic", "priced") and not self._holds_elsewhere(values, *call):
            self.state = "exact"

    def _holds_elsewhere(self, values: list[int], args: tuple, kwargs: dict) -> bool:
        """Whether the class's formula gives the output sizes torch's meta kernels give for the probes of the
        call of symbol `values` (`args`, `kwargs`; `_probes`), or torch refuses a probe whose outputs are the
        call's size arguments (`_given`)."""
        if not self.formula or not values:   # outputs from the local results, or no size to move
            return True
        spec = self.decision.spec
        m = math.prod(spec.mesh_shape)
        for moved in _probes(values, _bounds(spec.values, m), m):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    made = meta_outputs(spec.func, *_moved_call(args, kwargs, self.sized, dict(zip(values, moved))))
            except Exception:   # noqa: BLE001 -- the probe breaks what the call's arguments hold (a view's sizes)
                if not _given(self.decision):
                    return False
                continue
            if _sizes(self.formula, moved) != tuple(None if o is None else tuple(o.shape) for o in made):
                return False
        return True

    def instantiate(self, func, args: tuple, kwargs: dict, leaves: list, mesh: DeviceMesh,
                    values: list[int]) -> Decision:
        """The class's decision for a call of the class (its symbols' `values`): its choice and run, the
        output sizes from the formula; no meta kernels, no planning for a generic class. Everything but
        the sizes is the class's (paths, writes, targets, the run): only the spec, the output shapes,
        strides and spec tokens are made anew (`_resized`)."""
        made = self.decision
        spec = _respec(made.spec, args, kwargs, leaves, self.sized)
        spec.outputs = tuple(None if m is None else TensorMeta(shape, m.dtype)
                             for m, shape in zip(made.spec.outputs, _sizes(self.formula, values)))
        if self.state == "generic":
            return _resized(made, spec)
        rule = rules.lookup(func)   # priced: the sizes decide, the output sizes are known
        if self.found is None:      # the class's candidates (rule signatures, checks) are the same for all
            try:
                self.found = candidates(rule, spec, made.aliases)
            except ShapeError as e:
                raise ShapeError(f"{_on_inputs(spec)}: {e}") from e
        found = self.found
        choice = found if isinstance(found, Choice) else cheapest(spec, found, made.aliases)
        if choice is None:
            return _fallback(spec, made.paths, made.writes)
        if choice == made.choice and not made.fallback:
            return _resized(made, spec)
        return Decision(spec, choice, rule.run, made.paths, made.writes)


def instantiate_symbolic(record: DecisionClass, func, args: tuple, kwargs: dict, leaves: list, mesh: DeviceMesh,
                         values: list) -> Optional[Decision]:
    """`DecisionClass.instantiate` for a call with symbolic sizes (`sbp.ops.symbolic`): the spec and output
    shapes hold the call's SymInts; a priced class prices its candidates at the sizes' hints. No spec tokens
    are made (a symbolic size does not hash). None where the class's candidates fall back."""
    made = record.decision
    spec = _respec(made.spec, args, kwargs, leaves, record.sized)
    spec.outputs = tuple(None if m is None else TensorMeta(shape, m.dtype)
                         for m, shape in zip(made.spec.outputs, _sizes(record.formula, values)))
    if record.state == "generic":
        return _resized(made, spec, keyed=False)
    hinted = _hinted(spec)
    if record.found is None:
        record.found = candidates(rules.lookup(func), hinted, made.aliases)
    found = record.found
    if not isinstance(found, Choice):   # as the class was decided: no choice that moves a symbolic dim
        found = [c for c in found if keeps_dims(spec, c[2], is_symbolic)] \
            or [c for c in found if keeps_dims(spec, c[2], is_symbolic, moving=True)]   # (where one must)
    choice = found if isinstance(found, Choice) else cheapest(hinted, found, made.aliases)
    if choice is None:
        return None
    if choice != made.choice:
        made = Decision(hinted, choice, rules.lookup(func).run, made.paths, made.writes)
    return _resized(made, spec, keyed=False)


def size_arguments(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of `func`'s size arguments (`SIZE_ARGS`).

    >>> size_arguments(torch.ops.aten.view.default)
    ((1, 'size'),)
    """
    return tuple((i, arg.name) for i, arg in enumerate(func._schema.arguments) if arg.name in SIZE_ARGS)


def instantiate_shaped(made: Decision, sized: tuple, args: tuple, kwargs: dict, leaves: list,
                       outputs: tuple) -> Decision:
    """`made`'s choice for a call with symbolic sizes of its shape class (a *shaped* class's decision, whose
    size arguments are `sized`, or a replicated call's decision at its hints: `sbp.ops.symbolic` checks that
    either holds at every size), with the output shapes torch's meta kernels gave for the call's symbolic
    shapes (`outputs`: a shape or None each)."""
    spec = _respec(made.spec, args, kwargs, leaves, sized)
    spec.outputs = tuple(None if m is None or o is None else TensorMeta(tuple(o), m.dtype)
                         for m, o in zip(made.spec.outputs, outputs))
    return _resized(made, spec, keyed=False)


def _hinted(spec: OpSpec) -> OpSpec:
    """`spec` with every symbolic size at its hint (what pricing plans on)."""
    def ints(v: Any) -> Any:
        if isinstance(v, torch.SymInt):
            return hint(v)
        if isinstance(v, (list, tuple)):
            return type(v)(ints(x) for x in v)
        return v
    out = OpSpec(spec.func, spec.mesh_shape, {k: ints(v) for k, v in spec.values.items()},
                 tuple(TensorMeta(hint_shape(m.shape), m.dtype, m.placements, m.is_global) for m in spec.inputs))
    out.outputs = tuple(None if m is None else TensorMeta(hint_shape(m.shape), m.dtype) for m in spec.outputs)
    return out


def _respec(first: OpSpec, args: tuple, kwargs: dict, leaves: list, sized: tuple) -> OpSpec:
    """`first` (a call of a shape class, bound by `_bind`) for another call of its class: the same values
    but the size arguments (`sized`: their (position, name)), the same input placements and dtypes, the
    call's input shapes; the outputs are left to the caller. Equal to `_bind` of the call: in a class
    everything else is equal (`sbp.ops.dispatch.class_key`)."""
    inputs = tuple([TensorMeta(tuple(t.shape), m.dtype, m.placements, m.is_global)
                    for t, m in zip(leaves, first.inputs)])
    values = first.values
    if sized:
        values = dict(values)
        for i, name in sized:
            if i < len(args):
                values[name] = _plain(args[i])
            elif name in kwargs:
                values[name] = _plain(kwargs[name])
    return OpSpec(first.func, first.mesh_shape, values, inputs)


def _plain(v: Any) -> Any:
    """A non-tensor argument as `_bind` records it (lists as lists, finite non-zero floats as `FLOAT`)."""
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if type(v) is float and v != 0 and v - v == 0:
        return FLOAT
    return v


_PER_CALL = ("spec", "out_shapes", "out_strides", "out_keys", "bounds")
_SHARED = tuple(name for name in Decision.__slots__ if name not in _PER_CALL)


def _resized(made: Decision, spec: OpSpec, keyed: bool = True) -> Decision:
    """`made` for `spec`, a call of its shape class with the same choice: what depends on sizes (the spec,
    output shapes, strides and spec tokens) made anew, the rest shared -- what `Decision(spec, ...)`
    would compute, without recomputing what the class fixes (tests/ops/test_decision_classes.py compares
    every slot with a cold decision's)."""
    d = Decision.__new__(Decision)
    for name in _SHARED:
        setattr(d, name, getattr(made, name))
    d.spec = spec
    outs, mesh_shape, placements = spec.outputs, spec.mesh_shape, made.choice.outputs
    d.out_shapes = [None if o is None else o.shape for o in outs]
    d.out_strides = [None if o is None else contiguous_strides(o.shape) for o in outs]
    d.out_keys = [None if key is None or not keyed else SPEC_TOKENS.token(placements[k], o.shape, o.dtype, mesh_shape)
                  for k, (key, o) in enumerate(zip(made.out_keys, outs))]
    d.bounds = None if made.bounds is None else index_bounds(spec)   # an index's bound is a size
    return d


def _out_shapes(decision: Decision) -> tuple:
    return tuple(None if m is None else tuple(m.shape) for m in decision.spec.outputs)


def _formula(decision: Decision, values: list[int]) -> Optional[tuple]:
    """Each output size as a symbol (``-1 - index`` into `values`) or a constant; None when the decision
    may not be shared (a fallback, or an output size > the mesh's rank count is no symbol). A guess from one
    call: `DecisionClass.confirm` checks it at other calls of the class before any decision is made from it."""
    spec = decision.spec
    if decision.fallback:
        return None
    where = {v: -1 - i for i, v in enumerate(values)}
    small = math.prod(spec.mesh_shape)
    out = []
    for shape in _out_shapes(decision):
        if shape is None:
            out.append(None)
            continue
        dims = tuple(n if n <= small else where.get(n) for n in shape)
        if None in dims:
            return None
        out.append(dims)
    return tuple(out)


_PROBE = 64   # the far probe moves the r-th smallest size by at least (r + 1)^2 x _PROBE multiples of the rank count


def _probes(values: list[int], bounds: list[int], m: int) -> list[list[int]]:
    """Sizes of made-up calls of the shape class of `values` (its symbols' values): each size keeps its
    remainder mod `m` and its order among them and against the int arguments `bounds` (what
    `sbp.ops.dispatch.class_key` keys; a probe that cannot is left out), and

    - far: the r-th smallest moves up by (r + 1)^2 x max(_PROBE, the largest bound below it) multiples of
      `m`, or as far as the next bound or the next size's probe lets it. Distinct squares: a size that is a
      sum or a multiple of others in `values` is none here (``x.view(n, -1, 4)``'s -1, ``x.repeat(2, 1)``'s
      rows); at least the bound below: a quotient by it changes (``x[::9]``'s rows);
    - least: each is the least size above `m`, the bound below it and the smaller sizes' probes: small int
      arguments may add up to a bound no key holds (``x[-3:5:2]`` has a row only where n < 8);
    - spread: as least, but r multiples of `m` above the smaller sizes' probes: differences between sizes
      change in one of the probes at least, even where bounds hold the far probe close (``x[2:40]``'s n - 2).

    >>> _probes([12, 5], [], 2), _probes([12, 5], [30], 2)   # far: 12 moves by 2 x 4 x 64; 5 < 12 < 30
    ([[524, 133], [4, 3], [6, 3]], [[28, 27], [4, 3], [6, 3]])
    """
    order = sorted(range(len(values)), key=values.__getitem__)
    far, least, spread = list(values), list(values), list(values)
    top = None   # the far probe of the next larger size
    for r in reversed(range(len(order))):
        n = values[order[r]]
        if n not in bounds:
            step = m * (r + 1) ** 2 * max([_PROBE] + [b for b in bounds if b < n])
            limit = min([b for b in bounds if b > n] + ([] if top is None else [top]), default=n + step + 1)
            far[order[r]] = n + min(step, m * ((limit - 1 - n) // m))
        top = far[order[r]]
    for r, i in enumerate(order):
        n = values[i]
        if n not in bounds:
            floor = max([m] + [b for b in bounds if b < n])
            below = order[r - 1] if r else None
            least[i] = _above(n, floor if below is None else max(floor, least[below]), m)
            spread[i] = _above(n, floor if below is None else max(floor, spread[below] + m * r), m)
    return [p for p in (far, least, spread) if _member(p, values, bounds, m)]


def _above(n: int, floor: int, m: int) -> int:
    """The least size above `floor` with `n`'s remainder mod `m`."""
    return floor + 1 + (n - floor - 1) % m


def _member(probe: list[int], values: list[int], bounds: list[int], m: int) -> bool:
    """Whether sizes `probe` are of the shape class of `values`: above `m`, the same remainders mod `m`, the same
    order among them and against `bounds` (`sbp.ops.dispatch.class_key`)."""
    return (all(p > m and (p - v) % m == 0 for p, v in zip(probe, values))
            and all((p > q) == (v > w) and (p == q) == (v == w) for p, v in zip(probe, values)
                    for q, w in zip(probe + bounds, values + bounds)))


def _bounds(values: dict, m: int) -> list[int]:
    """The magnitudes of the int arguments above `m` that are no sizes (`SIZE_ARGS`) among an `OpSpec`'s
    values: what `sbp.ops.dispatch.class_key` orders the sizes against."""
    out: list[int] = []

    def walk(v: Any) -> None:
        if type(v) is int and abs(v) > m:
            out.append(abs(v))
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for name, v in values.items():
        if name not in SIZE_ARGS:
            walk(v)
    return out


def _moved_call(args: tuple, kwargs: dict, sized: tuple, moved: dict[int, int]) -> tuple[tuple, dict]:
    """The call on meta tensors, every size in `moved` (a symbol's value -> its probe) replaced where
    `sbp.ops.dispatch.class_key` finds sizes: tensors' dims and size arguments (`sized`: (position, name))."""
    def conv(v: Any, size: bool) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty([moved.get(n, n) for n in v.shape], dtype=v.dtype, device="meta")
        if size and type(v) is int:
            return moved.get(v, v)
        if type(v) is list or type(v) is tuple:
            return type(v)(conv(x, size) for x in v)
        return v

    positions = {i for i, _ in sized}
    return (tuple(conv(a, i in positions) for i, a in enumerate(args)),
            {k: conv(v, k in SIZE_ARGS) for k, v in kwargs.items()})


def _given(decision: Decision) -> bool:
    """Whether every output's shape is one of the call's size arguments as given (``view(x, [a * b, c])``,
    ``new_zeros``; no -1): torch makes it so for every call it accepts, whatever a probe shows."""
    given = [tuple(v) for name, v in decision.spec.values.items() if name in SIZE_ARGS and isinstance(v, list)]
    return all(shape is None or shape in given for shape in _out_shapes(decision))


def free(decision: Decision) -> bool:
    """Whether the decision's choice costs nothing: nothing moves, or only by local moves (no bytes, no
    collective, no new Partial to reduce); otherwise it won on price, and sizes decide."""
    spec, choice = decision.spec, decision.choice
    if not (_changed(spec, choice) or _writes_back(spec, choice, decision.aliases)):
        return True
    return _price(spec, choice, decision.aliases) == (0, 0)


def _sizes(formula: tuple, values: list[int]) -> tuple:
    return tuple(None if dims is None else tuple(values[-1 - n] if n < 0 else n for n in dims) for dims in formula)
