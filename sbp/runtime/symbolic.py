"""Symbolic sizes: torch.compile with dynamic shapes (``dynamic=True``, ``torch._dynamo.mark_dynamic``).

Under dynamic shapes a global tensor's size may be a ``torch.SymInt`` (the batch of a compiled training
step). sbp's decisions -- plans, op signatures -- are made on the size's *hint* (the value of the example
the graph is traced with), and they stay valid for every value the size takes as long as no placement splits
that dim: a dim no placement splits is whole on every rank, so it only rides along. The executor then
runs the plan on a reduced problem (the symbolic dims moved behind the others as the *element* of each
position, `execute(..., elem=...)`): layout maths stays on ints, every buffer carries the symbolic dims as
trailing dims, and collectives split and join along the leading dim only.

A dim split alike in every state of a plan rides along too (`frozen_splits`: its pieces are expressions
of the size, with only its remainder by the pieces pinned), and a move that only cuts each rank's block
(``B -> S(0)``: `narrows`) cuts with symbolic bounds. Any other plan that moves a symbolic dim (``S(0) ->
B``) specializes it: ``int()`` of the size records a guard in dynamo's shape environment, the graph is
compiled for that size, and another size compiles again (as without this module).

>>> hint_shape((3, 4)), any_symbolic((3, 4))
((3, 4), False)
"""
from __future__ import annotations

import math
import sys
import weakref
from dataclasses import replace
from typing import Iterable, Sequence

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..values.layout import block, splitters
from ..values.placement import Broadcast, Partial, Placement, Split
from ..values.steps import Plan


def is_symbolic(n: object) -> bool:
    """Whether `n` is a size torch.compile keeps symbolic (a ``SymInt`` that is no constant).

    >>> is_symbolic(3)
    False
    """
    return isinstance(n, torch.SymInt) and n.node.maybe_as_int() is None


def any_symbolic(shape: Iterable[object]) -> bool:
    """Whether any size of `shape` is symbolic.

    >>> any_symbolic(torch.Size([2, 3]))
    False
    """
    for n in shape:   # a loop, not any(): eager code asks this of every shape it plans
        if type(n) is not int and is_symbolic(n):
            return True
    return False


def size_key(n: "int | torch.SymInt") -> object:
    """A hashable stand-in for a size, for dicts keyed by sizes: the int itself, or a symbolic size's
    expression in its shape environment (a SymInt does not hash).

    >>> size_key(3)
    3
    """
    if type(n) is int or not isinstance(n, torch.SymInt):
        return n
    value = n.node.maybe_as_int()
    return value if value is not None else (id(n.node.shape_env), n.node.expr)


class SizeMap:
    """A dict keyed by sizes that may be symbolic (`size_key`), whose lookups also find a size recorded as an
    expression that the guards since recorded make equal to the asked one (``s0 // 2`` recorded, ``1`` asked
    after torch guarded ``s0 // 2 == 1``, as it does for a size 1 a broadcast could read). The newest record
    that answers wins: a graph traced for a batch of 3 records its local batch ``s0 // 2`` where an earlier
    graph (a batch of 2) recorded the int 1, and the asked 1 must find the new record, not the stale one.
    A symbolic record answers only within its own shape environment (the graph it was traced in).

    >>> m = SizeMap()
    >>> m[3] = 6
    >>> m.get(3), m.get(4)
    (6, None)
    """

    __slots__ = ("_entries",)
    LIMIT = 64

    def __init__(self) -> None:
        self._entries: dict = {}   # size_key -> (size, value), oldest first

    def __setitem__(self, n: "int | torch.SymInt", value: object) -> None:
        key = size_key(n)
        entries = self._entries
        if key in entries:
            del entries[key]   # set again: it becomes the newest
        elif len(entries) >= self.LIMIT:
            del entries[next(iter(entries))]
        entries[key] = (n, value)

    def get(self, n: "int | torch.SymInt", default: object = None) -> object:
        """The value of the newest record for size `n`, else `default`."""
        key, env = size_key(n), None
        for k, (size, value) in reversed(self._entries.items()):
            if k == key:
                return value
            if type(size) is int or not is_symbolic(size):
                continue
            if env is None:   # (looked up once, and only past a symbolic record: eager lookups skip it)
                env = n.node.shape_env if isinstance(n, torch.SymInt) else _tracing_shape_env()
            if size.node.shape_env is env and statically_known_true(size == n):   # known equal: no guard added
                return value
        return default


def _tracing_shape_env() -> object:
    """The shape environment of the graph torch.compile is tracing, else None."""
    context = torch._guards.TracingContext.try_get()
    mode = getattr(context, "fake_mode", None) if context is not None else None
    return getattr(mode, "shape_env", None)


_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # graph tracer -> {expression: size}


def canonical(shape: Sequence["int | torch.SymInt"], known: Iterable[object] = ()) -> tuple:
    """`shape` with each symbolic size replaced by the first size of the same expression seen while
    tracing this graph (`known` first: the sizes a call was given).

    torch records how a size computed in Python is made lazily, as a chain back to the sizes it came
    from. A size handed from op to op through meta kernels (an output shape of torch's meta kernel, the
    next op's input: ``T + 1`` after a cat, ``T`` again after the slice in its backward) would grow that
    chain with every op, and recording a size deep in a long program then recurses past Python's limit.
    One object per expression ends the chain where the expression was first made.

    >>> canonical((4, 2), [4])   # ints, or no graph being traced: as they are
    (4, 2)
    """
    if not any_symbolic(shape):
        return tuple(shape)
    mode = get_proxy_mode()
    if mode is None:
        return tuple(shape)
    table = _SEEN.get(mode.tracer)
    if table is None:
        table = _SEEN[mode.tracer] = {}
    for n in known:
        if is_symbolic(n):
            table.setdefault(n.node.expr, n)
    return tuple(table.setdefault(n.node.expr, n) if is_symbolic(n) else n for n in shape)


def hint(n: "int | torch.SymInt") -> int:
    """The value `n` has in the example being traced (no guard is recorded); `n` itself for an int.

    >>> hint(5)
    5
    """
    if not isinstance(n, torch.SymInt):
        return int(n)
    value = n.node.maybe_as_int()
    if value is not None:
        return value
    if not n.node.has_hint():   # an unbacked size (data-dependent): nothing to plan on but a guard
        return int(n)
    return int(n.node.hint)


def hint_shape(shape: Sequence["int | torch.SymInt"]) -> tuple[int, ...]:
    """`shape` with every symbolic size replaced by its hint (what sbp plans and decides on).

    >>> hint_shape(torch.Size([2, 0]))
    (2, 0)
    """
    return tuple(hint(n) for n in shape)


def specialize(shape: Sequence["int | torch.SymInt"]) -> tuple[int, ...]:
    """`shape` as ints, recording a guard for each symbolic size (the graph then holds for this size only).

    >>> specialize((4, 2))
    (4, 2)
    """
    return tuple(int(n) for n in shape)


# the locals `untie_local_sizes` marked, with the mark each held before, until `forget_untied`
_UNTIED: list = []
_MARK = "_dynamo_propagated_dynamic_indices"


def untie_local_sizes(local: torch.Tensor) -> None:
    """Give each size of a global input's `local` a symbol of its own when torch.compile fakes it with
    ``dynamic=True`` (``GlobalTensor.__tensor_flatten__`` calls this; elsewhere it does nothing).

    Under ``dynamic=True`` torch gives equal sizes of a graph's inputs one symbol ("duck sizing"), decided
    per rank from that rank's values. A local's size then shares a symbol with any size that happens to be
    equal: rank 0's piece of 2 of a sequence of 3 with the batch of 2. Pinning the sequence (rank 1's piece
    of 1 is static: `pin_static_pieces`) then pins the batch on rank 0 only, and ranks that see different
    symbolic sizes decide ops differently: equal buffer sizes, different layouts, wrong values. A local size
    is related to the global sizes by sbp's own equations (`block_of`, `tie_local_sizes`), never by a
    coincidence of values: its dims are marked as torch marks a graph output's symbolic dims for the next
    graph (weakly dynamic, no guard), so each gets a symbol of its own; `forget_untied` takes the mark off
    again once the input is faked.

    >>> t = torch.ones(2, 3)
    >>> untie_local_sizes(t); forget_untied()   # outside torch.compile(dynamic=True): nothing to mark
    >>> hasattr(t, "_dynamo_propagated_dynamic_indices")
    False
    """
    config = sys.modules.get("torch._dynamo.config")
    if config is None or config.assume_static_by_default or type(local) is not torch.Tensor:
        return
    _UNTIED.append((local, local.__dict__.get(_MARK)))
    setattr(local, _MARK, set(range(local.dim())))


def forget_untied() -> None:
    """Take `untie_local_sizes`' marks off again (``GlobalTensor.__tensor_unflatten__``, once torch faked
    the input: the symbols are made); a mark torch had set before is put back.

    >>> forget_untied()
    """
    while _UNTIED:
        local, before = _UNTIED.pop()
        if before is None:
            local.__dict__.pop(_MARK, None)
        else:
            setattr(local, _MARK, before)


def tie_local_sizes(local_shape: Sequence["int | torch.SymInt"], shape: Sequence["int | torch.SymInt"],
                    pls: tuple) -> None:
    """Tell torch that each symbolic size of a traced input's local along a dim no placement of `pls` splits
    is the global size of `shape` there: torch then replaces the local's symbol by the global one everywhere.
    Left apart, a local size keeps a symbol of its own, which a compiled function's output can carry
    (``x.reshape(x.shape[0], -1)`` of a global input): its gradient's local then has a size in symbols the
    backward graph is not given, and inductor cannot compile it.

    >>> from sbp import S
    >>> tie_local_sizes((2, 3), (4, 3), (S(0),))   # ints: nothing to tell
    """
    for d, (n, m) in enumerate(zip(local_shape, shape)):
        if is_symbolic(n) and not splitters(pls, d):   # a whole dim: its local size is the global one
            torch._check(n == m)


def pin_static_pieces(shape: Sequence["int | torch.SymInt"], local_shape: Sequence["int | torch.SymInt"],
                      mesh_shape: tuple[int, ...], pls: tuple) -> tuple:
    """A traced global tensor's `shape` with each symbolic size whose local size is static pinned by a guard
    (``int()``: the graph then holds for that size only).

    torch.compile fakes a global input's local on its own: a local size of 0 or 1 is specialized (as any
    size-1 dim), and one that did not change keeps its value, while the global size is symbolic. The
    graph holds for that local size only, so for the global sizes that give it; but sbp computes pieces
    as expressions of the global size (`block_of`), and an op that compares them with the static local
    (a view of a batch of 2 that leaves each of 2 ranks one row) lets torch's guards solve for the global
    size and pin it wherever that op runs. Run in a backward that AOTAutograd traces, the pin changes the
    forward's outputs after torch counted their symbolic sizes: the compiled call then rebuilds an output
    from the wrong sizes (or its partitioner fails). Pinned here, where the input is made, the size is
    static from the start.

    A symbolic size that `pls` (the tensor's placements on a mesh of `mesh_shape`) split into `k` pieces is
    pinned too where some rank's piece is 0 or 1 (the size's hint is under 2 x `k`): torch specializes that rank's
    piece, so that rank pins the size while the others would keep it symbolic, and ranks that see different
    symbolic sizes decide ops differently -- different collectives, a hang or wrong values. Every rank
    computes the same from the global size, so every rank pins it.

    >>> from sbp import S
    >>> pin_static_pieces((4, 6), (2, 6), (2,), (S(0),))
    (4, 6)
    """
    parts = [math.prod(mesh_shape[a] for a in splitters(pls, d)) for d in range(len(shape))]
    return tuple(int(n) if is_symbolic(n) and (not is_symbolic(m) or (k > 1 and hint(n) < 2 * k)) else n
                 for n, m, k in zip(shape, local_shape, parts))


def dynamic_dims(shape: Sequence["int | torch.SymInt"]) -> tuple[int, ...]:
    """The dims of `shape` whose sizes are symbolic.

    >>> dynamic_dims((4, 2))
    ()
    """
    return tuple(d for d, n in enumerate(shape) if is_symbolic(n))


def splits_any(pls: Iterable[Placement], dims: Sequence[int]) -> bool:
    """Whether a placement of `pls` (normalised) splits one of `dims`.

    >>> from sbp import S, B
    >>> splits_any((S(0), B), (1,)), splits_any((S(0), B), (0,))
    (False, True)
    """
    return any(isinstance(p, Split) and p.dim in dims for p in pls)


def block_of(shape: Sequence["int | torch.SymInt"], mesh_shape: tuple[int, ...], pls: tuple[Placement, ...],
             coord: tuple[int, ...], cache: bool = True) -> tuple:
    """`sbp.values.layout.block` for a shape that may hold symbolic sizes: ranges are expressions of them.
    A split size's remainder by the parts is pinned (a guard: balanced pieces differ by one where it is
    not zero), so a graph holds for the sizes of one remainder class; the size itself stays symbolic.
    ``cache=False`` computes int sizes here too, not through the layout's cache (for code dynamo traces).

    >>> from sbp import S
    >>> block_of((4, 6), (2,), (S(1),), (1,)), block_of((4, 6), (2,), (S(1),), (1,), cache=False)
    (((0, 4), (3, 6)), ((0, 4), (3, 6)))
    """
    if cache and not any_symbolic(shape):
        try:
            return block(tuple(shape), mesh_shape, pls, coord)
        except TypeError:   # a SymInt a guard pinned to a constant: it does not hash
            return block(hint_shape(shape), mesh_shape, pls, coord)
    ranges = [(0, n) for n in shape]
    for axis, p in enumerate(pls):
        if isinstance(p, Split):
            lo, hi = ranges[p.dim]
            base, extra = (hi - lo) // mesh_shape[axis], int((hi - lo) % mesh_shape[axis])
            start = lo + coord[axis] * base + min(coord[axis], extra)
            ranges[p.dim] = (start, start + base + (1 if coord[axis] < extra else 0))
    return tuple(ranges)


def narrows(src: tuple[Placement, ...], dst: tuple[Placement, ...], ndim: int) -> bool:
    """Whether `src` -> `dst` (normalised) only narrows each rank's block: every mesh axis keeps its
    placement or goes from Broadcast to a split, and each dim's splitting axes in `src` come first (in
    order) among its axes in `dst`. Each rank then cuts its new block out of the one it holds, with no
    communication, and the cut's bounds are expressions of symbolic sizes (`narrow_block`).

    >>> from sbp import S, B, Partial
    >>> narrows((B,), (S(0),), 2), narrows((S(0), B), (S(0), S(0)), 2), narrows((B, S(0)), (S(0), S(0)), 2)
    (True, True, False)
    >>> narrows((S(1),), (S(0),), 2), narrows((Partial("sum"),), (S(0),), 2)
    (False, False)
    """
    if any(s != d and not (isinstance(s, Broadcast) and isinstance(d, Split)) for s, d in zip(src, dst)):
        return False
    for k in range(ndim):
        before = splitters(src, k)
        if splitters(dst, k)[:len(before)] != before:
            return False
    return True


def narrow_block(local: torch.Tensor, shape: Sequence["int | torch.SymInt"], mesh_shape: tuple[int, ...],
                 src: tuple[Placement, ...], dst: tuple[Placement, ...], coord: tuple[int, ...]) -> torch.Tensor:
    """This rank's block laid out as `dst`, cut from its block `local` laid out as `src` where `narrows(src,
    dst)`: the bounds are expressions of `shape`'s symbolic sizes (each split size's remainder pinned by a
    guard, `block_of`), so the graph holds for every size of that remainder class.

    >>> from sbp import S, B
    >>> narrow_block(torch.arange(6.), (6,), (2,), (B,), (S(0),), (1,)).tolist()
    [3.0, 4.0, 5.0]
    """
    have = block_of(shape, mesh_shape, src, coord, cache=False)
    want = block_of(shape, mesh_shape, dst, coord, cache=False)
    for d, ((lo, hi), (new_lo, new_hi)) in enumerate(zip(have, want)):
        if (lo, hi) != (new_lo, new_hi):
            local = local.narrow(d, new_lo - lo, new_hi - new_lo)
    return local


def frozen_splits(plan: Plan, dims: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """The dims of `dims` that every state of the plan splits alike (the same mesh axes), with those axes:
    no step moves them, so each rank keeps its piece of such a dim throughout.

    >>> import sbp
    >>> frozen_splits(sbp.plan((4, 6), (2, 2), "S(0), P(sum)", "S(0), B"), (0, 1))
    {0: (0,)}
    """
    states = [plan.src, plan.dst] + [pls for step in plan.steps for pls in (step.src, step.dst)]
    out = {}
    for d in dims:
        axes = {splitters(pls, d) for pls in states}
        if len(axes) == 1 and () not in axes:
            out[d] = axes.pop()
    return out


# the placements (source, target) on the axis of each step `runs_symbolically` accepts
_MOVES = {"all_gather": (Split, Broadcast), "reduce_scatter": (Partial, Split), "all_to_all": (Split, Split)}


def runs_symbolically(plan: Plan) -> bool:
    """Whether every step of `plan` reduces (``all_reduce``) or moves dims along one mesh axis that splits
    them innermost, the other axes unchanged: an ``all_gather`` ``S(d) -> B``, a ``reduce_scatter``
    ``P -> S(d)`` or an ``all_to_all`` ``S(a) -> S(b)``. Such steps run with the moved dims' sizes symbolic
    (`traced.run_symbolic_step`): the pieces along the axis are the balanced split of one range of each
    moved dim, whose length is an expression of the dim's size.

    >>> import sbp
    >>> [runs_symbolically(sbp.plan((8, 4), (2,), "S(0)", dst)) for dst in ("B", "S(1)")]
    [True, True]
    >>> runs_symbolically(sbp.plan((8, 8), (2, 2), "S(0), S(0)", "S(1), S(0)"))   # a transfer over both axes
    False

    An ``all_gather`` over several axes that split one dim innermost, in their order (``(S(0), S(0)) -> (B,
    B)``), runs symbolically too (`traced.run_symbolic_gather`).
    """
    return all(step_runs_symbolically(step) for step in plan.steps)


def step_runs_symbolically(step) -> bool:
    """`runs_symbolically` for one step of a plan."""
    if step.kind == "all_reduce":
        return True
    if step.kind == "all_gather" and len(step.axes) > 1:   # over several axes: their splits of one dim
        return _gathers_one_dim(step)
    if step.kind not in _MOVES or len(step.axes) != 1:
        return False
    (axis,) = step.axes
    if any(a != b for k, (a, b) in enumerate(zip(step.src, step.dst)) if k != axis):
        return False
    if not all(isinstance(p, kind) for p, kind in zip((step.src[axis], step.dst[axis]), _MOVES[step.kind])):
        return False
    for pls in (step.src, step.dst):   # the axis splits its dim innermost (last)
        if isinstance(pls[axis], Split) and splitters(pls, pls[axis].dim)[-1] != axis:
            return False
    return True


def _gathers_one_dim(step) -> bool:
    """Whether an all_gather over several axes takes one dim's innermost splits, in their order, to `B`."""
    first = step.src[step.axes[0]]
    if not isinstance(first, Split) or splitters(step.src, first.dim)[-len(step.axes):] != tuple(step.axes):
        return False
    return all((step.src[k], step.dst[k]) == (first, Broadcast()) if k in step.axes else step.src[k] == step.dst[k]
               for k in range(len(step.src)))


def moved_dims(plan: Plan, dims: Sequence[int]) -> list[int]:
    """The dims of `dims` that `plan` moves: split in some state it passes through, not alike in all.

    >>> import sbp
    >>> moved_dims(sbp.plan((4, 6), (2,), "S(0)", "B"), (0, 1))
    [0]
    >>> moved_dims(sbp.plan((4, 6), (2,), "S(1)", "S(1)"), (1,))
    []
    """
    split = split_dims(plan, dims)
    frozen = frozen_splits(plan, split)
    return [d for d in split if d not in frozen]


def split_dims(plan: Plan, dims: Sequence[int]) -> tuple[int, ...]:
    """The dims of `dims` that a state the plan passes through (its source, its target, each step's) splits.

    >>> import sbp
    >>> split_dims(sbp.plan((4, 6), (2,), "S(1)", "B"), (0, 1)), split_dims(sbp.plan((4, 6), (2,), "B", "S(0)"), (0,))
    ((1,), (0,))
    """
    states = [plan.src, plan.dst] + [pls for step in plan.steps for pls in (step.src, step.dst)]
    return tuple(d for d in dims if any(splits_any(pls, (d,)) for pls in states))


def without_dims(plan: Plan, dims: Sequence[int]) -> Plan:
    """`plan` for the tensor without `dims` (no step moves them: whole, or split alike in every state, see
    `frozen_splits`): its shape lacks them, every split dim after them is renumbered, and an axis splitting one
    of them is `B` (it splits nothing else). Run with those dims (each rank's pieces) as the trailing element
    of each position.

    >>> import sbp
    >>> p = without_dims(sbp.plan((4, 6), (2,), "S(1)", "B"), (0,))
    >>> p.global_shape, p.src, [s.kind for s in p.steps]
    ((6,), (S(0),), ['all_gather'])
    """
    gone = frozenset(dims)

    def dim(k: int) -> int:
        return k - sum(1 for d in gone if d < k)

    def pls(ps: tuple[Placement, ...]) -> tuple[Placement, ...]:
        return tuple((Broadcast() if p.dim in gone else Split(dim(p.dim))) if isinstance(p, Split) else p
                     for p in ps)

    steps = tuple(replace(s, src=pls(s.src), dst=pls(s.dst), dims=tuple(dim(k) for k in s.dims))
                  for s in plan.steps)
    shape = tuple(n for d, n in enumerate(plan.global_shape) if d not in gone)
    return replace(plan, global_shape=shape, src=pls(plan.src), dst=pls(plan.dst), steps=steps)


__all__ = ["is_symbolic", "any_symbolic", "size_key", "SizeMap", "canonical", "hint", "hint_shape", "specialize",
           "block_of", "narrows", "narrow_block", "frozen_splits", "dynamic_dims", "splits_any", "split_dims",
           "without_dims"]
