"""The server's one byte budget: everything it keeps counts against it, and the least recently used goes first.

``--max-batch-bytes`` (default `limits.memory_budget`: 3/4 of the device's
memory) bounds the sum of the parts registered with the worker's
`MemoryBudget`, in every worker mode: the weights, the requests being
generated (their sessions), the prompt cache (sessions with their lookup
indexes), the Responses API's stored conversations and the compiled grammars.
Whatever else the server comes to keep registers the same way. A part is any
object with

- ``nbytes``: its bytes now, an int cheap to read from any thread (no device
  work: a part records sizes as entries come in);

and, when it can give memory back (an LRU of entries),

- ``oldest()``: when its least recently used entry was last used
  (``time.monotonic()``), None when it has nothing to give;
- ``evict_oldest()``: drop that entry.

`make_room(wanted)` evicts the least recently used entry of all the parts,
one at a time, until `wanted` more bytes fit, and says whether they do;
`enforce()` (`make_room(0)`) is called by whoever made a part grow. `usage()`
is what ``/health`` shows.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict


class Bytes:
    """A part that is a plain count (the weights; the sessions being generated, set by the worker)."""

    def __init__(self, nbytes: int = 0):
        self.nbytes = nbytes


class Counted:
    """A part counted but never evicted by the budget (a sharded server's prompt cache: its ranks must
    evict alike, by the cache's own bounds)."""

    def __init__(self, part):
        self.part = part

    @property
    def nbytes(self) -> int:
        return self.part.nbytes


class MemoryBudget:
    def __init__(self, total: int):
        if total < 0:
            raise ValueError(f"the memory budget must be >= 0 bytes, got {total}.")
        self.total = total
        self._parts: dict[str, object] = {}
        self._lock = threading.Lock()

    def register(self, name: str, part) -> None:
        """Count `part` (see the module docstring) under `name`."""
        with self._lock:
            if name in self._parts:
                raise ValueError(f"a part named {name!r} is counted already.")
            self._parts[name] = part

    @property
    def used(self) -> int:
        return sum(part.nbytes for part in list(self._parts.values()))

    def make_room(self, wanted: int = 0) -> bool:
        """Evict least recently used entries until `wanted` more bytes fit; whether they do."""
        with self._lock:
            while self.used + wanted > self.total:
                part, when = self._oldest()
                if part is None:
                    return False
                before = part.nbytes
                part.evict_oldest()
                if part.nbytes >= before and part.oldest() == when:  # (a part that gave nothing back)
                    return False
            return True

    def enforce(self) -> bool:
        """Evict until everything fits (after a part grew); whether it does."""
        return self.make_room(0)

    def _oldest(self) -> tuple[object | None, float | None]:
        best, first = None, None
        for part in self._parts.values():
            oldest = getattr(part, "oldest", None)
            when = oldest() if oldest is not None else None
            if when is not None and (first is None or when < first):
                best, first = part, when
        return best, first

    def usage(self) -> dict:
        """Bytes per part, in all and the budget (what /health shows)."""
        parts = {name: part.nbytes for name, part in list(self._parts.items())}
        return {"budget_bytes": self.total, "used_bytes": sum(parts.values()), "parts": parts}


def python_bytes(value) -> int:
    """Bytes of a JSON-like Python value (dicts, lists, strings, numbers), each object counted once."""
    seen, total, stack = set(), 0, [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


class Kept:
    """At most `size` entries by key, least recently used first, each counted at its bytes: a part of a
    `MemoryBudget` that gives room back (`oldest`, `evict_oldest`), whose `put` asks the budget (when given)
    to make room. Safe from any thread."""

    def __init__(self, size: int, budget: MemoryBudget | None = None):
        self.size, self.budget = size, budget
        self._entries: OrderedDict = OrderedDict()  # key -> (value, bytes, last used)
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key):
        """The entry's value, now the most recently used (None: not kept)."""
        with self._lock:
            if key not in self._entries:
                return None
            value, size, _ = self._entries.pop(key)
            self._entries[key] = (value, size, time.monotonic())
            return value

    def put(self, key, value, nbytes: int) -> None:
        with self._lock:
            self._drop(key)
            self._entries[key] = (value, nbytes, time.monotonic())
            self._bytes += nbytes
            while len(self._entries) > self.size:
                self._drop(next(iter(self._entries)))
        if self.budget is not None:
            self.budget.enforce()

    def oldest(self) -> float | None:
        with self._lock:
            return next(iter(self._entries.values()))[2] if self._entries else None

    def evict_oldest(self) -> None:
        with self._lock:
            if self._entries:
                self._drop(next(iter(self._entries)))

    def _drop(self, key) -> None:
        kept = self._entries.pop(key, None)
        if kept is not None:
            self._bytes -= kept[1]
