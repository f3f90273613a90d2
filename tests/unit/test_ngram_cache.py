"""The n-gram cache of earlier outputs on its own: a lookup finds the longest suffix whose last two continuations
agreed and drafts what they agreed on, the cache never holds more than its capacity and evicts the least recently used
n-grams, and the same calls give the same drafts."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.ngram_cache import NgramCache


def test_a_lookup_drafts_what_the_last_two_continuations_of_the_longest_suffix_agreed_on() -> None:
    cache = NgramCache(capacity=100, max_ngram=3, max_continuation=4)
    cache.insert([1, 2, 3, 4, 5, 6], 0, 6)
    assert cache.lookup([1, 2, 3], 8) == (0, [])  # seen once: a guess, not drafted
    cache.insert([1, 2, 3, 4, 5, 9], 0, 6)  # (1, 2, 3) and (2, 3) went on with 4 5 both times
    cache.insert([9, 3, 7, 8], 0, 4)  # (3,) was followed by 7 8 after 4 5 6: they parted at once
    assert cache.lookup([0, 2, 3], 8) == (2, [4, 5])
    assert cache.lookup([1, 2, 3], 1) == (3, [4])  # at most max_tokens
    assert cache.lookup([0, 0, 3], 8) == (0, [])
    assert cache.lookup([1, 2, 3], 0) == (0, [])
    cache.insert([1, 2, 3, 4, 5, 6], 0, 6)  # 4 5 9 then 4 5 6: they agree on 4 5 again
    assert cache.lookup([1, 2, 3], 8) == (3, [4, 5])


def test_a_longer_suffix_that_parted_gives_way_to_a_shorter_one_that_agreed() -> None:
    cache = NgramCache(capacity=100, max_ngram=2, max_continuation=2)
    cache.insert([5, 1, 2, 3], 0, 4)
    cache.insert([6, 1, 2, 3], 0, 4)  # (1,) -> 2 3 twice; (6, 1) seen once
    assert cache.lookup([6, 1], 8) == (1, [2, 3])


def test_continuations_are_at_most_max_continuation_long_and_positions_outside_the_range_are_not_taken() -> None:
    cache = NgramCache(capacity=100, max_ngram=2, max_continuation=2)
    for _ in range(2):  # positions 2 and 3: what follows (10, 11) / (11,) and (11, 12) / (12,)
        cache.insert([10, 11, 12, 13, 14, 15], 2, 4)
    assert cache.lookup([10, 11], 8) == (2, [12, 13])
    assert cache.lookup([12], 8) == (1, [13, 14])
    assert cache.lookup([10], 8) == (0, [])  # position 1: before the range
    assert cache.lookup([13], 8) == (0, [])  # position 4: after it
    assert len(cache) == 4


def test_the_least_recently_used_n_grams_are_evicted_first() -> None:
    cache = NgramCache(capacity=3, max_ngram=1, max_continuation=1)
    for _ in range(2):
        cache.insert([1, 2, 3, 4], 0, 4)  # (1,) -> 2, (2,) -> 3, (3,) -> 4
    assert cache.lookup([1], 1) == (1, [2])  # (1,) is now the most recently used
    cache.insert([5, 6, 5, 6], 0, 4)  # (5,) -> 6 twice, (6,) -> 5: evict (2,) and (3,), the least recently used
    assert len(cache) == 3
    assert cache.lookup([2], 1) == (0, [])
    assert cache.lookup([3], 1) == (0, [])
    assert cache.lookup([1], 1) == (1, [2])
    assert cache.lookup([5], 1) == (1, [6])


@pytest.mark.parametrize(
    "settings_",
    [{"capacity": 0, "max_ngram": 2, "max_continuation": 2}, {"capacity": 8, "max_ngram": 0, "max_continuation": 2}],
)
def test_a_cache_that_could_hold_nothing_is_refused(settings_: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        NgramCache(**settings_)


token_lists = st.lists(st.lists(st.integers(0, 5), max_size=30), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(outputs=token_lists, capacity=st.integers(1, 40), context=st.lists(st.integers(0, 5), min_size=1, max_size=5))
def test_the_cache_never_outgrows_its_capacity_and_the_same_calls_give_the_same_drafts(
    outputs: list[list[int]], capacity: int, context: list[int]
) -> None:
    caches = [NgramCache(capacity, max_ngram=3, max_continuation=4) for _ in range(2)]
    for cache in caches:
        for tokens in outputs:
            cache.insert(tokens, 0, len(tokens))
            assert len(cache) <= capacity
    assert caches[0].lookup(context, 4) == caches[1].lookup(context, 4)


@settings(max_examples=60, deadline=None)
@given(outputs=token_lists, context=st.lists(st.integers(0, 5), min_size=1, max_size=5))
def test_with_room_for_everything_a_lookup_is_what_the_last_two_followers_agreed_on(
    outputs: list[list[int]], context: list[int]
) -> None:
    cache = NgramCache(capacity=10_000, max_ngram=3, max_continuation=4)
    for tokens in outputs:
        cache.insert(tokens, 0, len(tokens))
    expected: tuple[int, list[int]] = (0, [])
    for n in range(min(3, len(context)), 0, -1):
        suffix = context[-n:]
        followers = [
            tokens[position : position + 4]
            for tokens in outputs
            for position in range(n, len(tokens))
            if tokens[position - n : position] == suffix
        ]
        if len(followers) < 2:
            continue
        agreed = list(
            itertools.takewhile(lambda pair: pair[0] == pair[1], zip(followers[-2], followers[-1], strict=False))
        )
        if agreed:
            expected = (n, [token for token, _ in agreed])
            break
    assert cache.lookup(context, 4) == expected
