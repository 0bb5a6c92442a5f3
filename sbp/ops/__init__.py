"""Operators on global tensors: SBP signature rules at the ATen level.

Importing this package plugs `handle` into `GlobalTensor.__torch_dispatch__` (`sbp.tensor.set_op_handler`).
Every ATen op on a global tensor then looks up its rule (`sbp.ops.rules.TABLE`, pointwise ops by tag),
picks the cheapest signature for the inputs' placements (planner bytes), redistributes what must move
and runs locally. See docs/operators.md for the signature table and how to add a rule.

>>> import sbp
>>> sbp.ops.rules.lookup(torch.ops.aten.mm.default).doc
'contraction mk,kn->mn'
"""
import torch

from ..tensor import set_op_handler
from .dispatch import clear_cache, handle
from . import direct
from .strict import is_strict, strict
from .rules import TABLE, lookup, register
from .spec import ANY, Call, Choice, OpSpec, Rule, Sig

set_op_handler(handle)
direct.install()

__all__ = ["ANY", "Call", "Choice", "OpSpec", "Rule", "Sig", "TABLE", "clear_cache", "handle", "is_strict", "lookup",
           "register", "strict"]
