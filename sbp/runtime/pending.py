"""Asynchronous collectives: one ordered queue of communication work per rank, and the tensor that waits for it.

``x.redistribute(placements, async_op=True)`` returns at once; its local tensor is a `PendingTensor`, a
stand-in with the result's shape, dtype and device whose first use (any ATen op on it, ``wait()``) blocks
until the collectives that make it have run. The collectives run on the rank's `CommQueue`: one worker
thread per rank that takes submitted work first in, first out. Why one ordered queue: gloo and NCCL need
every member of a group to make the same calls in the same order; SPMD code submits the same work in the
same order on every rank, and one FIFO keeps that order whatever the main thread does meanwhile.

Ordering with synchronous collectives: every collective called on a binding from another thread than the
queue's worker (the executor running a plan, a row move, a check, ``mesh.binding.all_gather(...)``) first
drains the rank's queue (`drain`), so it never overtakes async work submitted before it (work submitted
from the queue's own thread does not drain, or it would wait for itself).

Ordering with compiled graphs: a graph made by torch.compile issues its functional collectives straight to
the process groups, with no drain. So every global tensor a compiled graph takes as an input, or as the
gradient of an output (torch flattens it, `GlobalTensor.__tensor_flatten__`, right before the graph runs),
calls `fence`: the rank's queue is drained first if work on it may communicate over a group some compiled
graph of this process runs collectives on (`note_graph_group`, at trace time; each job's `span` says
which ranks it talks to). Async work on other groups keeps running beside the graph: a fully sharded
model's gathers and reduce_scatters on the data-parallel axis overlap compiled blocks whose collectives
are tensor-parallel. Without this, a compiled block whose graph held a collective on the data-parallel
axis (an uneven batch's rows moved, a batch mean) raced the queue's reduce_scatter to the same gloo
group from two threads, in an order that differed between ranks: the ranks aborted.

The worker runs with the caller's `contextvars` (``sbp.debug()``, ``sbp.strict()``) as they were at
submission. On CUDA the work runs on a side stream that first waits for the caller's current stream (an
event recorded at submission), and the waiter's current stream waits for an event recorded after it, as
FSDP2's all-gather stream does: the host thread never blocks on the device. Errors raised by the work
(a `CommError` after the mesh's timeout) are raised where the result is waited for.

>>> import torch, sbp, sbp.testing
>>> def fn(mesh):
...     x = sbp.distribute(torch.arange(4.), mesh, "S(0)")
...     y = x.redistribute("B", async_op=True)      # returns at once
...     return type(y.to_local()).__name__, y.wait().to_local().tolist()
>>> sbp.testing.spmd(fn, (2,))
[('Tensor', [0.0, 1.0, 2.0, 3.0]), ('Tensor', [0.0, 1.0, 2.0, 3.0])]
"""
from __future__ import annotations

import contextvars
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import torch

IDLE_EXIT_S = 2.0   # a worker with nothing to do for this long ends (a later submission starts another)


class CommQueue:
    """One rank's ordered communication worker: `submit` runs callables on its thread, first in, first out.

    >>> q = CommQueue("demo")
    >>> q.submit(lambda: 6 * 7).result()     # (value, CUDA event or None)
    (42, None)
    >>> q.drain(); q.busy()
    False
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        # work submitted and not finished, counted by span (`submit`); a span whose count falls to 0 is dropped
        self._spans: dict[Optional[frozenset], int] = {}
        self._idle = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self.blocked_s = 0.0           # seconds callers spent blocked on this queue's work (exposed communication)

    def submit(self, fn: Callable[[], Any], span: Optional[frozenset] = None) -> Future:
        """Run `fn` on the worker after everything submitted before; its result (or error) in a `Future`.
        `span`: the world ranks of the group(s) `fn` communicates over (None: unknown, any group)."""
        fut: Future = Future()
        job = (fn, fut, contextvars.copy_context(), _cuda_ready_event(), span)
        with self._lock:
            self._spans[span] = self._spans.get(span, 0) + 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=f"sbp-comm-{self.name}", daemon=True)
                self._thread.start()
            self._jobs.put(job)
        return fut

    def busy(self) -> bool:
        """Whether work is queued or running."""
        return bool(self._spans)

    def touches(self, groups: "set[frozenset] | frozenset[frozenset]") -> bool:
        """Whether work queued or running may communicate over one of `groups` (sets of world ranks): its
        span (`submit`) holds the group, or is unknown.

        >>> import threading
        >>> q, go = CommQueue("demo"), threading.Event()
        >>> _ = q.submit(go.wait, span=frozenset({0, 2}))     # rank 0's group along a data-parallel axis
        >>> q.touches({frozenset({0, 1})}), q.touches({frozenset({0, 2})})
        (False, True)
        >>> go.set(); q.drain(); q.touches({frozenset({0, 2})})
        False
        """
        with self._lock:
            return any(span is None or any(g <= span for g in groups) for span in self._spans)

    def on_worker(self) -> bool:
        """Whether the calling thread is this queue's worker (its work must not wait for the queue)."""
        return threading.current_thread() is self._thread

    def drain(self) -> None:
        """Block until every submitted job has finished (their errors stay with their futures)."""
        if self.on_worker():
            return
        t0 = time.perf_counter()
        with self._idle:
            while self._spans:
                self._idle.wait()
        self.blocked_s += time.perf_counter() - t0

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if not self._spans:   # nothing queued: end; submit starts a new worker under the lock
                        self._thread = None
                        return
                continue
            fn, fut, ctx, ready, span = job
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(ctx.run(_on_side_stream, fn, ready))
                    except BaseException as e:   # delivered to the waiter, not lost in this thread
                        fut.set_exception(e)
            finally:
                with self._idle:
                    self._spans[span] -= 1
                    if not self._spans[span]:
                        del self._spans[span]
                    self._idle.notify_all()


class _Queues:
    """The queue of each rank of this process, keyed by (backend, world, rank): one per process on
    torch.distributed, one per thread-rank on the threads backend (whose ranks share a process).
    Collective order is per rank, as process groups are per process (`sbp.runtime.backends.dist`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keep: dict[tuple, CommQueue] = {}

    def of(self, comm: Any, create: bool = True) -> Optional[CommQueue]:
        key = (comm.backend, id(getattr(comm, "world", None)), comm.rank)
        with self._lock:
            found = self._keep.get(key)
            if found is None and create:
                found = self._keep[key] = CommQueue(f"{comm.backend}-{comm.rank}")
            return found

    def clear(self) -> None:
        """Forget every idle queue (busy ones are kept)."""
        with self._lock:
            self._keep = {k: q for k, q in self._keep.items() if q.busy()}


QUEUES = _Queues()   # the order of collectives is per rank of the process, like its process groups


def queue_of(comm: Any) -> CommQueue:
    """The ordered queue of the rank bound by `comm` (made on first use).

    >>> import sbp.testing
    >>> sbp.testing.spmd(lambda mesh: queue_of(mesh.binding) is queue_of(mesh.binding), (2,))
    [True, True]
    """
    return QUEUES.of(comm)


def drain(comm: Any) -> None:
    """Wait for the async work of `comm`'s rank (nothing to do when there is none; never on the worker).

    >>> import sbp.testing
    >>> sbp.testing.spmd(lambda mesh: drain(mesh.binding), (2,))
    [None, None]
    """
    q = QUEUES.of(comm, create=False)
    if q is not None and q.busy():
        q.drain()


class PendingTensor(torch.Tensor):
    """The result of asynchronous work, with its shape, dtype and device known ahead: the first ATen op on
    it (or `wait`) blocks for the value and runs on it; later ops run on the value directly. `then`
    derives another pending value (a slice of this one, say) without waiting; so does ``detach`` (autograd
    detaches each gradient it stores in a leaf's ``.grad``: a queued gradient reduction keeps running).

    >>> from concurrent.futures import Future
    >>> fut = Future(); fut.set_result((torch.arange(3.), None))
    >>> p = PendingTensor(fut, (3,), torch.float32, torch.device("cpu"))
    >>> (p * 2).tolist(), p.done(), p.then(lambda v: v[1:], (2,)).wait().tolist()
    ([0.0, 2.0, 4.0], True, [1.0, 2.0])
    """

    _future: Optional[Future]
    _queue: Optional[CommQueue]   # charged with the time `wait` blocks
    _parent: Optional[tuple["PendingTensor", Callable[[torch.Tensor], torch.Tensor]]]
    _value: Optional[torch.Tensor]

    @staticmethod
    def __new__(cls, future: Optional[Future], shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                parent: Optional[tuple["PendingTensor", Callable]] = None,
                queue: Optional[CommQueue] = None) -> "PendingTensor":
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        d = self.__dict__
        d["_future"], d["_parent"], d["_value"], d["_queue"] = future, parent, None, queue
        return self

    def wait(self) -> torch.Tensor:
        """The value (a plain tensor), blocking until the work that makes it has run."""
        value = self._value
        if value is None:
            if self._parent is not None:
                source, fn = self._parent
                value = fn(source.wait())
            else:
                t0 = time.perf_counter()
                value, done = self._future.result()
                if self._queue is not None:
                    self._queue.blocked_s += time.perf_counter() - t0
                if done is not None:   # CUDA: the current stream waits for the side stream's work, not the host
                    torch.cuda.current_stream().wait_event(done)
                    value.record_stream(torch.cuda.current_stream())
            d = self.__dict__
            d["_value"], d["_future"], d["_parent"] = value, None, None
        return value

    def then(self, fn: Callable[[torch.Tensor], torch.Tensor], shape: Sequence[int],
             dtype: Optional[torch.dtype] = None) -> "PendingTensor":
        """A pending `fn(value)` of `shape` (and `dtype`, default this one's), computed when it is waited for."""
        return PendingTensor(None, shape, dtype or self.dtype, self.device, parent=(self, fn))

    def done(self) -> bool:
        """Whether the work that makes the value has run (waiting would not block on the host)."""
        if self._value is not None:
            return True
        return self._parent[0].done() if self._parent is not None else self._future.done()

    def tolist(self) -> Any:  # type: ignore[override]
        """The value as (nested) Python numbers (waits), as a plain tensor's ``tolist``."""
        return self.wait().tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        """The value as a NumPy array (waits)."""
        return self.wait().numpy(force=force)

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        """The value's storage (waits): aliasing checks compare the value's memory."""
        return self.wait().untyped_storage()

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"PendingTensor(shape={tuple(self.shape)}, dtype={self.dtype}, done={self.done()})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default and args[0]._value is None:
            # autograd detaches every gradient it stores in a leaf's .grad: a pending one stays pending (its
            # reduction keeps running behind the rest of backward) until the optimizer reads it
            return args[0].then(torch.Tensor.detach, tuple(args[0].shape))
        unwrap = lambda a: a.wait() if isinstance(a, PendingTensor) else \
            type(a)(unwrap(x) for x in a) if isinstance(a, (list, tuple)) else a
        return func(*unwrap(args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def submit(comm: Any, fn: Callable[[], torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
           device: torch.device, axes: Optional[Sequence[int]] = None) -> PendingTensor:
    """Run `fn` (collectives of `comm`'s rank returning a tensor of `shape`) on the rank's queue. `axes`:
    the mesh axes `fn` communicates along (their groups and those of their subsets); None: any.

    >>> import sbp.testing
    >>> def fn(mesh):
    ...     p = submit(mesh.binding, lambda: torch.ones(2), (2,), torch.float32, torch.device("cpu"))
    ...     return isinstance(p, PendingTensor), p.wait().tolist()
    >>> sbp.testing.spmd(fn, (2,))
    [(True, [1.0, 1.0]), (True, [1.0, 1.0])]
    """
    q = queue_of(comm)
    span = None if axes is None else frozenset(comm.members(tuple(axes)))
    return PendingTensor(q.submit(fn, span), shape, dtype, device, queue=q)


GRAPH_GROUPS: set[frozenset] = set()   # world ranks of each group a compiled graph of this process communicates on


def note_graph_group(members: Sequence[int]) -> None:
    """Record that a compiled graph runs collectives on the group of `members` (called while tracing).

    >>> note_graph_group((0, 1)); frozenset((0, 1)) in GRAPH_GROUPS
    True
    >>> GRAPH_GROUPS.discard(frozenset((0, 1)))      # (this example's record: no graph of this process uses it)
    """
    GRAPH_GROUPS.add(frozenset(members))


def fence(comm: Any) -> None:
    """Before a compiled graph runs on this rank: wait for the async work of `comm`'s rank if any of it
    may communicate over a group some compiled graph uses (the module docstring: "Ordering with compiled
    graphs"); async work on other groups keeps running. Nothing to do when the queue is idle.

    >>> import sbp.testing
    >>> sbp.testing.spmd(lambda mesh: fence(mesh.binding), (2,))
    [None, None]
    """
    q = QUEUES.of(comm, create=False)
    if q is None or not q.busy() or not GRAPH_GROUPS:
        return
    if q.touches(GRAPH_GROUPS):
        q.drain()


def ready(t: torch.Tensor) -> torch.Tensor:
    """`t`'s value: waits for a `PendingTensor`, returns any other tensor as it is.

    >>> ready(torch.ones(1)).tolist()
    [1.0]
    """
    return t.wait() if isinstance(t, PendingTensor) else t


def is_pending(t: Any) -> bool:
    """Whether `t` is a `PendingTensor` whose value has not been taken yet (its work may still run).

    >>> is_pending(torch.ones(1))
    False
    """
    return isinstance(t, PendingTensor) and t._value is None


def wait_all(comm: Any) -> None:
    """Wait until every piece of async work of `comm`'s rank has run (as `drain`; public spelling).

    >>> import sbp.testing
    >>> sbp.testing.spmd(lambda mesh: wait_all(mesh.binding), (2,))
    [None, None]
    """
    drain(comm)


def _cuda_ready_event() -> Optional[tuple["torch.cuda.Event", int]]:
    """On CUDA, an event on the caller's current stream (the side stream waits for it before the work)
    and the caller's device (the worker thread selects it: the current device is per thread)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event, torch.cuda.current_device()


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}   # one communication stream per device (a cache)


def _on_side_stream(fn: Callable[[], Any], ready: Optional[tuple["torch.cuda.Event", int]]) -> tuple[Any, Any]:
    """Run `fn`: on CPU as it is; on CUDA on the caller's device's side stream after the caller's event,
    returning the value and an event recorded after it (the waiter's stream waits for that event)."""
    if ready is None:
        return fn(), None
    ready_event, device = ready
    torch.cuda.set_device(device)
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        stream.wait_event(ready_event)
        value = fn()
        done = torch.cuda.Event()
        done.record(stream)
    return value, done
