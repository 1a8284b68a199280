"""Copy-aware drafting: drafts looked up in the context itself (prompt lookup, suffix matching).

Agent and editing replies re-emit spans of their context (a file rewritten with
a few changes, a quoted tool result, a JSON object echoed with one field
changed). `LookupIndex` holds the token sequence so far (prompt, conversation,
output) and proposes what followed the longest suffix of it (at least
`min_match` tokens) where that suffix occurred before: most recent occurrence
first, cut at `limit` tokens; a continuation that reaches the end of the
sequence goes on copying what it has just proposed (a repeating span repeats,
as LZ77 copies overlap). It is incremental: each token appended indexes
the n-grams ending just before it (`min_match`..`max_match` tokens), so a
proposal costs a few dictionary lookups and nothing is rescanned; tokens
appended wait until the index is next read (a span source the policy rests
is not asked for many cycles: their indexing then runs in one call). Each indexed
occurrence remembers the one before it, so cutting the sequence back (a
conversation's re-rendered turn) trims the index in place: an n-gram whose
latest occurrence was cut falls back to its latest one before the cut, or goes
(the index is then exactly the one built from the kept tokens). `nbytes`
counts what it holds. A lookup draft is a point mass (q one-hot): the acceptor
verifies it like any deterministic proposer's, exactly under sampling too.
`LookupProposer` is the index as a proposer (`proposers.base`): it offers a
span only where the context matches (`offer` returns 0 otherwise), and follows
the committed tokens (`commit`).
"""

from __future__ import annotations

import sys
from array import array

import mlx.core as mx

from .base import Proposal

MIN_MATCH = 3  # shorter suffixes match too often by chance
MAX_MATCH = 8  # longer ones add nothing: an 8-token match is already specific
INT_BYTES = sys.getsizeof(2**20)  # a token id or position beyond CPython's cached small integers


class LookupIndex:
    def __init__(self, tokens: list[int] | None = None, *, min_match: int = MIN_MATCH, max_match: int = MAX_MATCH):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match} and {max_match}.")
        self.min_match, self.max_match = min_match, max_match
        self._seq: list[int] = []  # the tokens indexed
        self._waiting: list[int] = []  # tokens appended after them, indexed when the index is next read
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest indexed occurrence ends
        # per n-gram length n: entry e - (n - 1) is where the occurrence before the one ending at e ends (-1: none)
        self._before = [array("q") for _ in range(min_match, max_match + 1)]
        self._key_bytes = 0  # the n-gram tuples the table holds
        self._tuple_bytes = [sys.getsizeof(tuple(range(n))) for n in range(min_match, max_match + 1)]
        self.extend(tokens or [])

    def __len__(self) -> int:
        return len(self._seq) + len(self._waiting)

    @property
    def tokens(self) -> list[int]:
        """The token sequence (every token appended, indexed)."""
        self._catch_up()
        return self._seq

    def _catch_up(self) -> None:
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            self._index(waiting)

    def _lengths(self):
        """(n, its `_before` array, the bytes of an n-gram's tuple) for every indexed n-gram length."""
        return zip(range(self.min_match, self.max_match + 1), self._before, self._tuple_bytes)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (indexed when the index is next read)."""
        self._waiting.extend(map(int, tokens))

    def _index(self, tokens: list[int]) -> None:
        """Index appended tokens: each one indexes the n-grams that end right before it (so the sequence's own
        suffix stays unindexed, and a lookup of it finds an earlier occurrence). (Per end, one slice of the
        longest n-gram, the shorter ones its tails.)"""
        seq, ends, lowest = self._seq, self._ends, self.min_match
        first = len(seq) - 1  # the first end not indexed yet: the last token before these
        seq.extend(tokens)
        for end in range(max(first, lowest - 1), len(seq) - 1):
            top = min(self.max_match, end + 1)
            longest = tuple(seq[end - top + 1 : end + 1])
            for n in range(lowest, top + 1):
                gram = longest[top - n :]
                previous = ends.get(gram, -1)
                self._before[n - lowest].append(previous)
                ends[gram] = end
                if previous < 0:
                    self._key_bytes += self._tuple_bytes[n - lowest]

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (a session cut back to a common prefix), trimmed in place: each
        occurrence cut goes, its n-gram falling back to the occurrence before it (or leaving the table)."""
        self._catch_up()
        seq, ends = self._seq, self._ends
        length = max(length, 0)
        if length >= len(seq):
            return
        for n, before, size in self._lengths():
            start = max(length - 1, n - 1)  # the first end that goes (the kept sequence's own suffix too)
            for end in range(len(seq) - 2, start - 1, -1):  # latest first: each one is its n-gram's latest
                gram = tuple(seq[end - n + 1 : end + 1])
                previous = before[end - n + 1]
                if ends.get(gram) != end:
                    continue
                if previous >= 0:
                    ends[gram] = previous
                else:
                    del ends[gram]
                    self._key_bytes -= size
            del before[max(start - n + 1, 0) :]
        del seq[length:]

    def follow(self, tokens: list[int]) -> None:
        """Hold `tokens`: cut back to what they share with the indexed tokens, then extended."""
        shared = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            shared += 1
        self.truncate(shared)
        self.extend(tokens[len(self.tokens) :])
        self._catch_up()  # (a prompt is read at once: its first cycle asks for a span)

    def copy(self) -> LookupIndex:
        """An independent index of the same tokens (a copied conversation's): copied, not rebuilt."""
        self._catch_up()
        other = LookupIndex(min_match=self.min_match, max_match=self.max_match)
        other._seq, other._ends = list(self._seq), dict(self._ends)
        other._before = [array("q", b) for b in self._before]
        other._key_bytes = self._key_bytes
        return other

    @property
    def nbytes(self) -> int:
        """Bytes of what the index holds: its table (the hash table, n-gram tuples, positions: one per end,
        shared by the n-grams ending there), the tokens and the occurrence chains. Token ids are counted as its
        own (a copy counts them again)."""
        self._catch_up()
        positions = min(len(self._ends), len(self._seq))
        table = sys.getsizeof(self._ends) + self._key_bytes + INT_BYTES * positions
        tokens = sys.getsizeof(self._seq) + INT_BYTES * len(self._seq)
        return table + tokens + sum(sys.getsizeof(b) for b in self._before)

    def match(self) -> tuple[int, int]:
        """(length of the longest indexed suffix match, where that occurrence ends), or (0, -1). (Asked every
        cycle: a suffix whose shortest n-gram never occurred has no longer match, so that one is asked first.)"""
        seq = self.tokens
        if len(seq) < self.min_match or tuple(seq[len(seq) - self.min_match :]) not in self._ends:
            return 0, -1
        for n in range(min(self.max_match, len(seq)), self.min_match - 1, -1):
            end = self._ends.get(tuple(seq[len(seq) - n :]))
            if end is not None:
                return n, end
        return 0, -1

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest earlier occurrence of the sequence's suffix
        (none when no suffix of at least `min_match` tokens occurred before)."""
        n, end = self.match()
        if n == 0 or limit < 1:
            return []
        seq, out = self.tokens, self.tokens[end + 1 : end + 1 + limit]
        while len(out) < limit:  # the occurrence runs into the suffix itself: copy on from what is proposed
            out.append(out[end + 1 + len(out) - len(seq)])
        return out


class LookupProposer:
    """A `LookupIndex` as a proposer: spans copied from the context, point masses (q one-hot).

    It reads no target features (`layer_ids` is empty) and keeps no state of
    its own beyond the index, which a session keeps across generations
    (`Session.lookup_source`): `start` brings the index in step with the
    prompt (a chat's next turn extends it; a prompt that diverges cuts it
    back to what they share), `commit` extends it with each cycle's tokens.
    """

    name = "lookup"
    layer_ids: tuple[int, ...] = ()
    block_size = MAX_MATCH + 1  # (a hint only: its spans are as long as the verify allows)

    def __init__(self, index: LookupIndex):
        self.index = index
        self._span: tuple[int, int, list[int]] | None = None  # (index length, limit asked, span)

    def start(self, target, prompt, reused: int = 0) -> None:
        self.index.follow(prompt.tolist() if isinstance(prompt, mx.array) else list(prompt))
        self._span = None

    def add_context(self, features) -> None:
        pass

    def state(self) -> list:
        return []

    def commit(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def fork(self, context: bool = False) -> LookupProposer:
        if context:
            return LookupProposer(self.index.copy())
        return LookupProposer(LookupIndex(min_match=self.index.min_match, max_match=self.index.max_match))

    def _spanned(self, count: int) -> list[int]:
        """The span after the sequence's end, at most `count` tokens: asked of the index once per
        length of the sequence (a span for a smaller limit is the prefix of a larger one)."""
        length = len(self.index)
        if self._span is None or self._span[0] != length or self._span[1] < count:
            self._span = (length, count, self.index.propose(count))
        return self._span[2][:count]

    def offer(self, count: int) -> int:
        return len(self._spanned(count)) if count > 0 else 0

    def propose(self, anchor, position: int, count: int, *, sampling=None, key=None) -> Proposal:
        """The span after the anchor (the sequence's last token, committed): a point mass."""
        return Proposal(tokens=mx.array(self._spanned(count), mx.int32))

    def span(self, count: int) -> list[int]:
        """The same span on the host (the planner verifies it without a device round trip)."""
        return self._spanned(count)
