"""Suffix drafting across requests: what earlier generations produced drafts what this one produces again.

Agent loops produce the same text again and again across requests: the same
tool calls and JSON shapes, a retried step, a sibling sub-agent doing the same
work. `SuffixIndex` keeps what generations produced, shared by every
generation given it (a server's scope, an agent loop's calls), bounded in
tokens (the least recently used sequences go first); `SuffixProposer` is one
generation's span source over it, named "suffix" (after SuffixDecoding, Arctic
Inference), beside the per-conversation copy index (`proposers.lookup`).

Each generation is one sequence in the index: the last MAX_MATCH tokens of its
prompt (so a reply's first tokens can be drafted), then its tokens as they are
committed. Every MIN_MATCH-gram with a continuation is indexed (its
MAX_OCCURRENCES most recent occurrences). A lookup takes the sequence's last
MIN_MATCH tokens, measures how deep each occurrence matches the sequence's end
(up to MAX_MATCH tokens), and for each depth walks the continuation that the
occurrences matching at least that deep agree on most (frequency; a tie goes
to the most recently used sequence). Each token's probability is its share of
the occurrences still on the path times the rate at which drafts from matches
of that depth were accepted so far (`observe`: learnt from every generation
using the index, from a prior that trusts deeper matches more); the span ends
where the product of the probabilities falls below MIN_PROB, or after
SPAN_FACTOR x depth tokens: a deep match is trusted further. The depth whose
span expects the most accepted tokens wins (SuffixDecoding's score), and that
expectation is what the policy weighs the span by (`expected_tokens`). A depth
whose rate withholds its spans fades towards its prior with each span
withheld, so it is tried again.

Drafts are point masses (q one-hot): exact under sampling too. A draft from
another conversation is accepted only where the target would produce the same
token, so greedy text cannot leak, nor sampled text: an unseeded call's
distribution, and a seeded call's draws (keyed by position, `acceptance`), are
the target's whatever is drafted. One lock guards the index (the batched server's rows,
threads of a library user). `nbytes` counts what it holds; `oldest` and
`evict_oldest` let a memory budget take sequences back.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

from .base import Proposal

MIN_MATCH = 4  # the shortest match drafted (across requests a shorter one matches by chance)
MAX_MATCH = 32  # the deepest match measured, and the prompt tokens a sequence starts with
MAX_OCCURRENCES = 16  # the most recent occurrences of an n-gram kept (frequency among recent ones)
SPAN_FACTOR = 1.0  # a span is at most this many tokens per matched token (SuffixDecoding's default)
MIN_PROB = 0.1  # a span ends where its next token's probability falls below this
DEFAULT_TOKENS = 100_000  # the default budget: a few hundred replies, about 20 MB
DEPTH_CLASSES = (MIN_MATCH, 8, 16, MAX_MATCH)  # acceptance is learnt per class of depth: 4-7, 8-15, 16-31, 32
# a class's acceptance per token before its spans were verified: the deeper the match, the likelier the same text
# follows (a whole MAX_MATCH window repeated is a repeat); corrected after a few spans (PRIOR_WEIGHT)
PRIOR_RATES, PRIOR_WEIGHT = (0.5, 0.7, 0.85, 0.95), 2.0
DISCOUNT = 0.98  # weight of older spans per new one (about 50 spans of memory per class)
FADE = 0.97  # weight kept per span a class's rate withheld: after a few dozen it is tried again
POSITION_BITS = 32  # an occurrence: (sequence id << POSITION_BITS) | the position its n-gram ends at

_TOKEN_BYTES = array("i").itemsize
_ENTRY_BYTES = array("q").itemsize
_KEY_BYTES = sys.getsizeof(hash((1 << 40,) * MIN_MATCH)) + sys.getsizeof(array("q", [0]))  # a key, its first entry
_SEQUENCE_BYTES = sys.getsizeof(array("i"))  # + the sequence object (its slots)


@dataclass
class Continuation:
    """A span the index proposes: its tokens, the probability that each is reached accepted (the product of
    its and the earlier tokens' probabilities), the depth of the match it follows and the sequences it came
    from."""

    tokens: list[int]
    reach: list[float]
    depth: int
    sequences: tuple[int, ...]


class _Sequence:
    __slots__ = ("tokens", "stamp", "used")

    def __init__(self, tokens: list[int], stamp: int):
        self.tokens = array("i", tokens)
        self.stamp = stamp  # when it was last used, on the index's clock (ties go to the most recent)
        self.used = time.monotonic()  # the same in seconds (`oldest`: a memory budget's LRU order)


_SEQUENCE_BYTES += sys.getsizeof(_Sequence([], 0))


def _depth(tokens: array, end: int, pattern: array) -> int:
    """How many tokens of `pattern` match those of `tokens` ending at `end` (0: not MIN_MATCH of them)."""
    n = len(pattern)
    if tokens[end - MIN_MATCH + 1 : end + 1] != pattern[n - MIN_MATCH :]:
        return 0  # (a hash collision)
    low, high = MIN_MATCH, min(n, end + 1)
    while low < high:  # a match of length k is one of every shorter length: the longest by bisection
        mid = (low + high + 1) // 2
        if tokens[end - mid + 1 : end + 1] == pattern[n - mid :]:
            low = mid
        else:
            high = mid - 1
    return low


def _depth_class(depth: int) -> int:
    return sum(depth >= low for low in DEPTH_CLASSES) - 1


class SuffixIndex:
    """What generations produced, shared by every generation given it (see the module docstring).

    `max_tokens`: the budget in tokens (the sequences' prompt tokens included); the least recently used
    sequences (recorded or drafted from) are evicted to stay within it. `private`: the index of one
    conversation (a server's ``--suffix-scope conversation``), which its session holds, counts in its
    bytes and copies with it, and replaces with an empty one for a prompt of another conversation
    (`session.Session.span_sources`).
    """

    def __init__(self, max_tokens: int = DEFAULT_TOKENS, *, private: bool = False):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1 (no index: no suffix drafting), got {max_tokens!r}.")
        self.max_tokens = max_tokens
        self.private = private
        self._lock = threading.Lock()
        self._sequences: OrderedDict[int, _Sequence] = OrderedDict()  # least recently used first
        self._grams: dict[int, array] = {}  # hash of an n-gram -> its occurrences, oldest first
        self._next_id = self._clock = 0
        self._held = self._entries = 0  # tokens held, occurrences indexed
        self._rates = [[0.0, 0.0] for _ in DEPTH_CLASSES]  # per depth class: discounted (accepted, reached)

    def __len__(self) -> int:
        return len(self._sequences)

    def copy(self) -> SuffixIndex:
        """An independent index holding the same (a conversation's, when its session is copied)."""
        other = SuffixIndex(self.max_tokens, private=self.private)
        with self._lock:
            for sid, sequence in self._sequences.items():
                copied = other._sequences[sid] = _Sequence(sequence.tokens.tolist(), sequence.stamp)
                copied.used = sequence.used
            other._grams = {key: array("q", entries) for key, entries in self._grams.items()}
            other._next_id, other._clock = self._next_id, self._clock
            other._held, other._entries = self._held, self._entries
            other._rates = [list(counts) for counts in self._rates]
        return other

    @property
    def tokens(self) -> int:
        """The tokens it holds (at most `max_tokens`)."""
        return self._held

    @property
    def nbytes(self) -> int:
        """Bytes of what it holds: its tables, occurrences and sequences (read without the lock: cheap)."""
        keys = len(self._grams)
        return (
            sys.getsizeof(self._grams)
            + sys.getsizeof(self._sequences)
            + keys * _KEY_BYTES
            + (self._entries - keys) * _ENTRY_BYTES
            + self._held * _TOKEN_BYTES
            + len(self._sequences) * _SEQUENCE_BYTES
        )

    # -- recording --------------------------------------------------------------------------------

    def begin(self, context: list[int]) -> int:
        """A new sequence, starting with the last MAX_MATCH tokens of `context` (a prompt); its id."""
        with self._lock:
            sid, self._next_id = self._next_id, self._next_id + 1
            sequence = _Sequence(list(context[-MAX_MATCH:]), self._tick())
            self._sequences[sid] = sequence
            self._held += len(sequence.tokens)
            self._index(sid, sequence.tokens, 0)
            self._evict()
            return sid

    def extend(self, sid: int, tokens: list[int]) -> None:
        """Append committed tokens to sequence `sid` (nothing once it was evicted)."""
        with self._lock:
            sequence = self._sequences.get(sid)
            if sequence is None or not tokens:
                return
            start = len(sequence.tokens) - 1  # the n-gram ending there now has a continuation
            sequence.tokens.extend(tokens)
            self._held += len(tokens)
            self._index(sid, sequence.tokens, start)
            self._touch(sid)
            self._evict()

    def _index(self, sid: int, tokens: array, start: int) -> None:
        """Index the n-grams of `tokens` ending at `start` and after that have a continuation."""
        grams, base = self._grams, sid << POSITION_BITS
        for end in range(max(start, MIN_MATCH - 1), len(tokens) - 1):
            key = hash(tuple(tokens[end - MIN_MATCH + 1 : end + 1]))
            entries = grams.get(key)
            if entries is None:
                grams[key] = array("q", [base | end])
            else:
                entries.append(base | end)
                if len(entries) > MAX_OCCURRENCES:
                    del entries[0]
                    self._entries -= 1
            self._entries += 1

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, sid: int) -> None:
        sequence = self._sequences.get(sid)
        if sequence is not None:
            self._sequences.move_to_end(sid)
            sequence.stamp, sequence.used = self._tick(), time.monotonic()

    def _evict(self) -> None:
        """Drop least recently used sequences until the budget holds (the one growing last: alone over it)."""
        while self._held > self.max_tokens:
            self._drop(next(iter(self._sequences)))

    def _drop(self, sid: int) -> None:
        sequence = self._sequences.pop(sid)
        tokens, grams = sequence.tokens, self._grams
        self._held -= len(tokens)
        for end in range(MIN_MATCH - 1, len(tokens) - 1):
            key = hash(tuple(tokens[end - MIN_MATCH + 1 : end + 1]))
            entries = grams.get(key)
            if entries is None:
                continue
            kept = array("q", [e for e in entries if e >> POSITION_BITS != sid])
            self._entries -= len(entries) - len(kept)
            if kept:
                grams[key] = kept
            else:
                del grams[key]

    def oldest(self) -> float | None:
        """When the least recently used sequence was last used (`time.monotonic()`), None when empty."""
        with self._lock:
            first = next(iter(self._sequences.values()), None)
            return first.used if first is not None else None

    def evict_oldest(self) -> None:
        """Drop the least recently used sequence (a memory budget making room)."""
        with self._lock:
            if self._sequences:
                self._drop(next(iter(self._sequences)))

    # -- drafting ---------------------------------------------------------------------------------

    def lookup(self, pattern: list[int], limit: int) -> Continuation | None:
        """The best span of at most `limit` tokens to follow `pattern` (a sequence's last tokens), or None."""
        if limit < 1 or len(pattern) < MIN_MATCH:
            return None
        pattern = array("i", pattern[-MAX_MATCH:])
        key = hash(tuple(pattern[len(pattern) - MIN_MATCH :]))
        with self._lock:
            entries = self._grams.get(key)
            if not entries:
                return None
            found = []
            for packed in entries:
                sid, end = packed >> POSITION_BITS, packed & ((1 << POSITION_BITS) - 1)
                sequence = self._sequences[sid]
                depth = _depth(sequence.tokens, end, pattern)
                if depth:
                    found.append((depth, (sequence, end, sid)))
            best = None
            for depth in sorted({d for d, _ in found}, reverse=True):
                cap = min(limit, math.ceil(SPAN_FACTOR * depth))
                node = [occurrence for d, occurrence in found if d >= depth]
                reach, tokens, sources = self._walk(node, cap, self._rate(depth))
                if not tokens and self._walk(node, 1, 1.0)[1]:
                    self._fade(depth)  # the frequencies would draft here: only the rate withheld it
                if tokens and (best is None or sum(reach) > sum(best[0])):  # expected accepted tokens
                    best = (reach, tokens, depth, sources)
            if best is None:
                return None
            return Continuation(best[1], best[0], best[2], tuple({sid for _, _, sid in best[3]}))

    @staticmethod
    def _walk(node: list, cap: int, rate: float) -> tuple[list[float], list[int], list]:
        """The continuation the occurrences `node` ((sequence, end, id) triples) agree on most, at most
        `cap` tokens: (each token's probability of being reached accepted, the tokens, the occurrences that
        hold all of them)."""
        tokens, reach = [], []
        while len(tokens) < cap:
            at = len(tokens) + 1
            votes: dict[int, list] = {}
            for sequence, end, _ in node:
                if end + at < len(sequence.tokens):
                    vote = votes.setdefault(sequence.tokens[end + at], [0, 0])
                    vote[0] += 1
                    vote[1] = max(vote[1], sequence.stamp)
            if not votes:
                break
            token, (count, _) = max(votes.items(), key=lambda item: item[1])
            p = (reach[-1] if reach else 1.0) * rate * count / sum(v[0] for v in votes.values())
            if p < MIN_PROB:
                break
            node = [o for o in node if o[1] + at < len(o[0].tokens) and o[0].tokens[o[1] + at] == token]
            tokens.append(token)
            reach.append(p)
        return reach, tokens, node

    def used(self, sequences: tuple[int, ...]) -> None:
        """A span from `sequences` is being verified: they are the most recently used."""
        with self._lock:
            for sid in sequences:
                self._touch(sid)

    # -- what its spans' acceptance teaches it ----------------------------------------------------

    def _rate(self, depth: int) -> float:
        """The acceptance per token learnt for spans from matches `depth` deep."""
        k = _depth_class(depth)
        accepted, reached = self._rates[k]
        return (accepted + PRIOR_WEIGHT * PRIOR_RATES[k]) / (reached + PRIOR_WEIGHT)

    def _fade(self, depth: int) -> None:
        counts = self._rates[_depth_class(depth)]
        counts[0] *= FADE
        counts[1] *= FADE

    def observe(self, depth: int, drafted: int, accepted: int) -> None:
        """A span of `drafted` tokens from a match `depth` deep had its first `accepted` accepted."""
        with self._lock:
            counts = self._rates[_depth_class(depth)]
            counts[0] = counts[0] * DISCOUNT + accepted
            counts[1] = counts[1] * DISCOUNT + min(drafted, accepted + 1)


class SuffixProposer:
    """One generation's span source over a shared `SuffixIndex` (`proposers.base`), named "suffix".

    `start(target, prompt)` begins the generation's sequence in the index,
    `commit(tokens)` records each cycle's tokens (and, after a cycle that
    verified its span, how much of it was accepted); `offer(count)` is the
    index's span after the sequence's end (0: none), asked
    once per length of the sequence; `propose` gives it as point masses.
    """

    name = "suffix"
    layer_ids: tuple[int, ...] = ()  # it reads none of the target's hidden states
    block_size = MAX_MATCH + 1  # (a hint only: its spans are as long as the verify allows)

    def __init__(self, index: SuffixIndex):
        self.index = index
        self._sequence = -1
        self._tail: list[int] = []  # the sequence's last MAX_MATCH tokens
        self._length = 0  # the sequence's length (prompt included)
        self._span: tuple[int, int, Continuation | None] | None = None  # (length, limit asked, its span)
        self._proposed: tuple[int, list[int]] | None = None  # (depth, tokens) of the span being verified

    def start(self, target, prompt, reused: int = 0) -> None:
        tokens = prompt.tolist() if isinstance(prompt, mx.array) else list(prompt)
        self._sequence = self.index.begin(tokens)
        self._tail, self._length = tokens[-MAX_MATCH:], len(tokens)
        self._span = self._proposed = None

    def add_context(self, features) -> None:
        pass

    def state(self) -> list:
        return []

    def commit(self, tokens: list[int]) -> None:
        if self._proposed is not None:
            depth, span = self._proposed
            accepted = 0
            while accepted < min(len(span), len(tokens)) and span[accepted] == tokens[accepted]:
                accepted += 1
            self.index.observe(depth, len(span), accepted)
            self._proposed = None
        self.index.extend(self._sequence, tokens)
        self._tail = (self._tail + list(tokens))[-MAX_MATCH:]
        self._length += len(tokens)

    def _continuation(self, count: int) -> Continuation | None:
        """The index's span after the sequence's end, asked once per length (a shorter limit's span is a
        prefix of a longer one's)."""
        if self._span is None or self._span[0] != self._length or self._span[1] < count:
            self._span = (self._length, count, self.index.lookup(self._tail, count))
        return self._span[2]

    def offer(self, count: int) -> int:
        if count < 1:
            return 0
        found = self._continuation(count)
        return min(count, len(found.tokens)) if found is not None else 0

    def expected_tokens(self, widest: int) -> list[float]:
        """[E(1), ..., E(widest)]: what a cycle verifying the anchor and w - 1 tokens of its span is expected
        to commit, by the index's probabilities (its entry's estimate in `policy.adaptive`,
        `estimate.SpanOdds`)."""
        found = self._continuation(widest - 1) if widest > 1 else None
        reach = found.reach if found is not None else []
        return [1.0 + sum(reach[: w - 1]) for w in range(1, widest + 1)]

    def propose(self, anchor, position: int, count: int, *, sampling=None, key=None) -> Proposal:
        """The span after the anchor (the sequence's last token, committed): point masses."""
        found = self._continuation(count)
        span = found.tokens[:count] if found is not None else []
        if span:
            self._proposed = (found.depth, span)
            self.index.used(found.sequences)
        return Proposal(tokens=mx.array(span, mx.int32))
