"""Two mends to torch's compile stack that sbp's graphs need, made once, when sbp first traces a collective
(`apply`). Both concern graphs whose ranks must run the same collectives in the same order, as eager does.

**No collective is merged by common-subexpression elimination.** AOTAutograd's min-cut partitioner (used by
``inductor`` and ``aot_eager_decomp_partition`` for training graphs) first runs a CSE pass over the joint
graph (``torch._functorch.compile_utils.fx_graph_cse``) that folds two calls with equal arguments into one.
Two collectives can be equal on one rank and differ on another: in an exact transfer where a rank neither
sends nor receives, that rank's ``all_to_all_single`` carries one constant row, the same for every such
transfer, while its peers' calls carry their rows. Two redistributions compiled together (``B, S(0) ->
S(0), S(0)`` of two (7, 5) tensors on a (2, 2) mesh) then gave ranks 0 and 3 one collective and ranks 1 and 2
two, and the ranks hung. Eager runs every collective, so the graph keeps them all: the functional
collectives join the ops that pass leaves alone (its list of random ops, which it must not merge either).

**A read of a collective's result stays after its wait (inductor's CPU backend).** ``wait_tensor`` is a
mutation of the collective's buffer in inductor's scheduler: a kernel that reads the buffer after the wait
depends on the wait through the buffer's renamed (mutated) name. When the C++ backend fuses two kernels
whose loops have the same size but different shapes ((4, 5) and (20,)), it rebuilds one kernel's
dependencies from its loop body (``SchedulerNode.recompute_size_and_body``) and renames only the manual
ones, so the kernel's read of the buffer lost the rename and with it the dependency on the wait: the fused
kernel ran before ``wait_tensor`` and read the gathered buffer before the all_gather had filled it (a
redistribution's gradient was uninitialised memory on one rank of four, with nothing raised). The wrapper
renames all of them, as the scheduler's ``refresh_dependencies`` does.

Each mend checks that the torch internals it touches are there and otherwise leaves torch as it is.

>>> apply(); apply()   # idempotent
>>> import torch
>>> from torch._functorch import compile_utils
>>> torch.ops._c10d_functional.all_to_all_single in compile_utils.rand_ops
True
"""

from __future__ import annotations

import functools

import torch

_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
_applied = False


def apply() -> None:
    """Make both mends (the module's docstring), once per process; later calls return at once."""
    global _applied
    if _applied:
        return
    _applied = True
    _keep_collectives_out_of_cse()
    _rename_recomputed_dependencies()


def _keep_collectives_out_of_cse() -> None:
    try:
        from torch._functorch import compile_utils
    except ImportError:
        return
    kept = getattr(compile_utils, "rand_ops", None)
    if not isinstance(kept, list):
        return
    for name in _COLLECTIVES:
        op = getattr(torch.ops._c10d_functional, name, None)
        if op is not None and op not in kept:
            kept.append(op)


def _rename_recomputed_dependencies() -> None:
    try:
        from torch._inductor.scheduler import SchedulerNode
    except ImportError:
        return
    recompute = getattr(SchedulerNode, "recompute_size_and_body", None)
    if recompute is None or getattr(recompute, "_sbp_mended", False) \
            or not hasattr(SchedulerNode, "set_read_writes"):
        return

    @functools.wraps(recompute)
    def recompute_size_and_body(self, *args, **kwargs):
        recompute(self, *args, **kwargs)
        renames = getattr(self, "mutation_renames", None)
        if renames:
            self.set_read_writes(self.read_writes.rename(renames))

    recompute_size_and_body._sbp_mended = True   # type: ignore[attr-defined]
    SchedulerNode.recompute_size_and_body = recompute_size_and_body
