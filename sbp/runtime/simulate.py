"""Reference simulator: run a plan on every coord's local tensor in one process, from the logical definitions.

It is the oracle for the planner and the executor and shares no code with `sbp.runtime.executor`. A step acts on
every group along its axes (the other axes fixed). The group's value is rebuilt on global coordinates
from its members' locals, nesting the axes in order: a Split axis lays the members' blocks side by side,
a Partial axis reduces them with its op, a Broadcast axis takes coord 0 after checking that the
replicas agree (unless a later Partial axis outside the group lets their contributions differ). Each member then cuts its new local out of that value with `sbp.values.layout.block`. An axis
that turns Partial keeps the member's own contribution instead (local-move semantics):

=================  ==============================================================================
move on axis a     new local at coord c
=================  ==============================================================================
``B -> P(sum)``    the value where ``c[a] == 0``, zeros elsewhere
``B -> P(min|max)``  the value, on every coord
``S(d) -> P(op)``  the shard, embedded into the op's identity (0, +inf / -inf, or the int dtype's max / min)
=================  ==============================================================================

Every communicating kind is the same rebuild and cut; the kind only limits what one step may do
(a ``reduce_transfer`` reduces Partial axes of its own op into Split/Broadcast ones, nothing else).

Imports torch for tensors, never ``torch.distributed``.
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from ..values.errors import ShapeError
from ..values.layout import Block, block, block_shape, check_global_shape
from ..values.mesh import DeviceMesh, as_mesh_shape
from ..values.placement import Broadcast, Partial, Placement, Split, normalize
from ..values.steps import Plan, Step

Coord = tuple[int, ...]
Locals = dict[Coord, torch.Tensor]


class SimulationError(AssertionError):
    """A plan step cannot be carried out as written: a wrong plan, not a user error."""


def simulate(plan: Plan, locals: Locals) -> Locals:
    """Execute `plan` on the local tensors of all coords at once and return the new locals.

    Per-rank table for ``S(0) -> B`` on a (2,) mesh:

    >>> import torch, sbp
    >>> p = sbp.plan((4,), (2,), "S(0)", "B")
    >>> out = simulate(p, {(0,): torch.tensor([1, 2]), (1,): torch.tensor([3, 4])})
    >>> out[(0,)].tolist(), out[(1,)].tolist()
    ([1, 2, 3, 4], [1, 2, 3, 4])
    """
    mesh_shape, global_shape = tuple(plan.mesh_shape), tuple(plan.global_shape)
    _check_locals(locals, mesh_shape, plan.src, global_shape)
    for step in plan.steps:
        locals = _apply(step, locals, mesh_shape, global_shape)
    return locals


def scatter(global_tensor: torch.Tensor, mesh_shape: "DeviceMesh | Sequence[int]", placements, *,
            parts: "int | torch.Generator | None" = None) -> Locals:
    """The local tensors of every coord for a logical tensor laid out with `placements`.

    A Partial axis holds the value at coord 0 and the op's identity elsewhere; with ``parts=seed`` (or a
    ``torch.Generator``) it holds random contributions whose op-reduction is exactly the value (use
    integer data or integer-valued floats so sums are exact).

    >>> import torch
    >>> t = torch.arange(4.)
    >>> {c: v.tolist() for c, v in scatter(t, (2,), "S(0)").items()}
    {(0,): [0.0, 1.0], (1,): [2.0, 3.0]}
    >>> {c: v.tolist() for c, v in scatter(t, (2,), "P").items()}
    {(0,): [0.0, 1.0, 2.0, 3.0], (1,): [0.0, 0.0, 0.0, 0.0]}
    """
    mshape = as_mesh_shape(mesh_shape)
    shape = tuple(global_tensor.shape)
    pls = normalize(placements, len(shape), len(mshape))
    gen = parts if isinstance(parts, torch.Generator) or parts is None else torch.Generator().manual_seed(parts)
    out: Locals = {}

    def rec(coord: list[int], value: torch.Tensor) -> None:
        axis = len(coord)
        if axis == len(mshape):
            c = tuple(coord)
            out[c] = value[_slices(block(shape, mshape, pls, c))].clone()
            return
        p = pls[axis]
        pieces = _decompose(value, p.op, mshape[axis], gen) if isinstance(p, Partial) else [value] * mshape[axis]
        for i, piece in enumerate(pieces):
            rec(coord + [i], piece)

    rec([], global_tensor)
    return out


def assemble(locals: Locals, mesh_shape: "DeviceMesh | Sequence[int]", placements,
             global_shape: Sequence[int]) -> torch.Tensor:
    """The logical tensor the locals represent (Split axes concatenated, Partial axes reduced).

    >>> import torch
    >>> assemble({(0,): torch.tensor([1, 5]), (1,): torch.tensor([4, 2])}, (2,), "P(max)", (2,))
    tensor([4, 5])
    """
    mshape = as_mesh_shape(mesh_shape)
    shape = check_global_shape(global_shape)
    pls = normalize(placements, len(shape), len(mshape))
    _check_locals(locals, mshape, pls, shape)
    values, mask = _combine(locals, mshape, pls, shape, (0,) * len(mshape), tuple(range(len(mshape))))
    if not bool(mask.all()):
        raise SimulationError(f"the locals of {pls} on mesh {mshape} do not cover the global shape {shape}")
    return values


def identity(op: str, dtype: torch.dtype) -> "int | float | bool":
    """The identity element of a reduction op for a dtype.

    >>> identity("sum", torch.float32), identity("min", torch.float32), identity("max", torch.int8)
    (0, inf, -128)
    """
    if op == "sum":
        return False if dtype == torch.bool else 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point:
        return float("inf") if op == "min" else float("-inf")
    if dtype.is_complex:
        raise ShapeError(f"P({op}) has no identity for complex dtype {dtype} (valid: real dtypes)")
    info = torch.iinfo(dtype)
    return info.max if op == "min" else info.min


# ---- one step --------------------------------------------------------------------------------------------
def _apply(step: Step, locals: Locals, mesh_shape: tuple[int, ...], global_shape: tuple[int, ...]) -> Locals:
    s, t = step.src, step.dst
    # a Partial axis that rides along unchanged keeps its contributions: it is not part of the group
    axes = tuple(a for a in step.axes if not (isinstance(s[a], Partial) and s[a] == t[a]))
    for a in axes:
        if isinstance(s[a], Partial) and isinstance(t[a], Partial):
            raise SimulationError(f"{step}: {s[a]!r} -> {t[a]!r} on axis {a} is not one move (reduce first)")
    if step.kind == "reduce_transfer":
        ops = {s[a].op for a in axes if isinstance(s[a], Partial)}
        if len(ops) != 1 or step.op not in (None, *ops) or any(isinstance(t[a], Partial) for a in axes):
            raise SimulationError(f"{step}: a reduce_transfer turns Partial axes of one op (got {sorted(ops)}) "
                                  f"into Split/Broadcast ones")
    to_partial = tuple(a for a in axes if isinstance(t[a], Partial) and not isinstance(s[a], Partial))
    if len(to_partial) > 1:
        raise SimulationError(f"{step}: more than one axis turns Partial in one step ({to_partial})")
    gather = tuple(a for a in axes if a not in to_partial)
    dtype = next(iter(locals.values())).dtype
    groups: dict[Coord, tuple[torch.Tensor, torch.Tensor]] = {}
    out: Locals = {}
    for c in _coords(mesh_shape):
        key = tuple(x for a, x in enumerate(c) if a not in gather)
        if key not in groups:
            groups[key] = _combine(locals, mesh_shape, s, global_shape, c, gather)
        values, mask = groups[key]
        sl = _slices(block(global_shape, mesh_shape, t, c))
        if not to_partial:
            if not bool(mask[sl].all()):
                raise SimulationError(f"{step}: coord {c} needs elements its group along axes {gather} does not hold")
            out[c] = values[sl].clone()
            continue
        a = to_partial[0]
        fill = identity(t[a].op, dtype)
        keep = not (isinstance(s[a], Broadcast) and t[a].op == "sum" and c[a] != 0)
        new = torch.full(block_shape(block(global_shape, mesh_shape, t, c)), fill, dtype=dtype)
        if keep:
            new = torch.where(mask[sl], values[sl], new)
        out[c] = new
    return out


def _combine(locals: Locals, mesh_shape: tuple[int, ...], state: tuple[Placement, ...],
             global_shape: tuple[int, ...], fixed: Coord, axes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The value of the group along `axes` through `fixed`, on global coordinates, and where it is defined."""
    dtype = next(iter(locals.values())).dtype

    def rec(coord: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k == len(axes):
            c = tuple(coord)
            sl = _slices(block(global_shape, mesh_shape, state, c))
            values = torch.zeros(global_shape, dtype=dtype)
            mask = torch.zeros(global_shape, dtype=torch.bool)
            values[sl] = locals[c]
            mask[sl] = True
            return values, mask
        a = axes[k]
        children = []
        for i in range(mesh_shape[a]):
            coord[a] = i
            children.append(rec(coord, k + 1))
        coord[a] = fixed[a]
        match state[a]:
            case Split():
                values, mask = children[0][0].clone(), children[0][1].clone()
                for v, m in children[1:]:
                    values[m] = v[m]
                    mask |= m
                return values, mask
            case Broadcast():
                v0, m0 = children[0]
                # replicas agree once reduced; an inner Partial axis outside the group may split them differently
                loose = any(isinstance(state[b], Partial) and b not in axes for b in range(a + 1, len(state)))
                for i, (v, m) in enumerate([] if loose else children[1:], 1):
                    if not torch.equal(m, m0) or not torch.equal(v[m], v0[m0]):
                        raise SimulationError(f"Broadcast replicas along axis {a} differ (coord {a}={i} vs 0, "
                                              f"state {state}, fixed coord {fixed})")
                return v0, m0
            case Partial(op=op):
                return _reduce(op, [v for v, _ in children]), children[0][1]
        raise AssertionError(state[a])  # pragma: no cover

    return rec(list(fixed), 0)


# ---- helpers ---------------------------------------------------------------------------------------------
def _reduce(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(tensors)
    match op:
        case "sum":
            return stacked.any(0) if stacked.dtype == torch.bool else stacked.sum(0).to(stacked.dtype)
        case "min":
            return stacked.amin(0)
        case "max":
            return stacked.amax(0)
    raise AssertionError(op)  # pragma: no cover


def _decompose(value: torch.Tensor, op: str, n: int, gen: Optional[torch.Generator]) -> list[torch.Tensor]:
    """`n` tensors whose op-reduction is exactly `value`."""
    if gen is None or n == 1 or value.dtype == torch.bool or value.numel() == 0:
        return [value] + [torch.full_like(value, identity(op, value.dtype)) for _ in range(n - 1)]
    noise = [torch.randint(0, 5, value.shape, generator=gen).to(value.dtype) for _ in range(n)]
    if op == "sum":
        rest = noise[1:]
        first = value - sum(rest) if rest else value
        return [first, *rest]
    # min: every part >= value, max: every part <= value; one random part per element is exactly value
    if op == "min":
        parts = [torch.where(value > _limit(value, "max") - 5, value, value + r) for r in noise]
    else:
        parts = [torch.where(value < _limit(value, "min") + 5, value, value - r) for r in noise]
    exact = torch.randint(0, n, value.shape, generator=gen)
    return [torch.where(exact == i, value, p) for i, p in enumerate(parts)]


def _limit(value: torch.Tensor, which: str) -> "int | float":
    if value.dtype.is_floating_point:
        return float("inf") if which == "max" else float("-inf")
    info = torch.iinfo(value.dtype)
    return info.max if which == "max" else info.min


def _check_locals(locals: Locals, mesh_shape: tuple[int, ...], pls: tuple[Placement, ...],
                  global_shape: tuple[int, ...]) -> None:
    coords = _coords(mesh_shape)
    if sorted(locals) != coords:
        raise ShapeError(f"locals must have one tensor per coord of mesh {mesh_shape}, got coords {sorted(locals)}")
    dtypes = {v.dtype for v in locals.values()}
    if len(dtypes) != 1:
        raise ShapeError(f"locals must share one dtype, got {sorted(map(str, dtypes))}")
    for c in coords:
        want = block_shape(block(global_shape, mesh_shape, pls, c))
        if tuple(locals[c].shape) != want:
            raise ShapeError(f"local at coord {c} has shape {tuple(locals[c].shape)}, but {pls} of global shape "
                             f"{global_shape} on mesh {mesh_shape} gives {want}")


def _coords(mesh_shape: tuple[int, ...]) -> list[Coord]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _slices(b: Block) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in b)
