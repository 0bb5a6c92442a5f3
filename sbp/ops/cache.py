"""The op handler's two caches, as owned objects: spec tokens and decisions.

`SPEC_TOKENS` gives every global tensor spec (placements, global shape, dtype, mesh shape) one token
object, so a call's cache key hashes and compares tokens by identity instead of placement dataclasses.
`DECISIONS` maps a call's key (op, tokens, non-tensor arguments; see `sbp.ops.dispatch`) to the decision
made for it (`sbp.ops.decide.decide`), and, beside it, a call's shape *class* (its sizes as symbols, see
`sbp.ops.dispatch.class_key`) to a `sbp.ops.decide.DecisionClass`, so a new sequence length of a known
class re-uses the class's decision instead of deciding anew. Both are bounded: a full table is cleared
and refilled, which only costs recomputation -- a token is never reused for another spec, and a decision
is a pure function of its key. `clear()` empties them (`sbp.ops.register` clears the decisions and
classes, since a new rule may decide otherwise); `info()` reports their size.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

CACHE_SIZE = 8192   # entries a table holds before it is cleared


class SpecToken:
    """Stands for one global tensor spec in cache keys: compared by identity, never equal to an argument.

    >>> SPEC_TOKENS.token((), (2,), torch.float32, (1,)).spec
    ((), (2,), torch.float32, (1,))
    """

    __slots__ = ("spec",)

    def __init__(self, spec: tuple) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"<spec {self.spec}>"


class SpecTokens:
    """The table of spec tokens: equal specs get the same `SpecToken` object.

    >>> from sbp import S
    >>> spec = ((S(0),), (4, 4), torch.float32, (2,))
    >>> SPEC_TOKENS.token(*spec) is SPEC_TOKENS.token(*spec)
    True
    """

    __slots__ = ("_tokens", "capacity")

    def __init__(self, capacity: int = CACHE_SIZE) -> None:
        self._tokens: dict[tuple, SpecToken] = {}
        self.capacity = capacity

    def token(self, placements: tuple, shape: tuple, dtype: torch.dtype, mesh_shape: tuple) -> SpecToken:
        """The token of one global tensor spec (made on first use)."""
        key = (placements, tuple(shape), dtype, mesh_shape)
        found = self._tokens.get(key)
        if found is None:
            if len(self._tokens) >= self.capacity:
                self._tokens.clear()
            found = self._tokens[key] = SpecToken(key)
        return found

    def clear(self) -> None:
        """Forget every token (tensors holding an old token then simply miss the decision cache once)."""
        self._tokens.clear()

    def info(self) -> dict[str, int]:
        """``{"size": tokens held, "capacity": ...}``."""
        return {"size": len(self._tokens), "capacity": self.capacity}


class DecisionCache:
    """Decisions by call key. `get` is the plain dict lookup (the hot path of every op call); a miss goes
    through `decide_once`, which lets one thread-rank of a process decide while the others wait and reuse it.

    >>> cache = DecisionCache(capacity=2)
    >>> cache.decide_once(("op", 1), str, "decision"), cache.get(("op", 1)), cache.info()["size"]
    ('decision', 'decision', 1)
    >>> cache.clear(); cache.get(("op", 1)) is None
    True
    """

    __slots__ = ("_decisions", "_classes", "_deciding", "get", "capacity", "made", "seconds")

    def __init__(self, capacity: int = CACHE_SIZE) -> None:
        self._decisions: dict[Any, Any] = {}
        self._classes: dict[Any, Any] = {}   # class key -> DecisionClass (read and written under _deciding)
        self._deciding = threading.RLock()   # guards misses only; hits read the dict without it
        self.get = self._decisions.get       # bound once: the same dict for the cache's lifetime
        self.capacity = capacity
        self.made = 0                        # decisions made (misses), for info()
        self.seconds = 0.0                   # CPU time making them (the deciding thread's), for info()

    def decide_once(self, key: Any, make: Callable[..., Any], *args: Any) -> Any:
        """The decision for `key`, made with `make(*args)` unless another thread made it meanwhile; a key of
        None (an unhashable call) is decided without caching."""
        with self._deciding:
            found = self._decisions.get(key) if key is not None else None
            if found is None:
                start = time.thread_time()
                found = make(*args)
                self.seconds += time.thread_time() - start
                self.made += 1
                if key is not None:
                    if len(self._decisions) >= self.capacity:
                        self._decisions.clear()
                    self._decisions[key] = found
            return found

    def class_get(self, key: Any) -> Any:
        """The record of a shape class (None when unknown); call it inside `decide_once`'s `make`.

        >>> cache = DecisionCache(); cache.class_put("k", 1); cache.class_get("k"), cache.info()["classes"]
        (1, 1)
        """
        return self._classes.get(key)

    def class_put(self, key: Any, record: Any) -> None:
        """Keep the record of a shape class (the table is cleared when full, like the decisions)."""
        with self._deciding:
            if len(self._classes) >= self.capacity:
                self._classes.clear()
            self._classes[key] = record

    def clear(self) -> None:
        """Forget every decision and shape class (after a rule changes; tests use it to see fallback
        warnings again)."""
        with self._deciding:
            self._decisions.clear()
            self._classes.clear()

    def info(self) -> dict[str, int | float]:
        """``{"size": decisions held, "capacity": ..., "made": decisions made since start, "seconds": the CPU
        time making them took, "classes": shape classes held}`` (`made` and `seconds` tell what new shapes
        cost: a new shape of a known class is a decision made from its class, see `sbp.ops.dispatch`)."""
        return {"size": len(self._decisions), "capacity": self.capacity, "made": self.made,
                "seconds": self.seconds, "classes": len(self._classes)}


SPEC_TOKENS = SpecTokens()
DECISIONS = DecisionCache()


# the ops whose fallback has warned (`Decision._complain`: once per op, not per decision)
WARNED_OPS: set = set()


def clear_cache() -> None:
    """Forget every cached decision (`DECISIONS.clear()`) and which ops' fallbacks have warned.

    >>> clear_cache(); DECISIONS.info()["size"]
    0
    """
    DECISIONS.clear()
    WARNED_OPS.clear()
