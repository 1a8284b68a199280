"""The lookup index of copy-aware drafting: longest earlier suffix match, most recent first, incremental."""

from __future__ import annotations

import random

import pytest

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
