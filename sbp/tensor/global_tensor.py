"""`GlobalTensor`: a `torch.Tensor` wrapper subclass holding this rank's local tensor of one global tensor.

The wrapper reports the *global* shape, stride, dtype and device; the data lives in `_local` (a plain
tensor holding this rank's block, or its Partial part). Autograd runs on the wrapper (see
`sbp.tensor.autograd`); ATen ops reach `__torch_dispatch__`, which hands every op to the handler plugged in
with `set_op_handler` -- the one op path, `sbp.ops` (`sbp.ops.install()`; ``import sbp`` does it on the first
use of a torch-level name). Per-tensor state is declared on the class: the local tensor, mesh, placements
and op-cache key as direct attributes (every op reads them), the rest in one slotted record, `TensorNotes`,
made on first use (`notes_of`). Also here: the local helpers every layer above shares (`local_from_full`,
`redistribute_raw`, `grad_placements`, ...).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import torch

from ..runtime import agreement, pending, symbolic
from ..runtime.agreement import is_enabled as debug_enabled
from ..runtime.executor import cached_plan, redistribute_local
from ..runtime.pending import PendingTensor
from ..runtime.traced import cache_key, graph_break, is_tracing, traced_here
from ..values.errors import DTypeError, MeshError, PlacementError, SbpError, ShapeError
from ..values.layout import block, local_slices
from ..values.mesh import DeviceMesh, live_mesh
from ..values.placement import Broadcast, Partial, Placement, Split, normalize
from . import (
    autograd,  # the class's conversions are its autograd functions: the one allowed cycle
    traced_values,
)
from .setitem import basic_entries, index_error, narrows_a_split_dim, write_blocks

OpHandler = Callable[[Any, tuple, dict], Any]
_op_handler: list[Optional[OpHandler]] = [None]  # the one plug-in point; set by sbp.ops, never a flag


class FallbackWarning(UserWarning):
    """An op has no sharding rule and ran on the full (Broadcast) tensor (`sbp.strict()` makes it an error).

    >>> import sbp
    >>> issubclass(FallbackWarning, UserWarning), issubclass(FallbackWarning, sbp.SbpError)
    (True, False)
    """


class TensorNotes:
    """What sbp remembers about some `GlobalTensor`s beyond their local tensor, mesh, placements and cache key.

    ``view``: how a view op's output was made, ``(func, args, kwargs, output index)``, replayed on meta
    tensors by `logical_strides`. ``strides``: the logical strides once worked out (or set by an in-place
    view). ``detached``: a view whose local tensor does not alias its base's (a write into it would miss
    the base, so writes are refused). ``leaf_rule``: the leaf's gradient hook is installed
    (`install_leaf_rule`). Most tensors never need any of these, so a tensor's record is made on first use
    (`notes_of`); until then ``t._notes`` is None and every field reads as its default.

    >>> notes = TensorNotes()
    >>> notes.view, notes.strides, notes.detached, notes.leaf_rule
    (None, None, False, False)
    """

    __slots__ = ("view", "strides", "detached", "leaf_rule")

    def __init__(self) -> None:
        self.view: Optional[tuple] = None
        self.strides: Optional[tuple[int, ...]] = None
        self.detached = False
        self.leaf_rule = False

    def __repr__(self) -> str:
        return (f"TensorNotes(view={self.view is not None}, strides={self.strides}, detached={self.detached}, "
                f"leaf_rule={self.leaf_rule})")


class GlobalTensor(torch.Tensor):
    """One logical tensor spread over a device mesh; this object holds this rank's local tensor.

    Build one with `sbp.distribute`, `sbp.from_local` or a factory (`sbp.zeros`, `sbp.randn`, ...), not
    with the constructor, which trusts its arguments (normalised placements, checked global shape).

    >>> import torch, sbp
    >>> mesh = sbp.DeviceMesh((2, 2))                        # a pure value: no processes needed here
    >>> x = GlobalTensor(torch.zeros(4, 12), mesh, (sbp.S(0), sbp.B), (8, 12))
    >>> x
    GlobalTensor(shape=(8, 12), placements=(S(0), B), mesh=(2, 2))
    >>> x.shape, x.local_shape
    (torch.Size([8, 12]), torch.Size([4, 12]))
    """

    _local: torch.Tensor
    _mesh: DeviceMesh
    _placements: tuple[Placement, ...]
    _key: Optional[tuple]   # (placements, mesh, spec token): its part of an op's cache key (sbp.ops.dispatch)
    _notes: Optional[TensorNotes]   # the rest of sbp's per-tensor state; None until `notes_of` makes it

    __torch_function__ = torch._C._disabled_torch_function_impl  # results stay what dispatch returns

    @staticmethod
    def __new__(cls, local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
                global_shape: Sequence[int], *, requires_grad: bool = False) -> "GlobalTensor":
        shape = tuple(global_shape)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=contiguous_strides(shape), dtype=local.dtype, device=local.device,
            layout=local.layout, requires_grad=requires_grad)
        if mesh.binding is None and torch.compiler.is_compiling():
            mesh = _rebound(mesh)
        d = self.__dict__
        d["_local"], d["_mesh"], d["_placements"] = local, mesh, tuple(placements)
        d["_key"] = d["_notes"] = None
        return self

    def item(self) -> Any:
        """The value of a one-element global tensor as a Python number (the same on every rank).

        >>> import sbp, sbp.testing
        >>> sbp.testing.spmd(lambda mesh: sbp.distribute(torch.full((1,), 3.0), mesh, "B").item(), (2,))
        [3.0, 3.0]
        """
        if self.numel() != 1:
            raise ShapeError(f".item() needs a global tensor with exactly one element, got global shape "
                             f"{tuple(self.shape)} ({self.numel()} elements) with placements "
                             f"{_fmt(self._placements)}")
        self._on_mesh("item")
        return super().item()

    def tolist(self) -> Any:
        """The logical tensor as (nested) Python lists, the same on every rank (every rank calls it: a planned
        gather, as `full()`).

        >>> import sbp, sbp.testing
        >>> sbp.testing.spmd(lambda mesh: sbp.distribute(torch.arange(3.), mesh, "S(0)").tolist(), (2,))
        [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
        """
        return self._whole("tolist").tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """The logical tensor as a NumPy array, the same on every rank (every rank calls it: a planned gather,
        as `full()`; ``np.asarray(x)`` too). As torch's, refused for a tensor that requires grad unless `force`.

        >>> import sbp, sbp.testing
        >>> sbp.testing.spmd(lambda mesh: sbp.distribute(torch.arange(3.), mesh, "S(0)").numpy().tolist(), (2,))
        [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
        """
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return self._whole("numpy").detach().numpy(force=force)

    def _whole(self, what: str) -> torch.Tensor:
        self._on_mesh(what)
        return self.full()

    def _on_mesh(self, what: str) -> None:
        if self._mesh.coord is None:
            raise MeshError(f".{what}() on rank {self._mesh.binding.rank}, which is outside the tensor's mesh "
                            f"(ranks {list(self._mesh.ranks)}): it holds no value; call it on the mesh's ranks, or "
                            f"redistribute the tensor onto a mesh that includes this rank")

    @property
    def data(self) -> "GlobalTensor":
        """As torch's: the same global tensor detached from autograd (sharing the local)."""
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """``x.data = y`` with `y` a global tensor on `x`'s mesh: `x` takes `y`'s local, placements, global
        shape and dtype (its identity and autograd flags stay), as torch's ``.data`` assignment. A plain
        tensor or another mesh is an `SbpError`: the layout would be lost.

        >>> import sbp, sbp.testing
        >>> def fn(mesh):
        ...     x = sbp.distribute(torch.ones(4), mesh, "S(0)")
        ...     x.data = x.data.double() * 2
        ...     return x.dtype, x.to_local().tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [(torch.float64, [2.0, 2.0]), (torch.float64, [2.0, 2.0])]
        """
        if not isinstance(value, GlobalTensor):
            raise SbpError(f"x.data = <{type(value).__name__}>: a global tensor's data must be a global tensor on "
                           f"its mesh (the layout would be lost); lay the value out first (sbp.distribute / "
                           f"sbp.from_local), or write into x in place (with torch.no_grad(): x.copy_(...))")
        if value._mesh != self._mesh:
            raise SbpError(f"x.data = y: y is on mesh {value._mesh!r}, x on {self._mesh!r}; redistribute y onto x's "
                           f"mesh first (y.redistribute(placements, mesh=x.mesh))")
        torch.Tensor.data.__set__(self, value)   # the wrapper's global shape, strides and dtype
        d, v = self.__dict__, value.__dict__
        d["_local"], d["_placements"], d["_notes"] = v["_local"], v["_placements"], v["_notes"]
        d["_key"] = None   # the op cache's key of this tensor is made again from the new layout
        if getattr(self, "_is_param", False):
            _static_parameter_shapes(self)

    # ---- indexing: torch checks integer indices against the (global) sizes before any op runs ----------
    def __getitem__(self, index: Any) -> Any:
        try:
            return super().__getitem__(index)
        except IndexError as e:
            if isinstance(e, SbpError):   # an op's own error (it names the layout already)
                raise
            raise index_error(self, index, e) from e

    def __setitem__(self, index: Any, value: Any) -> None:
        entries = basic_entries(index, self.ndim)
        if entries is not None and narrows_a_split_dim(self, entries) and not is_detached(self):
            # a slice of a split dim cannot stay a view: write the blocks (recorded by autograd if needed)
            if torch.is_grad_enabled() and (self.requires_grad or getattr(value, "requires_grad", False)):
                return autograd.write_blocks_autograd(self, index, entries, value)
            return write_blocks(self, index, entries, value)
        try:
            super().__setitem__(index, value)
        except IndexError as e:
            if isinstance(e, SbpError):   # an op's own error (it names the layout already)
                raise
            raise index_error(self, index, e) from e

    # ---- metadata --------------------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        """The normalised placements, one per mesh axis, e.g. ``(S(0), B)``.

        >>> import sbp, sbp.testing
        >>> sbp.testing.spmd(lambda mesh: sbp.distribute(torch.ones(4, 3), mesh, "S(-2)").placements, (2,))
        [(S(0),), (S(0),)]
        """
        return self._placements

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh the tensor lives on.

        >>> import sbp
        >>> GlobalTensor(torch.ones(2, 3), sbp.DeviceMesh((2,), names=("tp",)), (sbp.S(0),), (4, 3)).mesh.names
        ('tp',)
        """
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The device mesh (DTensor's spelling of `mesh`).

        >>> import sbp
        >>> x = GlobalTensor(torch.ones(2), sbp.DeviceMesh((2,)), (sbp.S(0),), (4,))
        >>> x.device_mesh is x.mesh
        True
        """
        return self._mesh

    @property
    def local_shape(self) -> torch.Size:
        """The shape of this rank's local tensor (empty for a rank outside the mesh).

        >>> import sbp, sbp.testing
        >>> sbp.testing.spmd(lambda mesh: tuple(sbp.distribute(torch.ones(5, 2), mesh, "S(0)").local_shape), (2,))
        [(3, 2), (2, 2)]
        """
        return self._local.shape

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        extra = "" if self.dtype == torch.float32 else f", dtype={self.dtype}"
        if self.grad_fn is not None:
            extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            extra += ", requires_grad=True"
        return (f"GlobalTensor(shape={tuple(self.shape)}, placements={_fmt(self._placements)}, "
                f"mesh={self._mesh.shape}{extra})")

    __str__ = __repr__  # printing the values would need a collective; show the layout instead

    # ---- conversions (differentiable; see sbp.tensor.autograd) -----------------------------------------
    def to_local(self, *, grad_placements=None) -> torch.Tensor:
        """This rank's local tensor (plain). Its gradient is taken as this rank's share with the tensor's
        placements (`P(op)` parts as `P(sum)` parts), or with `grad_placements` when given.

        >>> import sbp
        >>> GlobalTensor(torch.ones(2, 3), sbp.DeviceMesh((2,)), (sbp.S(0),), (4, 3)).to_local().shape
        torch.Size([2, 3])
        """
        return autograd.to_local(self, grad_placements)

    def full(self) -> torch.Tensor:
        """The whole logical tensor as a plain tensor on every rank (a planned redistribution to all-`B`).

        The gradient flowing into it is taken as Broadcast: every rank computed the same loss.

        >>> import sbp
        >>> GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,)).full()
        tensor([1., 1.])
        """
        if torch.compiler.is_compiling() and traced_here():  # dynamo: one opaque call, traced by AOTAutograd (sbp.runtime.traced)
            return _compiled_full(self)
        return autograd.full(self)

    full_tensor = full

    def redistribute(self, placements=None, dtensor_placements=None, *, mesh: Optional[DeviceMesh] = None,
                     device_mesh: Optional[DeviceMesh] = None, async_op: bool = False) -> "GlobalTensor":
        """The same logical tensor with other placements (objects or a string like ``"S(0), B"``).

        Runs the planner's cheapest plan; differentiable (the backward is a planned redistribution too).
        With `mesh`, moves to another mesh (other ranks and/or shape; `sbp.runtime.crossmesh`).
        DTensor's spellings work too: ``x.redistribute(mesh, placements)`` and ``device_mesh=``.
        With `async_op=True` it returns at once: the collectives run on the rank's ordered queue
        (`sbp.runtime.pending`) and the result's local tensor waits for them at its first use (`wait()`
        forces it); its backward is asynchronous too. (Cross-mesh moves and compiled code run at once.)

        >>> import sbp, sbp.testing
        >>> def fn(mesh):
        ...     x = sbp.distribute(torch.arange(6.), mesh, "S(0)")
        ...     return x.redistribute("B").to_local().tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
        """
        if placements is None or dtensor_placements is not None or device_mesh is not None \
                or placements.__class__ is DeviceMesh:
            placements, mesh = _redistribute_arguments(placements, dtensor_placements, mesh, device_mesh)
        if torch.compiler.is_compiling() and traced_here():  # dynamo: one opaque call, traced by AOTAutograd (sbp.runtime.traced)
            if isinstance(mesh, DeviceMesh) and mesh != self._mesh:
                return _redistribute_across(self, placements, mesh)   # a graph break: runs eagerly
            return _compiled_redistribute(self, placements_text(placements),
                                          () if mesh is None else mesh_description(mesh))
        return _redistribute(self, placements, mesh, async_op)

    def wait(self) -> "GlobalTensor":
        """Block until the collectives of an asynchronous redistribution that made this tensor have run;
        returns `self` (a tensor with nothing pending returns at once).

        >>> import sbp, sbp.testing
        >>> def fn(mesh):
        ...     y = sbp.distribute(torch.arange(4.), mesh, "S(0)").redistribute("B", async_op=True)
        ...     return y.wait().to_local().tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]
        """
        d = self.__dict__
        if isinstance(d["_local"], PendingTensor):
            d["_local"] = d["_local"].wait()
        return self

    # ---- autograd integration --------------------------------------------------------------------
    def requires_grad_(self, requires_grad: bool = True) -> "GlobalTensor":
        """As `torch.Tensor.requires_grad_`; a leaf also gets the leaf rule: gradients arriving with other
        placements (e.g. `P(sum)` from a data-parallel axis) are redistributed to `grad_placements(leaf)`.

        >>> import sbp, sbp.testing
        >>> def fn(mesh):
        ...     w = sbp.distribute(torch.ones(4), mesh, "S(0)").requires_grad_()
        ...     (w * 3).sum().backward()
        ...     return w.grad.placements, w.grad.to_local().tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [((S(0),), [3.0, 3.0]), ((S(0),), [3.0, 3.0])]
        """
        if requires_grad:
            _check_grad_dtype(self)
        super().requires_grad_(requires_grad)
        ensure_leaf_rule(self)
        return self

    def is_contiguous(self, memory_format: torch.memory_format = torch.contiguous_format) -> bool:
        """As torch's, for the logical strides: a transpose or permute of a global tensor is not contiguous
        (the wrapper itself always reports contiguous strides of the global shape).

        >>> import sbp, sbp.testing
        >>> sbp.testing.spmd(lambda mesh: sbp.distribute(torch.ones(2, 3), mesh, "S(0)").t().is_contiguous(), (2,))
        [False, False]
        """
        return meta_like(self).is_contiguous(memory_format=memory_format)

    def contiguous(self, memory_format: torch.memory_format = torch.contiguous_format) -> "GlobalTensor":
        """As torch's: `self` when its logical strides are contiguous, else a copy, so a write into the result
        never reaches a tensor it was a view of (``x.t().contiguous().add_(1)`` leaves `x` alone).

        >>> import sbp, sbp.testing
        >>> def fn(mesh):
        ...     x = sbp.distribute(torch.zeros(2, 3), mesh, "S(0)")
        ...     x.t().contiguous().add_(1)
        ...     return x.full().sum().item()
        >>> sbp.testing.spmd(fn, (2,))
        [0.0, 0.0]
        """
        if self.is_contiguous(memory_format=memory_format):
            return self
        return self.clone(memory_format=memory_format)

    def __setattr__(self, name: str, value: Any) -> None:
        """As torch's; ``x.requires_grad = True`` on a leaf also installs the leaf rule (see `requires_grad_`).
        (Reads stay torch's own getters; sbp's hot paths write attributes through ``__dict__``.)"""
        if name == "requires_grad" and value:
            _check_grad_dtype(self)
        super().__setattr__(name, value)
        if name == "requires_grad":
            ensure_leaf_rule(self)
        elif name == "_is_param" and value:   # nn.Parameter(x) sets this on a tensor subclass
            _static_parameter_shapes(self)

    def __deepcopy__(self, memo: dict) -> "GlobalTensor":
        if id(self) in memo:
            return memo[id(self)]
        # the mesh is a value bound to process groups: share it, copy only the data
        # a pending result (async_op=True) is waited for: its value is what gets copied
        out = GlobalTensor(copy.deepcopy(pending.ready(self._local).detach(), memo), self._mesh, self._placements,
                           tuple(self.shape))
        if self.requires_grad:
            out.requires_grad_(True)
        if getattr(self, "_is_param", False):
            out._is_param = True
        elif self.grad is not None:   # as torch copies a plain tensor's .grad (an nn.Parameter's copy has none)
            out.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickles (``torch.save``) as this rank's local tensor, the layout and the mesh's description --
        never a process group; ``torch.load`` binds it to the live mesh of that description
        (`sbp.values.mesh.LIVE_MESHES`) and also works with ``weights_only=True``.

        >>> import io, sbp, sbp.testing
        >>> def fn(mesh):
        ...     buf = io.BytesIO()
        ...     torch.save(sbp.distribute(torch.arange(4.), mesh, "S(0)"), buf)
        ...     y = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        ...     return y.placements, y.mesh is mesh, y.to_local().tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [((S(0),), True, [0.0, 1.0]), ((S(0),), True, [2.0, 3.0])]
        """
        args = (pending.ready(self._local).detach(), self._mesh, self._placements, tuple(self.shape),
                self.requires_grad, bool(getattr(self, "_is_param", False)), self._mesh.coord)
        attrs = {k: v for k, v in self.__dict__.items() if k not in _OWN_ATTRS and not k.startswith("_sbp")}
        return rebuild_global_tensor, args + (attrs,) if attrs else args   # (attributes set on it, as torch keeps)

    def __tensor_flatten__(self):
        # torch flattens a compiled graph's global inputs and output gradients right before the graph runs;
        # the graph's collectives then go straight to the process groups: async work that may use the same
        # groups runs first (`pending.fence`), as sbp's eager collectives drain the queue first
        binding = self._mesh.binding
        if binding is not None:
            pending.fence(binding)
        # the global shape with symbolic sizes as None: the metadata is pickled into torch.compile's caches,
        # and a symbolic size would drag its shape environment along (unpicklable: no cache entry was saved)
        symbolic.untie_local_sizes(self._local)   # dynamic=True: no symbol shared by a coincidence of values
        return ["_local"], (self._mesh, self._placements, tuple(n if type(n) is int else None for n in self.shape))

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        # the global shape is the outer size torch.compile hands over: symbolic sizes stay symbolic, but for
        # those whose local size is static (torch specialized a piece of 1): pinned now, before torch counts
        # the graph's symbolic sizes, not by an op that relates them later (symbolic.pin_static_pieces); the
        # local's sizes along whole dims are the global ones (symbolic.tie_local_sizes)
        symbolic.forget_untied()
        mesh, pls, _ = meta
        local = inner["_local"]
        if symbolic.any_symbolic(outer_size):
            outer_size = symbolic.canonical(symbolic.pin_static_pieces(outer_size, local.shape, mesh.shape, pls))
            symbolic.tie_local_sizes(local.shape, outer_size, pls)
        return GlobalTensor(local, mesh, pls, tuple(outer_size))

    @classmethod
    def __metadata_guard__(cls, orig: tuple, other: tuple) -> bool:
        """torch.compile's guard on a global input: the same mesh and placements. The global shape is
        guarded by dynamo's own size guards (so a size compiled as symbolic is not pinned here).

        >>> import sbp
        >>> mesh = sbp.DeviceMesh((2,))
        >>> GlobalTensor.__metadata_guard__((mesh, (sbp.B,), (4,)), (mesh, (sbp.B,), (6,)))
        True
        """
        return orig[0] == other[0] and orig[1] == other[1]

    def __coerce_tangent_metadata__(self) -> "GlobalTensor":
        """The placements AOTAutograd traces a compiled output's gradient with: the output's, with `B` for
        each Partial axis (the gradient of a ``P(op)`` value is ``B``; DESIGN.md "Autograd").

        >>> import sbp
        >>> x = GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.Partial("sum"),), (2,))
        >>> x.__coerce_tangent_metadata__().placements
        (B,)
        """
        if not any(isinstance(p, Partial) for p in self._placements):
            return self
        dst = tuple(Broadcast() if isinstance(p, Partial) else p for p in self._placements)
        # a P(op) axis holds full-size locals, so B on it keeps the local shape: only the guess's metadata
        # matters here (AOTAutograd traces the backward with it)
        return GlobalTensor(self._local, self._mesh, dst, tuple(self.shape))

    def __coerce_same_metadata_as_tangent__(self, expected, expected_type: Optional[type] = None):
        """A compiled function's output gradient, redistributed to the placements its backward was traced
        with (eager code after the compiled call may hand back a gradient with other placements: a `B`
        output used with an ``S(0)`` tensor gets an ``S(0)`` gradient). None (AOTAutograd's error) for
        another type, mesh or shape.

        >>> import sbp, sbp.testing
        >>> def fn(mesh):
        ...     g = sbp.distribute(torch.arange(4.), mesh, "B")
        ...     return g.__coerce_same_metadata_as_tangent__((mesh, (sbp.S(0),), (4,))).to_local().tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [[0.0, 1.0], [2.0, 3.0]]
        """
        if expected_type is not None and expected_type is not type(self):
            return None
        mesh, placements, shape = expected
        if mesh != self._mesh or len(shape) != self.dim() or any(
                a is not None and a != b for a, b in zip(shape, self.shape)):   # None: a symbolic size, any
            return None
        return self.redistribute(placements)

    def _stable_hash_for_caching(self) -> str:
        """This tensor's part of torch.compile's cache keys (AOTAutograd's on-disk cache): the layout, the
        local tensor's metadata, sbp's code and this process's rank -- ranks share the cache, and a traced
        plan differs between ranks whose local shapes agree (a `P(sum)` input becoming uneven `S(1)` pieces).

        >>> import sbp
        >>> mesh = sbp.DeviceMesh((2,))
        >>> a, b = (GlobalTensor(torch.ones(2), mesh, (p,), (2,)) for p in (sbp.Partial("sum"), sbp.B))
        >>> a._stable_hash_for_caching() == b._stable_hash_for_caching()
        False
        """
        mesh, local = self._mesh, self._local
        return cache_key(mesh_description(mesh), None if mesh.binding is None else mesh.binding.rank,
                         placements_text(self._placements), tuple(self.shape), self.requires_grad,
                         tuple(local.shape), tuple(local.stride()), str(local.dtype), str(local.device))

    # ---- ATen dispatch -----------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _op_handler[0]
        if handler is None:
            raise SbpError(f"{func} on a GlobalTensor: sbp's operator rules are not installed; import sbp and use "
                           f"sbp.<name> (sbp.distribute, sbp.zeros, ...), which installs them, or call "
                           f"sbp.ops.install()")
        return handler(func, args, kwargs or {})


def _never_compiled(code) -> None:
    """dynamo never compiles a frame of `code`, nor the frames it calls. For `__torch_dispatch__`: between two
    graphs (after a graph break, e.g. at ``.item()``) an op on a global tensor runs sbp's dispatch as eager
    Python, which dynamo would otherwise take for user code, compile as a frame of its own and fail in. In a
    graph, ops reach the dispatch through fake tensors, never through dynamo's frames. Likewise for what
    torch's tracing calls on a global tensor (`__new__`, `__tensor_flatten__`, ... at the end of this module):
    compiled autograd's capture fakes its inputs with dynamo's frame hook on. (A code-level skip: eager pays
    nothing for it, where a `torch._dynamo.disable` wrapper costs ~0.6 us a call. Inlining is not affected:
    dynamo still traces these where it inlines them, e.g. the leaf hook under compiled autograd.)"""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except (ImportError, AttributeError, TypeError):   # another torch: its dynamo keeps its own rules
        return


# a global tensor's own entries in its __dict__ (and torch.compile's marks on parameters, which sbp sets again
# when a parameter is made; sbp.nn's marks start with "_sbp"): a pickle carries every other attribute
_OWN_ATTRS = frozenset(("_local", "_mesh", "_placements", "_key", "_notes", "_reduced", "_is_param",
                        "_dynamo_static_indices", "_has_dynamo_dim_marking"))


def rebuild_global_tensor(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
                          global_shape: tuple[int, ...], requires_grad: bool, is_param: bool,
                          coord: Optional[tuple[int, ...]] = None, attrs: Optional[dict] = None) -> torch.Tensor:
    """A pickled global tensor again (what `GlobalTensor.__reduce_ex__` stores): an `nn.Parameter` when it
    was one, with the attributes set on it (`attrs`, e.g. ``p._no_weight_decay = True``). The mesh arrives
    bound (`sbp.values.mesh.live_mesh`); the local must match its layout, and `coord` (the saving rank's;
    None in pickles made before it was stored) must hold the same block: equal to this rank's on every axis
    where the tensor is not Broadcast.

    >>> import sbp
    >>> rebuild_global_tensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,), False, False)
    GlobalTensor(shape=(2,), placements=(B,), mesh=(1,))
    """
    if mesh.binding is not None and mesh.coord is not None:
        want = tuple(b - a for a, b in block(tuple(global_shape), mesh.shape, tuple(placements), mesh.coord))
        if tuple(local.shape) != want:
            raise ShapeError(f"a pickled global tensor of global shape {tuple(global_shape)} with placements "
                             f"{_fmt(tuple(placements))} holds a local of shape {tuple(local.shape)} on rank "
                             f"{mesh.rank} (coord {mesh.coord}), whose block is {want}: was the file saved by "
                             f"another rank? (torch.save files hold one rank's shards; sbp.save/sbp.load reshard)")
        if coord is not None and any(c != m and not isinstance(p, Broadcast)
                                     for c, m, p in zip(coord, mesh.coord, placements)):
            raise ShapeError(f"a pickled global tensor with placements {_fmt(tuple(placements))} was saved at coord "
                             f"{tuple(coord)} of mesh {mesh.shape} and is loaded on rank {mesh.rank} at coord "
                             f"{mesh.coord}: it holds another rank's block (torch.save files hold one rank's "
                             f"shards: load each rank's own file; sbp.save/sbp.load reshard)")
    out = GlobalTensor(local, mesh, tuple(placements), tuple(global_shape))
    if is_param:
        out = torch.nn.Parameter(out, requires_grad=requires_grad)
    elif requires_grad:
        out.requires_grad_(True)
    if attrs:
        out.__dict__.update(attrs)
    return out


def register_safe_globals() -> None:
    """Allow sbp's types in ``torch.load(..., weights_only=True)``: the global-tensor rebuild, meshes and
    placements (plain values; no code runs on load). Importing this module calls it.

    >>> register_safe_globals(); rebuild_global_tensor in torch.serialization.get_safe_globals()
    True
    """
    torch.serialization.add_safe_globals([rebuild_global_tensor, live_mesh, DeviceMesh, Split, Broadcast, Partial])


# ---- the plug-in point for an operator rule table ----------------------------------------------------
def set_op_handler(handler: Optional[OpHandler]) -> Optional[OpHandler]:
    """Plug in the operator handler (the rule table of `sbp.ops`); returns the previous one.

    The handler is called as ``handler(func, args, kwargs)`` for every ATen op on a `GlobalTensor` and
    returns the result; it is the only op path (with None, ops on global tensors raise `SbpError`).

    >>> previous = set_op_handler(None)   # no handler: ops on global tensors raise SbpError
    >>> _ = set_op_handler(previous)
    """
    previous, _op_handler[0] = _op_handler[0], handler
    return previous


def get_op_handler() -> Optional[OpHandler]:
    """The operator handler plugged in with `set_op_handler` (None before `sbp.ops.install`).

    >>> import sbp; sbp.load_torch_layers(); get_op_handler() is sbp.ops.handle
    True
    """
    return _op_handler[0]


def _redistribute_arguments(placements, dtensor_placements, mesh, device_mesh):
    """`redistribute`'s (placements, mesh) from its own spelling or DTensor's (``(mesh, placements)``,
    ``device_mesh=``, ``placements=`` alone)."""
    if isinstance(placements, DeviceMesh):  # DTensor's positional order: (device_mesh, placements)
        if mesh is not None or device_mesh is not None:
            raise SbpError("redistribute got a mesh twice: positionally first (DTensor's order) and as a keyword")
        mesh, placements, dtensor_placements = placements, dtensor_placements, None
    if dtensor_placements is not None:
        raise SbpError(f"redistribute takes the placements and, keyword-only, mesh= and async_op=; got a second "
                       f"positional argument: {dtensor_placements!r}")
    if device_mesh is not None:
        if mesh is not None and mesh is not device_mesh:
            raise SbpError("redistribute got both mesh= and device_mesh= (DTensor's name for it); pass one")
        mesh = device_mesh
    if placements is None:
        raise SbpError("redistribute needs the target placements, e.g. x.redistribute(\"S(0), B\") "
                       "(objects or a string; one per mesh axis)")
    return placements, mesh


def _redistribute(self: GlobalTensor, placements, mesh: Optional[DeviceMesh], async_op: bool = False) -> GlobalTensor:
    """The body of `GlobalTensor.redistribute` (also what a compiled graph traces through)."""
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise MeshError(f"redistribute(mesh=...) needs an sbp.DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(async_op, bool):
        raise SbpError(f"redistribute(async_op=...) takes a bool, got {async_op!r}")
    if mesh is None or mesh is self._mesh or mesh == self._mesh:
        pls = normalize(placements, len(self.shape), len(self._mesh.shape))
        if pls == self._placements:  # already laid out so (and checked when it was made)
            _debug_check(self, pls)  # redistribute_raw checks every other call
            return self
        check_partial_dtype(pls, self.dtype, "redistribute")
        return autograd.redistribute(self, pls, async_op)
    if mesh.binding is None:
        raise MeshError(f"redistribute(mesh=...) needs a mesh bound to processes (sbp.init_mesh, "
                        f"sbp.testing.submesh); {mesh!r} is a pure value")
    if mesh.device_type != self._mesh.device_type:
        raise MeshError(f"redistribute(mesh=...) moves between meshes of one device type; the tensor is on a "
                        f"{self._mesh.device_type!r} mesh, the target mesh is {mesh.device_type!r}")
    pls = normalize(placements, self.ndim, mesh.ndim)
    check_partial_dtype(pls, self.dtype, "redistribute")
    return autograd.redistribute_cross(self, mesh, pls)


_ACROSS_MESHES = ("sbp: a cross-mesh x.redistribute(..., mesh=other) is not lowered into a compiled graph (its "
                  "exact point-to-point transfers between rank sets have no functional collective); it runs "
                  "eagerly between two graphs. With fullgraph=True call it outside the compiled function.")


@torch._dynamo.disable(reason=_ACROSS_MESHES)
def _redistribute_across(x: GlobalTensor, placements, mesh: DeviceMesh) -> GlobalTensor:
    """A cross-mesh move inside compiled code: a graph break, then an eager run (dynamo never traces it)."""
    graph_break("x.redistribute(placements, mesh=another_mesh)",
                "a move to another mesh runs exact point-to-point transfers that no graph holds",
                "make the move outside the compiled function (without fullgraph it runs eagerly)")
    return _redistribute(x, placements, mesh)


def _full(x: GlobalTensor) -> torch.Tensor:
    return autograd.full(x)


def _redistribute_described(x: GlobalTensor, placements: str, mesh: tuple) -> GlobalTensor:
    return _redistribute(x, placements, mesh_of(mesh) if mesh else None)


def placements_text(placements) -> Any:
    """Placements as a string constant (``"S(0), B"``): what crosses into a compiled graph's opaque calls
    (dynamo cannot rebuild frozen dataclass instances there); anything else is returned as it is.

    >>> import sbp
    >>> placements_text((sbp.S(0), sbp.B)), placements_text("P")
    ('S(0), B', 'P')
    """
    if isinstance(placements, Placement):
        return _placement_text(placements)
    if isinstance(placements, (tuple, list)) and all(isinstance(p, Placement) for p in placements):
        return ", ".join([_placement_text(p) for p in placements])
    return placements


def _placement_text(p: Placement) -> str:
    # int(): a fallback for a torch whose dynamo lacks the hooks `traced_values` uses (there an input's Split dim
    # may come in as a symbol under dynamic shapes; with them an input's placements are constants already)
    return f"S({int(p.dim)})" if isinstance(p, Split) else repr(p)


def mesh_description(mesh: DeviceMesh) -> tuple:
    """(shape, names or (), ranks, device type): a bound mesh as a constant of a compiled graph (no None:
    opaque calls take only tensors, numbers, strings and tuples of them); `mesh_of` is the mesh again.

    >>> import sbp
    >>> mesh_description(sbp.DeviceMesh((2, 2), names=("dp", "tp")))
    ((2, 2), ('dp', 'tp'), (0, 1, 2, 3), 'cpu')
    """
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"expected an sbp.DeviceMesh, got {type(mesh).__name__}")
    return (mesh.shape, mesh.names or (), mesh.ranks, mesh.device_type)


_inference_mode = torch.is_inference_mode_enabled


def normal_in_inference_mode(local: torch.Tensor) -> bool:
    """Whether a wrapper around `local` must be made outside inference mode: in inference mode torch makes a
    view of a normal tensor a normal tensor, sharing its base's version counter; a wrapper made there would
    be an inference tensor, which cannot take one ("Cannot set version_counter for inference tensor": a view
    of a global tensor taken inside `torch.inference_mode()`, an autograd function's output aliasing its
    input). A wrapper is an inference tensor exactly when its local is.

    >>> with torch.inference_mode():
    ...     normal_in_inference_mode(torch.ones(1)), normal_in_inference_mode(torch.ones(1) + 1)
    (False, False)
    >>> t = torch.ones(1)
    >>> with torch.inference_mode():
    ...     normal_in_inference_mode(t)
    True
    """
    return _inference_mode() and not local.is_inference()


def _rebound(mesh: DeviceMesh) -> DeviceMesh:
    """The live bound mesh equal to `mesh`, or `mesh` itself where this process has none. Dynamo rebuilds a
    mesh that enters a graph as a constant (an argument of a recorded call, of a global tensor made in
    traced code) from its value fields, without the binding (`sbp.values.mesh._Bindable`)."""
    try:
        return mesh_of(mesh_description(mesh))
    except MeshError:
        return mesh


def mesh_of(description: tuple) -> DeviceMesh:
    """The live bound mesh of this process with a `mesh_description` (`sbp.values.mesh.live_mesh`).

    >>> import sbp.testing
    >>> sbp.testing.spmd(lambda mesh: mesh_of(mesh_description(mesh)) is mesh, (2,))
    [True, True]
    """
    shape, names, ranks, device_type = description
    # under torch.compile dynamo may hand the description's ints in as symbols (dynamic=True, or a mesh argument
    # that changed between calls): the mesh is a constant of the graph, so each is specialized to its value
    return live_mesh(tuple(int(n) for n in shape), names or None, tuple(int(r) for r in ranks), device_type)


# dynamo does not trace sbp's planning Python; it records one call that AOTAutograd traces with fake tensors,
# where the executor lowers the plan to functional collectives (mesh and placements are graph constants)
_compiled_redistribute = torch._dynamo.nonstrict_trace(_redistribute_described)
_compiled_full = torch._dynamo.nonstrict_trace(_full)


# ---- local helpers shared by dispatch, distribute, autograd and the factories ----------------------
def full_local(x: GlobalTensor) -> torch.Tensor:
    """The whole logical tensor as a plain tensor, without autograd (a planned redistribution to all-`B`).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: full_local(sbp.distribute(torch.arange(3), mesh, "S(0)")).tolist(), (2,))
    [[0, 1, 2], [0, 1, 2]]
    """
    return redistribute_raw(x, (Broadcast(),) * x._mesh.ndim)._local


def redistribute_raw(x: GlobalTensor, dst: tuple[Placement, ...], async_op: bool = False, *,
                     snapshot: bool = True) -> GlobalTensor:
    """Redistribute without recording autograd: the executor runs the planned steps on the local tensor
    (with `async_op`, on the rank's ordered queue: the result's local is a `PendingTensor`; the source's
    local is copied when queued, so a write into the source before the queue reads it cannot reach the
    result -- `snapshot=False` for a source nobody writes meanwhile, e.g. a buffer made for the move).

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.arange(4), mesh, "B")
    ...     return redistribute_raw(x, (sbp.S(0),)).to_local().tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [[0, 1], [2, 3]]
    """
    _debug_check(x, dst)
    if dst == x._placements:
        return GlobalTensor(x._local, x._mesh, dst, tuple(x.shape))
    summed = _SUM in x._placements and not any(isinstance(p, Partial) for p in dst) and _versioned(x)
    if summed:
        reduced = _reduced_before(x)
        if reduced is not None:
            return _moved_from_reduced(reduced, dst, async_op)
    if async_op and x._mesh.coord is not None and not is_tracing(x._local):
        return GlobalTensor(_submit_redistribute(x, dst, snapshot), x._mesh, dst, tuple(x.shape))
    out = GlobalTensor(redistribute_local(x._local, x._mesh, tuple(x.shape), x._placements, dst), x._mesh, dst,
                      tuple(x.shape))
    if summed:
        x.__dict__["_reduced"] = (x._local, x._version, x._local._version, out, out._version, out._local._version,
                                  _uncounted_writes(x._local))
    return out


# A P(sum) tensor reduced by two plans gives two sets of bits (floating-point sums in another order): its first
# full reduction is kept, and every later one is an exact move of it. `x == x.amax(1, keepdim=True)` marks
# every row, and backward of amax (which reduces the saved input again) finds its maxima.
_SUM = Partial("sum")


# Writes that no version counter records, by the data pointer of the storage written: ops without an
# ADInplaceOrView kernel (fused optimizers, amp's unscale, batch norm's running stats) bump no counter, and
# bumping the wrapper's by hand would fail autograd's check of the tensors such an op saves (batch norm saves
# the running stats it writes). A kept reduction made before such a write into its storage -- through the
# tensor or any other handle on it, a view, a detach: their locals share storage, not version counters -- is
# stale. (A freed storage's pointer reused only makes a later reduction be made again.)
_UNCOUNTED: dict[int, int] = {}


def _uncounted_writes(local: torch.Tensor) -> int:
    return _UNCOUNTED.get(local.untyped_storage().data_ptr(), 0) if _UNCOUNTED else 0


def note_uncounted_write(local: torch.Tensor) -> None:
    """Record a write into `local`'s storage that no version counter records (`Decision.uncounted`).

    >>> t = torch.ones(2)
    >>> before = _uncounted_writes(t[1:])
    >>> note_uncounted_write(t)
    >>> _uncounted_writes(t[1:]) == before + 1   # the storage's count, whatever view asks
    True
    """
    if is_tracing(local):
        return
    ptr = local.untyped_storage().data_ptr()
    _UNCOUNTED[ptr] = _UNCOUNTED.get(ptr, 0) + 1


def note_local_write(x: GlobalTensor) -> None:
    """Count a write into `x`'s local made inside dispatch, below the in-place kernel that counts versions: the
    local's counter bumped by hand, as the wrapper's is. A kept reduction checks the local's counter too
    (`_reduced_before`), so a write through another wrapper of the same local -- ``x.data``, whose wrapper has
    a counter of its own -- or through a view of it (its bases' locals are bumped too) is seen: the kept
    value was served stale, and ranks whose block the write missed kept it while the others reduced again.

    >>> t = GlobalTensor(torch.zeros(2), DeviceMesh((1,)), (Broadcast(),), (2,))
    >>> before = t._local._version
    >>> note_local_write(t)
    >>> t._local._version == before + 1
    True
    """
    while x is not None:   # and the bases of a view: views made inside dispatch share no counter with them
        local = x._local
        if type(local) is torch.Tensor:   # (not traced; an inference tensor's is left alone by torch)
            torch._C._increment_version((local,))
        notes = x.__dict__.get("_notes")
        made = notes.view if notes is not None else None
        x = made[1][0] if made is not None and made[1] and isinstance(made[1][0], GlobalTensor) else None


def _versioned(x: GlobalTensor) -> bool:
    """Whether `x` and a result made from it now have version counters (not traced, no inference tensors)."""
    return not (is_tracing(x._local) or torch.is_inference_mode_enabled() or x.is_inference()
                or x._local.is_inference())


def _reduced_before(x: GlobalTensor) -> Optional[GlobalTensor]:
    """`x`'s kept full reduction, while neither `x` nor the reduction was written since (version counters).

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.from_local(torch.ones(2), mesh, "P(sum)", global_shape=(2,))
    ...     kept = redistribute_raw(x, (sbp.S(0),))
    ...     return _reduced_before(x) is kept, x.add_(1) is x and _reduced_before(x) is None
    >>> sbp.testing.spmd(fn, (2,))[0]
    (True, True)
    """
    memo = x.__dict__.get("_reduced")
    if memo is None:
        return None
    local, version, local_version, reduced, reduced_version, reduced_local_version, uncounted = memo
    # (an in-place op on a global tensor bumps its wrapper's counter; a write into its local, the local's; a
    # write torch counts nowhere, the storage's entry in `_UNCOUNTED`)
    if (local is not x._local or version != x._version or local_version != local._version
            or reduced_version != reduced._version or reduced_local_version != reduced._local._version
            or uncounted != _uncounted_writes(local)):
        del x.__dict__["_reduced"]
        return None
    return reduced


def _moved_from_reduced(reduced: GlobalTensor, dst: tuple[Placement, ...], async_op: bool) -> GlobalTensor:
    """`reduced` moved to `dst` (an exact move: no Partial on either side), in storage of its own: the
    kept reduction and the tensors made from it never alias each other."""
    out = redistribute_raw(reduced, dst, async_op)
    local = out._local
    if not isinstance(local, PendingTensor) and local.numel() and (
            local.untyped_storage().data_ptr() == reduced._local.untyped_storage().data_ptr()):
        out = GlobalTensor(local.clone(), out._mesh, dst, tuple(out.shape))
    return out


def _submit_redistribute(x: GlobalTensor, dst: tuple[Placement, ...], snapshot: bool = True) -> PendingTensor:
    """The planned redistribution of `x`'s local to `dst` as queued work. With `snapshot` the source is the
    local as it is now (a copy: the queue reads it later, after the caller may have written into `x`); a
    result that would alias the source (a slice of it) is copied, so a later write to either never reaches
    the other."""
    src_local, mesh, shape, src = x._local, x._mesh, tuple(x.shape), x._placements
    if snapshot and not isinstance(src_local, PendingTensor):
        src_local = src_local.clone()

    def run() -> torch.Tensor:
        source = pending.ready(src_local)
        out = redistribute_local(source, mesh, shape, src, dst)
        same = out.numel() and out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        return out.clone() if same else out

    want = tuple(hi - lo for lo, hi in block(shape, mesh.shape, dst, mesh.coord))
    axes = {a for step in cached_plan(shape, tuple(mesh.shape), src, dst, x.element_size()).steps for a in step.axes}
    return pending.submit(mesh.binding, run, want, x.dtype, x._local.device, axes=sorted(axes))


def check_partial_dtype(placements: tuple[Placement, ...], dtype: torch.dtype, what: str) -> None:
    """Refuse Partial placements a dtype cannot represent: `P(sum)` of bools (a sum of bools is no bool;
    it would saturate silently) and `P(min|max)` of complex numbers (they have no order).

    >>> check_partial_dtype((Partial("sum"),), torch.bool, "distribute")
    Traceback (most recent call last):
    ...
    sbp.values.errors.PlacementError: distribute: P(sum) cannot hold a torch.bool tensor: a sum of bools is not a bool (valid for bool: S(d), B, P(min), P(max); or convert to an integer dtype first)
    """
    for p in placements:
        if isinstance(p, Partial):
            if p.op == "sum" and dtype == torch.bool:
                raise PlacementError(f"{what}: P(sum) cannot hold a torch.bool tensor: a sum of bools is not a bool "
                                     f"(valid for bool: S(d), B, P(min), P(max); or convert to an integer dtype first)")
            if p.op != "sum" and dtype.is_complex:
                raise PlacementError(f"{what}: {p!r} needs ordered values; {dtype} has no min/max "
                                     f"(valid for complex: S(d), B, P(sum))")


def mesh_device(mesh: DeviceMesh, what: str) -> torch.device:
    """The torch device of a mesh's local tensors; a CUDA mesh needs CUDA in this process.

    >>> import sbp
    >>> mesh_device(sbp.DeviceMesh((2,)), "zeros")
    device(type='cpu')
    """
    if mesh.device_type == "cuda" and not torch.cuda.is_available():
        raise MeshError(f"{what}: the mesh's device_type is 'cuda' but CUDA is not available in this process "
                        f"(torch.cuda.is_available() is False); use a mesh with device_type='cpu'")
    return torch.device(mesh.device_type)


def check_local_device(local: torch.Tensor, mesh: DeviceMesh, what: str) -> None:
    """A local tensor must live on its mesh's device type (collectives cannot move it silently).

    >>> import sbp
    >>> check_local_device(torch.ones(1), sbp.DeviceMesh((2,), device_type="cuda"), "from_local")
    Traceback (most recent call last):
    ...
    sbp.values.errors.MeshError: from_local: the local tensor is on cpu but the mesh's device_type is 'cuda'; move it first (local.to('cuda'))
    """
    if local.device.type != mesh.device_type:
        raise MeshError(f"{what}: the local tensor is on {local.device} but the mesh's device_type is "
                        f"{mesh.device_type!r}; move it first (local.to({mesh.device_type!r}))")


def _debug_check(x: "GlobalTensor", dst: tuple[Placement, ...]) -> None:
    """Under `sbp.debug()`: every rank of the mesh redistributes the same tensor the same way."""
    if not debug_enabled() or x._mesh.binding is None or x._mesh.coord is None or is_tracing(x._local):
        return
    signature = "none: layouts agree" if dst == x._placements else agreement.plan_signature(
        cached_plan(tuple(x.shape), tuple(x._mesh.shape), x._placements, dst, x._local.element_size()))
    gather, members = agreement.mesh_gather(x._mesh)
    agreement.agree(gather, members, "redistribute", {
        "mesh": x._mesh, "dtype": x.dtype, "global shape": tuple(x.shape), "src placements": x._placements,
        "dst placements": dst, "plan": signature}, device=x._local.device)


def sum_holds_value(mesh: DeviceMesh, placements: tuple[Placement, ...], coord: tuple[int, ...]) -> bool:
    """Whether `coord` holds the value (rather than zeros) when a Broadcast value becomes `placements`:
    `P(sum)` axes keep it at coord 0 only, `P(min|max)`, `S` and `B` axes everywhere.

    >>> import sbp
    >>> mesh, pls = sbp.DeviceMesh((2, 2)), (Partial("sum"), Partial("max"))
    >>> [sum_holds_value(mesh, pls, c) for c in mesh.coords()]
    [True, True, False, False]
    """
    return all(c == 0 for p, c in zip(placements, coord) if isinstance(p, Partial) and p.op == "sum")


def local_from_full(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's local tensor of `full` laid out with `placements` (no communication, a fresh copy).

    `S` slices (layout maths), `B` keeps, `P(sum)` keeps the value at coord 0 and zeros elsewhere,
    `P(min|max)` keep the value. A rank outside the mesh gets an empty tensor.

    >>> import sbp, sbp.testing
    >>> pls = (sbp.S(0), Partial("sum"))
    >>> sbp.testing.spmd(lambda mesh: local_from_full(torch.arange(4), mesh, pls).tolist(), (2, 2))
    [[0, 1], [0, 0], [2, 3], [0, 0]]
    """
    coord = mesh.coord
    if coord is None:
        return empty_outside(full.ndim, full.dtype, full.device)
    shape = tuple(full.shape)
    if symbolic.any_symbolic(shape):   # torch.compile, dynamic shapes: ranges are expressions of the sizes
        pls = normalize(placements, len(shape), mesh.ndim)
        piece = full[tuple(slice(lo, hi) for lo, hi in symbolic.block_of(shape, mesh.shape, pls, coord))]
    else:
        piece = full[local_slices(shape, mesh.shape, placements, coord)]
    if not sum_holds_value(mesh, placements, coord):
        return torch.zeros_like(piece, memory_format=torch.contiguous_format)
    return piece.clone(memory_format=torch.contiguous_format)


def logical_strides(t: GlobalTensor) -> tuple[int, ...]:
    """The strides torch would give `t` on one device: a view op's output (recorded by the op handler as
    the op and its arguments) replays the op on meta tensors with its inputs' logical strides; any other
    global tensor is contiguous. The same on every rank (no local tensor is read).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: logical_strides(sbp.distribute(torch.ones(2, 3), mesh, "B").t()), (2,))
    [(1, 3), (1, 3)]
    """
    notes = t._notes
    if notes is None:
        return tuple(t.stride())
    found = notes.strides
    if found is not None:
        return found
    recipe = notes.view
    if recipe is None:
        return tuple(t.stride())
    func, args, kwargs, k = recipe
    meta = lambda a: meta_like(a) if isinstance(a, torch.Tensor) else \
        [meta(x) for x in a] if isinstance(a, (list, tuple)) else \
        symbolic.hint(a) if isinstance(a, torch.SymInt) else a
    try:
        out = func(*[meta(a) for a in args], **{n: meta(v) for n, v in kwargs.items()})
    except RuntimeError:
        if func.__name__.split(".")[0] not in ("view", "_unsafe_view"):
            raise
        # torch's reshape chose a view from the wrapper's (contiguous) strides, but on one device the input's
        # logical strides admit no view (a slice, then a reshape): there reshape copies, and the copy is
        # contiguous. (sbp ran the view on the local blocks; only the strides are asked here.)
        found = notes.strides = contiguous_strides(tuple(t.shape))
        return found
    found = notes.strides = tuple((out[k] if k is not None else out).stride())
    return found


def notes_of(t: GlobalTensor) -> TensorNotes:
    """`t`'s `TensorNotes`, made on first use (readers that only look check ``t._notes`` for None instead).

    >>> import sbp
    >>> t = GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,))
    >>> t._notes is None, notes_of(t) is notes_of(t), t._notes.detached
    (True, True, False)
    """
    notes = t.__dict__["_notes"]
    if notes is None:
        notes = t.__dict__["_notes"] = TensorNotes()
    return notes


def is_detached(t: GlobalTensor) -> bool:
    """Whether `t` is a view whose local tensor does not alias its base's (see `TensorNotes`).

    >>> import sbp
    >>> is_detached(GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,)))
    False
    """
    notes = t.__dict__["_notes"]
    return notes is not None and notes.detached


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of `t`'s logical shape and strides (symbolic sizes at their hints: torch.compile's
    dynamic shapes; only layout questions are asked of it).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: meta_like(sbp.distribute(torch.ones(2, 3), mesh, "S(0)").t()).stride(), (2,))
    [(1, 3), (1, 3)]
    """
    strides = logical_strides(t) if isinstance(t, GlobalTensor) else t.stride()
    shape = tuple(t.shape)
    if any(isinstance(n, torch.SymInt) for n in shape + tuple(strides)):
        shape, strides = symbolic.hint_shape(shape), symbolic.hint_shape(strides)
    return torch.empty_strided(shape, strides, dtype=t.dtype, device="meta")


def empty_outside(ndim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The local tensor of a rank outside the mesh: empty, with the tensor's ndim, dtype and device.

    >>> empty_outside(2, torch.float32, "cpu").shape
    torch.Size([0, 0])
    """
    return torch.empty((0,) * ndim if ndim else (0,), dtype=dtype, device=device)


def grad_placements(pls: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """Placements of the gradient of a value with placements `pls`: `S`/`B` unchanged, `P(op)` -> `B`.

    >>> from sbp import S, B, Partial
    >>> grad_placements((S(0), Partial("max")))
    (S(0), B)
    """
    return tuple(Broadcast() if isinstance(p, Partial) else p for p in pls)


def _check_grad_dtype(x: GlobalTensor) -> None:
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise DTypeError(f"only floating point and complex global tensors can require gradients, got {x.dtype} "
                         f"(global shape {tuple(x.shape)}, placements {_fmt(x._placements)})")


def install_leaf_rule(leaf: GlobalTensor) -> None:
    """Register the hook that gives a leaf's `.grad` the placements `grad_placements(leaf.placements)`
    (`requires_grad_` calls it; gradients in other layouts are redistributed before they accumulate).

    >>> import sbp
    >>> leaf = GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,)).requires_grad_()
    >>> leaf._notes.leaf_rule
    True
    """
    leaf.register_hook(_LeafHook(leaf._mesh, grad_placements(leaf._placements)))
    notes_of(leaf).leaf_rule = True


class _LeafHook:
    """The leaf rule's hook on one leaf: its mesh and gradient placements. Also a constant of traced calls
    (a `torch.utils._pytree` constant, equal only to itself: no two leaves are taken for each other)."""
    __slots__ = ("mesh", "want")

    def __init__(self, mesh: DeviceMesh, want: tuple[Placement, ...]) -> None:
        self.mesh, self.want = mesh, want

    def __call__(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if grad is None:   # no gradient comes (a function stored it in .grad itself: `sbp.nn.fully_shard`)
            return None
        if torch.compiler.is_compiling() and traced_here():   # compiled autograd: dynamo traces the hook
            return _traced_leaf_layout(grad, self)
        return self.laid_out(grad)

    def laid_out(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """`grad` in the leaf's layout; None when it is in it already. A plain gradient is the whole value
        (autograd checked its shape against the leaf's)."""
        mesh, want = self.mesh, self.want
        if isinstance(grad, GlobalTensor):
            if grad._mesh != mesh:   # a gradient given on another mesh (``y.backward(g)``): torch refuses a
                raise MeshError(     # gradient on another device alike
                    f"the gradient reaching a leaf of global shape {tuple(grad.shape)} on {mesh!r} is on another "
                    f"mesh, {grad._mesh!r} (a gradient passed to backward() must be on its output's mesh; move it "
                    f"with g.redistribute(placements, mesh=...))")
            if grad._placements == want:
                return None
            return autograd.redistribute(grad, want)
        return GlobalTensor(local_from_full(grad, mesh, want), mesh, want, tuple(grad.shape))

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


torch.utils._pytree.register_constant(_LeafHook)


def _laid_out(grad: torch.Tensor, hook: _LeafHook) -> torch.Tensor:
    out = hook.laid_out(grad)
    return grad if out is None else out


# the leaf rule as one opaque call that AOTAutograd traces: under compiled autograd dynamo inlines the leaf
# hooks, and it cannot build the placements of a gradient made inside its graph
_traced_leaf_layout = torch._dynamo.nonstrict_trace(_laid_out)


def ensure_leaf_rule(t: GlobalTensor) -> None:
    """Install the leaf rule on `t` if it is a leaf that requires grad and has none yet (torch sets
    ``requires_grad`` in C++ for factories, so `requires_grad_` is not the only way in).

    >>> import sbp
    >>> t = GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,), requires_grad=True)
    >>> ensure_leaf_rule(t); t._notes.leaf_rule
    True
    """
    if t.requires_grad and t.is_leaf and (t._notes is None or not t._notes.leaf_rule):
        install_leaf_rule(t)


def _static_parameter_shapes(t: GlobalTensor) -> None:
    """Mark a global parameter's sizes and its local tensor's static for ``torch.compile(dynamic=True)``,
    as dynamo treats a plain ``nn.Parameter`` (``force_parameter_static_shapes``; it checks the exact type,
    so a tensor subclass parameter would otherwise get symbolic sizes when reached other than as a module
    attribute, e.g. through an optimizer's ``param_groups``). On torch 2.13 such symbolic parameter sizes
    break the optimizer step inside a dynamic compiled function (docs/compile.md).

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     p = torch.nn.Parameter(sbp.distribute(torch.ones(4, 2), mesh, "S(0)"))
    ...     return sorted(p._dynamo_static_indices), sorted(p._local._dynamo_static_indices)
    >>> sbp.testing.spmd(fn, (2,))
    [([0, 1], [0, 1]), ([0, 1], [0, 1])]
    """
    if not (torch.compiler.is_compiling() and traced_here()):   # (inside a graph mark_static would specialize instead)
        local = t.__dict__["_local"]
        if not isinstance(local, PendingTensor):   # a view of its own (same storage and version counter): the
            t.__dict__["_local"] = local.view_as(local)   # tensor it was made from shares the local otherwise
        torch._dynamo.mark_static(t)   # the wrapper and, as a tensor subclass, its local tensor


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of `shape` (a zero-size dim counts as 1, as torch does).

    >>> contiguous_strides((2, 3, 4))
    (12, 4, 1)
    """
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1) if type(n) is int else torch.sym_max(n, 1)   # symbolic: no guard
    return tuple(reversed(strides))


def _fmt(pls: tuple[Placement, ...]) -> str:
    return "(" + ", ".join(repr(p) for p in pls) + ("," if len(pls) == 1 else "") + ")"


# what torch's tracing machinery calls on a global tensor (compiled autograd's capture runs it with dynamo's
# frame hook on: each would be compiled as a frame of its own, on fake tensors)
for _code in (GlobalTensor.__torch_dispatch__.__func__.__code__, GlobalTensor.__new__.__code__,
              GlobalTensor.__tensor_flatten__.__code__, GlobalTensor.__tensor_unflatten__.__code__,
              GlobalTensor.__metadata_guard__.__func__.__code__, GlobalTensor.__coerce_tangent_metadata__.__code__,
              GlobalTensor.__coerce_same_metadata_as_tangent__.__code__, GlobalTensor.__setattr__.__code__,
              _LeafHook.__call__.__code__):
    _never_compiled(_code)

# a process that imports any torch layer of sbp (`import sbp.testing`, `import sbp.nn`) may `torch.load` global
# tensors (weights_only by default) before it uses any `sbp.<name>`
register_safe_globals()

# `y.placements` / `y.mesh` of a global tensor made inside a compiled graph read as constants
traced_values.register()
