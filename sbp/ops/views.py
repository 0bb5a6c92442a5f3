"""View and shape ops: which splits survive a change of shape, and the local sizes on uneven shards.

A view keeps P(op) and B as they are. A split `S(d)` survives when dim d maps to one output dim:

================================  ===========================================================
op                                split S(d) becomes
================================  ===========================================================
transpose, permute, t             S(position of d in the output)
unsqueeze / squeeze               S(d shifted); a squeezed (size-1) dim must not be split
expand                            S(d shifted) unless d is broadcast (size 1 -> n): then B
slice, split, unbind, cat, stack  S(d') for d != the sliced / split / concatenated dim
select(dim, i)                    S(d') for d != dim; S(dim) -> P(sum): the owner selects, others 0
view / reshape / _unsafe_view     S(first non-trivial output dim of d's group) when every rank's
                                  block is the same contiguous run of elements before and after
================================  ===========================================================

The reshape test is exact, per coord, with layout maths (`regroup`): dims are grouped into runs whose
sizes multiply to the same number ((B, T, C) -> (B*T, C) groups B,T with B*T); a block is the same run on
both sides when its flattened (start, stop) range within the group agrees *and* is the balanced block
of the output's split. Merging dims after the split dim is local when the shards are even (rows 2,2 of
(4, 6) -> 12,12 of 24); splitting a split dim when the local sizes divide evenly (C split 6,6 -> (H=4, 3):
2,2 heads). When the blocks are runs in the same rank order but cut elsewhere (rows 3,2 of (5, 6) give
18,12 where S(0) of 30 is 15,15), the split survives and the view moves the elements whose rank changes
(`sbp.runtime.rows`). A block that is no single run is refused and the planner redistributes first (to the
cheapest layout the view accepts).

In-place views (``squeeze_``, ``t_``, ``transpose_``, ``detach_``, ...) have the composite rule
`INPLACE_VIEW`: the tensor becomes its out-of-place view, placed by that view's rule (`inplace_view`).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch

from ..runtime.buffers import group_coords
from ..runtime.rows import move_rows
from ..runtime.symbolic import block_of, hint_shape
from ..tensor.global_tensor import GlobalTensor, logical_strides, notes_of
from ..values.errors import ShapeError, torch_alike
from ..values.layout import block
from ..values.placement import Split
from .spec import (
    ANY,
    PMAX,
    PMIN,
    PSUM,
    B,
    Call,
    Choice,
    OpSpec,
    Rule,
    Sig,
    converts_parts,
    dims_of,
    no_signatures,
    splits,
)

aten = torch.ops.aten
PARTIALS = (PSUM, PMAX, PMIN)
_EMPTY = "empty"


def _keep_partials(n_in: int, n_out: int) -> list[Sig]:
    return [Sig((B,) * n_in, (B,) * n_out)] + [Sig((p,) * n_in, (p,) * n_out) for p in PARTIALS]


def _dim_map_sigs(spec: OpSpec, mapping: dict[int, int], n_out: Optional[int] = None) -> list[Sig]:
    """S(d) -> S(mapping[d]) for the mapped dims of input 0 (other inputs B), plus B and Partial."""
    n_out = len(spec.outputs) if n_out is None else n_out
    n_in = len(spec.inputs)
    sigs = [Sig((Split(d),) + (B,) * (n_in - 1), (Split(o),) * n_out) for d, o in mapping.items()]
    return sigs + _keep_partials(n_in, n_out)


# ---- view / reshape ---------------------------------------------------------------------------------------------
def view_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Runs of dims of shapes `a` and `b` (same numel) whose sizes multiply to the same number; one run of all
    dims when that numel is 0 (no element to line up).

    >>> view_groups((2, 3, 4), (6, 4))
    [([0, 1], [0]), ([2], [1])]
    >>> view_groups((12,), (3, 4))
    [([0], [0, 1])]
    >>> view_groups((3, 0), (0,))
    [([0, 1], [0])]

    Shapes of different numel are torch's error (a call a shape class took without torch's own check):

    >>> view_groups((10, 14), (120,))
    Traceback (most recent call last):
    ...
    sbp.values.errors.ShapeError: shape '[120]' is invalid for input of size 140
    """
    if math.prod(a) != math.prod(b):
        raise torch_alike(ShapeError, f"shape '{list(b)}' is invalid for input of size {math.prod(a)}", RuntimeError)
    if 0 in a or 0 in b:
        return [(list(range(len(a))), list(range(len(b))))]
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                gj.append(j)
                pb *= b[j]
                j += 1
        groups.append((gi, gj))
    groups += [([k], []) for k in range(i, len(a))] + [([], [k]) for k in range(j, len(b))]
    return groups


def _flat_range(ranges: list[tuple[int, int]], sizes: list[int]) -> Any:
    """The flattened [start, stop) of a block within a run of dims; None if not contiguous."""
    if any(hi <= lo for lo, hi in ranges):
        return _EMPTY
    q = next((k for k, (lo, hi) in enumerate(ranges) if hi - lo > 1), len(ranges))
    if any(ranges[k] != (0, sizes[k]) for k in range(q + 1, len(ranges))):
        return None
    start, stride = 0, 1
    for (lo, _), n in zip(reversed(ranges), reversed(sizes)):
        start += lo * stride
        stride *= n
    return start, start + math.prod(hi - lo for lo, hi in ranges)


def _view_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x, out = spec.inputs[0], spec.out
    n_in = len(spec.inputs)
    sigs = []
    if math.prod(x.shape) > 0:
        for gi, gj in view_groups(x.shape, out.shape):
            targets = [o for o in gj if out.shape[o] > 1]
            for d in gi:
                if x.shape[d] > 1 and targets:
                    sigs.append(Sig((Split(d),) + (B,) * (n_in - 1), (Split(targets[0]),)))
    return sigs + _keep_partials(n_in, 1)


def _view_check(spec: OpSpec, choice: Choice) -> bool:
    if not any(isinstance(p, Split) for p in choice.inputs[0]):
        return True
    return regroup(spec.inputs[0].shape, spec.out.shape, choice.inputs[0], choice.outputs[0], spec.mesh_shape) \
        is not False


@functools.lru_cache(maxsize=4096)
def regroup(shape: tuple[int, ...], out_shape: tuple[int, ...], src: tuple, dst: tuple,
            mesh_shape: tuple[int, ...]) -> Any:
    """How a view of `shape` laid out as `src` becomes `out_shape` laid out as `dst`, worked out per coord:
    None when every rank's block is the same run of elements before and after (a local view), False when
    a block is no contiguous run (the view is refused: the planner lays the input out anew first), or
    ``(group, axes)`` when one group of dims holds the same runs in the same member order but cut in other
    places (``(5, 10) -> (50,)`` with 5 split 3,2 over two ranks: rows 0-29 and 30-49 where the output's
    split puts 0-24 and 25-49): the view then moves the rows between the ranks along `axes`
    (`sbp.runtime.rows`), the exact elements whose owner changes.

    >>> from sbp import S
    >>> regroup((4, 6), (24,), (S(0),), (S(0),), (2,)), regroup((5, 6), (30,), (S(0),), (S(0),), (2,))
    (None, (0, (0,)))
    >>> regroup((4, 6), (24,), (S(1),), (S(0),), (2,))   # columns 0-2 of every row: no run
    False
    """
    groups = view_groups(shape, out_shape)
    moved = set()
    for coord in _coords(mesh_shape):
        bin_ = block(shape, mesh_shape, src, coord)
        bout = block(out_shape, mesh_shape, dst, coord)
        fin = [_flat_range([bin_[d] for d in gi], [shape[d] for d in gi]) for gi, _ in groups]
        fout = [_flat_range([bout[d] for d in gj], [out_shape[d] for d in gj]) for _, gj in groups]
        if _EMPTY in fin and _EMPTY in fout:
            continue   # nothing held before or after
        if None in fin or None in fout:
            return False
        moved.update(k for k, (a, b) in enumerate(zip(fin, fout)) if a != b)
    if not moved:
        return None
    if len(moved) > 1:
        return False
    (k,) = moved
    gi, gj = groups[k]
    axes = _splitting(src, gi)
    if axes != _splitting(dst, gj):
        return False
    return k, axes


def _splitting(pls: tuple, dims: list[int]) -> tuple[int, ...]:
    """The mesh axes whose placement splits one of `dims`."""
    return tuple(a for a, p in enumerate(pls) if isinstance(p, Split) and p.dim in dims)


def _coords(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    coords = [()]
    for n in mesh_shape:
        coords = [c + (i,) for c in coords for i in range(n)]
    return coords


def _run_view(call: Call) -> Any:
    local, shape = call.args[0], list(call.out_shape(0))
    spec, src, dst = call.spec, call.choice.inputs[0], call.choice.outputs[0]
    try:
        how = regroup(spec.inputs[0].shape, spec.out.shape, src, dst, spec.mesh_shape)
    except TypeError:   # a symbolic size does not hash
        how = _symbolic_regroup(call)
    if how:
        return _move_group_rows(call, local, how)
    try:
        return call.func(local, shape)
    except (RuntimeError, ValueError):  # a non-contiguous local block (e.g. after a transpose): copy, as
        return local.reshape(shape)     # reshape would (fake tensors, under torch.compile, raise ValueError)


def _symbolic_regroup(call: Call) -> Any:
    """`regroup` for symbolic sizes: worked out at their hints. Where the view is local there, a guard per
    run keeps the graph to the sizes where it stays local (equal runs before and after); moving rows holds
    for every size (the runs are expressions of the sizes)."""
    spec, src, dst = call.spec, call.choice.inputs[0], call.choice.outputs[0]
    shape, out_shape = hint_shape(spec.inputs[0].shape), hint_shape(spec.out.shape)
    how = regroup(shape, out_shape, src, dst, spec.mesh_shape)
    if how is not None:
        return how
    for k, (gi, gj) in enumerate(view_groups(shape, out_shape)):
        axes = _splitting(src, gi)
        if axes and any(h != w for h, w in zip(*_group_runs(call, gi, gj, axes))):   # records the guards
            return k, axes
    return None


def _group_runs(call: Call, gi: list[int], gj: list[int], axes: tuple[int, ...]) -> tuple[list, list]:
    """Every member's run of elements of one view group (input dims `gi`, output dims `gj`), before and
    after, for the members of this rank's group along `axes` in member order; ints, or expressions of
    symbolic sizes."""
    spec, mesh_shape = call.spec, call.spec.mesh_shape

    def runs(full: tuple, pls: tuple, dims: list[int]) -> list[tuple]:
        out = []
        for coord in group_coords(mesh_shape, axes, call.coord):
            b = block_of(full, mesh_shape, pls, coord)
            start, stride = 0, 1
            for d in reversed(dims):
                start, stride = start + b[d][0] * stride, stride * full[d]
            out.append((start, start + math.prod(b[d][1] - b[d][0] for d in dims)))
        return out

    return (runs(tuple(spec.inputs[0].shape), call.choice.inputs[0], gi),
            runs(tuple(spec.out.shape), call.choice.outputs[0], gj))


def _move_group_rows(call: Call, local: torch.Tensor, how: tuple) -> torch.Tensor:
    """A view whose group `how[0]` is cut in other places before and after (`regroup`): the group's dims of
    the local merged into one, its rows moved between the ranks along `how[1]` (`sbp.runtime.rows.move_rows`),
    then viewed as the output's local. Sizes may be symbolic: the runs are expressions of them."""
    k, axes = how
    spec = call.spec
    gi, gj = view_groups(hint_shape(spec.inputs[0].shape), hint_shape(spec.out.shape))[k]
    have, want = _group_runs(call, gi, gj, axes)
    me = call.mesh.group_index(call.coord, axes)
    at = gi[0]
    # (the group's length spelled out: -1 is ambiguous where a dim before it holds nothing here)
    rows = local.reshape(tuple(local.shape[:at]) + (math.prod(local.shape[d] for d in gi),) +
                         tuple(local.shape[gi[-1] + 1:]))
    if at:     # (no-op moves stay out of a traced graph: each op costs its tracing time)
        rows = rows.movedim(at, 0)
    moved = move_rows(rows, have, want, me, axes, call.mesh)
    # (rows-first is sbp's own order: the result is laid out as a view of a contiguous tensor would be, last
    # dim of stride 1, for ops that read strides -- view_as_complex of rotary embeddings)
    return (moved.movedim(0, at).contiguous() if at else moved).reshape(call.out_shape(0))


VIEW = Rule(_view_sigs, run=_run_view, check=_view_check,
            doc="S(d)->S(first output dim of d's group) when every block stays one contiguous run (runs cut "
                "elsewhere: rows moved between neighbours); B; P")


def _pad_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """`constant_pad_nd`: a split of a dim the pad leaves alone (pairs from the last dim) stays."""
    x, pad = spec.inputs[0], list(spec.arg("pad"))
    padded = {x.ndim - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    sigs = [Sig((Split(d),), (Split(d),)) for d in range(x.ndim) if d not in padded] + [Sig((B,), (B,))]
    if spec.arg("value", 0) == 0:
        sigs.append(Sig((PSUM,), (PSUM,)))   # zeros padded into every part add up to zeros
    return sigs


PAD = Rule(_pad_sigs, doc="S(d not padded)->S(d); B; P(sum)->P(sum) when the value is 0")


def _repeat_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """`repeat`: a split of a dim repeated once stays (shifted by the leading dims `repeats` adds)."""
    x, repeats = spec.inputs[0], list(spec.arg("repeats"))
    lead = len(repeats) - x.ndim
    sigs = [Sig((Split(d),), (Split(d + lead),)) for d in range(x.ndim) if repeats[d + lead] == 1]
    return sigs + [Sig((p,), (p,)) for p in (B,) + PARTIALS]   # copies of a part are parts of the copies


REPEAT = Rule(_repeat_sigs, doc="S(d repeated once)->S(d + added dims); B; P->P")


# ---- dim permutations and insertions -------------------------------------------------------------------------------
def _transpose_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    ndim = spec.inputs[0].ndim
    if spec.func is aten.t.default:
        perm = list(range(ndim))[::-1]
    elif spec.func is aten.permute.default:
        perm = [d % ndim for d in spec.arg("dims")]
    else:
        perm = list(range(ndim))
        if ndim:
            d0, d1 = spec.arg("dim0") % ndim, spec.arg("dim1") % ndim
            perm[d0], perm[d1] = perm[d1], perm[d0]
    return _dim_map_sigs(spec, {src: dst for dst, src in enumerate(perm)})


TRANSPOSE = Rule(_transpose_sigs, doc="S(d)->S(perm^-1(d)); B; P")


def _unsqueeze_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    ndim = spec.inputs[0].ndim
    at = spec.arg("dim") % (ndim + 1)
    return _dim_map_sigs(spec, {d: d + (d >= at) for d in range(ndim)})


UNSQUEEZE = Rule(_unsqueeze_sigs, doc="S(d)->S(d or d+1); B; P")


def _squeezed(spec: OpSpec) -> list[int]:
    x = spec.inputs[0]
    if spec.func is aten.squeeze.default:
        cand = range(x.ndim)
    else:
        dims = spec.arg("dim", spec.arg("dims"))
        # an empty dims list squeezes nothing (torch), where a reduction's [] means every dim
        cand = dims_of(dims, x.ndim) if x.ndim and dims != [] and dims != () else ()
    return [d for d in cand if x.shape[d] == 1]


def _squeeze_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    gone = _squeezed(spec)
    ndim = spec.inputs[0].ndim
    return _dim_map_sigs(spec, {d: d - sum(g < d for g in gone) for d in range(ndim) if d not in gone})


def _run_squeeze(call: Call) -> Any:
    return aten.squeeze.dims(call.args[0], _squeezed(call.spec))


SQUEEZE = Rule(_squeeze_sigs, run=_run_squeeze, doc="S(d)->S(d') for kept dims; squeezed dims must be whole")


def _expand_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x, out = spec.inputs[0], spec.out
    off = out.ndim - x.ndim
    return _dim_map_sigs(spec, {d: d + off for d in range(x.ndim) if x.shape[d] == out.shape[d + off]})


def _run_expand(call: Call) -> Any:
    return call.args[0].expand(call.out_shape(0))


EXPAND = Rule(_expand_sigs, run=_run_expand, doc="S(d)->S(d+new dims) for non-broadcast d; B; P")


# ---- slicing ---------------------------------------------------------------------------------------------------------
def _slice_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x = spec.inputs[0]
    dim = spec.arg("dim", 0) % x.ndim
    size = x.shape[dim]
    start, end, step = spec.arg("start"), spec.arg("end"), spec.arg("step", 1)
    whole = (start is None or start == 0 or start <= -size) and (end is None or end >= size) and step == 1
    return _dim_map_sigs(spec, {d: d for d in range(x.ndim) if d != dim or whole})


SLICE = Rule(_slice_sigs, doc="S(d != dim)->S(d) (any S for a whole-range slice); B; P")


def _select_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x = spec.inputs[0]
    dim = spec.arg("dim") % x.ndim
    sigs = _dim_map_sigs(spec, {d: d - (d > dim) for d in range(x.ndim) if d != dim})
    if x.dtype is not torch.bool:
        sigs.append(Sig((Split(dim),), (PSUM,)))  # the owner of the index selects, the others give zeros
    return sigs


def _run_select(call: Call) -> Any:
    x = call.args[0]
    meta = call.spec.inputs[0]
    dim = call.spec.arg("dim") % meta.ndim
    if not splits(call.choice.inputs[0], dim):
        return call.default()
    index = call.args[2] % meta.shape[dim]
    lo, hi = call.in_block(0)[dim]
    if lo <= index < hi:
        # a copy, not a view: writing through a Partial view must not reach the base on one rank only
        return aten.select.int(x, dim, index - lo).clone()
    return x.new_zeros(call.out_shape(0))


SELECT = Rule(_select_sigs, run=_run_select, doc="S(d != dim)->S(d'); S(dim)->P(sum) (owner selects); B; P")


def _split_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    x = spec.inputs[0]
    dim = spec.arg("dim", 0) % x.ndim
    drop = spec.func is aten.unbind.int
    return _dim_map_sigs(spec, {d: d - (drop and d > dim) for d in range(x.ndim) if d != dim})


SPLIT = Rule(_split_sigs, doc="S(d != dim)->S(d') on every piece; B; P")


def _cat_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    out = spec.out
    stack = spec.func is aten.stack.default
    dim = spec.arg("dim", 0) % out.ndim
    n = len(spec.inputs)
    sigs = []
    for d in range(out.ndim):
        if d == dim:
            continue
        src = d - (stack and d > dim)
        ins = tuple(Split(src) if t.ndim == out.ndim - stack else B for t in spec.inputs)
        sigs.append(Sig(ins, (Split(d),)))
    # cat promotes dtypes (int64 and float32 pieces give float32): a Partial passes where every piece's
    # parts survive the conversion to the result's dtype
    return sigs + [Sig((B,) * n, (B,))] + [Sig((p,) * n, (p,)) for p in PARTIALS
                                            if all(converts_parts(t, axis, p, out.dtype) for t in spec.inputs)]


CAT = Rule(_cat_sigs, doc="all S(d), d != dim -> S(d) (stack: shifted); all B; all P(op) -> P(op) (where each "
                          "piece's dtype conversion keeps it)")


# ---- backward of slicing --------------------------------------------------------------------------------------------
def _select_backward_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    g, out = spec.inputs[0], spec.out
    dim = spec.arg("dim") % out.ndim
    return [Sig((Split(d),), (Split(d + (d >= dim)),)) for d in range(g.ndim)] + \
        [Sig((B,), (B,)), Sig((PSUM,), (PSUM,))]


def _slice_backward_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    g, out = spec.inputs[0], spec.out
    dim = spec.arg("dim") % out.ndim
    whole = g.shape[dim] == out.shape[dim]   # the backward of a whole-range slice: any split stays
    return [Sig((Split(d),), (Split(d),)) for d in range(out.ndim) if d != dim or whole] + \
        [Sig((B,), (B,)), Sig((PSUM,), (PSUM,))]


def _run_with_local_sizes(call: Call) -> Any:
    """`select_backward` / `slice_backward`: `input_sizes` become this rank's local output shape."""
    args = list(call.args)
    args[1] = list(call.out_shape(0))
    return call.func(*args, **call.kwargs)


SELECT_BACKWARD = Rule(_select_backward_sigs, run=_run_with_local_sizes, doc="S(d)->S(d'); B; P(sum)")
SLICE_BACKWARD = Rule(_slice_backward_sigs, run=_run_with_local_sizes,
                      doc="S(d != dim)->S(d) (any S for a whole-range slice); B; P(sum)")


# ---- factories from a tensor, fills and copies -----------------------------------------------------------------------
def _like_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """`*_like`: the result keeps the input's splits; a Partial input gives a Broadcast result."""
    p = spec.inputs[0].placements[axis]
    out = B if not isinstance(p, Split) else p
    return [Sig((ANY,) + (B,) * (len(spec.inputs) - 1), (out,))]


LIKE = Rule(_like_sigs, doc="S->S, B->B, P->B (the value is the same everywhere)")


def _new_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    if tuple(spec.arg("size")) == spec.inputs[0].shape:   # same size: lay it out like the input
        return _like_sigs(spec, axis)
    return [Sig((ANY,) + (B,) * (len(spec.inputs) - 1), (B,))]


def _run_new(call: Call) -> Any:
    """`new_*(size)`: the local size of the chosen layout (a `new_empty_strided` gets contiguous strides)."""
    args = list(call.args)
    shape = call.out_shape(0)
    args[1] = list(shape)
    if call.func is aten.new_empty_strided.default:
        return aten.new_empty.default(args[0], list(shape), **call.kwargs)
    return call.func(*args, **call.kwargs)


NEW = Rule(_new_sigs, run=_run_new, doc="same size as the input: like `*_like`; otherwise B of the given size")


def _keep_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    p = spec.inputs[0].placements[axis]
    return [Sig((ANY,) + (B,) * (len(spec.inputs) - 1), (p,))]


def _run_fill(call: Call) -> Any:
    """`fill_`: under P(sum) only the coords that hold a Broadcast value's copy get it, others 0."""
    x = call.args[0]
    holds = all(c == 0 for p, c in zip(call.choice.outputs[0], call.coord) if p == PSUM)
    if holds:
        return call.default()
    return x.zero_()


FILL = Rule(_keep_sigs, run=_run_fill, doc="keeps placements; P(sum): value on coord 0 of the axis, 0 elsewhere")
ZERO = Rule(_keep_sigs, doc="keeps placements (zeros are valid under every placement)")


def _copy_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    """`dst.copy_(src)`: src is laid out like dst, and the local copy converts it to dst's dtype. Where dst
    is Partial and converting src's parts one by one would not give parts of the converted value (float64
    P(sum) parts 0.6 + 0.6 truncated to int64 give 0, not 1; an S -> P(min) fill of +inf gives INT64_MIN),
    src is written whole (B) into dst's local -- a Partial's local has the Broadcast shape -- and the
    write-back lays the result out as dst's Partial (`sbp.ops.apply`: B -> P is a local move)."""
    dst, src = spec.inputs[0], spec.inputs[1]
    rest = (B,) * (len(spec.inputs) - 2)
    p = dst.placements[axis]
    if isinstance(p, Split):
        k = p.dim - (dst.ndim - src.ndim)
        want = Split(k) if k >= 0 and src.shape[k] == dst.shape[p.dim] else B
    elif p in PARTIALS and not converts_parts(src, axis, p, dst.dtype):
        return [Sig((ANY, B) + rest, (B,))]
    else:
        want = p
    return [Sig((ANY, want) + rest, (p,))]


COPY = Rule(_copy_sigs, doc="dst keeps its placements; src is laid out like dst (into a Partial dst whose dtype "
                            "conversion would not keep the parts: written whole, then laid out as dst's Partial)")


def _full_sigs(spec: OpSpec, axis: int) -> list[Sig]:
    return [Sig((B,) * len(spec.inputs), (B,) * len(spec.outputs))]


FULL_NO_META = Rule(_full_sigs, meta=False, doc="B inputs (the op needs whole values, e.g. .item()); no warning")


# ---- in-place views ------------------------------------------------------------------------------------------
def inplace_view(func, args: tuple, kwargs: dict) -> Any:
    """``x.squeeze_(0)``, ``x.t_()``, ...: `x` becomes the out-of-place view (its rule places it): it takes
    that view's local, placements and global shape and strides, and stays the same Python object.
    (torch builds ``vector @ matrix`` with an in-place ``squeeze_``.)

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     x = sbp.distribute(torch.ones(1, 4, 2), mesh, "S(1)")
    ...     x.squeeze_(0).t_()
    ...     return tuple(x.shape), x.placements, tuple(x.local_shape)
    >>> sbp.testing.spmd(fn, (2,))[0]
    ((2, 4), (S(1),), (2, 2))
    """
    x = args[0]
    view = getattr(aten, func._schema.name.split("::")[-1][:-1])(*args, **kwargs)
    if not isinstance(x, GlobalTensor) or not isinstance(view, GlobalTensor):
        return NotImplemented
    strides = logical_strides(view)   # worked out from x as it was, before x changes
    d = x.__dict__
    d["_local"], d["_placements"], d["_key"] = view._local, view._placements, None   # another spec now
    notes = notes_of(x)
    notes.view = None                  # no longer made by a view op: its strides are set
    notes.strides = strides
    with torch.utils._mode_utils.no_dispatch():   # the wrapper's own sizes, as torch changes a subclass's
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            aten.as_strided_.default(x, view.shape, view.stride(), 0)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)
    return x



INPLACE_VIEW = Rule(no_signatures, composite=inplace_view,
                    doc="the out-of-place view's rule; the tensor takes that view's local, placements and shape")
