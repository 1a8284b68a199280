"""The suffix index across requests: what it proposes (frequency, recency, depth), its budget, its bytes, threads."""

from __future__ import annotations

import math
import random
import threading
import tracemalloc

import pytest

from dflash_mlx import SuffixIndex, make_session
from dflash_mlx.proposers import suffix as sx
from dflash_mlx.proposers.suffix import SuffixProposer


def _generation(index: SuffixIndex, prompt: list[int], reply: list[int]) -> SuffixProposer:
    source = SuffixProposer(index)
    source.start(None, prompt)
    if reply:
        source.commit(reply)
    return source


def _spans(source: SuffixProposer, count: int) -> list[int]:
    return source.propose(None, 0, source.offer(count), sampling=None).tokens.tolist() if source.offer(count) else []


def test_a_later_generation_drafts_what_an_earlier_one_produced():
    index = SuffixIndex()
    prompt, reply = list(range(100, 140)), list(range(500, 560))
    first = _generation(index, prompt, [])
    assert first.offer(8) == 0  # nothing recorded yet
    first.commit(reply)
    again = _generation(index, [7, 8, 9] + prompt, [])  # another conversation ending alike
    assert _spans(again, 8) == reply[:8]
    assert _spans(again, 40) == reply[:32]  # a match 32 deep: at most 32 tokens (SPAN_FACTOR)
    # a match 5 deep: at most 5 tokens, and the prior acceptance of such matches (0.5 a token) trusts a fresh
    # index for 3 (0.5 ** 3 > MIN_PROB > 0.5 ** 4)
    assert _spans(_generation(index, [1, 2, 3] + prompt[-5:], []), 8) == reply[:3]
    assert _spans(_generation(index, [1, 2, 3] + prompt[-12:], []), 40) == reply[:6]  # 12 deep: 0.7 ** 6 > 0.1
    assert _generation(index, [1, 2] + prompt[-3:], []).offer(8) == 0  # shorter than MIN_MATCH: no draft


def test_the_most_frequent_continuation_wins_then_the_most_recent():
    context = [9, 9, 1, 2, 3, 4]
    index = SuffixIndex()
    for tail in ([5, 6], [7, 8], [5, 6]):
        _generation(index, [], context + tail)
    assert _generation(index, [0] + context, []).offer(1) == 1
    source = _generation(index, [0] + context, [])
    # 2 of 3 occurrences say 5: probability 0.5 * 2/3 (a match 6 deep); then 6 (both left agree)
    assert _spans(source, 2) == [5, 6]
    index = SuffixIndex()
    for tail in ([5, 6], [7, 8]):
        _generation(index, [], context + tail)
    assert _spans(_generation(index, [0] + context, []), 1) == [7]  # a tie: the most recently used sequence
    older = index.lookup([0] + context, 1)
    index.used(tuple(sid for sid in range(2) if sid not in older.sequences))  # the other one used since
    assert _spans(_generation(index, [0] + context, []), 1) == [5]


def _brute_force(sequences: list[list[int]], pattern: list[int], limit: int) -> tuple[list[int], int]:
    """What the index should propose after `pattern` (a fresh index: every depth class at its prior rate; the
    sequences recorded one after another, so insertion order is theirs and recency their order)."""
    key = pattern[-sx.MIN_MATCH :]
    occurrences = [
        (k, end)
        for k, seq in enumerate(sequences)
        for end in range(sx.MIN_MATCH - 1, len(seq) - 1)
        if seq[end - sx.MIN_MATCH + 1 : end + 1] == key
    ][-sx.MAX_OCCURRENCES :]
    found = []
    for k, end in occurrences:
        seq, depth = sequences[k], 0
        while depth < min(len(pattern), sx.MAX_MATCH, end + 1) and seq[end - depth] == pattern[-1 - depth]:
            depth += 1
        found.append((depth, k, end))
    best = ([], 0, -1.0)
    for depth in sorted({d for d, _, _ in found}, reverse=True):
        node = [(k, end) for d, k, end in found if d >= depth]
        tokens, reach, expected = [], 1.0, 0.0
        while len(tokens) < min(limit, math.ceil(sx.SPAN_FACTOR * depth)):
            at = len(tokens) + 1
            nexts = [(sequences[k][end + at], k) for k, end in node if end + at < len(sequences[k])]
            if not nexts:
                break
            counts = {t: sum(1 for u, _ in nexts if u == t) for t, _ in nexts}
            token = max(counts, key=lambda t: (counts[t], max(k for u, k in nexts if u == t)))
            rate = sx.PRIOR_RATES[max(k for k, low in enumerate(sx.DEPTH_CLASSES) if depth >= low)]
            p = reach * rate * counts[token] / len(nexts)
            if p < sx.MIN_PROB:
                break
            node = [(k, end) for k, end in node if end + at < len(sequences[k]) and sequences[k][end + at] == token]
            tokens.append(token)
            reach, expected = p, expected + p
        if tokens and expected > best[2]:
            best = (tokens, depth, expected)
    return best[0], best[1]


@pytest.mark.parametrize("seed", range(4))
def test_lookups_equal_a_brute_force_search(seed):
    rng = random.Random(seed)
    sequences = [[rng.randrange(3) for _ in range(rng.randrange(10, 60))] for _ in range(12)]  # many matches
    index = SuffixIndex()
    for seq in sequences:
        source = SuffixProposer(index)
        source.start(None, seq[: sx.MAX_MATCH])
        for k in range(sx.MAX_MATCH, len(seq), 3):  # (committed a few tokens at a time)
            source.commit(seq[k : k + 3])
    for _ in range(60):
        pattern = [rng.randrange(3) for _ in range(rng.randrange(4, 40))]
        found = index.lookup(pattern, 12)
        want, depth = _brute_force(sequences, pattern, 12)
        assert (found.tokens, found.depth) == (want, depth) if found else want == [], pattern


def test_acceptance_per_depth_withholds_spans_then_fades_back():
    """Spans from shallow matches that the target keeps rejecting stop being offered; deep ones still are;
    after enough withheld lookups the shallow class is tried again."""
    index = SuffixIndex()
    _generation(index, [], [1, 2, 3, 4, 5, 6] + list(range(200, 240)))
    shallow = [9, 3, 4, 5, 6]  # a 4-token match
    deep = [1, 2, 3, 4, 5, 6] + list(range(200, 220))
    for _ in range(40):
        index.observe(4, 4, 0)  # every shallow span rejected at its first token
    assert index.lookup(shallow, 8) is None
    assert index.lookup(deep, 8).tokens == list(range(220, 228))
    withheld = 0
    while index.lookup(shallow, 8) is None:
        withheld += 1
        assert withheld < 200
    assert withheld > 10


def test_it_never_exceeds_its_budget_under_a_soak_of_distinct_requests():
    """Distinct requests far beyond the budget: the tokens held never exceed it, its bytes level off, and
    the least recently used sequences go first (a sequence drafted from lately stays)."""
    budget = 3000
    index = SuffixIndex(budget)
    rng = random.Random(0)
    kept = _generation(index, list(range(1000, 1040)), list(range(2000, 2100)))
    sizes = []
    for n in range(400):
        source = _generation(index, [rng.randrange(50_000) for _ in range(60)], [])
        for _ in range(4):
            source.commit([rng.randrange(50_000) for _ in range(rng.randrange(1, 40))])
            assert index.tokens <= budget
        if n % 20 == 0:  # the kept conversation is drafted from now and then
            again = _generation(index, list(range(1000, 1040)), [])
            assert again.offer(4) == 4 and _spans(again, 4) == [2000, 2001, 2002, 2003]
        sizes.append(index.nbytes)
    assert index.tokens > budget * 0.9 and len(index) < 60
    # its bytes level off once it is full (its hash table is resized as keys come and go: a band, no growth)
    assert max(sizes[100:]) < 1.5 * sizes[50]
    assert kept.index is index and _spans(_generation(index, list(range(1000, 1040)), []), 2) == [2000, 2001]
    assert index.oldest() is not None
    while len(index):
        index.evict_oldest()
    assert index.tokens == 0 and index._entries == 0 and not index._grams and index.oldest() is None


def test_its_byte_count_is_the_memory_it_holds():
    """`nbytes` (counted as entries come in) against what Python allocated for the index (tracemalloc)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(100_000) for _ in range(40)] for _ in range(30)]
    replies = [[rng.randrange(100_000) for _ in range(200)] for _ in range(30)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index = SuffixIndex(1_000_000)
    for prompt, reply in zip(prompts, replies):
        source = _generation(index, prompt, [])
        for k in range(0, len(reply), 5):
            source.commit(reply[k : k + 5])
        del source
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    held = sum(stat.size_diff for stat in after.compare_to(before, "filename") if stat.size_diff > 0)
    assert 0.75 * held < index.nbytes < 1.25 * held, (index.nbytes, held)


def test_threads_share_it():
    """Threads recording and drafting at once leave it consistent and within its budget."""
    index = SuffixIndex(5000)
    shared = list(range(300, 340))
    errors = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                source = _generation(index, shared[: rng.randrange(10, 40)], [])
                for _ in range(10):
                    if source.offer(6):
                        source.propose(None, 0, 6)
                    source.commit([rng.randrange(20) for _ in range(rng.randrange(1, 8))])
                    assert index.tokens <= 5000
        except Exception as e:  # (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert index.tokens == sum(len(s.tokens) for s in index._sequences.values())
    assert index._entries == sum(len(entries) for entries in index._grams.values())
    for key, entries in index._grams.items():
        for packed in entries:
            tokens = index._sequences[packed >> sx.POSITION_BITS].tokens
            end = packed & ((1 << sx.POSITION_BITS) - 1)
            assert end + 1 < len(tokens) and hash(tuple(tokens[end - sx.MIN_MATCH + 1 : end + 1])) == key


def test_a_copy_is_independent():
    """A conversation's index copied with its session: the same spans, then each goes its own way."""
    index = SuffixIndex(500, private=True)
    _generation(index, list(range(40)), list(range(100, 140)))
    other = index.copy()
    assert other.private and other.nbytes == index.nbytes and other.tokens == index.tokens
    assert other.lookup(list(range(40)), 6).tokens == index.lookup(list(range(40)), 6).tokens == list(range(100, 106))
    _generation(other, list(range(40)), list(range(200, 500)))  # (a tie with the first: the most recent wins)
    assert other.lookup(list(range(40)), 6).tokens == list(range(200, 206)) and other.tokens == 404
    assert index.lookup(list(range(40)), 6).tokens == list(range(100, 106)) and index.tokens == 72


def test_bad_arguments_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SuffixIndex(0)
    with pytest.raises(ValueError, match="suffix_index must be a dflash_mlx.SuffixIndex"):
        make_session(None, None, suffix_index=1000)


def test_the_policy_weighs_a_span_by_the_index_odds():
    """The policy's entry for the suffix proposer takes the index's own expected tokens (`SpanOdds`), and
    a probe's hope floors each position's rate without lowering a better one."""
    from dflash_mlx.policy.adaptive import AdaptiveBlock
    from dflash_mlx.policy.cost import CostTable
    from dflash_mlx.policy.estimate import SpanOdds

    index = SuffixIndex()
    first = SuffixProposer(index)
    first.start(None, [1, 2, 3])
    first.commit(list(range(10, 40)))
    again = SuffixProposer(index)
    again.start(None, [1, 2, 3])
    again.commit(list(range(10, 16)))
    policy = AdaptiveBlock(CostTable.curve(range(1, 9), [1.0] * 8), 8)
    entry = policy.span_source("suffix", again.expected_tokens)
    assert isinstance(entry.estimate, SpanOdds)
    assert entry.expected(8) == pytest.approx(again.expected_tokens(8)[-1])
    assert entry.expected(8) > 2.5  # (a 9-token match: its depth class's prior, 0.7 a token)
    odds = SpanOdds(lambda w: [1.0, 1.9, 2.5, 2.8][:w])
    assert odds.expected_tokens(4) == pytest.approx([1.0, 1.9, 2.5, 2.8])
    assert odds.expected_tokens(4, floor=0.8) == pytest.approx([1.0, 1.9, 1.9 + 0.9 * 0.8, 1.9 + 0.72 + 0.72 * 0.8])
    assert odds.expected_tokens(6)[-1] == pytest.approx(2.8)  # (nothing past the span)
