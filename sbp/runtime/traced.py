"""The traced lowering: a `Plan`'s steps as torch's functional collectives, for `torch.compile`.

While a local tensor is being traced (dynamo, AOTAutograd's fake/functional tensors, `make_fx`), the
executor hands every collective step here instead of running eager torch.distributed calls. Each step
becomes ``torch.ops._c10d_functional`` ops (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce``, ``all_to_all_single``, each followed by ``wait_tensor``) on the process group of the
step's group (named by ``pg.group_name``), so the compiled graph holds exactly the planned collectives
and a compiler may schedule them. Only shape maths runs (the same layouts the eager executor uses);
no data pointer is read. Uneven pieces travel padded to one width (all_gather / reduce_scatter) or with
exact per-peer split sizes (all_to_all, point-to-point ``transfer`` and both phases of
``reduce_transfer``, which become ``all_to_all_single`` calls).

Only communicators over torch.distributed process groups can be traced; the threads backend has no
process groups (`CompileError`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import pathlib
import weakref
from typing import Optional

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import TracingContext
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy

from ..planning.exchange import exchange, reduce_exchange
from ..values.errors import MeshError, PlanError
from ..values.layout import block, block_numel, block_shape, relative
from ..values.placement import Partial
from ..values.steps import Step
from . import pending
from .buffers import gather, scatter
from .communicator import Communicator
from .symbolic import step_runs_symbolically
from .torch_fixes import apply as apply_torch_fixes

_FUNCOL = torch.ops._c10d_functional


class CompileError(MeshError):
    """A plan cannot be lowered to functional collectives (e.g. the mesh is bound to the threads backend).

    >>> raise CompileError("no process groups")
    Traceback (most recent call last):
    ...
    sbp.runtime.traced.CompileError: no process groups
    """


def is_tracing(t: torch.Tensor) -> bool:
    """Whether `t` is being traced (a fake or functional tensor, dynamo compiling, a proxy mode active):
    then a plan must run as functional collectives (`run_step`), not as eager calls.

    >>> is_tracing(torch.ones(2))
    False
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode() as mode:
    ...     is_tracing(torch.ones(2))
    True
    """
    if type(t) is not torch.Tensor and isinstance(t, (FakeTensor, FunctionalTensor)):
        return True
    return (torch._is_functional_tensor(t) or get_proxy_mode() is not None
            or torch.compiler.is_compiling() and traced_here())


def untraced():
    """A context where tensors made are host tensors again, outside the tracing modes of a compiled graph
    (its fake-tensor and proxy modes; none active: nothing to leave). For what only shapes or constants
    are read from: a meta kernel's output shapes, a view's element index.

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     with untraced():
    ...         type(torch.ones(2)).__name__
    'Tensor'
    """
    return _disable_current_modes() if torch._C._len_torch_dispatch_stack() else contextlib.nullcontext()


_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def traced_here() -> bool:
    """While torch's compiling flag is up: whether the calling thread is the one being traced. Call it as
    ``torch.compiler.is_compiling() and traced_here()`` -- sbp's test for "this code is being traced by
    torch.compile or torch.export".

    The flag alone is not enough: torch raises it for the whole process during a compile, so another thread
    (sbp's side thread running a prefetched `fully_shard` gather, another rank of the threads backend) would
    see it too and take the traced path on real tensors while its peers run eagerly, and their collectives
    would not match. Dynamo folds this call to True in the code it traces; elsewhere the flag counts only on
    the thread holding a tracing context. The flag goes first at the call site: it is torch's, never compiled
    as a frame of its own, where a call of this function in a frame that fell back to eager under
    torch.compile could be (returning the True dynamo folds it to).

    >>> import torch
    >>> torch.compiler.is_compiling() and traced_here()   # eager code
    False
    """
    return _dynamo_compiling() or TracingContext.try_get() is not None


def traced_without_dynamo() -> bool:
    """While torch's compiling flag is up: whether the calling thread runs real Python under a trace that is
    not dynamo's (torch.export's non-strict trace). There `nn.Module` skips its ``always_call`` forward hooks
    when a forward raises, so what a forward-pre hook enters would outlive a failed trace. Call it as
    ``torch.compiler.is_compiling() and traced_without_dynamo()``.

    >>> import torch
    >>> torch.compiler.is_compiling() and traced_without_dynamo()   # eager code
    False
    """
    return not _dynamo_compiling() and TracingContext.try_get() is not None


def graph_break(what: str, why: str, hint: str) -> None:
    """Break the graph at `what`, a call that no graph can hold, when it runs under a trace; running for
    real, return and let the call go on. Dynamo runs a global tensor's method on fake tensors to learn its
    output: there this raises dynamo's graph break (without ``fullgraph`` the graph ends before the call
    and the call runs eagerly; with it, the compile fails with this message). Under any other trace
    (AOTAutograd, torch.export, make_fx) the same text is a RuntimeError.

    >>> graph_break("a cross-mesh move", "no graph holds it", "move outside the compiled function") is None
    True
    """
    if TracingContext.try_get() is None:
        return None
    if get_proxy_mode() is None:   # dynamo's fake-tensor run of a recorded call
        from torch._dynamo.exc import unimplemented
        unimplemented(gb_type=f"sbp: {what}", context=what, explanation=why, hints=[hint])
    raise RuntimeError(f"{what} cannot be traced into a graph: {why}; {hint}")


def group_name(comm: Communicator, axes: tuple[int, ...]) -> tuple[str, int, tuple[int, ...]]:
    """(process group name, group size, member index at each group rank) of this rank's group along
    `axes`; the member order is the mesh's row-major order, the group's is ascending ranks.

    On the threads backend (ranks as threads, no process groups) there is none:

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     try:
    ...         return group_name(mesh.binding, (0,))
    ...     except CompileError as e:
    ...         return str(e)[:60]
    >>> sbp.testing.spmd(fn, (2,))[0]
    'torch.compile of a redistribution needs a mesh bound to torc'
    """
    members = comm.members(axes)
    groups = getattr(comm, "_groups", None)  # DistComm: process groups keyed by sorted members
    if not isinstance(groups, dict):
        raise CompileError(f"torch.compile of a redistribution needs a mesh bound to torch.distributed process "
                           f"groups (sbp.init_mesh, sbp.testing.spmd(..., backend='gloo')); this mesh is bound "
                           f"to the {comm.backend!r} backend, which runs ranks as threads and has no process "
                           f"groups: run it eagerly or use backend='gloo'/'nccl'")
    pg = groups.get(tuple(sorted(members)))
    if pg is None:
        raise CompileError(f"no process group for ranks {list(members)} on rank {comm.rank}")
    pending.note_graph_group(members)   # async work on this group now waits before a graph runs (`pending.fence`)
    return pg.group_name, len(members), _order(members)


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A digest of sbp's own source files (read once per process).

    Compile caches (torch's on-disk AOTAutograd cache) key a graph by dynamo's graph and its inputs; the
    lowering of sbp's opaque calls is sbp's Python, which they do not hash, so a cached graph made by
    another version of sbp would be served without it.

    >>> len(code_fingerprint()), code_fingerprint() == code_fingerprint()
    (32, True)
    """
    digest = hashlib.blake2b(digest_size=16)
    root = pathlib.Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(*parts: object) -> str:
    """A stable digest of `parts` (their reprs) and `code_fingerprint()`: a traced tensor's part of a compile
    cache's key. The caller puts in everything its lowering depends on -- for a global tensor, this
    process's rank: ranks share one on-disk cache, and a plan's traced lowering differs between ranks
    (their blocks differ) even where the graph and the local shapes do not.

    >>> cache_key((2,), 0) == cache_key((2,), 0), cache_key((2,), 0) == cache_key((2,), 1)
    (True, False)
    """
    text = repr((code_fingerprint(),) + parts)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@functools.lru_cache(maxsize=1024)
def _order(members: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(members.index(r) for r in sorted(members))


def run_step(step: Step, local: torch.Tensor, global_shape: tuple[int, ...], mesh_shape: tuple[int, ...],
             coord: tuple[int, ...], comm: Communicator, elem: tuple = ()) -> torch.Tensor:
    """One communicating step of a plan as functional collectives on this rank's (traced) `local`.

    `elem`: trailing dims of `local` past the plan's shape (symbolic sizes no placement splits,
    `sbp.runtime.symbolic`): every flat buffer is then a column of such elements, collectives split and join
    along its leading dim, and all layout maths stays on the plan's (int) shape.

    Local steps (slicing, no communication) stay with the executor:

    >>> import sbp, torch
    >>> step = sbp.plan((4,), (2,), "B", "S(0)").steps[0]
    >>> run_step(step, torch.arange(4.), (4,), (2,), (0,), None)
    Traceback (most recent call last):
    ...
    sbp.values.errors.PlanError: the traced lowering has no step kind 'local'
    """
    if step.kind != "local" and len(comm.members(step.axes)) == 1:
        return local.contiguous()   # a group of one (an axis of size 1): its collective is the identity
    match step.kind:
        case "all_gather":
            return _all_gather(step, local, global_shape, mesh_shape, coord, comm, elem)
        case "reduce_scatter":
            return _reduce_scatter(step, local, global_shape, mesh_shape, coord, comm, elem)
        case "all_reduce":
            if math.prod(local.shape[:local.dim() - len(elem)]) == 0:
                return local.contiguous()
            name, _, _ = group_name(comm, step.axes)
            return _collective("all_reduce", local.contiguous(), _op(step), name)
        case "all_to_all" if step_runs_symbolically(step):
            return _exchange_padded(step, local, global_shape, mesh_shape, coord, comm)
        case "all_to_all" | "transfer":
            return _exchange(step, local, global_shape, mesh_shape, coord, comm, elem)
        case "reduce_transfer":
            return _reduce_transfer(step, local, global_shape, mesh_shape, coord, comm, elem)
    raise PlanError(f"the traced lowering has no step kind {step.kind!r}")


def assert_rows_agree(row: list, comm: Communicator, axes: tuple[int, ...], device: torch.device,
                      message: str) -> None:
    """In the graph being traced: all-gather `row` (ints, some may be symbolic sizes) over this rank's group
    along `axes` and assert at run time that every member's row equals this rank's, else the graph raises
    ``RuntimeError(message)`` -- on every member alike, as each compares the same gathered rows (a check on
    values only the ranks together know, where a graph cannot branch).

    On the threads backend there is no process group to trace (`CompileError`, as for `run_step`).
    """
    if len(comm.members(axes)) == 1:
        return
    name, n, _ = group_name(comm, axes)
    if all(type(v) is int for v in row):
        mine = torch.tensor(row, dtype=torch.int64, device=device)
    else:   # a symbolic size: traced as the ops that make it
        mine = torch.stack([torch.scalar_tensor(v, dtype=torch.int64, device=device) for v in row])
    rows = _collective("all_gather_into_tensor", mine, n, name).view(n, len(row))
    same = torch.all(rows == mine)
    # on a GPU the assertion is read on the host: asserted on the device it would be a device-side assert,
    # which leaves the process's CUDA context unusable (eager `from_local` reads the shapes on the host too)
    torch._assert_async(same if same.device.type == "cpu" else same.cpu(), message)


def _collective(name: str, inp: torch.Tensor, *args) -> torch.Tensor:
    """``torch.ops._c10d_functional.<name>(inp, *args)`` and its wait. A bool tensor travels as uint8 (bools
    reduce only by max or min, `P(sum)` refuses them, and both are exact on 0 and 1): inductor's C++ backend
    failed to compile a bool mask loaded from a collective's buffer (``torch.where`` on an all-gathered
    comparison: "CppCSEVariable ... dtype: torch.int64" in its mask cast; a torch bug, plain functional
    collectives alike), and where only some ranks' graphs hit it the others hung."""
    if inp.dtype != torch.bool:
        return _wait(getattr(_FUNCOL, name)(inp, *args))
    return _wait(getattr(_FUNCOL, name)(inp.to(torch.uint8), *args)).to(torch.bool)


def _wait(t: torch.Tensor) -> torch.Tensor:
    apply_torch_fixes()   # before the partitioner and inductor see this graph (`sbp.runtime.torch_fixes`)
    _keep_forward_collectives_forward()
    out = _FUNCOL.wait_tensor(t)
    _keep_backward_collectives_backward()
    return out


_PINNED: "weakref.WeakSet[torch.fx.Graph]" = weakref.WeakSet()
_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _keep_forward_collectives_forward() -> None:
    """While AOTAutograd traces a backward (its joint graph's second half): mark the forward's functional
    collectives as forward-only, once per graph, so that no backward graph holds a copy of them.

    Why: the partitioner builds the backward graph from every node it can compute out of the values saved
    for it, then drops the unused ones -- but ``wait_tensor`` counts as a side effect, so a forward chain
    ``collective -> wait_tensor`` whose input the backward can compute (say the backward saves `x` and the
    forward all-gathered a function of `x`) stays in the backward graph, run again and unused. Which values
    are saved depends on their sizes (the min-cut partitioner of ``aot_eager`` / ``inductor``), and with
    uneven shards sizes differ by rank: the ranks' backward graphs then held different collectives and hung
    (``x.logsumexp(0)``, x (7, 6) split over 4 ranks). A node tagged ``must_be_in_forward`` is never copied
    into the backward graph; its result, when the backward needs it, is saved (the partitioner already saves
    collectives' results rather than recompute them). Collectives that activation checkpointing asks to
    recompute keep their tag. The forward's tags are final once its trace ends (AOTAutograd writes them
    then), so the backward's first collective is the place to change them."""
    if fx_traceback.current_meta.get("partitioner_tag") != "is_backward":
        return
    mode = get_proxy_mode()
    if mode is None or mode.tracer.graph in _PINNED:
        return
    _PINNED.add(mode.tracer.graph)
    for node in mode.tracer.graph.nodes:
        if (node.op == "call_function" and node.meta.get("partitioner_tag") == "is_forward"
                and getattr(node.target, "namespace", None) == "_c10d_functional"
                and node.target is not _FUNCOL.wait_tensor.default
                and node.meta.get("recompute") not in _RECOMPUTED):
            node.meta["partitioner_tag"] = "must_be_in_forward"


def _keep_backward_collectives_backward() -> None:
    """While AOTAutograd traces a backward: mark the collectives just traced (back to the previous one) as
    backward-only, so that no forward graph computes them ahead.

    Why: a backward collective that does not depend on the incoming gradient (``amax``'s backward reduces its
    saved result again for the mask) can be computed in the forward and its result saved instead; the min-cut
    partitioner decides that from sizes, which differ by rank with uneven shards (a rank holding no rows).
    Ranks then ran it in different graphs and the backward hung. Eager runs it in the backward: so does every
    rank's graph. (The tag also keeps their users in the backward: the partitioner's rule.)"""
    if fx_traceback.current_meta.get("partitioner_tag") != "is_backward":
        return
    mode = get_proxy_mode()
    if mode is None:
        return
    for node in reversed(mode.tracer.graph.nodes):
        if node.meta.get("partitioner_tag") != "is_backward":   # the previous collective's mark, or the forward
            break
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional":
            node.meta["partitioner_tag"] = "must_be_in_backward"


def _op(step: Step) -> str:
    if step.op is not None:
        return step.op
    return next(step.src[a].op for a in step.axes if isinstance(step.src[a], Partial))


def _to_group_order(buf: torch.Tensor, width: int, order: tuple[int, ...]) -> torch.Tensor:
    """A flat buffer of equal member-order pieces rearranged into group-rank order (and back: the
    inverse permutation); the buffer itself when the orders agree."""
    if order == tuple(range(len(order))):
        return buf
    return torch.cat([buf[m * width:(m + 1) * width] for m in order])


def _from_group_order(buf: torch.Tensor, width: int, order: tuple[int, ...]) -> torch.Tensor:
    if order == tuple(range(len(order))):
        return buf
    at = {m: g for g, m in enumerate(order)}
    return torch.cat([buf[at[m] * width:(at[m] + 1) * width] for m in range(len(order))])


def _all_gather(step, local, global_shape, mesh_shape, coord, comm, elem=()) -> torch.Tensor:
    lay = gather(global_shape, mesh_shape, step.src, step.dst, step.axes, coord)
    if lay.width == 0:
        return local.new_empty(lay.shape + elem)
    name, n, order = group_name(comm, step.axes)
    flat = local.reshape((-1,) + elem)
    if flat.shape[0] != lay.width:
        flat = torch.cat([flat, flat.new_zeros((lay.width - flat.shape[0],) + elem)])
    buf = _from_group_order(_collective("all_gather_into_tensor", flat.contiguous(), n, name), lay.width, order)
    if lay.runs is not None:
        if len(lay.runs) == 1:   # one run (the pieces lie in order): the buffer, or its head, as it is
            (lo, hi), = lay.runs
            return (buf if (lo, hi) == (0, buf.shape[0]) else buf[lo:hi]).view(lay.shape + elem)
        return torch.cat([buf[lo:hi] for lo, hi in lay.runs]).view(lay.shape + elem)
    if lay.stack is not None:   # equal pieces side by side along one dim: one copy, not one per member
        return buf.view(lay.members_shape + elem).movedim(0, lay.stack).reshape(lay.shape + elem)
    out = local.new_empty(lay.shape + elem)
    for where, shape, offset in lay.places:
        out[where] = buf[offset:offset + math.prod(shape)].view(shape + elem)
    return out


def _reduce_scatter(step, local, global_shape, mesh_shape, coord, comm, elem=()) -> torch.Tensor:
    lay = scatter(global_shape, mesh_shape, step.src, step.dst, step.axes, coord)
    if lay.width == 0:
        return local.new_empty(lay.shape + elem)
    name, n, order = group_name(comm, step.axes)
    if lay.direct:
        inp = local.reshape((-1,) + elem)
    elif lay.stack is not None:   # equal pieces side by side along one dim: one copy, not one per member
        inp = local.unflatten(lay.stack, (n, -1)).movedim(lay.stack, 0).reshape((-1,) + elem)
    else:
        inp = local.new_zeros((n * lay.width,) + elem)
        if lay.runs is not None:
            flat = local.reshape((-1,) + elem)
            for src, dst, length in lay.runs:
                inp[dst:dst + length] = flat[src:src + length]
        else:
            for where, shape, offset in lay.places:
                inp[offset:offset + math.prod(shape)] = local[where].reshape((-1,) + elem)
    inp = _to_group_order(inp, lay.width, order).contiguous()
    got = _collective("reduce_scatter_tensor", inp, _op(step), n, name)
    return got[:lay.numels[lay.index]].view(lay.shape + elem)


def run_symbolic_step(step: Step, local: torch.Tensor, ranges: dict, me: int, comm: Communicator) -> torch.Tensor:
    """One ``all_gather`` ``S(d) -> B``, ``reduce_scatter`` ``P -> S(d)`` or ``all_to_all`` ``S(a) -> S(b)``
    along one mesh axis that splits the moved dims innermost (`sbp.runtime.symbolic.runs_symbolically`),
    with their sizes symbolic: `ranges` maps each moved dim to the length of the range of it the axis
    splits (an expression of the global size), `me` is this rank's index along the axis. The pieces are
    the balanced split of that range: ``length // n`` rows and one more on the first ``length % n``
    members. That remainder is pinned (a guard: the graph holds for the sizes of one remainder class);
    shorter pieces travel padded by one row. The length itself stays symbolic.

    The result is sized by expressions of the lengths alone, read out of the collective's buffer by
    `_rows_of` without relating the local's own size symbols to the global ones: torch would otherwise
    rewrite a global size in terms of a local's symbol, which no input of a backward graph binds
    (inductor then cannot compile that backward: "expected [s..] to have been codegen-ed").
    """
    if len(comm.members(step.axes)) == 1:
        return local.contiguous()
    name, n, order = group_name(comm, step.axes)
    to_group, to_member = list(order), [order.index(m) for m in range(n)]
    (axis,) = step.axes
    if step.kind == "all_gather":
        d = step.src[axis].dim
        x = _padded_piece(local.movedim(d, 0), ranges[d], n, me)
        parts = _rows_of(_collective("all_gather_into_tensor", x.contiguous(), n, name),
                         (n, _width(ranges[d], n)) + tuple(x.shape[1:]))
        out = _joined(_reordered(parts, to_member), ranges[d], n)
        return out.movedim(0, d).contiguous()
    if step.kind == "reduce_scatter":
        d = step.dst[axis].dim
        x = local.movedim(d, 0)
        x = _rows_of(x.contiguous(), (ranges[d],) + tuple(x.shape[1:]))   # every member's partial sum of it
        parts = _reordered(_pieces(x, ranges[d], n), to_group)
        out = _collective("reduce_scatter_tensor", parts.flatten(0, 1).contiguous(), _op(step), n, name)
        return _own_piece(out, ranges[d], n, me).movedim(0, d).contiguous()
    a, b = step.src[axis].dim, step.dst[axis].dim   # all_to_all: gathers a, scatters b
    x = local.movedim((a, b), (0, 1))
    x = _rows_of(x.contiguous(), (_piece(ranges[a], n, me), ranges[b]) + tuple(x.shape[2:]))
    parts = _pieces(_padded_piece(x, ranges[a], n, me).movedim(1, 0), ranges[b], n)   # (member, b, a, ...)
    parts = _reordered(parts.transpose(1, 2), to_group)   # (member, a's piece, b's piece, ...)
    got = _collective("all_to_all_single", parts.contiguous(), [1] * n, [1] * n, name)
    out = _own_piece(_joined(_reordered(got, to_member), ranges[a], n).movedim(1, 0), ranges[b], n, me)
    return out.movedim((1, 0), (a, b)).contiguous()


def run_symbolic_gather(step: Step, local: torch.Tensor, dim: int, lengths: list, me: int,
                        comm: Communicator) -> torch.Tensor:
    """An ``all_gather`` of `dim` over several mesh axes (their innermost splits of it, in order:
    `sbp.runtime.symbolic.runs_symbolically`) with its size symbolic: `lengths` holds each member's rows
    (expressions of the global size, the remainders of its nested splits pinned; the first member's is the
    longest), `me` this rank's member index. Shorter pieces travel padded to the first's length; the result
    is sized by expressions of the lengths alone (`_rows_of`, as `run_symbolic_step`)."""
    name, n, order = group_name(comm, step.axes)
    x = local.movedim(dim, 0)
    rest = tuple(x.shape[1:])
    pad = int(lengths[0] - lengths[me])   # 0 or 1: fixed by the pinned remainders (a guard that holds)
    if pad:
        x = torch.cat([x, x.new_zeros((pad,) + rest)])
    parts = _rows_of(_collective("all_gather_into_tensor", x.contiguous(), n, name), (n, lengths[0]) + rest)
    parts = _reordered(parts, [order.index(m) for m in range(n)])   # group order -> member order
    return torch.cat([parts[m, :lengths[m]] for m in range(n)]).movedim(0, dim).contiguous()


def _width(length, n: int):
    """The padded width of the balanced pieces of `length` rows on `n` members."""
    return length // n + (1 if length % n else 0)


def _piece(length, n: int, me: int):
    """Member `me`'s rows of the balanced split of `length` on `n` members (its remainder pinned)."""
    return length // n + (1 if me < int(length % n) else 0)


def _padded_piece(x: torch.Tensor, length, n: int, me: int) -> torch.Tensor:
    """`x`, member `me`'s piece of `length` rows along dim 0, padded by one row to the pieces' width."""
    extra = int(length % n)
    return torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))]) if extra and me >= extra else x


def _pieces(x: torch.Tensor, length, n: int) -> torch.Tensor:
    """`x`, whose dim 0 holds `length` rows, as (n, width, ...): the balanced pieces, the short ones padded."""
    base, extra = length // n, int(length % n)
    rest = tuple(x.shape[1:])
    if not extra:
        return x.reshape((n, base) + rest)
    head = x[:extra * (base + 1)].reshape((extra, base + 1) + rest)
    tail = x[extra * (base + 1):].reshape((n - extra, base) + rest)
    return torch.cat([head, torch.cat([tail, tail.new_zeros((n - extra, 1) + rest)], 1)])


def _joined(parts: torch.Tensor, length, n: int) -> torch.Tensor:
    """`_pieces`' inverse: (n, width, ...) padded pieces joined into the `length` rows they hold."""
    base, extra = length // n, int(length % n)
    if not extra:
        return parts.flatten(0, 1)
    return torch.cat([parts[:extra].flatten(0, 1), parts[extra:, :base].flatten(0, 1)])


def _own_piece(x: torch.Tensor, length, n: int, me: int) -> torch.Tensor:
    """`_padded_piece`'s inverse: member `me`'s piece of `length` rows out of `x`, padded to the width."""
    extra = int(length % n)
    return x[:length // n] if extra and me >= extra else x


def _rows_of(buf: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Contiguous `buf` viewed as `shape` (the same elements), sized by `shape`'s expressions: an
    ``as_strided`` view, which compares no sizes (a ``view`` would tie `buf`'s size symbols to `shape`'s)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size
    return buf.as_strided(shape, tuple(reversed(strides)))


def _reordered(parts: torch.Tensor, at: list[int]) -> torch.Tensor:
    """`parts` (one per member along dim 0) with entry k taken from `at[k]`; itself where nothing moves."""
    return parts if at == list(range(len(at))) else parts[at]


def _all_to_all(source: torch.Tensor, held, send, recv, n: int, name: str, order: tuple[int, ...],
                me: int, elem: tuple = ()) -> tuple[list[tuple[object, torch.Tensor]], Optional[torch.Tensor]]:
    """One exact all_to_all_single: the blocks of `send` ((member, block) pairs) cut from `source` (which
    holds `held`), per-peer sizes in group-rank order; returns (block, received piece) in `recv` order, and
    `one`: None, or where this member (`me`) receives nothing, a 0-d tensor holding 1 that came through the
    call (it sends itself one row of ones), by which the caller multiplies its result.

    Why `one`: a member that only sends would not use the call's result, and AOTAutograd's partitioner
    drops a functional collective whose result is unused (treats it as pure) or moves it into the backward
    graph -- on that member only: the ranks' graphs would then hold different collectives (a mismatch, a
    hang, or pieces paired with another call). Multiplying by a value that arrived through the call keeps it
    in place on every member, exactly (x * 1 == x, signed zeros, infinities and NaNs included)."""
    outbox: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for peer, b in send:
        outbox[peer].append(source[relative(b, held)].reshape((-1,) + elem))
    out_sizes_m = [0] * n
    for peer, b in recv:
        out_sizes_m[peer] += block_numel(b)
    tie = not recv and math.prod(elem) > 0
    if tie:   # one row to itself, both ways
        outbox[me].append(source.new_ones((1,) + elem))
        out_sizes_m[me] += 1
    in_sizes = [sum(p.shape[0] for p in outbox[m]) for m in order]
    out_sizes = [out_sizes_m[m] for m in order]
    parts = [p for m in order for p in outbox[m]]
    inp = torch.cat(parts) if parts else source.new_empty((0,) + elem)
    got = _collective("all_to_all_single", inp.contiguous(), out_sizes, in_sizes, name)
    if tie:
        return [], got.reshape(-1)[0]
    starts, at = {}, 0
    for g, m in enumerate(order):
        starts[m] = at
        at += out_sizes[g]
    out = []
    for peer, b in recv:
        k = block_numel(b)
        out.append((b, got[starts[peer]:starts[peer] + k].view(block_shape(b) + elem)))
        starts[peer] += k
    return out, None


def all_to_all_rows(inp: torch.Tensor, out_sizes: list, in_sizes: list, name: str) -> torch.Tensor:
    """One functional ``all_to_all_single`` along dim 0 of `inp` (sizes in rows, group-rank order; they may
    be symbolic), waited for: `sbp.runtime.rows` in a traced graph."""
    return _collective("all_to_all_single", inp.contiguous(), out_sizes, in_sizes, name)


def _exchange(step, local, global_shape, mesh_shape, coord, comm, elem=()) -> torch.Tensor:
    ex = exchange(global_shape, mesh_shape, step.src, step.dst, step.axes, coord)
    me = ex.members.index(coord)
    have, want = block(global_shape, mesh_shape, step.src, coord), block(global_shape, mesh_shape, step.dst, coord)
    out = local.new_empty(block_shape(want) + elem)
    keep = ex.keep[me]
    if keep is not None and block_numel(keep):
        out[relative(keep, want)] = local[relative(keep, have)]
    if ex.max_recv_elems == 0:  # nothing moves anywhere in the group: no call
        return out
    name, n, order = group_name(comm, step.axes)
    pieces, one = _all_to_all(local, have, ex.send[me], ex.recv[me], n, name, order, me, elem)
    for b, piece in pieces:
        out[relative(b, want)] = piece
    return _tied(out, one)


def _exchange_padded(step, local, global_shape, mesh_shape, coord, comm) -> torch.Tensor:
    """A single-axis all_to_all ``S(a) -> S(b)`` at int sizes, as `run_symbolic_step` runs it at symbolic ones
    (padded pieces, equal splits): a rank whose sizes torch pinned (a piece of 1, or one duck-sized with
    another dim) makes the same collective as the ranks that kept them symbolic, or their graphs would
    exchange pieces of different sizes. Exact (`_exchange`) where a range is empty."""
    (axis,) = step.axes
    a, b = step.src[axis].dim, step.dst[axis].dim
    (lo_a, hi_a), (lo_b, hi_b) = block(global_shape, mesh_shape, step.dst, coord)[a], \
        block(global_shape, mesh_shape, step.src, coord)[b]
    if hi_a == lo_a or hi_b == lo_b:
        return _exchange(step, local, global_shape, mesh_shape, coord, comm)
    return run_symbolic_step(step, local, {a: hi_a - lo_a, b: hi_b - lo_b}, coord[axis], comm)


def _tied(out: torch.Tensor, one: Optional[torch.Tensor]) -> torch.Tensor:
    """`out`, made to depend on an all_to_all's `one` where this rank received nothing (see `_all_to_all`)."""
    return out if one is None else out * one


def _reduce_transfer(step, local, global_shape, mesh_shape, coord, comm, elem=()) -> torch.Tensor:
    ex = reduce_exchange(global_shape, mesh_shape, step.src, step.dst, step.axes, coord)
    me = ex.members.index(coord)
    have, want = block(global_shape, mesh_shape, step.src, coord), block(global_shape, mesh_shape, step.dst, coord)
    out = local.new_empty(block_shape(want) + elem)
    op = _op(step)
    name, n, order = group_name(comm, step.axes)
    arrived: dict = {}
    one = None
    if any(ex.recv1):
        pieces, one = _all_to_all(local, have, ex.send1[me], ex.recv1[me], n, name, order, me, elem)
        for b, piece in pieces:
            arrived.setdefault(b, []).append(piece)
    for b, holds in ex.owned[me]:
        parts = ([local[relative(b, have)]] if holds else []) + arrived.get(b, [])
        out[relative(b, want)] = functools.reduce(_REDUCE[op], parts)
    out = _tied(out, one)
    if any(ex.recv2):
        pieces, one = _all_to_all(out, want, ex.send2[me], ex.recv2[me], n, name, order, me, elem)
        for b, piece in pieces:
            out[relative(b, want)] = piece
        out = _tied(out, one)
    return out


_REDUCE = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}

__all__ = ["CompileError", "is_tracing", "group_name", "run_step", "all_to_all_rows", "code_fingerprint", "cache_key"]
