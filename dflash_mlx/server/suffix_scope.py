"""Which suffix index a request drafts from and records in (``serve --suffix-scope``, ``--suffix-cache-tokens``).

The server keeps what it generated in suffix indexes (`proposers.suffix`), each
bounded by ``--suffix-cache-tokens`` tokens (least recently used sequences
first), so a request that produces what an earlier one produced drafts it:

- ``server``: one index for every request (the default without API keys);
- ``key``: one per API key (the default with keys): one key's replies never
  draft another key's;
- ``conversation``: each conversation's session in the prompt cache holds its
  own (`SuffixIndex(private=True)`, counted in the session's bytes): only
  what this conversation produced before drafts (a retried step, a later
  turn); a conversation is requests each of whose prompts contains the one
  before (`session.Session.span_sources`).

A draft is accepted only where the target would produce the same token, so
no text can leak (a seeded request's draws are keyed by position,
`dflash_mlx.acceptance`); timing can (docs/serving.md).
`nbytes`, `oldest` and `evict_oldest` are the shared indexes' together: one
part of the server's byte budget (`budget`, "suffix_index" in ``/health``),
which takes their least recently used sequences back as it takes the prompt
cache's oldest conversations; the conversations' indexes count in their
sessions. A request's index is chosen as it is prepared, in its handler's
thread (`prompts.Prepared.suffix`).
"""

from __future__ import annotations

import threading

from ..proposers.suffix import SuffixIndex

SCOPES = ("server", "key", "conversation")


class SuffixScopes:
    def __init__(self, scope: str | None, max_tokens: int, keys: int = 0):
        """`scope`: one of SCOPES (None: "key" with API keys, else "server"); `max_tokens`: each index's
        budget (>= 1); `keys`: how many API keys the server accepts."""
        scope = scope or ("key" if keys else "server")
        if scope not in SCOPES:
            raise ValueError(f"--suffix-scope: expected one of {', '.join(SCOPES)}, got {scope!r}.")
        if scope == "key" and not keys:
            raise ValueError("--suffix-scope key: the server has no API key to scope by (--api-key, --api-keys-file).")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"--suffix-cache-tokens: expected an integer >= 1 (0: none), got {max_tokens!r}.")
        self.scope, self.max_tokens = scope, max_tokens
        self._indexes: dict = {}  # None (the server's) or a key's number -> its index
        self._lock = threading.Lock()

    def for_request(self, key: int | None) -> SuffixIndex | None:
        """The index a request sent with API key number `key` uses (None: its conversation's own)."""
        if self.scope == "conversation":
            return None
        owner = key if self.scope == "key" else None
        with self._lock:
            if owner not in self._indexes:
                self._indexes[owner] = SuffixIndex(self.max_tokens)
            return self._indexes[owner]

    def conversation_index(self) -> SuffixIndex | None:
        """A new session's own index (scope "conversation"), else None."""
        return SuffixIndex(self.max_tokens, private=True) if self.scope == "conversation" else None

    def _shared(self) -> list[SuffixIndex]:
        with self._lock:
            return list(self._indexes.values())

    @property
    def tokens(self) -> int:
        return sum(index.tokens for index in self._shared())

    @property
    def nbytes(self) -> int:
        return sum(index.nbytes for index in self._shared())

    def oldest(self) -> float | None:
        """When the least recently used sequence of any shared index was last used (None: all empty)."""
        times = [t for index in self._shared() if (t := index.oldest()) is not None]
        return min(times, default=None)

    def evict_oldest(self) -> None:
        """Drop the least recently used sequence of all the shared indexes."""
        indexes = self._shared()
        ages = [(t, k) for k, index in enumerate(indexes) if (t := index.oldest()) is not None]
        if ages:
            indexes[min(ages)[1]].evict_oldest()

    def card(self) -> dict:
        """What `/v1/models` says of it."""
        return {"scope": self.scope, "max_tokens": self.max_tokens, "tokens": self.tokens, "bytes": self.nbytes}
