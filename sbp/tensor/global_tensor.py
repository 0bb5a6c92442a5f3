"""`GlobalTensor`: a `torch.Tensor` wrapper subclass holding this rank's local tensor of one global tensor.

The wrapper reports the *global* shape, stride, dtype and device; the data lives in `_local` (a plain
tensor holding this rank's block, or its Partial part). Autograd runs on the wrapper (see
`sbp.tensor.autograd`); ATen ops reach `__torch_dispatch__`, which asks the op handler plugged in with
`set_op_handler` (the rule table of `sbp.ops`) and otherwise uses `default_dispatch` (`sbp.ops.fallback`):
a few layout-preserving ops run on the local tensor, everything else runs on the full tensor and returns
a Broadcast result with a one-time warning naming the op. Also here: the local helpers every layer above
shares (`local_from_full`, `redistribute_raw`, `grad_placements`, ...).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import torch

from ..values.errors import DTypeError, MeshError, PlacementError, ShapeError
from ..runtime.agreement import is_enabled as _debug_enabled
from ..values.layout import local_slices
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, Partial, Placement, normalize


OpHandler = Callable[[Any, tuple, dict], Any]
_op_handler: list[Optional[OpHandler]] = [None]  # the one plug-in point; set by sbp.ops, never a flag


class FallbackWarning(UserWarning):
    """An op has no sharding rule and ran on the full (Broadcast) tensor (`sbp.strict()` makes it an error).

    >>> import sbp
    >>> issubclass(FallbackWarning, UserWarning), issubclass(FallbackWarning, sbp.SbpError)
    (True, False)
    """


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

    __torch_function__ = torch._C._disabled_torch_function_impl  # results stay what dispatch returns

    @staticmethod
    def __new__(cls, local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...],
                global_shape: Sequence[int], *, requires_grad: bool = False) -> "GlobalTensor":
        shape = tuple(global_shape)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=contiguous_strides(shape), dtype=local.dtype, device=local.device,
            layout=local.layout, requires_grad=requires_grad)
        d = self.__dict__
        d["_local"], d["_mesh"], d["_placements"] = local, mesh, tuple(placements)
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
        if self._mesh.coord is None:
            raise MeshError(f".item() on rank {self._mesh.binding.rank}, which is outside the tensor's mesh (ranks "
                            f"{list(self._mesh.ranks)}): it holds no value; call it on the mesh's ranks, or "
                            f"redistribute the tensor onto a mesh that includes this rank")
        return super().item()

    # ---- indexing: torch checks integer indices against the (global) sizes before any op runs ----------
    def __getitem__(self, index: Any) -> Any:
        try:
            return super().__getitem__(index)
        except IndexError as e:
            raise _index_error(self, index, e) from e

    def __setitem__(self, index: Any, value: Any) -> None:
        from .setitem import basic_entries, narrows_a_split_dim, write_blocks
        entries = basic_entries(index, self.ndim)
        if entries is not None and narrows_a_split_dim(self, entries) and not self.__dict__.get("_sbp_detached") \
                and not (torch.is_grad_enabled() and (self.requires_grad or getattr(value, "requires_grad", False))):
            return write_blocks(self, index, entries, value)   # a slice of a split dim cannot stay a view
        try:
            super().__setitem__(index, value)
        except IndexError as e:
            raise _index_error(self, index, e) from e

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
        from .autograd import to_local
        return to_local(self, grad_placements)

    def full(self) -> torch.Tensor:
        """The whole logical tensor as a plain tensor on every rank (a planned redistribution to all-`B`).

        The gradient flowing into it is taken as Broadcast: every rank computed the same loss.

        >>> import sbp
        >>> GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,)).full()
        tensor([1., 1.])
        """
        from .autograd import full
        return full(self)

    full_tensor = full

    def redistribute(self, placements, *, mesh: Optional[DeviceMesh] = None) -> "GlobalTensor":
        """The same logical tensor with other placements (objects or a string like ``"S(0), B"``).

        Runs the planner's cheapest plan; differentiable (the backward is a planned redistribution too).
        With `mesh`, moves to another mesh (other ranks and/or shape; `sbp.runtime.crossmesh`).

        >>> import sbp, sbp.testing
        >>> def fn(mesh):
        ...     x = sbp.distribute(torch.arange(6.), mesh, "S(0)")
        ...     return x.redistribute("B").to_local().tolist()
        >>> sbp.testing.spmd(fn, (2,))
        [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
        """
        from .autograd import redistribute, redistribute_cross
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise MeshError(f"redistribute(mesh=...) needs an sbp.DeviceMesh, got {type(mesh).__name__}")
        if mesh is None or mesh is self._mesh or mesh == self._mesh:
            pls = normalize(placements, len(self.shape), len(self._mesh.shape))
            if pls == self._placements:  # already laid out so (and checked when it was made)
                _debug_check(self, pls)  # redistribute_raw checks every other call
                return self
            check_partial_dtype(pls, self.dtype, "redistribute")
            return redistribute(self, pls)
        if mesh.binding is None:
            raise MeshError(f"redistribute(mesh=...) needs a mesh bound to processes (sbp.init_mesh, "
                            f"sbp.testing.submesh); {mesh!r} is a pure value")
        if mesh.device_type != self._mesh.device_type:
            raise MeshError(f"redistribute(mesh=...) moves between meshes of one device type; the tensor is on a "
                            f"{self._mesh.device_type!r} mesh, the target mesh is {mesh.device_type!r}")
        pls = normalize(placements, self.ndim, mesh.ndim)
        check_partial_dtype(pls, self.dtype, "redistribute")
        return redistribute_cross(self, mesh, pls)

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
        return _meta_like(self).is_contiguous(memory_format=memory_format)

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

    def __deepcopy__(self, memo: dict) -> "GlobalTensor":
        if id(self) in memo:
            return memo[id(self)]
        # the mesh is a value bound to process groups: share it, copy only the data
        out = GlobalTensor(copy.deepcopy(self._local.detach(), memo), self._mesh, self._placements,
                           tuple(self.shape))
        if self.requires_grad:
            out.requires_grad_(True)
        if getattr(self, "_is_param", False):
            out._is_param = True
        memo[id(self)] = out
        return out

    def __tensor_flatten__(self):
        return ["_local"], (self._mesh, self._placements, tuple(self.shape))

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        mesh, pls, shape = meta
        return GlobalTensor(inner["_local"], mesh, pls, shape)

    # ---- ATen dispatch -----------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _op_handler[0]
        if handler is not None:
            out = handler(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return default_dispatch(func, args, kwargs)


# ---- the plug-in point for an operator rule table ----------------------------------------------------
def set_op_handler(handler: Optional[OpHandler]) -> Optional[OpHandler]:
    """Plug in the operator handler (the rule table of `sbp.ops`); returns the previous one.

    The handler is called as ``handler(func, args, kwargs)`` for every ATen op on a `GlobalTensor`; it
    returns the result, or `NotImplemented` to let `default_dispatch` handle the op.

    >>> previous = set_op_handler(None)   # no handler: default_dispatch only
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


# ---- local helpers shared by dispatch, distribute, autograd and the factories ----------------------
def full_local(x: GlobalTensor) -> torch.Tensor:
    """The whole logical tensor as a plain tensor, without autograd (a planned redistribution to all-`B`).

    >>> import sbp, sbp.testing
    >>> sbp.testing.spmd(lambda mesh: full_local(sbp.distribute(torch.arange(3), mesh, "S(0)")).tolist(), (2,))
    [[0, 1, 2], [0, 1, 2]]
    """
    return redistribute_raw(x, (Broadcast(),) * x._mesh.ndim)._local


def redistribute_raw(x: GlobalTensor, dst: tuple[Placement, ...]) -> GlobalTensor:
    """Redistribute without recording autograd: the executor runs the planned steps on the local tensor.

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
    from ..runtime.executor import redistribute_local
    local = redistribute_local(x._local, x._mesh, tuple(x.shape), x._placements, dst)
    return GlobalTensor(local, x._mesh, dst, tuple(x.shape))


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
    if not _debug_enabled() or x._mesh.binding is None or x._mesh.coord is None:
        return
    from ..runtime.agreement import agree, mesh_gather, plan_signature
    from ..runtime.executor import _plan
    signature = "none: layouts agree" if dst == x._placements else plan_signature(
        _plan(tuple(x.shape), tuple(x._mesh.shape), x._placements, dst, x._local.element_size()))
    gather, members = mesh_gather(x._mesh)
    agree(gather, members, "redistribute", {
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
    piece = full[local_slices(tuple(full.shape), mesh.shape, placements, coord)]
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
    d = t.__dict__
    found = d.get("_sbp_strides")
    if found is not None:
        return found
    recipe = d.get("_sbp_view")
    if recipe is None:
        return tuple(t.stride())
    func, args, kwargs, k = recipe
    meta = lambda a: _meta_like(a) if isinstance(a, torch.Tensor) else \
        [meta(x) for x in a] if isinstance(a, (list, tuple)) else a
    out = func(*[meta(a) for a in args], **{n: meta(v) for n, v in kwargs.items()})
    found = d["_sbp_strides"] = tuple((out[k] if k is not None else out).stride())
    return found


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    strides = logical_strides(t) if isinstance(t, GlobalTensor) else t.stride()
    return torch.empty_strided(tuple(t.shape), strides, dtype=t.dtype, device="meta")


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
    >>> leaf._sbp_leaf_rule
    True
    """
    mesh, shape, want = leaf._mesh, tuple(leaf.shape), grad_placements(leaf._placements)

    def to_leaf_layout(grad: torch.Tensor) -> Optional[torch.Tensor]:
        if isinstance(grad, GlobalTensor):
            if grad._placements == want and grad._mesh == mesh:
                return None
            from .autograd import redistribute
            return redistribute(grad, want)
        return GlobalTensor(local_from_full(grad, mesh, want), mesh, want, shape)

    leaf.register_hook(to_leaf_layout)
    leaf.__dict__["_sbp_leaf_rule"] = True


def ensure_leaf_rule(t: GlobalTensor) -> None:
    """Install the leaf rule on `t` if it is a leaf that requires grad and has none yet (torch sets
    ``requires_grad`` in C++ for factories, so `requires_grad_` is not the only way in).

    >>> import sbp
    >>> t = GlobalTensor(torch.ones(2), sbp.DeviceMesh((1,)), (sbp.B,), (2,), requires_grad=True)
    >>> ensure_leaf_rule(t); t._sbp_leaf_rule
    True
    """
    if "_sbp_leaf_rule" not in t.__dict__ and t.requires_grad and t.is_leaf:
        install_leaf_rule(t)


def _index_error(x: GlobalTensor, index: Any, e: IndexError) -> ShapeError:
    """`ShapeError` for an index torch refused (out of bounds, too many indices), naming the global layout.

    >>> import sbp
    >>> x = GlobalTensor(torch.zeros(2, 4), DeviceMesh((2,)), (sbp.S(0),), (4, 4))
    >>> print(_index_error(x, (slice(1, None), 10), IndexError("index 10 is out of bounds")))
    x[1:, 10] on global shape (4, 4) with placements (S(0),): index 10 is out of bounds
    """
    def text(i: Any) -> str:
        if isinstance(i, slice):
            parts = ["" if v is None else str(v) for v in (i.start, i.stop, i.step)]
            return ":".join(parts[:2] if i.step is None else parts)
        if i is Ellipsis:
            return "..."
        if isinstance(i, torch.Tensor):
            return f"<{_dtype_name(i.dtype)} tensor of shape {tuple(i.shape)}>"
        return repr(i)

    items = index if isinstance(index, tuple) else (index,)
    return ShapeError(f"x[{', '.join(text(i) for i in items)}] on global shape {tuple(x.shape)} with placements "
                      f"{x._placements}: {e}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of `shape` (a zero-size dim counts as 1, as torch does).

    >>> contiguous_strides((2, 3, 4))
    (12, 4, 1)
    """
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _fmt(pls: tuple[Placement, ...]) -> str:
    return "(" + ", ".join(repr(p) for p in pls) + ("," if len(pls) == 1 else "") + ")"


# the default rules construct GlobalTensors, so they import this module: bind them last
from ..ops.fallback import default_dispatch, fallback  # noqa: E402,F401 - re-exported
