"""Ops on global tensors with symbolic sizes (torch.compile with dynamic shapes; `sbp.runtime.symbolic`).

A call whose global shapes (or size arguments) hold ``torch.SymInt`` sizes cannot be keyed by its sizes.
It is keyed by its *shape class* instead (`sbp.ops.dispatch.class_key`: each symbolic size is a symbol of
its own), and the class must be shown generic: two cold decisions at made-up sizes (each symbol at its hint
plus a distinct large multiple of the rank count, so no two symbols and no constant coincide) make the same
choice, and the output sizes follow the symbols (`sbp.ops.decide.DecisionClass`). The call then runs the
class's decision with its own (symbolic) spec, so one graph serves every value the sizes take. A class
whose output sizes no symbol gives (``x[:, :-1]``, a cat) is *shaped* when both cold decisions make the same
choice (one that is not free must also be the choice at the call's hint sizes): the call runs that choice
with the output sizes torch's meta kernels give for its symbolic shapes. A choice that moves a symbolic dim is
taken only where every choice does, and only by steps that keep the size symbolic (gathers, reduce-scatters,
all_to_alls along one axis: `sbp.runtime.symbolic.runs_symbolically`; cutting each rank's block, `narrows`,
moves nothing). A decision that moves one otherwise, or a class that is neither generic nor shaped (a
fallback, a choice that differs), specializes the call instead: its symbolic sizes are pinned by guards (the
graph then holds for those sizes), and it is decided as any call with int sizes -- or, where only some symbols
break the made-up sizes or change the choice, those alone are pinned and the call is tried again (a call whose
global inputs are all Broadcast is decided at its hint sizes instead: nothing moves at any size; one whose
symbols torch's guards tie to each other, a view input's replay, at made-up sizes that keep the ties). Made-up
sizes break a call where deciding it there fails (whatever torch or sbp raises) or gives output sizes other
than torch's symbolic ones taken at those sizes (they lie outside torch's guards: a slice bound that is a
symbol of its own, moved past the end of a static dim). A symbolic float argument is pinned alone.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..runtime import symbolic
from ..tensor.global_tensor import GlobalTensor
from ..values.errors import SbpError
from ..values.layout import splitters
from ..values.placement import Broadcast
from .cache import DECISIONS
from .decide import (
    KEEP_SIZES,
    MADE_UP,
    Decision,
    DecisionClass,
    decide,
    free,
    instantiate_shaped,
    instantiate_symbolic,
    keeps_dims,
    meta_outputs,
    size_arguments,
)

_OFFSET = 1009   # made-up sizes: hint + rank count x _OFFSET x (symbol number + 1) x (1 or 2)
_MOST_ELEMENTS = 1 << 60   # a tensor at made-up sizes with more elements (or bytes past int64) breaks the call


def has_symbolic(args: tuple, kwargs: dict, leaves: list, pinned: bool = False) -> bool:
    """Whether a call has a symbolic size: in a tensor's shape or among its arguments (with `pinned`, also
    a ``SymInt`` a guard has pinned to a constant: it does not hash either).

    >>> has_symbolic((torch.ones(2), 3), {}, [torch.ones(2)])
    False
    """
    test = (lambda n: isinstance(n, torch.SymInt)) if pinned else symbolic.is_symbolic
    if any(any(map(test, t.shape)) for t in leaves if isinstance(t, torch.Tensor)):
        return True
    return any(map(test, _scalars(args))) or any(map(test, _scalars(tuple(kwargs.values()))))


def _scalars(a: Any, kind: type = torch.SymInt):
    """The `kind` scalars (``torch.SymInt`` or ``torch.SymFloat``) among `a`, lists and tuples opened."""
    for x in a:
        if type(x) is list or type(x) is tuple:
            yield from _scalars(x, kind)
        elif isinstance(x, kind):
            yield x


def _call_sizes(values: list, args: tuple, kwargs: dict) -> list:
    """A call's class values and the symbolic sizes among its arguments (their symbols are made up too)."""
    return values + list(_scalars(args)) + list(_scalars(tuple(kwargs.values())))


def handle_symbolic(func, args: tuple, kwargs: dict, leaves: list, mesh, class_key, retry: bool = True) -> Any:
    """Run one op call with symbolic sizes (see the module's text); `leaves` as `sbp.ops.dispatch.handle`
    collects them, `class_key` its shape-class key (`sbp.ops.dispatch.class_key`)."""
    outputs = _torch_guards(func, args, kwargs)
    if not has_symbolic(args, kwargs, leaves):   # torch pinned every symbolic size itself
        return _specialized(func, args, kwargs, leaves, mesh)
    if any(_scalars(args, torch.SymFloat)) or any(_scalars(tuple(kwargs.values()), torch.SymFloat)):
        # a symbolic float (attention's scale of a symbolic head dim) is pinned by a guard; the sizes may stay
        args, kwargs = _pin_floats(args), {k: _pin_floats((v,))[0] for k, v in kwargs.items()}
        if not has_symbolic(args, kwargs, leaves):
            return _specialized(func, args, kwargs, leaves, mesh)
    try:
        key, values = class_key(func, args, kwargs, tuple(mesh.shape))
    except TypeError:   # a symbolic bool
        return _specialized(func, args, kwargs, leaves, mesh)
    # which sizes are symbolic is part of the class: a size a guard pinned keys as its symbol did, and an
    # eager class's sizes may coincide (a split's piece of 4 of a batch of 4 reads as the batch); the static
    # sizes are too, by value: a class is decided at made-up values of the symbolic ones only, so one made for
    # 4 heads of 12 (48 features) is not the class of 2 heads of 12 (24: one head a rank on 2)
    key = (key, tuple(None if symbolic.is_symbolic(v) else int(v) for v in values))
    record = DECISIONS.class_get(key)
    if record is None or record.state in ("candidate", "priced?", "shaped?"):   # not yet shown: decide cold
        record = _decide_class(func, args, kwargs, mesh, key, values, record, outputs)
    decision = None
    if record is not None and record.state in ("generic", "priced"):
        decision = instantiate_symbolic(record, func, args, kwargs, leaves, mesh, values)
        if decision is not None and not _fits(decision, outputs):   # the class's formula is not this call's
            record = None   # (``x[:, 0:6:k]`` with a symbolic step k: 1 column at both made-up k)
    if record is None:   # made-up sizes break the call's constants: pin the symbols that do, if not all
        decision = _replicated(func, args, kwargs, leaves, mesh, outputs)
        if decision is None:
            decision = _related(func, args, kwargs, leaves, mesh, key, values, outputs)
        if decision is not None:
            return decision.execute(func, args, kwargs, leaves)
        if retry and _pin_breaking(func, args, kwargs, mesh, values, outputs):
            return handle_symbolic(func, args, kwargs, leaves, mesh, class_key, retry=False)
        return _specialized(func, args, kwargs, leaves, mesh)
    if record.state == "exact" and retry and not record.decision.fallback \
            and _pin_breaking(func, args, kwargs, mesh, values, outputs, compare=True):   # a choice some symbols
        return handle_symbolic(func, args, kwargs, leaves, mesh, class_key, retry=False)   # change (a split's pieces)
    if record.state == "shaped" and outputs is not None and len(outputs) == len(record.decision.spec.outputs) \
            and (record.free or _at_hints(func, args, kwargs, mesh).choice == record.decision.choice):
        decision = instantiate_shaped(record.decision, record.sized, args, kwargs, leaves,
                                      _output_shapes(outputs, leaves, values))
    if decision is not None and keeps_symbolic_splits(decision):
        return decision.execute(func, args, kwargs, leaves)
    return _specialized(func, args, kwargs, leaves, mesh)


def _output_shapes(outputs: tuple, leaves: list, values: list) -> tuple:
    """The shapes of torch's meta `outputs` for a call, in the symbols of its inputs and sizes."""
    known = [n for t in leaves if isinstance(t, torch.Tensor) for n in t.shape] + values
    return tuple(None if meta is None else symbolic.canonical(meta.shape, known) for meta in outputs)


def _replicated(func, args: tuple, kwargs: dict, leaves: list, mesh, outputs: Optional[tuple]) -> Optional[Decision]:
    """The decision of a call whose made-up sizes break it (``base.view(B, T, 8)`` of a symbolic (B x T, 8),
    torch.compile's replay of a view input: the view's sizes are symbols of their own, tied to the base's
    by torch's guards only) where every global input is Broadcast on every axis: its choice at its hint
    sizes if nothing moves and every output is Broadcast -- each rank runs torch's op on whole tensors,
    at any sizes torch's guards admit -- with torch's symbolic output sizes; else None. An op with a size
    argument (a view) keeps the sizes it was given, not those torch's meta kernel derives from them (T as
    rows // B): the replay's check ties the given symbols to the input's, and no guard is left that names
    a symbol of the replay alone (dynamo could not write it)."""
    if outputs is None or any(isinstance(t, GlobalTensor) and any(type(p) is not Broadcast for p in t._placements)
                              for t in leaves):
        return None
    try:
        made = _at_hints(func, args, kwargs, mesh)
    except Exception:   # noqa: BLE001 -- left to the pinned decision, which raises it as eagerly
        return None
    if made.fallback or len(outputs) != len(made.spec.outputs) or not free(made) \
            or any(type(p) is not Broadcast for pls in made.choice.outputs for p in pls):
        return None
    sized = size_arguments(func)
    shapes = _output_shapes(outputs, leaves, _call_sizes([], args, kwargs))
    given = [args[i] if i < len(args) else kwargs.get(name) for i, name in sized]
    if len(shapes) == 1 and len(given) == 1 and _gives_shape(given[0], shapes[0]):
        shapes = (tuple(n if _inferred(g) else g for n, g in zip(shapes[0], given[0])),)
    return instantiate_shaped(made, sized, args, kwargs, leaves, shapes)


def _inferred(g: Any) -> bool:
    """A size argument's -1: torch's size (a view's inferred dim, expand's kept one)."""
    return isinstance(g, int) and g == -1


def _gives_shape(given: Any, shape: tuple) -> bool:
    """Whether a size argument is the output's `shape` (a view's; not affine_grid's), -1 where torch infers."""
    return isinstance(given, (list, tuple)) and len(given) == len(shape) and \
        all(_inferred(g) or symbolic.hint(g) == symbolic.hint(n) for n, g in zip(shape, given))


def _decide_class(func, args: tuple, kwargs: dict, mesh, key, values: list, record: Optional[DecisionClass],
                  outputs: Optional[tuple] = None, tied: Optional[dict] = None) -> Optional[DecisionClass]:
    """The call's class record after two cold decisions at made-up sizes (each symbol at its hint plus a
    distinct large multiple of the rank count), kept under `key`; None where made-up sizes break what the
    call's constants hold (``x.view(30, 8)`` of a symbolic (B, T, 8); a static plain tensor's size that a
    guard ties the symbols to: cross-entropy's targets of (B x T) logits).

    Any error of a decision at made-up sizes means they break the call, whatever torch raises for it (a
    `sbp.SbpError` from sbp's checks, or torch's own: its Python decompositions refuse with an
    ``AssertionError``): the caller pins the symbols that break it, or all, and decides at the call's hint
    sizes, where an error that is the user's is raised as it is eagerly. So does a decision whose output
    sizes are not those torch's meta kernels gave for the call's symbolic shapes (`outputs`), taken at the
    made-up sizes (`_fits`). With `tied` (`_ties`: symbols torch's guards give as expressions of the others),
    those symbols take their expressions' values at the others' made-up sizes.
    """
    m = math.prod(mesh.shape)
    symbols = _symbols(_call_sizes(values, args, kwargs))
    for k in (1, 2):
        assign = _made_up(symbols, m, k, tied)
        if assign is None:
            return None
        token = KEEP_SIZES.set(frozenset(assign.values()))   # a choice that moves a symbolic dim would pin it:
        try:                                                  # the cheapest that moves none, where one fits
            made = _decide_made_up(func, args, kwargs, mesh, assign)
        except Exception:   # noqa: BLE001 -- any failure at made-up sizes: they break the call (see the docstring)
            return None
        finally:
            KEEP_SIZES.reset(token)
        if not _fits(made, outputs, assign):
            return None
        ints = [_value(v, assign) for v in values]
        if record is None:
            record = DecisionClass(made, ints)
            DECISIONS.class_put(key, record)
        else:
            record.confirm(made, ints)
    return record


def _without_size_factors(diff: Any, own: set) -> Any:
    """`diff` (0 by a guard) without its factors that are powers of the call's own size symbols: a size is at
    least 1, so the rest is 0 -- ``T*B - T*B'`` (logits of (B x T) rows against targets of (B' x T) with T
    symbolic too) ties B' to B as ``8*B - 8*B'`` would.

    >>> import sympy
    >>> b, c, t = sympy.symbols("b c t", positive=True, integer=True)
    >>> _without_size_factors(t * b - t * c, {b, c, t})
    b - c
    """
    import sympy

    factored = sympy.factor(diff)
    if not isinstance(factored, sympy.Mul):
        return diff
    kept = [a for a in factored.args
            if not (a.free_symbols and a.free_symbols <= own
                    and (a.is_Symbol or (a.is_Pow and a.base.is_Symbol and a.exp.is_Integer and a.exp > 0)))]
    return sympy.expand(sympy.Mul(*kept)) if len(kept) < len(factored.args) else diff


def _made_up(symbols: list, m: int, k: int, tied: Optional[dict] = None) -> Optional[dict]:
    """The made-up sizes of `symbols` ((symbol, hint) pairs, `_symbols`) for the `k`-th cold decision: each
    at its hint plus a distinct large multiple of the rank count `m`; with `tied`, a tied symbol at its
    expression's value (None where that is no integer)."""
    import sympy

    assign = {s: h + m * _OFFSET * (j + 1) * k for j, (s, h) in enumerate(symbols) if not tied or s not in tied}
    for s, expr in (tied or {}).items():
        value = sympy.sympify(expr.xreplace(assign))   # (a bare symbol's value comes back an int)
        if not value.is_Integer:
            return None
        assign[s] = int(value)
    return assign


def _related(func, args: tuple, kwargs: dict, leaves: list, mesh, key, values: list,
             outputs: Optional[tuple]) -> Optional[Decision]:
    """The decision of a call whose made-up sizes break it because torch's guards tie its symbols to each
    other (torch.compile's replay of a view input ``base.view(B, T, 8)`` of a symbolic (R, 8): the view's
    sizes are symbols of their own, and torch's check of the view guarded ``8 * R == B * T * 8``): the
    call's class decided at made-up sizes that keep the ties (`_ties`: R at B x T), kept under the class key
    and the ties, if that class is generic or priced, its decision fits torch's output sizes and moves no
    symbolic dim (a split batch kept on its axis: its remainder is pinned, as for any call); else None.

    Also None where one symbol of the replay's own stands for two sizes (`_duck_sized_replay`), and where the
    decision's choice differs from the one at the call's hint sizes: each rank reads its own guards (a rank
    whose local size is pinned holds one more), so a rank that declines here decides at the hints, and every
    rank's graph must hold the same collectives."""
    if _duck_sized_replay(list(_scalars(args)) + list(_scalars(tuple(kwargs.values())))):
        return None
    found = _ties(_call_sizes(values, args, kwargs), math.prod(mesh.shape))
    if found is None:
        return None
    tied, ties = found
    key = (key, ties)
    record = DECISIONS.class_get(key)
    if record is None or record.state in ("candidate", "priced?", "shaped?"):
        record = _decide_class(func, args, kwargs, mesh, key, values, record, outputs, tied)
    if record is None or record.state not in ("generic", "priced"):
        return None
    decision = instantiate_symbolic(record, func, args, kwargs, leaves, mesh, values)
    if decision is None or not _fits(decision, outputs):
        return None
    pins = _split_sizes(decision)
    if pins is None:
        return None
    try:
        if _at_hints(func, args, kwargs, mesh).choice != decision.choice:
            return None
    except Exception:   # noqa: BLE001 -- the caller decides it at the hints, where the user's error is raised
        return None
    _pin_remainders(pins)
    return decision


def _duck_sized_replay(values: list) -> bool:
    """Whether one symbol of a view replay's own (ephemeral sources only: no input of the graph gives it)
    stands for two of the call's size arguments `values`: torch gave the replay's equal sizes one symbol
    (``base.view(6, 6, 8)``), where the graph's input has one per dim. A remainder pinned on it is a guard
    dynamo cannot write (an IndexError as it builds the guards)."""
    seen = set()
    for n in values:
        if symbolic.is_symbolic(n) and n.node.expr.is_Symbol:
            s, env = n.node.expr, n.node.shape_env
            if s in seen and not any(not src.is_ephemeral() for src in env.var_to_sources.get(s, ())):
                return True
            seen.add(s)
    return False


def _ties(sizes: list, m: int) -> Optional[tuple[dict, tuple]]:
    """The symbols of a call's symbolic `sizes` that torch's equality guards give as expressions of its
    other symbols -- each solved from a guard linear in it with an integer coefficient (``8 * R == B * T *
    8`` gives R = B x T; torch's other guards of the view, ``T == R // B`` and ``R % B == 0``, then hold) --
    and those ties in the call's symbol numbers (part of its class key). None where no guard ties them, or
    where some guard on the call's symbols does not hold at the made-up sizes that keep the ties (a tie
    only a floor division or a remainder gives, which is not solved).

    Only guards on the call's symbols alone are read (torch's ``shape_env.guards``, with its replacements);
    nothing is recorded."""
    import sympy

    symbols = _symbols(sizes)
    if len(symbols) < 2:
        return None
    env = next(n.node.shape_env for n in sizes if symbolic.is_symbolic(n))
    own = {s for s, _ in symbols}
    guards = []
    for g in env.guards:   # each with torch's replacements (a view's static size: a symbol torch set to 8)
        if g.expr.free_symbols & own:
            expr = env.replace(g.expr)
            if expr.free_symbols and expr.free_symbols <= own:
                guards.append(expr)
    tied: dict = {}
    for g in guards:
        if not isinstance(g, sympy.Eq) or len(g.free_symbols) < 2:
            continue
        diff = _without_size_factors(sympy.expand((g.lhs - g.rhs).xreplace(tied)), own)
        for s, _ in symbols:   # the first symbol the guard is linear in (the view's base before its sizes)
            if s in tied or s not in diff.free_symbols:
                continue
            try:
                c = diff.diff(s)
            except Exception:   # noqa: BLE001 -- torch's own functions (FloorDiv, Mod) of s
                continue
            if not c.is_Integer or c == 0:
                continue
            solved = sympy.expand(s - diff / c)
            if s in solved.free_symbols or not _integral(solved):
                continue
            tied = {t: sympy.expand(e.xreplace({s: solved})) for t, e in tied.items()}
            tied[s] = solved
            break
    if not tied:
        return None
    for k in (1, 2):   # the made-up sizes `_decide_class` takes must keep every guard on the call's symbols
        assign = _made_up(symbols, m, k, tied)
        if assign is None or any(a <= 0 for a in assign.values()):
            return None
        for g in guards:
            try:
                if not bool(g.xreplace(assign)):
                    return None
            except TypeError:
                return None
    number = {s: sympy.Symbol(f"s{j}") for j, (s, _) in enumerate(symbols)}
    ties = tuple(sorted((str(number[s]), str(e.xreplace(number))) for s, e in tied.items()))
    return tied, ties


def _integral(expr) -> bool:
    """Whether `expr` is a polynomial in its symbols with integer coefficients (an integer at integers)."""
    import sympy

    if not expr.free_symbols:
        return expr.is_Integer
    try:
        return all(a.is_Integer for a in sympy.Poly(expr, *sorted(expr.free_symbols, key=str)).coeffs())
    except sympy.PolynomialError:   # torch's FloorDiv, Mod of a symbol
        return False


def _pin_breaking(func, args: tuple, kwargs: dict, mesh, values: list, outputs: Optional[tuple] = None,
                  compare: bool = False) -> bool:
    """Pin (by guards) each symbol whose made-up size alone, the others at their hints, breaks the call
    (``x.view(B, 3, 2, 8)`` of a symbolic (B, T, 8): torch checks ``T == 6`` at run time without pinning
    it, so T breaks and B does not; a slice bound of its own, which the made-up value moves past the
    end of the dim: `_fits` with torch's symbolic `outputs`) or, with `compare`, changes its choice from the
    one at the hints (``x.split(4, 1)``: T sets the number of pieces). Whether some but not all symbols
    were pinned."""
    sizes = _call_sizes(values, args, kwargs)
    symbols = _symbols(sizes)
    hints = dict(symbols)
    try:
        choice = _at_hints(func, args, kwargs, mesh).choice if compare else None
    except SbpError:
        return False
    breaking = []
    for j, (s, h) in enumerate(symbols):
        assign = dict(hints)
        assign[s] = h + math.prod(mesh.shape) * _OFFSET * (j + 1)
        try:
            made = _decide_made_up(func, args, kwargs, mesh, assign)
        except Exception:   # noqa: BLE001 -- as in `_decide_class`
            breaking.append(s)
            continue
        if (compare and made.choice != choice) or not _fits(made, outputs, assign):
            breaking.append(s)
    if not breaking or len(breaking) == len(symbols):
        return False
    for n in sizes:
        if symbolic.is_symbolic(n) and any(s in n.node.expr.free_symbols for s in breaking):
            int(n)   # records the guard that pins it
    return True


def _fits(made: Decision, outputs: Optional[tuple], assign: Optional[dict] = None) -> bool:
    """Whether `made`'s output sizes are those torch's meta kernels gave for the call's symbolic shapes
    (`outputs`, `_torch_guards`), with each symbol at its value in `assign` (made-up sizes) or, without it,
    at its hint (`made` is the call's own decision).

    Where they differ, the made-up sizes lie outside what torch's guards on the call hold, and the
    decision is of no call the graph can take: ``x[:, a:b]`` with bounds that are symbols of their own (a
    view input's bounds, replayed by torch.compile on the fake base) moves them past the end of a static
    dim, and the slice comes out empty at every made-up size -- a class whose formula gave every call of
    it an empty dim. At the hints it catches a class that two made-up calls misjudge though they fit: a
    symbolic step k of ``x[:, 0:6:k]`` gives 1 column at both made-up values of k, a constant to the class.
    A size torch's expression does not give at `assign` (a symbol of no size) is not compared; nor is
    anything where torch gave no outputs or `made` is a fallback.
    """
    if outputs is None or made.fallback:
        return True
    for meta, torch_meta in zip(made.spec.outputs, outputs):
        if meta is None or torch_meta is None:
            continue
        if len(meta.shape) != len(torch_meta.shape):
            return False
        for n, want in zip(meta.shape, torch_meta.shape):
            if assign is None:
                n, want = symbolic.hint(n), symbolic.hint(want)
            elif symbolic.is_symbolic(want):
                try:
                    want = int(want.node.expr.xreplace(assign))
                except (TypeError, ValueError, ZeroDivisionError):   # symbols left, or no number there
                    continue
            if int(n) != int(want):
                return False
    return True


def _pin_floats(a: tuple) -> tuple:
    """`a` with each ``torch.SymFloat`` replaced by its value (``float()`` records the guard)."""
    return tuple(float(x) if isinstance(x, torch.SymFloat) else
                 type(x)(_pin_floats(x)) if type(x) is list or type(x) is tuple else x for x in a)


def _torch_guards(func, args: tuple, kwargs: dict) -> Optional[tuple]:
    """Run `func` on meta tensors of the call's (symbolic) global shapes: torch records the guards it would
    record for plain tensors (a linear's input features equal the weight's pin them), so only the sizes
    the op leaves free stay symbolic. Returns the outputs' metas, None on an error (left to the decision,
    which reports it on the global inputs)."""
    try:
        outputs = meta_outputs(func, args, kwargs)
    except Exception:   # noqa: BLE001 - deciding reports it
        return None
    return outputs


def keeps_symbolic_splits(decision: Decision) -> bool:
    """Whether `decision` moves no dim of symbolic size other than symbolically: each global input's symbolic
    dims are split by the same mesh axes in its placements and in its target (a redistribution that moves
    one would pin it), or the input's move only narrows each rank's block (`sbp.runtime.symbolic.narrows`:
    ``B -> S(0)``, cut with bounds in the symbolic sizes), or runs with its sizes symbolic (gathers,
    reduce-scatters and all_to_alls along one axis at a time: `sbp.runtime.symbolic.runs_symbolically`).

    A symbolic dim that some placement of the call splits gets its remainder by the pieces pinned by a guard
    here, so the checks of the chosen signature (which may depend on it: balanced pieces differ by one) hold
    for every size the graph takes.
    """
    pinned = _split_sizes(decision)
    if pinned is None:
        return False
    _pin_remainders(pinned)
    return True


def _split_sizes(decision: Decision) -> Optional[list[tuple[Any, int]]]:
    """(symbolic size, pieces) of each dim of symbolic size that `decision`'s placements split, or None
    where the decision moves one other than symbolically (`keeps_symbolic_splits`, `keeps_dims`)."""
    spec, choice = decision.spec, decision.choice
    if not keeps_dims(spec, choice, symbolic.is_symbolic, moving=True):
        return None
    pinned = []   # (size, parts)
    for meta, target in zip(spec.inputs, choice.inputs):
        if meta.is_global:
            pinned += [(meta.shape[d], _parts(spec.mesh_shape, target, d)) for d in symbolic.dynamic_dims(meta.shape)]
    for meta, pls in zip(spec.outputs, choice.outputs):
        if meta is not None:
            pinned += [(meta.shape[d], _parts(spec.mesh_shape, pls, d)) for d in symbolic.dynamic_dims(meta.shape)]
    return [(n, parts) for n, parts in pinned if parts > 1]


def _pin_remainders(pinned: list[tuple[Any, int]]) -> None:
    for n, parts in pinned:
        int(n % parts)   # a guard on the remainder only


def _parts(mesh_shape: tuple[int, ...], pls: tuple, dim: int) -> int:
    return math.prod(mesh_shape[a] for a in splitters(pls, dim))


def _at_hints(func, args: tuple, kwargs: dict, mesh) -> Decision:
    """The call decided cold at its sizes' hints (no guard recorded)."""
    cargs, ckwargs, cleaves = _concrete_call(args, kwargs, symbolic.hint)
    return decide(func, cargs, ckwargs, cleaves, mesh)


def _specialized(func, args: tuple, kwargs: dict, leaves: list, mesh) -> Any:
    """The call decided at its sizes' hints, with those sizes pinned by guards."""
    decision = _at_hints(func, args, kwargs, mesh)
    _concrete_call(args, kwargs, int)   # int() of a symbolic size records its guard
    return decision.execute(func, args, kwargs, leaves)


def _symbols(values: list) -> list[tuple[Any, int]]:
    """The free symbols of the symbolic sizes among `values`, with their hints, in order of appearance."""
    found: dict = {}
    for v in values:
        if isinstance(v, torch.SymInt) and symbolic.is_symbolic(v):
            env = v.node.shape_env
            for s in sorted(v.node.expr.free_symbols, key=str):
                if s not in found:
                    found[s] = int(env.backed_var_to_val[s])
    return list(found.items())


def _decide_made_up(func, args: tuple, kwargs: dict, mesh, assign: dict) -> Decision:
    """`decide` of the call with its symbols at `assign`'s made-up values (`MADE_UP` set: nothing is run on
    the host at those sizes); raises where they break the call."""
    token = MADE_UP.set(True)
    try:
        cargs, ckwargs, cleaves = _concrete_call(args, kwargs, lambda n: _value(n, assign))
        return decide(func, cargs, ckwargs, cleaves, mesh)
    finally:
        MADE_UP.reset(token)


def _value(n: Any, assign: dict) -> int:
    """`n` (an int or a SymInt) with its symbols replaced by `assign`'s values."""
    if isinstance(n, torch.SymInt) and symbolic.is_symbolic(n):
        return int(n.node.expr.xreplace(assign))
    return int(n)


def _concrete_call(args: tuple, kwargs: dict, size) -> tuple[tuple, dict, list]:
    """The call with every symbolic size replaced by `size(n)`: global tensors keep their local but get
    int global shapes, plain tensors become meta tensors of the concrete shape; and its leaves."""
    leaves: list = []

    def concrete(shape) -> tuple[int, ...]:
        out = tuple(size(n) for n in shape)
        if math.prod(out) > _MOST_ELEMENTS:   # (several symbols of one tensor at made-up sizes: its element count
            raise SbpError(f"made-up sizes {out} hold too many elements")   # overflowed int64, or worse)
        return out

    def conv(a: Any) -> Any:
        if isinstance(a, GlobalTensor):
            if any(isinstance(n, torch.SymInt) for n in a.shape):
                a = GlobalTensor(a._local, a._mesh, a._placements, concrete(a.shape))
            leaves.append(a)
            return a
        if isinstance(a, torch.Tensor):
            if any(isinstance(n, torch.SymInt) for n in a.shape):
                a = torch.empty(concrete(a.shape), dtype=a.dtype, device="meta")
            leaves.append(a)
            return a
        if isinstance(a, torch.SymInt):
            return size(a)
        if type(a) is list or type(a) is tuple:
            return type(a)(conv(x) for x in a)
        return a

    cargs = tuple(conv(a) for a in args)
    ckwargs = {k: conv(v) for k, v in kwargs.items()}
    return cargs, ckwargs, leaves


__all__ = ["has_symbolic", "handle_symbolic", "keeps_symbolic_splits"]
