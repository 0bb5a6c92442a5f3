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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..values.placement import Split
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
