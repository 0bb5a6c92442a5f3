"""The matmul family as contractions: every label split alike, a contracted label gives P(sum).

Each op is an einsum over its operands (plus an optional bias added to the product, broadcast
right-aligned to the output). Per mesh axis:

==========================================  ============  ===============================
operands                                    bias          output
==========================================  ============  ===============================
S on a kept label (m, n, or batch b)        S or B        S(that label's output dim)
S on the contracted label k (both)          P(sum)        P(sum)
P(sum) on one operand, the others B         P(sum)        P(sum)
all B                                       B             B
==========================================  ============  ===============================

So `mm`: ``S(0)xB->S(0)``, ``BxS(1)->S(1)``, ``S(1)xS(0)->P(sum)``, ``P(sum)xB->P(sum)``,
``BxP(sum)->P(sum)``; `bmm`: also ``S(0)xS(0)->S(0)`` (batch). A contracted dim split on both operands
uses the same balanced blocks (same length, same axes), so uneven shards line up.

`torch.matmul` of batched operands never reaches these rules whole: torch decomposes it before dispatch,
reshaping the batch dims into one, ``(b, H, T, d) -> (b*H, T, d)``, then `bmm`. A split on a batch dim
after the first (attention's heads, ``S(1)``) does not survive that merge (rank c's rows
``{i*H + its heads}`` are no contiguous block, which is what a Split is), so the operands would be
redistributed. `SplitBatchMatmul`, a torch-function mode, rewrites such a call before the decomposition:
the split batch dims are moved to the front, where the merge keeps the split (``(H, b, T, d) -> (H*b, T, d)``
is `S(0)`), and the result is permuted back. Same values, no communication; `sbp.nn.parallelize` turns
the mode on while a parallelized model runs its forward. Where batch dims are split on several axes (batch
on dp, heads on tp), no order survives the merge, and the mode computes the matmul on the local blocks
(`local_batch_layout`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..runtime.traced import traced_here
from ..tensor.autograd import to_local
from ..tensor.construct import from_local
from ..tensor.global_tensor import GlobalTensor
from ..values.placement import Broadcast, Partial, Split
from .spec import PSUM, B, OpSpec, Rule, Sig


@dataclass(frozen=True, slots=True)
class Contraction:
    """`operands`: (argument name, labels) pairs; `output`: output labels; `bias`: an added argument.

    >>> Contraction((("self", "mk"), ("mat2", "kn")), "mn").equation
    'mk,kn->mn'
    """

    operands: tuple[tuple[str, str], ...]
    output: str
    bias: Optional[str] = None

    @property
    def equation(self) -> str:
        return ",".join(labels for _, labels in self.operands) + "->" + self.output

    def sigs(self, spec: OpSpec, axis: int) -> list[Sig]:
        out = spec.out
        bias = spec.tensor(self.bias) if self.bias else None
        sigs = []
        seen = []
        for _, labels in self.operands:
            seen += [label for label in labels if label not in seen]
        for label in seen:
            placed = {name: Split(labels.index(label)) for name, labels in self.operands if label in labels}
            if label in self.output:
                d = self.output.index(label)
                if bias is not None:
                    k = d - (out.ndim - bias.ndim)
                    placed[self.bias] = Split(k) if k >= 0 and bias.shape[k] == out.shape[d] else B
                sigs.append(spec.sig(placed, (Split(d),)))
            else:
                if bias is not None:
                    placed[self.bias] = PSUM
                sigs.append(spec.sig(placed, (PSUM,)))
        sigs.append(spec.sig({}, (B,)))
        for name, _ in self.operands:
            placed = {name: PSUM}
            if bias is not None:
                placed[self.bias] = PSUM
            sigs.append(spec.sig(placed, (PSUM,)))
        return sigs

    def rule(self) -> Rule:
        doc = self.equation + (f" (+ {self.bias})" if self.bias else "")
        return Rule(self.sigs, doc=f"contraction {doc}")


MM = Contraction((("self", "mk"), ("mat2", "kn")), "mn")
ADDMM = Contraction((("mat1", "mk"), ("mat2", "kn")), "mn", bias="self")
BMM = Contraction((("self", "bmk"), ("mat2", "bkn")), "bmn")
BADDBMM = Contraction((("batch1", "bmk"), ("batch2", "bkn")), "bmn", bias="self")
DOT = Contraction((("self", "k"), ("tensor", "k")), "")
MV = Contraction((("self", "mk"), ("vec", "k")), "m")
ADDMV = Contraction((("mat", "mk"), ("vec", "k")), "m", bias="self")


# ---- torch.matmul with a split batch dim ---------------------------------------------------------------------------
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def split_batch_first(a: Any, b: Any) -> Optional[tuple[int, ...]]:
    """The permutation that moves the split batch dims of ``matmul(a, b)`` to the front, or None when
    there is nothing to move (no global operand, unequal batch shapes, or the split dims already lead).

    Batch dims are all but the last two, equal in both operands (no broadcasting); a batch dim is split
    when either operand splits it on some mesh axis.

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     q = sbp.distribute(torch.ones(2, 4, 3, 5), mesh, "S(1)")     # (batch, heads, tokens, dim)
    ...     return split_batch_first(q, q.transpose(-2, -1)), split_batch_first(q.full(), q.full())
    >>> sbp.testing.spmd(fn, (2,))[0]
    ((1, 0, 2, 3), None)
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.ndim != b.ndim or a.ndim < 3:
        return None
    nb = a.ndim - 2
    if a.shape[:nb] != b.shape[:nb]:
        return None
    split = sorted({p.dim % t.ndim for t in (a, b) if isinstance(t, GlobalTensor)
                    for p in t.placements if isinstance(p, Split) and p.dim % t.ndim < nb})
    perm = tuple(split + [d for d in range(a.ndim) if d not in split])
    return None if perm == tuple(range(a.ndim)) else perm


class SplitBatchMatmul(TorchFunctionMode):
    """While active, ``torch.matmul(a, b)`` / ``a @ b`` of batched global operands whose split batch dims do
    not lead is computed with those dims moved to the front (see the module docstring): torch's reshape to
    `bmm` then keeps the split, and the result, permuted back, has the same values with no collective.

    >>> import sbp, sbp.testing
    >>> x = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    >>> def fn(mesh):
    ...     q = sbp.distribute(x, mesh, "S(1)")
    ...     mesh.binding.counters.reset()
    ...     with SplitBatchMatmul():
    ...         s = q @ q.transpose(-2, -1)
    ...     return s.placements, len(mesh.binding.counters.calls), torch.equal(s.full(), x @ x.transpose(-2, -1))
    >>> sbp.testing.spmd(fn, (2,))[0]
    ((S(1),), 0, True)
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and len(args) == 2 and not kwargs:
            if torch.compiler.is_compiling() and traced_here() and any(isinstance(a, GlobalTensor) for a in args):
                # dynamo: one opaque call (the operands' placements are not values dynamo can read from a
                # tensor made in the graph); AOTAutograd traces the permuted matmul inside
                return _compiled_split_batch_matmul(*args)
            return _split_batch_matmul(*args)
        if func is _CHECKPOINT and args:
            # Compiled activation checkpointing: dynamo turns `checkpoint(body, ...)` into this op and passes
            # it through the modes on the stack. A mode's own handler runs with the mode popped, so the body
            # would run without it (attention's matmuls folding split heads into the batch: collectives
            # eager does not run). The body enters the mode again.
            return func(functools.partial(_with_mode, self, args[0]), *args[1:], **kwargs)
        return func(*args, **kwargs)


_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def _with_mode(mode: TorchFunctionMode, body: Any, *args: Any, **kwargs: Any) -> Any:
    with mode:
        return body(*args, **kwargs)


def local_batch_layout(a: Any, b: Any) -> Optional[tuple[tuple, tuple, tuple]]:
    """For ``matmul(a, b)`` of global operands whose batch dims are split on more than one dim (attention's
    batch on dp and heads on tp, ``(S(0), S(1))``): (output placements, gradient placements of `a`, of `b`)
    when each rank's block of the result is the matmul of its local blocks -- per mesh axis both `B`, both
    `Split` on one batch dim, `a` split on its rows (`b` `B`) or `b` on its columns (`a` `B`); the other
    operand's gradient is then a partial sum there. None otherwise (including one split batch dim, which
    `split_batch_first` keeps whole through torch's merge of the batch dims).

    No batch order keeps two dims split on different axes through that merge (rank (i, j)'s rows of the
    merged ``b*H`` are its batch rows times its heads: no contiguous block), so such a call is computed on
    the local blocks, without the merge.

    >>> import sbp, sbp.testing
    >>> def fn(mesh):
    ...     q = sbp.distribute(torch.ones(2, 4, 3, 5), mesh, "S(0), S(1)")     # (batch, heads, tokens, dim)
    ...     return local_batch_layout(q, q.transpose(-2, -1)), local_batch_layout(q, q.full().transpose(-2, -1))
    >>> sbp.testing.spmd(fn, (2, 2))[0]
    (((S(0), S(1)), (S(0), S(1)), (S(0), S(1))), None)
    """
    if not (isinstance(a, GlobalTensor) and isinstance(b, GlobalTensor)) or a.ndim != b.ndim or a.ndim < 4:
        return None
    nb = a.ndim - 2
    if a.shape[:nb] != b.shape[:nb] or a.mesh != b.mesh:
        return None
    out, ga, gb, batch = [], [], [], set()
    for pa, pb in zip(a.placements, b.placements):
        if isinstance(pa, Broadcast) and isinstance(pb, Broadcast):
            out.append(pa), ga.append(pa), gb.append(pb)
        elif isinstance(pa, Split) and pa is pb and pa.dim < nb:        # one batch dim, split alike
            out.append(pa), ga.append(pa), gb.append(pb)
            batch.add(pa.dim)
        elif isinstance(pa, Split) and pa.dim == nb and isinstance(pb, Broadcast):     # a's rows
            out.append(pa), ga.append(pa), gb.append(Partial())
        elif isinstance(pa, Broadcast) and isinstance(pb, Split) and pb.dim == nb + 1:  # b's columns
            out.append(pb), ga.append(Partial()), gb.append(pb)
        else:
            return None
    return (tuple(out), tuple(ga), tuple(gb)) if len(batch) > 1 else None


def _split_batch_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)`` with the split batch dims moved to the front and back (`split_batch_first`),
    or on the local blocks where several batch dims are split (`local_batch_layout`)."""
    local = local_batch_layout(a, b)
    if local is not None:
        out, ga, gb = local
        # (the gradient placements fit the locals by construction: no check, which symbolic sizes would fail)
        product = torch.matmul(to_local(a, ga, check=False), to_local(b, gb, check=False))
        return from_local(product, a.mesh, out, global_shape=(*a.shape[:-1], b.shape[-1]))
    perm = split_batch_first(a, b)
    if perm is None:
        return torch.matmul(a, b)
    back = tuple(sorted(range(len(perm)), key=perm.__getitem__))
    return torch.matmul(a.permute(perm), b.permute(perm)).permute(back)


def _opaque_split_batch_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunction():   # the mode (still on the stack while a graph traces) is not re-entered
        return _split_batch_matmul(a, b)


_compiled_split_batch_matmul = torch._dynamo.nonstrict_trace(_opaque_split_batch_matmul)
