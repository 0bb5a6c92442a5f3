"""`sbp.strict()`: turn the fallback of ops without a rule into `sbp.UnsupportedOpError`.

The state is a `contextvars.ContextVar`, never a module-level flag.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from ..runtime.agreement import backward_on_this_thread
from ..values.errors import SbpError

_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("sbp_strict", default=False)


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Inside this context an op without a sharding rule raises `sbp.UnsupportedOpError` instead of
    running on Broadcast inputs with a warning.

    The state lives in a `contextvars.ContextVar`, not a global flag: it holds for the current context
    (thread or asyncio task). The threads SPMD backend starts each rank in a copy of the caller's
    context, so ``with sbp.strict(): sbp.testing.spmd(fn, ...)`` covers the ranks too.

    >>> import sbp
    >>> with sbp.strict():
    ...     pass  # ops here must have rules
    """
    if not isinstance(enabled, bool):   # a truthy "no" would turn strict mode on
        raise SbpError(f"sbp.strict(enabled) takes a bool, got {enabled!r}")
    token = _STRICT.set(enabled)
    try:
        with backward_on_this_thread(enabled):   # CUDA backward threads do not see this ContextVar
            yield
    finally:
        _STRICT.reset(token)


def is_strict() -> bool:
    """Whether `strict()` is active in the current context.

    >>> import sbp
    >>> with sbp.strict():
    ...     sbp.ops.is_strict()
    True
    """
    return _STRICT.get()
