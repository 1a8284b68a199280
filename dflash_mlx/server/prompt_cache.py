"""The server's prompt cache: an LRU of sessions (one per conversation), bounded by count and bytes.

Each entry is a `dflash_mlx.session.Session`: the target's caches, the
drafter's context and the checkpoint of ring / Gated DeltaNet state.
`take(prompt)` hands out the session that keeps the longest prefix of the
prompt (`Session.usable_prefix`):

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
An optional `store` (`session_store.SessionStore`) keeps the cache on disk.
"""

from __future__ import annotations

import logging
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
        self._names: weakref.WeakKeyDictionary[Session, str] = weakref.WeakKeyDictionary()  # its file in the store
        if store is not None:
            for name, session in store.load(make):
                self._add(session, name)
            self._evict()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._sessions.values())

    def take(self, prompt: list[int]) -> Session:
        """The session to generate `prompt` with (out of the cache until `put` back)."""
        best, keep = None, 0
        for key, session in self._sessions.items():
            n = session.usable_prefix(prompt)
            if n > keep or (n == keep and best is not None and n):  # ties: the most recent
                best, keep = key, n
        if best is None:
            return self.make()
        session = self._sessions[best]
        if keep >= session.prompt_length:  # this conversation's next turn (it held at least that prompt)
            del self._sessions[best]
            return session
        if keep >= MIN_SHARED:
            try:
                return session.copy()
            except RuntimeError as e:  # a proposer without fork(context=True)
                logging.warning("Prompt cache: cannot branch a cached conversation (%s)", e)
        return self.make()

    def put(self, session: Session) -> None:
        """File `session` back as the most recent; evict beyond the bounds."""
        if not session.tokens:
            return
        if session.cache is not None and all(trimmable(c) for c in session.cache):
            for key, other in list(self._sessions.items()):  # prefixes of it only take room
                if other.tokens == session.tokens[: len(other.tokens)]:
                    del self._sessions[key]
                    self._forget(other)
        if self.store is not None:
            self._names[session] = self.store.save(session, self._names.get(session))
        self._sessions[id(session)] = session
        self._evict()

    def trim_to(self, max_bytes: int) -> None:
        """Evict the least recently used sessions until the cache holds at most `max_bytes`."""
        self._evict(max_bytes)

    def _add(self, session: Session, name: str) -> None:
        self._sessions[id(session)] = session
        self._names[session] = name

    def _forget(self, session: Session) -> None:
        name = self._names.pop(session, None)
        if name is not None and self.store is not None:
            self.store.delete(name)

    def _evict(self, max_bytes: int | None = None) -> None:
        """Evict the least recently used beyond the bounds (and beyond `max_bytes`, when given)."""
        bounds = [b for b in (self.max_bytes, max_bytes) if b is not None]
        limit = min(bounds) if bounds else None
        while self._sessions and (
            len(self._sessions) > self.max_sessions or (limit is not None and self.nbytes > limit)
        ):
            self._forget(self._sessions.popitem(last=False)[1])
