"""The server's prompt cache: an LRU of sessions (one per conversation), bounded by count and bytes.

Each entry is a `dflash_mlx.session.Session`: the target's caches, the
drafter's context, the checkpoint of ring / Gated DeltaNet state and the
lookup index of copy-aware drafting. `take(prompt)` hands out the session
that keeps the longest prefix of the prompt (`Session.usable_prefix`):

- a session whose whole last prompt the new prompt keeps (a conversation's
  next turn, even when the re-rendered reply tokenizes differently) is taken
  out and cut back to the common prefix;
- one that shares less (another conversation with the same system prompt and
  tools, an edited or regenerated turn) is copied (`Session.copy`) when the
  shared part is at least `MIN_SHARED` tokens, so its own conversation keeps it;
- otherwise a fresh session.

`put(session)` files it back as the most recent; the least recently used go
while there are more than `max_sessions` or they hold more than `max_bytes`
(the session being generated with is not counted: it is out of the cache).
mlx_lm.server's flags and defaults: ``--prompt-cache-size 10``, no byte bound.
The cache is also a part of the server's byte budget (`budget`): `nbytes`
(each session's bytes, recorded when it is filed), `oldest` and
`evict_oldest`, safe from any thread. An optional `store`
(`session_store.SessionStore`) keeps the cache on disk.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable

from ..session import Session
from ..targets.rollback import trimmable

MIN_SHARED = 32  # tokens a different conversation must share before its session is copied
DEFAULT_SESSIONS = 10  # mlx_lm.server's --prompt-cache-size


class PromptCache:
    def __init__(
        self,
        make: Callable[[], Session],
        *,
        max_sessions: int = DEFAULT_SESSIONS,
        max_bytes: int | None = None,
        store=None,
    ):
        if max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {max_sessions}.")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}.")
        self.make, self.max_sessions, self.max_bytes, self.store = make, max_sessions, max_bytes, store
        self._sessions: OrderedDict[int, Session] = OrderedDict()  # least recently used first
        self._sizes: dict[int, tuple[int, float]] = {}  # key -> (bytes when filed, when filed)
        self._names: weakref.WeakKeyDictionary[Session, str] = weakref.WeakKeyDictionary()  # its file in the store
        self._lock = threading.Lock()
        if store is not None:
            for name, session in store.load(make):
                self._add(session)
                self._names[session] = name
            with self._lock:
                self._evict()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in list(self._sizes.values()))

    def take(self, prompt: list[int]) -> Session:
        """The session to generate `prompt` with (out of the cache until `put` back)."""
        with self._lock:
            best, keep = None, 0
            for key, session in self._sessions.items():
                n = session.usable_prefix(prompt)
                if n > keep or (n == keep and best is not None and n):  # ties: the most recent
                    best, keep = key, n
            if best is None:
                return self.make()
            session = self._sessions[best]
            if keep >= session.prompt_length:  # this conversation's next turn (it held at least that prompt)
                self._pop(best)
                return session
        if keep >= MIN_SHARED:  # (copied outside the lock: the cache keeps the original)
            try:
                return session.copy()
            except RuntimeError as e:  # a proposer without fork(context=True)
                logging.warning("Prompt cache: cannot branch a cached conversation (%s)", e)
        return self.make()

    def put(self, session: Session) -> None:
        """File `session` back as the most recent; evict beyond the bounds."""
        if not session.tokens:
            return
        name = None
        if self.store is not None:
            name = self.store.save(session, self._names.get(session))
        with self._lock:
            if session.cache is not None and all(trimmable(c) for c in session.cache):
                for key, other in list(self._sessions.items()):  # prefixes of it only take room
                    if other.tokens == session.tokens[: len(other.tokens)]:
                        self._forget(self._pop(key))
            if name is not None:
                self._names[session] = name
            self._add(session)
            self._evict()

    def oldest(self) -> float | None:
        """When the least recently used session was filed (None: the cache is empty)."""
        with self._lock:
            key = next(iter(self._sessions), None)
            return None if key is None else self._sizes[key][1]

    def evict_oldest(self) -> None:
        with self._lock:
            if self._sessions:
                self._forget(self._pop(next(iter(self._sessions))))

    def _add(self, session: Session) -> None:
        key = id(session)
        self._sessions[key] = session
        self._sessions.move_to_end(key)
        self._sizes[key] = (session.nbytes, time.monotonic())

    def _pop(self, key: int) -> Session:
        del self._sizes[key]
        return self._sessions.pop(key)

    def _forget(self, session: Session) -> None:
        name = self._names.pop(session, None)
        if name is not None and self.store is not None:
            self.store.delete(name)

    def _evict(self) -> None:
        """Evict the least recently used beyond the bounds."""
        while self._sessions and (
            len(self._sessions) > self.max_sessions or (self.max_bytes is not None and self.nbytes > self.max_bytes)
        ):
            self._forget(self._pop(next(iter(self._sessions))))
