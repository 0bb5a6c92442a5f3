"""Operators on global tensors: SBP signature rules at the ATen level, the one op path of sbp.

`install()` plugs `handle` into `GlobalTensor.__torch_dispatch__` (`sbp.tensor.global_tensor.set_op_handler`)
and the direct-path operators into `GlobalTensor` (`sbp.ops.direct`); ``import sbp`` calls it on the first
use of a torch-level name (`sbp.load_torch_layers`). Every ATen op on a global tensor then looks up its
rule (`sbp.ops.table`: one row per op, pointwise ops by tag, ``_foreach_*`` by name), picks the cheapest
signature for the inputs' placements (planner bytes), redistributes what must move and runs locally; an
op without a rule runs on Broadcast inputs with a one-time warning (the one fallback, `sbp.ops.decide`).
Decisions are cached in `DECISIONS` (`sbp.ops.cache`). See docs/operators.md for the signature table and
how to add a rule.

>>> import sbp
>>> sbp.ops.table.lookup(torch.ops.aten.mm.default).doc
'contraction mk,kn->mn'
"""
import torch  # noqa: F401 - the docstring example uses it

from ..tensor.global_tensor import get_op_handler, set_op_handler
from . import direct
from .cache import DECISIONS, clear_cache
from .dispatch import handle
from .spec import ANY, Call, Choice, OpSpec, Rule, Sig
from .strict import is_strict, strict
from .table import TABLE, lookup, register


def install() -> None:
    """Wire the operator rules into `GlobalTensor`: the dispatch handler and the direct-path methods.

    Idempotent; `sbp.load_torch_layers` calls it, so a program that uses ``sbp.<name>`` never has to.

    >>> install(); is_installed()
    True
    """
    set_op_handler(handle)
    direct.install()


def is_installed() -> bool:
    """Whether `install` has wired the operator rules into `GlobalTensor`.

    >>> import sbp; sbp.load_torch_layers(); is_installed()
    True
    """
    return get_op_handler() is handle

__all__ = ["ANY", "Call", "Choice", "DECISIONS", "OpSpec", "Rule", "Sig", "TABLE", "clear_cache", "handle", "install",
           "is_installed", "is_strict", "lookup", "register", "strict"]

# importing the rule table is using it: `import sbp.nn` (which imports this) right after `import sbp` reaches
# sbp's torch layers without going through `sbp.<name>`, and ops on global tensors must work there too
install()
