"""Factories that allocate only this rank's local tensor: zeros, ones, empty, full, rand, randn.

`rand` / `randn` give the same logical tensor whatever the mesh and placements, and the same values as
a single process (``mesh=None``), so a parallel model initialises like the single-device one. The
flattened global tensor is cut into fixed chunks of `CHUNK` elements; chunk k is drawn by its own
`torch.Generator` seeded from ``(seed, k)``, and a rank draws only the chunks that overlap its block.
Chunks are drawn on the mesh's device (a CUDA mesh draws with CUDA generators, nothing is drawn on the
host and copied): like torch's own draws, the values depend on the device type, never on the layout.

With ``mesh=None`` every factory returns a plain `torch.Tensor` holding the whole logical tensor.
`P(sum)` placements hold the value at coord 0 of the axis and zeros elsewhere; `P(min|max)` hold it
everywhere (the exact, communication-free `B -> P` conversions).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Optional, Sequence, Union

import torch

from ..runtime.agreement import agree, is_enabled, mesh_gather
from ..runtime.backends.base import comm_device
from ..runtime.traced import traced_here
from ..values.errors import DTypeError, MeshError, SbpError
from ..values.layout import check_global_shape, local_slices
from ..values.mesh import DeviceMesh
from ..values.placement import Broadcast, normalize
from .global_tensor import (
    GlobalTensor,
    check_partial_dtype,
    empty_outside,
    mesh_description,
    mesh_device,
    mesh_of,
    placements_text,
    sum_holds_value,
)

CHUNK = 1 << 16  # elements per random chunk; part of the values' definition: never change it lightly

Shape = Union[int, Sequence[int]]
# (global index of the block, block shape, dtype, device) -> the block, made on that device
Fill = Callable[[tuple[slice, ...], tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def zeros(global_shape: Shape, mesh: Optional[DeviceMesh] = None, placements=None, *,
          dtype: Optional[torch.dtype] = None, requires_grad: bool = False):
    """A global tensor of zeros; only the local block is allocated.

    >>> zeros((2, 3))                                    # mesh=None: a plain tensor
    tensor([[0., 0., 0.],
            [0., 0., 0.]])
    """
    return _constant_factory("zeros", global_shape, mesh, placements, dtype, requires_grad, 0)


def ones(global_shape: Shape, mesh: Optional[DeviceMesh] = None, placements=None, *,
         dtype: Optional[torch.dtype] = None, requires_grad: bool = False):
    """A global tensor of ones (`P(sum)`: ones at coord 0 of the axis, zeros elsewhere).

    >>> ones(3, dtype=torch.int64)
    tensor([1, 1, 1])
    """
    return _constant_factory("ones", global_shape, mesh, placements, dtype, requires_grad, 1)


def empty(global_shape: Shape, mesh: Optional[DeviceMesh] = None, placements=None, *,
          dtype: Optional[torch.dtype] = None, requires_grad: bool = False):
    """An uninitialised global tensor (under `P(sum)`, coords other than 0 hold zeros).

    >>> empty((2, 0)).shape
    torch.Size([2, 0])
    """
    return _constant_factory("empty", global_shape, mesh, placements, dtype, requires_grad, 0)


def full(global_shape: Shape, fill_value, mesh: Optional[DeviceMesh] = None, placements=None, *,
         dtype: Optional[torch.dtype] = None, requires_grad: bool = False):
    """A global tensor filled with `fill_value`, like `torch.full` (not the method `x.full()`, which
    gathers a global tensor).

    >>> full((2,), 7.0)
    tensor([7., 7.])
    """
    return _constant_factory("full", global_shape, mesh, placements, dtype, requires_grad, fill_value)


def rand(global_shape: Shape, mesh: Optional[DeviceMesh] = None, placements=None, *, seed: Optional[int] = None,
         generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
         requires_grad: bool = False):
    """Uniform [0, 1) values, identical for every mesh and placements given the seed.

    Without `seed`, one is drawn from `generator` (or torch's default generator) and the mesh takes
    coord 0's draw (one tiny all_gather), so all ranks agree; pass `seed=` with the threads backend,
    whose ranks share one default generator.

    >>> torch.equal(rand((3, 5), seed=1)[1:], rand((3, 5), seed=1)[1:])
    True
    """
    if torch.compiler.is_compiling() and traced_here() and mesh is not None:
        return _eager_random(torch.rand, global_shape, mesh, placements, seed, generator, dtype, requires_grad)
    return _random(torch.rand, global_shape, mesh, placements, seed, generator, dtype, requires_grad)


def randn(global_shape: Shape, mesh: Optional[DeviceMesh] = None, placements=None, *, seed: Optional[int] = None,
          generator: Optional[torch.Generator] = None, dtype: Optional[torch.dtype] = None,
          requires_grad: bool = False):
    """Standard normal values, identical for every mesh and placements given the seed (see `rand`).

    >>> import sbp
    >>> def fn(mesh):
    ...     return sbp.randn((10, 3), mesh, "S(0), S(1)", seed=7).full()
    >>> torch.equal(sbp.testing.spmd(fn, (2, 2))[3], randn((10, 3), seed=7))
    True
    """
    if torch.compiler.is_compiling() and traced_here() and mesh is not None:
        return _eager_random(torch.randn, global_shape, mesh, placements, seed, generator, dtype, requires_grad)
    return _random(torch.randn, global_shape, mesh, placements, seed, generator, dtype, requires_grad)


# ---- machinery ---------------------------------------------------------------------------------------------
def _constant(value) -> Fill:
    return lambda index, shape, dtype, device: torch.full(shape, value, dtype=dtype, device=device)


# kind -> (the value that picks the default dtype, the fill); "full" checks and uses its fill_value
_KINDS = {"zeros": (0.0, _constant(0)), "ones": (1.0, _constant(1)),
          "empty": (0.0, lambda index, shape, dtype, device: torch.empty(shape, dtype=dtype, device=device))}


def _constant_factory(kind: str, global_shape, mesh, placements, dtype, requires_grad, value):
    """zeros / ones / empty / full. Inside compiled code (a mesh given): one opaque call that makes the local
    block (no collective, placements and mesh constants of the graph); a result that requires grad is a new
    leaf, which a graph cannot make: a graph break that makes it eagerly."""
    if torch.compiler.is_compiling() and traced_here() and mesh is not None:
        if requires_grad is not False:
            return _eager_constant(kind, global_shape, mesh, placements, dtype, requires_grad, value)
        _check_dtype(dtype)
        shape = (global_shape,) if isinstance(global_shape, int) else tuple(global_shape)
        if placements is not None and isinstance(mesh, DeviceMesh):   # checked where dynamo traces: sbp's error
            normalize(placements, len(shape), mesh.ndim, cache=False)   # reaches the user, not the opaque call's
        return _compiled_constant(kind, shape, mesh_description(mesh),
                                  "" if placements is None else placements_text(placements),
                                  "" if dtype is None else str(dtype).removeprefix("torch."), value)
    return _constant_local(kind, global_shape, mesh, placements, dtype, requires_grad, value)


def _constant_local(kind: str, global_shape, mesh, placements, dtype, requires_grad, value):
    if kind == "full":
        return _make(global_shape, mesh, placements, dtype, requires_grad, value, _constant(value), check_value=True)
    sample, fill = _KINDS[kind]
    return _make(global_shape, mesh, placements, dtype, requires_grad, sample, fill)


def _constant_described(kind: str, shape: tuple, mesh: tuple, placements, dtype: str, value):
    return _constant_local(kind, shape, mesh_of(mesh), placements or None, getattr(torch, dtype) if dtype else None,
                           False, value)


_IN_GRAPH = ("sbp.{0} inside a compiled function is not traced into the graph: {1}; it runs eagerly between two "
             "graphs. With fullgraph=True call it outside the compiled function")
_compiled_constant = torch._dynamo.nonstrict_trace(_constant_described)
_eager_constant = torch._dynamo.disable(_constant_local, reason=_IN_GRAPH.format(
    "zeros / ones / empty / full with requires_grad=True", "a graph cannot make a new leaf that requires grad"))


def _make(global_shape: Shape, mesh: Optional[DeviceMesh], placements, dtype, requires_grad: bool,
          sample_value, fill: Fill, check_value: bool = False, agreed: Optional[dict] = None):
    """The factory's global tensor; under `sbp.debug()` the ranks first agree on its global shape, placements,
    dtype, the fill value and `agreed` (the random factories' seed)."""
    shape = check_global_shape((global_shape,) if isinstance(global_shape, int) else global_shape)
    _check_dtype(dtype)
    if check_value:
        sample_value = _as_number(sample_value)
        fill = _constant(sample_value)
    if check_value and not isinstance(sample_value, (bool, int, float, complex)):
        raise DTypeError(f"full: fill_value must be a Python number (bool, int, float or complex), "
                         f"got {sample_value!r} ({type(sample_value).__name__})")
    if dtype is None:
        dtype = (torch.bool if isinstance(sample_value, bool) else torch.int64 if isinstance(sample_value, int)
                 else torch.complex64 if isinstance(sample_value, complex) else torch.get_default_dtype())
    if check_value:
        _check_fill(sample_value, dtype)
    if not isinstance(requires_grad, bool):
        raise SbpError(f"requires_grad must be a bool, got {requires_grad!r}")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise DTypeError(f"requires_grad=True needs a floating point or complex dtype (only those have "
                         f"gradients), got {dtype}")
    if mesh is None:
        if placements is not None:
            raise SbpError(f"placements {placements!r} need a mesh; pass mesh= or drop placements")
        out = fill(tuple(slice(0, n) for n in shape), shape, dtype, torch.device("cpu"))
        return out.requires_grad_(requires_grad)
    if not isinstance(mesh, DeviceMesh) or mesh.binding is None:
        hint = (f" (an int: the global shape is one argument, a tuple -- ({global_shape}, {mesh}), mesh, placements "
                f"-- not sizes one by one)" if isinstance(mesh, int) and isinstance(global_shape, int) else "")
        raise MeshError(f"factories need an sbp.DeviceMesh bound to processes (sbp.init_mesh or sbp.testing.spmd), "
                        f"got {mesh!r}{hint}")
    pls = normalize((Broadcast(),) * mesh.ndim if placements is None else placements, len(shape), mesh.ndim)
    check_partial_dtype(pls, dtype, "factory")
    coord = mesh.coord
    mesh_device(mesh, "factory")
    device = comm_device(mesh)
    if is_enabled() and coord is not None:
        gather, members = mesh_gather(mesh)
        agree(gather, members, "factory", {"global shape": shape, "placements": pls, "dtype": dtype,
                                           "fill value": sample_value, **(agreed or {})}, device=device)
    if coord is None:
        local = empty_outside(len(shape), dtype, device)
    else:
        index = local_slices(shape, mesh.shape, pls, coord)
        block = tuple(s.stop - s.start for s in index)
        if sum_holds_value(mesh, pls, coord):
            local = fill(index, block, dtype, device)   # made on the device, not filled on the host and copied
        else:
            local = torch.zeros(block, dtype=dtype, device=device)
    out = GlobalTensor(local, mesh, pls, shape)
    return out.requires_grad_(True) if requires_grad else out


def _random(draw, global_shape, mesh, placements, seed, generator, dtype, requires_grad):
    _check_dtype(dtype)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise DTypeError(f"random factories need a floating dtype, got {dtype}")
    if not _can_draw(draw, dtype):
        raise DTypeError(f"torch cannot draw random numbers in {dtype} (valid: float16, bfloat16, float32, float64); "
                         f"draw in float32 and cast")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise SbpError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and seed is not None:   # the seed would win and the generator be ignored
        raise SbpError(f"give seed= or generator=, not both (got seed={seed!r} and a generator)")
    if seed is None:
        seed = agreed_seed(mesh, generator)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise SbpError(f"seed must be an int, got {seed!r}")
    elif not -(1 << 63) <= seed < (1 << 64):
        raise SbpError(f"seed must fit in 64 bits (as torch.manual_seed: -2**63 <= seed < 2**64), got {seed}")
    shape = check_global_shape((global_shape,) if isinstance(global_shape, int) else global_shape)
    total = 1
    for n in shape:
        total *= n

    def fill(index: tuple[slice, ...], block: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        flat = _flat_indices(shape, index, device)          # (local numel,) ascending global flat indices
        out = torch.empty(flat.numel(), dtype=dtype, device=device)
        if flat.numel():
            chunk_of = flat // CHUNK
            ids, counts = torch.unique_consecutive(chunk_of, return_counts=True)
            start = 0
            for k, count in zip(ids.tolist(), counts.tolist()):
                values = _chunk(draw, seed, k, min(CHUNK, total - k * CHUNK), dtype, device)
                out[start:start + count] = values[flat[start:start + count] - k * CHUNK]
                start += count
        return out.view(block)   # drawn on the device itself: no host draw, no copy

    return _make(shape, mesh, placements, dtype, requires_grad, 0.0, fill, agreed={"seed": seed})


_eager_random = torch._dynamo.disable(_random, reason=_IN_GRAPH.format(
    "rand / randn", "each chunk is drawn by its own seeded torch.Generator (and without seed= the ranks agree on "
    "one with a collective)"))


@functools.lru_cache(maxsize=None)
def _can_draw(draw, dtype: torch.dtype) -> bool:
    """Whether torch has a kernel drawing `draw` numbers in `dtype` (not float8, for one)."""
    try:
        _chunk(draw, 0, 0, 1, dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _check_dtype(dtype) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise DTypeError(f"dtype must be a torch.dtype (e.g. torch.float32) or None, got {dtype!r}")
    if dtype in _QUANTIZED:
        raise DTypeError(f"sbp's factories do not make quantized tensors, got dtype {dtype}; make the values in a "
                         f"plain dtype and quantize the local blocks")


_QUANTIZED = frozenset(getattr(torch, name) for name in ("quint8", "qint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, name))


def _as_number(value):
    """A Python number from numpy scalars and one-element tensors (torch.full accepts them too)."""
    if isinstance(value, (bool, int, float, complex)) or not callable(getattr(value, "item", None)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        return value
    try:
        number = value.item()
    except (TypeError, ValueError):
        return value
    return number if isinstance(number, (bool, int, float, complex)) else value


def _check_fill(value, dtype: torch.dtype) -> None:
    """`value` must be representable in `dtype`: no silent truncation (1.5 -> int64) or overflow (300 -> uint8).
    Rounding a float to the nearest value of a float dtype is not truncation."""
    def refuse(why: str) -> DTypeError:
        return DTypeError(f"full: fill_value {value!r} cannot be represented as {dtype} ({why}); "
                          f"pass a value the dtype holds exactly or another dtype")

    if isinstance(value, complex) and not dtype.is_complex:
        if value.imag != 0:
            raise refuse("a complex number with an imaginary part needs a complex dtype")
        value = value.real
    if dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex):
        if isinstance(value, float) and not value.is_integer():
            raise refuse("not an integer")
        if dtype == torch.bool:
            if value not in (0, 1):
                raise refuse("bool holds only 0/False and 1/True")
            return
        info = torch.iinfo(dtype)
        if not info.min <= value <= info.max:
            raise refuse(f"out of range {info.min}..{info.max}")
    else:   # a float dtype, or a complex one (each part in its real dtype)
        finfo = torch.finfo(dtype)
        parts = (value.real, value.imag) if isinstance(value, complex) else (value,)
        if any(abs(v) != float("inf") and v == v and abs(v) > finfo.max for v in parts):
            raise refuse(f"beyond its largest finite value {finfo.max}")


def _chunk(draw, seed: int, k: int, size: int, dtype: torch.dtype,
           device: torch.device = torch.device("cpu")) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(_mix(seed, k))
    return draw(size, generator=generator, dtype=dtype, device=device)


def _mix(seed: int, k: int) -> int:
    """A 63-bit seed for chunk k: splitmix64 of the pair (exact Python integer arithmetic)."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (k + 1) * 0xD1B54A32D192ED03) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


def _flat_indices(shape: tuple[int, ...], index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
    """Row-major flat indices into `shape` of the elements of the block `index`, in the block's order."""
    flat = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    strides = []
    for n in reversed(shape):
        strides.append(stride)
        stride *= n
    for s, st in zip(index, reversed(strides)):
        flat = flat.unsqueeze(-1) + torch.arange(s.start, s.stop, dtype=torch.int64, device=device) * st
    return flat.reshape(-1)


# held around sbp's own uses of the process's default generator: the threads backend's ranks share it, and a
# draw from it by one rank must not land inside another rank's draw from it seeded for agreement
DEFAULT_RNG = threading.Lock()


def agreed_seed(mesh: Optional[DeviceMesh], generator: Optional[torch.Generator]) -> int:
    """A seed drawn from `generator` (or the default one) on the mesh's first rank and all-gathered, so every
    rank of the mesh gets the same seed (one small collective); a pure mesh or a rank outside it draws alone.

    >>> import sbp, sbp.testing
    >>> seeds = sbp.testing.spmd(lambda mesh: agreed_seed(mesh, None), (2,))
    >>> seeds[0] == seeds[1]
    True
    """
    # drawn on the generator's own device (a CUDA generator draws only there)
    device = generator.device if generator is not None else torch.device("cpu")
    with DEFAULT_RNG if generator is None else contextlib.nullcontext():   # not inside another rank's seeded draw
        drawn = torch.randint(0, 2 ** 62, (1,), generator=generator, dtype=torch.int64, device=device)
    if mesh is None or mesh.binding is None or mesh.coord is None:
        return int(drawn.item())
    drawn = drawn.to(comm_device(mesh))     # NCCL meshes need tensors on the rank's GPU
    return int(mesh.binding.all_gather(drawn, tuple(range(mesh.ndim)))[0].item())
