"""The lookup index of copy-aware drafting: longest earlier suffix match, most recent first, incremental."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from dflash_mlx import make_session
from dflash_mlx.proposers.lookup import LookupIndex


def _brute_force(tokens: list[int], limit: int, low: int, high: int) -> list[int]:
    """What the longest earlier occurrence of a suffix (most recent first) was followed by, copied on
    through what is proposed once it reaches the end (the overlapping copy)."""
    for n in range(min(high, len(tokens)), low - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                extended = list(tokens)
                for i in range(end + 1, end + 1 + limit):
                    extended.append(extended[i])
                return extended[end + 1 : end + 1 + limit]
    return []


def test_it_proposes_what_followed_the_longest_earlier_match():
    index = LookupIndex([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert index.propose(7) == [4, 5, 6, 7, 1, 2, 3]
    assert index.propose(2) == [4, 5]
    index.extend([4])
    assert index.match()[0] == 4 and index.propose(3) == [5, 6, 7]
    index.extend([9])
    assert index.propose(3) == []  # no suffix of 3 tokens occurred before


@pytest.mark.parametrize("seed", range(5))
def test_incremental_extension_equals_a_brute_force_search(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(300)]  # a small alphabet: many matches
    index = LookupIndex(tokens[:10])
    for k in range(10, len(tokens)):
        assert index.propose(6) == _brute_force(tokens[:k], 6, 3, 8), k
        index.extend([tokens[k]])


def test_truncate_forgets_what_was_cut():
    index = LookupIndex([1, 2, 3, 4, 1, 2, 3])
    assert index.propose(1) == [4]
    index.truncate(5)
    assert index.tokens == [1, 2, 3, 4, 1] and index.propose(1) == []
    with pytest.raises(ValueError, match="min_match"):
        LookupIndex(min_match=0)


def test_a_continuation_that_reaches_the_end_copies_on():
    index = LookupIndex([7, 1, 2, 3, 1, 2, 3])
    assert index.propose(8) == [1, 2, 3, 1, 2, 3, 1, 2]  # the period repeats


def _same_index(index: LookupIndex, fresh: LookupIndex) -> None:
    """The same table and chains as a fresh build, and so the same proposals."""
    assert index.tokens == fresh.tokens
    assert index._ends == fresh._ends
    assert [list(b) for b in index._before] == [list(b) for b in fresh._before]
    for limit in (1, 4, 9):
        assert index.propose(limit) == fresh.propose(limit)


@pytest.mark.parametrize("seed", range(6))
def test_a_trimmed_index_proposes_what_a_fresh_one_of_the_kept_tokens_does(seed):
    """Cut back in place (an occurrence past the cut falls back to an earlier one or goes), then grown again:
    at every length the proposals (and the table) are those of an index built from scratch."""
    rng = random.Random(seed)
    alphabet = 3 + seed  # small alphabets: n-grams recur, so cut occurrences have earlier ones to fall back to
    index = LookupIndex([rng.randrange(alphabet) for _ in range(300)])
    for _ in range(8):
        index.truncate(rng.randrange(0, len(index) + 2))
        _same_index(index, LookupIndex(index.tokens))
        for _ in range(rng.randrange(1, 40)):
            index.extend([rng.randrange(alphabet)])
            assert index.propose(6) == _brute_force(index.tokens, 6, 3, 8)
        _same_index(index, LookupIndex(index.tokens))


def test_follow_and_copy_keep_the_index_exact():
    rng = random.Random(7)
    tokens = [rng.randrange(4) for _ in range(200)]
    index = LookupIndex(tokens)
    other = tokens[:120] + [rng.randrange(4) for _ in range(50)]  # a conversation edited at token 120
    index.follow(other)
    _same_index(index, LookupIndex(other))
    copy = index.copy()
    copy.extend([1, 2, 3])
    _same_index(index, LookupIndex(other))  # the copy is its own
    _same_index(copy, LookupIndex(other + [1, 2, 3]))


@pytest.mark.parametrize("vocab", [150_000, 40])
def test_nbytes_is_within_a_fifth_of_what_the_index_allocates(vocab):
    """tracemalloc's count of what building the index allocated (its table, tuples, positions, tokens and
    chains) against `nbytes`: text of a large vocabulary (no n-gram repeats) and a repetitive one."""
    rng = random.Random(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tokens = [rng.randrange(257, 257 + vocab) for _ in range(20_000)]  # (ids beyond the cached small ints)
        index = LookupIndex(tokens)
        del tokens
        built = index.nbytes, tracemalloc.get_traced_memory()[0] - before
        index.truncate(12_000)  # (in place: the table keeps its size, the rest shrinks)
        trimmed = index.nbytes, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    for counted, allocated in (built, trimmed):
        assert abs(counted - allocated) <= 0.2 * allocated, (counted, allocated)


def test_a_sessions_bytes_count_its_lookup_index(tiny_pair):
    """`Session.nbytes` grows by what building its lookup index allocates (tracemalloc, within a fifth)."""
    model, _, draft = tiny_pair("qwen3")
    session = make_session(model, draft)
    rng, bare = random.Random(1), session.nbytes
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        prompt = [rng.randrange(257, 4096) for _ in range(8_000)]  # (its ids: the index's to keep)
        session.lookup_source(prompt)
        del prompt
        allocated = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert abs((session.nbytes - bare) - allocated) <= 0.2 * allocated, (session.nbytes - bare, allocated)
    assert session.copy().nbytes - bare > 0.8 * allocated  # a copied conversation keeps (and counts) its index


def test_tokens_appended_are_indexed_when_the_index_is_next_read():
    """`extend` only queues its tokens (a rested span source is not read for many cycles: their indexing then
    runs in one call); every read sees them: spans, the tokens, a copy, a cut, the bytes."""
    rng = random.Random(5)
    tokens = [rng.randrange(6) for _ in range(400)]
    eager = LookupIndex(tokens)
    lazy = LookupIndex(tokens[:50])
    for i in range(50, 400, 7):
        lazy.extend(tokens[i : i + 7])
        assert len(lazy) == min(i + 7, 400)
    assert lazy._waiting and lazy.nbytes == eager.nbytes and not lazy._waiting
    lazy.extend(tokens[:30])
    copied = lazy.copy()
    assert copied.tokens == lazy.tokens == tokens + tokens[:30]
    lazy.extend([1, 2, 3])
    lazy.truncate(400)  # (cut back past what waited)
    assert lazy.tokens == tokens and lazy._ends == eager._ends and lazy.propose(8) == eager.propose(8)
