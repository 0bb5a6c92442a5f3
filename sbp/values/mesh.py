"""The device mesh as a pure value: shape, axis names, the world ranks it covers, rank <-> coord maths.

A `DeviceMesh` made directly is a value for planning and layout maths. `sbp.init_mesh` returns the
same value bound to a communicator (torch.distributed process groups, or the in-process backend);
binding never changes equality or hashing.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence, runtime_checkable

from .errors import MeshError

MAX_RANKS = 1 << 24   # 16,777,216: far beyond any torch.distributed world, small enough to list

AxisRef = "int | str"


@runtime_checkable
class MeshBinding(Protocol):
    """What a mesh needs from the communicator it is bound to (`DeviceMesh.binding`). The full interface,
    collectives included, is `sbp.runtime.communicator.Communicator`, which extends this one; the values
    layer names only what it calls, so it never imports the runtime.

    >>> import sbp.testing
    >>> sbp.testing.spmd(lambda mesh: isinstance(mesh.binding, MeshBinding), (2,))
    [True, True]
    """

    rank: int          # this process's world rank
    backend: str       # "gloo"/"nccl" via "dist", or "threads"

    def submesh_binding(self, mesh: "DeviceMesh", axes: tuple[int, ...],
                        members: "tuple[int, ...] | None" = None) -> "MeshBinding":
        """The binding of `mesh`'s sub-mesh along `axes` made of `members` (default: this rank's group)."""


class _Bindable:
    """Holds a mesh's `binding` outside its dataclass fields: the fields are the value (equality, hashing,
    and what torch.compile rebuilds a mesh argument from, so a bound mesh passes into a compiled graph
    as a constant); the binding is this process's communicator and never part of the value."""

    __slots__ = ("binding",)


@dataclass(frozen=True, slots=True, init=False)
class DeviceMesh(_Bindable):
    """An n-dimensional grid of ranks.

    `ranks` lists the world ranks in row-major coord order (default: 0..size-1); `binding` is the
    communicator of a mesh bound to processes (`sbp.init_mesh`; None for a pure value).

    >>> mesh = DeviceMesh((2, 2), names=("dp", "tp"))
    >>> mesh.size(), mesh.coord_of(3), mesh.rank_of((1, 0))
    (4, (1, 1), 2)
    >>> mesh.groups("tp")
    ((0, 1), (2, 3))
    """

    shape: tuple[int, ...]
    names: Optional[tuple[str, ...]] = None
    ranks: Optional[tuple[int, ...]] = None
    device_type: str = "cpu"

    def __init__(self, shape: Any, names: Optional[Sequence[str]] = None, ranks: Optional[Sequence[int]] = None,
                 device_type: str = "cpu", binding: Optional[MeshBinding] = None) -> None:
        for name, value in (("shape", shape), ("names", names), ("ranks", ranks),
                            ("device_type", device_type), ("binding", binding)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        shape = self.shape
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        try:
            shape = tuple(shape)
        except TypeError:
            raise MeshError(f"mesh shape must be a tuple of positive ints, got {self.shape!r}") from None
        ints = as_ints(shape)   # any integer (numpy's too), as global shapes and coords take them; no bool
        if not shape or ints is None or any(n < 1 for n in ints):
            raise MeshError(f"mesh shape must be a non-empty tuple of positive ints, got {self.shape!r}")
        shape = ints
        object.__setattr__(self, "shape", shape)
        for what in ("names", "ranks"):   # an unordered collection would give each process its own order
            if isinstance(getattr(self, what), (set, frozenset, dict)):
                raise MeshError(f"mesh {what} must be ordered (a tuple or list, one per axis / rank in row-major "
                                f"order), got a {type(getattr(self, what)).__name__}: {getattr(self, what)!r}")
        if self.names is not None:
            # a lone string is one name, not one name per character ("dp" is not ("d", "p"))
            try:
                names = (self.names,) if isinstance(self.names, str) else tuple(self.names)
            except TypeError:
                raise MeshError(f"mesh names must be a tuple of strings, one per axis of shape {shape}, "
                                f"got {self.names!r}") from None
            if len(names) != len(shape):
                raise MeshError(f"mesh names {names} must have one name per axis of shape {shape}")
            if any(not isinstance(n, str) or not n for n in names):
                raise MeshError(f"mesh axis names must be non-empty strings, got {names}")
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise MeshError(f"mesh axis names must be unique, got {names} (duplicated: {', '.join(dup)})")
            object.__setattr__(self, "names", names)
        size = math.prod(shape)
        if size > MAX_RANKS:
            raise MeshError(f"mesh shape {shape} has {size} ranks; a mesh holds at most {MAX_RANKS} "
                            f"(its rank list is kept)")
        try:
            ranks = tuple(range(size)) if self.ranks is None else tuple(self.ranks)
        except TypeError:
            raise MeshError(f"mesh ranks must be a sequence of {size} distinct world ranks (row-major), "
                            f"got {self.ranks!r}") from None
        if len(ranks) != size:
            raise MeshError(f"mesh of shape {shape} needs {size} ranks, got {len(ranks)}: {list(ranks)}")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
            raise MeshError(f"mesh ranks must be non-negative ints, got {list(ranks)}")
        if len(set(ranks)) != size:
            raise MeshError(f"mesh ranks must be distinct, got {list(ranks)}")
        object.__setattr__(self, "ranks", ranks)
        if self.device_type not in ("cpu", "cuda"):
            raise MeshError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        """Number of mesh axes.

        >>> DeviceMesh((2, 3)).ndim
        2
        """
        return len(self.shape)

    def size(self, axis: "int | str | None" = None) -> int:
        """Number of ranks in the mesh, or along one axis.

        >>> DeviceMesh((2, 3)).size(), DeviceMesh((2, 3)).size(1)
        (6, 3)
        """
        if axis is None:
            return math.prod(self.shape)
        return self.shape[self.axis(axis)]

    def axis(self, ref: "int | str") -> int:
        """The index of an axis given by index (negative allowed) or by name.

        >>> DeviceMesh((2, 2), names=("dp", "tp")).axis("tp")
        1
        """
        if isinstance(ref, str):
            if self.names is None or ref not in self.names:
                raise MeshError(f"mesh has no axis named {ref!r} (axis names: {self.names})")
            return self.names.index(ref)
        if isinstance(ref, bool) or not isinstance(ref, int) or not -self.ndim <= ref < self.ndim:
            raise MeshError(f"mesh axis {ref!r} is out of range for a {self.ndim}-axis mesh (valid: {-self.ndim}..{self.ndim - 1} or a name)")
        return ref % self.ndim

    # ---- rank <-> coord ----------------------------------------------------------------------------
    def coord_of(self, rank: int) -> tuple[int, ...]:
        """The coord of a world rank in this mesh (row-major).

        >>> DeviceMesh((2, 3)).coord_of(4), DeviceMesh((2,), ranks=[5, 7]).coord_of(7)
        ((1, 1), (1,))
        """
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise MeshError(f"a rank is an int, got {rank!r}")
        try:
            index = self.ranks.index(rank)
        except ValueError:
            raise MeshError(f"rank {rank} is not in this mesh (ranks: {list(self.ranks)})") from None
        return self.coord_of_index(index)

    def coord_of_index(self, index: int) -> tuple[int, ...]:
        """The coord of the mesh-local (flat, row-major) index, whatever world rank sits there.

        >>> DeviceMesh((2, 3)).coord_of_index(4), DeviceMesh((2,), ranks=[5, 7]).coord_of_index(1)
        ((1, 1), (1,))
        """
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.ranks):
            raise MeshError(f"a mesh index of mesh shape {self.shape} is an int in 0..{len(self.ranks) - 1}, "
                            f"got {index!r}")
        coord = []
        for n in reversed(self.shape):
            coord.append(index % n)
            index //= n
        return tuple(reversed(coord))

    def index_of(self, coord: Sequence[int]) -> int:
        """The flat row-major index of a coord.

        >>> DeviceMesh((2, 3)).index_of((1, 2))
        5
        """
        if not _is_coord(coord, self.shape):
            raise MeshError(bad_coord(coord, self.shape))
        index = 0
        for c, n in zip(coord, self.shape):
            index = index * n + c
        return index

    def rank_of(self, coord: Sequence[int]) -> int:
        """The world rank at a coord.

        >>> DeviceMesh((2, 2), ranks=[4, 5, 6, 7]).rank_of((1, 0))
        6
        """
        return self.ranks[self.index_of(coord)]

    def coords(self) -> list[tuple[int, ...]]:
        """All coords in row-major order.

        >>> DeviceMesh((2, 2)).coords()
        [(0, 0), (0, 1), (1, 0), (1, 1)]
        """
        return list(itertools.product(*(range(n) for n in self.shape)))

    # ---- groups along axes -------------------------------------------------------------------------
    def groups(self, axes: "int | str | Iterable[int | str]") -> tuple[tuple[int, ...], ...]:
        """The rank groups along `axes`: one group per coord of the other axes, members row-major over `axes`.

        >>> DeviceMesh((2, 2)).groups((0, 1))
        ((0, 1, 2, 3),)
        """
        axes = self.axes(axes)
        others = [a for a in range(self.ndim) if a not in axes]
        out = []
        for rest in itertools.product(*(range(self.shape[a]) for a in others)):
            group = []
            for sub in itertools.product(*(range(self.shape[a]) for a in axes)):
                coord = [0] * self.ndim
                for a, c in zip(others, rest):
                    coord[a] = c
                for a, c in zip(axes, sub):
                    coord[a] = c
                group.append(self.rank_of(coord))
            out.append(tuple(group))
        return tuple(out)

    def axes(self, refs: "int | str | Iterable[int | str]") -> tuple[int, ...]:
        """Normalise one axis reference or several into a sorted tuple of distinct axis indices.

        >>> mesh = DeviceMesh((2, 2, 2), names=("pp", "dp", "tp"))
        >>> mesh.axes("dp"), mesh.axes(("tp", 0, -1))
        ((1,), (0, 2))
        """
        if isinstance(refs, (int, str)):
            refs = (refs,)
        try:
            refs = tuple(refs)
        except TypeError:
            raise MeshError(f"mesh axes must be an axis (index or name) or a sequence of them, got {refs!r}") from None
        axes = tuple(sorted({self.axis(r) for r in refs}))
        return axes

    def group_index(self, coord: Sequence[int], axes: Sequence[int]) -> int:
        """Position of `coord` inside its group along `axes` (row-major over `axes`).

        >>> DeviceMesh((2, 2, 2)).group_index((1, 0, 1), (0, 2))
        3
        """
        index = 0
        for a in axes:
            index = index * self.shape[a] + coord[a]
        return index

    def submesh(self, axes: "int | str | Iterable[int | str]", coord: Sequence[int]) -> "DeviceMesh":
        """The sub-mesh along `axes` through `coord` (other axes fixed at `coord`'s values).

        >>> DeviceMesh((2, 2), names=("dp", "tp")).submesh("tp", (1, 0))
        DeviceMesh((2,), names=('tp',), ranks=[2, 3])
        >>> DeviceMesh((2, 2), names=("dp", "tp")).submesh(("tp", "dp"), (1, 0))
        Traceback (most recent call last):
        ...
        sbp.values.errors.MeshError: a sub-mesh takes its axes in the mesh's order, each once: got ('tp', 'dp'); write ('dp', 'tp')
        """
        refs = (axes,) if isinstance(axes, (int, str)) else axes
        if isinstance(refs, Iterable):
            refs = tuple(refs)
        axes = self.axes(refs)
        if tuple(self.axis(r) for r in refs) != axes:   # (as torch's DeviceMesh: no transposed or repeated axes)
            names = self.names is not None and all(isinstance(r, str) for r in refs)   # in the caller's spelling
            order = tuple(self.names[a] for a in axes) if names else axes
            raise MeshError(f"a sub-mesh takes its axes in the mesh's order, each once: got {refs!r}; write "
                            f"{order[0] if len(order) == 1 else order!r}")
        rank = self.rank_of(coord)
        for group in self.groups(axes):
            if rank in group:
                names = None if self.names is None else tuple(self.names[a] for a in axes)
                binding = None if self.binding is None else self.binding.submesh_binding(self, axes, group)
                sub = DeviceMesh(tuple(self.shape[a] for a in axes), names, group, self.device_type, binding)
                if binding is not None and self.rank in group:   # what a pickled or compiled copy binds to
                    LIVE_MESHES.remember(sub, per_thread=binding.backend == "threads")
                return sub
        raise MeshError(f"coord {tuple(coord)} is not in a mesh of shape {self.shape}")  # pragma: no cover

    # ---- bound meshes ------------------------------------------------------------------------------
    @property
    def rank(self) -> Optional[int]:
        """This process's world rank (bound meshes only).

        >>> import sbp.testing
        >>> sbp.testing.spmd(lambda mesh: mesh.rank, (2, 2))
        [0, 1, 2, 3]
        """
        return self._bound("rank").rank

    @property
    def coord(self) -> Optional[tuple[int, ...]]:
        """This process's coord in the mesh, or None when this rank is outside the mesh (bound meshes only).

        >>> import sbp.testing
        >>> sbp.testing.spmd(lambda mesh: mesh.coord, (2, 2))
        [(0, 0), (0, 1), (1, 0), (1, 1)]
        """
        rank = self._bound("coord").rank
        return self.coord_of(rank) if rank in self.ranks else None

    # ---- DTensor's spellings of the same facts (code ported from torch.distributed's DeviceMesh) -----
    @property
    def mesh_dim_names(self) -> Optional[tuple[str, ...]]:
        """The axis names (DTensor's spelling of `names`).

        >>> DeviceMesh((2, 2), names=("dp", "tp")).mesh_dim_names
        ('dp', 'tp')
        """
        return self.names

    def get_coordinate(self) -> Optional[list[int]]:
        """This rank's coord as a list, None outside the mesh (DTensor's spelling of `coord`).

        >>> import sbp.testing
        >>> sbp.testing.spmd(lambda mesh: mesh.get_coordinate(), (2,))
        [[0], [1]]
        """
        coord = self.coord
        return None if coord is None else list(coord)

    def get_local_rank(self, mesh_dim: "int | str | None" = None) -> int:
        """This rank's coord along one axis (DTensor's spelling; `mesh_dim` may be omitted on a 1-axis mesh).

        >>> import sbp.testing
        >>> sbp.testing.spmd(lambda mesh: mesh.get_local_rank("tp"), (2, 2), names=("dp", "tp"))
        [0, 1, 0, 1]
        """
        if mesh_dim is None:
            if self.ndim != 1:
                raise MeshError(f"get_local_rank needs mesh_dim on a {self.ndim}-axis mesh (valid: "
                                f"0..{self.ndim - 1} or a name)")
            mesh_dim = 0
        coord = self.coord
        if coord is None:
            raise MeshError(f"rank {self.rank} is outside {self!r}: it has no local rank")
        return coord[self.axis(mesh_dim)]

    def __getitem__(self, name: "int | str") -> "DeviceMesh":
        """The 1-axis sub-mesh along `name` that contains this rank (bound meshes only).

        >>> import sbp.testing
        >>> sbp.testing.spmd(lambda mesh: mesh["tp"].ranks, (2, 2), names=("dp", "tp"))
        [(0, 1), (0, 1), (2, 3), (2, 3)]
        >>> DeviceMesh((2, 2), names=("dp", "tp"))["tp"]
        Traceback (most recent call last):
        ...
        sbp.values.errors.MeshError: mesh['tp'] (the sub-mesh along an axis through this rank) needs a mesh bound to processes (sbp.init_mesh or sbp.testing.spmd); DeviceMesh((2, 2), names=('dp', 'tp')) is a pure value
        """
        if self.binding is None:
            raise MeshError(f"mesh[{name!r}] (the sub-mesh along an axis through this rank) needs a mesh bound to "
                            f"processes (sbp.init_mesh or sbp.testing.spmd); {self!r} is a pure value")
        coord = self.coord
        if coord is None:
            raise MeshError(f"rank {self.rank} is outside this mesh (ranks: {list(self.ranks)}); it has no sub-mesh")
        return self.submesh(name, coord)

    # ---- copies and pickles: the value travels, the binding never does ------------------------------
    def __copy__(self) -> "DeviceMesh":
        return self

    def __deepcopy__(self, memo: dict) -> "DeviceMesh":
        """A mesh is an immutable value; a copy of anything holding it shares it, binding included (process
        groups and communicators are never copied).

        >>> import copy
        >>> mesh = DeviceMesh((2,)); copy.deepcopy({"m": mesh})["m"] is mesh
        True
        """
        return self

    def __reduce__(self) -> tuple:
        """Pickles as its description (shape, names, ranks, device type), never its binding. A pure mesh
        loads as a pure mesh; a bound one binds again on load to the live mesh of the process with the
        same description (`LIVE_MESHES.find`).

        >>> import pickle
        >>> pickle.loads(pickle.dumps(DeviceMesh((2, 2), names=("dp", "tp"))))
        DeviceMesh((2, 2), names=('dp', 'tp'))
        """
        description = (self.shape, self.names, self.ranks, self.device_type)
        return (DeviceMesh if self.binding is None else live_mesh), description

    def _bound(self, what: str) -> Any:
        if self.binding is None:
            raise MeshError(
                f"mesh.{what} needs a mesh bound to processes (sbp.init_mesh or sbp.testing.spmd); "
                f"this DeviceMesh{self.shape} is a pure value"
            )
        return self.binding

    def __repr__(self) -> str:
        names = f", names={self.names}" if self.names else ""
        r = self.ranks
        if r == tuple(range(len(r))):
            ranks = ""
        elif len(r) > 8 and r == tuple(range(r[0], r[0] + len(r))):   # one run: as a range (16k ranks stay short)
            ranks = f", ranks=range({r[0]}, {r[0] + len(r)})"
        else:
            ranks = f", ranks={list(r)}"
        return f"DeviceMesh({self.shape}{names}{ranks})"


def _frozen(self: DeviceMesh, name: str, *_: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r} of a DeviceMesh (an immutable value)")


# the binding too is frozen: dataclasses' own __setattr__ of a slots class, reached for a name that is not a
# field, fails with an unrelated TypeError ("super(type, obj): ...") instead
DeviceMesh.__setattr__ = _frozen
DeviceMesh.__delattr__ = _frozen


class LiveMeshes:
    """The bound meshes of this process, by description: what an unpickled mesh binds to.

    Backends `remember` every mesh they bind. A torch.distributed mesh is remembered for the process; a
    mesh of the in-process backend for its thread (each thread is one rank there). `find` returns the
    remembered mesh equal to a description or, when there is none, binds a new one through a remembered
    mesh of the same world (torch.distributed: every rank must then load in the same order, since new
    process groups are made). `clear` forgets them all.

    >>> live = LiveMeshes()
    >>> live.find(((2,), None, (0, 1), "cpu"))
    Traceback (most recent call last):
    ...
    sbp.values.errors.MeshError: cannot load a global tensor of DeviceMesh((2,)) (device_type 'cpu'): no mesh is bound in this process; bind one first on every rank, e.g. sbp.init_mesh((2,), device_type='cpu'), then load
    """

    def __init__(self) -> None:
        self._process: dict[tuple, DeviceMesh] = {}
        self._thread = threading.local()
        self._lock = threading.Lock()

    def _table(self, per_thread: bool) -> dict[tuple, DeviceMesh]:
        if not per_thread:
            return self._process
        table = getattr(self._thread, "meshes", None)
        if table is None:
            table = self._thread.meshes = {}
        return table

    def remember(self, mesh: DeviceMesh, *, per_thread: bool) -> None:
        """Note a bound mesh (the latest of one description wins)."""
        key = (mesh.shape, mesh.names, mesh.ranks, mesh.device_type)
        with self._lock:
            table = self._table(per_thread)
            table.pop(key, None)
            table[key] = mesh

    def find(self, description: tuple) -> DeviceMesh:
        """The live mesh with `description` (shape, names, ranks, device type), bound anew if needed."""
        key = tuple(description)
        mesh = DeviceMesh(*key)   # validates the description
        with self._lock:
            tables = [t for t in (getattr(self._thread, "meshes", None), self._process) if t]
            for table in tables:
                if key in table:
                    return table[key]
            world = next((m for table in tables for m in reversed(table.values())
                          if m.device_type == mesh.device_type), None)
        if world is None:
            names = f", names={mesh.names}" if mesh.names else ""
            raise MeshError(f"cannot load a global tensor of {mesh!r} (device_type {mesh.device_type!r}): no mesh is "
                            f"bound in this process; bind one first on every rank, e.g. "
                            f"sbp.init_mesh({mesh.shape}{names}, device_type={mesh.device_type!r}), then load")
        return world.binding.bind(mesh)   # the backend remembers the new mesh

    def clear(self) -> None:
        """Forget every remembered mesh (of the process and of this thread)."""
        with self._lock:
            self._process.clear()
            self._table(True).clear()


LIVE_MESHES = LiveMeshes()   # the one registry: backends remember into it, unpickling finds in it


def live_mesh(shape: tuple[int, ...], names: Optional[tuple[str, ...]], ranks: tuple[int, ...],
              device_type: str) -> DeviceMesh:
    """The live bound mesh with this description (what a pickled bound mesh loads as); see `LiveMeshes`.

    >>> import sbp.testing
    >>> sbp.testing.spmd(lambda mesh: live_mesh(mesh.shape, mesh.names, mesh.ranks, "cpu") is mesh, (2,))
    [True, True]
    """
    return LIVE_MESHES.find((shape, names, ranks, device_type))


def bad_coord(coord: Any, shape: tuple[int, ...]) -> str:
    """The message for a coord that is not in a mesh of `shape`.

    >>> bad_coord(None, (2, 2))
    'coord None is not in a mesh of shape (2, 2) (a coord is a tuple of 2 ints, one per axis)'
    """
    try:
        return f"coord {tuple(coord)} is not in a mesh of shape {shape}"
    except TypeError:
        return f"coord {coord!r} is not in a mesh of shape {shape} (a coord is a tuple of {len(shape)} int{'s' if len(shape) != 1 else ''}, one per axis)"


def _is_coord(coord: Any, shape: tuple[int, ...]) -> bool:
    try:
        coord = as_ints(coord)
    except TypeError:   # no sequence
        return False
    return coord is not None and len(coord) == len(shape) and all(0 <= c < n for c, n in zip(coord, shape))


def as_ints(values: Iterable[Any]) -> Optional[tuple[int, ...]]:
    """`values` as a tuple of ints when each is an integer (an int, a numpy integer: anything with
    ``__index__``) and none is a bool (a flag, not a count), else None.

    >>> import numpy as np
    >>> as_ints((2, np.int64(3))), as_ints((2, 3.0)), as_ints((True,))
    ((2, 3), None, None)
    """
    values = tuple(values)
    if any(isinstance(v, bool) for v in values):
        return None
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError:
        return None


def as_mesh_shape(mesh: "DeviceMesh | Sequence[int] | int") -> tuple[int, ...]:
    """Accept a mesh or a mesh shape (tuple or '2x2' string) and return the shape tuple.

    >>> as_mesh_shape("2x4"), as_mesh_shape((2, 2)), as_mesh_shape(DeviceMesh((8,)))
    ((2, 4), (2, 2), (8,))
    """
    if isinstance(mesh, DeviceMesh):
        return mesh.shape
    if type(mesh) is tuple and mesh and all(type(n) is int and n > 0 for n in mesh) and math.prod(mesh) <= MAX_RANKS:
        return mesh
    if isinstance(mesh, str):
        try:
            mesh = tuple(int(p) for p in mesh.lower().split("x"))
        except ValueError:
            raise MeshError(f"cannot parse mesh shape {mesh!r}; write it like '2x2' or '8'") from None
    return DeviceMesh(mesh).shape
