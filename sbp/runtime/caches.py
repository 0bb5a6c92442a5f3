"""The runtime's memos in one place: `cache_info()` reports them, `clear_caches()` empties them.

Each memo is a bounded `functools.lru_cache` of a pure function of its arguments (plans for normalised
arguments, buffer layouts of a step on a coord, plan signatures), owned by the module that computes it;
this module only lists them. Clearing is never needed for correctness: the same arguments give the same
values. The planning layer has its own pair (`sbp.planning.clear_caches`, `sbp.planning.cache_info`);
the executor's plans come through `sbp.plan`, so a new shape of a known shape class costs the class
memo's arithmetic there (`sbp.planning.classes`), not a search. Every memo here is keyed by exact global
shapes: a new sequence length adds one entry to each memo it meets (4,096 each at most).

>>> clear_caches()
>>> info = cache_info()
>>> sorted(info)[:2], info["executor.cached_plan"]["maxsize"]
(['agreement.plan_signature', 'buffers.exchange_layout'], 4096)
"""
from __future__ import annotations

from . import agreement, buffers, executor

MEMOS = {
    "executor.cached_plan": executor.cached_plan,
    "buffers.gather": buffers.gather,
    "buffers.scatter": buffers.scatter,
    "buffers.exchange_layout": buffers.exchange_layout,
    "buffers.p2p_layout": buffers.p2p_layout,
    "buffers.messages_copy_nothing": buffers.messages_copy_nothing,
    "buffers.group_moves": buffers.group_moves,
    "agreement.plan_signature": agreement.plan_signature,
}


def cache_info() -> dict[str, dict[str, int | None]]:
    """Hits, misses, current size and bound of every runtime memo, by name.

    >>> cache_info()["buffers.gather"]["maxsize"]
    4096
    """
    return {name: fn.cache_info()._asdict() for name, fn in MEMOS.items()}


def clear_caches() -> None:
    """Empty every runtime memo.

    >>> clear_caches(); cache_info()["executor.cached_plan"]["currsize"]
    0
    """
    for fn in MEMOS.values():
        fn.cache_clear()
