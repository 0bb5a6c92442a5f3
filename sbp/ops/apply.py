"""Running a decision: lay the inputs out, run the rule's local computation, wrap the local results.

A `Decision` is made once per cache key (`sbp.ops.decide.decide`) and executed for every call with that
key. The common case -- nothing to move, nothing written, one output, the op itself runs locally --
takes a short path. In-place results computed in another layout are written back into the original's
layout; a view whose local tensor could not alias its base is flagged, and writing into it raises
instead of silently missing the base.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Optional

import torch

from ..runtime.traced import is_tracing
from ..tensor.global_tensor import (
    FallbackWarning,
    GlobalTensor,
    TensorNotes,
    contiguous_strides,
    empty_outside,
    is_detached,
    local_from_full,
    normal_in_inference_mode,
    note_local_write,
    note_uncounted_write,
    notes_of,
    redistribute_raw,
)
from ..tensor.setitem import refuse_shared_memory
from ..values.errors import SbpError, ShapeError, UnsupportedOpError, torch_alike
from ..values.mesh import DeviceMesh
from ..values.placement import Split
from .cache import SPEC_TOKENS, WARNED_OPS
from .random import is_random
from .spec import B, Call, Choice, OpSpec, default_run
from .strict import is_strict
from .through import can_write_through, own_copies, refuse_write, write_through


def _substitute(args: tuple, kwargs: dict, paths: list[tuple], locals_: list) -> tuple[list, dict]:
    largs, lkwargs = list(args), dict(kwargs) if kwargs else {}
    copied: set = set()
    for path, local in zip(paths, locals_):
        where = path[0]
        target = largs if isinstance(where, int) else lkwargs
        if len(path) == 1:
            target[where] = local
        else:
            if where not in copied:
                target[where] = list(target[where])
                copied.add(where)
            target[where][path[1]] = local
    return largs, lkwargs


def _user_stacklevel() -> int:
    """The `warnings.warn` stacklevel, from its caller, of the first frame outside sbp: the user's line
    (an op may be reached through sbp frames such as `GlobalTensor.__getitem__`)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "sbp":
        frame, level = frame.f_back, level + 1
    return level


# ---- decisions -----------------------------------------------------------------------------------------
class Decision:
    """How to run one (op, input specs): input targets, output placements and shapes, the local run.

    Made once per cache key by `decide`; `execute` runs it for a call with those specs."""

    __slots__ = ("spec", "choice", "targets", "run", "paths", "out_shapes", "out_strides", "out_keys", "aliases",
                 "writes", "fallback", "blank", "first", "fast", "view", "fast_inplace", "bounds", "uncounted")

    def __init__(self, spec: OpSpec, choice: Choice, run, paths: list[tuple], writes: list[tuple[int, Optional[int]]],
                 fallback: bool = False, blank: bool = False) -> None:
        self.spec = spec
        self.choice = choice
        self.run = run
        self.paths = paths
        self.writes = writes          # (input index, output slot or None) for every input the op writes
        # writes torch counts nowhere (no ADInplaceOrView kernel: fused optimizers, amp's unscale, batch norm's
        # running stats): a P(sum) tensor's kept reduction, trusted while the version counters stand, would
        # outlive the write, so sbp records the write by storage (`_note_uncounted_writes`). (Bumping the counters
        # instead would fail autograd's check of tensors the op saved for its backward, as batch norm saves
        # its running stats.)
        self.uncounted = bool(writes) and not _has_kernel(spec.func.name(), "ADInplaceOrView")
        self.aliases = {k: i for i, k in writes if k is not None}
        self.fallback = fallback
        self.blank = blank            # the first input is only drawn over: a fresh full tensor, not gathered
        self.first = next(i for i, m in enumerate(spec.inputs) if m.is_global)
        # None where the input is used as it is (a plain tensor counts as Broadcast)
        self.targets = tuple(None if tgt == meta.placements else tgt
                             for tgt, meta in zip(choice.inputs, spec.inputs))
        self.out_shapes = [None if o is None else o.shape for o in spec.outputs]
        self.out_strides = [None if o is None else contiguous_strides(o.shape) for o in spec.outputs]
        # a factory's output may be made a leaf that requires grad (zeros_like(x, requires_grad=True)):
        # its key is left to its first op, which also gives it the leaf rule (`sbp.ops.dispatch`)
        factory = spec.func._schema.name.split("::")[-1] in FACTORIES
        self.out_keys = [None if o is None or k in self.aliases or factory else
                         SPEC_TOKENS.token(choice.outputs[k], o.shape, o.dtype, spec.mesh_shape)
                         for k, o in enumerate(spec.outputs)]
        self.bounds = index_bounds(spec)   # an index / target every rank holds whole: checked before slicing
        # the common case: nothing moves, nothing is written, one output, the op itself runs locally
        returns = spec.func._schema.returns
        self.view = any(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        self.fast = (not fallback and not writes and run is default_run and len(spec.outputs) == 1
                     and len(returns) == 1 and str(returns[0].type) == "Tensor" and all(t is None for t in self.targets)
                     and all(len(p) == 1 and isinstance(p[0], int) for p in paths))
        # the in-place kind of that case (``buf.mul_(m)``, ``p.add_(g, alpha=-lr)``: an optimizer's update):
        # nothing moves, only the first input is written, in its own layout, and the op returns it
        self.fast_inplace = (not fallback and writes == [(0, 0)] and run is default_run and len(spec.outputs) == 1
                             and len(returns) == 1 and not self.view and all(t is None for t in self.targets)
                             and choice.outputs[0] == spec.inputs[0].placements
                             and all(len(p) == 1 and isinstance(p[0], int) for p in paths))

    def execute(self, func, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Run the decision for one call whose key it was made for; `leaves` are the call's tensors in
        flattened argument order (as `sbp.ops.dispatch.handle` collects them).

        >>> import sbp, sbp.testing
        >>> from sbp.ops.decide import decide
        >>> def fn(mesh):
        ...     x, neg = sbp.distribute(torch.ones(4), mesh, "S(0)"), torch.ops.aten.neg.default
        ...     return decide(neg, (x,), {}, [x], mesh).execute(neg, (x,), {}, [x]).to_local().tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [[-1.0, -1.0], [-1.0, -1.0]]
        """
        if self.view and normal_in_inference_mode(leaves[self.first]):   # a view of a normal tensor: normal
            with torch.inference_mode(False):
                return self.execute(func, args, kwargs, leaves)
        mesh = leaves[self.first]._mesh
        if self.fast:
            largs = list(args)
            for (pos,), t in zip(self.paths, leaves):
                if isinstance(t, GlobalTensor):
                    if t._mesh is not mesh and t._mesh != mesh:
                        refuse_mixed_meshes(func, mesh, t)
                    largs[pos] = t._local
            if mesh_coord(mesh) is None:
                return self._wrap_outside(mesh, leaves)
            out = self.wrap_output(0, func(*largs, **kwargs), mesh)
            if self.view:   # (inlined `notes_of` and `is_detached`: every view op passes here)
                notes = out.__dict__["_notes"] = TensorNotes()
                base = leaves[0].__dict__.get("_notes")
                if func not in SAME_LAYOUT:
                    notes.view = (func, args, kwargs, None)   # its logical strides, worked out if asked
                elif base is not None:
                    notes.view, notes.strides = base.view, base.strides
                if base is not None and base.detached:
                    notes.detached = True   # a view of a detached view is detached too
            return out
        if self.fallback and not self.blank:   # a draw over a made tensor gathers nothing: nothing to warn of
            self._complain()
        if self.bounds is not None:
            check_bounds(self.bounds, leaves)
        if self.writes:
            own_copies(func, leaves, self.writes)
        through = [leaves[i] for i, _ in self.writes if isinstance(leaves[i], GlobalTensor) and is_detached(leaves[i])]
        for view in through:   # views laid out anew: the write goes on into the base (`sbp.ops.through`)
            if not can_write_through(view):
                raise refuse_write(func, view, view._placements)
        coord = mesh_coord(mesh)
        locals_ = []
        for i, (t, target) in enumerate(zip(leaves, self.targets)):
            if isinstance(t, GlobalTensor):
                if t._mesh is not mesh and t._mesh != mesh:
                    refuse_mixed_meshes(func, mesh, t)
                if target is None:
                    locals_.append(t._local)
                elif self.blank and i == 0:
                    locals_.append(t._local.new_empty(t.shape))   # only its shape is read: made, not gathered
                else:
                    locals_.append(redistribute_raw(t, target)._local)
            else:
                locals_.append(t if target is None or coord is None else local_from_full(t, mesh, target))
        if coord is None and self.spec.outputs:  # outside the mesh: empty tensors, nothing to compute
            return self._wrap_outside(mesh, leaves)
        largs, lkwargs = _substitute(args, kwargs, self.paths, locals_)
        result = self.run(Call(func, largs, lkwargs, self.spec, self.choice, mesh, coord))
        for i, k in self.writes:
            self._write_back(i, k, leaves, locals_, mesh)
            if isinstance(leaves[i], GlobalTensor):
                note_local_write(leaves[i])
        if self.uncounted:
            _note_uncounted_writes(leaves, self.writes)
        for view in through:
            write_through(view)
        out = self._wrap(result, mesh, leaves)
        if self.view:
            _mark_detached(out, leaves[0], self.targets[0] is not None)
            _note_views(out, func, args, kwargs)
        return out

    def wrap_output(self, k: int, local: torch.Tensor, mesh: DeviceMesh) -> GlobalTensor:
        """Output slot `k` of this decision as a GlobalTensor around `local` (its cache key already made).

        >>> import sbp
        >>> mesh = sbp.DeviceMesh((1,))
        >>> x = GlobalTensor(torch.ones(2), mesh, (sbp.B,), (2,))
        >>> from sbp.ops.decide import decide
        >>> decide(torch.ops.aten.neg.default, (x,), {}, [x], mesh).wrap_output(0, -torch.ones(2), mesh).placements
        (B,)
        """
        pls = self.choice.outputs[k]
        key = self.out_keys[k]
        return _wrap_global(local, mesh, pls, self.out_shapes[k], self.out_strides[k],
                            None if key is None else (pls, mesh, key))

    def _complain(self) -> None:
        """The fallback's warning (an error under `sbp.strict()`): once per op, and only when some input
        had to be gathered (all of them already Broadcast or plain: nothing was lost by the fallback)."""
        pls = ", ".join(repr(m.placements) if m.is_global else "plain" for m in self.spec.inputs)
        if is_strict():
            raise UnsupportedOpError(
                f"sbp.strict(): no sharding rule for {self.spec.func} (input placements: {pls}); "
                f"add a rule (docs/operators.md) or leave strict() to run it on Broadcast inputs")
        func = self.spec.func
        if func not in WARNED_OPS and any(t is not None for t in self.targets):
            WARNED_OPS.add(func)
            warnings.warn(f"sbp: no sharding rule for {func} with input placements {pls}; it ran on "
                          f"Broadcast (full) inputs. sbp.strict() makes this an error. (Warned once per op.)",
                          FallbackWarning, stacklevel=_user_stacklevel())

    def _write_back(self, i: int, k: Optional[int], leaves: list, locals_: list, mesh: DeviceMesh) -> None:
        """An input the op wrote: if it was computed in another layout, copy the result into the original."""
        layout = self.choice.outputs[k] if k is not None and k < len(self.choice.outputs) else self.choice.inputs[i]
        original = leaves[i]
        current = self.spec.inputs[i].placements
        if self.targets[i] is None and layout == current:
            return  # written in place, in its own layout
        result = GlobalTensor(locals_[i], mesh, layout, self.spec.inputs[i].shape)
        if isinstance(original, GlobalTensor):
            refuse_shared_memory(original, f"{self.spec.func}: copying its result (computed in another layout) into")
            original._local.copy_(redistribute_raw(result, current)._local)
        else:
            original.copy_(redistribute_raw(result, (B,) * mesh.ndim)._local)

    def _wrap(self, result: Any, mesh: DeviceMesh, leaves: list) -> Any:
        if isinstance(result, torch.Tensor):
            return self._wrap_one(0, result, mesh, leaves)
        if isinstance(result, (tuple, list)):
            out = [self._wrap_one(k, r, mesh, leaves) if isinstance(r, torch.Tensor) else r
                   for k, r in enumerate(result)]
            return tuple(out) if isinstance(result, tuple) else out
        return result

    def _wrap_one(self, k: int, local: torch.Tensor, mesh: DeviceMesh, leaves: list) -> Any:
        source = self.aliases.get(k)
        if source is not None:
            return leaves[source]
        if k < len(self.out_shapes) and self.out_shapes[k] is not None:
            return self.wrap_output(k, local, mesh)
        if k == 0 and self.fallback and leaves and is_random(self.spec.func):
            like = leaves[0]
            if (isinstance(like, GlobalTensor) and tuple(local.shape) == tuple(like.shape)
                    and all(p == B or isinstance(p, Split) for p in like._placements)):
                # a random op's draw shaped like its first input (`bernoulli`, `rand_like`): laid out as that
                # input, as its in-place form keeps it (dropout's mask under torch.compile): a local cut
                return GlobalTensor(local_from_full(local, mesh, like._placements), mesh, like._placements,
                                    tuple(like.shape))
        return GlobalTensor(local, mesh, (B,) * mesh.ndim, tuple(local.shape))   # shape from the local result

    def _wrap_outside(self, mesh: DeviceMesh, leaves: list) -> Any:
        device = next(t.device for t in leaves if isinstance(t, GlobalTensor))
        outs = []
        for k, meta in enumerate(self.spec.outputs):
            if meta is None:
                outs.append(None)
            elif k in self.aliases:
                outs.append(leaves[self.aliases[k]])
            else:
                outs.append(GlobalTensor(empty_outside(meta.ndim, meta.dtype, device), mesh,
                                         self.choice.outputs[k], meta.shape))
        returns = self.spec.func._schema.returns
        if len(returns) == 1 and str(returns[0].type) == "Tensor":
            return outs[0]
        return outs if len(returns) == 1 else tuple(outs)


_TARGET_OPS = frozenset(("nll_loss_forward", "nll_loss2d_forward"))
_INDEX_OPS = frozenset(("gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                        "scatter_reduce_"))


def index_bounds(spec: OpSpec) -> Optional[tuple]:
    """What `check_bounds` checks for one op's spec, or None: (leaf index, bound, ignored value, error kind,
    dim) for an nll target or a gather/scatter index that every rank holds whole (plain or all Broadcast).

    Such an index is sliced to each rank's block before the kernel sees it, so an out-of-range value
    would raise on its owner only while the others wait in the next collective (SPMD). A split index
    is not checked here (the batch-split mean nll folds its check into its all_reduce).

    >>> import sbp
    >>> from sbp.ops.spec import Ref, TensorMeta
    >>> x, t = TensorMeta((4, 5), torch.float32, (sbp.S(0),)), TensorMeta((4,), torch.int64, (), False)
    >>> values = {"self": Ref(0), "target": Ref(1), "ignore_index": -100}
    >>> index_bounds(OpSpec(torch.ops.aten.nll_loss_forward.default, (2,), values, (x, t)))
    (1, 5, -100, 'target', None)
    """
    name = spec.func._schema.name.split("::")[-1]
    if name in _TARGET_OPS:
        i, x = spec.index("target"), spec.tensor("self")
        if i is None or x is None:
            return None
        bound, ignored, kind, dim = x.shape[1] if x.ndim >= 2 else x.shape[0], spec.arg("ignore_index"), "target", None
    elif name in _INDEX_OPS:
        i, x, dim = spec.index("index"), spec.tensor("self"), spec.arg("dim")
        if i is None or x is None or not isinstance(dim, int):
            return None
        dim = dim % max(x.ndim, 1)
        bound, ignored, kind = x.shape[dim] if x.ndim else 1, None, "index"
    else:
        return None
    meta = spec.inputs[i]
    if meta.is_global and any(p != B for p in meta.placements):
        return None
    return i, bound, ignored, kind, dim


def check_bounds(bounds: tuple, leaves: list) -> None:
    """Raise torch's error for an out-of-range index on every rank alike (see `index_bounds`): one min
    and one max over the whole index, no communication. It is a `ShapeError` that is also torch's class.

    >>> check_bounds((0, 5, -100, "target", None), [torch.tensor([0, 5])])
    Traceback (most recent call last):
    ...
    sbp.values.errors.ShapeError: Target 5 is out of bounds.
    """
    i, bound, ignored, kind, dim = bounds
    t = leaves[i]
    t = t._local if isinstance(t, GlobalTensor) else t
    if is_tracing(t) or t.is_floating_point() or t.is_complex():
        return
    bad = first_out_of_range(t, bound, ignored)
    if bad is None:
        return
    if kind == "target":   # torch's messages and classes (a ShapeError that is also torch's IndexError / RuntimeError)
        raise torch_alike(ShapeError, f"Target {bad} is out of bounds.", IndexError)
    raise torch_alike(ShapeError, f"index {bad} is out of bounds for dimension {dim} with size {bound}", RuntimeError)


def first_out_of_range(t: torch.Tensor, bound: int, ignored: Any = None) -> Optional[int]:
    """The first value of integer tensor `t` outside [0, bound) other than `ignored`, or None: one
    `aminmax` (and one host sync) when every value is in range, the usual case.

    >>> first_out_of_range(torch.tensor([0, -100, 4]), 5, -100), first_out_of_range(torch.tensor([0, 9]), 5)
    (None, 9)
    """
    if t.numel() == 0:
        return None
    lo, hi = (int(v) for v in torch.aminmax(t))
    if 0 <= lo and hi < bound:
        return None
    bad = (t < 0) | (t >= bound)
    if ignored is not None:
        bad &= t != ignored
    found = t[bad][:1].tolist()
    return found[0] if found else None


# views with their base's layout: they take the base's recipe, never the base itself. Autograd saves an op's
# output for its backward as a detach of it: a recipe naming the output would make a reference cycle through
# autograd's C++ graph, which Python's collector cannot see (the output and its graph would never be freed)
SAME_LAYOUT = frozenset((torch.ops.aten.detach.default, torch.ops.aten.alias.default))


_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key


def _note_uncounted_writes(leaves: list, writes: list) -> None:
    """For an op whose writes torch does not count (`Decision.uncounted`): record the writes by storage,
    so the kept reductions of every handle on the written data (the tensor, a detach, a view, a view's
    base) see them (`sbp.tensor.global_tensor.note_uncounted_write`)."""
    for i, _ in writes:
        if isinstance(leaves[i], GlobalTensor):
            note_uncounted_write(leaves[i]._local)


def _note_views(out: Any, func, args: tuple, kwargs: dict) -> None:
    """Record how each global output of a view op was made (`sbp.tensor.global_tensor.logical_strides` replays it)."""
    many = isinstance(out, (list, tuple))
    for k, t in enumerate(out if many else [out]):
        if isinstance(t, GlobalTensor) and t is not args[0]:
            notes = notes_of(t)
            if func not in SAME_LAYOUT:
                notes.view = (func, args, kwargs, k if many else None)
            elif args[0]._notes is not None:
                notes.view, notes.strides = args[0]._notes.view, args[0]._notes.strides


FACTORIES = frozenset(("zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
                       "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided"))


def _mark_detached(out: Any, base: Any, moved: bool) -> None:
    """Flag view outputs whose local tensor does not alias the base's (`moved`: the base was laid out anew
    for the view; or the rule's run copied): an in-place op on them would not reach the base, so `execute`
    refuses it. Every rank must decide alike (SPMD): the layout decides, and the alias test holds for
    empty locals too (a rank whose piece of the view is empty), unlike a data-pointer comparison, and for
    traced locals (fake and functional tensors keep their storages' aliasing)."""
    if not isinstance(base, GlobalTensor):
        return
    detached = moved or is_detached(base)
    local = base._local
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(t, GlobalTensor) and t is not base and (detached or not _is_alias_of(t._local, local)):
            notes_of(t).detached = True


_is_alias_of = torch._C._is_alias_of


_make_wrapper = torch.Tensor._make_wrapper_subclass
_STRIDED = torch.strided


def _wrap_by_constructor(local, mesh, pls, shape, strides, key) -> GlobalTensor:
    out = GlobalTensor(local, mesh, pls, shape)
    out.__dict__["_key"] = key
    return out


def _wrap_direct(local, mesh, pls, shape, strides, key) -> GlobalTensor:
    """`GlobalTensor(local, mesh, pls, shape)` with the strides computed once per decision, not per call
    (and not passed at all for a strided local: the wrapper's default strides are the contiguous ones),
    and its cache key already made."""
    if local.layout is _STRIDED:
        out = _make_wrapper(GlobalTensor, shape, dtype=local.dtype, device=local.device)
    else:
        out = _make_wrapper(GlobalTensor, shape, strides=strides, dtype=local.dtype, device=local.device,
                            layout=local.layout)
    d = out.__dict__
    d["_local"] = local
    d["_mesh"] = mesh
    d["_placements"] = pls
    d["_key"] = key
    d["_notes"] = None
    return out


def _pick_wrapper():
    """Use `_wrap_direct` only while it builds exactly what the GlobalTensor constructor builds."""
    local, mesh, pls = torch.zeros(2, 3), DeviceMesh((1,)), (B,)
    want = GlobalTensor(local, mesh, pls, (2, 3))
    got = _wrap_direct(local, mesh, pls, (2, 3), contiguous_strides((2, 3)), None)
    same = (vars(want).keys() == vars(got).keys() and want.stride() == got.stride()
            and want.requires_grad == got.requires_grad and type(want) is type(got))
    return _wrap_direct if same else _wrap_by_constructor


def refuse_mixed_meshes(func, mesh: DeviceMesh, t: GlobalTensor) -> None:
    """Raise the `SbpError` for an op whose global tensors live on different meshes.

    >>> import sbp
    >>> t = GlobalTensor(torch.ones(2), sbp.DeviceMesh((2,)), (sbp.B,), (2,))
    >>> refuse_mixed_meshes("aten.add.Tensor", sbp.DeviceMesh((1,)), t)
    Traceback (most recent call last):
    ...
    sbp.values.errors.SbpError: aten.add.Tensor mixes global tensors on different meshes (DeviceMesh((1,)) and
    DeviceMesh((2,))); redistribute them onto one mesh first
    """
    raise SbpError(f"{func} mixes global tensors on different meshes ({mesh!r} and {t._mesh!r}); "
                   f"redistribute them onto one mesh first")


def mesh_coord(mesh: DeviceMesh) -> Optional[tuple[int, ...]]:
    """This rank's coord on `mesh` (None outside it), read from the binding when it knows it (fast path).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(mesh_coord, (2,))
    [(0,), (1,)]
    """
    binding = mesh.binding
    coord = getattr(binding, "coord", _MISSING)
    return mesh.coord if coord is _MISSING else coord


_MISSING = object()


_wrap_global = _pick_wrapper()
